"""support/token_cache.py: a second build of the same data reads the cache back (memory-mapped, the same rows)
without tokenizing again; other settings make a new entry; no temp file is left behind. (A skipped row is said again
on a cache hit: test_pack.py.)"""

import numpy as np
from test_pack import _write

import pack
from pack import build_dataset, tokenize_examples
from support.tokenizer import Tokenizer


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
