"""NF4 double-quantized linear layers: QLoRA's frozen 4-bit base, in plain PyTorch.

QLoRA (Dettmers et al. 2023, https://arxiv.org/abs/2305.14314) fine-tunes a large model on
one GPU: the frozen base weights sit in 4 bits under small 16-bit LoRA adapters (lora.py).

NormalFloat4. Pretrained weights are near-normal around zero, so the 16 code values (NF4
below) are quantiles of N(0, 1) rescaled to [-1, 1]: 8 positive, 7 negative and an exact
zero (the paper's Appendix E). Each code covers an equal share of normal data.

Blockwise absmax. W (out, in) is flattened row-major (n = out * in) into blocks of 64, each
divided by its absolute maximum into [-1, 1]. Each value becomes the index of its nearest
NF4 value (bucketize on the 15 midpoints), two to a byte, element 2i in byte i's high
nibble. W[i] = NF4[code[i]] * absmax[i // 64] in fp32, rounded once to the compute dtype.

Double quantization. An fp32 absmax per 64 weights costs 0.5 bits a weight, so the absmax,
minus their mean (`offset`), in blocks of 256, become 8-bit indices into bitsandbytes'
signed dynamic map (dense near zero) times the block's fp32 absmax (`nested_absmax`). As
bitsandbytes' CPU path does, a value takes the code of the nearest of 65536 points in [-1, 1].

Memory: 4 + 8/64 + 32/(64 * 256) = 4.127 bits a weight, 3.9x less than 16. The layout is
bitsandbytes' (Params4bit, QuantState) and "bnb-4bit" checkpoints' (support/formats/hf.py):

    weight         uint8   ((n + 1) // 2, 1)  packed codes
    absmax         uint8   (B,)   codes of absmax - offset, B = ceil(n / 64)
    nested_absmax  float32 (B2,)  max |absmax - offset| per 256, B2 = ceil(B / 256)
    offset         float32 ()     mean of the fp32 absmax

Training. NF4Linear's forward dequantizes W to the compute dtype and multiplies; backward
dequantizes again for dL/dx = dL/dy W: only the frozen 4-bit buffers are kept. The reference
is dequantize_nf4 (fp32, one rounding); a layer's `dequantize_op` may be another op with its
bits (support/kernels/nf4_ops.py: a CUDA kernel, or one opaque to torch.compile).
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
GRID = 65536  # points of [-1, 1] giving an absmax its code
# NF4 as bitsandbytes stores it (fp32); tests check it against normal quantiles.
NF4 = (
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453]
    + [-0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0]
    + [0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224]
    + [0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]
)
BUFFERS = ("weight", "absmax", "nested_absmax", "offset")  # of NF4Linear, as NF4Weight


class NF4Weight(NamedTuple):
    """The four buffers of one quantized weight (layout above)."""

    packed: torch.Tensor  # uint8 ((n + 1) // 2, 1)
    absmax: torch.Tensor  # uint8 (B,)
    nested_absmax: torch.Tensor  # fp32 (B2,)
    offset: torch.Tensor  # fp32 ()

    def to(self, device):
        return NF4Weight(*(t.to(device) for t in self))


def dynamic_map():
    """bitsandbytes' signed 8-bit dynamic map, 256 sorted floats in [-0.993, 1]: 0, 1, and for
    e = 0..6 the 2**e midpoints of an even split of [0.1, 1] times 10**(e - 6), both signs."""
    values = [0.0, 1.0]
    for e in range(7):
        edges = torch.linspace(0.1, 1, 2**e + 1)
        mantissas = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (e - 6)  # fp32, as bitsandbytes rounds
        values += mantissas.tolist() + (-mantissas).tolist()
    return torch.tensor(sorted(values))


@functools.cache
def code_tables(device):
    """Code books and lookup tables on `device`, built on CPU (same bits everywhere).
    pairs: a byte's (high, low) NF4 values; grid_code: a grid point's nearest dyn code."""
    nf4 = torch.tensor(NF4)
    dyn = dynamic_map()
    pairs = torch.stack([nf4.repeat_interleave(16), nf4.repeat(16)], 1)  # (256, 2)
    grid = 2.0 * torch.arange(GRID, dtype=torch.float32) / (GRID - 1) - 1
    grid_code = torch.searchsorted((dyn[:-1] + dyn[1:]) / 2, grid).to(torch.uint8)  # (65536,)
    nf4_mid = (nf4[:-1] + nf4[1:]) / 2
    tables = dict(nf4=nf4, nf4_mid=nf4_mid, pairs=pairs, dyn=dyn, grid_code=grid_code)
    return {k: v.to(device) for k, v in tables.items()}


def scale_blocks(x, block):
    """Cut x (n,) fp32 into blocks of `block`, each over its absolute maximum: returns the
    blocks (nb, block) in [-1, 1] and the maxima (nb,). The last block is zero-padded."""
    blocks = F.pad(x, (0, -x.numel() % block)).view(-1, block)
    absmax = blocks.abs().amax(dim=1)
    inverse = (1.0 / absmax.clamp(min=1e-38))[:, None]  # an all-zero block stays 0
    return (blocks * inverse).clamp_(-1, 1), absmax


@torch.no_grad()
def quantize_nf4(w):
    """Any float tensor (n values) -> its NF4Weight, on w's device."""
    tables = code_tables(w.device)
    flat = w.reshape(-1).float()
    n = flat.numel()
    # 1. Blocks of 64 scaled into [-1, 1]: (B, 64); absmax (B,)
    scaled, absmax = scale_blocks(flat, BLOCK)
    # 2. Nearest NF4 index (odd n: padded by a zero), two to a byte, 2i in the high nibble
    values = scaled.view(-1)[: n + n % 2]
    codes = torch.bucketize(values, tables["nf4_mid"], out_int32=True).to(torch.uint8)
    packed = (codes[0::2] << 4 | codes[1::2]).view(-1, 1)
    # 3. Double quantization: absmax minus their mean, blocks of 256 into [-1, 1]: (B2, 256)
    offset = absmax.mean()
    normed, nested_absmax = scale_blocks(absmax - offset, NESTED_BLOCK)
    # 4. Codes via the grid; a block of equal absmax (all 0 once centred) gets code 0
    point = ((normed + 1) * 0.5 * (GRID - 1) + 0.5).int()
    nested = torch.where(nested_absmax[:, None] > 0, tables["grid_code"][point], 0)
    return NF4Weight(packed, nested.view(-1)[: absmax.numel()], nested_absmax, offset)


