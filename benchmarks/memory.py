"""Does train.py's CPU memory estimate hold, and where does it stop holding?

    python bench.py memory             the estimate against the measured peak over the matrix below (minutes to an hour
                                       on 2 cores)
    python bench.py memory --only=default,fp32-1row     some cells of it

Every cell is a fresh process in a fresh copy of this working tree (no checkpoints/, no token cache, no out/: a
fresh clone), and compares the two numbers train.py prints after its second step: "measured peak memory after 2 steps:
M (estimated E)". First the default run exactly as shipped, `python train.py` with no arguments, which converts the
embedded GGUF weights and tokenizes the data in the same process before it trains; then the same command again, the
converted model and the token cache now in place. Both are stopped once the line is printed (the peak they report is
that of steps 1 and 2). Then the matrix, in the same copy: fp32 and bf16, micro-batches of 1 and 4 rows, activation
checkpointing off and on, all with 4 rows of 256 tokens per step (so a 1-row micro-batch is one of 4 per step), 2
steps and a 4-row evaluation after the second; then the full-vocabulary loss (chunked_loss=False) and 1,024-token rows
(2 per step, one per micro-batch). Where this CPU emulates bf16 (its matmuls measured slower than fp32's, as
support/run/precision.py measures them), the bf16 cells are skipped and the reason printed: they would take hours.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.common import OUT_DIR, REPO, cpu_name, print_table
from benchmarks.first_run import cpu_kind
from support.accounting.flops import fmt_flops, matmul_rates
from support.formats import gguf_read
from support.formats.hf_config import read_config
from support.run.precision import faster_precision

MEASURED = re.compile(r"measured peak memory after 2 steps: ([\d.]+) (GiB|MiB) \(estimated ([\d.]+) (GiB|MiB)\)")
STEP = ["--max_steps=2", "--eval_rows=4", "--eval_samples=0"]  # the second step's evaluation inside the peak


def matrix() -> list[tuple[str, str, list[str]]]:
    """(name, precision, train.py arguments) of each cell after the two default runs."""
    cells = []
    for precision in ("fp32", "bf16"):
        for rows in (1, 4):
            for ckpt in (False, True):
                name = f"{precision}-{rows}row{'-ckpt' * ckpt}"
                args = ["--context_length=256", "--batch_tokens=1024", f"--micro_batch_tokens={rows * 256}"]
                cells.append((name, precision, args + [f"--activation_checkpointing={ckpt}"]))
    for precision in ("fp32", "bf16"):
        full = ["--context_length=256", "--batch_tokens=1024", "--micro_batch_tokens=256", "--chunked_loss=False"]
        cells.append((f"{precision}-1row-fullloss", precision, full))
        long_rows = ["--context_length=1024", "--batch_tokens=2048", "--micro_batch_tokens=1024"]
        cells.append((f"{precision}-1024ctx", precision, long_rows))
    return cells


def fresh_clone(dst) -> str:
    """A copy of this working tree at `dst` as a fresh clone has it: no converted model (checkpoints/), no token cache
    (data/), no runs (out/)."""
    skip = shutil.ignore_patterns(".git", "checkpoints", "out", "data", "__pycache__", ".*_cache")
    shutil.copytree(REPO, dst, ignore=skip)
    return dst


def native_bf16() -> str:
    """'' where this CPU's bf16 matmuls (at SmolLM2's MLP shape, as precision "auto" measures them) are faster than
    fp32's, else why bf16 cells are skipped."""
    config = read_config(gguf_read.smollm2_dir())[0]
    rates = matmul_rates((128, config.hidden_size, config.intermediate_size), (torch.bfloat16, torch.float32),
                         torch.device("cpu"))  # fmt: skip
    if faster_precision(rates) == "bf16":
        return ""
    return f"this CPU emulates bf16 ({fmt_flops(rates[torch.bfloat16])} against {fmt_flops(rates[torch.float32])})"


def gib(number, unit) -> float:
    return float(number) / (1 if unit == "GiB" else 1024)


def run_until_measured(clone, args, log_path) -> tuple[float, float, str]:
    """(measured GiB, estimated GiB, the printed estimate line) of `python train.py args` in `clone`, stopped once it
    has printed the measured peak after step 2."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=clone, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None and not MEASURED.search(open(log_path, errors="replace").read()):
            time.sleep(1)
        proc.terminate()
        proc.wait()
    text = open(log_path, errors="replace").read()
    if not (found := MEASURED.search(text)):
        raise SystemExit(f"error: python train.py {' '.join(args)} printed no measured peak; see {log_path}")
    estimate = re.search(r"memory estimate .*", text)[0]
    return gib(*found.groups()[:2]), gib(*found.groups()[2:]), estimate


def bench_memory(only=""):
    """`python bench.py memory`: the table of estimated against measured peaks, one fresh process per cell."""
    skip_bf16 = native_bf16()
    print(f"CPU: {cpu_name()} ({cpu_kind()}), {os.cpu_count()} cores; torch {torch.__version__}")
    print(f"bf16 cells skipped: {skip_bf16}" if skip_bf16 else "bf16 is native here: bf16 cells run")
    cells = [("default", "auto", []), ("default-again", "auto", [])]
    cells += [(n, p, [f"--precision={p}", *args, *STEP]) for n, p, args in matrix()]
    chosen = only.split(",") if only else [n for n, _, _ in cells]
    rows, logs = [], os.path.join(OUT_DIR, "logs")
    os.makedirs(logs, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=OUT_DIR) as tmp:
        clone = fresh_clone(os.path.join(tmp, "clone"))
        for name, precision, args in cells:
            if name not in chosen or (precision == "bf16" and skip_bf16):
                continue
            log = os.path.join(logs, f"memory-{name}.log")
            measured, estimated, estimate = run_until_measured(clone, args, log)
            if precision == "auto":
                precision = re.search(r"precision auto: (\w+)", open(log).read())[1]
            settings = " ".join(a.removeprefix("--") for a in args if a not in STEP) or "python train.py"
            rows.append([name, precision, settings, f"{estimated:.2f}", f"{measured:.2f}",
                         f"{100 * (estimated / measured - 1):+.0f}%"])  # fmt: skip
            print(f"{name}: {estimate}", flush=True)
    print_table(["cell", "precision", "settings", "estimated GiB", "measured GiB", "error"], rows)
