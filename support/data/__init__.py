"""How rows of a dataset become token ids: the readers and the held-out split, the tokenizer and chat templates, the
token cache on disk, and the preview of what the model will see. docs/support.md explains each file at length."""
