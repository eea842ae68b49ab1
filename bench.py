"""Benchmarks, printed as tables and never asserted in tests; each file of benchmarks/ explains its own.

python bench.py gpu-proof --out=DIR  a lent GPU's work in --budget: CUDA tests, step, rl, compiled, context, ladder
python bench.py gpu          ours (LoRA, QLoRA) vs transformers + PEFT on a random Llama-3.1-8B (--shape=smollm2: CPU)
python bench.py gpu-context  the longest single row of our QLoRA, three settings, peak beside the estimate
python bench.py gpu-ladder   the GPU optimization ladder: one technique per rung (--shape=smollm2: on CPU)
python bench.py gpu-rl       two rl.py steps on a random Llama-3.2-1B shape: generated tokens/s, peak memory
python bench.py quant        NF4 quantize / dequantize on CPU, ours vs bitsandbytes (--smollm2: load times too)
python bench.py pack         tokenize + pack 75,000 Magicoder-sized examples, the cache hit, the memory it adds
python bench.py first-run    the default `python train.py` as a newcomer runs it: wall time, losses, peak RSS
python bench.py under-load   the default run and an rl.py step beside a busy process and a copy: slowdown vs fair share
python bench.py fsdp         DDP vs FSDP over 2 CPU ranks, interleaved: step time, per-rank peak RSS
python bench.py humaneval    HumanEval with SmolLM2-135M-Instruct: ours vs transformers' generate, pass@1
python bench.py grpo         a GRPO step on CPU: rl.py vs TRL's GRPOTrainer, interleaved (~25 minutes)
"""

import argparse
import os

import support.run.threads  # noqa: F401 (before torch: how idle threads wait, support/run/threads.py)

# isort: split
from benchmarks.common import OUT_DIR
from benchmarks.first_run import bench_first_run
from benchmarks.fsdp import bench_fsdp
from benchmarks.gpu import bench_gpu, bench_gpu_context, bench_gpu_ladder, gpu_problem
from benchmarks.gpu_proof import PHASES, bench_gpu_proof
from benchmarks.gpu_rl import bench_gpu_rl
from benchmarks.gpu_systems import SHAPES, SYSTEMS
from benchmarks.grpo import bench_grpo, trl_peer
from benchmarks.humaneval import bench_humaneval
from benchmarks.pack import bench_pack
from benchmarks.quant import bench_quant
from benchmarks.under_load import WORKLOADS, bench_under_load


def gpu_arguments(sub):
    """The GPU commands: gpu-proof, gpu, gpu-context, gpu-ladder, gpu-rl."""
    g = sub.add_parser("gpu-proof", help="the whole GPU proof (tests, step, rl, compiled, context, ladder) in a budget")
    g.add_argument("--budget", type=float, default=540, help="seconds for all phases together (default 540)")
    g.add_argument("--out", required=True, help="the folder of the results")
    g.add_argument("--shape", default="8b", help="the model shape of bench.py gpu (default 8b; tiny on CPU)")
    g.add_argument("--warmup", type=int, default=2, help="bench.py gpu's warm-up steps (default 2)")
    g.add_argument("--rounds", type=int, default=4, help="bench.py gpu's measured rounds (default 4)")
    g.add_argument("--wheels", default="wheels", help="folder of wheels to install first (default wheels/)")
    g.add_argument("--phases", default=",".join(p[0] for p in PHASES), help="comma-separated subset of the phases")
    g.set_defaults(run=bench_gpu_proof)
    g = sub.add_parser("gpu", help="ours (LoRA, QLoRA) vs transformers + PEFT on a random Llama, in one process")
    shape_arguments(g, rounds=8)
    g.add_argument("--out", default=os.path.join(OUT_DIR, "gpu.json"), help="raw results (default out/bench/gpu.json)")
    g.add_argument("--row", type=int, default=0, help="tokens per row (default: 8192; smollm2 2048, tiny 256)")
    g.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {', '.join(SYSTEMS)}")
    g.add_argument("--memory", action="store_true", help="QLoRA peak memory at 1, 2, 4 rows, checkpointing off/on")
    g.add_argument("--profile", action="store_true", help="the kernels of one step of ours (torch.profiler)")
    g.set_defaults(run=bench_gpu, problem=gpu_problem)
    g = sub.add_parser("gpu-context", help="the longest single row of our QLoRA on this GPU, three settings")
    shape_arguments(g)
    g.add_argument("--out", required=True, help="the JSON file of the results")
    g.set_defaults(run=bench_gpu_context)
    g = sub.add_parser("gpu-ladder", help="the GPU optimization ladder: one technique per rung, natural batching")
    shape_arguments(g, rounds=3)
    g.add_argument("--out", required=True, help="the JSON file of the results")
    g.set_defaults(run=bench_gpu_ladder)
    g = sub.add_parser("gpu-rl", help="two rl.py steps on a random Llama (default shape 1b): tokens/s, peak memory")
    shape_arguments(g)
    g.add_argument("--out", required=True, help="the JSON file of the results (its log beside it)")
    g.set_defaults(run=bench_gpu_rl, shape="1b")


