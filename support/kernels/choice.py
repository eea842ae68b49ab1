"""Which kernels does a model built on this device use?

One call when a model is built (train.load_model) answers it for the three places a kernel is chosen, each by the file
that knows its kernels: the packed-document attention (attention.py: flash-attn, torch's varlen kernel, or one SDPA
call per document), NF4 dequantization (nf4_ops.py: bitsandbytes', a Triton kernel, or the reference, as an op) and
LoRA dropout (dropout_cuda.py: one Triton kernel, or the reference). The choice is made once, for the model's life.
"""

from typing import NamedTuple

import torch

from support.kernels import attention, dropout_cuda, nf4_ops


class Kernels(NamedTuple):
    attention: object  # varlen(q, k, v, docs, window): the model's packed-document attention
    dequantize: object  # the op every NF4 linear dequantizes with
    dropout: object  # the op every LoRA dropout applies its keyed mask with


def kernels_for(device, dtype, config) -> Kernels:
    """The kernels of a model of `config` built on `device`, computing in `dtype`."""
    device = torch.device(device)
    varlen = attention.varlen_attention(device, dtype, config.head_dim, windowed=bool(config.sliding_layers))
    return Kernels(varlen, nf4_ops.dequantize_op_for(device), dropout_cuda.dropout_op_for(device))
