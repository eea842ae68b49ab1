"""Which kernel applies LoRA's keyed dropout on a GPU?

The same hash as dropout.py's `keyed_dropout` in one Triton kernel, bit-identical to it, reading x once and writing
once. `dropout_op_for` hands a model built on CUDA the op `keyed_dropout_cuda`, opaque to torch.compile, whose backward
is the same op on the gradient (dropout is linear in x), so no mask is saved.
"""

import contextlib
import functools

import torch
from torch import Tensor

from support.kernels.dropout import (
    DRAW_BITS,
    DRAWS,
    GOLDEN,
    KEYED_OP,
    MIX1,
    MIX2,
    keyed_dropout,
    register_backward_,
    tile_keys,
)
from support.kernels.nf4_ops import matches_reference
from support.run import optional

TRITON_BLOCK = 1024  # elements of one row per Triton program


def _unsigned(c):  # an int64 constant of dropout.py as the uint64 the kernel computes with
    return c % 2**64


@functools.cache
def _triton_kernel():
    """The Triton kernel, built on first use. Program (b, r) writes elements b * SIZE ... of row r: element e takes
    draw e % 4 of hash e // 4 of its row, the reference's hash on uint64. x * keep is exact and * scale rounds once, as
    PyTorch's; bf16 is rounded on the bits (to nearest even): Triton's CPU interpreter truncates the cast."""
    import triton
    import triton.language as tl

    @triton.jit
    def keyed_dropout_kernel(x, keys, out, row_numel, threshold, scale, SIZE: tl.constexpr, GOLD: tl.constexpr,
                             M1: tl.constexpr, M2: tl.constexpr, BITS: tl.constexpr, BF16: tl.constexpr):  # fmt: skip
        row = tl.program_id(1).to(tl.int64)
        e = tl.program_id(0).to(tl.int64) * SIZE + tl.arange(0, SIZE)  # (SIZE,) element indices in the row
        inside = e < row_numel
        z = tl.load(keys + row).to(tl.uint64, bitcast=True) + (e // 4).to(tl.uint64) * GOLD
        z = z ^ (z >> 30)
        z = z * M1
        z = z ^ (z >> 27)
        z = z * M2
        z = z ^ (z >> 31)
        draw = ((z >> ((e % 4) * BITS).to(tl.uint64)) & ((1 << BITS) - 1)).to(tl.int32)
        keep = (draw >= threshold).to(tl.float32)
        value = tl.load(x + row * row_numel + e, mask=inside, other=0.0).to(tl.float32) * keep * scale
        if BF16:  # add half an ulp of bf16 (minus 1 when the kept bit is even) and keep the high 16 bits
            bits = value.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            tl.store(out + row * row_numel + e, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=inside)
        else:
            tl.store(out + row * row_numel + e, value.to(out.dtype.element_ty), mask=inside)

    return keyed_dropout_kernel


def keyed_dropout_triton(x, p, keys):
    """keyed_dropout in one Triton kernel launch, bit-identical to it."""
    if keys.shape != x.shape[:1]:
        raise ValueError(f"keyed_dropout: {tuple(keys.shape)} keys for an input of {x.shape[0]} rows")
    row_numel = x[0].numel()
    grid = launch_grid(x.shape[0], row_numel)
    if grid is None:  # more rows than one launch takes: the reference, whose bits these are
        return keyed_dropout(x, p, keys)
    x, keys = x.contiguous(), keys.to(x.device).contiguous()
    out = torch.empty_like(x)
    threshold = round(p * DRAWS)  # as the reference: a draw below it drops its element
    consts = dict(SIZE=TRITON_BLOCK, GOLD=_unsigned(GOLDEN), M1=_unsigned(MIX1), M2=_unsigned(MIX2), BITS=DRAW_BITS)
    # Triton launches on the current GPU: make it the input's (cuda:1 while cuda:0 is current would fault).
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _triton_kernel()[grid](x, keys, out, row_numel, threshold, DRAWS / (DRAWS - threshold), **consts,
                               BF16=x.dtype == torch.bfloat16)  # fmt: skip
    return out


def launch_grid(rows, row_numel):
    """(programs along a row, rows), or None where CUDA cannot launch it: a row's blocks on the first axis (up to
    2**31 - 1; an 8B down_proj's 8,192-token row is 114,688), the rows on the second (up to 65,535)."""
    blocks = -(-row_numel // TRITON_BLOCK)
    return (blocks, rows) if blocks < 2**31 and rows <= 65_535 else None


@functools.cache
def cuda_keyed_dropout():
    """The CUDA implementation, chosen once per process."""
    if optional.installed("triton") and runs_like_reference(keyed_dropout_triton, "cuda"):
        return keyed_dropout_triton
    return keyed_dropout


@torch.library.custom_op("nanoqlora::keyed_dropout_cuda", mutates_args=(), device_types="cuda")
def keyed_dropout_cuda(x: Tensor, p: float, keys: Tensor, first: int = 0) -> Tensor:
    """dropout.keyed_dropout on CUDA tensors by the implementation cuda_keyed_dropout chose, as one opaque op."""
    return cuda_keyed_dropout()(x, p, tile_keys(keys, first))


@keyed_dropout_cuda.register_fake
def _(x, p, keys, first=0):  # what the compiler needs: the output's metadata
    return torch.empty_like(x)


register_backward_(keyed_dropout_cuda)
CUDA_OP = torch.ops.nanoqlora.keyed_dropout_cuda.default  # as KeyedDropout holds it


def dropout_op_for(device, compiled=False):
    """The op the KeyedDropouts of a model built on `device` apply, its blocks `compiled` or not: off CUDA the plain
    keyed_dropout, compiled its opaque KEYED_OP (Inductor's C++ gets the hash wrong); on CUDA this file's op, whose
    kernel is chosen (and tried) now."""
    if torch.device(device).type != "cuda":
        return KEYED_OP if compiled else keyed_dropout
    cuda_keyed_dropout()
    return CUDA_OP


def runs_like_reference(impl, device):
    """Whether impl drops a small bf16 input on `device` (rows of 77 elements, not a multiple of 4) to the
    reference's bits; if not, one line says so."""
    x = torch.randn(3, 7, 11, generator=torch.Generator().manual_seed(0)).bfloat16().to(device)
    keys = torch.tensor([1, -2, 3**39], dtype=torch.int64, device=device)
    return matches_reference(impl, keyed_dropout, (x, 0.3, keys), "LoRA dropout runs in PyTorch")
