"""How much memory and compute a run takes: the memory estimate and the measured peak, what fits a GPU (--plan), the
micro-batch size, model FLOPs and MFU. docs/support.md explains each file at length."""
