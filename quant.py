"""NF4 double-quantized linear layers: the frozen 4-bit base of QLoRA, in plain PyTorch.

QLoRA (Dettmers et al. 2023, https://arxiv.org/abs/2305.14314) fine-tunes a large model on one GPU by keeping the frozen
base weights in 4 bits under small 16-bit LoRA adapters (lora.py). This file is the 4-bit part.

NormalFloat4. Pretrained weights are close to normal around zero, so the 16 code values sit at quantiles of N(0, 1):
8 on the positive side, 7 on the negative side and an exact zero, rescaled to [-1, 1] (the paper's Appendix E):

    NF4 = [-1, -.696, -.525, -.395, -.284, -.185, -.091, 0, .080, .161, .246, .338, .441, .563, .723, 1]

Each code then covers an equal share of normal data: information-theoretically optimal, the paper says.

Blockwise absmax. W (out, in) is flattened row-major into n = out * in values, cut into blocks of 64. Each block is
divided by its absolute maximum (into [-1, 1]) and each value becomes the index of the nearest NF4 value, a bucketize
against the 15 midpoints. Dequantization is W[i] = NF4[code[i]] * absmax[i // 64] in fp32, rounded once to the compute
dtype. Two codes share a byte, element 2i in the high nibble of byte i.

Double quantization. One fp32 absmax per 64 weights would cost 32 / 64 = 0.5 bits per weight, so the absmax are
quantized too: subtract their mean (`offset`), cut them into blocks of 256, and store each as an 8-bit index into the
signed dynamic map of bitsandbytes (256 values with a decimal exponent, dense near zero) scaled by the block's fp32
absolute maximum (`nested_absmax`). The code is found as bitsandbytes' CPU path finds it: the normalised value is
rounded to one of 65536 evenly spaced points of [-1, 1], and a table maps each point to its nearest code (bitsandbytes'
CUDA kernel searches the exact nearest, so rare absmax bytes differ by a step; both load alike).

Memory, per weight: 4 bits of code + 8 / 64 bits of absmax + 32 / (64 * 256) bits of nested absmax = 4.127 bits, plus a
4-byte offset per tensor and a partial last block: 3.9x less than 16-bit weights. The 6.5B linear weights of a 7B
Llama take 3.3 GB instead of 13 GB.

Layout, the same as bitsandbytes' Params4bit and QuantState (so tensors pass both ways), with B = ceil(n / 64) blocks
and B2 = ceil(B / 256) nested blocks:

    weight         uint8   ((n + 1) // 2, 1)   packed codes
    absmax         uint8   (B,)                 8-bit codes of absmax - offset
    nested_absmax  float32 (B2,)                absolute maximum of each block of 256 centred absmax
    offset         float32 ()                   mean of the fp32 absmax

Checkpoints in the Hugging Face "bnb-4bit" format hold exactly these buffers (support/formats/hf.py); `quantize_`
takes such a pre-quantized weight as it is.

Training. NF4Linear's forward dequantizes W into the compute dtype (bf16, fp16 or fp32) and multiplies; its backward
dequantizes again for the input gradient dL/dx = dL/dy W alone: the base is frozen, only the 4-bit buffers are kept.

Where dequantization runs. `dequantize_nf4` below is the reference: a few PyTorch ops, fp32 math, one rounding. Each
NF4Linear dequantizes with its `dequantize_op`, the reference unless the model's builder hands it an op with the same
bits (support/kernels/nf4_ops.py: on CUDA a faster kernel; everywhere one torch.compile sees as opaque).

Quantization error. quantize_ records each layer's relative error ||W - dequant(W)||_F / ||W||_F (`rel_error`;
support/run/progress.py prints the mean and the worst). For Gaussian weights NF4 with blocks of 64 loses about 9% of the
norm; real checkpoints come close (tests/test_quant.py).
"""

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from model import find_linears

