"""Tokenized documents with their loss masks, packed into rows of equal length.

Tokens and masks
----------------
Each example becomes one document of token ids with a mask that is 1 where a token is supervised: by default every
assistant turn with its end-of-turn token and nothing else, so the model learns to answer and to stop, not to write
prompts (train_on_prompt supervises everything). tokenizer.segments cuts the rendered text into prompt pieces and
responses; each piece is tokenized on its own and the ids are concatenated, so a response's tokens are exactly the
ones the model must generate after its prompt's tokens. A cut through what the tokenizer would merge (a prompt ending
in a space, a response starting with spaces after a newline) makes the tokens at that cut differ from the joined
text's.

support/data/preview.py shows documents as the model sees them and warns about the usual data bugs.

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

Tokenizing happens once per dataset, a chunk of examples at a time (tokenize_chunk), streamed from the files to disk
and mapped back by support/data/token_cache.py.
"""

import bisect

import numpy as np
import torch

from support.data.token_cache import cached_packer, tokenize_cached
from support.data.tokenizer import segment


def document(segmented, piece_ids, tokenizer, train_on_prompt=False):
    """One example's document from its pieces: (token ids, mask) lists, mask True where supervised.

    segmented: tokenizer.segments' (pieces [(text, supervised)], prepend BOS?, append EOS after each response?);
    piece_ids: the token ids of each piece's text, tokenized on its own."""
    pieces, add_bos, add_eos = segmented
    ids, mask = [], []
    if add_bos:
        ids.append(tokenizer.bos_id)
        mask.append(train_on_prompt)
    for (_, supervised), piece in zip(pieces, piece_ids, strict=True):
        ids += piece
        mask += [supervised or train_on_prompt] * len(piece)
        if supervised and add_eos:  # the EOS after a response is supervised: the model learns to stop
            ids.append(tokenizer.eos_id)
            mask.append(True)
    return ids, mask


def supervised_targets(mask, starts):
    """Each document's supervised targets (int64 (docs,)): its supervised tokens but the first, nobody's target (no
    predecessor in it). np.add.reduceat sums mask[starts[i]:starts[i + 1]] in one pass."""
    return np.add.reduceat(mask, starts, dtype=np.int64) - mask[starts] if len(starts) else np.zeros(0, np.int64)


def tokenize_chunk(examples, tokenizer, template=None, train_on_prompt=False, first=0, skip_bad_rows=False):
    """A list of examples (numbered from `first`) as arrays: their documents (see `document`) end to end, tokens
    uint32 (n,) and mask uint8 (n,) 1 where a token is supervised; per document its length, its example's index and
    its supervised targets, int64 (docs,); "skipped": the "label: why" of each example the template rejects.
    support/data/token_cache.py runs it a chunk at a time, on every core, straight to disk."""
    if tokenizer.eos_id is None:
        raise ValueError(f"{tokenizer.path}: the tokenizer has no eos token, which ends every response")
    segmented, skipped = segment(examples, tokenizer, template, first, skip_bad_rows)
    encoded = tokenizer.encode_batch([text for *_, seg in segmented for text, _ in seg[0]])  # every piece, one call
    ids, mask, lengths, start = [], [], [], 0  # start: the next document's first piece
    for *_, seg in segmented:  # seg: (pieces [(text, supervised)], add BOS?, add EOS?)
        doc, doc_mask = document(seg, encoded[start : start + len(seg[0])], tokenizer, train_on_prompt)
        start += len(seg[0])
        ids += doc
        mask += doc_mask
        lengths.append(len(doc))
    tokens, mask = np.array(ids, dtype=np.uint32), np.array(mask, dtype=np.uint8)
    lengths, example = np.array(lengths, dtype=np.int64), np.array([i for i, *_ in segmented], dtype=np.int64)
    supervised = supervised_targets(mask, np.cumsum(lengths) - lengths)
    return dict(tokens=tokens, mask=mask, lengths=lengths, example=example, supervised=supervised, skipped=skipped)


