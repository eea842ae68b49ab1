"""pack.py against references and invariants.

- Tokenizer: token ids, decoding and rendered chat templates equal transformers' for tokenizers the tests train
  (a byte-level BPE tokenizer.json, a BPE-with-byte-fallback tokenizer.model) and for the real SmolLM2 tokenizer.
- Masking: the prompt part of each document equals transformers' tokenization of the generation prompt, the
  supervised part equals the response ids + EOS.
- Packing (a seeded property test over a few hundred random length sets): no token lost or duplicated, documents
  whole and contiguous, no row longer than context_length, position_ids restarting at every document and every pad
  run, and labels[t] = input[t+1] exactly when t+1 is a supervised token of the same document, -100 elsewhere; BFD
  uses as many rows as a naive quadratic best-fit-decreasing.
- Batching: per-epoch seeded order, disjoint rank slices that cover every row, resume at batch k.
- Length policy, cache reuse (a second build does not tokenize), malformed input errors naming file and line,
  the stdlib dataset (bodies verbatim from the source, deterministic split), and >= 97% packing efficiency on it.
"""

import ast
import importlib
import inspect
import io
import json
import random
import sysconfig
import textwrap
from pathlib import Path

import jinja2
import numpy as np
import pytest
import sentencepiece as spm
import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

import pack
from pack import PackedDataset, Tokenizer, build_dataset, load_examples, pack_bfd, tokenize_examples

CHATML = """{%- set ns = namespace(system=false) -%}
{% for m in messages %}
  {% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}
  {% if m['role'] == 'system' %}{% set ns.system = true %}{% endif %}
  {% if loop.first and not ns.system %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
  {% endif %}
<|im_start|>{{ m['role'] }}{% if m.get('name') %} {{ m['name'] | tojson }}{% endif %}

{{ m['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

LLAMA2 = """{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] | trim }} [/INST]\
{% elif m['role'] == 'assistant' %} {{ m['content'] | trim }} {{ eos_token }}{% else %}{% continue %}{% endif %}\
{% endfor %}"""

CONVERSATIONS = [
    [
        {"role": "user", "content": "Write a function that adds two numbers."},
        {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
    ],
    [
        {"role": "system", "content": "Answer tersely & <exactly>."},
        {"role": "user", "content": "Hi", "name": "<b>O'Neil & co</b>"},
        {"role": "assistant", "content": "  Hello!  "},
        {"role": "user", "content": "Sort [3, 1, 2]\n\n"},
        {"role": "assistant", "content": "sorted([3, 1, 2])"},
    ],
]

TEXTS = [
    "def foo(x):\n    return x + 1\n",
    "Hello world, this is a test.",
    " leading space and  double  spaces\n\n\ttab",
    "ünïcødé 日本語 🙂 — “quotes”",
    "digits 1234567890 and 3.14159",
    "<|im_start|>user\nhi<|im_end|>\n",
    "special in the middle<|im_end|>after",
    "",
    "\r\nwindows\r\nlines",
    "x<s>y </s> z <unk>",
]


def _corpus():
    root = Path(sysconfig.get_paths()["stdlib"])
    return [
        p.read_text(encoding="utf-8") for p in (root / "json" / "decoder.py", root / "textwrap.py", root / "bisect.py")
    ]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A byte-level BPE tokenizer.json (SmolLM2-style special tokens) trained here, with a ChatML template."""
    d = tmp_path_factory.mktemp("bpe")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=1500, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_corpus() + TEXTS, trainer)
    tok.save(str(d / "tokenizer.json"))
    cfg = dict(tokenizer_class="PreTrainedTokenizerFast", bos_token="<|im_start|>", eos_token="<|im_end|>")
    cfg |= dict(pad_token="<|endoftext|>", unk_token="<|endoftext|>", chat_template=CHATML)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def llama_json_dir(tmp_path_factory, bpe_dir):
    """The same BPE with a post-processor that prepends BOS (as Llama tokenizer.json files do), no add_bos_token."""
    d = tmp_path_factory.mktemp("llama_json")
    tok = tokenizers.Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    bos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A $B", special_tokens=[("<|endoftext|>", bos)]
    )
    tok.save(str(d / "tokenizer.json"))
    cfg = dict(tokenizer_class="PreTrainedTokenizerFast", bos_token="<|endoftext|>", eos_token="<|im_end|>")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": LLAMA2}))
    return d


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    """A sentencepiece BPE tokenizer.model with Llama's settings (byte fallback, no normalization), trained here, plus
    a pad token added after the sentencepiece vocabulary and a Llama-2 style chat template."""
    d = tmp_path_factory.mktemp("sp")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter("\n".join(_corpus()).splitlines()),
        model_writer=buf,
        vocab_size=1000,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        user_defined_symbols=["<|im_start|>", "<|im_end|>"],
        minloglevel=2,
    )
    (d / "tokenizer.model").write_bytes(buf.getvalue())
    pad = {"content": "<pad>", "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    cfg = dict(bos_token="<s>", eos_token={"content": "</s>"}, unk_token="<unk>", pad_token="<pad>")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg | {"added_tokens_decoder": {"1000": pad}}))
    (d / "chat_template.jinja").write_text(LLAMA2)
    return d


def test_tokenizer_json_matches_transformers(bpe_dir, llama_json_dir):
    ours, ref = Tokenizer(bpe_dir), transformers.AutoTokenizer.from_pretrained(str(bpe_dir))
    for text in TEXTS + _corpus():
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == ref.decode(ids) == text
    assert ours.encode("a b", bos=True, eos=True) == [
        ref.bos_token_id,
        *ref.encode("a b", add_special_tokens=False),
        ref.eos_token_id,
    ]
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.vocab_size) == (
        ref.bos_token_id,
        ref.eos_token_id,
        ref.pad_token_id,
        len(ref),
    )
    assert not ours.add_bos  # this tokenizer never adds BOS by itself ...
    llama, llama_ref = Tokenizer(llama_json_dir), transformers.AutoTokenizer.from_pretrained(str(llama_json_dir))
    assert llama.add_bos and llama.encode("a b", bos=llama.add_bos) == llama_ref.encode("a b")  # ... this one does
    assert llama.pad_id == llama.eos_id  # no pad token: pad with EOS


