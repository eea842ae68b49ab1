"""How much slower is a CPU run beside other work than its fair share of the cores?

`python bench.py under-load`: two workloads, the default `python train.py` and one step of rl.py (RL_STEP below), each
run idle, beside one busy single-threaded process (`while True: pass`), and beside a second copy of itself started at
the same moment; rounds interleave them (idle, busy, copy, ...). Every run is a fresh child process with its own
out_dir; train.py's token cache is built once before the rounds (`--preview`), as a newcomer's second run finds it.

A run's fair share: if the kernel gave every busy thread the same time, a run of t threads on c cores (t <= c) beside
b other busy threads would take max(1, (t + b) / c) times its idle time: 1.5x beside one busy thread on 2 cores with 2
torch threads, 2x beside a second copy. Each slowdown is a round's loaded time over the same round's idle time, the
median of the rounds printed with its range, then divided by the fair share; beside a copy, each number (the wall
time, each phase) is the larger of the two copies'. Logs: out/bench/logs/under-load-*.log, one per run.
`--before=REV` also runs each workload idle from a checkout of git revision REV (a temporary worktree), in the same
rounds: idle speed before and after a change, interleaved.
"""

import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.common import OUT_DIR, REPO, child_failed, cpu_name, print_table, run_records
from benchmarks.first_run import cpu_kind
from support.run import threads

RL_STEP = ["configs/grpo_stdlib.py", "--max_steps=1", "--eval_task=", "--problems_per_step=1", "--group_size=4",
           "--sample_tokens=64"]  # fmt: skip
WORKLOADS = {"train": "python train.py (the default run)", "rl": "one rl.py step (" + " ".join(RL_STEP) + ")"}
CONDITIONS = {
    "idle": "nothing (idle)",
    "busy": "one busy single-threaded process",
    "copy": "a second copy (the slower)",
}


def workload_argv(workload, out, cache) -> list[str]:
    """The child's argv (after python) for one run of `workload` ("train" or "rl") writing to `out`."""
    if workload == "train":
        return ["train.py", f"--out_dir={out}", f"--cache_dir={cache}"]
    return ["rl.py", *RL_STEP, f"--out_dir={out}"]


def phases(workload, out) -> dict:
    """{phase: seconds} of a finished run, from its metrics.jsonl: train.py's median step after the first, rl.py's
    sampling and update of its one step."""
    steps = [r for r in run_records(out) if "loss" in r]
    if workload == "train":
        return {"step": statistics.median(r["fwd_s"] + r["bwd_s"] + r["opt_s"] for r in steps[1:])}
    return {"sampling": steps[0]["generate_s"], "update": steps[0]["train_s"]}


def run_together(cwd, argvs, log_stem) -> list[float]:
    """Start `python argv` for each of `argvs` at once, in `cwd`; the seconds from the start until each had ended
    (child_failed if one failed; the others are then stopped)."""
    start, procs, walls = time.perf_counter(), [], {}
    try:
        for i, argv in enumerate(argvs):
            with open(f"{log_stem}-{i}.log", "w") as log:
                child = [sys.executable, *argv]
                procs.append(subprocess.Popen(child, cwd=cwd, env=children_env(), stdout=log, stderr=subprocess.STDOUT))
        while len(walls) < len(procs):
            for i, proc in enumerate(procs):
                if i not in walls and proc.poll() is not None:
                    walls[i] = time.perf_counter() - start
                    if proc.returncode:
                        child_failed(argvs[i][0], proc.returncode, f"{log_stem}-{i}.log")
            time.sleep(0.1)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return [walls[i] for i in range(len(procs))]


def measure(workload, condition, checkout, folder, tag) -> dict:
    """{"wall": seconds, phase: seconds, ...} of one run of `workload` from `checkout` (cwd, cache) in `condition`;
    beside a copy, each number the larger of the two copies'. tag: the log's name ends with it."""
    cwd, cache = checkout
    outs = [tempfile.mkdtemp(dir=folder) for _ in range(2 if condition == "copy" else 1)]
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if condition == "busy" else None
    try:
        log_stem = os.path.join(OUT_DIR, "logs", f"under-load-{workload}-{condition}-{tag}")
        walls = run_together(cwd, [workload_argv(workload, out, cache) for out in outs], log_stem)
    finally:
        if busy:
            busy.kill()
            busy.wait()
    results = [{"wall": wall, **phases(workload, out)} for wall, out in zip(walls, outs, strict=True)]
    return {k: max(r[k] for r in results) for k in results[0]}