BLOCK = 64  # weights per absmax
NESTED_BLOCK = 256  # absmax per nested absmax
GRID = 65536  # evenly spaced points of [-1, 1] giving an absmax its 8-bit code
# The 16 NF4 values as bitsandbytes stores them (fp32); tests check them against the normal quantiles.
# fmt: off
NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]
# fmt: on


BUFFERS = ("weight", "absmax", "nested_absmax", "offset")  # NF4Linear's buffers, an NF4Weight's fields


class NF4Weight(NamedTuple):
    """The four buffers of one quantized weight (see the layout above)."""

    packed: torch.Tensor  # uint8 ((n + 1) // 2, 1)
    absmax: torch.Tensor  # uint8 (B,)
    nested_absmax: torch.Tensor  # fp32 (B2,)
    offset: torch.Tensor  # fp32 ()

    def to(self, device):
        return NF4Weight(*(t.to(device) for t in self))


def dynamic_map():
    """The signed 8-bit dynamic map (256 sorted floats in [-0.993, 1]): 0, 1, and for e = 0..6 the 2**e midpoints of
    an even split of [0.1, 1] times 10**(e - 6), both signs: fine steps near 0, where centred absmax sit."""
    values = [0.0, 1.0]
    for e in range(7):
        edges = torch.linspace(0.1, 1, 2**e + 1)
        mantissas = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (e - 6)  # fp32, as bitsandbytes rounds
        values += mantissas.tolist() + (-mantissas).tolist()
    return torch.tensor(sorted(values))


@functools.cache
def code_tables(device):
    """Code books and lookup tables on `device` (built on CPU: same bits everywhere)."""
    nf4, dyn = torch.tensor(NF4), dynamic_map()
    pairs = torch.stack([nf4.repeat_interleave(16), nf4.repeat(16)], 1)  # (256, 2): byte -> (high, low)
    grid = 2.0 * torch.arange(GRID, dtype=torch.float32) / (GRID - 1) - 1  # (65536,) in [-1, 1]
    grid_code = torch.searchsorted((dyn[:-1] + dyn[1:]) / 2, grid).to(torch.uint8)  # nearest code
    tables = dict(nf4=nf4, nf4_mid=(nf4[:-1] + nf4[1:]) / 2, pairs=pairs, dyn=dyn, grid_code=grid_code)
    return {k: v.to(device) for k, v in tables.items()}


def blockwise_absmax(x, block):
    """x (n,) fp32 cut into blocks of `block` values -> (each block over its absolute maximum, in [-1, 1]
    (nb, block); the maxima (nb,)). The last block is zero-padded (its maximum unchanged); an all-zero block stays 0."""
    blocks = F.pad(x, (0, -x.numel() % block)).view(-1, block)
    absmax = blocks.abs().amax(dim=1)
    return (blocks * (1.0 / absmax.clamp(min=1e-38))[:, None]).clamp_(-1, 1), absmax


@torch.no_grad()
def quantize_nf4(w):
    """Any float tensor (n values) -> its NF4Weight (the layout above), computed on w's device."""
    tables = code_tables(w.device)
    flat = w.reshape(-1).float()
    n = flat.numel()
    # 1. Blocks of 64 weights scaled by their absolute maximum into [-1, 1]: scaled (B, 64), absmax (B,)
    scaled, absmax = blockwise_absmax(flat, BLOCK)
    # 2. Each weight's nearest NF4 index (an odd n padded by a zero), two to a byte
    codes = torch.bucketize(scaled.view(-1)[: n + n % 2], tables["nf4_mid"], out_int32=True).to(torch.uint8)
    packed = (codes[0::2] << 4 | codes[1::2]).view(-1, 1)  # element 2i in the high nibble
    # 3. Double quantization: the absmax minus their mean, in blocks of 256 scaled into [-1, 1]: (B2, 256)
    offset = absmax.mean()
    normed, nested_absmax = blockwise_absmax(absmax - offset, NESTED_BLOCK)
    # 4. Each one's dynamic-map code through the grid, as above; a block of equal absmax (all zero) gets code 0.
    point = ((normed + 1) * 0.5 * (GRID - 1) + 0.5).int()
    nested_codes = torch.where(nested_absmax[:, None] > 0, tables["grid_code"][point], 0)
    return NF4Weight(packed, nested_codes.view(-1)[: absmax.numel()], nested_absmax, offset)


