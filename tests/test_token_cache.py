"""support/data/token_cache.py: a second build of the same data reads the cache back (memory-mapped, the same rows)
without reading or tokenizing the examples again; other settings make a new entry; no temp file is left behind, not
even by a bad row that stops the build. The files streamed through it give a run exactly the data the in-memory path
gave before streaming: tests/data/stream_reference.json was computed by train.build_data at commit 26ff909, before
this file streamed (rows, their order, the tokens, labels and positions of every row, the packing report with its
efficiency, the held-out prompts). Under torchrun one rank per machine tokenizes and both map the same files; a
failing first rank ends the waiting one with its line. (A skipped row is said again on a cache hit: test_pack.py.)"""

import hashlib
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import DATA, ROOT, free_port, threads_env
from test_pack import _write

import pack
import train
from pack import build_dataset, tokenize_chunk
from support.data import token_cache
from support.data.preview import packing_report
from support.data.tokenizer import Tokenizer
from support.run import ranks

CASES = {  # name: train.Config settings, as stream_reference.json was computed
    "fraction": dict(val_fraction=0.2, context_length="auto", skip_bad_rows=True, eval_samples=2),
    "capped": dict(val_fraction=0.1, max_examples=25, context_length=96, train_on_prompt=True, skip_bad_rows=True,
                   eval_samples=1),
}  # fmt: skip


def test_cache_reuse(tmp_path, bpe_dir, monkeypatch):
    tok = Tokenizer(bpe_dir)
    data = _write(tmp_path / "d.jsonl", [{"problem": f"p{i} " * i, "solution": f"s{i} " * (i % 7)} for i in range(50)])
    a = build_dataset(data, tok, 64, cache_dir=tmp_path / "cache")
    calls = []
    monkeypatch.setattr(pack, "tokenize_chunk", lambda *args, **kw: calls.append(1) or tokenize_chunk(*args, **kw))
    monkeypatch.setattr(token_cache, "read_examples", _no_reading)
    b = build_dataset(data, tok, 64, cache_dir=tmp_path / "cache")
    assert not calls and isinstance(b.tokens, np.memmap)
    assert all((a.collate(range(len(a)))[k] == b.collate(range(len(b)))[k]).all() for k in ("input_ids", "labels"))
    with pytest.raises(AssertionError, match="read the examples"):  # a new entry would read them
        build_dataset(data, tok, 64, cache_dir=tmp_path / "cache", train_on_prompt=True)
    assert not calls
    assert not list((tmp_path / "cache").glob(".*tmp")) and len(list((tmp_path / "cache").iterdir())) == 1


def _no_reading(*args, **kw):
    raise AssertionError("read the examples")


def test_a_bad_row_stops_the_build_and_leaves_no_entry(tmp_path, bpe_dir):
    """A malformed row far into the file, after chunks were already written: one line with its file and line, no
    entry and no temp folder in the cache (the next run starts over)."""
    rows = [{"problem": f"p{i}", "solution": "s"} for i in range(30)] + [{"problem": "p"}]
    data = _write(tmp_path / "d.jsonl", rows)
    with pytest.raises(ValueError, match=rf"^{tmp_path}/d\.jsonl:31: missing field 'solution'$"):
        token_cache.tokenize_cached(pack.tokenize_chunk, data, Tokenizer(bpe_dir), tmp_path / "cache", fmt="magicoder")
    assert not list((tmp_path / "cache").iterdir())


def test_worker_processes_write_the_arrays_one_process_writes(tmp_path, family_dirs, monkeypatch, capsys):
    """Tokenized by 2 forked worker processes, chunks of 7 rows (40 conversations, every 9th one the Mistral v0.3
    template rejects: a system message): the arrays, the rows read and what is said about the skipped rows equal
    those of the one-process build; without skip_bad_rows the first rejected row stops it with its file and line (not a
    malformed line read ahead of it), and no entry is left."""
    monkeypatch.setattr(token_cache, "CHUNK", 7)
    tok, system = Tokenizer(family_dirs["mistral-v0.3"]), [{"role": "system", "content": "Be brief."}]
    rows = [
        [{"role": "user", "content": f"Add {i} and 1."}, {"role": "assistant", "content": f"{i} + 1"}]
        for i in range(40)
    ]
    rows = [(system if i % 9 == 1 else []) + turns for i, turns in enumerate(rows)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    built = {}
    for count in (1, 2):
        got = token_cache.tokenize_cached(pack.tokenize_chunk, path, tok, tmp_path / f"c{count}", skip_bad_rows=True,
                                          processes=count)  # fmt: skip
        built[count] = {k: np.asarray(v).tolist() for k, v in got.items() if k != "entry"}, capsys.readouterr().err
    assert built[1] == built[2] and built[2][0]["read"] == 40 and len(built[2][0]["example"]) == 35
    assert f"skipped 5 examples the template cannot render (first: {path}:2: chat template" in built[2][1]
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:9] + ["{not json\n"] + lines[9:]))  # read (line 10) while line 2 is tokenized
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:2: chat template: messages\[:2\] rendered"):
        token_cache.tokenize_cached(pack.tokenize_chunk, path, tok, tmp_path / "cache", processes=2)
    assert not list((tmp_path / "cache").iterdir())


