"""How is a dataset tokenized once, without holding it in memory, and read back from disk after?

An entry is a directory under `cache_dir`, written whole (support/formats/atomic.py): tokens uint32 (N,), mask uint8
(N,), and per document its offsets int64 (docs + 1,), its example's index and its supervised targets int64 (docs,), as
.npy files read back as memory maps, and meta.json. The key hashes the data (content under 64 MiB, else path + size +
mtime), the tokenizer files, the template and the settings. Both splits share an entry, each taking its documents by
example index (a new val_fraction or max_examples tokenizes nothing again). Rows are read a block at a time and
tokenized a chunk at a time, on Linux by forked workers for data of 32 MiB and more (docs/internals.md). Under torchrun
one rank per machine builds, the others wait (`local_first`).
"""

import collections
import concurrent.futures
import contextlib
import ctypes
import hashlib
import itertools
import json
import multiprocessing
import os
import signal
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch.distributed as dist

from support.data.examples import read_examples
from support.formats.atomic import atomic_write, read_json, write_json

CACHE_VERSION = 3  # 3: one streamed directory per dataset with each document's example and supervised targets
ARRAYS = {"tokens": np.uint32, "mask": np.uint8, "offsets": np.int64, "example": np.int64, "supervised": np.int64}
CHUNK = 4096  # examples tokenized at a time
PROCESSES_FROM = 32 << 20  # bytes of data files from which one process per core tokenizes
MAX_PROCESSES = 8  # each holds up to 2 chunks of Python objects in flight
PR_SET_PDEATHSIG = 1  # prctl's option (linux/prctl.h)


def chunks(items, size):
    """(index of its first item, list of `size` items) for each chunk of an iterable, the last one shorter."""
    it, first = iter(items), 0
    while part := list(itertools.islice(it, size)):
        yield first, part
        first += len(part)


def prefetch(iterator):
    """The items of an iterator, the next one computed in a thread while the caller works on this one."""
    end = object()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ahead = pool.submit(next, iterator, end)
        while (item := ahead.result()) is not end:
            ahead = pool.submit(next, iterator, end)
            yield item


def tokenized_chunks(rows, tokenize_chunk, tokenizer, settings, processes=1):
    """tokenize_chunk(chunk, tokenizer, first=..., **settings) of each chunk of CHUNK rows, in order, each with "read":
    the rows read so far; in `processes` forked workers, or with 1 in a thread one chunk ahead."""
    if processes > 1:
        yield from _in_workers(rows, (tokenize_chunk, tokenizer, settings), processes)
        return

    def encode(first, part):
        return tokenize_chunk(part, tokenizer, first=first, **settings) | {"read": first + len(part)}

    yield from prefetch(itertools.starmap(encode, chunks(rows, CHUNK)))


def _in_workers(rows, work, processes):
    """tokenized_chunks in `processes` forked workers: at most 2 chunks per worker in flight, results in order."""
    # Forked: a worker starts at once with the parent's tokenizer (never pickled). TOKENIZERS_PARALLELISM set (to its
    # default) keeps the tokenizers library from warning in every worker that the parent used its threads.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    pool = concurrent.futures.ProcessPoolExecutor(processes, multiprocessing.get_context("fork"), _worker_start, work)
    pending = collections.deque()  # (rows read once it is done, its future), oldest first
    try:
        try:
            for first, part in chunks(rows, CHUNK):
                pending.append((first + len(part), pool.submit(_tokenize_in_worker, part, first)))
                if len(pending) > 2 * processes:
                    read, done = pending.popleft()
                    yield done.result() | {"read": read}
        except Exception:  # a bad row read ahead: an earlier row's error, still in flight, is the one to report
            for _, done in pending:
                done.result()
            raise
        while pending:
            read, done = pending.popleft()
            yield done.result() | {"read": read}
    finally:
        pool.shutdown(cancel_futures=True)


_worker = {}  # in a tokenizing worker: what _worker_start was given


def _worker_start(tokenize_chunk, tokenizer, settings):
    """A tokenizing worker: one thread; Ctrl-C and SIGTERM are its parent's to handle, and it ends with its parent."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenizer.encode_threads = 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the handler a rank installs (support/run/ranks.py)
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # Linux: SIGTERM when the parent dies, even by SIGKILL
    _worker.update(tokenize_chunk=tokenize_chunk, tokenizer=tokenizer, settings=settings)


def _tokenize_in_worker(part, first):
    return _worker["tokenize_chunk"](part, _worker["tokenizer"], first=first, **_worker["settings"])


class GrowingNpy:
    """A 1-D .npy file written piece by piece: numpy pads its header with room for any length, so the length is
    written into it at the end without moving the data."""

    def __init__(self, path, dtype):
        self.file, self.dtype, self.length = open(path, "wb"), np.dtype(dtype), 0
        self.data_start = self._header()

    def _header(self):
        self.file.seek(0)
        shape = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (self.length,)}
        np.lib.format.write_array_header_1_0(self.file, shape)
        return self.file.tell()

    def append(self, array):
        self.file.write(np.ascontiguousarray(array, self.dtype).data)
        self.length += len(array)

    def close(self):
        if self._header() != self.data_start:
            raise RuntimeError(f"{self.file.name}: the .npy header grew with the length {self.length}")
        self.file.close()


def _write_entry(folder, stream, said):
    """Append every chunk of `stream` (tokenized_chunks) to the arrays in `folder`; returns the entry's meta.
    said: what reading the rows said (filled as they are read); the template's rejections follow."""
    files = {name: GrowingNpy(os.path.join(folder, f"{name}.npy"), dtype) for name, dtype in ARRAYS.items()}
    files["offsets"].append(np.zeros(1))
    # tokens so far, examples the template rejected (the first one's "label: why"), examples read
    tokens, skipped, first, read = 0, 0, None, 0
    try:
        for chunk in stream:
            for name in ("tokens", "mask", "example", "supervised"):
                files[name].append(chunk[name])
            files["offsets"].append(tokens + np.cumsum(chunk["lengths"]))
            tokens, read = tokens + len(chunk["tokens"]), chunk["read"]
            skipped, first = skipped + len(chunk["skipped"]), first or next(iter(chunk["skipped"]), None)
    finally:
        for f in files.values():
            f.close()
    said += [f"skipped {skipped} examples the template cannot render (first: {first})"] if skipped else []
    for line in said:
        print(line, file=sys.stderr)
    if files["offsets"].length == 1:
        raise ValueError("no examples to tokenize" + (" (every one skipped)" if skipped else ""))
    return {"read": read, "docs": files["offsets"].length - 1, "said": said}


