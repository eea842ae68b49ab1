"""Tokenized documents with their loss masks, packed into rows of equal length.

Tokens and masks. An example becomes a document: token ids, and a mask 1 where supervised: by
default each assistant turn and its end-of-turn token, so the model learns to answer and to stop,
not to write prompts (train_on_prompt: all). tokenizer.segments cuts the text into prompt and
response pieces, tokenized one by one: a response is what the model generates after its prompt.

Packing. Whole documents fill rows of C = context_length tokens by best-fit-decreasing (BFD):
longest first, each into the open row with the least free space that holds it, or a new one; a
bisect over sorted free sizes finds it, O(n log C). position_ids restart at 0 at each document;
attention stays within documents (model.py), so packed samples never see each other. Labels are
pre-shifted: labels[t] is input[t+1] if supervised and in t's document, else -100. C = 8, A
(prompt a0 a1, response a2 eos), B (prompt b0, response eos), padding (its own document):

    input_ids     a0    a1    a2    eos   b0    eos   pad   pad
    position_ids  0     1     2     3     0     1     0     1
    labels        -100  a2    eos   -100  eos   -100  -100  -100

Batches. A batch is rows_per_batch rows, shuffled per epoch; the rows of optimizer step s depend
on s alone (step_batch), so resuming needs only s. pack=False: one example a row, for comparison.
"""

import bisect

import numpy as np
import torch

from support.data.token_cache import cached_packer, tokenize_cached
from support.data.tokenizer import segment


def document(segmented, piece_ids, tokenizer, train_on_prompt=False):
    """One example's document: lists (token ids, mask True where supervised). segmented: from
    tokenizer.segments, (pieces [(text, supervised)], add BOS?, add EOS after each response?)."""
    pieces, add_bos, add_eos = segmented
    ids = [tokenizer.bos_id] if add_bos else []
    mask = [train_on_prompt] if add_bos else []
    for (_, supervised), piece in zip(pieces, piece_ids, strict=True):
        ids += piece
        mask += [supervised or train_on_prompt] * len(piece)
        if supervised and add_eos:  # supervised: the model learns to stop
            ids.append(tokenizer.eos_id)
            mask.append(True)
    return ids, mask


def count_supervised(mask, starts):
    """Each document's targets, int64 (docs,): supervised tokens after its first (unpredicted)."""
    if not len(starts):
        return np.zeros(0, np.int64)
    return np.add.reduceat(mask, starts, dtype=np.int64) - mask[starts]


def tokenize_chunk(examples, tokenizer, template=None, train_on_prompt=False, first=0, skip_bad_rows=False):
    """Examples (numbered from `first`) -> their documents end to end, tokens uint32 (n,)
    and mask uint8 (n,); per document its length, example index and supervised targets,
    int64 (docs,); "skipped": "label: why" per example the template rejects."""
    if tokenizer.eos_id is None:
        raise ValueError(f"{tokenizer.path}: the tokenizer has no eos token, which ends every response")
    segmented, skipped = segment(examples, tokenizer, template, first, skip_bad_rows)
    piece_ids = iter(tokenizer.encode_batch([text for *_, seg in segmented for text, _ in seg[0]]))
    ids = []
    mask = []
    lengths = []
    for *_, seg in segmented:  # seg: (pieces, add BOS?, add EOS?)
        doc, doc_mask = document(seg, [next(piece_ids) for _ in seg[0]], tokenizer, train_on_prompt)
        ids += doc
        mask += doc_mask
        lengths.append(len(doc))
    mask = np.array(mask, dtype=np.uint8)
    lengths = np.array(lengths, dtype=np.int64)
    supervised = count_supervised(mask, np.cumsum(lengths) - lengths)
    example = np.array([i for i, *_ in segmented], dtype=np.int64)
    out = dict(tokens=np.array(ids, dtype=np.uint32), mask=mask, lengths=lengths, example=example)
    return dict(out, supervised=supervised, skipped=skipped)


def pack_bfd(lengths, capacity):
    """Best-fit-decreasing: lists of document indices, lengths summing to <= capacity."""
    rows = []  # lists of document indices
    buckets = {}  # free space f -> the rows with f free slots
    free_sizes = []  # the keys of buckets, sorted
    for i in np.argsort(-np.asarray(lengths), kind="stable").tolist():
        n = int(lengths[i])
        k = bisect.bisect_left(free_sizes, n)
        if k == len(free_sizes):  # nothing fits: open a row
            f = capacity
            r = len(rows)
            rows.append([])
        else:
            f = free_sizes[k]
            r = buckets[f].pop()
            if not buckets[f]:
                del free_sizes[k], buckets[f]
        rows[r].append(i)
        if f > n:
            if f - n not in buckets:
                bisect.insort(free_sizes, f - n)
            buckets.setdefault(f - n, []).append(r)
    return rows


