"""How is a dataset tokenized once and read back from disk after?

The token stream is cached under `cache_dir` as three .npy files read back as memory maps (tokens uint32, mask uint8,
document offsets int64) and a small json written last, which marks the entry complete. The key hashes the data
(content for files under 64 MiB, else path + size + mtime), the tokenizer files, the template and the settings. Each
file is written atomically (support/atomic.py), so an interrupted run never leaves a half entry. Tokenizing runs in
the tokenizer libraries' native threads rather than a process pool, whose start-up and pickling cost more than the
Python-side work it would spread.
"""

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

from support.atomic import atomic_write, read_json, write_json
from support.examples import load_examples

CACHE_VERSION = 2  # 2: every assistant turn supervised, pieces tokenized one by one


def _save_npy(path, array):
    def write(tmp):
        with open(tmp, "wb") as f:  # a file object: given a name, np.save would append ".npy" to it
            np.save(f, array)

    atomic_write(path, write)


def tokenize_cached(
    tokenize_examples, data, tokenizer, cache_dir=None, template=None, train_on_prompt=False, fmt="auto",
    skip_bad_rows=False,
):  # fmt: skip
    """tokenize_examples (pack.py's) over a path (read with load_examples) or a list of examples, through the disk
    cache."""

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