def test_sentencepiece_matches_transformers(sp_dir):
    """transformers cannot load a .model without protobuf here, so its sentencepiece tokenizer class is built directly
    (legacy mode: the sentencepiece behaviour of the original Llama tokenizers)."""
    ours = Tokenizer(sp_dir)
    ref = SentencePieceBackend(
        vocab_file=str(sp_dir / "tokenizer.model"),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    for text in TEXTS + _corpus():
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == text
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.vocab_size) == (
        ref.bos_token_id,
        ref.eos_token_id,
        ref.pad_token_id,
        len(ref),
    )
    assert ours.decode([1000, *ours.encode("x")]) == "<pad>x"
    for msgs in CONVERSATIONS:
        assert ours.apply_chat_template(msgs) == ref.apply_chat_template(msgs, chat_template=LLAMA2, tokenize=False)


@pytest.mark.parametrize("generation", [False, True])
def test_chat_template_matches_transformers(bpe_dir, generation):
    ours, ref = Tokenizer(bpe_dir), transformers.AutoTokenizer.from_pretrained(str(bpe_dir))
    for msgs in CONVERSATIONS + [c[:-1] for c in CONVERSATIONS]:
        text = ref.apply_chat_template(msgs, add_generation_prompt=generation, tokenize=False)
        assert ours.apply_chat_template(msgs, add_generation_prompt=generation) == text
    assert '"<b>O\'Neil & co</b>"' in ours.apply_chat_template(CONVERSATIONS[1])  # tojson does not HTML-escape
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_smollm2_tokenizer_matches_transformers(smollm2_dir):
    ours, ref = Tokenizer(smollm2_dir), transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    for text in TEXTS + _corpus():
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), text
    for msgs in CONVERSATIONS:
        for g in (False, True):
            assert ours.apply_chat_template(msgs, g) == ref.apply_chat_template(
                msgs, add_generation_prompt=g, tokenize=False
            )
    assert (ours.bos_id, ours.eos_id, ours.vocab_size) == (ref.bos_token_id, ref.eos_token_id, len(ref))


# ---------------------------------------------------------------------------------------------- masking


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


# ---------------------------------------------------------------------------------------------- files, cache


