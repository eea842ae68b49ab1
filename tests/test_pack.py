"""pack.py against references and invariants.

- Masking (against transformers' chat templates and tokenizers): for seeded random conversations of 1-6 turns, with
  and without a system message, under SmolLM2's real template, Qwen2.5, Qwen3, Mistral v0.1/v0.3/legacy and a
  Llama-3-style template, each document is transformers' render cut around every assistant turn, each piece
  tokenized by transformers, and exactly the assistant turns as rendered plus their end-of-turn token are
  supervised (Qwen3's final think block included); train_on_prompt supervises every token. A plain format string
  gives one instance per turn with EOS after each response and BOS as transformers' tokenizer adds it. Templates
  that cannot be masked by prefixes (Mistral v0.3 with a system message) fail with one line naming the example.
- Packing (a seeded property test over a few hundred random length sets): no token lost or duplicated, documents
  whole and contiguous, no row longer than context_length, position_ids restarting at every document and every pad
  run, and labels[t] = input[t+1] exactly when t+1 is a supervised token of the same document, -100 elsewhere; BFD
  uses as many rows as a naive quadratic best-fit-decreasing.
- Batching: per-epoch seeded order, disjoint rank slices that cover every row, resume at batch k, and step_batch as
  the same order counted across epochs.
- Length policy and >= 97% packing efficiency on the stdlib dataset. (The preview and the token cache are tested in
  test_preview.py and test_token_cache.py.)
"""

import itertools
import json
import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CONVERSATIONS, FAMILIES, QWEN, reference, tokenizer_dir, turn_text

import pack
from pack import PackedDataset, build_dataset, pack_bfd, tokenize_chunk
from support.data.examples import read_examples, stdlib_examples
from support.data.preview import packing_report, preview
from support.data.token_cache import tokenize_cached
from support.data.tokenizer import Tokenizer, renders

WORDS = [
    "sort",
    "the",
    "list",
    "x",
    "=",
    "[3, 1, 2]",
    "déjà",
    "日本語",
    "42",
    "\n",
    "    return",
    "{}",
    "(a, b)",
    "&",
    "'q'",
]


def tokenize_examples(examples, tokenizer, template=None, train_on_prompt=False, skip_bad_rows=False):
    """pack.tokenize_chunk over a few examples in memory, as the token cache calls it, and its messages: (tokens uint32
    (N,), mask uint8 (N,), offsets int64 (docs + 1,)), document i is tokens[offsets[i]:offsets[i + 1]]."""
    got = tokenize_chunk(list(examples), tokenizer, template, train_on_prompt, skip_bad_rows=skip_bad_rows)
    if got["skipped"]:
        print(f"skipped {len(got['skipped'])} examples the template cannot render (first: {got['skipped'][0]})",
              file=sys.stderr)  # fmt: skip
    if not len(got["lengths"]):
        raise ValueError("no examples to tokenize" + (" (every one skipped)" if got["skipped"] else ""))
    return got["tokens"], got["mask"], np.concatenate([[0], np.cumsum(got["lengths"])])


def random_conversation(rng, turns, system):
    """Alternating user/assistant turns (after an optional system message) of random words, some with whitespace
    around them that templates trim or keep."""

    def say(who, t):
        words = " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))
        return rng.choice(["", " ", "\n"]) + f"{who} {t}: {words}" + rng.choice(["", " ", "\n"])

    msgs = [{"role": "system", "content": say("system", 0)}] if system else []
    for t in range(turns):
        msgs += [{"role": "user", "content": say("question", t)}, {"role": "assistant", "content": say("answer", t)}]
    return msgs


def expected_document(family, msgs, ref, template):
    """(ids, mask) from transformers alone: its render of the conversation cut around each assistant turn's text,
    every piece tokenized by transformers' tokenizer, the turns supervised."""
    whole = ref.apply_chat_template(msgs, chat_template=template, tokenize=False)
    pieces, cur = [], 0
    for k in [k for k, m in enumerate(msgs) if m["role"] == "assistant"]:
        turn = turn_text(family, msgs, k)
        start = whole.index(turn, cur)
        pieces += [(whole[cur:start], 0), (turn, 1)]
        cur = start + len(turn)
    pieces.append((whole[cur:], 0))
    encoded = [(ref.encode(text, add_special_tokens=False), sup) for text, sup in pieces]
    return [t for ids, _ in encoded for t in ids], [sup for ids, sup in encoded for _ in ids]


def _dir(request, name):
    if name in ("smollm2_dir", "llama_json_dir", "bpe_dir", "sp_dir"):
        return Path(request.getfixturevalue(name))
    return request.getfixturevalue("family_dirs")[name]


