"""What does each technique buy on a GPU? The optimization ladder, the GPU twin of bench.py train's CPU ladder.

`python bench.py gpu-ladder` (--shape=tiny: a 2-layer toy, on CPU; the tests run it). The rungs train on the
natural-batching documents of bench.py gpu (gpu_workloads.natural_work: log-normal lengths shaped like instruction data,
prompts unsupervised), bf16 weights, LoRA r=16 on every block linear:

    0  baseline: one document per row, padded to the longest of its batch; logits over the whole vocabulary for every
       position; activation checkpointing; eager (as a plain transformers + PEFT script runs)
    1  + packing: documents packed into full rows, attention within each document
    2  + chunked cross-entropy: the head and the loss a chunk of supervised tokens at a time
    3  + checkpointing off (what the memory saved by 1 and 2 pays for)
    4  + compiled blocks (model.Options.compile)
    5  + NF4 base (QLoRA): what 4-bit weights cost in speed and save in memory

Each rung is a model of its own, built with the rung's options over the same weight tensors (5 quantized from them);
all run interleaved, step s of every rung, then s + 1, so every gain is the median of per-round ratios. Per rung:
supervised tokens/s, MFU, peak memory (resident + the step's own allocation; on CUDA), gain over the rung before and
over the baseline. Results: --out (JSON), written when the rungs end.
"""

import time

import torch

from benchmarks.gpu_systems import FAILURES, LR, SHAPES, System, one_line, our_llama, ours_system, random_llama
from benchmarks.gpu_workloads import natural_work, pair_ratio, run_workload, workload_result
from model import LOSS_CHUNK, Options
from support.accounting.flops import peak_flops
from support.formats import atomic
from support.formats.hf import from_hf
from support.kernels.choice import pick_precision

# (label, packed rows, loss chunk, checkpointing, compiled, NF4): each rung a model of its own over the same weights
RUNGS = [
    ("baseline: padded, full-vocabulary logits, checkpointing, eager", False, 0, True, False, False),
    ("+ packing", True, 0, True, False, False),
    ("+ chunked cross-entropy", True, LOSS_CHUNK, True, False, False),
    ("+ checkpointing off", True, LOSS_CHUNK, False, False, False),
    ("+ compiled blocks", True, LOSS_CHUNK, False, True, False),
    ("+ NF4 base (QLoRA)", True, LOSS_CHUNK, False, True, True),
]


def build_rungs(cfg, device, dtype):
    """A System per rung, each its own model built with the rung's options over one set of random weights (the NF4
    rung quantized from them); a rung that cannot be built keeps its row with the reason."""
    base = dict(random_llama(cfg, device, dtype).state_dict())
    rungs = []
    for i, (_, _, chunk, checkpointing, compiled, nf4) in enumerate(RUNGS):
        options = Options(checkpointing=checkpointing, loss_chunk=chunk, compile=compiled)
        try:
            rungs.append(ours_system(f"rung{i}", our_llama(cfg, base, device, dtype, options, nf4), device, dtype, LR))
        except FAILURES as e:
            rungs.append(System(f"rung{i}", status=f"failed: {one_line(e)}"))
    return rungs


def gains(result, warmup):
    """Each rung's gain in supervised tokens/s over the rung before and over the baseline: medians of per-round
    ratios."""
    ratio = lambda a, b: pair_ratio(result["systems"], a, b, "supervised", warmup)  # noqa: E731
    return {f"rung{i}": dict(previous=ratio(f"rung{i}", f"rung{i - 1}"), baseline=ratio(f"rung{i}", "rung0"))
            for i in range(1, len(RUNGS))}  # fmt: skip


def bench_gpu_ladder(args):
    """`python bench.py gpu-ladder`: see the file docstring."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _, config, row = SHAPES[args.shape]
    cfg = from_hf(config)
    dtype = pick_precision("auto", device, cfg)
    peak, source = peak_flops(device, dtype)
    ours_ds, peer_ds, peer_batches = natural_work(cfg.vocab_size, row, args.rows)
    systems = build_rungs(cfg, device, dtype)

    def batch_of(key, step):
        packed = RUNGS[int(key.removeprefix("rung"))][1]
        return (
            ours_ds.step_batch(step, args.rows) if packed else peer_ds.collate(peer_batches[step % len(peer_batches)])
        )

    steps = args.warmup + args.rounds
    records, errors = run_workload(systems, batch_of, steps, device, cfg, "ladder", args.deadline or None)
    result = workload_result(systems, records, errors, args.warmup, peak, "supervised", pairs=[])
    result |= dict(rungs=[r[0] for r in RUNGS], gains=gains(result, args.warmup), shape=args.shape, row=row)
    result |= dict(rows=args.rows, peak_flops=peak, peak_source=source, precision=str(dtype).removeprefix("torch."))
    atomic.write_json(args.out, result)
    print(f"ladder: {time.strftime('%H:%M:%S')} written to {args.out}")
