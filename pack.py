"""Tokenized documents with their loss masks, cached on disk and packed into rows of equal length.

Tokens and masks
----------------
Each example becomes one document of token ids, [bos] prompt response eos, with a mask that is 1 where a token is
supervised: by default only the response and its EOS, so the model learns to answer and to stop, not to write
prompts. Prompt and response are tokenized separately and concatenated.

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
file is written atomically (hf.atomic_write), so an interrupted run never leaves a half entry. Tokenizing runs in
the tokenizer libraries' native threads rather than a process pool, whose start-up and pickling cost more than the
Python-side work it would spread.
"""

import bisect
import hashlib
import json
import os
import time
from itertools import chain
from pathlib import Path

import numpy as np
import torch

from examples import load_examples, stdlib_examples
from hf import atomic_write, write_json
from tokenizer import Tokenizer, render

CACHE_VERSION = 1


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


def _save_npy(path, array):
    def write(tmp):
        with open(tmp, "wb") as f:  # a file object: given a name, np.save would append ".npy" to it
            np.save(f, array)

    atomic_write(path, write)


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
            _save_npy(stem.with_suffix(f".{name}.npy"), a)
        meta = {"source": str(data) if isinstance(data, str | os.PathLike) else "examples", "docs": len(arrays[2]) - 1}
        write_json(stem.with_suffix(".json"), meta)
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