def dequantize_absmax(absmax, nested_absmax, offset):
    """uint8 codes (B,) -> fp32 absmax (B,): dyn[code] * nested_absmax[i // 256] + offset."""
    values = code_tables(absmax.device)["dyn"][absmax.int()]
    values = F.pad(values, (0, -values.numel() % NESTED_BLOCK))
    values = values.view(-1, NESTED_BLOCK) * nested_absmax[:, None]
    return values.view(-1)[: absmax.numel()] + offset


def dequantize_nf4(weight, absmax, nested_absmax, offset, shape, dtype):
    """Packed buffers -> `shape` in `dtype`: NF4[code] * absmax in fp32, rounded once."""
    scale = dequantize_absmax(absmax, nested_absmax, offset)  # (B,)
    n = math.prod(shape)
    nb = scale.numel()
    pairs = code_tables(weight.device)["pairs"].view(torch.int64).view(-1)  # (256,): a byte's 2 floats as 1 item
    values = pairs.index_select(0, weight.view(-1).int()).view(torch.float32)  # (2 * bytes,)
    if values.numel() != nb * BLOCK:  # a partial last block
        values = F.pad(values[:n], (0, nb * BLOCK - n))
    values = values.view(nb, BLOCK).mul_(scale[:, None])
    return values.view(-1)[:n].to(dtype).view(shape)


