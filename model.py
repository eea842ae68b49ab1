"""A Llama decoder in plain PyTorch: Hugging Face names, packed rows, a chunked loss.

Llama (https://arxiv.org/abs/2302.13971, 2307.09288, 2407.21783) is a pre-norm
decoder-only transformer: token ids (B, T) become embeddings x (B, T, hidden), each of L
blocks adds an attention and an MLP branch to that residual stream, and a final RMSNorm
and the lm_head (hidden -> vocab, maybe tied to the embedding) give the logits:

    x = x + Attention(RMSNorm(x))        x = x + MLP(RMSNorm(x))

RMSNorm (https://arxiv.org/abs/1910.07467): y = w * x / sqrt(mean(x^2) + eps), in fp32,
cast back before w. RoPE (https://arxiv.org/abs/2104.09864) turns channel pairs
(i, i + D/2) of each query and key head by p * f_i at position p, f_i = theta^(-2i/D), so
q.k depends only on the distance: rope(x) = x * cos + rotate_half(x) * sin (Hugging
Face's pairing). "linear" scaling divides all f_i by a factor, "llama3" the low ones,
blending the band between. cos/sin are gathered by position id, so positions restarting
in a packed row get their own angles.

Attention has grouped queries (GQA, https://arxiv.org/abs/2305.13245): H query heads share
Hkv key/value heads, a KV cache H / Hkv times smaller; causal softmax(q k^T / sqrt(D)) v.
The MLP is SwiGLU (https://arxiv.org/abs/2002.05202): down(silu(gate(x)) * up(x)).
Qwen2/2.5, Qwen3 and Mistral add biases, per-head q/k RMSNorm or sliding windows
(LlamaConfig's last fields).

Packed rows (pack.py): a document starts where position_ids == 0 and at each row start;
tokens attend causally within it. doc_bounds finds the bounds once per forward, for the
attention chosen at build time: a varlen kernel on a GPU, a loop over documents on CPU.

Loss: with labels (pre-shifted, -100 unsupervised), the fp32 summed cross-entropy and the
number of supervised tokens. Only supervised hidden states reach the lm_head, LOSS_CHUNK
at a time, head and loss fused: while a chunk's fp32 logits exist, forward turns them into
the gradient dL/dh = (softmax(h W^T) - onehot(y)) W; backward only scales it.

Long rows (Options): activation checkpointing (https://arxiv.org/abs/1604.06174), a tiled
MLP (https://arxiv.org/abs/2506.13996), offloading (support/kernels/long_context.py).

Shapes: B rows, T tokens a row, N = B*T, H / Hkv query / key-value heads, D head size.
"""

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from support.kernels.attention import Docs, causal_sdpa, compilable, compiled, in_buckets, sdpa_varlen
from support.kernels.long_context import OffloadedSaves, tiled_mlp

LOSS_CHUNK = 1024  # supervised tokens per lm_head + loss chunk


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
    rope_scaling: dict | None = None  # {"rope_type": "linear" | "llama3", "factor": ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # Family switches (Qwen2/2.5, Qwen3, Mistral), from config.json:
    model_type: str = "llama"  # llama | qwen2 | qwen3 | mistral
    qkv_bias: bool = False  # q/k/v_proj biases (Qwen2: always; others: attention_bias)
    o_bias: bool = False  # an o_proj bias (attention_bias: Llama, Qwen3)
    qk_norm: bool = False  # RMSNorm per head of q and k, before RoPE (Qwen3)
    sliding_window: int | None = None  # W: a query sees its key and the W - 1 before
    sliding_layers: list[int] | None = None  # Mistral: all; Qwen: from max_window_layers

    def window(self, layer):
        """Layer `layer`'s sliding window, or None for plain causal attention."""
        return self.sliding_window if layer in (self.sliding_layers or ()) else None