def summary(trainset, valset, prompts):
    """What a run gets from its data: each dataset's rows (document indices), the tokens, labels and positions of
    every row (a digest), its counts and packing report; the held-out prompts' sources."""
    out = {"prompts": [ex["source"].rsplit("/", 1)[-1] for ex in prompts]}
    for name, ds in (("train", trainset), ("val", valset)):
        batch = ds.collate(range(len(ds)))
        digest = hashlib.sha256(b"".join(batch[k].numpy().tobytes() for k in sorted(batch))).hexdigest()
        stats = {k: int(v) for k, v in ds.stats.items() if k != "lengths"}
        out[name] = dict(rows=[[int(d) for d in row] for row in ds.rows], digest=digest, stats=stats,
                         lengths=np.asarray(ds.stats["lengths"]).tolist(), num_tokens=ds.num_tokens,
                         num_supervised=ds.num_supervised, report=packing_report(ds))  # fmt: skip
    return out


@pytest.mark.parametrize("case", CASES)
def test_streamed_data_is_the_data_before_streaming(smollm2_dir, tmp_path, case):
    """tests/data/stream_rows.jsonl (80 rows, a bad JSON line, a row missing its field, a blank line), split by
    val_fraction (and max_examples): train.build_data streams it through the cache and gets what the in-memory path
    got at commit 26ff909, built and then from the cache."""
    expected = json.loads((DATA / "stream_reference.json").read_text())[case]
    data = str(DATA / "stream_rows.jsonl")
    cfg = train.Config(data=data, cache_dir=str(tmp_path / "cache"), **CASES[case])
    place = ranks.Placement(0, 1, torch.device("cpu"))
    for _ in range(2):
        got = summary(*train.build_data(cfg, Tokenizer(smollm2_dir), {"data": [data], "val_data": []}, 8192, place))
        assert got == expected


@pytest.mark.parametrize("fault", ["none", "bad-row"])
def test_one_rank_per_machine_tokenizes(bpe_dir, tmp_path, fault):
    """torchrun, 2 gloo ranks: local rank 0 tokenizes while rank 1 waits, then both map the same files (rank 1 never
    calls the tokenizer). A bad row ends rank 0 with its line and rank 1 with the same line, from rank 0."""
    rows = [{"problem": f"p{i} " * i, "solution": f"s{i} " * (i % 7)} for i in range(60)]
    data = _write(tmp_path / "d.jsonl", rows + ([{"problem": "p"}] if fault == "bad-row" else []))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    worker = [
        os.path.join(ROOT, "tests", "cache_worker.py"),
        str(bpe_dir),
        str(data),
        str(tmp_path / "cache"),
        str(tmp_path),
    ]
    proc = subprocess.run([*cmd, *worker], cwd=ROOT, env=threads_env(2), text=True, capture_output=True, timeout=180)
    lines = (proc.stdout + proc.stderr).splitlines()
    if fault == "none":
        said = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
        assert proc.returncode == 0 and [s["rank"] for s in said] == [0, 1], "\n".join(lines[-30:])
        assert [s["encoded"] > 0 for s in said] == [True, False]  # rank 1 found the entry rank 0 wrote
        assert said[0]["files"] == said[1]["files"] and said[0]["rows"] == said[1]["rows"]
        return
    errors = [line[line.index("error: ") :] for line in lines if "error: " in line]
    line = f"{data}:61: missing field 'solution'"
    assert proc.returncode != 0 and sorted(errors) == [f"error: {line}", f"error: {line} (from rank 0; rank 1 stopped "
                                                      "with it)"], "\n".join(lines[-30:])  # fmt: skip
