"""How a model is judged: generation, the sandbox for model-written code, HumanEval pass@1, the merge check.
docs/support.md explains each file at length."""
