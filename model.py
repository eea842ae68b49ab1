"""A Llama decoder in plain PyTorch, with Hugging Face parameter names, packed-sequence attention and a chunked loss.

The architecture
----------------
Llama (Touvron et al. 2023, https://arxiv.org/abs/2302.13971; Llama 2, https://arxiv.org/abs/2307.09288; Llama 3,
https://arxiv.org/abs/2407.21783) is a pre-norm decoder-only transformer. Token ids (B, T) become embeddings
x (B, T, hidden); each of the L blocks adds an attention and an MLP branch to that residual stream:

    x = x + Attention(RMSNorm(x))        x = x + MLP(RMSNorm(x))

and a final RMSNorm and the lm_head (hidden -> vocab, possibly sharing the embedding matrix) give the logits.

RMSNorm (https://arxiv.org/abs/1910.07467) rescales each vector by its root mean square, without centring it:
y = w * x / sqrt(mean(x^2) + eps). The statistic is taken in fp32 and the result is cast back before the weight is
applied, so bf16 models normalise exactly like the reference implementation.

RoPE (Su et al., https://arxiv.org/abs/2104.09864) encodes position by rotating query and key vectors. Channel pairs
(i, i + D/2) of a head of size D rotate by the angle p * f_i at position p, with f_i = theta^(-2i/D). The dot product
q.k then depends only on the distance between the two positions. We use the "rotate-half" pairing of the Hugging Face
checkpoints: rope(x) = x * cos + rotate_half(x) * sin, with rotate_half([a, b]) = [-b, a]. Longer-context variants
rescale the frequencies: "linear" divides every f_i by a factor; "llama3" divides only the low frequencies (long
wavelengths), leaves the high ones alone and blends the band in between. cos/sin are gathered by position id, so a
packed row whose positions restart at 0 for every document gets the right angles.

Attention uses grouped queries (GQA, https://arxiv.org/abs/2305.13245): H query heads share Hkv <= H key/value heads,
each key/value head serving H / Hkv query heads, which shrinks the KV cache by that ratio. The head size D may differ
from hidden / H. softmax(q k^T / sqrt(D)) v is computed with a causal mask.

The MLP is SwiGLU (Shazeer, https://arxiv.org/abs/2002.05202): down(silu(gate(x)) * up(x)), hidden -> inter -> hidden.

The relatives. Qwen2/2.5, Qwen3 and Mistral are this Llama with a switch or two, read from config.json's model_type:
Qwen2 adds biases to q/k/v (o_proj has none); Qwen3 normalises each head of q and k with an RMSNorm over the D channels
(one (D,) weight shared by all heads) before RoPE, and its head size is set explicitly (H * D need not equal hidden);
Mistral (v0.1) and Qwen with use_sliding_window attend within a sliding window of W tokens: query i sees keys
i - W + 1 .. i, in every layer (Mistral) or in the layers from max_window_layers on (Qwen). Llama's attention_bias puts
biases on all four projections. Families that need more than switches (Gemma's scaled embeddings, Phi's fused
projections, mixtures of experts) are refused with what they would need.

Packed rows
-----------
Fine-tuning packs several documents into one row. A document starts wherever position_ids == 0 and at every row
start; tokens attend causally within their own document only. The boundaries are found once per forward as cumulative
sequence lengths over the flattened (B*T) tokens (`Docs`), e.g. documents of lengths 5, 3, 7 give
cu_seqlens = [0, 5, 8, 15]. The function that attends over them is chosen once, when the model is built
(`varlen_attention`): FlashAttention-2 (Dao, https://arxiv.org/abs/2307.08691) where flash-attn really imports and
the GPU can run it (compute capability 8.0+, 16-bit, head size <= 256); else torch's own FlashAttention varlen kernel
(torch.nn.attention.varlen); else, on CPU and older GPUs, one causal scaled_dot_product_attention call per document,
zero-padded to one of a few lengths (`bucket`) so that the kernels meet few shapes. All three take the window. For
torch.compile the per-document loop becomes one opaque op (a torch.library custom op whose backward recomputes each
document's attention), so the compiler sees no data-dependent Python in a block.

Loss
----
With labels (already shifted: labels[b, t] is the target of position t, -100 where unsupervised) the model returns
the fp32 summed cross-entropy and the number of supervised tokens. Only supervised hidden states reach the lm_head,
in chunks of LOSS_CHUNK tokens, and the lm_head and the loss are fused: while a chunk's (chunk, vocab) fp32 logits
exist, the forward pass also turns them into the gradient of the loss for the hidden states,
dL/dh = (softmax(h W^T) - onehot(y)) W, so the logits are dropped at once and the backward pass only scales that
gradient. Full-vocabulary logits never exist for the whole batch, and no lm_head matmul is recomputed.

Generation and FLOPs
--------------------
generate keeps a `KVCache`, a preallocated (layers, 1, max_len, Hkv, D) key and value buffer: the prompt runs once,
then each new token costs one single-position forward that attends to the cached keys and values. flops_per_token
counts the model FLOPs of a frozen-base LoRA training step, the numerator of MFU.

Weights are read from Hugging Face files by hf.py; this file only defines the modules and their math.

Shapes: B batch rows, T tokens per row, N = B*T flattened tokens, H / Hkv query / key-value heads, D head size.
"""