def prepare(cwd, cache):
    """What a newcomer's second run finds in `cwd`: SmolLM2 converted from its GGUF, train.py's token cache built."""
    argv = ["train.py", "--preview", f"--cache_dir={cache}"]
    subprocess.run([sys.executable, *argv], cwd=cwd, env=children_env(), check=True, stdout=subprocess.DEVNULL)


def fair_share(condition, torch_threads, cores) -> float:
    """The run's time over its idle time if the kernel gave every busy thread the same time: `torch_threads` on
    `cores` cores beside one busy thread, or beside a copy's `torch_threads`."""
    others = {"idle": 0, "busy": 1, "copy": torch_threads}[condition]
    return max(1.0, (torch_threads + others) / cores) / max(1.0, torch_threads / cores)


def slowdown_rows(results, workload, torch_threads, cores) -> list[list]:
    """The table's rows for `workload`: each condition's median seconds and its slowdown over idle, per round then
    the median (range), and that median over the fair share; "before" rows compare idle speed."""
    rows = []
    for condition, rounds in results[workload].items():
        idle = results[workload]["idle"]
        share = fair_share(condition.split()[0], torch_threads, cores)
        row = [CONDITIONS.get(condition, condition), f"{share:.2f}x"]
        for key in rounds[0]:
            ratios = [r[key] / i[key] for r, i in zip(rounds, idle, strict=True)]
            median = statistics.median(r[key] for r in rounds)
            row.append(f"{median:.1f} s, {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}), "
                       f"{statistics.median(ratios) / share:.2f}x fair")  # fmt: skip
        rows.append(row)
    return rows


def children_env() -> dict:
    """This process's environment for the runs, less the OpenMP wait policy bench.py chose for itself (none the user
    set): each checkout's own entry point decides it, as it would for a user."""
    env = dict(os.environ)
    if threads.USER_WAIT_POLICY is None:
        env.pop("OMP_WAIT_POLICY", None)
    return env


def run_rounds(rounds, workloads, checkouts, folder) -> dict:
    """{workload: {condition: [one measurement per round]}}, the runs interleaved within each round."""
    results = {w: {} for w in workloads}
    for r in range(rounds):
        for workload in workloads:
            for name, checkout in checkouts.items():
                for condition in CONDITIONS if name == "now" else ["idle"]:
                    load = os.getloadavg()[0]
                    got = measure(workload, condition, checkout, folder, f"{name}-round{r + 1}")
                    key = condition if name == "now" else f"idle at {name}"
                    results[workload].setdefault(key, []).append(got)
                    said = ", ".join(f"{k} {v:.1f} s" for k, v in got.items())
                    print(f"round {r + 1}: {workload}, {key}: {said} (load before {load:.2f})", flush=True)
    return results


def bench_under_load(rounds=2, workloads=("train", "rl"), before=""):
    """Each workload idle, beside one busy process, beside its copy (and idle at `before`), interleaved in `rounds`:
    the slowdown tables."""
    cores, n_threads = len(os.sched_getaffinity(0)), torch.get_num_threads()
    policy = threads.USER_WAIT_POLICY or "unset (each entry point's choice)"
    print(f"CPU: {cpu_name()} ({cpu_kind()}), {cores} cores, {n_threads} torch threads; torch {torch.__version__}")
    print(f"OMP_WAIT_POLICY in the runs' environment: {policy}")
    os.makedirs(os.path.join(OUT_DIR, "logs"), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=OUT_DIR) as folder:
        checkouts = {"now": (REPO, os.path.join(folder, "cache-now"))}
        if before:
            tree = os.path.join(folder, "before")
            subprocess.run(["git", "worktree", "add", "--detach", tree, before], cwd=REPO, check=True)
            checkouts[before] = (tree, os.path.join(folder, "cache-before"))
        try:
            for cwd, cache in checkouts.values():
                prepare(cwd, cache)
            results = run_rounds(rounds, workloads, checkouts, folder)
        finally:
            if before:  # never in place of an error on the way
                subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=REPO, check=False)
                subprocess.run(["git", "worktree", "prune"], cwd=REPO, check=False)
    for workload in workloads:
        keys = list(next(iter(results[workload].values()))[0])
        print(f"\n{WORKLOADS[workload]}: medians of {rounds} rounds, slowdown over the same round's idle run")
        print_table(["beside the run", "fair share", *keys], slowdown_rows(results, workload, n_threads, cores))