@pytest.mark.parametrize("family", ["smollm2", *FAMILIES, "llama3-style"])
def test_every_assistant_turn_supervised(request, family):
    """Random conversations of 1-6 turns, with and without a system message: the supervised tokens are exactly the
    assistant turns as the template renders them plus their end-of-turn token; train_on_prompt supervises all."""
    d = _dir(request, "smollm2_dir" if family == "smollm2" else family)
    tok, ref = Tokenizer(d), reference(d)
    rng = random.Random(family)
    convs = [random_conversation(rng, turns, system) for turns in range(1, 7) for system in (False, True)]
    if family in ("mistral-v0.3", "mistral-legacy"):  # v0.3 drops the system message, the legacy one refuses it
        for msgs in [c for c in convs if c[0]["role"] == "system"]:
            with pytest.raises(ValueError) as e:
                tokenize_examples([{"messages": msgs}], tok)
            assert str(e.value).startswith("example 0: ") and "\n" not in str(e.value)
        convs = [c for c in convs if c[0]["role"] != "system"]
    for train_on_prompt in (False, True):
        tokens, mask, offsets = tokenize_examples(
            [{"messages": c} for c in convs], tok, train_on_prompt=train_on_prompt
        )
        for i, msgs in enumerate(convs):
            ids, sup = expected_document(family, msgs, ref, tok.chat_template)
            assert tokens[offsets[i] : offsets[i + 1]].tolist() == ids, (i, msgs)
            assert mask[offsets[i] : offsets[i + 1]].tolist() == ([1] * len(ids) if train_on_prompt else sup)


def test_unmaskable_template_is_one_clear_line(tmp_path, family_dirs, bpe_dir):
    msgs = [{"role": "system", "content": "Be brief."}, *CONVERSATIONS[0]]
    with pytest.raises(ValueError) as e:
        tokenize_examples([{"messages": CONVERSATIONS[0]}, {"messages": msgs}], Tokenizer(family_dirs["mistral-v0.3"]))
    want = r"example 1: chat template: messages\[:2\] rendered with add_generation_prompt=True is not a prefix of the "
    want += r"whole conversation \(.*Be brief.*\), so assistant turn 2 cannot be masked: .*"
    assert re.fullmatch(want, str(e.value)) and "\n" not in str(e.value)
    qwen3_base = tokenizer_dir(tmp_path / "q3", bpe_dir, "Qwen-Qwen3-0.6B", **(QWEN | {"eos_token": "<|endoftext|>"}))
    with pytest.raises(ValueError) as e:  # no eos to end turn 1, whose render alone differs (a final think block)
        tokenize_examples([{"messages": CONVERSATIONS[1]}], Tokenizer(qwen3_base))
    want = "example 0: chat template: assistant turn 2 renders no eos '<|endoftext|>' and the conversation ending "
    assert str(e.value) == want + "with it is not a prefix of the whole, so the end of the turn cannot be found"
    bad = Tokenizer(bpe_dir)
    bad.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>>{% endif %}"
    )
    with pytest.raises(ValueError, match="not a prefix"):
        tokenize_examples([{"instruction": "a", "response": "b"}], bad)


def test_a_row_the_template_rejects_names_its_line_or_is_skipped(tmp_path, family_dirs, capsys):
    """Read from a file, a conversation the template rejects (Mistral v0.3 drops a system message) fails with its file
    and line; with skip_bad_rows it is left out and counted, and the others tokenize exactly as they do alone."""
    tok, system = Tokenizer(family_dirs["mistral-v0.3"]), [{"role": "system", "content": "Be brief."}]
    rows = [CONVERSATIONS[0], system + CONVERSATIONS[0], CONVERSATIONS[0][:1] + [{"role": "assistant", "content": "x"}]]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    examples = list(read_examples(path))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:2: chat template: messages\[:2\] rendered"):
        tokenize_examples(examples, tok)
    kept = tokenize_examples(examples, tok, skip_bad_rows=True)
    assert f"skipped 1 examples the template cannot render (first: {path}:2: chat template" in capsys.readouterr().err
    alone = tokenize_examples([examples[0], examples[2]], tok)
    assert [a.tolist() for a in kept] == [a.tolist() for a in alone]
    assert [renders(ex, tok) for ex in examples] == [True, False, True]
    with pytest.raises(ValueError, match=r"^no examples to tokenize \(every one skipped\)$"):
        tokenize_examples(examples[1:2], tok, skip_bad_rows=True)
    text = preview(examples, tok, skip_bad_rows=True)
    assert f"--- {path}:1: " in text and f"--- {path}:3: " in text and f"{path}:2" not in text
    for _ in range(2):  # the file streamed through the cache: built, then read back, and the skip said both times
        kw = dict(cache_dir=tmp_path / "cache", skip_bad_rows=True)
        cached = tokenize_cached(pack.tokenize_chunk, path, tok, **kw)
        assert [cached[k].tolist() for k in ("tokens", "mask", "offsets")] == [a.tolist() for a in alone]
        assert cached["example"].tolist() == [0, 2] and cached["read"] == 3  # row 2's example has no document
        assert "skipped 1 examples the template cannot render (" in capsys.readouterr().err


