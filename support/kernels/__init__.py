"""Which kernel computes a technique's step on this device (packed-document attention, LoRA's keyed dropout, NF4
dequantization, long rows), and in which dtype: chosen once, when a model is built. docs/support.md explains each
file at length."""
