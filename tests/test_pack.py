"""pack.py against references and invariants.

- Masking: the prompt part of each document equals transformers' tokenization of the generation prompt, the
  supervised part equals the response ids + EOS.
- Packing (a seeded property test over a few hundred random length sets): no token lost or duplicated, documents
  whole and contiguous, no row longer than context_length, position_ids restarting at every document and every pad
  run, and labels[t] = input[t+1] exactly when t+1 is a supervised token of the same document, -100 elsewhere; BFD
  uses as many rows as a naive quadratic best-fit-decreasing.
- Batching: per-epoch seeded order, disjoint rank slices that cover every row, resume at batch k, and step_batch as
  the same order counted across epochs.
- Length policy, cache reuse (a second build does not tokenize), and >= 97% packing efficiency on the stdlib dataset.
"""

import json
import random

import numpy as np
import pytest
import torch
import transformers
from conftest import CONVERSATIONS

import pack
from examples import stdlib_examples
from pack import PackedDataset, build_dataset, pack_bfd, tokenize_examples
from tokenizer import Tokenizer


def test_chat_masking_matches_transformers(bpe_dir):
    """Document = transformers-tokenized generation prompt ++ response ids + EOS; only the latter supervised."""
    tok, ref = Tokenizer(bpe_dir), transformers.AutoTokenizer.from_pretrained(str(bpe_dir))
    examples = [{"instruction": "Reverse a list.", "response": "xs[::-1]"}] + [{"messages": c} for c in CONVERSATIONS]
    for train_on_prompt in (False, True):
        tokens, mask, offsets = tokenize_examples(examples, tok, train_on_prompt=train_on_prompt)
        for i, ex in enumerate(examples):
            msgs = ex.get("messages") or [
                {"role": "user", "content": ex["instruction"]},
                {"role": "assistant", "content": ex["response"]},
            ]
            prompt = ref.encode(
                ref.apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=False), add_special_tokens=False
            )
            response = ref.encode(msgs[-1]["content"], add_special_tokens=False) + [ref.eos_token_id]
            assert tokens[offsets[i] : offsets[i + 1]].tolist() == prompt + response
            assert mask[offsets[i] : offsets[i + 1]].tolist() == [int(train_on_prompt)] * len(prompt) + [1] * len(
                response
            )


def test_plain_template_and_bos(llama_json_dir, bpe_dir):
    tok = Tokenizer(llama_json_dir)
    template = "Q: {instruction}\nA: {response}"
    tokens, mask, offsets = tokenize_examples([{"instruction": "1+1?", "response": "2"}], tok, template=template)
    prompt = [tok.bos_id] + tok.encode("Q: 1+1?\nA: ")
    assert tokens.tolist() == prompt + tok.encode("2") + [tok.eos_id]
    assert mask.tolist() == [0] * len(prompt) + [1] * (len(tokens) - len(prompt))
    with pytest.raises(ValueError, match="end with"):
        tokenize_examples([{"instruction": "a", "response": "b"}], tok, template="{response} then {instruction}")
    bad = Tokenizer(bpe_dir)
    bad.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>>{% endif %}"
    )
    with pytest.raises(ValueError, match="not a prefix"):
        tokenize_examples([{"instruction": "a", "response": "b"}], bad)


# ---------------------------------------------------------------------------------------------- packing


