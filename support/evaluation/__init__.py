"""How a model is judged: batched generation, the sandbox that runs model-written code (and the kernel confinement it
applies), HumanEval pass@1, and the check of a merged export."""
