"""Which kernel attends over packed documents, and how it is called.

model.py calls the function `varlen_attention` chose when the model was built with q (N, H, D), k and v (N, Hkv, D)
over the B*T flattened tokens, the documents' bounds (`Docs`) and the layer's sliding window: flash-attn's varlen
kernel, torch's own (torch_varlen), or one causal SDPA call per document (sdpa_varlen, one opaque op when compiled).
On a GPU a micro-batch of whole documents, one a row (a long single row, unpacked rows of one length), goes to batched
causal SDPA instead (whole_rows_first), where cuDNN's fused attention is faster than a varlen kernel.
"""

import functools
import inspect
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from support.run import optional

try:  # torch's own varlen FlashAttention (torch >= 2.9), looked up once here: compiled blocks then read a constant
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

SHAPE_BUCKET = 64  # beyond this many tokens, documents (attention) and loss chunks grow in steps of it (bucket)


class Docs(NamedTuple):
    """Packed-document bounds over the N = B*T flattened tokens, e.g. documents of 5, 3 and 7 tokens: [0, 5, 8, 15]."""

    cu_seqlens: torch.Tensor  # int32 (docs + 1,), on the tokens' device, for the varlen kernels
    max_seqlen: int  # the longest document
    bounds: torch.Tensor  # the same cu_seqlens on the CPU, for the per-document loop (read without a device sync)


