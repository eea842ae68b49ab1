"""Data: tokenizers, instruction datasets, and sample packing.

Tokenizer
---------
`Tokenizer(dir)` reads a Hugging Face tokenizer directory: tokenizer.json (the `tokenizers` library) or
tokenizer.model (`sentencepiece`), plus tokenizer_config.json for the special tokens and the chat template (or a
chat_template.jinja file). The chat template is Jinja rendered the way transformers renders it: a sandboxed
environment with trim_blocks and lstrip_blocks, a `raise_exception` function, a `tojson` filter that does not escape
HTML, and bos_token/eos_token/... and add_generation_prompt as variables. The sentencepiece path cuts text at
special-token strings and encodes each span on its own, so sentencepiece's dummy prefix applies per span (as in the
original Llama/Mistral tokenizers and transformers' sentencepiece tokenizers with legacy=True).

Examples and loss masking
-------------------------
An example is an (instruction, response) pair or a chat `messages` list. With the checkpoint's chat template the
prompt is the template over all but the last message with add_generation_prompt=True and the response is the last
(assistant) message's content; with a plain template ("...{instruction}...{response}") the prompt is the text before
{response}. Prompt and response are tokenized separately and concatenated, EOS ends every response, and by default
only the response and its EOS are supervised:  doc = [bos] prompt response eos,  mask = 0 ... 0 1 ... 1.

Packing
-------
Padding every example to the longest in its batch wastes most of the compute on datasets whose lengths span two
orders of magnitude. Instead whole documents are packed into rows of C = context_length tokens by best-fit-decreasing
(BFD): take documents longest first and put each into the open row with the least free space that still holds it,
opening a new row when none does. Open rows are bucketed by free space and the distinct free sizes are kept in a
sorted list, so finding the best row is one bisect: O(n log C) for n documents. A document is never split. Inside a
row, position_ids restart at 0 at every document; the model reads position_ids == 0 as a document start and lets
tokens attend only within their document (varlen flash attention, or a block-diagonal mask), so packed samples never
see each other. Trailing padding is its own pseudo-document (positions 0, 1, ... again) with labels -100.

Labels are pre-shifted: labels[t] is the target at position t, i.e. input[t+1] when t+1 is in the same document and
is supervised, else -100. A row with C = 8 holding A (prompt a0 a1, response a2 eos) and B (prompt b0, response eos):

    input_ids    a0   a1   a2   eos  b0   eos  pad  pad
    position_ids 0    1    2    3    0    1    0    1
    labels       -100 a2   eos  -100 eos  -100 -100 -100

A batch is a token budget, `rows_per_batch` rows of C tokens. Rows are shuffled per epoch by a generator seeded with
(seed, epoch); rank r of w takes its slice of each global batch of w * rows_per_batch rows, so every rank sees the
same order and resuming at batch k skips k batches without touching data. `pack=False` puts one example per row,
padded to the longest in its batch (or to C with pad_to_max), for comparison. Length policy: context_length "auto"
is the 95th percentile of example lengths rounded up to 64 and capped by the model's maximum; longer examples are
truncated (or dropped with truncate=False), and both are counted in the report.

Cache
-----
The token stream is cached under `cache_dir` as three .npy files read back as memory maps (tokens uint32, mask uint8,
document offsets int64) and a small json written last, which marks the entry complete. The key hashes the data
(content for files under 64 MiB, else path + size + mtime), the tokenizer files, the template and the settings. Each
file is written to a temp name and moved into place with os.replace, so an interrupted run never leaves a half entry.
Tokenizing runs in native threads (tokenizers' encode_batch, sentencepiece's list encode): on 2 cores this beat a
spawn-based process pool, whose start-up and pickling cost more than the Python-side work it would spread.
"""

import ast
import bisect
import functools
import hashlib
import json
import os
import re
import sys
import sysconfig
import time
from datetime import datetime
from itertools import chain
from pathlib import Path

import numpy as np
import torch

DEFAULT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n{response}"
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
FORMATS = {
    "magicoder": ("problem", "solution"),
    "alpaca": ("instruction", "output"),
    "pairs": ("instruction", "response"),
}
CACHE_VERSION = 1


