"""support/evaluation/sampling.py: continuing a prompt through the model's KV cache.

What this file proves: greedy generation through the cache equals recomputing the whole sequence for every token (a
model built with activation checkpointing, in training mode, too), the cache fed in two chunks gives the full pass's
logits at each chunk's last position, generation stops at any of several eos ids, nucleus sampling with a vanishing
top_p is greedy and a seed repeats a sample; and greedy generation equals transformers' generate on the same weights
(the families' own cases, sliding windows included, are in tests/test_model.py). Batched greedy generation with left
padding gives every prompt what it gets alone (rows ending at eos or at the caller's `done` at different steps,
sliding windows too, a prompt given twice read once), and dense_weights computes the QLoRA model's logits within fp32
rounding, its adapters merged, with DecodeLinear's transposed product or without, and puts the model's layers back.
Sampled batches (rl.py's groups): at temperature 0 they are the greedy answers whatever top_p and seed say, at
temperature 1 a seed repeats them, and the first token's frequencies over many draws match softmax(logits / T) cut to
the top_p nucleus (a chi-square test at the 0.1% level).
"""

import math

import pytest
import torch
from test_model import hf_model, tiny_config

import lora
import quant
from model import Llama, Options
from support.evaluation.sampling import FEW_ROWS, DecodeLinear, KVCache, dense_weights, generate_batch, next_tokens
from support.kernels import choice
from train import load_model


def generate(model, prompt, max_new_tokens, **options):
    """One prompt's new tokens: generate_batch with a batch of one."""
    return generate_batch(model, [prompt], max_new_tokens, **options)[0]


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
        full = model(seq)
        first = model.decode(seq[:, :9], cache)  # (1, 1, vocab): the head on the last position only
        assert cache.length == 9 and first.shape == (1, 1, full.shape[-1])
        second = model.decode(seq[:, 9:], cache)
        assert (first - full[:, 8:9]).abs().max() < 1e-5 and (second - full[:, -1:]).abs().max() < 1e-5
    assert generate(model, prompt, 12, eos_id=[96, new[3]]) == new[: new.index(new[3]) + 1]
    checkpointed = Llama(tiny_config(), options=Options(checkpointing=True)).train()  # decoding never recomputes
    checkpointed.load_state_dict(model.state_dict())
    assert generate(checkpointed, prompt, 12) == new
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


def test_batched_generation_equals_one_prompt_at_a_time():
    """Left-padded prompts of lengths 1 to 9 generated together equal each generated alone, token for token, when
    rows end at different steps (an eos, the caller's `done`, max_new_tokens) and the batch drops finished rows; the
    same with a sliding window shorter than the sequences."""
    for window in (None, 4):
        torch.manual_seed(0)
        model = Llama(tiny_config(sliding_window=window, sliding_layers=[0, 1] if window else None)).eval()
        prompts = [[5, 17, 3, 60, 8, 1, 9, 4, 11], [7], [30, 31, 32], [12, 40, 41, 42, 43, 44], [88, 2, 3, 50]]
        alone = [generate(model, p, 10) for p in prompts]
        eos = alone[2][3]  # ends row 2 at its 4th token, and any other row where that token comes first
        done = lambda i, new: i == 3 and len(new) == 6  # noqa: E731
        want = []
        for i, a in enumerate(alone):
            cut = a.index(eos) + 1 if eos in a else len(a)
            want.append(a[: min(cut, 6 if i == 3 else cut)])
        assert generate_batch(model, prompts, 10, eos_id=eos, done=done) == want
        assert generate_batch(model, prompts, 10) == alone
        assert generate_batch(model, prompts + prompts[::-1], 10) == alone + alone[::-1]  # each distinct one read once


@pytest.mark.parametrize("transposed", [True, False])
def test_dense_weights_equal_the_qlora_forward_and_are_put_back(monkeypatch, transposed):
    """Under dense_weights a QLoRA model (NF4 base, LoRA with a non-zero B) gives the logits of its own forward within
    fp32 rounding, for a prompt (9 rows) and a decode step's few rows alike, with DecodeLinear's transposed product
    and with plain linears (as choice.few_rows_transposed says for the CPU); no NF4 or LoRA layer is left inside, and
    on exit the model's own layers and adapters are back."""
    monkeypatch.setattr(choice, "few_rows_transposed", lambda: transposed)
    torch.manual_seed(0)
    model = quant.quantize_(Llama(tiny_config()), compute_dtype=torch.float32)
    lora.add_lora_(model, "all-linear", r=4, alpha=8, dropout=0.0)
    for m in lora.lora_modules(model).values():
        torch.nn.init.normal_(m.lora_B.weight)
    model.eval()
    ids = torch.tensor([[5, 17, 3, 60, 8, 1, 9, 4, 11], [7, 30, 31, 32, 12, 40, 41, 42, 43]])
    before = dict(model.named_modules())
    with torch.no_grad():
        want = model(ids)
        with dense_weights(model):
            assert not any(isinstance(m, (quant.NF4Linear, *lora.LORA)) for m in model.modules())
            assert type(model.lm_head) is (DecodeLinear if transposed else torch.nn.Linear)
            got = model(ids)
            step = model(ids[:, :1])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(step, model(ids[:, :1]), rtol=1e-5, atol=1e-5)
    assert dict(model.named_modules()) == before