import importlib.util
import inspect
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

try:  # torch's own varlen FlashAttention (torch >= 2.9), looked up once here: compiled blocks then read a constant
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

LOSS_CHUNK = 1024  # supervised tokens per lm_head + cross-entropy chunk
SHAPE_BUCKET = 64  # beyond this many tokens, documents (attention) and loss chunks grow in steps of it (bucket)
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
PLAIN_KEYS = ("rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id")
ROPE_KEYS = {"default": (), "linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
# The families this Llama reads, by config.json model_type, and the class name transformers gives each.
FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
FAMILIES["mistral"] = "MistralForCausalLM"
# Near relatives that need more than a switch: what each would add.
MISSING = {
    "gemma": "embeddings scaled by sqrt(hidden), (1 + w) RMSNorm weights and a GeGLU MLP",
    "gemma2": "Gemma's changes plus logit soft-capping, extra feed-forward norms and alternating window layers",
    "gemma3_text": "Gemma 2's changes plus two RoPE bases",
    "phi": "LayerNorm, a parallel attention + MLP block and partial rotary embeddings",
    "phi3": "fused qkv_proj and gate_up_proj weights",
    "mixtral": "a mixture-of-experts MLP",
    "qwen2_moe": "a mixture-of-experts MLP with a shared expert",
    "qwen3_moe": "a mixture-of-experts MLP",
    "ministral": "a sliding window that varies by layer type",
}


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear" | "llama3", "factor": ..., ...} or None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # The family switches (Qwen2/2.5, Qwen3 and Mistral are Llamas with these set; config.json says which):
    model_type: str = "llama"  # llama | qwen2 | qwen3 | mistral
    qkv_bias: bool = False  # biases on q_proj/k_proj/v_proj (always in Qwen2; attention_bias elsewhere)
    o_bias: bool = False  # a bias on o_proj (attention_bias of Llama and Qwen3)
    qk_norm: bool = False  # RMSNorm over each head of q and k, before RoPE (Qwen3)
    sliding_window: int | None = None  # W: a query in a sliding layer sees its own key and the W - 1 before it
    sliding_layers: list[int] | None = None  # the layers that slide (Mistral: all; Qwen: those >= max_window_layers)

    @classmethod
    def from_hf(cls, d, path="config.json"):
        """Read a Hugging Face config.json dict; `path` names the file in errors."""
        kind = d.get("model_type")
        if kind not in FAMILIES:
            why = f": it needs {MISSING[kind]}" if kind in MISSING else ""
            raise ValueError(f"{path}: model_type {kind!r} is not supported{why} (expected {', '.join(FAMILIES)})")
        if FAMILIES[kind] not in (d.get("architectures") or [FAMILIES[kind]]):
            raise ValueError(
                f"{path}: architectures {d['architectures']!r} is not supported (expected {FAMILIES[kind]})"
            )
        if missing := [k for k in REQUIRED_KEYS if k not in d]:
            raise ValueError(f"{path}: missing key(s) {', '.join(missing)}")
        for key, want in (("hidden_act", "silu"), ("mlp_bias", False)):
            if d.get(key, want) != want:
                raise ValueError(f"{path}: {key} = {d[key]!r} is not supported (expected {want!r})")
        heads, bias = d["num_attention_heads"], bool(d.get("attention_bias")) and kind != "mistral"
        cfg = cls(
            **{k: d[k] for k in REQUIRED_KEYS},
            **{k: d.get(k, getattr(cls, k)) for k in PLAIN_KEYS},  # absent: the field's default
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or (128 if kind == "qwen3" else d["hidden_size"] // heads),  # transformers'
            model_type=kind,
            qkv_bias=bias or kind == "qwen2",
            o_bias=bias and kind != "qwen2",
            qk_norm=kind == "qwen3",
        )
        cfg.rope_theta, cfg.rope_scaling = _rope(d, path, cfg.max_position_embeddings)
        cfg.sliding_window, cfg.sliding_layers = _windows(d, path, kind)
        return cfg

    def window(self, layer):
        """Layer `layer`'s sliding window, or None for plain causal attention."""
        return self.sliding_window if self.sliding_layers and layer in self.sliding_layers else None

    def to_hf(self):
        """A config.json dict in the classic form (top-level rope_theta + rope_scaling) every transformers reads, as
        the family's own config class spells it. Only Hugging Face keys are written, whatever else a fork stores."""
        keys = [*REQUIRED_KEYS, "num_key_value_heads", "head_dim", "rope_theta", *PLAIN_KEYS]
        kind, layers = self.model_type, self.num_hidden_layers
        d = {"architectures": [FAMILIES[kind]], "model_type": kind, "hidden_act": "silu"}
        d |= {k: getattr(self, k) for k in keys}
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        if kind in ("llama", "qwen3"):
            d["attention_bias"] = self.o_bias
        if kind == "mistral":  # written even when None: absent, transformers would assume 4096
            d["sliding_window"] = self.sliding_window
        if kind in ("qwen2", "qwen3"):
            sliding = self.sliding_layers or []
            d |= dict(use_sliding_window=bool(sliding), sliding_window=self.sliding_window)
            d["max_window_layers"] = sliding[0] if sliding else layers
            d["layer_types"] = ["sliding_attention" if i in sliding else "full_attention" for i in range(layers)]
        return d


def _rope(d, path, context):
    """(rope_theta, rope_scaling or None) of a config.json dict. transformers 5 writes rope_parameters (with
    rope_theta inside); published checkpoints carry a top-level rope_theta plus rope_scaling, whose kind is under
    "rope_type" (or "type" in older files)."""
    key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
    rope = dict(d.get(key) or {})
    theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    if kind not in ROPE_KEYS:
        raise ValueError(f"{path}: {key} type {kind!r} is not supported (expected default, linear or llama3)")
    if missing := [k for k in ROPE_KEYS[kind] if k not in rope]:
        raise ValueError(f"{path}: {key} of type {kind!r} lacks {', '.join(missing)}")
    if kind == "llama3":  # as in transformers: the pre-training length defaults to the context length
        rope.setdefault("original_max_position_embeddings", context)
    return float(theta), None if kind == "default" else {"rope_type": kind, **rope}


def _windows(d, path, kind):
    """(sliding_window, sliding layers) as transformers reads them: Mistral slides every layer (its window defaults to
    4096 when the key is absent); Qwen only with use_sliding_window, in the layers from max_window_layers on (or as
    layer_types lists them); Llama never."""
    layers = d["num_hidden_layers"]
    if kind == "mistral":
        window = d.get("sliding_window", 4096)
        return window, None if window is None else list(range(layers))
    if kind not in ("qwen2", "qwen3"):
        return None, None
    window = d.get("sliding_window") if d.get("use_sliding_window") else None
    if d.get("layer_types"):
        sliding = [i for i, t in enumerate(d["layer_types"]) if t == "sliding_attention"]
    else:
        sliding = [] if window is None else list(range(d.get("max_window_layers", 28), layers))
    if sliding and window is None:
        raise ValueError(
            f"{path}: layer_types lists sliding layers but use_sliding_window/sliding_window set no window"
        )
    return (window, sliding) if sliding else (None, None)


def rope_inv_freq(cfg, device=None):
    """The D/2 rotation frequencies f_i = theta^(-2i/D), rescaled per cfg.rope_scaling. fp32, (D/2,)."""
    d = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    s = cfg.rope_scaling
    if s and s["rope_type"] == "linear":
        inv_freq = inv_freq / s["factor"]
    elif s and s["rope_type"] == "llama3":
        old_len, factor = s["original_max_position_embeddings"], s["factor"]
        low, high = s["low_freq_factor"], s["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        # smooth = 0 at wavelength old_len / low (fully scaled), 1 at old_len / high (untouched)
        smooth = ((old_len / wavelen - low) / (high - low)).clamp(0, 1)
        inv_freq = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return inv_freq


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Docs(NamedTuple):
    """Packed-document bounds over the N = B*T flattened tokens: document i is tokens cu_seqlens[i]:cu_seqlens[i+1]."""

    cu_seqlens: torch.Tensor  # int32 (docs + 1,), on the tokens' device, for the varlen kernels
    max_seqlen: int  # the longest document
    bounds: torch.Tensor  # the same cu_seqlens on the CPU, for the per-document loop (read without a device sync)


def doc_bounds(position_ids):
    """(B, T) position ids -> Docs. A document starts where position_ids == 0 and at every row start. One host sync
    per forward (the CPU copy), shared by every layer."""
    B, T = position_ids.shape
    starts = position_ids == 0
    starts[:, 0] = True  # a row that opens mid-document still starts a new attention span
    idx = starts.flatten().nonzero().flatten()
    cu_seqlens = torch.cat([idx, idx.new_tensor([B * T])]).to(torch.int32)
    bounds = cu_seqlens.cpu()
    return Docs(cu_seqlens, int((bounds[1:] - bounds[:-1]).max()), bounds)


def causal_sdpa(q, k, v, window=None, start=0):
    """softmax(q k^T / sqrt(D)) v with q (B, H, T, D) at positions start.., k/v (B, Hkv, S, D) at positions 0..S-1.
    Query i sees the keys at or before its own position and, with a window W, only the W most recent of them."""
    T, S = q.shape[-2], k.shape[-2]
    if start == 0 and (window is None or T <= window):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    i, j = torch.arange(start, start + T, device=q.device)[:, None], torch.arange(S, device=q.device)
    mask = (j <= i) & (i - j < (window or S + 1))  # (T, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def bucket(n):
    """n >= 1 rounded up to a power of two up to SHAPE_BUCKET, to a multiple of SHAPE_BUCKET beyond: the few lengths
    that sdpa_varlen and linear_cross_entropy hand their kernels, whatever the data (powers of two keep a short
    document's padding under its own length)."""
    return 1 << (n - 1).bit_length() if n <= SHAPE_BUCKET else -(-n // SHAPE_BUCKET) * SHAPE_BUCKET


def pad_to_bucket(t):
    """t (n, ...) with zero rows appended up to bucket(n) rows; t itself when n is a bucket length already."""
    n = t.shape[0]
    return t if bucket(n) == n else F.pad(t, (0, 0) * (t.dim() - 1) + (0, bucket(n) - n))


def sdpa_varlen(q, k, v, docs, window=None):
    """Packed attention as one causal SDPA call per document. q (N, H, D), k/v (N, Hkv, D) -> (N, H, D).

    A document of L tokens is attended with zeros appended up to bucket(L) tokens. Causality hides the zero keys from
    the L real queries, and the outputs of the zero queries are dropped, so the result is the document's own
    attention. Why: PyTorch's bf16 CPU attention builds and keeps a matmul kernel for every shape it meets, so the
    hundreds of document lengths of a run keep growing the process, step after step; a few dozen buckets do not."""
    b = docs.bounds.tolist()

    # Each document as 4-D (1, heads, bucket(L), D): with 3-D inputs PyTorch's CPU attention skips its fused kernel
    # and keeps the whole (heads, L, L) attention matrix of every document for backward.
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
    """torch's own FlashAttention varlen kernel (torch.nn.attention.varlen), the same contract. Causal attention is
    window_size=(-1, 0), a window W is (W - 1, 0); the first release (2.9) takes is_causal instead (and no window).
    GQA is the kernel's own in every release (Hkv dividing H, k/v never copied up to H heads): later releases only
    ask for enable_gqa=True before they let unequal head counts through."""
    c, m, _ = docs
    kw = {"enable_gqa": True} if "enable_gqa" in VARLEN_PARAMS else {}
    if "is_causal" in VARLEN_PARAMS:  # its default is False: without it, attention would see the whole document
        kw["is_causal"] = True
    if "window_size" in VARLEN_PARAMS or window is not None:  # asked for a window, a release without one fails loudly
        kw["window_size"] = (-1 if window is None else window - 1, 0)
    return varlen_attn(q, k, v, c, c, m, m, **kw)


# The names varlen_attn takes: they changed between releases (torch_varlen's docstring).
VARLEN_PARAMS = frozenset(inspect.signature(varlen_attn).parameters) if varlen_attn else frozenset()


def _flash_attn_imports():
    """Whether flash-attn's varlen function really imports. A wheel built for another torch fails with "undefined
    symbol", and flash-attn 4's namespace package has no such function: both mean "not available", not a crash."""
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401
    except Exception as e:  # an ImportError or an OSError from a broken binary
        if importlib.util.find_spec("flash_attn") is not None:
            print(f"flash_attn is installed but does not import ({type(e).__name__}: {e}); using another kernel")
        return False
    return True


def varlen_attention(device, dtype, head_dim=128, windowed=False):
    """The packed-document attention for a model on `device` computing in `dtype`, chosen once as the file docstring
    says. torch's kernel has flash-attn's limits, and needs head_dim a multiple of 8 and a torch that takes a window
    when the model slides."""
    device = torch.device(device)
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or head_dim > 256:
        return sdpa_varlen
    if torch.cuda.get_device_capability(device)[0] < 8:  # pre-Ampere (T4, V100): no FlashAttention kernels
        return sdpa_varlen
    if _flash_attn_imports():
        return flash_varlen
    if varlen_attn is not None and head_dim % 8 == 0 and torch.backends.cuda.is_flash_attention_available():
        if "window_size" in VARLEN_PARAMS or not windowed:
            return torch_varlen
    return sdpa_varlen


def linear_cross_entropy(h, weight, labels, chunk, grad=False):
    """sum_i CE(h_i W^T, y_i) over rows h (n, hidden), chunk rows at a time; with grad=True also dL/dh (n, hidden)
    and dL/dW (None for a frozen W), from dL/dlogits = softmax(logits) - onehot(y) while each chunk's logits exist.
    A chunk of c rows is padded with zero rows to bucket(c), so the matmuls meet a few shapes over a run, not one per
    supervised-token count (see sdpa_varlen for why that matters on CPU)."""
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    grad_h = torch.empty_like(h) if grad else None
    grad_w = torch.zeros_like(weight, dtype=torch.float32) if grad and weight.requires_grad else None
    for i in range(0, labels.numel(), chunk):
        yc = labels[i : i + chunk]
        c = yc.numel()
        hc = pad_to_bucket(h[i : i + chunk])
        # hc (P, hidden): zero rows up to P = bucket(c). logits (P, vocab) fp32: the only vocabulary-wide tensor, one
        # chunk at a time.
        logits = (hc @ weight.t()).float()
        lse = logits.logsumexp(-1)  # (P,)
        loss += (lse[:c] - logits[:c].gather(1, yc[:, None])[:, 0]).sum()
        if grad:
            g = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            g[c:] = 0  # the padding rows carry no loss
            g[torch.arange(c, device=g.device), yc] -= 1
            g = g.to(h.dtype)
            grad_h[i : i + chunk] = (g @ weight.to(h.dtype))[:c]  # (c, hidden)
            if grad_w is not None:
                grad_w += (g.t() @ hc).float()  # (vocab, hidden)
            del g
        del logits  # freed before the next chunk's are made: else two chunks' would be alive at once
    return loss, grad_h, grad_w


class LinearCrossEntropy(torch.autograd.Function):
    """The lm_head and the loss fused: forward computes the loss and its gradients chunk by chunk, backward only
    scales them. Versus checkpointing each chunk this saves one (n, hidden) x (hidden, vocab) matmul per step and
    still never keeps (n, vocab) logits."""

    @staticmethod
    def forward(ctx, h, weight, labels, chunk):
        loss, ctx.grad_h, ctx.grad_w = linear_cross_entropy(h, weight, labels, chunk, grad=True)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):  # grad: d(outer loss)/d(our loss), a scalar
        grad_w = None if ctx.grad_w is None else (ctx.grad_w * grad).to(ctx.weight_dtype)
        return ctx.grad_h * grad.to(ctx.grad_h.dtype), grad_w, None, None


class KVCache:
    """Keys and values of every layer during generation: k, v (layers, B, max_len, Hkv, D), valid up to `length`."""

    def __init__(self, cfg, max_len, batch=1, dtype=torch.float32, device=None):
        shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        self.k, self.v = (torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))
        self.length = 0  # tokens already cached; the model advances it after each forward

    def update(self, layer, k, v):
        """Store this step's k, v (B, T, Hkv, D) at positions length.. and return all keys and values so far."""
        end = self.length + k.shape[1]
        self.k[layer, :, self.length : end], self.v[layer, :, self.length : end] = k, v
        return self.k[layer, :, :end], self.v[layer, :, :end]


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx, varlen=sdpa_varlen):
        super().__init__()
        self.head_dim, self.layer_idx, self.varlen = cfg.head_dim, layer_idx, varlen
        self.window = cfg.window(layer_idx)
        h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:  # one (D,) weight shared by every head, as Qwen3 has it
            self.q_norm, self.k_norm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, docs=None, cache=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim)  # (B, T, H, D)
        k = self.k_proj(x).view(B, T, -1, self.head_dim)  # (B, T, Hkv, D)
        v = self.v_proj(x).view(B, T, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin  # cos/sin (B, T, 1, D)
        if docs is not None:  # packed rows: attention confined to each document, over (N, heads, D)
            o = self.varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), docs, self.window)
            return self.o_proj(o.reshape(B, T, -1))
        start = 0 if cache is None else cache.length
        if cache is not None:  # generation: store this step's keys/values, attend to everything so far
            k, v = cache.update(self.layer_idx, k, v)
        o = causal_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.window, start)  # (B, H, T, D)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg, layer_idx, varlen=sdpa_varlen):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, varlen)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, docs=None, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, docs, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, config, varlen=sdpa_varlen):
        """varlen: the packed-document attention (see varlen_attention), fixed for the model's life."""
        super().__init__()
        self.config = config
        self.activation_checkpointing = False
        self.loss_chunk = LOSS_CHUNK  # 0: full-vocabulary logits for every position at once (the naive baseline)
        embed = nn.Embedding(config.vocab_size, config.hidden_size)
        layers = nn.ModuleList(Block(config, i, varlen) for i in range(config.num_hidden_layers))
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.model = nn.ModuleDict(dict(embed_tokens=embed, layers=layers, norm=norm))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.compiled_block = None  # set by compile_blocks

    def compile_blocks(self):
        """torch.compile the blocks' training forward (and so their backward). One graph serves every block; the
        per-document SDPA loop becomes its opaque twin, so nothing in a block breaks the graph; shapes are dynamic, so
        other document counts or lengths do not recompile. Evaluation and generation (no grad) stay eager."""
        for block in self.model.layers:
            if block.self_attn.varlen is sdpa_varlen:
                block.self_attn.varlen = sdpa_varlen_opaque
        # No shape padding: on CUDA, Inductor's choice whether to pad a half-precision matmul with an unaligned side
        # (a LoRA rank such as 2 or 12) guards on the row width, which then recompiles for every new width.
        self.compiled_block = torch.compile(Block.forward, dynamic=True, options={"shape_padding": False})

    def forward(self, input_ids, position_ids=None, labels=None, cache=None):
        """input_ids (B, T) -> logits (B, T, vocab), or (loss_sum, n_tokens) when labels (B, T) are given.

        position_ids (B, T) marks packed documents (each starts at 0). A KVCache runs one incremental generation step
        (no position_ids): the tokens continue after the cache.length already cached ones.
        """
        B, T = input_ids.shape
        docs = None if position_ids is None else doc_bounds(position_ids)  # once per forward, shared by all layers
        if position_ids is None:
            start = 0 if cache is None else cache.length
            position_ids = torch.arange(start, start + T, device=input_ids.device).expand(B, T)
        x = self.model.embed_tokens(input_ids)  # (B, T, hidden)
        angles = position_ids[..., None].float() * rope_inv_freq(self.config, input_ids.device)  # (B, T, D/2)
        angles = torch.cat((angles, angles), dim=-1)[:, :, None]  # (B, T, 1, D): broadcast over heads
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        training = torch.is_grad_enabled()
        block = self.compiled_block if self.compiled_block is not None and training else Block.__call__
        for layer in self.model.layers:
            if self.activation_checkpointing and training:
                x = checkpoint(block, layer, x, cos, sin, docs, use_reentrant=False)
            else:
                x = block(layer, x, cos, sin, docs, cache)
        if cache is not None:
            cache.length += T
        x = self.model.norm(x)
        return self.lm_head(x) if labels is None else self.loss(x, labels)

    def loss(self, h, labels):
        """h (B, T, hidden), labels (B, T) -> (fp32 summed cross-entropy, number of supervised tokens)."""
        keep = labels.flatten() != -100
        if self.loss_chunk and type(self.lm_head) is not nn.Linear:
            raise ValueError(
                f"lm_head is a {type(self.lm_head).__name__}: the chunked loss needs a plain nn.Linear head "
                "(train an adapted or quantized lm_head with chunked_loss=False)"
            )
        if not self.loss_chunk:  # naive: (B*T, vocab) fp32 logits, all kept for backward
            logits = self.lm_head(h).float().flatten(0, 1)
            return F.cross_entropy(logits, labels.flatten(), ignore_index=-100, reduction="sum"), int(keep.sum())
        h, labels = h.flatten(0, 1)[keep], labels.flatten()[keep]  # (n, hidden): only supervised tokens
        w = self.lm_head.weight
        if torch.is_grad_enabled() and (h.requires_grad or w.requires_grad):
            return LinearCrossEntropy.apply(h, w, labels, self.loss_chunk), labels.numel()
        return linear_cross_entropy(h, w, labels, self.loss_chunk)[0], labels.numel()


