"""How models, adapters and files are read and written: Hugging Face checkpoints and PEFT adapters, config.json, GGUF
both ways, the Hub, and the one crash-safe write every writer uses. docs/support.md explains each
file at length."""
