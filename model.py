"""A Llama decoder in plain PyTorch, with Hugging Face parameter names, packed-sequence attention and a chunked loss.

The architecture
----------------
Llama (Touvron et al. 2023, https://arxiv.org/abs/2302.13971; Llama 2, https://arxiv.org/abs/2307.09288; Llama 3,
https://arxiv.org/abs/2407.21783) is a pre-norm decoder-only transformer. Token ids (B, T) become embeddings
x (B, T, hidden); each of the L blocks adds an attention and an MLP branch to that residual stream:

    x = x + Attention(RMSNorm(x))        x = x + MLP(RMSNorm(x))

and a final RMSNorm and the lm_head (hidden -> vocab, possibly sharing the embedding matrix) give the logits.

RMSNorm (https://arxiv.org/abs/1910.07467) rescales each vector by its root mean square, without centring it:
y = w * x / sqrt(mean(x^2) + eps), the statistic in fp32 and cast back before the weight, as the reference does.

RoPE (Su et al., https://arxiv.org/abs/2104.09864) encodes position by rotating query and key vectors. Channel pairs
(i, i + D/2) of a head of size D rotate by the angle p * f_i at position p, with f_i = theta^(-2i/D). The dot product
q.k then depends only on the distance between the two positions. We use the "rotate-half" pairing of the Hugging Face
checkpoints: rope(x) = x * cos + rotate_half(x) * sin, with rotate_half([a, b]) = [-b, a]. Longer-context variants
rescale the frequencies: "linear" divides every f_i by a factor; "llama3" divides only the low frequencies (long
wavelengths), leaves the high ones alone and blends the band in between. cos/sin are gathered by position id, so a
packed row whose positions restart at 0 for every document gets the right angles.

Attention uses grouped queries (GQA, https://arxiv.org/abs/2305.13245): H query heads share Hkv <= H key/value heads,
which shrinks the KV cache H / Hkv times. The head size D may differ from hidden / H. softmax(q k^T / sqrt(D)) v is
computed with a causal mask. The MLP is SwiGLU (Shazeer, https://arxiv.org/abs/2002.05202): down(silu(gate(x)) * up(x)),
hidden -> inter -> hidden.

Qwen2/2.5, Qwen3 and Mistral are this Llama with a switch or two (LlamaConfig's last fields, read from config.json by
support/formats/hf.py): biases on q/k/v (Qwen2) or on all four projections, an RMSNorm over each head of q and k
before RoPE (Qwen3), a sliding window of W keys in some or all layers (Mistral, Qwen).

Packed rows
-----------
Fine-tuning packs several documents into one row (pack.py). A document starts wherever position_ids == 0 and at every
row start; tokens attend causally within their document only. The bounds are found once per forward, as cumulative
sequence lengths over the flattened (B*T) tokens (`doc_bounds`), and every layer hands them to one attention call chosen
when the model is built: FlashAttention's varlen kernel on a GPU, one causal attention per document on CPU
(support/kernels/attention.py).

Loss
----
With labels (already shifted: labels[b, t] is the target of position t, -100 where unsupervised) the model returns the
fp32 summed cross-entropy and the number of supervised tokens. Only supervised hidden states reach the lm_head, in
chunks of LOSS_CHUNK tokens, with the lm_head and the loss fused: while a chunk's (chunk, vocab) fp32 logits exist, the
forward also turns them into the loss's gradient for the hidden states, dL/dh = (softmax(h W^T) - onehot(y)) W, so the
logits are dropped at once and the backward only scales that gradient. Full-vocabulary logits never exist for the whole
batch, and no lm_head matmul is recomputed.

Memory for long sequences
-------------------------
Autograd keeps what each block's backward reads, about 16h + 6i bytes a token and block in bf16 (h hidden, i
intermediate; support/accounting/memory.py counts it, LoRA's share too). Activation checkpointing (Chen et al. 2016,
https://arxiv.org/abs/1604.06174) keeps only each block's input, 2h bytes, and recomputes the block in backward: one
more forward for a memory that no longer grows with depth. What still grows with the sequence is the one block alive
in backward, mostly its MLP (three (T, i) tensors), and the inputs kept for all blocks. A tiled MLP (as in Arctic Long
Sequence Training, https://arxiv.org/abs/2506.13996) runs the MLP over tiles of `mlp_tile` tokens, each recomputed in
backward on its own, so the (T, i) tensors exist for one tile; offloading keeps the checkpointed inputs in CPU memory
instead of the GPU's (support/kernels/long_context.py, both).

Generation (support/evaluation/sampling.py) keeps a KV cache, a preallocated (layers, B, max_len, Hkv, D) key and value
buffer: the prompt runs once, then each new token costs a one-position forward against the cache. A batch of prompts is
left-padded to one length; the cache's `pad` says how many, so positions start at each row's first real token and no
query attends to padding.

Shapes: B batch rows, T tokens per row, N = B*T flattened tokens, H / Hkv query / key-value heads, D head size.
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

LOSS_CHUNK = 1024  # supervised tokens per lm_head + cross-entropy chunk


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
    # The family switches (Qwen2/2.5, Qwen3 and Mistral set them; config.json says which):
    model_type: str = "llama"  # llama | qwen2 | qwen3 | mistral
    qkv_bias: bool = False  # biases on q/k/v_proj (always in Qwen2; attention_bias elsewhere)
    o_bias: bool = False  # a bias on o_proj (attention_bias of Llama and Qwen3)
    qk_norm: bool = False  # RMSNorm over each head of q and k, before RoPE (Qwen3)
    sliding_window: int | None = None  # W: a sliding layer's query sees its key and the W - 1 before
    sliding_layers: list[int] | None = None  # sliding layers (Mistral: all; Qwen: from max_window_layers)

    def window(self, layer):
        """Layer `layer`'s sliding window, or None for plain causal attention."""
        return self.sliding_window if self.sliding_layers and layer in self.sliding_layers else None


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
        # smooth: 0 at wavelength old_len / low (scaled), 1 at old_len / high (untouched)
        smooth = ((old_len / wavelen - low) / (high - low)).clamp(0, 1)
        inv_freq = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return inv_freq


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attend(NamedTuple):
    """Which keys each query attends to: the earlier keys of its own packed document (`docs`), or those a mask allows
    (`mask`, rl.py's answers sharing one prompt), or, with neither, every earlier key of its row."""

    docs: Docs | None = None  # from doc_bounds
    mask: torch.Tensor | None = None  # (B, T, T) bool: True where query t may see key s


