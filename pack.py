"""Tokenized documents with their loss masks, cached on disk and packed into rows of equal length.

Tokens and masks
----------------
Each example becomes one document of token ids with a mask that is 1 where a token is supervised: by default every
assistant turn with its end-of-turn token and nothing else, so the model learns to answer and to stop, not to write
prompts (train_on_prompt supervises everything). tokenizer.segments cuts the rendered text into prompt pieces and
responses; each piece is tokenized on its own and the ids are concatenated, so a response's tokens are exactly the
ones the model must generate after its prompt's tokens. A cut through what the tokenizer would merge (a prompt ending
in a space, a response starting with spaces after a newline) makes the tokens at that cut differ from the joined
text's.

`preview` (and `python pack.py DATA --tokenizer DIR --preview N`) prints the first N documents decoded, BOS and EOS
visible, the supervised text marked, and one warning line for each example without a supervised token, with a
double BOS, with a response not ended by EOS or holding one before its end (an answer quoting the end-of-turn text,
which tokenizes as the token itself), or with tokens that merge across a cut; `check_examples` runs the same checks
over a whole dataset. Messages name an example by its "file:line" (its stdlib function for the default data).

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
same order and the rows of optimizer step s are a pure function of s (`PackedDataset.step_batch`): resuming needs
nothing but the step number. `pack=False` puts one example per row, padded to the longest in its batch (or to C with
pad_to_max), for comparison. Length policy: context_length "auto" is the 95th percentile of example lengths rounded
up to 64 and capped by the model's maximum; longer examples are truncated (or dropped with truncate=False), and both
are counted in the report.

Cache
-----
The token stream is cached under `cache_dir` as three .npy files read back as memory maps (tokens uint32, mask uint8,
document offsets int64) and a small json written last, which marks the entry complete. The key hashes the data
(content for files under 64 MiB, else path + size + mtime), the tokenizer files, the template and the settings. Each
file is written atomically (atomic.atomic_write), so an interrupted run never leaves a half entry. Tokenizing runs in
the tokenizer libraries' native threads rather than a process pool, whose start-up and pickling cost more than the
Python-side work it would spread.
"""

import argparse
import bisect
import hashlib
import itertools
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from jinja2 import TemplateError

from support.atomic import atomic_write, read_json, write_json
from support.examples import load_examples, stdlib_examples
from support.tokenizer import Tokenizer, segments

CACHE_VERSION = 2  # 2: every assistant turn supervised, pieces tokenized one by one


def _label(ex, i):
    """Where example i came from, for messages: its file and line, its stdlib function, or else its position."""
    return ex.get("source") or ex.get("name") or f"example {i}"


def _encode(examples, tokenizer, template, first=0, skip_bad_rows=False):
    """([(label, parts)], [skipped]): per example, its parts in order as (token ids, text, supervised): BOS (text None)
    where prepended, the pieces of tokenizer.segments tokenized one by one, and EOS (text None) after each response
    where the template has none. An example the template rejects stops the run, or is skipped with skip_bad_rows."""
    docs, bad = [], []
    for i, ex in enumerate(examples, first):
        label = _label(ex, i)
        try:
            docs.append((label, segments(ex, tokenizer, template)))
        except (ValueError, TemplateError) as e:
            if not skip_bad_rows:
                raise ValueError(f"{label}: {e}") from None
            bad.append(f"{label}: {e}")
    ids = iter(tokenizer.encode_batch([text for _, (pieces, _, _) in docs for text, _ in pieces]))
    bos, eos, out = ([tokenizer.bos_id], None, False), ([tokenizer.eos_id], None, True), []
    for label, (pieces, add_bos, add_eos) in docs:
        parts = [bos] if add_bos else []
        for text, supervised in pieces:
            parts += [(next(ids), text, supervised)] + ([eos] if supervised and add_eos else [])
        out.append((label, parts))
    return out, bad


def renders(ex, tokenizer, template=None):
    """Whether the template renders example `ex` (what skip_bad_rows keeps)."""
    return bool(_encode([ex], tokenizer, template, skip_bad_rows=True)[0])