def _write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_load_formats(tmp_path):
    magi = _write(
        tmp_path / "m.jsonl",
        [{"problem": "p1", "solution": "s1", "lang": "py"}, "", {"problem": "p2", "solution": "s2"}],
    )
    assert load_examples(magi) == [{"instruction": "p1", "response": "s1"}, {"instruction": "p2", "response": "s2"}]
    alpaca = tmp_path / "a.json"
    alpaca.write_text(
        json.dumps(
            [{"instruction": "i", "input": "x", "output": "o"}, {"instruction": "j", "input": "", "output": "p"}],
            indent=2,
        )
    )
    assert load_examples(alpaca) == [{"instruction": "i\n\nx", "response": "o"}, {"instruction": "j", "response": "p"}]
    chat = _write(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[1]}])
    assert load_examples(chat)[0]["messages"][1] == {"role": "user", "content": "Hi"}
    ex = load_examples(magi)
    train, val = pack.split_examples(ex * 10, 0.2, seed=1)
    assert len(val) == 4 and len(train) == 16 and pack.split_examples(ex * 10, 0.2, seed=1) == (train, val)


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"problem": "a", "solution": "b"}, '{"problem": "a", "solution": '], r"x\.jsonl:2: invalid JSON"),
        ([{"problem": "a", "solution": "b"}, "", {"problem": "a"}], r"x\.jsonl:3: missing field 'solution'"),
        ([{"problem": "a", "solution": 7}], r"x\.jsonl:1: field 'solution' must be a string, got int"),
        ([{"messages": [{"role": "user", "content": "hi"}]}], r"x\.jsonl:1: the last message must be the assistant"),
        ([{"text": "a"}], r"x\.jsonl:1: cannot tell the format"),
        ([], r"x\.jsonl: no examples \(empty file\)"),
    ],
)
def test_bad_input_names_file_and_line(tmp_path, rows, message):
    with pytest.raises(ValueError, match=message):
        load_examples(_write(tmp_path / "x.jsonl", rows))


def test_bad_json_array_line_and_skip_bad_rows(tmp_path, capsys):
    arr = tmp_path / "a.json"
    arr.write_text('[\n  {"problem": "a", "solution": "b"},\n  {"problem": "c", "solution": 1},\n  {"problem": }\n]')
    with pytest.raises(ValueError, match=r"a\.json:3: field 'solution' must be a string"):
        load_examples(arr)
    with pytest.raises(ValueError, match=r"a\.json:4: invalid JSON"):
        load_examples(arr, skip_bad_rows=True)  # a broken array cannot be resynchronised
    good = {"problem": "a", "solution": "b"}
    path = _write(tmp_path / "x.jsonl", [good, "{oops", {"problem": "a"}, {"problem": 1, "solution": "b"}, good])
    assert load_examples(path, skip_bad_rows=True) == [{"instruction": "a", "response": "b"}] * 2
    assert "skipped 3 bad rows (first: " + str(path) + ":2: invalid JSON" in capsys.readouterr().err


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


# ---------------------------------------------------------------------------------------------- stdlib dataset


def test_stdlib_examples_are_real_code():
    train, val = pack.stdlib_examples("train"), pack.stdlib_examples("val")
    assert len(train) > 2000 and 0.02 < len(val) / (len(train) + len(val)) < 0.1
    assert not {e["name"] for e in train} & {e["name"] for e in val}
    pack._stdlib_functions.cache_clear()
    assert pack.stdlib_examples("val") == val  # a fresh walk gives the same split
    checked = 0
    for e in train + val:
        head = e["instruction"].split("\n\n", 1)[1]
        fn = ast.parse(head + "\n" + e["response"]).body[0]  # signature + docstring + body is a whole function
        assert ast.get_docstring(fn) and e["response"].strip() and ast.get_docstring(fn) not in e["response"]
        if (obj := _resolve(e["name"])) is not None:  # and it is the function's real source, formatting and all
            assert head + "\n" + e["response"] + "\n" in textwrap.dedent(inspect.getsource(obj))
            checked += 1
    assert checked > 100


SAFE_MODULES = {"json", "textwrap", "argparse", "_pydecimal", "fractions", "ast", "difflib", "shlex", "statistics"}


def _resolve(name):
    """The function object behind a qualified name, for a few modules that are safe to import."""
    module, *attrs = name.split(".")
    if module not in SAFE_MODULES:
        return None
    obj = importlib.import_module(module)
    while attrs and hasattr(obj, "__path__"):  # a package: descend into its submodules
        obj = importlib.import_module(f"{obj.__name__}.{attrs.pop(0)}")
    for a in attrs:
        obj = getattr(obj, a, None)
    return obj if inspect.isfunction(obj) else None


@pytest.mark.parametrize("context", [1024, 2048])
def test_stdlib_packing_efficiency(smollm2_dir, context):
    ds = build_dataset(pack.stdlib_examples(), Tokenizer(smollm2_dir), context)
    report = ds.report()
    print(report)
    assert ds.num_tokens / (len(ds) * context) >= 0.97
