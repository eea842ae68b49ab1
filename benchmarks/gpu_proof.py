"""Everything a GPU is lent for, in one command that fits the time it is lent for, saving what it measured as it goes.

    python bench.py gpu-proof --budget=540 --out=DIR       on a CUDA machine: the phases below, within 540 s
    python bench.py gpu-proof --shape=tiny --budget=300 --out=DIR      the rehearsal on CPU (tests/test_bench.py)

The phases (PHASES), each a child process with its share of the budget: tests (pytest --cuda-only), step (bench.py gpu,
eager), rl (bench.py gpu-rl: two rl.py steps, 1B shape), compiled (bench.py gpu, compiled), context (bench.py
gpu-context), ladder (bench.py gpu-ladder). --out receives
<phase>.json, proof.json (statuses, times, the machine), proof.md (every table) and log.txt, rewritten as phases end.
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from benchmarks.common import REPO
from benchmarks.gpu import profile_table, ratio_table, workload_table
from benchmarks.gpu_rl import rl_table
from benchmarks.gpu_systems import COMPILED, EAGER, SYSTEMS
from support.accounting.memory import fmt
from support.formats import atomic

# (phase, share of the budget, the fewest seconds worth starting it with): docs/performance.md, "The GPU proof"
PHASES = [
    ("tests", 0.32, 20),
    ("step", 0.15, 60),
    ("rl", 0.10, 40),
    ("compiled", 0.23, 60),
    ("context", 0.12, 40),
    ("ladder", 0.08, 30),
]
CUDA_TESTS = "-m pytest -v -p no:cacheprovider --cuda-only tests --continue-on-collection-errors"  # the tests phase
GRACE = 0.2  # the share of a phase's limit from its child's deadline to its kill: the step in flight, the results


def phase_command(name, args, deadline):
    """The child process of phase `name`, as an argv."""
    if name == "tests":
        return [sys.executable, *CUDA_TESTS.split()]
    common = [f"--shape={args.shape}", f"--deadline={deadline:.1f}", f"--out={os.path.join(args.out, name)}.json"]
    if name in ("step", "compiled"):
        systems = ",".join(EAGER if name == "step" else COMPILED)
        rounds = [f"--warmup={args.warmup}", f"--rounds={args.rounds}"]
        return [sys.executable, "bench.py", "gpu", *common, f"--systems={systems}", *rounds, "--profile"]
    if name == "rl":  # a 1B model where the others train an 8B one
        common[0] = f"--shape={'1b' if args.shape == '8b' else args.shape}"
    return [sys.executable, "bench.py", f"gpu-{name}", *common]


def run_phase(argv, env, kill_at, log):
    """(exit code, or None when killed; its output lines) of `argv` in a process group of its own, every line to
    stdout and `log` as it comes; the whole group killed at time.time() `kill_at`."""
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, bufsize=1)  # fmt: skip
    lines = []

    def pump():
        for line in proc.stdout:
            print(line, end="", flush=True)
            log.write(line)
            log.flush()
            lines.append(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=max(1.0, kill_at - time.time()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    reader.join(timeout=5)
    return code, lines


TEST_LINE = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")
SUMMARY_LINE = re.compile(r"^=+ (.*\b(passed|failed|skipped|error|errors|deselected)\b.*) =+$")


def tests_result(lines, code):
    """The tests phase's JSON: each test's outcome, pytest's summary line (none when it was cut off)."""
    outcomes = dict(m.groups() for m in map(TEST_LINE.match, lines) if m)
    summary = next((m.group(1) for m in map(SUMMARY_LINE.match, reversed(lines)) if m), None)
    return dict(summary=summary, exit_code=code, outcomes=outcomes, tail=lines[-40:])


def install_wheels(folder, log):
    """The PYTHONPATH entry for the children: a temporary directory the wheels in `folder` are pip-installed into; or
    None, with one line saying why."""
    wheels = sorted(f for f in os.listdir(folder) if f.endswith(".whl")) if os.path.isdir(folder) else []
    if not wheels:
        line = f"no wheels in {folder}/: the peers that need bitsandbytes or liger-kernel are skipped\n"
        print(line, end="")
        log.write(line)
        return None
    site = tempfile.mkdtemp(prefix="gpu-proof-site-")
    argv = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", site]
    done = subprocess.run(argv + [os.path.join(folder, w) for w in wheels], capture_output=True, text=True)
    line = f"wheels from {folder}/: {', '.join(wheels)}: " + ("installed" if done.returncode == 0 else "pip failed")
    print(line, flush=True)
    log.write(line + "\n" + done.stderr[-2000:] * (done.returncode != 0))
    return site if done.returncode == 0 else None