def rope_inv_freq(cfg, device=None):
    """The D/2 frequencies f_i = theta^(-2i/D), fp32, rescaled per cfg.rope_scaling."""
    d = cfg.head_dim
    exponents = torch.arange(0, d, 2, device=device, dtype=torch.float32) / d  # 2i/D
    inv_freq = 1.0 / cfg.rope_theta**exponents
    s = cfg.rope_scaling
    if s and s["rope_type"] == "linear":
        inv_freq = inv_freq / s["factor"]
    elif s and s["rope_type"] == "llama3":
        old_len = s["original_max_position_embeddings"]
        low = s["low_freq_factor"]
        high = s["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        # smooth: 0 at wavelength old_len / low (scaled), 1 at old_len / high (untouched)
        smooth = ((old_len / wavelen - low) / (high - low)).clamp(0, 1)
        inv_freq = (1 - smooth) * inv_freq / s["factor"] + smooth * inv_freq
    return inv_freq


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attend(NamedTuple):
    """The keys each query sees: the earlier ones of its packed document (`docs`), those a mask
    allows (`mask`: rl.py's answers sharing a prompt), or else every earlier key of the row."""

    docs: Docs | None = None  # from doc_bounds
    mask: torch.Tensor | None = None  # (B, T, T) bool: True where query t may see key s


CAUSAL = Attend()  # a row is one document


def doc_bounds(position_ids):
    """(B, T) position ids -> Docs: documents start at position 0 and at each row start. One host
    sync (the CPU copy) per forward, for all layers."""
    B, T = position_ids.shape
    starts = position_ids == 0
    starts[:, 0] = True  # a row opening mid-document starts a new span
    idx = starts.flatten().nonzero().flatten()
    cu_seqlens = torch.cat([idx, idx.new_tensor([B * T])]).to(torch.int32)
    bounds = cu_seqlens.cpu()
    return Docs(cu_seqlens, int((bounds[1:] - bounds[:-1]).max()), bounds)


def linear_cross_entropy(h, weight, labels, chunk, grad=False):
    """sum_i CE(h_i W^T, y_i) over rows h (n, hidden), `chunk` at a time; with grad=True also
    dL/dh (n, hidden) and dL/dW (None if W is frozen): dL/dlogits = softmax - onehot(y)."""
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    grad_h = torch.empty_like(h) if grad else None
    train_w = grad and weight.requires_grad
    grad_w = torch.zeros_like(weight, dtype=torch.float32) if train_w else None
    for i in range(0, labels.numel(), chunk):
        hc = h[i : i + chunk]  # (c, hidden)
        yc = labels[i : i + chunk]  # (c,)
        logits = (hc @ weight.t()).float()  # (c, vocab) fp32, the only vocab-wide tensor
        lse = logits.logsumexp(-1)  # (c,)
        loss += (lse - logits.gather(1, yc[:, None])[:, 0]).sum()
        if grad:
            g = logits.sub_(lse[:, None]).exp_()  # softmax, in place
            g[torch.arange(yc.numel(), device=g.device), yc] -= 1
            g = g.to(h.dtype)
            grad_h[i : i + chunk] = g @ weight.to(h.dtype)  # (c, hidden)
            if grad_w is not None:
                grad_w += (g.t() @ hc).float()  # (vocab, hidden)
            del g
        del logits  # freed before the next chunk's: one alive at a time
    return loss, grad_h, grad_w


class LinearCrossEntropy(torch.autograd.Function):
    """lm_head and loss fused: forward makes the loss and its gradients, backward scales them."""

    @staticmethod
    def forward(ctx, h, weight, labels, chunk, cross_entropy):  # linear_cross_entropy or a wrap
        loss, ctx.grad_h, ctx.grad_w = cross_entropy(h, weight, labels, chunk, grad=True)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):  # grad: d(outer loss)/d(our loss), a scalar
        grad_h = ctx.grad_h
        grad_w = ctx.grad_w
        ctx.grad_h = ctx.grad_w = None  # freed now, not held through the blocks' backward
        grad_w = None if grad_w is None else (grad_w * grad).to(ctx.weight_dtype)
        return grad_h * grad.to(grad_h.dtype), grad_w, None, None, None


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        inv_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (xf * inv_rms).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx, varlen=sdpa_varlen):
        super().__init__()
        H = cfg.num_attention_heads
        Hkv = cfg.num_key_value_heads
        D = cfg.head_dim  # may differ from hidden / H
        assert H % Hkv == 0, "each key/value head serves whole query heads"
        self.head_dim = D
        self.layer_idx = layer_idx
        self.varlen = varlen
        self.window = cfg.window(layer_idx)
        self.q_proj = nn.Linear(cfg.hidden_size, H * D, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, Hkv * D, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, Hkv * D, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(H * D, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:  # one (D,) weight for all heads (Qwen3)
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attend=CAUSAL, cache=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim)  # (B, T, H, D)
        k = self.k_proj(x).view(B, T, -1, self.head_dim)  # (B, T, Hkv, D)
        v = self.v_proj(x).view(B, T, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = q * cos + rotate_half(q) * sin  # RoPE; cos/sin (B, T, 1, D)
        k = k * cos + rotate_half(k) * sin
        if attend.docs is not None:  # packed rows: within each document
            q, k, v = (t.flatten(0, 1) for t in (q, k, v))  # (N, heads, D)
            o = self.varlen(q, k, v, attend.docs, self.window)
            return self.o_proj(o.reshape(B, T, -1))
        start = 0 if cache is None else cache.length
        pad = None if cache is None else cache.pad
        # generation: cache this step's keys and values, attend to all
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, D)
        if attend.mask is not None:
            mask = attend.mask[:, None]  # (B, 1, T, T)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        else:
            o = causal_sdpa(q, k, v, self.window, start, pad)
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
    def __init__(self, cfg, layer_idx, varlen=sdpa_varlen, compiled=False):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, varlen)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.compiled = compiled  # the training forward through torch.compile

    def forward(self, x, cos, sin, attend=CAUSAL, cache=None, mlp_tile=0):
        # Compiled only with gradients, inside the call: hooks (FSDP's gathering) run outside.
        eager = not (self.compiled and torch.is_grad_enabled())
        compute = Block.compute if eager else compiled(Block.compute)
        return compute(self, x, cos, sin, attend, cache, mlp_tile)

    def compute(self, x, cos, sin, attend, cache, mlp_tile):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend, cache)
        h = self.post_attention_layernorm(x)
        return x + (tiled_mlp(self.mlp, h, mlp_tile) if mlp_tile else self.mlp(h))


