"""Which op dequantizes the NF4 weights of a model built on this device?

quant.dequantize_nf4 is the reference. A model's builder hands every NF4Linear an op instead (`dequantize_op_for`), a
custom op torch.compile sees as one opaque operator (docs/internals.md): off CUDA the reference (REFERENCE_OP); on CUDA
`dequantize_cuda` (CUDA_OP): bitsandbytes' kernel, or a Triton kernel bit-identical to the reference, or the reference.
"""

import contextlib
import functools

import torch
from torch import Tensor

import quant
from support.run import optional


def _fake(weight, absmax, nested_absmax, offset, shape, dtype):  # what the compiler needs: the output's metadata
    return weight.new_empty(shape, dtype=dtype)


@torch.library.custom_op("nanoqlora::dequantize_nf4", mutates_args=())
def dequantize(
    weight: Tensor, absmax: Tensor, nested_absmax: Tensor, offset: Tensor, shape: list[int], dtype: torch.dtype
) -> Tensor:
    """quant.dequantize_nf4 as one opaque op, on every device."""
    return quant.dequantize_nf4(weight, absmax, nested_absmax, offset, shape, dtype)


dequantize.register_fake(_fake)
REFERENCE_OP = torch.ops.nanoqlora.dequantize_nf4.default  # a layer holds it so: copy.deepcopy copies it as itself


@functools.cache  # looked up by every dequantize of the bitsandbytes path
def _bnb_functional():
    """bitsandbytes.functional when it is installed and imports (the optional CUDA fast path), else None."""
    return optional.load("bitsandbytes.functional", "NF4 runs without it")


def dequantize_bnb(weight, absmax, nested_absmax, offset, shape, dtype):
    """dequantize_nf4 through bitsandbytes' kernel, from a QuantState that points at our buffers."""
    bnb = _bnb_functional()
    tables = quant.code_tables(weight.device)
    nested = bnb.QuantState(absmax=nested_absmax, code=tables["dyn"], blocksize=quant.NESTED_BLOCK, dtype=torch.float32)
    kw = dict(quant_type="nf4", dtype=dtype, offset=offset, state2=nested)
    state = bnb.QuantState(absmax=absmax, shape=torch.Size(shape), code=tables["nf4"], blocksize=quant.BLOCK, **kw)
    return bnb.dequantize_4bit(weight, state)


TRITON_BLOCK = 1024  # output values per Triton program: 16 NF4 blocks, 512 packed bytes
# Compile options of every launch: no FMA contraction, so a * b + c is rounded twice, as PyTorch's two ops round it.
TRITON_OPTIONS = dict(enable_fp_fusion=False)