def test_decode_linear_takes_the_transposed_product_for_few_rows():
    """DecodeLinear equals F.linear within fp32 rounding, with a bias and without, for 1 and 3 rows, where its output
    is exactly the transposed product (W x^T)^T, and for FEW_ROWS + 1 rows, where it is exactly F.linear's."""
    torch.manual_seed(0)
    for bias in (True, False):
        layer = DecodeLinear(96, 160, bias=bias)
        for rows in (1, 3, FEW_ROWS + 1):
            x = torch.randn(rows, 1, 96)
            want = torch.nn.functional.linear(x, layer.weight, layer.bias)
            torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
            if rows > FEW_ROWS:
                assert torch.equal(layer(x), want)
            else:
                product = (layer.weight @ x[:, 0].T).T[:, None]
                assert torch.equal(layer(x), product if layer.bias is None else product + layer.bias)


PROMPTS = [[5, 17, 3, 60, 8, 1, 9, 4, 11], [7], [30, 31, 32], [12, 40, 41, 42, 43, 44], [88, 2, 3, 50]]


def test_sampled_batches_are_greedy_at_temperature_0_and_seeded_at_1():
    """Temperature 0 is greedy (the answers of one prompt at a time), whatever top_p and seed say; at
    temperature 1 the same seed gives the same answers and another seed other answers, which are not the greedy ones."""
    model = Llama(tiny_config()).eval()
    greedy = [generate(model, p, 10) for p in PROMPTS]
    assert generate_batch(model, PROMPTS, 10, temperature=0.0, top_p=0.3, seed=5) == greedy
    sampled = generate_batch(model, PROMPTS, 10, temperature=1.0, seed=5)
    assert sampled == generate_batch(model, PROMPTS, 10, temperature=1.0, seed=5)
    assert sampled != generate_batch(model, PROMPTS, 10, temperature=1.0, seed=6) and sampled != greedy
    assert [len(a) for a in sampled] == [10] * len(PROMPTS)


def chi_square_quantile(df, z=3.09):
    """The chi-square distribution's quantile at the standard normal's z (3.09: the 99.9th percentile), by Wilson and
    Hilferty's approximation (within 1% of the exact quantile from 30 degrees of freedom on)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts, probs):
    """Pearson's statistic of `counts` against the expected n * probs and its degrees of freedom, the tokens expected
    fewer than 5 times pooled into one cell (the usual condition for the chi-square approximation)."""
    n = counts.sum()
    expected = n * probs
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    cells = expected > 0
    return float(((observed - expected)[cells] ** 2 / expected[cells]).sum()), int(cells.sum()) - 1


def test_sampled_token_frequencies_match_softmax():
    """20,000 first tokens drawn for one prompt at temperature 1, and at temperature 0.7 within a top_p 0.9 nucleus:
    their counts against n * softmax(logits / T) (renormalised over the nucleus) pass a chi-square test at the 0.1%
    level (seeded, so the verdict is fixed; a temperature applied wrongly, or a nucleus cut one token off, fails it by
    far), and no token outside the nucleus is ever drawn."""
    model = Llama(tiny_config(vocab_size=97)).eval()
    n, prompt = 20_000, [5, 17, 3, 60, 8]
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0, -1].float()
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
        draws = generate_batch(model, [prompt] * n, 1, temperature=temperature, top_p=top_p, seed=11)
        counts = torch.bincount(torch.tensor([d[0] for d in draws]), minlength=97).double()
        probs, order = torch.softmax(logits / temperature, -1).double().sort(descending=True)
        probs[probs.cumsum(0) - probs > top_p] = 0
        nucleus = torch.zeros(97, dtype=torch.double).scatter(0, order, probs / probs.sum())
        assert counts[nucleus == 0].sum() == 0
        statistic, df = chi_square(counts, nucleus)
        assert df > 30 and statistic < chi_square_quantile(df), (temperature, statistic, df)


def test_next_tokens_nucleus_keeps_the_top_token():
    """A nucleus smaller than the most likely token's probability keeps that token alone: every draw is the argmax."""
    logits = torch.randn(64, 97)
    gen = torch.Generator().manual_seed(0)
    assert torch.equal(next_tokens(logits, 1.0, 1e-6, gen), logits.argmax(-1))
