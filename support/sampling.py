"""How does a fine-tuned model continue a prompt?

One token at a time through the model's KV cache (model.KVCache: the prompt runs once, then each new token is one
single-position forward against the cached keys and values), greedy or with nucleus sampling (top-p, Holtzman et al.
2019, https://arxiv.org/abs/1904.09751). train.py answers held-out prompts with it at every evaluation; generate.py
answers the command line's.
"""

import torch

from model import KVCache
from support.tokenizer import render


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


def prompt_and_answer(model, tok, example, template, max_new_tokens, autocast) -> dict:
    """{"prompt", "answer"}: an example's prompt rendered as in training (support/tokenizer.py) and the model's greedy
    answer to it, in eval mode (no dropout: the same on every rank), under the context `autocast()` gives."""
    text, _, bos = render(example, tok, template)
    model.eval()
    with autocast():
        ids = generate(model, tok.encode(text, bos=bos), max_new_tokens, eos_id=tok.eos_id)
    model.train()
    return dict(prompt=text, answer=tok.decode(ids))