def tokenize_examples(examples, tokenizer, template=None, train_on_prompt=False, chunk=4096, skip_bad_rows=False):
    """Flat token stream (tokens uint32 (N,), mask uint8 (N,), offsets int64 (docs + 1,)): document i is
    tokens[offsets[i]:offsets[i + 1]], its pieces tokenized one by one, mask 1 where a token is supervised."""
    if tokenizer.eos_id is None:
        raise ValueError(f"{tokenizer.path}: the tokenizer has no eos token, which ends every response")
    tokens, mask, lengths, bad = [], [], [], []
    # chunks bound the peak of Python int lists (tens of bytes per token) to a few thousand examples
    for first in range(0, len(examples), chunk):
        docs, skipped = _encode(examples[first : first + chunk], tokenizer, template, first, skip_bad_rows)
        parts, bad = [p for _, parts in docs for p in parts], bad + skipped
        sizes = np.array([len(ids) for ids, _, _ in parts], dtype=np.int64)
        ids = itertools.chain.from_iterable(ids for ids, _, _ in parts)
        tokens.append(np.fromiter(ids, dtype=np.uint32, count=int(sizes.sum())))
        mask.append(np.repeat(np.array([s or train_on_prompt for _, _, s in parts], dtype=np.uint8), sizes))
        lengths += [sum(len(ids) for ids, _, _ in parts) for _, parts in docs]
    if bad:
        print(f"skipped {len(bad)} examples the template cannot render (first: {bad[0]})", file=sys.stderr)
    if not lengths:
        raise ValueError("no examples to tokenize" + (" (every one skipped)" if bad else ""))
    return np.concatenate(tokens), np.concatenate(mask), np.concatenate([[0], np.cumsum(lengths)])


def _save_npy(path, array):
    def write(tmp):
        with open(tmp, "wb") as f:  # a file object: given a name, np.save would append ".npy" to it
            np.save(f, array)

    atomic_write(path, write)