def _token_str(v):
    return v.get("content") if isinstance(v, dict) else v  # tokenizer_config stores AddedToken as a dict


def _compile_chat_template(source):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson HTML-escapes <, > and &, which would change the prompt text.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)


class Tokenizer:
    """tokenizer.json or tokenizer.model behind encode/decode, special ids and the chat template."""

    def __init__(self, path):
        self.path = d = Path(path) if Path(path).is_dir() else Path(path).parent
        cfg_file = d / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        self.special_tokens = {k: _token_str(cfg[k]) for k in SPECIAL_NAMES if cfg.get(k)}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template}.get("default")
        if template is None and (d / "chat_template.jinja").exists():
            template = (d / "chat_template.jinja").read_text()
        self.chat_template, self._compiled = template, None
        if (d / "tokenizer.json").exists():
            import tokenizers

            self.files, self._sp = [d / "tokenizer.json"], None
            self._tok = tokenizers.Tokenizer.from_file(str(self.files[0]))
            self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
            ids = {s: self._tok.token_to_id(s) for s in self.special_tokens.values()}
        elif (d / "tokenizer.model").exists():
            import sentencepiece

            self.files, self._tok = [d / "tokenizer.model"], None
            self._sp = sp = sentencepiece.SentencePieceProcessor(model_file=str(self.files[0]))
            for name, i in (("bos_token", sp.bos_id()), ("eos_token", sp.eos_id()), ("unk_token", sp.unk_id())):
                if i >= 0:  # a bare .model still names its own specials
                    self.special_tokens.setdefault(name, sp.id_to_piece(i))
            n = sp.get_piece_size()
            ids = {
                s: i for s in self.special_tokens.values() if (i := sp.piece_to_id(s)) < n and sp.id_to_piece(i) == s
            }
            ids |= {_token_str(t): int(i) for i, t in cfg.get("added_tokens_decoder", {}).items()}
            self._special, self._special_of = ids, {i: s for s, i in ids.items()}
            self._split = re.compile("(" + "|".join(map(re.escape, sorted(ids, key=len, reverse=True))) + ")")
            self.vocab_size = max([n - 1, *ids.values()]) + 1
        else:
            raise FileNotFoundError(f"{d}: no tokenizer.json or tokenizer.model")
        self.files += [f for f in (cfg_file, d / "chat_template.jinja") if f.exists()]
        self.bos_id, self.eos_id, pad = (
            ids.get(self.special_tokens.get(k)) for k in SPECIAL_NAMES[:2] + ("pad_token",)
        )
        self.pad_id = pad if pad is not None else self.eos_id
        # Whether plain (non-chat) prompts start with BOS: the config says so, else what the tokenizer does by itself.
        default = self._sp is not None or self._tok.encode("a").ids[:1] == [self.bos_id]
        self.add_bos = self.bos_id is not None and bool(cfg.get("add_bos_token", default))

    def encode_batch(self, texts):
        """Token ids of many texts without BOS/EOS; both libraries encode a list in parallel native threads."""
        if self._sp is None:
            return [e.ids for e in self._tok.encode_batch_fast(list(texts), add_special_tokens=False)]
        parts = [[p for p in self._split.split(t) if p] if self._special else [t] for t in texts]
        plain = iter(self._sp.encode([p for ps in parts for p in ps if p not in self._special]))
        return [[i for p in ps for i in ([self._special[p]] if p in self._special else next(plain))] for ps in parts]

    def encode(self, text, bos=False, eos=False):
        return [self.bos_id] * bos + self.encode_batch([text])[0] + [self.eos_id] * eos

    def decode(self, ids):
        if self._sp is None:
            return self._tok.decode(list(ids), skip_special_tokens=False)
        out, run = [], []
        for i in ids:  # sentencepiece drops control pieces and knows no added ids: those are spelled out here
            if i in self._special_of:
                out += [self._sp.decode(run), self._special_of[i]]
                run = []
            else:
                run.append(i)
        return "".join(out) + self._sp.decode(run)

    def apply_chat_template(self, messages, add_generation_prompt=False):
        if self.chat_template is None:
            raise ValueError(f"{self.path}: the tokenizer has no chat_template")
        self._compiled = self._compiled or _compile_chat_template(self.chat_template)
        kw = dict(messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt)
        return self._compiled.render(**kw, **self.special_tokens)