def find_linears(model, targets="all-linear", types=(nn.Linear,)):
    """{name: module} of the `types` modules that `targets` picks, the one rule quantize_ and add_lora_ share.

    "all-linear": every one inside the blocks (model.layers.*), never lm_head, as PEFT's "all-linear". Otherwise a
    list of names, each matching a module's full name or a "."-suffix of it ("q_proj", "layers.0.mlp.up_proj"); a
    name that matches nothing is an error, so a typo never silently leaves a layer out.
    """
    found = {n: m for n, m in model.named_modules() if isinstance(m, types)}
    if targets == "all-linear":
        return {n: m for n, m in found.items() if n.startswith("model.layers.")}
    hit = lambda n, t: n == t or n.endswith("." + t)  # noqa: E731
    for t in targets:
        if not any(hit(n, t) for n in found):
            raise ValueError(f"target module {t!r} matches no linear layer of the model")
    return {n: m for n, m in found.items() if any(hit(n, t) for t in targets)}


def flops_per_token(c, context):
    """Model FLOPs per token of a frozen-base LoRA training step at `context` tokens per document: 2N forward plus 2N
    backward (input gradients only: the frozen base has no weight gradients) over the N matmul weights, plus causal
    attention, 2 * layers * context * H*D forward (QK^T and PV at 2 FLOPs each, halved by the mask) and twice that
    backward. Recomputation by activation checkpointing is not counted (that would be hardware FLOPs)."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    n = c.num_hidden_layers * (c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size)
    n += c.hidden_size * c.vocab_size  # lm_head
    return 4 * n + 3 * 2 * c.num_hidden_layers * context * q


@torch.inference_mode()
def generate(model, prompt_ids, max_new_tokens, temperature=0.0, top_p=1.0, eos_id=None, seed=None):
    """Continue prompt_ids; returns the new tokens only (ending with the eos token if one was produced).

    Greedy when temperature == 0, else softmax(logits / temperature) restricted to the smallest set of most likely
    tokens whose probability reaches top_p (nucleus sampling, https://arxiv.org/abs/1904.09751).
    """
    weight = model.model.embed_tokens.weight
    cache = KVCache(model.config, len(prompt_ids) + max_new_tokens, dtype=weight.dtype, device=weight.device)
    stop = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    gen = None if seed is None else torch.Generator(weight.device).manual_seed(seed)
    ids, out = torch.tensor([prompt_ids], device=weight.device), []
    for _ in range(max_new_tokens):
        logits = model(ids, cache=cache)[0, -1].float()  # (vocab,)
        if temperature == 0:
            tok = int(logits.argmax())
        else:
            probs, order = torch.softmax(logits / temperature, -1).sort(descending=True)
            probs[probs.cumsum(0) - probs > top_p] = 0  # drop tokens once the mass before them exceeds top_p
            tok = int(order[torch.multinomial(probs, 1, generator=gen)])
        out.append(tok)
        if tok in stop:
            break
        ids = torch.tensor([[tok]], device=weight.device)
    return out