def dequantize_absmax(absmax, nested_absmax, offset):
    """uint8 (B,) codes -> fp32 (B,) absmax: dyn[code] * nested_absmax[block // 256] + offset."""
    values = code_tables(absmax.device)["dyn"][absmax.int()]
    values = F.pad(values, (0, -values.numel() % NESTED_BLOCK)).view(-1, NESTED_BLOCK) * nested_absmax[:, None]
    return values.view(-1)[: absmax.numel()] + offset


def dequantize_nf4(weight, absmax, nested_absmax, offset, shape, dtype):
    """Packed buffers -> tensor of `shape` in `dtype`: NF4[code] * absmax in fp32, rounded once."""
    scale = dequantize_absmax(absmax, nested_absmax, offset)  # (B,)
    n, nb = math.prod(shape), scale.numel()
    values = code_tables(weight.device)["pairs"].index_select(0, weight.view(-1).int()).view(-1)  # (2 * bytes,)
    if values.numel() != nb * BLOCK:  # a partial last block
        values = F.pad(values[:n], (0, nb * BLOCK - n))
    return values.view(nb, BLOCK).mul_(scale[:, None]).view(-1)[:n].to(dtype).view(shape)


def zeros_nf4(n, device=None):
    """An all-zero NF4Weight of n values (quantize_nf4's shapes), to be filled."""
    nb = -(-n // BLOCK)
    return NF4Weight(
        torch.zeros((n + 1) // 2, 1, dtype=torch.uint8, device=device),
        torch.zeros(nb, dtype=torch.uint8, device=device),
        torch.zeros(-(-nb // NESTED_BLOCK), device=device),
        torch.zeros((), device=device),
    )


# ----------------------------------------------------------------------------- the linear
class DequantizeLinear(torch.autograd.Function):
    """y = x dequant(W)^T + b: W (out, in) dequantized by `dequantize` in forward, used and dropped, and again in
    backward for dx = dy W. Only the 4-bit buffers are saved, never W; they get no gradient. (Buffers and op are
    arguments: torch.compile traces both passes.)"""

    @staticmethod
    def forward(ctx, x, bias, dequantize, weight, absmax, nested_absmax, offset, shape):  # x (..., in), [out, in]
        ctx.save_for_backward(weight, absmax, nested_absmax, offset)
        ctx.dequantize, ctx.shape, ctx.dtype = dequantize, shape, x.dtype
        return F.linear(x, dequantize(weight, absmax, nested_absmax, offset, shape, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):  # grad (..., out)
        dx = db = None
        if ctx.needs_input_grad[0]:  # dL/dx = dL/dy W, the forward's W
            dx = grad @ ctx.dequantize(*ctx.saved_tensors, ctx.shape, ctx.dtype).to(grad.dtype)  # (..., in)
        if ctx.needs_input_grad[1]:
            db = grad.flatten(0, -2).sum(0)  # (out,)
        return dx, db, None, None, None, None, None, None


class NF4Linear(nn.Module):
    """A frozen linear whose weight (out, in) lives in NF4 buffers (see above). rel_error: ||W - dequant(W)|| / ||W||
    when quantized from a 16-bit W, else None. dequantize_op: dequantize_nf4, or the op the model's builder hands it."""

    def __init__(self, in_features, out_features, bias=False, compute_dtype=torch.bfloat16, device=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.compute_dtype = compute_dtype
        self.rel_error = None
        self.dequantize_op = dequantize_nf4
        for name, t in zip(BUFFERS, zeros_nf4(in_features * out_features, device), strict=True):
            self.register_buffer(name, t)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=compute_dtype, device=device)) if bias else None

    @classmethod
    def from_nf4(cls, w, out_features, in_features, bias=None, compute_dtype=torch.bfloat16):
        """A layer around the NF4Weight of an (out, in) weight, with an optional 16-bit bias."""
        layer = cls(in_features, out_features, bias is not None, compute_dtype, device="meta")
        layer.weight = w.packed
        layer.absmax = w.absmax
        layer.nested_absmax = w.nested_absmax
        layer.offset = w.offset
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().to(w.packed.device, compute_dtype))
        return layer

    def nf4_weight(self):
        return NF4Weight(self.weight, self.absmax, self.nested_absmax, self.offset)

    def dequantize(self):
        """The weight (out, in) in compute_dtype."""
        return self.dequantize_op(*self.nf4_weight(), [self.out_features, self.in_features], self.compute_dtype)

    def forward(self, x):  # x (..., in) -> (..., out) in x's dtype
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        shape = [self.out_features, self.in_features]
        y = DequantizeLinear.apply(x.to(self.compute_dtype), bias, self.dequantize_op, *self.nf4_weight(), shape)
        return y.to(x.dtype)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, compute_dtype={self.compute_dtype}"


# ----------------------------------------------------------------------------- whole models
@torch.no_grad()
def relative_error(w, q):
    """||W - dequant(q)||_F / ||W||_F of a weight W and its NF4Weight q, in fp32 (0 for W = 0)."""
    w = w.detach().float()
    err = torch.linalg.vector_norm(w - dequantize_nf4(*q, w.shape, torch.float32))
    return (err / torch.linalg.vector_norm(w).clamp(min=torch.finfo(torch.float32).tiny)).item()


def quantize_(
    model, targets="all-linear", compute_dtype=torch.bfloat16, device=None, weights=None, dequantize_op=dequantize_nf4
):
    """Swap the chosen nn.Linear modules of `model` for NF4Linear, one weight at a time; returns the model.

    targets: as model.find_linears ("all-linear": the blocks' linears; embeddings and lm_head stay 16-bit).
    weights: None quantizes the model's own weights; else a function name -> tensor ("<module>.weight", "<module>.bias")
    supplying them one by one, so a meta-device model gets its base from a checkpoint, never holding the 16-bit model.
    An NF4Weight it hands back (a pre-quantized checkpoint) is used as it is. A 16-bit or fp32 weight is rounded to
    compute_dtype before it is quantized, as transformers + bitsandbytes do when they load a checkpoint in that dtype,
    so the bytes equal theirs. device: where the buffers go (default: the linear's, or CPU for a meta linear); on CUDA
    each weight is quantized on the GPU as it arrives. dequantize_op: what every new NF4Linear dequantizes with.
    """
    for name, linear in find_linears(model, targets).items():
        dev = torch.device(device or ("cpu" if linear.weight.is_meta else linear.weight.device))
        w = linear.weight.detach() if weights is None else weights(f"{name}.weight")
        if isinstance(w, torch.Tensor) and w.is_meta:
            raise ValueError(f"{name}.weight is on the meta device: pass weights= to read it from a checkpoint")
        # rounded to the compute dtype first (see above); the copy lives on `dev` until the next weight replaces it
        w = w.to(dev) if isinstance(w, NF4Weight) else w.to(dev, compute_dtype)
        q = w if isinstance(w, NF4Weight) else quantize_nf4(w)
        bias = linear.bias if weights is None or linear.bias is None else weights(f"{name}.bias")
        layer = NF4Linear.from_nf4(q, linear.out_features, linear.in_features, bias, compute_dtype)
        layer.rel_error = None if isinstance(w, NF4Weight) else relative_error(w, q)
        layer.dequantize_op = dequantize_op
        model.set_submodule(name, layer)
    return model