# ---------------------------------------------------------------------------------------------- reading examples


def _rows(path):
    """(line, row or ValueError) pairs from JSON lines, a JSON array, or Parquet."""
    if path.suffix == ".parquet":
        import pyarrow.parquet  # optional: only Parquet inputs need it

        yield from enumerate(pyarrow.parquet.read_table(path).to_pylist(), 1)
        return
    text = path.read_text(encoding="utf-8")
    if not text.lstrip().startswith("["):
        for line, s in enumerate(text.splitlines(), 1):
            try:
                yield from [(line, json.loads(s))] if s.strip() else []
            except json.JSONDecodeError as e:
                yield line, ValueError(f"{path}:{line}: invalid JSON ({e.msg} at column {e.colno})")
        return
    dec, sep = json.JSONDecoder(), re.compile(r"[\s,]*")  # walk the array item by item to know each item's line
    i, line = text.index("[") + 1, 1
    while (j := sep.match(text, i).end()) < len(text) and text[j] != "]":
        line += text.count("\n", i, j)
        try:
            row, i = dec.raw_decode(text, j)
        except json.JSONDecodeError as e:  # the array cannot be resynchronised: fatal even with skip_bad_rows
            raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        yield line, row
        line += text.count("\n", j, i)


def _example(row, fmt, where):
    if isinstance(row, Exception):
        raise row
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if fmt == "messages":
        msgs = row.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ValueError(f"{where}: field 'messages' must be a non-empty list of {{role, content}} objects")
        for k, m in enumerate(msgs):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f"{where}: messages[{k}] needs string 'role' and 'content'")
        if msgs[-1]["role"] != "assistant":
            raise ValueError(f"{where}: the last message must be the assistant's, got '{msgs[-1]['role']}'")
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in msgs]}
    src, dst = FORMATS[fmt]
    extra = ("input",) if fmt == "alpaca" and row.get("input") is not None else ()
    for k in (src, dst, *extra):
        if k not in row:
            raise ValueError(f"{where}: missing field '{k}'")
        if not isinstance(row[k], str):
            raise ValueError(f"{where}: field '{k}' must be a string, got {type(row[k]).__name__}")
    instruction = row[src] + ("\n\n" + row["input"] if extra and row["input"] else "")
    return {"instruction": instruction, "response": row[dst]}


def _detect(row, where):
    keys = set(row) if isinstance(row, dict) else set()
    found = ["messages"] * ("messages" in keys) + [f for f, (a, b) in FORMATS.items() if {a, b} <= keys]
    if not found:
        known = "'messages', 'problem'+'solution', 'instruction'+'output' or 'instruction'+'response'"
        raise ValueError(f"{where}: cannot tell the format from keys {sorted(keys)}; expected {known}")
    return found[0]


def load_examples(path, fmt="auto", skip_bad_rows=False):
    """Rows of a .jsonl / .json (array) / .parquet file as {"instruction", "response"} or {"messages"} dicts;
    fmt is "auto", "magicoder", "alpaca", "pairs" or "messages"."""
    path, examples, bad = Path(path), [], []
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such data file")
    for line, row in _rows(path):
        try:
            if fmt == "auto" and not isinstance(row, Exception):
                fmt = _detect(row, f"{path}:{line}")
            examples.append(_example(row, fmt, f"{path}:{line}"))
        except ValueError as e:
            if not skip_bad_rows:
                raise
            bad.append(str(e))
    if bad:
        print(f"{path}: skipped {len(bad)} bad rows (first: {bad[0]})", file=sys.stderr)
    if not examples:
        raise ValueError(f"{path}: no examples (empty file{' or only bad rows' if bad else ''})")
    return examples


def split_examples(examples, val_fraction, seed=0):
    """(train, val): a seeded random `val_fraction` of the examples held out, both in their original order."""
    order = np.random.default_rng(seed).permutation(len(examples))
    n_val = int(round(len(examples) * val_fraction))
    return [examples[i] for i in sorted(order[n_val:])], [examples[i] for i in sorted(order[:n_val])]