def _synthetic(lengths, rng, train_on_prompt=False):
    """Unique token ids (1..N, so any loss or duplicate shows) and a random prompt/response split per document."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.arange(1, offsets[-1] + 1, dtype=np.uint32)
    mask = np.zeros(offsets[-1], dtype=np.uint8)
    for s, e in zip(offsets[:-1], offsets[1:], strict=True):
        mask[rng.randint(s, e - 1) if not train_on_prompt else s : e] = 1
    return tokens, mask, offsets


def _check_rows(ds, batch, tokens, mask, offsets, width):
    """Independent check of one batch against the original token stream; returns the documents seen."""
    doc_of = np.searchsorted(offsets, np.arange(len(tokens)), side="right") - 1
    inp, lab, pos = (batch[k].numpy() for k in ("input_ids", "labels", "position_ids"))
    assert inp.shape == lab.shape == pos.shape and inp.shape[1] == width <= ds.context_length
    seen = []
    for row_inp, row_lab, row_pos in zip(inp, lab, pos, strict=True):
        t, pad_start = 0, None
        while t < width:
            if row_inp[t] == ds.pad_id:  # a pad run: positions 0.. to the row end, no targets
                pad_start = t
                assert (row_inp[t:] == ds.pad_id).all() and (row_pos[t:] == np.arange(width - t)).all()
                assert (row_lab[t:] == -100).all()
                break
            g = int(row_inp[t]) - 1  # global token index of a document start
            d = doc_of[g]
            n = min(int(offsets[d + 1] - offsets[d]), ds.context_length)
            assert g == offsets[d], "a document must start at its first token"
            assert (row_inp[t : t + n] == tokens[g : g + n]).all() and (row_pos[t : t + n] == np.arange(n)).all()
            want = np.where(mask[g + 1 : g + n] == 1, tokens[g + 1 : g + n].astype(np.int64), -100)
            assert (row_lab[t : t + n - 1] == want).all() and row_lab[t + n - 1] == -100
            seen.append(d)
            t += n
        assert pad_start is not None or t == width
    return seen


def test_packing_property():
    """Random length sets (seeded): every kept document appears exactly once, whole, with exact labels/positions."""
    rng = random.Random(0)
    for case in range(300):
        C = rng.choice([16, 64, 100, 256])
        n_docs = rng.randint(1, 60)
        lengths = [rng.randint(1, rng.choice([C // 4, C, 2 * C])) for _ in range(n_docs)]
        tokens, mask, offsets = _synthetic(lengths, rng, train_on_prompt=case % 7 == 0)
        truncate = case % 3 != 0
        ds = PackedDataset(tokens, mask, offsets, C, pack=True, truncate=truncate, seed=case, pad_id=0)
        assert all(sum(ds.lens[d] for d in row) <= C for row in ds.rows)
        batch = ds.collate(range(len(ds)))
        seen = _check_rows(ds, batch, tokens, mask, offsets, C)
        kept = [
            i for i, n in enumerate(lengths) if n <= C or (truncate and mask[offsets[i] + 1 : offsets[i] + C].any())
        ]
        assert sorted(seen) == kept
        assert ds.num_tokens == sum(min(lengths[i], C) for i in kept) == int((batch["input_ids"] != 0).sum())
        assert ds.num_supervised == int((batch["labels"] != -100).sum())
        assert ds.stats["dropped"] == n_docs - len(kept)


def test_bfd_matches_naive_best_fit():
    """Rows with equal free space are interchangeable, so any BFD tie-breaking opens the same number of rows."""
    rng = random.Random(1)
    for _ in range(200):
        C = rng.choice([8, 50, 128])
        lengths = [rng.randint(1, C) for _ in range(rng.randint(1, 80))]
        free = []
        for n in sorted(lengths, reverse=True):
            fits = [r for r in range(len(free)) if free[r] >= n]
            if fits:
                free[min(fits, key=lambda r: free[r])] -= n
            else:
                free.append(C - n)
        rows = pack_bfd(np.array(lengths), C)
        assert len(rows) == len(free) and sorted(sum(lengths[i] for i in r) for r in rows) == sorted(
            C - f for f in free
        )


def test_padded_mode():
    rng = random.Random(2)
    lengths = [rng.randint(1, 40) for _ in range(37)]
    tokens, mask, offsets = _synthetic(lengths, rng)
    for pad_to_max in (False, True):
        ds = PackedDataset(tokens, mask, offsets, 48, pack=False, pad_to_max=pad_to_max, pad_id=0)
        assert len(ds) == len(lengths)
        seen = []
        for batch in ds.batches(0, 5):
            docs = np.searchsorted(offsets, batch["input_ids"][:, 0].numpy() - 1, "right") - 1
            width = 48 if pad_to_max else max(lengths[d] for d in docs)  # the longest in the batch, or C
            seen += _check_rows(ds, batch, tokens, mask, offsets, width)
        assert sorted(set(seen)) == list(range(len(lengths)))


def test_batches_order_sharding_and_resume():
    rng = random.Random(3)
    tokens, mask, offsets = _synthetic([rng.randint(1, 30) for _ in range(300)], rng)
    ds = PackedDataset(tokens, mask, offsets, 64, seed=5, pad_id=0)
    first = lambda bs: [b["input_ids"][:, 0].tolist() for b in bs]  # noqa: E731  (a row's first token names it)
    epoch0 = first(ds.batches(0, 4))
    assert epoch0 == first(ds.batches(0, 4)) != first(ds.batches(1, 4))
    assert len(epoch0) == ds.steps_per_epoch(4) == -(-len(ds) // 4)
    assert first(ds.batches(0, 4, start=3)) == epoch0[3:]
    world = 3
    ranks = [first(ds.batches(2, 4, rank=r, world_size=world)) for r in range(world)]
    assert all(len(r) == ds.steps_per_epoch(4, world) for r in ranks)
    # step by step, rank by rank: every row exactly once, then the wrap-around that fills the last global batch
    seen = [v for step in zip(*ranks, strict=True) for r in step for v in r]
    all_rows = sorted(int(ds.collate([i])["input_ids"][0, 0]) for i in range(len(ds)))
    assert sorted(seen[: len(ds)]) == all_rows and set(seen[len(ds) :]) <= set(all_rows)
    # step_batch: the same order counted in optimizer steps across epochs, a pure function of the step
    steps = ds.steps_per_epoch(4, world)
    for step in (0, 3, steps, 2 * steps + 1):
        epoch, b = divmod(step, steps)
        want = next(ds.batches(epoch, 4, rank=1, world_size=world, start=b))
        got = ds.step_batch(step, 4, rank=1, world_size=world)
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_length_policy_and_report():
    rng = random.Random(4)
    lengths = [rng.randint(5, 100) for _ in range(200)] + [300, 400]
    tokens, mask, offsets = _synthetic(lengths, rng)
    C = pack.auto_context_length(np.array(lengths))
    assert C % 64 == 0 and C - 64 < np.percentile(lengths, 95) <= C
    assert pack.auto_context_length(np.array(lengths), max_context=64) == 64
    long = [i for i, n in enumerate(lengths) if n > C]
    kept = [i for i in long if mask[offsets[i] + 1 : offsets[i] + C].any()]  # a truncated doc must keep a target
    cut = PackedDataset(tokens, mask, offsets, C, truncate=True)
    drop = PackedDataset(tokens, mask, offsets, C, truncate=False)
    assert len(long) > 0 and cut.stats["truncated"] == len(kept) and cut.stats["dropped"] == len(long) - len(kept)
    assert cut.stats["truncated_tokens"] == sum(lengths[i] - C for i in kept)
    assert cut.num_tokens == sum(min(n, C) for n in lengths) - sum(C for i in long if i not in kept)
    assert drop.stats["dropped"] == len(long) and drop.stats["dropped_tokens"] == sum(lengths[i] for i in long)
    assert drop.num_tokens == sum(lengths) - sum(lengths[i] for i in long)
    text = cut.report()
    assert f"examples: {len(lengths)}" in text and f"packed {cut.num_tokens / (len(cut) * C):.1%}" in text
    assert f"truncated {cut.stats['truncated']} examples" in text


def _write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_cache_reuse(tmp_path, bpe_dir, monkeypatch):
    tok = Tokenizer(bpe_dir)
    data = _write(tmp_path / "d.jsonl", [{"problem": f"p{i} " * i, "solution": f"s{i} " * (i % 7)} for i in range(50)])
    a = build_dataset(data, tok, 64, cache_dir=tmp_path / "cache")
    calls = []
    monkeypatch.setattr(
        pack, "tokenize_examples", lambda *args, **kw: calls.append(1) or tokenize_examples(*args, **kw)
    )
    b = build_dataset(data, tok, 64, cache_dir=tmp_path / "cache")
    assert not calls and isinstance(b.tokens, np.memmap)
    assert all((a.collate(range(len(a)))[k] == b.collate(range(len(b)))[k]).all() for k in ("input_ids", "labels"))
    build_dataset(data, tok, 64, cache_dir=tmp_path / "cache", train_on_prompt=True)  # other settings: a new entry
    assert calls == [1]
    assert not list((tmp_path / "cache").glob(".*tmp")) and len(list((tmp_path / "cache").glob("*.json"))) == 2


@pytest.mark.parametrize("context", [1024, 2048])
def test_stdlib_packing_efficiency(smollm2_dir, context):
    ds = build_dataset(stdlib_examples(), Tokenizer(smollm2_dir), context)
    report = ds.report()
    print(report)
    assert ds.num_tokens / (len(ds) * context) >= 0.97