def output_of(*argv):
    """What `argv` prints, or "unknown (why)"."""
    try:
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({type(e).__name__})"
    return done.stdout.strip() or f"unknown ({done.stderr.strip()[:100]})"


def chosen_phases(names):
    """PHASES restricted to the comma-separated `names`, their shares scaled to sum to 1."""
    chosen = [p for p in PHASES if p[0] in names.split(",")]
    unknown = set(names.split(",")) - {p[0] for p in PHASES}
    if unknown or not chosen:
        sys.exit(f"--phases={names}: expected a comma-separated subset of {','.join(p[0] for p in PHASES)}")
    total = sum(share for _, share, _ in chosen)
    return [(name, share / total, least) for name, share, least in chosen]


def phase_limit(name, share, least, budget, end, carried):
    """(seconds phase `name` may take, or None to skip it) and the line that says so."""
    left = end - time.time()
    limit = min(left, share * budget + carried)
    if limit < least:
        return None, f"{name}: skipped, {max(left, 0):.0f} s of the budget left and it needs at least {least} s"
    return limit, f"{name}: up to {limit:.0f} s"


def bench_gpu_proof(args):
    phases = chosen_phases(args.phases)
    start = time.time()
    end = start + args.budget
    os.makedirs(args.out, exist_ok=True)
    proof = dict(command="python bench.py " + " ".join(sys.argv[1:]), budget_s=args.budget, phases=[])
    # the GPU as nvidia-smi names it (no CUDA context is made here) and the commit
    proof["gpu"] = output_of("nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader")
    proof["commit"] = output_of("git", "rev-parse", "--short", "HEAD")
    # growable segments: the systems' steps alternate in one caching allocator, and long rows allocate large blocks
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    with open(os.path.join(args.out, "log.txt"), "a") as log:
        site = install_wheels(args.wheels, log)
        if site:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
        carried = 0.0
        for name, share, least in phases:
            limit, line = phase_limit(name, share, least, args.budget, end, carried)
            print(f"\n== gpu-proof: {line}", flush=True)
            log.write(f"\n== gpu-proof: {line}\n")
            if limit is None:
                proof["phases"].append(dict(name=name, status=line))
                continue
            began = time.time()
            kill_at = began + limit
            code, lines = run_phase(phase_command(name, args, kill_at - GRACE * limit), env, kill_at, log)
            took = time.time() - began
            carried = max(0.0, share * args.budget + carried - took)
            status = "killed at its time limit" if code is None else f"exit code {code}"
            if name == "tests":
                atomic.write_json(os.path.join(args.out, "tests.json"), tests_result(lines, code))
            proof["phases"].append(dict(name=name, status=status, seconds=round(took, 1), limit_s=round(limit, 1)))
            write_proof(args.out, proof)
        proof["seconds"] = round(time.time() - start, 1)
        write_proof(args.out, proof)
    print(f"\ngpu-proof: {proof['seconds']:.0f} s of {args.budget:.0f}; results in {args.out}")


def write_proof(out, proof):
    atomic.write_json(os.path.join(out, "proof.json"), proof)
    paths = {p["name"]: os.path.join(out, f"{p['name']}.json") for p in proof["phases"]}
    phases = {name: atomic.read_json(path) for name, path in paths.items() if os.path.exists(path)}
    atomic.atomic_write(os.path.join(out, "proof.md"), lambda tmp: Path(tmp).write_text(render(proof, phases)))