@functools.cache
def _triton_kernel():
    """The Triton kernel, built on first use. One program writes TRITON_BLOCK values; value i reads byte i // 2 (high
    nibble for even i), absmax code i // 64 and nested absmax i // (64 * 256), in the reference's fp32 order. bf16 is
    rounded on the bits (to nearest even) because Triton's CPU interpreter, which the tests run, truncates the cast."""
    import triton
    import triton.language as tl

    @triton.jit
    def nf4_dequantize_kernel(packed, absmax, nested_absmax, offset, nf4, dyn, out, n, SIZE: tl.constexpr,
                              Q: tl.constexpr, NESTED: tl.constexpr, BF16: tl.constexpr):  # fmt: skip
        i = tl.program_id(0).to(tl.int64) * SIZE + tl.arange(0, SIZE)  # (SIZE,) output indices
        mask = i < n
        byte = tl.load(packed + i // 2, mask=mask, other=0).to(tl.int32)
        code = tl.where(i % 2 == 0, byte >> 4, byte & 15)
        a = tl.load(dyn + tl.load(absmax + i // Q, mask=mask, other=0).to(tl.int32), mask=mask, other=0.0)
        scale = a * tl.load(nested_absmax + i // (Q * NESTED), mask=mask, other=0.0) + tl.load(offset)
        value = tl.load(nf4 + code, mask=mask, other=0.0) * scale
        if BF16:  # add half an ulp of bf16 (minus 1 when the kept bit is even) and keep the high 16 bits
            bits = value.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            tl.store(out + i, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
        else:
            tl.store(out + i, value.to(out.dtype.element_ty), mask=mask)

    return nf4_dequantize_kernel


def dequantize_triton(weight, absmax, nested_absmax, offset, shape, dtype):
    """dequantize_nf4 in one Triton kernel launch, bit-identical to it (see TRITON_OPTIONS)."""
    out = torch.empty(shape, dtype=dtype, device=weight.device)
    n = out.numel()
    tables = quant.code_tables(weight.device)
    args = (weight, absmax, nested_absmax, offset, tables["nf4"], tables["dyn"], out, n)
    consts = dict(SIZE=TRITON_BLOCK, Q=quant.BLOCK, NESTED=quant.NESTED_BLOCK, BF16=dtype == torch.bfloat16)
    # Triton launches on the current GPU: make it the weight's (cuda:1 while cuda:0 is current would fault).
    with torch.cuda.device(weight.device) if weight.is_cuda else contextlib.nullcontext():
        _triton_kernel()[(-(-n // TRITON_BLOCK),)](*args, **consts, **TRITON_OPTIONS)
    return out


@functools.cache
def cuda_dequantize():
    """The CUDA implementation, chosen once per process (a CPU-only bitsandbytes is passed over)."""
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    if _bnb_functional() is not None and has_kernel("bitsandbytes::dequantize_4bit", "CUDA"):
        return dequantize_bnb
    if optional.installed("triton") and runs_like_reference(dequantize_triton, "cuda"):
        return dequantize_triton
    return quant.dequantize_nf4


@torch.library.custom_op("nanoqlora::dequantize_nf4_cuda", mutates_args=(), device_types="cuda")
def dequantize_cuda(
    weight: Tensor, absmax: Tensor, nested_absmax: Tensor, offset: Tensor, shape: list[int], dtype: torch.dtype
) -> Tensor:
    """quant.dequantize_nf4 on CUDA tensors by the implementation cuda_dequantize chose, as one opaque op."""
    return cuda_dequantize()(weight, absmax, nested_absmax, offset, shape, dtype)


dequantize_cuda.register_fake(_fake)
CUDA_OP = torch.ops.nanoqlora.dequantize_nf4_cuda.default


def dequantize_op_for(device):
    """The op the NF4 linears of a model built on `device` use; on CUDA its kernel is chosen (and tried) now."""
    if torch.device(device).type != "cuda":
        return REFERENCE_OP
    cuda_dequantize()
    return CUDA_OP


def runs_like_reference(impl, device):
    """Whether impl dequantizes 300 values (four 64-value blocks and a partial one) on `device` to the reference's
    bf16 bits; if not (Triton's launcher needs a C compiler and Python's headers), one line says so."""
    shape = [3, 100]
    q = quant.quantize_nf4(torch.randn(shape, generator=torch.Generator().manual_seed(0))).to(device)
    return matches_reference(impl, quant.dequantize_nf4, (*q, shape, torch.bfloat16), "NF4 dequantizes with PyTorch")


def matches_reference(impl, reference, args, instead) -> bool:
    """Whether impl(*args) runs and returns reference(*args)'s bits (a kernel's trial, here and in dropout_cuda.py);
    if not, one line naming impl says why and `instead`, what runs in its place."""
    try:
        out = impl(*args)
    except Exception as e:  # a missing compiler, a driver too old for the PTX: anything but a result
        why = (str(e).strip().splitlines() or [""])[0][:200]
        print(f"{impl.__name__} does not run here ({type(e).__name__}: {why}); {instead}")
        return False
    if not torch.equal(out, reference(*args)):
        print(f"{impl.__name__} differs from the reference here; {instead}")
        return False
    return True