def zeros_nf4(n, device=None):
    """An all-zero NF4Weight of n values (quantize_nf4's shapes), to be filled."""
    nb = -(-n // BLOCK)
    return NF4Weight(
        torch.zeros((n + 1) // 2, 1, dtype=torch.uint8, device=device),
        torch.zeros(nb, dtype=torch.uint8, device=device),
        torch.zeros(-(-nb // NESTED_BLOCK), device=device),
        torch.zeros((), device=device),
    )


# ------------------------------ the linear
class DequantizeLinear(torch.autograd.Function):
    """y = x dequant(W)^T + b, W (out, in) dequantized in forward and again in backward: only the
    4-bit buffers are saved. They and the op are arguments, so torch.compile traces both passes."""

    @staticmethod
    def forward(ctx, x, bias, dequantize, weight, absmax, nested_absmax, offset, shape):
        ctx.save_for_backward(weight, absmax, nested_absmax, offset)
        ctx.dequantize = dequantize
        ctx.shape = shape  # [out, in]
        ctx.dtype = x.dtype  # x (..., in)
        w = dequantize(weight, absmax, nested_absmax, offset, shape, x.dtype)
        return F.linear(x, w, bias)

    @staticmethod
    def backward(ctx, grad):  # grad (..., out)
        dx = db = None
        if ctx.needs_input_grad[0]:  # dL/dx = dL/dy W, the forward's W
            w = ctx.dequantize(*ctx.saved_tensors, ctx.shape, ctx.dtype)
            dx = grad @ w.to(grad.dtype)  # (..., in)
        if ctx.needs_input_grad[1]:
            db = grad.flatten(0, -2).sum(0)  # (out,)
        return dx, db, None, None, None, None, None, None


class NF4Linear(nn.Module):
    """A frozen linear, its weight (out, in) in NF4 buffers. rel_error: ||W - dequant(W)|| / ||W||
    (None if pre-quantized). dequantize_op: dequantize_nf4, or quantize_'s dequantize_op."""

    def __init__(self, in_features, out_features, bias=False, compute_dtype=torch.bfloat16, device=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.compute_dtype = compute_dtype
        self.rel_error = None
        self.dequantize_op = dequantize_nf4
        for name, t in zip(BUFFERS, zeros_nf4(in_features * out_features, device), strict=True):
            self.register_buffer(name, t)
        opts = dict(dtype=compute_dtype, device=device)
        self.bias = nn.Parameter(torch.zeros(out_features, **opts)) if bias else None

    @classmethod
    def from_nf4(cls, w, out_features, in_features, bias=None, compute_dtype=torch.bfloat16):
        """A layer around the NF4Weight of a weight (out, in) and an optional 16-bit bias."""
        layer = cls(in_features, out_features, bias is not None, compute_dtype, device="meta")
        for name, t in zip(BUFFERS, w, strict=True):
            setattr(layer, name, t)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().to(w.packed.device, compute_dtype))
        return layer

    def nf4_weight(self):
        return NF4Weight(self.weight, self.absmax, self.nested_absmax, self.offset)

    def dequantize(self):
        """The weight (out, in) in compute_dtype."""
        shape = [self.out_features, self.in_features]
        return self.dequantize_op(*self.nf4_weight(), shape, self.compute_dtype)

    def forward(self, x):  # x (..., in) -> (..., out) in x's dtype
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        shape = [self.out_features, self.in_features]
        xc = x.to(self.compute_dtype)
        y = DequantizeLinear.apply(xc, bias, self.dequantize_op, *self.nf4_weight(), shape)
        return y.to(x.dtype)

    def extra_repr(self):
        features = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{features}, compute_dtype={self.compute_dtype}"


# ------------------------------ whole models
@torch.no_grad()
def relative_error(w, q):
    """||W - dequant(q)||_F / ||W||_F of W and its NF4Weight q, in fp32 (0 if W = 0)."""
    w = w.detach().float()
    err = torch.linalg.vector_norm(w - dequantize_nf4(*q, w.shape, torch.float32))
    norm = torch.linalg.vector_norm(w).clamp(min=torch.finfo(torch.float32).tiny)
    return (err / norm).item()


def quantize_(
    model, targets="all-linear", compute_dtype=torch.bfloat16, device=None, weights=None, dequantize_op=dequantize_nf4
):
    """Swap the chosen nn.Linear modules of `model` for NF4Linear, one weight at a time; returns it.

    targets: as model.find_linears ("all-linear": the blocks' linears, not embeddings, lm_head).
    weights: None (the model's own) or name -> tensor ("<module>.weight", "<module>.bias"), so
    a meta model never holds its base in 16 bits. An NF4Weight is used as is; a float one is
    first rounded to compute_dtype as transformers load it, so the bytes equal bitsandbytes'.
    device: where weights are quantized and kept (default: the linear's, CPU if meta)."""
    for name, linear in find_linears(model, targets).items():
        dev = torch.device(device or ("cpu" if linear.weight.is_meta else linear.weight.device))
        w = linear.weight.detach() if weights is None else weights(f"{name}.weight")
        if isinstance(w, torch.Tensor) and w.is_meta:
            raise ValueError(f"{name}.weight is on the meta device: pass weights= to read it from a checkpoint")
        ready = isinstance(w, NF4Weight)  # pre-quantized
        w = w.to(dev) if ready else w.to(dev, compute_dtype)  # rounded first; one at a time on dev
        q = w if ready else quantize_nf4(w)
        bias = linear.bias if weights is None or linear.bias is None else weights(f"{name}.bias")
        layer = NF4Linear.from_nf4(q, linear.out_features, linear.in_features, bias, compute_dtype)
        layer.rel_error = None if ready else relative_error(w, q)
        layer.dequantize_op = dequantize_op
        model.set_submodule(name, layer)
    return model