class PackedDataset:
    def __init__(self, stream, context_length, pack=True, truncate=True, pad_to_max=False, seed=0, pad_id=0, docs=None):
        """Documents in rows of context_length (packed, or one a row). stream: {tokens, mask,
        offsets}, and from `tokenized` "supervised" (a memory-mapped mask is not read whole) and
        "entry" (packed rows read back); docs: the documents to use, in order (default all)."""
        C = context_length
        self.mask = stream["mask"]
        docs = slice(None) if docs is None else docs
        starts = np.asarray(stream["offsets"][:-1])  # (docs,) where each document begins
        if (supervised := stream.get("supervised")) is None:  # not counted by the cache
            supervised = count_supervised(self.mask, starts)
        starts = starts[docs]  # (docs,): the documents used from here on
        doc_lens = np.diff(stream["offsets"])[docs]
        supervised = np.array(supervised[docs])
        lens = np.minimum(doc_lens, C)  # a longer document is truncated to C
        for i in np.flatnonzero(doc_lens > C):  # then only its first C tokens count
            supervised[i] = int(self.mask[starts[i] + 1 : starts[i] + C].sum())
        keep = (doc_lens <= C) | (truncate & (supervised > 0))  # a cut one, if a target is left
        cut = (doc_lens > C) & keep
        self.stats = dict(examples=len(doc_lens), lengths=doc_lens)  # counted in the report
        self.stats.update(truncated=int(cut.sum()), dropped=int((~keep).sum()))
        self.stats.update(truncated_tokens=int((doc_lens - lens)[cut].sum()))
        self.stats.update(dropped_tokens=int(doc_lens[~keep].sum()))
        self.tokens = stream["tokens"]  # the whole stream (a memory map)
        self.starts = starts[keep]
        self.lens = lens[keep]
        self.num_tokens = int(self.lens.sum())
        self.num_supervised = int(supervised[keep].sum())
        self.context_length = C
        self.pack = pack
        self.pad_to_max = pad_to_max
        self.seed = seed
        self.pad_id = pad_id
        packer = cached_packer(stream.get("entry"), pack_bfd)  # or the cache's rows
        self.rows = packer(self.lens, C) if pack else [[i] for i in range(len(self.lens))]
        if not self.rows:
            n = len(doc_lens)
            raise ValueError(f"no examples left: all {n} are longer than context_length {C}")

    def __len__(self):
        return len(self.rows)

    def count_steps(self, rows_per_batch, world_size=1):
        return -(-len(self.rows) // (rows_per_batch * world_size))

    def step_batch(self, step, rows_per_batch, rank=0, world_size=1):
        """This rank's rows of optimizer step `step`, counted across epochs."""
        epoch, b = divmod(step, self.count_steps(rows_per_batch, world_size))
        return next(self.iter_batches(epoch, rows_per_batch, rank, world_size, start=b))

    def iter_batches(self, epoch, rows_per_batch, rank=0, world_size=1, start=0):
        """This rank's batches of an epoch from batch `start`, shuffled with seed (seed, epoch):
        rank r of w takes slice r of each global batch; the last wraps around to the first rows."""
        per_step = rows_per_batch * world_size
        steps = self.count_steps(rows_per_batch, world_size)
        rng = np.random.default_rng([self.seed, epoch])
        order = np.resize(rng.permutation(len(self.rows)), steps * per_step)
        for b in range(start, steps):
            yield self.collate(order[b * per_step + rank * rows_per_batch :][:rows_per_batch])

    def collate(self, row_ids):
        """Rows -> {"input_ids", "labels", "position_ids"}: int64 tensors (rows, width)."""
        rows = [self.rows[r] for r in row_ids]
        width = self.context_length
        if not self.pack and not self.pad_to_max:
            width = max(int(self.lens[r[0]]) for r in rows)
        inp = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        sup = np.zeros(inp.shape, dtype=bool)  # (rows, width) supervised tokens
        pos = np.zeros_like(inp)  # (rows, width) positions, from 0 in each document
        ar = np.arange(width)
        for b, docs in enumerate(rows):
            t = 0
            for s, n in zip(self.starts[docs].tolist(), self.lens[docs].tolist(), strict=True):
                inp[b, t : t + n] = self.tokens[s : s + n]
                sup[b, t : t + n] = self.mask[s : s + n]
                pos[b, t : t + n] = ar[:n]
                t += n
            pos[b, t:] = ar[: width - t]  # the padding: a pseudo-document of its own
        labels = np.full_like(inp, -100)  # at t: input t+1 if supervised, not a document start
        labels[:, :-1] = np.where(sup[:, 1:] & (pos[:, 1:] != 0), inp[:, 1:], -100)
        out = {"input_ids": inp, "labels": labels, "position_ids": pos}
        return {k: torch.from_numpy(v) for k, v in out.items()}


def choose_context_length(lengths, max_context=None, multiple=64):
    """95th percentile of lengths, rounded up to `multiple`, at most max_context."""
    c = max(multiple, int(np.ceil(np.percentile(lengths, 95) / multiple)) * multiple)
    return min(c, max_context) if max_context else c


def tokenized(data, tokenizer, *, cache_dir=None, **settings):
    """Files (a path, or paths in turn) or example dicts -> their token stream, tokenized
    once through token_cache.py: memory maps, and "read", the number of examples read."""
    return tokenize_cached(tokenize_chunk, data, tokenizer, cache_dir, **settings)


def build_dataset(
    data,
    tokenizer,
    context_length="auto",
    *,
    kept=None,
    pack=True,
    truncate=True,
    pad_to_max=False,
    seed=0,
    max_context=None,
    **tokenize,
):
    """A token stream (`tokenized`), or files or example dicts to tokenize (`tokenize`: its
    keywords) -> PackedDataset of the examples a bool (n,) mask `kept` picks (default all)."""
    stream = data if isinstance(data, dict) else tokenized(data, tokenizer, **tokenize)
    kept = np.ones(stream["read"], dtype=bool) if kept is None else kept
    docs = np.flatnonzero(kept[stream["example"]])  # the kept examples' documents
    if not len(docs):
        raise ValueError("no examples to tokenize (every one skipped)")
    if context_length == "auto":
        context_length = choose_context_length(np.diff(stream["offsets"])[docs], max_context)
    elif not isinstance(context_length, int) or context_length <= 0:
        raise ValueError(f"context_length must be a positive int or 'auto', got {context_length!r}")
    pad_id = tokenizer.pad_id
    ds = PackedDataset(stream, context_length, pack, truncate, pad_to_max, seed, pad_id, docs)
    ds.kept = kept
    return ds