def test_eos_text_inside_an_answer_is_not_the_end_of_the_turn(smollm2_dir):
    """An answer that quotes "<|im_end|>": the whole answer stays supervised up to the turn's own end-of-turn token
    (it used to end at the quote), and the preview warns that the quoted text tokenizes as EOS itself (as it does in
    transformers), so the model would learn to stop there."""
    tok, ref = Tokenizer(smollm2_dir), reference(Path(smollm2_dir))
    answer = "Each turn ends with <|im_end|> and then a newline. That is all."
    msgs = [{"role": "user", "content": "How do turns end?"}, {"role": "assistant", "content": answer}]
    tokens, mask, _ = tokenize_examples([{"messages": msgs}], tok)
    assert tok.decode(tokens.tolist()) == ref.apply_chat_template(msgs, tokenize=False)
    assert tok.decode([t for t, m in zip(tokens.tolist(), mask.tolist(), strict=True) if m]) == answer + "<|im_end|>"
    warning = "warning: example 0: response 1 holds EOS '<|im_end|>' before its end: the model learns to stop there"
    assert warning in preview([{"messages": msgs}], tok).splitlines()
    assert "holds EOS" not in preview([{"messages": CONVERSATIONS[0]}], tok)


def test_a_later_message_quoting_an_answer_is_not_supervised(smollm2_dir):
    """A template that renders an answer changed (here upper-cased, as Qwen3 drops earlier reasoning): the answer's
    text is not in its own turn, and a later user message that quotes it must not be taken for it, which would have
    supervised the user's message up to its end-of-turn token."""
    tok = Tokenizer(smollm2_dir)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' %}{{ m['content'] | upper }}{% else %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    msgs += [{"role": "user", "content": "you said: ok"}, {"role": "assistant", "content": "fine"}]
    tokens, mask, _ = tokenize_examples([{"messages": msgs}], tok)
    runs = itertools.groupby(zip(tokens.tolist(), mask.tolist(), strict=True), key=lambda t: t[1])
    assert [tok.decode([t for t, _ in run]) for m, run in runs if m] == ["OK<|im_end|>", "FINE<|im_end|>"]


@pytest.mark.parametrize("base", ["llama_json_dir", "smollm2_dir"])
def test_plain_format_every_turn_supervised(request, base):
    """A plain format string: one instance per assistant turn (system and user contents since the last answer as
    its instruction), each response followed by EOS; BOS where transformers' tokenizer adds it to plain text."""
    d = _dir(request, base)
    tok, ref = Tokenizer(d), reference(d)
    fmt = "### Q:\n{instruction}\n### A:\n{response}"
    rng = random.Random(base)
    examples = [{"messages": random_conversation(rng, t, s)} for t in range(1, 7) for s in (False, True)]
    examples.append({"instruction": "Reverse a list.", "response": "xs[::-1]"})
    tokens, mask, offsets = tokenize_examples(examples, tok, template=fmt)
    for i, ex in enumerate(examples):
        user, answer = {"role": "user", "content": "Reverse a list."}, {"role": "assistant", "content": "xs[::-1]"}
        ids, said = ref.encode(""), []  # BOS, if the tokenizer adds it
        sup = [0] * len(ids)
        for m in ex.get("messages") or [user, answer]:
            if m["role"] != "assistant":
                said.append(m["content"])
                continue
            head = ref.encode(fmt.format(instruction="\n\n".join(said), response=""), add_special_tokens=False)
            reply = ref.encode(m["content"], add_special_tokens=False) + [ref.eos_token_id]
            ids, sup, said = ids + head + reply, sup + [0] * len(head) + [1] * len(reply), []
        assert tokens[offsets[i] : offsets[i + 1]].tolist() == ids and mask[offsets[i] : offsets[i + 1]].tolist() == sup
    assert (tokens[0] == ref.bos_token_id) == (base == "llama_json_dir")


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
        ds = PackedDataset(
            dict(tokens=tokens, mask=mask, offsets=offsets), C, pack=True, truncate=truncate, seed=case, pad_id=0
        )
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
        ds = PackedDataset(
            dict(tokens=tokens, mask=mask, offsets=offsets), 48, pack=False, pad_to_max=pad_to_max, pad_id=0
        )
        assert len(ds) == len(lengths)
        seen = []
        for batch in ds.iter_batches(0, 5):
            docs = np.searchsorted(offsets, batch["input_ids"][:, 0].numpy() - 1, "right") - 1
            width = 48 if pad_to_max else max(lengths[d] for d in docs)  # the longest in the batch, or C
            seen += _check_rows(ds, batch, tokens, mask, offsets, width)
        assert sorted(set(seen)) == list(range(len(lengths)))


