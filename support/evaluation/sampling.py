"""How does a fine-tuned model continue a prompt?

Through the model's KV cache, greedy or with nucleus sampling (Holtzman et al. 2019, https://arxiv.org/abs/1904.09751).
`generate_batch` answers many prompts at once (left-padded, finished rows dropped), under `dense_weights` in evaluation.
"""

from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

import lora
import quant
from support.data.tokenizer import render
from support.kernels import choice


class KVCache:
    """Keys and values of every layer during generation: k, v (layers, B, max_len, Hkv, D), valid up to `length`."""

    def __init__(self, cfg, max_len, batch=1, dtype=torch.float32, device=None, pad=None):
        shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        self.k, self.v = (torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))
        self.length = 0  # tokens already cached; the model advances it after each forward
        self.pad = pad  # (B,) left-padding positions of each row of a batch of prompts (None: none), never attended

    def update(self, layer, k, v):
        """Store this step's k, v (B, T, Hkv, D) at positions length.. and return all keys and values so far."""
        end = self.length + k.shape[1]
        self.k[layer, :, self.length : end], self.v[layer, :, self.length : end] = k, v
        return self.k[layer, :, :end], self.v[layer, :, :end]


COMPACT = 0.1  # drop finished rows from the batch once they are this share of it (each drop copies the cache)


def prompt_and_answer(model, tok, example, template, max_new_tokens, autocast) -> dict:
    """{"prompt", "answer"}: an example's prompt as in training and the greedy answer, in eval mode (no dropout)."""
    text, _, bos = render(example, tok, template)
    model.eval()
    with autocast():
        ids = generate_batch(model, [tok.encode(text, bos=bos)], max_new_tokens, eos_id=tok.eos_id)[0]
    model.train()
    return dict(prompt=text, answer=tok.decode(ids))


FEW_ROWS = 64  # a decode step's rows (B * T) at most: DecodeLinear's transposed product


class DecodeLinear(nn.Linear):
    """A frozen fp32 linear for generation, y = x W^T + b. For at most FEW_ROWS rows it computes (W x^T)^T: the same
    products summed in another order, which MKL's GEMM runs faster on some CPUs (choice.few_rows_transposed)."""

    def forward(self, x):  # x (..., in) -> (..., out)
        rows = x.shape[:-1].numel()
        if rows > FEW_ROWS:
            return super().forward(x)
        y = (self.weight @ x.reshape(rows, -1).T).T.reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


@torch.no_grad()
def decode_linear(m, transposed=False) -> nn.Linear:
    """`m` (an NF4 or LoRA linear, or lm_head) as one frozen linear, a DecodeLinear where `transposed` and in fp32 (the
    case measured): its dequantized weight, its adapter's scale * B @ A added once (a decode step then skips the
    adapter's two small products and their thread wake-ups)."""
    w = m.dequantize() if isinstance(m, quant.NF4Linear) else m.weight.detach()
    if isinstance(m, lora.LORA) and m.enabled:
        w = lora.merged_weight(m, w)
    return lora.frozen_linear(w, m.bias, DecodeLinear if transposed and w.dtype == torch.float32 else nn.Linear)


@contextmanager
def dense_weights(model):
    """`model` with every NF4 or LoRA linear, and lm_head, swapped for a frozen linear (dequantized, adapters merged;
    a DecodeLinear where choice.few_rows_transposed), restored on exit: the same function without dequantizing on
    every call, for the dense weights' memory (a dense LoRA linear's merged weight is a copy too). Elsewhere than on
    CPU, or sharded, `model` as it is: CUDA's NF4 kernel dequantizes fast, an 8B model's dense copy may not fit beside
    the run, and a rank holds a part."""
    if model.model.embed_tokens.weight.device.type != "cpu" or isinstance(model, FSDPModule):
        yield model
        return
    swapped = {n: m for n, m in model.named_modules() if isinstance(m, (quant.NF4Linear, *lora.LORA))}
    swapped["lm_head"] = model.lm_head
    transposed = choice.few_rows_transposed()
    try:
        for name, m in swapped.items():
            model.set_submodule(name, decode_linear(m, transposed))
        yield model
    finally:
        for name, m in swapped.items():
            model.set_submodule(name, m)


@torch.inference_mode()
def generate_batch(model, prompts, max_new_tokens, eos_id=None, done=None, pad_id=0, temperature=0.0, top_p=1.0,
                   seed=None):  # fmt: skip
    """Each prompt's new tokens (ending with an eos id if one was produced), as next_tokens picks them, all prompts at
    once, seeded by `seed`. done(i, new_ids) -> bool, asked after each token of prompt i: whether its answer is
    complete. Ended rows leave the batch once a COMPACT share."""
    device, dtype = model.model.embed_tokens.weight.device, model.model.embed_tokens.weight.dtype
    stop = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    gen = None if temperature == 0 or seed is None else torch.Generator(device).manual_seed(seed)
    if max_new_tokens == 0:
        return [[] for _ in prompts]
    distinct = {p: i for i, p in enumerate(dict.fromkeys(map(tuple, prompts)))}  # each read once (rl.py: G rows each)
    longest = max(map(len, distinct))  # each prompt left-padded to it: ids (distinct, longest), pad (distinct,)
    ids = torch.tensor([[pad_id] * (longest - len(p)) + list(p) for p in distinct], device=device)
    pad = torch.tensor([longest - len(p) for p in distinct], device=device)
    cache = KVCache(model.config, ids.shape[1] + max_new_tokens, len(distinct), dtype, device, pad)
    logits = model.decode(ids, cache)[:, -1]  # (distinct, vocab)
    if len(distinct) < len(prompts):  # the cache's rows copied to one per prompt (all distinct: it is that already)
        which = torch.tensor([distinct[tuple(p)] for p in prompts], device=device)
        logits, cache.k, cache.v, cache.pad = logits[which], cache.k[:, which], cache.v[:, which], cache.pad[which]
    rows, out = list(range(len(prompts))), [[] for _ in prompts]  # rows: the prompt each batch row answers
    live = set(rows)
    for n in range(max_new_tokens):
        toks = next_tokens(logits.float(), temperature, top_p, gen).tolist()  # (rows,)
        for i, t in zip(rows, toks, strict=True):
            if i in live:
                out[i].append(t)
                if t in stop or (done is not None and done(i, out[i])):
                    live.discard(i)
        if not live or n + 1 == max_new_tokens:
            break
        if len(rows) - len(live) >= max(1, COMPACT * len(rows)):  # keep only the rows still answering
            keep = [r for r, i in enumerate(rows) if i in live]
            idx = torch.tensor(keep, device=device)
            cache.k, cache.v, cache.pad = cache.k[:, idx], cache.v[:, idx], cache.pad[idx]
            rows, toks = [rows[r] for r in keep], [toks[r] for r in keep]
        logits = model.decode(torch.tensor(toks, device=device)[:, None], cache)[:, -1]  # (rows, vocab)
    return out


def next_tokens(logits, temperature=0.0, top_p=1.0, gen=None):
    """logits (rows, vocab) fp32 -> (rows,) token ids: the argmax at temperature 0; else one draw per row from
    softmax(logits / temperature) cut to the smallest set of most likely tokens whose probability reaches top_p."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, -1)
    if top_p >= 1:
        return torch.multinomial(probs, 1, generator=gen)[:, 0]
    probs, order = probs.sort(-1, descending=True)
    probs[probs.cumsum(-1) - probs > top_p] = 0  # multinomial renormalises what is left
    return order.gather(-1, torch.multinomial(probs, 1, generator=gen))[:, 0]