@dataclass(frozen=True)
class Options:
    """How the training forward runs, fixed at build time (train.py's settings)."""

    checkpointing: bool = False  # recompute each block in backward, keeping only its input
    offload_checkpoints: bool = False  # ... and keep those inputs in CPU memory
    mlp_tile: int = 0  # MLP tiles of this many tokens (0: whole rows)
    loss_chunk: int = LOSS_CHUNK  # 0: all logits at once
    compile: bool = False  # blocks' training forward through torch.compile


class Llama(nn.Module):
    def __init__(self, config, varlen=sdpa_varlen, options=None):
        """varlen: the packed-document attention (support/kernels/choice.py); options: how the
        training forward runs (default Options()); both fixed for the model's life."""
        super().__init__()
        options = options or Options()
        self.config = config
        self.options = options
        # On CPU (attention per document) the loss pads its chunks to a few lengths too: CPU
        # kernels keep state for every shape they meet.
        loss_fn = linear_cross_entropy
        self.cross_entropy = in_buckets(loss_fn) if varlen is sdpa_varlen else loss_fn
        varlen = compilable(varlen) if options.compile else varlen  # the loop as one op
        n = config.num_hidden_layers
        embed = nn.Embedding(config.vocab_size, config.hidden_size)
        layers = nn.ModuleList(Block(config, i, varlen, options.compile) for i in range(n))
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.model = nn.ModuleDict(dict(embed_tokens=embed, layers=layers, norm=norm))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, position_ids=None, labels=None, only=None, mask=None):
        """input_ids (B, T) -> logits (B, T, vocab); with labels (B, T), (loss_sum, n_tokens);
        with `only` (n,), indices into the B*T positions, the logits (n, vocab) there (rl.py).

        position_ids (B, T) mark packed documents (each from 0), else a row is one document. A
        mask (B, T, T), True where query t may see key s, replaces them (rl.py: answers sharing
        a prompt; no sliding window). Training with gradients applies the options."""
        B, T = input_ids.shape
        windows = (layer.self_attn.window or T for layer in self.model.layers)
        if mask is not None and any(w < T for w in windows):
            msg = f"a mask of {T} tokens in a model with a shorter sliding window: not supported"
            raise ValueError(msg)
        packed = position_ids is not None and mask is None
        attend = Attend(doc_bounds(position_ids) if packed else None, mask)  # for every layer
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        x, cos, sin = self.embed(input_ids, position_ids)
        opts = self.options
        training = self.training and torch.is_grad_enabled()
        tile = opts.mlp_tile if training and opts.mlp_tile < T else 0
        checkpointing = opts.checkpointing and training
        offload = checkpointing and opts.offload_checkpoints
        with OffloadedSaves(x.device) if offload else nullcontext():
            for layer in self.model.layers:
                if checkpointing:  # keep only the block's input (offloaded: on CPU)
                    x = checkpoint(layer, x, cos, sin, attend, None, tile, use_reentrant=False)
                else:
                    x = layer(x, cos, sin, attend, None, tile)
        x = self.model.norm(x if only is None else x.flatten(0, 1)[only])
        return self.lm_head(x) if labels is None else self.loss(x, labels)

    def embed(self, input_ids, position_ids):
        """Embeddings x (B, T, hidden), and RoPE's cos and sin (B, T, 1, D) at the positions."""
        x = self.model.embed_tokens(input_ids)
        inv_freq = rope_inv_freq(self.config, input_ids.device)  # (D/2,)
        angles = position_ids[..., None].float() * inv_freq  # (B, T, D/2)
        angles = torch.cat((angles, angles), dim=-1)[:, :, None]  # (B, T, 1, D): for every head
        return x, angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    def decode(self, input_ids, cache):
        """Generation: input_ids (B, T) after the KV cache's cache.length tokens (a prompt, then a
        token at a time) -> the last position's logits (B, 1, vocab), all the next token needs."""
        B, T = input_ids.shape
        start = cache.length
        position_ids = torch.arange(start, start + T, device=input_ids.device).expand(B, T)
        if cache.pad is not None:  # a left-padded row's first real token is position 0
            position_ids = (position_ids - cache.pad[:, None]).clamp(min=0)
        x, cos, sin = self.embed(input_ids, position_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, cache=cache)
        cache.length += T
        return self.lm_head(self.model.norm(x[:, -1:]))

    def loss(self, h, labels):
        """h (B, T, hidden), labels (B, T) -> (fp32 summed cross-entropy, supervised tokens)."""
        keep = labels.flatten() != -100
        chunk = self.options.loss_chunk
        if chunk and type(self.lm_head) is not nn.Linear:
            name = type(self.lm_head).__name__
            raise ValueError(
                f"lm_head is a {name}: the chunked loss needs a plain nn.Linear head "
                "(train an adapted or quantized lm_head with chunked_loss=False)"
            )
        if not chunk:  # naive: (B*T, vocab) fp32 logits, kept for backward
            logits = self.lm_head(h).float().flatten(0, 1)
            loss = F.cross_entropy(logits, labels.flatten(), ignore_index=-100, reduction="sum")
            return loss, int(keep.sum())
        h = h.flatten(0, 1)[keep]  # (n, hidden): only supervised tokens
        labels = labels.flatten()[keep]
        w = self.lm_head.weight
        if torch.is_grad_enabled() and (h.requires_grad or w.requires_grad):
            loss = LinearCrossEntropy.apply(h, w, labels, chunk, self.cross_entropy)
            return loss, labels.numel()
        return self.cross_entropy(h, w, labels, chunk)[0], labels.numel()


def find_linears(model, targets="all-linear", types=(nn.Linear,)):
    """{name: module} of the `types` modules `targets` picks, for quantize_ and add_lora_ both.
    "all-linear": those in the blocks, not lm_head (as PEFT). Else names, each matching a full
    name or a "."-suffix ("q_proj", "layers.0.mlp.up_proj"); a typo matching none is an error."""
    found = {n: m for n, m in model.named_modules() if isinstance(m, types)}
    if targets == "all-linear":
        return {n: m for n, m in found.items() if n.startswith("model.layers.")}
    hits = {t: [n for n in found if n == t or n.endswith("." + t)] for t in targets}
    if missing := [t for t, names in hits.items() if not names]:
        raise ValueError(f"target module {missing[0]!r} matches no linear layer of the model")
    picked = {n for names in hits.values() for n in names}
    return {n: m for n, m in found.items() if n in picked}