def test_batches_order_sharding_and_resume():
    rng = random.Random(3)
    tokens, mask, offsets = _synthetic([rng.randint(1, 30) for _ in range(300)], rng)
    ds = PackedDataset(dict(tokens=tokens, mask=mask, offsets=offsets), 64, seed=5, pad_id=0)
    first = lambda bs: [b["input_ids"][:, 0].tolist() for b in bs]  # noqa: E731  (a row's first token names it)
    epoch0 = first(ds.iter_batches(0, 4))
    assert epoch0 == first(ds.iter_batches(0, 4)) != first(ds.iter_batches(1, 4))
    assert len(epoch0) == ds.count_steps(4) == -(-len(ds) // 4)
    assert first(ds.iter_batches(0, 4, start=3)) == epoch0[3:]
    world = 3
    ranks = [first(ds.iter_batches(2, 4, rank=r, world_size=world)) for r in range(world)]
    assert all(len(r) == ds.count_steps(4, world) for r in ranks)
    # step by step, rank by rank: every row exactly once, then the wrap-around that fills the last global batch
    seen = [v for step in zip(*ranks, strict=True) for r in step for v in r]
    all_rows = sorted(int(ds.collate([i])["input_ids"][0, 0]) for i in range(len(ds)))
    assert sorted(seen[: len(ds)]) == all_rows and set(seen[len(ds) :]) <= set(all_rows)
    # step_batch: the same order counted in optimizer steps across epochs, a pure function of the step
    steps = ds.count_steps(4, world)
    for step in (0, 3, steps, 2 * steps + 1):
        epoch, b = divmod(step, steps)
        want = next(ds.iter_batches(epoch, 4, rank=1, world_size=world, start=b))
        got = ds.step_batch(step, 4, rank=1, world_size=world)
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_length_policy_and_report():
    rng = random.Random(4)
    lengths = [rng.randint(5, 100) for _ in range(200)] + [300, 400]
    tokens, mask, offsets = _synthetic(lengths, rng)
    C = pack.choose_context_length(np.array(lengths))
    assert C % 64 == 0 and C - 64 < np.percentile(lengths, 95) <= C
    assert pack.choose_context_length(np.array(lengths), max_context=64) == 64
    long = [i for i, n in enumerate(lengths) if n > C]
    kept = [i for i in long if mask[offsets[i] + 1 : offsets[i] + C].any()]  # a truncated doc must keep a target
    cut = PackedDataset(dict(tokens=tokens, mask=mask, offsets=offsets), C, truncate=True)
    drop = PackedDataset(dict(tokens=tokens, mask=mask, offsets=offsets), C, truncate=False)
    assert len(long) > 0 and cut.stats["truncated"] == len(kept) and cut.stats["dropped"] == len(long) - len(kept)
    assert cut.stats["truncated_tokens"] == sum(lengths[i] - C for i in kept)
    assert cut.num_tokens == sum(min(n, C) for n in lengths) - sum(C for i in long if i not in kept)
    assert drop.stats["dropped"] == len(long) and drop.stats["dropped_tokens"] == sum(lengths[i] for i in long)
    assert drop.num_tokens == sum(lengths) - sum(lengths[i] for i in long)
    text = packing_report(cut)
    assert f"examples: {len(lengths)}" in text and f"packed {cut.num_tokens / (len(cut) * C):.1%}" in text
    assert f"truncated {cut.stats['truncated']} examples" in text


def _write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture(scope="module")
def stdlib_cache(tmp_path_factory):
    """One token cache for the stdlib tests: the dataset is tokenized once."""
    return tmp_path_factory.mktemp("stdlib_cache")


@pytest.mark.parametrize("context", [1024, 2048])
def test_stdlib_packing_efficiency(smollm2_dir, stdlib_cache, context):
    ds = build_dataset(stdlib_examples(), Tokenizer(smollm2_dir), context, cache_dir=stdlib_cache)
    report = packing_report(ds)
    print(report)
    assert ds.num_tokens / (len(ds) * context) >= 0.97