def pack_bfd(lengths, capacity):
    """Best-fit-decreasing: lists of document indices whose lengths sum to at most `capacity` each."""
    rows = []  # lists of document indices
    buckets = {}  # free space f -> the rows with f free slots
    free_sizes = []  # the keys of buckets, sorted
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
    """Documents in rows of context_length (packed, or one per row with pack=False); see above."""

    def __init__(self, stream, context_length, pack=True, truncate=True, pad_to_max=False, seed=0, pad_id=0, docs=None):
        """stream: {tokens, mask, offsets}, and where `tokenized` gives them the documents' "supervised" targets and
        the cache "entry" (a memory-mapped mask is not read whole, packed rows are read back); docs: the documents to
        use, in order (default all)."""
        C, tokens, mask, offsets = context_length, stream["tokens"], stream["mask"], stream["offsets"]
        docs = slice(None) if docs is None else docs
        starts = np.asarray(offsets[:-1])  # (docs,) where each document begins
        supervised = stream.get("supervised")
        supervised = supervised_targets(mask, starts) if supervised is None else supervised
        starts, doc_lens, supervised = starts[docs], np.diff(offsets)[docs], np.array(supervised[docs])  # (docs,)
        lens = np.minimum(doc_lens, C)  # a longer document is truncated to C
        for i in np.flatnonzero(doc_lens > C):  # a truncated document keeps its first C tokens' targets
            supervised[i] = int(mask[starts[i] + 1 : starts[i] + C].sum())
        keep = (doc_lens <= C) | (truncate & (supervised > 0))  # truncated, unless nothing supervised is left
        cut = (doc_lens > C) & keep
        drop = ~keep
        self.stats = dict(
            examples=len(doc_lens),
            lengths=doc_lens,
            truncated=int(cut.sum()),
            dropped=int(drop.sum()),
            truncated_tokens=int((doc_lens - lens)[cut].sum()),
            dropped_tokens=int(doc_lens[drop].sum()),
        )
        self.tokens = tokens  # the whole stream (a memory map): rows index into it
        self.mask = mask
        self.starts = starts[keep]
        self.lens = lens[keep]
        self.num_tokens = int(self.lens.sum())
        self.num_supervised = int(supervised[keep].sum())
        self.context_length = C
        self.pack = pack
        self.pad_to_max = pad_to_max
        self.seed = seed
        self.pad_id = pad_id
        packer = cached_packer(stream.get("entry"), pack_bfd)  # packed before (token cache), or pack_bfd
        self.rows = packer(self.lens, C) if pack else [[i] for i in range(len(self.lens))]  # document indices
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
        sup = np.zeros(inp.shape, dtype=bool)  # (rows, width) supervised tokens
        pos = np.zeros_like(inp)  # (rows, width) positions, restarting at every document
        ar = np.arange(width)
        for b, docs in enumerate(rows):
            t = 0
            for d in docs:
                s, n = int(self.starts[d]), int(self.lens[d])
                inp[b, t : t + n], sup[b, t : t + n] = self.tokens[s : s + n], self.mask[s : s + n]
                pos[b, t : t + n] = ar[:n]
                t += n
            pos[b, t:] = ar[: width - t]  # the padding: a pseudo-document of its own
        labels = np.full_like(inp, -100)
        # shifted: the target at t is input t+1 if supervised and not a new document's start
        labels[:, :-1] = np.where(sup[:, 1:] & (pos[:, 1:] != 0), inp[:, 1:], -100)
        return {k: torch.from_numpy(v) for k, v in (("input_ids", inp), ("labels", labels), ("position_ids", pos))}


def auto_context_length(lengths, max_context=None, multiple=64):
    """95th percentile of example lengths, rounded up to `multiple`, capped by the model's maximum."""
    c = max(multiple, int(np.ceil(np.percentile(lengths, 95) / multiple)) * multiple)
    return min(c, max_context) if max_context else c


def tokenized(data, tokenizer, *, cache_dir=None, **settings):
    """Files (a path, or paths read one after the other) or example dicts -> their token stream, tokenized once through
    the cache (support/data/token_cache.py): memory maps, and "read", the number of examples read."""
    return tokenize_cached(tokenize_chunk, data, tokenizer, cache_dir, **settings)


def build_dataset(data, tokenizer, context_length="auto", *, kept=None, pack=True, truncate=True, pad_to_max=False,
                  seed=0, max_context=None, **tokenize):  # fmt: skip
    """A token stream (`tokenized`), or the files or example dicts to tokenize first (with `tokenize`, tokenized's
    keywords) -> PackedDataset of the examples the index mask `kept` takes (bool (n,) over the n examples read; default
    all), which the dataset keeps as `kept`."""
    stream = data if isinstance(data, dict) else tokenized(data, tokenizer, **tokenize)
    kept = np.ones(stream["read"], dtype=bool) if kept is None else kept
    docs = np.flatnonzero(kept[stream["example"]])  # the documents of the kept examples, in order
    if not len(docs):
        raise ValueError("no examples to tokenize (every one skipped)")
    if context_length == "auto":
        context_length = auto_context_length(np.diff(stream["offsets"])[docs], max_context)
    elif not isinstance(context_length, int) or context_length <= 0:
        raise ValueError(f"context_length must be a positive int or 'auto', got {context_length!r}")
    ds = PackedDataset(stream, context_length, pack, truncate, pad_to_max, seed, tokenizer.pad_id, docs)
    ds.kept = kept
    return ds