def shape_arguments(parser, rounds=0):
    """--shape and --deadline of a GPU command; with `rounds`: --rows, --warmup and --rounds (default `rounds`)."""
    parser.add_argument("--shape", choices=list(SHAPES), default="8b", help="8b, 3b, 1b; smollm2, tiny (CPU)")
    deadline = "time.time() after which no step starts (0: none; for gpu-context, 10 minutes from now)"
    parser.add_argument("--deadline", type=float, default=0, help=deadline)
    if rounds:
        parser.add_argument("--rows", type=int, default=1, help="rows per step, one micro-batch (default 1)")
        parser.add_argument("--warmup", type=int, default=2, help="steps per system left out (default 2: compilation)")
        parser.add_argument(
            "--rounds", type=int, default=rounds, help=f"measured steps, interleaved (default {rounds})"
        )


def arguments():
    """The parser of every command: its options and their defaults."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = "{gpu-proof,gpu,gpu-context,gpu-ladder,gpu-rl,quant,pack,first-run,under-load,fsdp,humaneval,grpo}"
    sub = parser.add_subparsers(dest="command", required=True, metavar=commands)
    gpu_arguments(sub)
    s = sub.add_parser("fsdp", help="DDP vs FSDP over 2 CPU ranks, interleaved: step time and per-rank peak RSS")
    s.add_argument("--rounds", type=int, default=2, help="rounds of both, interleaved (default 2)")
    s.set_defaults(run=lambda a: bench_fsdp(rounds=a.rounds))
    q = sub.add_parser("quant", help="NF4 quantize / dequantize throughput, ours vs bitsandbytes (CPU)")
    q.add_argument("--size", type=int, default=4096, help="the weight is size x size (default 4096)")
    q.add_argument("--repeat", type=int, default=5, help="timed runs per case; the best is reported (default 5)")
    q.add_argument("--smollm2", action="store_true", help="also time SmolLM2-135M loading (quantize vs pre-quantized)")
    q.set_defaults(run=lambda a: bench_quant(a.size, a.repeat, a.smollm2))
    h = sub.add_parser("humaneval", help="HumanEval: ours vs transformers' generate, pass@1, tokens/s")
    h.add_argument("--limit", type=int, default=0, help="the first N problems (default: all 164)")
    h.add_argument("--start", type=int, default=0, help="skip the first N problems")
    h.add_argument("--max_new_tokens", type=int, default=384)
    h.add_argument("--adapter", default="", help="also score this PEFT adapter on the NF4 base")
    h.add_argument("--speed", action="store_true", help="only generated tokens/s, NF4 per call and dense")
    h.add_argument("--threads", type=int, default=0, help="torch threads (default torch's; 1 on an oversubscribed CPU)")
    h.add_argument("--only", default="", help="comma-separated phases: ours-fp32, transformers, ours-nf4, ours-adapter")
    h.set_defaults(run=bench_humaneval)
    k = sub.add_parser("pack", help="tokenizing and packing Magicoder-sized examples, the cache hit, the training data")
    k.add_argument("--rows", type=int, default=75_000, help="examples in the dataset (default 75,000)")
    k.set_defaults(run=lambda a: bench_pack(a.rows))
    f = sub.add_parser("first-run", help="the default python train.py as a newcomer runs it: wall time, losses, memory")
    f.add_argument("--repeat", type=int, default=1, help="runs, one after the other (default 1)")
    f.set_defaults(run=lambda a: bench_first_run(a.repeat))
    u = sub.add_parser(
        "under-load", help="the default run and an rl.py step idle, beside a busy process, beside a copy"
    )
    u.add_argument("--rounds", type=int, default=2, help="rounds of every run, interleaved (default 2)")
    u.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of train, rl")
    u.add_argument(
        "--before", default="", help="a git revision whose idle runs join the rounds (speed before a change)"
    )
    u.set_defaults(run=lambda a: bench_under_load(a.rounds, a.workloads.split(","), a.before))
    u.set_defaults(problem=under_load_problem)
    r = sub.add_parser("grpo", help="a GRPO step on CPU: rl.py vs TRL's GRPOTrainer, interleaved")
    r.add_argument("--rounds", type=int, default=2, help="rounds of both, interleaved (default 2)")
    r.add_argument("--steps", type=int, default=3, help="steps per run; the first is left out (default 3)")
    r.set_defaults(run=lambda a: bench_grpo(a.rounds, a.steps))
    r.set_defaults(problem=lambda a: (a.steps < 2 or a.rounds < 1) and GRPO_PROBLEM.format(a=a))
    g = sub.add_parser("grpo-peer")  # one TRL GRPOTrainer run, started by `grpo` in a child process
    g.add_argument("--steps", type=int, default=3)
    g.add_argument("--out", required=True, help="JSON file for the per-step records")
    g.set_defaults(run=lambda a: trl_peer(a.steps, a.out))
    return parser


def under_load_problem(args) -> str:
    """What is wrong with under-load's arguments, or ""."""
    if unknown := set(args.workloads.split(",")) - set(WORKLOADS):
        return f"--workloads: {', '.join(sorted(unknown))}: not a workload (train, rl)"
    return "--rounds must be at least 1" if args.rounds < 1 else ""


GRPO_PROBLEM = "--steps ({a.steps}) must be at least 2 (the first is left out); --rounds at least 1"


def main():
    parser = arguments()
    args = parser.parse_args()
    if problem := getattr(args, "problem", lambda a: "")(args):
        parser.error(problem)  # what argparse cannot check: it exits
    args.run(args)


if __name__ == "__main__":
    main()