def tokenize_cached(
    data, tokenizer, template=None, train_on_prompt=False, cache_dir=None, fmt="auto", skip_bad_rows=False
):
    """tokenize_examples over a path (read with load_examples) or a list of examples, through the disk cache."""

    def tokenize():  # (arrays, how many examples went in)
        examples = load_examples(data, fmt, skip_bad_rows) if isinstance(data, str | os.PathLike) else data
        arrays = tokenize_examples(examples, tokenizer, template, train_on_prompt, skip_bad_rows=skip_bad_rows)
        return arrays, len(examples)

    if not cache_dir:
        return tokenize()[0]
    h = hashlib.sha256(json.dumps([CACHE_VERSION, template, train_on_prompt, fmt, skip_bad_rows]).encode())
    if isinstance(data, str | os.PathLike):
        if not os.path.isfile(data):
            raise FileNotFoundError(f"{data}: no such data file")
        st = os.stat(data)
        big = f"{Path(data).resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()
        h.update(Path(data).read_bytes() if st.st_size < (64 << 20) else big)
    else:
        h.update(json.dumps(data, sort_keys=True).encode())
    for f in tokenizer.files:
        h.update(f.name.encode() + hashlib.sha256(f.read_bytes()).digest())
    stem, names = Path(cache_dir) / h.hexdigest()[:24], ("tokens", "mask", "offsets")
    if not stem.with_suffix(".json").exists():
        arrays, n = tokenize()
        stem.parent.mkdir(parents=True, exist_ok=True)
        for name, a in zip(names, arrays, strict=True):
            _save_npy(stem.with_suffix(f".{name}.npy"), a)
        meta = {"source": str(data) if isinstance(data, str | os.PathLike) else "examples", "docs": len(arrays[2]) - 1}
        write_json(stem.with_suffix(".json"), meta | {"skipped": n - meta["docs"]})
    elif skipped := read_json(stem.with_suffix(".json")).get("skipped"):  # said again: the cache holds no such rows
        print(f"skipped {skipped} examples the template cannot render (as cached)", file=sys.stderr)
    return tuple(np.load(stem.with_suffix(f".{name}.npy"), mmap_mode="r") for name in names)


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
        C, starts, doc_lens = context_length, np.asarray(offsets[:-1]), np.diff(offsets)
        lens = np.minimum(doc_lens, C)
        # supervised targets of a doc are its tokens 1..len-1 (token 0 has no predecessor in the doc)
        supervised = np.add.reduceat(mask, starts, dtype=np.int64) - mask[starts]
        for i in np.flatnonzero(doc_lens > C):
            supervised[i] = int(mask[starts[i] + 1 : starts[i] + C].sum())
        keep = (doc_lens <= C) | (truncate & (supervised > 0))
        cut, drop = (doc_lens > C) & keep, ~keep
        self.stats = dict(examples=len(doc_lens), lengths=doc_lens, truncated=int(cut.sum()), dropped=int(drop.sum()))
        self.stats |= dict(truncated_tokens=int((doc_lens - lens)[cut].sum()), dropped_tokens=int(doc_lens[drop].sum()))
        self.tokens, self.mask, self.starts, self.lens = tokens, mask, starts[keep], lens[keep]
        self.num_tokens, self.num_supervised = int(self.lens.sum()), int(supervised[keep].sum())
        self.context_length, self.pack, self.pad_to_max, self.seed, self.pad_id = C, pack, pad_to_max, seed, pad_id
        self.rows = pack_bfd(self.lens, C) if pack else [[i] for i in range(len(self.lens))]
        if not self.rows:
            raise ValueError(f"no examples left: all {len(doc_lens)} are longer than context_length {C}")

    def __len__(self):
        return len(self.rows)

    def steps_per_epoch(self, rows_per_batch, world_size=1):
        return -(-len(self.rows) // (rows_per_batch * world_size))

    def step_batch(self, step, rows_per_batch, rank=0, world_size=1):
        """This rank's rows of optimizer step `step`, counting across epochs: a pure function of the step."""
        epoch, b = divmod(step, self.steps_per_epoch(rows_per_batch, world_size))
        return next(self.batches(epoch, rows_per_batch, rank, world_size, start=b))

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
        eff = [f"{self.num_tokens / slots:.1%}" for slots in (packed * C, longest, len(shuffled) * C)]
        out.append(
            f"rows: {len(self.rows):,} ({'packed' if self.pack else 'one example each'}); efficiency (real tokens "
            f"/ slots): packed {eff[0]}, padded to the longest of {rows_per_batch} {eff[1]}, padded to {C} {eff[2]}"
        )
        return "\n".join(out)


def auto_context_length(lengths, max_context=None, multiple=64):
    """95th percentile of example lengths, rounded up to `multiple`, capped by the model's maximum."""
    c = max(multiple, int(np.ceil(np.percentile(lengths, 95) / multiple)) * multiple)
    return min(c, max_context) if max_context else c


def build_dataset(data, tokenizer, context_length="auto", *, pack=True, truncate=True, pad_to_max=False, seed=0,
                  template=None, train_on_prompt=False, cache_dir=None, max_context=None, fmt="auto",
                  skip_bad_rows=False):  # fmt: skip
    """A path or a list of example dicts -> PackedDataset, tokenized once through the cache."""
    tokens, mask, offsets = tokenize_cached(data, tokenizer, template, train_on_prompt, cache_dir, fmt, skip_bad_rows)
    if context_length == "auto":
        context_length = auto_context_length(np.diff(offsets), max_context)
    elif not isinstance(context_length, int) or context_length <= 0:
        raise ValueError(f"context_length must be a positive int or 'auto', got {context_length!r}")
    return PackedDataset(tokens, mask, offsets, context_length, pack, truncate, pad_to_max, seed, tokenizer.pad_id)


def _merges(docs, tok):
    """{j: the first cut of docs[j] between two text pieces where tokenizing them joined differs from apart}."""
    pairs = [(j, a, b) for j, (_, parts) in enumerate(docs) for a, b in itertools.pairwise(parts)]
    cuts = [(j, a, b) for j, a, b in pairs if a[1] and b[1]]  # BOS and EOS, ids without text, are not cut
    out = {}
    for (j, a, b), joined in zip(cuts, tok.encode_batch([a[1] + b[1] for _, a, b in cuts]), strict=True):
        if joined != a[0] + b[0]:
            out.setdefault(j, f"tokens merge across the cut {a[1][-20:]!r} | {b[1][:20]!r}")
    return out


def _warnings(docs, tok, train_on_prompt):
    """One line per problem: no supervised token, a double BOS, a response not ended by EOS or holding EOS before its
    end (the end-of-turn text inside an answer tokenizes as the token itself), tokens that merge across a cut between
    pieces (the joined text tokenizes differently from its pieces tokenized one by one)."""
    out, eos, merges = [], repr(tok.special_tokens.get("eos_token")), _merges(docs, tok)
    for j, (label, parts) in enumerate(docs):
        ids, mask = [t for p, _, _ in parts for t in p], [s or train_on_prompt for p, _, s in parts for _ in p]
        if not any(mask[1:]):  # the first token is nobody's target
            out.append(f"{label}: no supervised token")
        if ids[:2] == [tok.bos_id] * 2:
            out.append(f"{label}: double BOS {tok.decode(ids[:2])!r} at the start")
        responses = [k for k, (_, text, s) in enumerate(parts) if s and text is not None]
        for n, k in enumerate(responses, 1):
            end = parts[k + 1][0] if k + 1 < len(parts) and parts[k + 1][1] is None else parts[k][0]
            if end[-1:] != [tok.eos_id]:
                tail = parts[k][1][-20:]
                out.append(f"{label}: response {n} ends with {tail!r}, not EOS {eos}: the model will not stop")
            if tok.eos_id in parts[k][0][:-1]:
                out.append(f"{label}: response {n} holds EOS {eos} before its end: the model learns to stop there")
        if j in merges:
            out.append(f"{label}: {merges[j]}; the joined text tokenizes differently from its pieces")
    return out


def check_examples(examples, tokenizer, template=None, train_on_prompt=False, chunk=4096, skip_bad_rows=False):
    """The warnings of `preview` over all examples."""
    chunks = range(0, len(examples), chunk)
    docs = [_encode(examples[f : f + chunk], tokenizer, template, f, skip_bad_rows)[0] for f in chunks]
    return [w for d in docs for w in _warnings(d, tokenizer, train_on_prompt)]


def preview(examples, tokenizer, template=None, train_on_prompt=False, n=3, color=None, skip_bad_rows=False):
    """The first n examples as training sees them: decoded with BOS/EOS visible, supervised text marked (green on a
    terminal, in ⟦ ⟧ otherwise; color=None asks sys.stdout.isatty()), then one warning line per problem in them."""
    on, off = ("\x1b[32m", "\x1b[0m") if (sys.stdout.isatty() if color is None else color) else ("⟦", "⟧")
    docs, tok = _encode(examples[:n], tokenizer, template, skip_bad_rows=skip_bad_rows)[0], tokenizer
    name = lambda i: "none" if i is None else f"{tok.decode([i])!r} ({i})"
    out = [f"BOS {name(tok.bos_id)}, EOS {name(tok.eos_id)}, pad {name(tok.pad_id)}; supervised: {on}text{off}"]
    for label, parts in docs:
        runs = [(bool(s or train_on_prompt), ids) for ids, _, s in parts]
        grouped = [(k, [t for _, ids in g for t in ids]) for k, g in itertools.groupby(runs, key=lambda r: r[0])]
        n_sup = sum(len(ids) for k, ids in grouped if k)
        out.append(f"--- {label}: {sum(len(ids) for _, ids in grouped)} tokens, {n_sup} supervised ---")
        out.append("".join(on + tok.decode(ids) + off if k else tok.decode(ids) for k, ids in grouped))
    warnings = _warnings(docs, tok, train_on_prompt)
    return "\n".join(out + ([f"warning: {w}" for w in warnings] or [f"no warnings in the {len(docs)} examples shown"]))


def tokens_or_auto(text):
    """--context: "auto" or a positive number of tokens."""
    if text == "auto" or text.isdigit() and int(text) > 0:
        return text if text == "auto" else int(text)
    raise argparse.ArgumentTypeError(f"expected 'auto' or a positive number of tokens, got {text!r}")


def main():
    p = argparse.ArgumentParser(description="Tokenize and pack a dataset; print the packing report and the time.")
    p.add_argument("data", help="a .jsonl / .json / .parquet file, or 'stdlib' for the embedded dataset")
    p.add_argument("--tokenizer", required=True, help="a directory with tokenizer.json or tokenizer.model")
    p.add_argument("--template", help="a format string with {instruction} and {response} (default: chat template)")
    p.add_argument("--train-on-prompt", action="store_true")
    p.add_argument("--context", default="auto", type=tokens_or_auto, help="'auto' or a number of tokens")
    p.add_argument("--cache-dir", default="data/cache")
    p.add_argument("--no-pack", action="store_true")
    p.add_argument("--preview", type=int, default=0, metavar="N", help="then show the first N examples as tokenized")
    a = p.parse_args()
    try:
        t0, tok = time.perf_counter(), Tokenizer(a.tokenizer)
        data = stdlib_examples() if a.data == "stdlib" else a.data
        kw = dict(pack=not a.no_pack, template=a.template, train_on_prompt=a.train_on_prompt, cache_dir=a.cache_dir)
        print(build_dataset(data, tok, a.context, **kw).report())
        print(f"built in {time.perf_counter() - t0:.2f}s")
        if a.preview:
            examples = data if a.data == "stdlib" else load_examples(data)
            print(preview(examples, tok, a.template, a.train_on_prompt, a.preview))
    except (ValueError, OSError) as e:  # bad data or tokenizer: one line, as train.py says it
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