def _functions(body, lines, prefix):
    """(qualified name, signature + docstring, body) for documented functions and methods, not nested functions."""
    out = []
    for node in body:
        if isinstance(node, ast.ClassDef):
            out += _functions(node.body, lines, f"{prefix}.{node.name}")
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or len(node.body) < 2:
            continue
        doc, first, rest = ast.get_docstring(node), node.body[0], node.body[1:]
        if not doc or len(doc) < 40 or ". " not in doc + " " or doc.lstrip().upper().startswith(("TODO", "XXX")):
            continue
        if first.end_lineno >= rest[0].lineno or all(isinstance(s, ast.Pass | ast.Expr) for s in rest):
            continue  # the docstring shares a line with code, or the body is only `pass` / `...`
        d = lines[node.lineno - 1][: node.col_offset]  # the def's indentation, removed from every line
        if any(s.strip() and not s.startswith(d) for s in lines[node.lineno - 1 : node.end_lineno]):
            continue  # a string literal runs out to the left margin: dedenting would change it
        head, tail = lines[node.lineno - 1 : first.end_lineno], lines[first.end_lineno : node.end_lineno]
        out.append((f"{prefix}.{node.name}", *("\n".join(s[len(d) :] for s in p).rstrip() for p in (head, tail))))
    return out


@functools.lru_cache(maxsize=1)
def _stdlib_functions():
    root, out = Path(sysconfig.get_paths()["stdlib"]), []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(
            d for d in dirs if d not in {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages"}
        )
        for path in sorted(Path(dirpath, f) for f in files if f.endswith(".py")):
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
                tree = ast.parse("\n".join(lines))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue  # a few stdlib files are deliberately invalid or not UTF-8
            out += _functions(tree.body, lines, ".".join(path.relative_to(root).with_suffix("").parts))
    return out


def stdlib_examples(split="train"):
    """Signature + docstring -> body pairs from this Python's standard library, real code available offline.
    One function in 20, chosen by a hash of its qualified name, is held out as "val"."""
    out = []
    for name, head, body in _stdlib_functions():
        if (int(hashlib.sha1(name.encode()).hexdigest()[:8], 16) % 20 == 0) == (split == "val"):
            instruction = f"Complete this Python function from `{name.rsplit('.', 1)[0]}`.\n\n{head}"
            out.append({"instruction": instruction, "response": body, "name": name})
    return out


# ---------------------------------------------------------------------------------------------- tokenizing


def render(ex, tok, template):
    """(prompt text, response text, prepend BOS?) for one example."""
    if "messages" not in ex and (template is not None or tok.chat_template is None):
        head, _, tail = (template or DEFAULT_TEMPLATE).partition("{response}")
        if tail or "{instruction}" not in head:
            raise ValueError(f"template must contain {{instruction}} and end with {{response}}: {template!r}")
        return head.replace("{instruction}", ex["instruction"]), ex["response"], tok.add_bos
    msgs = ex.get("messages") or [{"role": "user", "content": ex["instruction"]}]
    msgs = msgs if "messages" in ex else [*msgs, {"role": "assistant", "content": ex["response"]}]
    prompt, full = tok.apply_chat_template(msgs[:-1], add_generation_prompt=True), tok.apply_chat_template(msgs)
    if not full.startswith(prompt):
        msg = "the prompt rendered with add_generation_prompt=True is not a prefix of the whole conversation"
        raise ValueError(f"chat template: {msg}, so the prompt cannot be masked: {prompt[-60:]!r} vs {full[-60:]!r}")
    return prompt, msgs[-1]["content"], False


def _tokenize_chunk(examples, tokenizer, template, train_on_prompt):
    rendered = [render(ex, tokenizer, template) for ex in examples]
    prompts = tokenizer.encode_batch([p for p, _, _ in rendered])
    responses = tokenizer.encode_batch([r for _, r, _ in rendered])
    prompts = [[tokenizer.bos_id] + p if bos else p for p, (_, _, bos) in zip(prompts, rendered, strict=True)]
    n_p = np.array([len(p) for p in prompts], dtype=np.int64)
    n_r = np.array([len(r) + 1 for r in responses], dtype=np.int64)
    stream = chain.from_iterable(chain(p, r, [tokenizer.eos_id]) for p, r in zip(prompts, responses, strict=True))
    tokens = np.fromiter(stream, dtype=np.uint32, count=int(n_p.sum() + n_r.sum()))
    spans = np.stack([n_p, n_r], 1).ravel()  # prompt, response, prompt, response, ...
    mask = np.repeat(np.tile(np.array([int(train_on_prompt), 1], np.uint8), len(examples)), spans)
    return tokens, mask, n_p + n_r


def tokenize_examples(examples, tokenizer, template=None, train_on_prompt=False, chunk=4096):
    """Flat token stream (tokens uint32 (N,), mask uint8 (N,), offsets int64 (docs + 1,)): document i is
    tokens[offsets[i]:offsets[i + 1]] = [bos] prompt response eos, mask 1 where a token is supervised."""
    if tokenizer.eos_id is None:
        raise ValueError(f"{tokenizer.path}: the tokenizer has no eos token, which ends every response")
    if not examples:
        raise ValueError("no examples to tokenize")
    # chunks bound the peak of Python int lists (tens of bytes per token) to a few thousand examples
    chunks = [examples[i : i + chunk] for i in range(0, len(examples), chunk)]
    parts = [_tokenize_chunk(c, tokenizer, template, train_on_prompt) for c in chunks]
    tokens, mask, lengths = (np.concatenate(p) for p in zip(*parts, strict=True))
    return tokens, mask, np.concatenate([[0], np.cumsum(lengths)])


def _save(path, write):
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)