CAUSAL = Attend()  # a row is one document


def doc_bounds(position_ids):
    """(B, T) position ids -> Docs. A document starts where position_ids == 0 and at every row start. One host sync
    per forward (the CPU copy), for every layer."""
    B, T = position_ids.shape
    starts = position_ids == 0
    starts[:, 0] = True  # a row opening mid-document starts a new span
    idx = starts.flatten().nonzero().flatten()
    cu_seqlens = torch.cat([idx, idx.new_tensor([B * T])]).to(torch.int32)
    bounds = cu_seqlens.cpu()
    return Docs(cu_seqlens, int((bounds[1:] - bounds[:-1]).max()), bounds)


def linear_cross_entropy(h, weight, labels, chunk, grad=False):
    """sum_i CE(h_i W^T, y_i) over rows h (n, hidden), chunk rows at a time; with grad=True also dL/dh (n, hidden)
    and dL/dW (None for a frozen W), from dL/dlogits = softmax(logits) - onehot(y) while each chunk's logits exist."""
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    grad_h = torch.empty_like(h) if grad else None
    grad_w = torch.zeros_like(weight, dtype=torch.float32) if grad and weight.requires_grad else None
    for i in range(0, labels.numel(), chunk):
        hc, yc = h[i : i + chunk], labels[i : i + chunk]  # (c, hidden), (c,)
        logits = (hc @ weight.t()).float()  # (c, vocab) fp32: the only vocabulary-wide tensor
        lse = logits.logsumexp(-1)  # (c,)
        loss += (lse - logits.gather(1, yc[:, None])[:, 0]).sum()
        if grad:
            g = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            g[torch.arange(yc.numel(), device=g.device), yc] -= 1
            g = g.to(h.dtype)
            grad_h[i : i + chunk] = g @ weight.to(h.dtype)  # (c, hidden)
            if grad_w is not None:
                grad_w += (g.t() @ hc).float()  # (vocab, hidden)
            del g
        del logits  # freed before the next chunk's: never two chunks' alive at once
    return loss, grad_h, grad_w


