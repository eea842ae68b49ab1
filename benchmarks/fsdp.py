"""What does sharding cost against replicating? DDP and FSDP over 2 CPU ranks, interleaved.

`python bench.py fsdp`: SmolLM2-135M QLoRA, each configuration a fresh `torchrun --nproc_per_node=2 train.py ...` with
SETTINGS, DDP and FSDP alternating in rounds; the ratio is the median of the per-round ratios, and peak RSS is each
rank's own. The two ranks share one machine's cores, so the times measure FSDP's extra work, not a network's.
"""

import os
import statistics
import tempfile

from benchmarks.common import OUT_DIR, cpu_name, fmt_gb, median_ratio, print_table, run_records, run_two_ranks

BATCH_TOKENS = 1024  # 2 ranks x 2 micro-batches of 1 row of 256 tokens (FSDP reduce-scatters once a step)
SETTINGS = [
    "--precision=fp32",
    "--context_length=256",
    f"--batch_tokens={BATCH_TOKENS}",
    "--micro_batch_tokens=256",
    "--eval_every=0",
    "--eval_samples=0",
]


def run_ranks(parallel, steps, out):
    """([seconds of each step], [peak RSS of each rank]) of one 2-rank torchrun of train.py."""
    argv = ["train.py", *SETTINGS, f"--parallel={parallel}", f"--max_steps={steps}", f"--out_dir={out}", "--overwrite"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    peaks = run_two_ranks(argv, out + ".log", f"torchrun with --parallel={parallel}", env)
    records = run_records(out)
    times = [BATCH_TOKENS / r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    return times, sorted(peaks.values())[-2:]  # the two workers: the largest resident sets under torchrun


def bench_fsdp(steps=6, warmup=2, rounds=2):
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; 2 gloo ranks, SmolLM2-135M QLoRA, {' '.join(SETTINGS)}")
    results = {"ddp": [], "fsdp": []}
    os.makedirs(OUT_DIR, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=OUT_DIR) as tmp:
        for r in range(rounds):
            for parallel in results:
                times, ranks = run_ranks(parallel, steps, os.path.join(tmp, f"{parallel}-{r}"))
                results[parallel].append((statistics.median(times[warmup:]), ranks))
                print(f"round {r + 1}: {parallel} {results[parallel][-1][0]:.2f} s a step", flush=True)
    ratio = median_ratio([(f, d) for (f, _), (d, _) in zip(results["fsdp"], results["ddp"], strict=True)])
    rows = []
    for parallel, runs in results.items():
        step = statistics.median(t for t, _ in runs)
        peak = [max(ranks[i] for _, ranks in runs) for i in range(2)]
        rows.append([parallel, f"{step:.2f}", " / ".join(fmt_gb(p) for p in peak)])
    print_table(["parallel", "step s (median)", "peak RSS of each rank"], rows)
    print(f"FSDP / DDP step time: {ratio['median']:.2f}x (rounds from {ratio['low']:.2f} to {ratio['high']:.2f})")
