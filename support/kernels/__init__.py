"""Which kernel computes a technique's step on this device, and in which dtype: packed-document attention, LoRA's
keyed dropout, NF4 dequantization, long rows (tiled MLP, offloaded checkpoints), the compute dtype. Chosen once, when a
model is built."""