def md_table(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    return lines + ["| " + " | ".join(str(x).replace("|", "/") for x in row) + " |" for row in rows]


def ratio_text(r):
    return f"{r['median']:.2f}x ({r['low']:.2f}-{r['high']:.2f}, {r['n']} rounds)" if r else "-"


def md_tests(res):
    lines = [f"pytest: {res['summary'] or 'no summary line (cut off)'}; exit code {res['exit_code']}"]
    lines += [f"- {test}: {outcome}" for test, outcome in res["outcomes"].items() if outcome in ("FAILED", "ERROR")]
    return lines + [", ".join(f"{k} {v}" for k, v in sorted(Counter(res["outcomes"].values()).items()))]


def md_step(res):
    """bench.py gpu's results: a table and the ratios per workload, then the profiles."""
    m = res["machine"]
    versions = ", ".join(f"{k} {m.get(k)}" for k in ("torch", "cuda", "transformers", "peft", "bitsandbytes", "triton"))
    lines = [f"{m['device']}; {versions}; shape {res['shape']}, {res['rows']} x {res['row']} tokens per step"]
    lines += [f"attention {res['attention']}, LoRA dropout {res.get('dropout')}, {res['warmup']} warm-up steps", ""]
    for name, work in res["workloads"].items():
        lines += [f"**{name}**", ""] + md_table(*workload_table(work)) + [""]
        lines += md_table(*ratio_table(work)) + [""] if work["ratios"] else []
    for key, p in res.get("profile", {}).items():
        kinds = ", ".join(f"{k} {v:.1%}" for k, v in p["kinds"].items())
        headers, rows = profile_table(p)
        lines += [f"profile of {SYSTEMS[key]}: {p['total_ms']:.1f} ms of kernels; {kinds}", ""]
        lines += md_table(headers, rows[:8]) + [""]
    return lines


def md_context(res):
    lines = [f"{res['device']}, {fmt(res['budget_bytes'])}; documents of {res['doc']:,} tokens in the row", ""]
    rows = []
    for s in res["settings"]:
        if "skipped" in s:
            rows.append((s["setting"], "", "", "", s["skipped"], "", "", ""))
        for a in s.get("attempts", []):
            peak = fmt(a["peak_bytes"]) if "peak_bytes" in a else "-"
            step = f"{a['step_s']:.1f}" if "step_s" in a else ""
            row = (s["setting"], f"{s['predicted']:,}", s["limited_by"], f"{a['tokens']:,}", a["status"], peak)
            rows.append((*row, fmt(a["estimate_bytes"]), step))
    headers = ["setting", "--plan predicts", "length limited by", "tokens tried", "result", "peak", "estimate"]
    return lines + md_table([*headers, "step s"], rows)


def md_ladder(res):
    rows = []
    for i, label in enumerate(res["rungs"]):
        r = res["systems"].get(f"rung{i}", {})
        if "summary" not in r:
            rows.append((label, r.get("status", "-"), "", "", "", ""))
            continue
        s, g = r["summary"], res["gains"].get(f"rung{i}", {})
        peak = fmt(s["peak_bytes"]) if "peak_bytes" in s else "-"
        gain = (ratio_text(g.get("previous")), ratio_text(g.get("baseline"))) if i else ("", "")
        rows.append((label, f"{s['supervised_per_s']:,.0f}", f"{s['mfu']:.1%}", peak, *gain))
    headers = ["rung", "supervised tokens/s", "MFU", "peak memory", "over the rung before", "over the baseline"]
    lines = [f"shape {res['shape']}, {res['rows']} x {res['row']} tokens per step, {res['precision']}", ""]
    return lines + md_table(headers, rows)


def md_rl(res):
    confined = "confined" if res["confined"] else f"unconfined ({res['unconfined_because']})"
    lines = [f"{res['device']}; {res['model']} shape, random weights; rewards {confined}; rl.py {res['status']}"]
    return lines + [f"`{res['command']}`", ""] + md_table(*rl_table(res))


RENDER = {
    "tests": md_tests,
    "step": md_step,
    "rl": md_rl,
    "compiled": md_step,
    "context": md_context,
    "ladder": md_ladder,
}


def render(proof, results):
    """proof.md: the phases' statuses, then each phase's tables from its JSON (results: {phase: its JSON})."""
    lines = [f"# gpu-proof: `{proof['command']}`", "", f"GPU {proof.get('gpu')}; commit {proof.get('commit')}", ""]
    rows = [(p["name"], p["status"], p.get("seconds", ""), p.get("limit_s", "")) for p in proof["phases"]]
    lines += md_table(["phase", "status", "seconds", "limit"], rows) + [""]
    for name, res in results.items():
        lines += [f"## {name}", ""]
        try:
            lines += RENDER[name](res)
        except (KeyError, TypeError, ValueError) as e:  # a phase stopped early may lack a part: say so, go on
            lines += [f"(incomplete results: {type(e).__name__} {e})"]
        lines.append("")
    return "\n".join(lines) + "\n"