def tokenize_cached(
    data, tokenizer, template=None, train_on_prompt=False, cache_dir=None, fmt="auto", skip_bad_rows=False
):
    """tokenize_examples over a path (read with load_examples) or a list of examples, through the disk cache."""
    if not cache_dir:
        examples = load_examples(data, fmt, skip_bad_rows) if isinstance(data, str | os.PathLike) else data
        return tokenize_examples(examples, tokenizer, template, train_on_prompt)
    h = hashlib.sha256(json.dumps([CACHE_VERSION, template, train_on_prompt, fmt, skip_bad_rows]).encode())
    if isinstance(data, str | os.PathLike):
        st = os.stat(data)
        big = f"{Path(data).resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()
        h.update(Path(data).read_bytes() if st.st_size < (64 << 20) else big)
    else:
        h.update(json.dumps(data, sort_keys=True).encode())
    for f in tokenizer.files:
        h.update(f.name.encode() + hashlib.sha256(f.read_bytes()).digest())
    stem, names = Path(cache_dir) / h.hexdigest()[:24], ("tokens", "mask", "offsets")
    if not stem.with_suffix(".json").exists():
        arrays = tokenize_cached(data, tokenizer, template, train_on_prompt, None, fmt, skip_bad_rows)
        stem.parent.mkdir(parents=True, exist_ok=True)
        for name, a in zip(names, arrays, strict=True):
            _save(stem.with_suffix(f".{name}.npy"), lambda f, a=a: np.save(f, a))
        meta = {"source": str(data) if isinstance(data, str | os.PathLike) else "examples", "docs": len(arrays[2]) - 1}
        _save(stem.with_suffix(".json"), lambda f: f.write(json.dumps(meta).encode()))
    return tuple(np.load(stem.with_suffix(f".{name}.npy"), mmap_mode="r") for name in names)


# ---------------------------------------------------------------------------------------------- packing


def pack_bfd(lengths, capacity):
    """Best-fit-decreasing: lists of document indices whose lengths sum to at most `capacity` each."""
    rows, buckets, free_sizes = [], {}, []  # buckets[f]: rows with f free slots; free_sizes: sorted keys of buckets
    for i in np.argsort(-np.asarray(lengths), kind="stable").tolist():
        n = int(lengths[i])
        k = bisect.bisect_left(free_sizes, n)
        if k == len(free_sizes):  # nothing fits: open a row
            r, free = len(rows), capacity - n
            rows.append([])
        else:
            f = free_sizes[k]
            r, free = buckets[f].pop(), f - n
            if not buckets[f]:
                del free_sizes[k], buckets[f]
        rows[r].append(i)
        if free > 0:
            if free not in buckets:
                buckets[free] = []
                bisect.insort(free_sizes, free)
            buckets[free].append(r)
    return rows