def causal_sdpa(q, k, v, window=None, start=0, pad=None):
    """Causal attention, q (B, H, T, D) at positions start.., k/v (B, Hkv, S, D) at 0..S-1, within the last `window`
    keys. pad (B,) (left padding of prompts): row b's first pad[b] keys are hidden, except each padding query's own
    key, so that no row of the softmax is empty (NaN)."""
    T, S = q.shape[-2], k.shape[-2]
    if start == 0 and (window is None or T <= window) and pad is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    i, j = torch.arange(start, start + T, device=q.device)[:, None], torch.arange(S, device=q.device)
    mask = (j <= i) & (i - j < (window or S + 1))  # (T, S)
    if pad is not None:  # (B, 1, T, S): broadcast over heads
        mask = (mask & (j >= pad[:, None, None]) | (j == i))[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def bucket(n):
    """n >= 1 rounded up to a power of two up to SHAPE_BUCKET, to a multiple of SHAPE_BUCKET beyond: the few lengths
    that sdpa_varlen and in_buckets hand their kernels, whatever the data."""
    return 1 << (n - 1).bit_length() if n <= SHAPE_BUCKET else -(-n // SHAPE_BUCKET) * SHAPE_BUCKET


def pad_to_bucket(t):
    """t (n, ...) with zero rows appended up to bucket(n) rows; t itself when n is a bucket length already."""
    n = t.shape[0]
    return t if bucket(n) == n else F.pad(t, (0, 0) * (t.dim() - 1) + (0, bucket(n) - n))


def in_buckets(cross_entropy):
    """model.linear_cross_entropy with each chunk's c rows zero-padded to bucket(c) rows (label 0): a zero row's loss,
    exactly log(vocab), is taken off again, its dL/dh dropped, and its share of dL/dW is zero."""

    def padded(h, weight, labels, chunk, grad=False):
        zero_row = torch.zeros(1, weight.shape[0], device=h.device).logsumexp(-1)[0]  # the loss of one zero row
        loss, grad_h, grad_w = torch.zeros((), device=h.device), torch.empty_like(h) if grad else None, None
        for i in range(0, labels.numel(), chunk):
            c = labels[i : i + chunk].numel()
            yc = F.pad(labels[i : i + chunk], (0, bucket(c) - c))
            part, gh, gw = cross_entropy(pad_to_bucket(h[i : i + chunk]), weight, yc, bucket(c), grad)
            loss += part - (bucket(c) - c) * zero_row
            if grad:
                grad_h[i : i + c] = gh[:c]
                grad_w = gw if grad_w is None or gw is None else grad_w + gw
        return loss, grad_h, grad_w

    return padded


def sdpa_varlen(q, k, v, docs, window=None):
    """Packed attention as one causal SDPA call per document. q (N, H, D), k/v (N, Hkv, D) -> (N, H, D).
    Each document is zero-padded to bucket(L) tokens (causality hides the zero keys; the zero queries are dropped):
    PyTorch's bf16 CPU attention keeps a kernel for every shape it meets, so raw lengths would grow the process."""
    b = docs.bounds.tolist()

    # 4-D (1, heads, bucket(L), D): given 3-D, CPU attention skips its fused kernel and keeps (heads, L, L) for backward
    def doc(t, s, e):
        return pad_to_bucket(t[s:e]).transpose(0, 1)[None]

    outs = [
        causal_sdpa(doc(q, s, e), doc(k, s, e), doc(v, s, e), window)[0, :, : e - s]
        for s, e in zip(b[:-1], b[1:], strict=True)
    ]
    return torch.cat(outs, dim=1).transpose(0, 1).contiguous()


@torch.library.custom_op("nanoqlora::sdpa_varlen", mutates_args=())
def sdpa_varlen_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor, window: int
) -> torch.Tensor:
    """sdpa_varlen as one opaque op, for torch.compile: the per-document loop depends on the data, so traced as Python
    it would break the graph in every layer and recompile for every document count. window 0 = none."""
    return sdpa_varlen(q, k, v, Docs(bounds, 0, bounds), window or None)


@sdpa_varlen_op.register_fake
def _(q, k, v, bounds, window):
    return torch.empty_like(q)


@torch.library.custom_op("nanoqlora::sdpa_varlen_backward", mutates_args=())
def sdpa_varlen_backward_op(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of sdpa_varlen_op, opaque too: each document's attention recomputed and differentiated with
    torch.func.vjp (an opaque forward keeps no graph to reuse, and inside an op autograd's own recording is off)."""
    docs = Docs(bounds, 0, bounds)
    _, vjp = torch.func.vjp(lambda q, k, v: sdpa_varlen(q, k, v, docs, window or None), q, k, v)
    return tuple(g.contiguous() for g in vjp(grad))


@sdpa_varlen_backward_op.register_fake
def _(grad, q, k, v, bounds, window):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _sdpa_varlen_setup(ctx, inputs, output):
    q, k, v, bounds, ctx.window = inputs
    ctx.save_for_backward(q, k, v, bounds)


def _sdpa_varlen_backward(ctx, grad):
    return *sdpa_varlen_backward_op(grad, *ctx.saved_tensors, ctx.window), None, None


sdpa_varlen_op.register_autograd(_sdpa_varlen_backward, setup_context=_sdpa_varlen_setup)


def sdpa_varlen_opaque(q, k, v, docs, window=None):
    return sdpa_varlen_op(q, k, v, docs.bounds, window or 0)


def flash_varlen(q, k, v, docs, window=None):
    """FlashAttention-2 over packed documents: the same contract in one kernel call, GQA handled by the kernel."""
    from flash_attn import flash_attn_varlen_func

    c, m, _ = docs
    left = -1 if window is None else window - 1  # flash-attn's window counts the keys left of the query
    return flash_attn_varlen_func(q, k, v, c, c, m, m, causal=True, window_size=(left, 0))


def torch_varlen(q, k, v, docs, window=None):
    """torch's own FlashAttention varlen kernel, the same contract. Causal is window_size=(-1, 0), a window W is
    (W - 1, 0); 2.9 takes is_causal instead (and no window); later releases ask for enable_gqa=True."""
    c, m, _ = docs
    # is_causal's default is False: without it, attention would see the whole document
    kw = {name: True for name in ("enable_gqa", "is_causal") if name in VARLEN_PARAMS}
    if "window_size" in VARLEN_PARAMS or window is not None:  # asked for a window, a release without one fails loudly
        kw["window_size"] = (-1 if window is None else window - 1, 0)
    return varlen_attn(q, k, v, c, c, m, m, **kw)


# The names varlen_attn takes: they changed between releases (torch_varlen's docstring).
VARLEN_PARAMS = frozenset(inspect.signature(varlen_attn).parameters) if varlen_attn else frozenset()


WHOLE_ROW_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def whole_rows_first(packed, backends=WHOLE_ROW_BACKENDS):
    """`packed` (a varlen kernel), except where all n documents have one length L (n * L = N: whole rows, or rows
    of equal documents) and no window cuts them: then causal SDPA over (n, heads, L, D), `backends` tried in order. An
    8,192-token layer on an H200 took 3.72 ms in cuDNN's attention against 6.59 ms in FlashAttention-2's varlen kernel
    (docs/performance.md). The test reads only host integers (the bounds' count, max_seqlen): no device sync. Compiled
    blocks take `packed` alone (compilable)."""

    def attention(q, k, v, docs, window=None):  # q (N, H, D), k/v (N, Hkv, D) -> (N, H, D)
        n, L = docs.bounds.shape[0] - 1, docs.max_seqlen
        if n * L != q.shape[0] or (window is not None and window < L):
            return packed(q, k, v, docs, window)
        rows = [t.unflatten(0, (n, L)).transpose(1, 2) for t in (q, k, v)]  # (n, heads, L, D)
        with sdpa_kernel(backends, set_priority=True):
            o = F.scaled_dot_product_attention(*rows, is_causal=True, enable_gqa=True)
        return o.transpose(1, 2).flatten(0, 1)

    attention.packed = packed  # what packed rows run (bench.py gpu names it)
    return attention


def _flash_attn_imports():
    """Whether flash-attn's varlen function really imports (not a wheel built for another torch, not flash-attn 4)."""
    flash_attn = optional.load("flash_attn", "using another attention kernel")
    return flash_attn is not None and hasattr(flash_attn, "flash_attn_varlen_func")


def varlen_attention(device, dtype, head_dim=128, windowed=False):
    """The packed-document attention for a model on `device` computing in `dtype`. The fused kernels need Ampere+,
    16 bits and head_dim <= 256; torch's also head_dim a multiple of 8, and a window argument when the model slides.
    Either fused kernel comes with whole_rows_first's batched SDPA for micro-batches of whole rows (head_dim a
    multiple of 8), in eager blocks (compilable)."""
    device = torch.device(device)
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or head_dim > 256:
        return sdpa_varlen
    if torch.cuda.get_device_capability(device)[0] < 8:  # pre-Ampere (T4, V100): no FlashAttention kernels
        return sdpa_varlen

    def whole_rows(packed):  # SDPA's fused kernels need head_dim a multiple of 8
        return whole_rows_first(packed) if head_dim % 8 == 0 else packed

    if _flash_attn_imports():
        return whole_rows(flash_varlen)
    if varlen_attn is not None and head_dim % 8 == 0 and torch.backends.cuda.is_flash_attention_available():
        if "window_size" in VARLEN_PARAMS or not windowed:
            return whole_rows(torch_varlen)
    return sdpa_varlen


def compilable(varlen):
    """The attention function to compile: the per-document loop's opaque twin, a fused kernel as it is, without
    whole_rows_first's branch (compiled, its test on the document count would guard the graph, and the first micro-batch
    of whole rows would compile every block again)."""
    return sdpa_varlen_opaque if varlen is sdpa_varlen else getattr(varlen, "packed", varlen)


@functools.cache
def compiled(function):
    """`function` (model.Block.compute) compiled once for every block, dynamic shapes, shape padding off (on CUDA it
    recompiled for every new row width: docs/internals.md), floats fixed: a block's eps, LoRA scaling and dropout
    rate never change, and traced as symbols they made every compile trace the block twice."""
    fixed_floats = torch._dynamo.config.patch(specialize_float=True)
    return fixed_floats(torch.compile(function, dynamic=True, options={"shape_padding": False}))
