"""What does a newcomer's first `python train.py` take on this machine?

`python bench.py first-run`: each run is a fresh child process with a fresh token cache and out_dir, after the one-time
conversion of the embedded GGUF weights that comes before a newcomer's first run.
"""

import os
import re
import tempfile

import torch

from benchmarks.common import OUT_DIR, cpu_name, fmt_gb, print_table, run_child_ok, run_records, timed
from support.formats import gguf_read
from support.kernels import choice


def cpu_kind() -> str:
    """What this CPU has for bf16 matmuls, from its flags: AMX, AVX512-BF16, or neither (bf16 emulated on AVX2)."""
    flags = (choice.cpuinfo_value(("flags",)) or "").split()
    kinds = (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"), ("avx2", "AVX2 only, no native bf16"))
    return next((name for flag, name in kinds if flag in flags), "no AVX2")


def bench_first_run(repeat=1):
    """`repeat` runs: wall time, steps, validation loss before and after, peak RSS, the precision "auto" chose."""
    print(f"CPU: {cpu_name()} ({cpu_kind()}), {os.cpu_count()} cores; torch {torch.__version__}")
    os.makedirs(os.path.join(OUT_DIR, "logs"), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=OUT_DIR) as tmp:
        seconds = timed(gguf_read.convert_gguf, gguf_read.smollm2_gguf_path(), os.path.join(tmp, "smollm2"))["seconds"]
        print(f"converting SmolLM2 from GGUF (once, before the first run): {seconds:.1f} s")
        rows = []
        for r in range(repeat):
            out, log = os.path.join(tmp, f"run{r}"), os.path.join(OUT_DIR, "logs", f"first-run-{r}.log")
            rss, wall = run_child_ok(
                ["train.py", f"--out_dir={out}", f"--cache_dir={out}/cache"], log, "python train.py"
            )
            text = open(log).read()
            history = run_records(out)
            vals = [h["val_loss"] for h in history if "val_loss" in h]
            steps = max(h["step"] for h in history)
            precision = re.search(r"precision auto: (\w+)", text)
            similarity = re.findall(r"training \((?:step \d+, )?similarity ([\d.]+)\)", text)
            rows.append([f"{wall:.0f} s", steps, f"{vals[0]:.3f} -> {vals[-1]:.3f}", " -> ".join(similarity),
                         fmt_gb(rss), precision[1] if precision else "?"])  # fmt: skip
    print_table(["wall time", "steps", "val loss", "sample similarity", "peak RSS", "precision"], rows)