class LinearCrossEntropy(torch.autograd.Function):
    """The lm_head and the loss fused: forward computes the loss and its gradients chunk by chunk, backward only
    scales them. Against checkpointing each chunk this saves an (n, hidden) x (hidden, vocab) matmul a step, and
    never keeps (n, vocab) logits either."""

    @staticmethod
    def forward(ctx, h, weight, labels, chunk, cross_entropy):  # linear_cross_entropy or its CPU wrap
        loss, ctx.grad_h, ctx.grad_w = cross_entropy(h, weight, labels, chunk, grad=True)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):  # grad: d(outer loss)/d(our loss), a scalar
        grad_h, grad_w = ctx.grad_h, ctx.grad_w
        ctx.grad_h = ctx.grad_w = None  # freed once used, not kept through the blocks' backward
        grad_w = None if grad_w is None else (grad_w * grad).to(ctx.weight_dtype)
        return grad_h * grad.to(grad_h.dtype), grad_w, None, None, None


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
        assert cfg.num_attention_heads % cfg.num_key_value_heads == 0, "each key/value head serves whole query heads"
        self.head_dim = d = cfg.head_dim
        self.layer_idx = layer_idx
        self.varlen = varlen
        self.window = cfg.window(layer_idx)
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:  # one (D,) weight for every head, as Qwen3 has it
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attend=CAUSAL, cache=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim)  # (B, T, H, D)
        k = self.k_proj(x).view(B, T, -1, self.head_dim)  # (B, T, Hkv, D)
        v = self.v_proj(x).view(B, T, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin  # cos/sin (B, T, 1, D)
        if attend.docs is not None:  # packed rows: within each document, (N, H, D)
            o = self.varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), attend.docs, self.window)
            return self.o_proj(o.reshape(B, T, -1))
        start, pad = (0, None) if cache is None else (cache.length, cache.pad)
        if cache is not None:  # generation: cache this step's keys/values, attend to all
            k, v = cache.update(self.layer_idx, k, v)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, D)
        if attend.mask is not None:  # (B, T, T): the keys each query sees
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attend.mask[:, None], enable_gqa=True)
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
        # Compiled where gradients are recorded (evaluation and generation stay eager), inside the block's call:
        # hooks on the block (FSDP gathering its weights) run around the graph.
        compute = compiled(Block.compute) if self.compiled and torch.is_grad_enabled() else Block.compute
        return compute(self, x, cos, sin, attend, cache, mlp_tile)

    def compute(self, x, cos, sin, attend, cache, mlp_tile):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend, cache)
        h = self.post_attention_layernorm(x)
        return x + (tiled_mlp(self.mlp, h, mlp_tile) if mlp_tile else self.mlp(h))  # tiles: long_context.py


@dataclass(frozen=True)
class Options:
    """How the training forward runs, fixed at build time (train.py's settings of these names)."""

    checkpointing: bool = False  # recompute each block in backward, keeping only its input
    offload_checkpoints: bool = False  # ... and keep those inputs in CPU memory
    mlp_tile: int = 0  # each MLP over tiles of this many tokens of a row (0: whole rows)
    loss_chunk: int = LOSS_CHUNK  # supervised tokens per lm_head + loss chunk (0: all logits at once)
    compile: bool = False  # each block's training forward through torch.compile


