"""How long do tokenizing and packing a Magicoder-sized dataset take, how much memory, and reading it back after?

`python bench.py pack` (--rows=1000000: an OpenHermes-2.5-sized dataset). The JSONL is written once to out/bench. Each
measurement is a fresh process (its own VmHWM): the first build (with its tokenizing workers), the cache hit, and the
resident memory train.build_data's data adds to one process and to each of 2 torchrun ranks.
"""

import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

import pack
import train
from benchmarks.common import OUT_DIR, fmt_gb, print_table, run_child_ok, run_two_ranks
from support.data.examples import stdlib_examples
from support.data.preview import packing_report
from support.data.tokenizer import Tokenizer
from support.formats import atomic, gguf_read
from support.run import ranks

CONTEXT = 2048


def write_dataset(rows):
    """out/bench/magicoder<rows/1000>k.jsonl, written once, a row at a time."""
    path = os.path.join(OUT_DIR, f"magicoder{rows // 1000}k.jsonl")
    if os.path.exists(path):
        return path
    examples = stdlib_examples("train")
    os.makedirs(OUT_DIR, exist_ok=True)

    def write(tmp):
        with open(tmp, "w") as f:
            for i in range(rows):  # Magicoder's problems and solutions run to a few hundred tokens each
                a, b = examples[i % len(examples)], examples[(7 * i + 1) % len(examples)]
                f.write(json.dumps({"problem": f"{i}: " + a["instruction"], "solution": a["response"] + b["response"]}))
                f.write("\n")

    atomic.atomic_write(path, write)
    return path


def bench_pack(rows=75_000):
    path = write_dataset(rows)
    with tempfile.TemporaryDirectory(dir=OUT_DIR) as cache:
        table, report = [], ""
        for label in ("first build", "cache hit"):
            out = os.path.join(cache, "out.json")
            argv = ["-m", "benchmarks.pack", "build", path, cache, out]
            peak, _ = run_child_ok(argv, os.path.join(cache, "log"), f"the {label}", with_workers=True)
            got = json.loads(Path(out).read_text())
            table.append([label, f"{got['seconds']:.1f} s", fmt_gb(peak), f"{got['rows']:,}", got["efficiency"]])
            report = got["report"]
        size = sum(f.stat().st_size for f in Path(cache).glob("*/*.npy"))
        data = _training_data(path, cache)
        print(f"{rows:,} rows ({os.path.getsize(path) / 2**30:.2f} GiB of JSONL); cache {fmt_gb(size)}\n{report}\n")
        print_table(["build", "time", "peak RSS (with its workers)", "rows", "packed efficiency"], table)
        print()
        print_table(["process", "RSS added by the data", "of the cache's size", "of it private"],
                    [[who, fmt_gb(g["added"]), f"{g['added'] / size:.1%}", fmt_gb(g["stepped_private"])]
                     for who, g in data])  # fmt: skip


def _training_data(path, cache):
    """[(who, {added, private, ...} resident bytes)] of train.build_data: one process, then each of 2 torchrun ranks."""
    out = os.path.join(cache, "train.json")
    run_child_ok(["-m", "benchmarks.pack", "train", path, cache, out], os.path.join(cache, "log"), "the training data")
    found = [("one process", json.loads(Path(out).read_text()))]
    argv = ["-m", "benchmarks.pack", "train", path, cache, os.path.join(cache, "rank{}.json")]
    run_two_ranks(argv, os.path.join(cache, "log"), "the 2 ranks")
    return found + [(f"rank {r} of 2", json.loads(Path(cache, f"rank{r}.json").read_text())) for r in (0, 1)]


def _child(mode, path, cache, out):
    """`build`: pack.build_dataset over `path`, timed; `train`: what train.build_data does, then 50 steps of rows,
    with the resident memory before and after. One JSON object to `out` ({} in it: this rank under torchrun)."""
    tok = Tokenizer(gguf_read.smollm2_dir())
    if mode == "build":
        t = time.perf_counter()
        ds = pack.build_dataset(path, tok, CONTEXT, cache_dir=cache)
        seconds, report = time.perf_counter() - t, packing_report(ds)
        got = dict(seconds=seconds, rows=len(ds), report=report, efficiency=report.rsplit("packed ", 1)[1][:5])
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        if world > 1:
            ranks.init_process_group("gloo", rank, world, timeout_minutes=30)
        before = _resident()
        cfg = train.Config(data=path, cache_dir=cache, context_length=CONTEXT)
        place = ranks.Placement(rank, world, torch.device("cpu"))
        trainset, _, _ = train.build_data(cfg, tok, {"data": [path], "val_data": []}, 8192, place)
        built = _resident()
        for step in range(50):
            trainset.step_batch(step, 8, rank, world)
        stepped = _resident()
        got = dict(added=stepped["all"] - before["all"], private=built["anon"] - before["anon"],
                   built=built["all"] - before["all"], stepped_private=stepped["anon"] - before["anon"])  # fmt: skip
    Path(out.format(os.environ.get("RANK", 0))).write_text(json.dumps(got))
    with open(os.path.join(OUT_DIR, "pack_results.jsonl"), "a") as f:  # every measurement, kept for the docs
        f.write(json.dumps(dict(mode=mode, path=path, rank=os.environ.get("RANK", 0), **got)) + "\n")


def _resident():
    """{"all": resident bytes, "anon": its private (anonymous) part}: the rest is file pages, such as the token cache's
    memory maps, which the kernel keeps once for every process that maps them."""
    gc.collect()
    with open("/proc/self/status") as f:
        kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f if line.startswith("Rss"))}
    return {"all": (kib["RssAnon"] + kib["RssFile"] + kib["RssShmem"]) * 1024, "anon": kib["RssAnon"] * 1024}


if __name__ == "__main__":
    _child(*sys.argv[1:])