class PackedDataset:
    """Documents laid out in rows of context_length (packed, or one per row with pack=False); see the docstring."""

    def __init__(
        self, tokens, mask, offsets, context_length, pack=True, truncate=True, pad_to_max=False, seed=0, pad_id=0
    ):
        C, starts, full = context_length, np.asarray(offsets[:-1]), np.diff(offsets)
        lens = np.minimum(full, C)
        # supervised targets of a doc are its tokens 1..len-1 (token 0 has no predecessor in the doc)
        supervised = np.add.reduceat(mask, starts, dtype=np.int64) - mask[starts]
        for i in np.flatnonzero(full > C):
            supervised[i] = int(mask[starts[i] + 1 : starts[i] + C].sum())
        keep = (full <= C) | (truncate & (supervised > 0))
        cut, drop = (full > C) & keep, ~keep
        self.stats = dict(examples=len(full), lengths=full, truncated=int(cut.sum()), dropped=int(drop.sum()))
        self.stats |= dict(truncated_tokens=int((full - lens)[cut].sum()), dropped_tokens=int(full[drop].sum()))
        self.tokens, self.mask, self.starts, self.lens = tokens, mask, starts[keep], lens[keep]
        self.num_tokens, self.num_supervised = int(self.lens.sum()), int(supervised[keep].sum())
        self.context_length, self.pack, self.pad_to_max, self.seed, self.pad_id = C, pack, pad_to_max, seed, pad_id
        self.rows = pack_bfd(self.lens, C) if pack else [[i] for i in range(len(self.lens))]
        if not self.rows:
            raise ValueError(f"no examples left: all {len(full)} are longer than context_length {C}")

    def __len__(self):
        return len(self.rows)

    def steps_per_epoch(self, rows_per_batch, world_size=1):
        return -(-len(self.rows) // (rows_per_batch * world_size))

    def batches(self, epoch, rows_per_batch, rank=0, world_size=1, start=0):
        """This rank's batches of one epoch from batch `start` on; the last global batch wraps around to the first
        rows so that every rank gets the same number of full batches."""
        per_step, steps = rows_per_batch * world_size, self.steps_per_epoch(rows_per_batch, world_size)
        order = np.resize(np.random.default_rng([self.seed, epoch]).permutation(len(self.rows)), steps * per_step)
        for b in range(start, steps):
            yield self.collate(order[b * per_step + rank * rows_per_batch :][:rows_per_batch])

    def collate(self, row_ids):
        """Rows -> {"input_ids", "labels", "position_ids"}: int64 tensors (rows, width)."""
        rows = [self.rows[r] for r in row_ids]
        width = self.context_length
        if not self.pack and not self.pad_to_max:
            width = max(int(self.lens[r[0]]) for r in rows)
        inp = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        sup, pos, ar = np.zeros(inp.shape, dtype=bool), np.zeros_like(inp), np.arange(width)
        for b, docs in enumerate(rows):
            t = 0
            for d in docs:
                s, n = int(self.starts[d]), int(self.lens[d])
                inp[b, t : t + n], sup[b, t : t + n] = self.tokens[s : s + n], self.mask[s : s + n]
                pos[b, t : t + n] = ar[:n]
                t += n
            pos[b, t:] = ar[: width - t]  # the padding run is a pseudo-document of its own
        labels = np.full_like(inp, -100)
        # shifted: the target at t is input t+1 if that token is supervised and does not start a new document
        labels[:, :-1] = np.where(sup[:, 1:] & (pos[:, 1:] != 0), inp[:, 1:], -100)
        return {k: torch.from_numpy(v) for k, v in (("input_ids", inp), ("labels", labels), ("position_ids", pos))}

    def report(self, rows_per_batch=8):
        """Length histogram, tokens kept / truncated / dropped, rows, and efficiency beside padded batching."""
        st, C, lens = self.stats, self.context_length, self.stats["lengths"]
        edges = [*range(0, C, C // 8), C + 1, max(C + 1, int(lens.max())) + 1]
        counts, _ = np.histogram(lens, bins=edges)
        pct = f"mean {lens.mean():.0f}, p50 {np.median(lens):.0f}, p95 {np.percentile(lens, 95):.0f}, max {lens.max()}"
        out = [f"examples: {st['examples']:,}; context_length {C}; lengths {pct}"]
        for lo, hi, c in zip(edges, edges[1:], counts, strict=False):
            out.append(
                f"  {f'{lo}-{hi - 1}' if lo <= C else f'> {C}':>12} {'#' * round(40 * c / counts.max()):<40} {c:,}"
            )
        cut = f"truncated {st['truncated']:,} examples (-{st['truncated_tokens']:,} tokens)"
        drop = f"dropped {st['dropped']:,} ({st['dropped_tokens']:,} tokens)"
        out.append(f"tokens kept {self.num_tokens:,} (supervised {self.num_supervised:,}); {cut}; {drop}")
        shuffled = self.lens[np.random.default_rng(self.seed).permutation(len(self.lens))]
        longest = sum(int(b.max()) * len(b) for b in np.array_split(shuffled, -(-len(shuffled) // rows_per_batch)))
        packed = len(self.rows) if self.pack else len(pack_bfd(self.lens, C))
        eff = [packed * C, longest, len(shuffled) * C]
        eff = [f"{self.num_tokens / slots:.1%}" for slots in eff]
        out.append(
            f"rows: {len(self.rows):,} ({'packed' if self.pack else 'one example each'}); efficiency (real tokens "
            f"/ slots): packed {eff[0]}, padded to the longest of {rows_per_batch} {eff[1]}, padded to {C} {eff[2]}"
        )
        return "\n".join(out)


def auto_context_length(lengths, max_context=None, multiple=64):
    """95th percentile of example lengths, rounded up to `multiple`, capped by the model's maximum."""
    c = max(multiple, int(np.ceil(np.percentile(lengths, 95) / multiple)) * multiple)
    return min(c, max_context) if max_context else c


def build_dataset(
    data,
    tokenizer,
    context_length="auto",
    *,
    pack=True,
    truncate=True,
    pad_to_max=False,
    seed=0,
    template=None,
    train_on_prompt=False,
    cache_dir=None,
    max_context=None,
    fmt="auto",
    skip_bad_rows=False,
):
    """A path or a list of example dicts -> PackedDataset, tokenized once through the cache."""
    tokens, mask, offsets = tokenize_cached(data, tokenizer, template, train_on_prompt, cache_dir, fmt, skip_bad_rows)
    if context_length == "auto":
        context_length = auto_context_length(np.diff(offsets), max_context)
    elif not isinstance(context_length, int) or context_length <= 0:
        raise ValueError(f"context_length must be a positive int or 'auto', got {context_length!r}")
    return PackedDataset(tokens, mask, offsets, context_length, pack, truncate, pad_to_max, seed, tokenizer.pad_id)


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="Tokenize and pack a dataset; print the packing report and the time.")
    p.add_argument("data", help="a .jsonl / .json / .parquet file, or 'stdlib' for the embedded dataset")
    p.add_argument("--tokenizer", required=True, help="a directory with tokenizer.json or tokenizer.model")
    p.add_argument("--context", default="auto", help="'auto' or a number of tokens")
    p.add_argument("--cache-dir", default="data/cache")
    p.add_argument("--no-pack", action="store_true")
    a = p.parse_args()
    t0 = time.perf_counter()
    data = stdlib_examples() if a.data == "stdlib" else a.data
    ctx = a.context if a.context == "auto" else int(a.context)
    ds = build_dataset(data, Tokenizer(a.tokenizer), ctx, pack=not a.no_pack, cache_dir=a.cache_dir)
    print(ds.report())
    print(f"built in {time.perf_counter() - t0:.2f}s")