def _key(data, paths, tokenizer, settings):
    h = hashlib.sha256(json.dumps([CACHE_VERSION, *settings]).encode())
    for path in paths or []:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such data file")
        st = os.stat(path)
        big = f"{Path(path).resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()
        h.update(Path(path).read_bytes() if st.st_size < (64 << 20) else big)
    if paths is None:
        h.update(json.dumps(data, sort_keys=True).encode())
    for f in tokenizer.files:
        h.update(f.name.encode() + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:24]


def tokenize_cached(
    tokenize_chunk, data, tokenizer, cache_dir=None, template=None, train_on_prompt=False, fmt="auto",
    skip_bad_rows=False, processes=None,
):  # fmt: skip
    """tokenize_chunk (pack.py's) over files (a path or paths) or a list of examples, through the disk cache:
    {tokens, mask, offsets, example, supervised: memory maps, read: examples read, entry: the entry's directory}.
    Without cache_dir the entry goes to a temporary directory, removed once mapped. processes: how many tokenize
    (default: one per core up to MAX_PROCESSES for files of PROCESSES_FROM bytes and more on Linux; else 1)."""
    paths = [data] if isinstance(data, str | os.PathLike) else data if data and not isinstance(data[0], dict) else None
    said = []  # what reading the rows says (bad rows skipped), kept for cache hits

    def build(entry):
        def write(folder):
            rows = read_examples(paths, fmt, skip_bad_rows, said) if paths is not None else data
            big = paths is not None and sum(os.path.getsize(p) for p in paths if os.path.isfile(p)) >= PROCESSES_FROM
            cores = min(len(os.sched_getaffinity(0)), MAX_PROCESSES) if sys.platform == "linux" else 1
            settings = dict(template=template, train_on_prompt=train_on_prompt, skip_bad_rows=skip_bad_rows)
            stream = tokenized_chunks(rows, tokenize_chunk, tokenizer, settings, processes or (cores if big else 1))
            with contextlib.closing(stream):  # an error while writing ends the workers at once
                meta = _write_entry(folder, stream, said)
            write_json(os.path.join(folder, "meta.json"), meta)

        atomic_write(entry, write, directory=True)

    if not cache_dir:
        with tempfile.TemporaryDirectory() as tmp:
            build(entry := os.path.join(tmp, "entry"))
            return _open(entry, again=None)
    entry = os.path.join(cache_dir, _key(data, paths, tokenizer, [template, train_on_prompt, fmt, skip_bad_rows]))
    os.makedirs(cache_dir, exist_ok=True)
    hit = local_first(lambda: os.path.isdir(entry) or build(entry))  # True: built before, not by this call
    return _open(entry, again=bool(hit))


def local_first(work):
    """work() on each machine's first rank (LOCAL_RANK 0) while its other ranks wait at a barrier, then on those,
    which find on disk what the first one wrote. A first rank that fails ends the others with its line
    (support/run/ranks.py)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return work()
    first = int(os.environ.get("LOCAL_RANK", 0)) == 0
    done = work() if first else None
    dist.barrier()
    return done if first else work()


def cached_packer(entry, packer):
    """packer(lengths, capacity) -> rows (pack.pack_bfd), its rows for the same lengths and capacity read back from a
    file in the entry (a tokenize_cached result's "entry"; None: packer itself) instead of packed again."""
    if entry is None:
        return packer

    def packed(lengths, capacity):
        lengths = np.ascontiguousarray(lengths, dtype=np.int64)
        key = hashlib.sha256(lengths.data).hexdigest()[:16]
        path = os.path.join(entry, f"rows-{capacity}-{key}.npy")  # int64: rows + 1 offsets, then the documents
        if not os.path.exists(path):
            rows = packer(lengths, capacity)
            sizes = np.array([len(r) for r in rows], dtype=np.int64)
            docs = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(sizes.sum()))
            table = np.concatenate([[len(rows), 0], np.cumsum(sizes), docs])
            atomic_write(path, lambda tmp: np.save(tmp, table))  # tmp ends in .npy: np.save adds no suffix
        table = np.load(path)
        offsets, docs = table[1 : table[0] + 2].tolist(), table[table[0] + 2 :].tolist()
        return [docs[a:b] for a, b in itertools.pairwise(offsets)]

    return packed


def _open(entry, again):
    """The entry's arrays as memory maps, its count of examples read and its path ("entry", None for a temporary one);
    again: a cache hit, whose notes about the rows are said again (the rows themselves are not read)."""
    meta = read_json(os.path.join(entry, "meta.json"))
    for line in meta["said"] if again else []:
        print(f"{line} (as cached)", file=sys.stderr)
    arrays = {name: np.load(os.path.join(entry, f"{name}.npy"), mmap_mode="r") for name in ARRAYS}
    return arrays | {"read": meta["read"], "entry": entry if again is not None else None}