class Llama(nn.Module):
    def __init__(self, config, varlen=sdpa_varlen, options=None):
        """varlen: the packed-document attention (see varlen_attention); options: how the training forward runs
        (default Options()). Both fixed for the model's life."""
        super().__init__()
        self.config = config
        self.options = options = options or Options()
        # Where attention loops over documents (CPU), the loss's chunks are padded to a few lengths too
        # (support/kernels/attention.py: CPU kernels keep state for every shape they meet).
        self.cross_entropy = in_buckets(linear_cross_entropy) if varlen is sdpa_varlen else linear_cross_entropy
        varlen = compilable(varlen) if options.compile else varlen  # the per-document loop as one op
        embed = nn.Embedding(config.vocab_size, config.hidden_size)
        layers = nn.ModuleList(Block(config, i, varlen, options.compile) for i in range(config.num_hidden_layers))
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.model = nn.ModuleDict(dict(embed_tokens=embed, layers=layers, norm=norm))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, position_ids=None, labels=None, only=None, mask=None):
        """input_ids (B, T) -> logits (B, T, vocab), or (loss_sum, n_tokens) given labels (B, T), or the logits
        (n, vocab) at `only` (n,), indices into the B*T positions (rl.py's answer tokens: no (B, T, vocab)).

        position_ids (B, T) marks packed documents (each starts at 0); without them a row is one document. A mask
        (B, T, T), True where query t may see key s, replaces the documents (rl.py: answers sharing a prompt; no
        sliding window then). In training (with gradients) the options apply: checkpointing (offloaded), MLP tiles,
        compiled blocks."""
        B, T = input_ids.shape
        if mask is not None and any((layer.self_attn.window or T) < T for layer in self.model.layers):
            raise ValueError(f"a mask of {T} tokens in a model with a shorter sliding window: not supported")
        packed = position_ids is not None and mask is None
        attend = Attend(doc_bounds(position_ids) if packed else None, mask)  # for every layer
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        x, cos, sin = self.embed(input_ids, position_ids)
        opts, training = self.options, self.training and torch.is_grad_enabled()
        tile = opts.mlp_tile if training and opts.mlp_tile < T else 0
        checkpointing = opts.checkpointing and training
        with OffloadedSaves(x.device) if checkpointing and opts.offload_checkpoints else nullcontext():
            for layer in self.model.layers:
                if checkpointing:  # keep only the block's input (offloaded: in CPU memory)
                    x = checkpoint(layer, x, cos, sin, attend, None, tile, use_reentrant=False)
                else:
                    x = layer(x, cos, sin, attend, None, tile)
        x = self.model.norm(x if only is None else x.flatten(0, 1)[only])
        return self.lm_head(x) if labels is None else self.loss(x, labels)

    def embed(self, input_ids, position_ids):
        """The token embeddings x (B, T, hidden) and RoPE's cos and sin (B, T, 1, D) at `position_ids`."""
        x = self.model.embed_tokens(input_ids)
        angles = position_ids[..., None].float() * rope_inv_freq(self.config, input_ids.device)  # (B, T, D/2)
        angles = torch.cat((angles, angles), dim=-1)[:, :, None]  # (B, T, 1, D): broadcast over heads
        return x, angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    def decode(self, input_ids, cache):
        """Generation: input_ids (B, T) continue the cache.length tokens the KV cache holds (a prompt, then a token at
        a time); the logits (B, 1, vocab) of the last position only, all that picks the next token (the head over the
        prompt's other positions would cost T times as much)."""
        B, T = input_ids.shape
        position_ids = torch.arange(cache.length, cache.length + T, device=input_ids.device).expand(B, T)
        if cache.pad is not None:  # a left-padded row's first real token is position 0
            position_ids = (position_ids - cache.pad[:, None]).clamp(min=0)
        x, cos, sin = self.embed(input_ids, position_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, cache=cache)
        cache.length += T
        return self.lm_head(self.model.norm(x[:, -1:]))

    def loss(self, h, labels):
        """h (B, T, hidden), labels (B, T) -> (fp32 summed cross-entropy, number of supervised tokens)."""
        keep = labels.flatten() != -100
        chunk = self.options.loss_chunk
        if chunk and type(self.lm_head) is not nn.Linear:
            raise ValueError(
                f"lm_head is a {type(self.lm_head).__name__}: the chunked loss needs a plain nn.Linear head "
                "(train an adapted or quantized lm_head with chunked_loss=False)"
            )
        if not chunk:  # naive: (B*T, vocab) fp32 logits, kept for backward
            logits = self.lm_head(h).float().flatten(0, 1)
            return F.cross_entropy(logits, labels.flatten(), ignore_index=-100, reduction="sum"), int(keep.sum())
        h, labels = h.flatten(0, 1)[keep], labels.flatten()[keep]  # (n, hidden): only supervised tokens
        w, cross_entropy = self.lm_head.weight, self.cross_entropy
        if torch.is_grad_enabled() and (h.requires_grad or w.requires_grad):
            return LinearCrossEntropy.apply(h, w, labels, chunk, cross_entropy), labels.numel()
        return cross_entropy(h, w, labels, chunk)[0], labels.numel()


def find_linears(model, targets="all-linear", types=(nn.Linear,)):
    """{name: module} of the `types` modules that `targets` picks, the one rule quantize_ and add_lora_ share.

    "all-linear": every one inside the blocks (model.layers.*), never lm_head, as PEFT's "all-linear". Otherwise a
    list of names, each matching a module's full name or a "."-suffix of it ("q_proj", "layers.0.mlp.up_proj"); a
    name that matches nothing is an error: a typo never silently leaves a layer out.
    """
    found = {n: m for n, m in model.named_modules() if isinstance(m, types)}
    if targets == "all-linear":
        return {n: m for n, m in found.items() if n.startswith("model.layers.")}
    hit = lambda n, t: n == t or n.endswith("." + t)  # noqa: E731
    for t in targets:
        if not any(hit(n, t) for n in found):
            raise ValueError(f"target module {t!r} matches no linear layer of the model")
    return {n: m for n, m in found.items() if any(hit(n, t) for t in targets)}
