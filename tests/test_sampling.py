"""support/sampling.py: continuing a prompt through the model's KV cache.

What this file proves: greedy generation through the cache equals recomputing the whole sequence for every token (in
training mode with activation checkpointing on too), the cache fed in two chunks gives the full pass's logits,
generation stops at any of several eos ids, nucleus sampling
with a vanishing top_p is greedy and a seed repeats a sample; and greedy generation equals transformers' generate on
the same weights (the families' own cases, sliding windows included, are in tests/test_model.py).
"""

import torch
from test_model import hf_model, tiny_config

from model import KVCache, Llama
from support.sampling import generate
from train import load_model


def test_kv_cache_generation_matches_full_recompute():
    model = Llama(tiny_config()).eval()
    prompt = [5, 17, 3, 60, 8]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    new = ids[len(prompt) :]
    assert generate(model, prompt, 12) == new
    # the cache contract itself: a sequence fed in two chunks (the second after 9 cached tokens) gives the full-pass
    # logits
    cache = KVCache(model.config, 17)
    seq = torch.tensor([ids])
    with torch.no_grad():
        first = model(seq[:, :9], cache=cache)
        assert cache.length == 9
        chunked = torch.cat([first, model(seq[:, 9:], cache=cache)], dim=1)
        assert (chunked - model(seq)).abs().max() < 1e-5
    assert generate(model, prompt, 12, eos_id=[96, new[3]]) == new[: new.index(new[3]) + 1]
    model.train().activation_checkpointing = True  # generation never recomputes: the cache is filled all the same
    assert generate(model, prompt, 12) == new
    model.eval()
    # nucleus sampling with a vanishing top_p keeps only the most likely token
    assert generate(model, prompt, 12, temperature=0.7, top_p=1e-9, seed=1) == new
    sampled = generate(model, prompt, 12, temperature=1.0, seed=3)
    assert sampled == generate(model, prompt, 12, temperature=1.0, seed=3) and len(sampled) == 12


def test_greedy_generation_matches_transformers(tmp_path):
    hf = hf_model(num_attention_heads=4, num_key_value_heads=2, eos_token_id=7)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    prompt = [1, 40, 41, 9, 13, 77]
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0)[0, len(prompt) :]
    assert generate(ours, prompt, 20, eos_id=ours.config.eos_token_id) == ref.tolist()
