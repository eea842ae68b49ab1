"""What does each technique buy on a GPU? The optimization ladder, the GPU twin of bench.py train's CPU ladder.

    python bench.py gpu-ladder                   Llama-3.1-8B LoRA on natural batching, one technique added per rung
    python bench.py gpu-ladder --shape=tiny      the same on a 2-layer toy, on CPU (the tests run it)

The rungs train on the natural-batching documents of bench.py gpu (gpu_workloads.natural_work: log-normal lengths
shaped like instruction data, prompts unsupervised), bf16 weights, LoRA r=16 on every block linear:

    0  baseline: one document per row, padded to the longest of its batch; logits over the whole vocabulary for every
       position; activation checkpointing; eager (as a plain transformers + PEFT script runs)
    1  + packing: documents packed into full rows, attention within each document
    2  + chunked cross-entropy: the head and the loss a chunk of supervised tokens at a time
    3  + checkpointing off (what the memory saved by 1 and 2 pays for)
    4  + compiled blocks (train.compile_blocks)
    5  + NF4 base (QLoRA): what 4-bit weights cost in speed and save in memory

Rungs 0-3 are one model whose switches change between steps, 4 a second model over the same weight tensors, 5 the NF4
model; all run interleaved, step s of every rung, then s + 1, so every gain is the median of per-round ratios. Per rung:
supervised tokens/s, MFU, peak memory (resident + the step's own allocation; on CUDA), gain over the rung before and
over the baseline. Results: --out (JSON), written when the rungs end.
"""

import time

import torch

from benchmarks.common import median_ratio
from benchmarks.gpu_systems import (
    FAILURES,
    LR,
    SHAPES,
    System,
    dense_llama,
    one_line,
    ours_system,
    qlora_llama,
    random_llama,
)
from benchmarks.gpu_workloads import natural_work, run_workload, workload_result
from model import LOSS_CHUNK
from support.accounting.flops import peak_flops
from support.formats import atomic
from support.formats.hf_config import from_hf
from support.run.precision import pick_precision

# (label, packed rows, loss chunk, checkpointing, model: "eager", "compiled" or "nf4")
RUNGS = [
    ("baseline: padded, full-vocabulary logits, checkpointing, eager", False, 0, True, "eager"),
    ("+ packing", True, 0, True, "eager"),
    ("+ chunked cross-entropy", True, LOSS_CHUNK, True, "eager"),
    ("+ checkpointing off", True, LOSS_CHUNK, False, "eager"),
    ("+ compiled blocks", True, LOSS_CHUNK, False, "compiled"),
    ("+ NF4 base (QLoRA)", True, LOSS_CHUNK, False, "nf4"),
]


def rung_system(i, model_system):
    """Rung i as a System over `model_system` (its model, parameters and optimizer): its forward sets the rung's
    switches first, so rungs sharing a model can take turns."""
    _, _, chunk, checkpointing, _ = RUNGS[i]
    model = model_system.model

    def forward(batch):
        model.loss_chunk, model.activation_checkpointing = chunk, checkpointing
        return model_system.forward(batch)

    return System(f"rung{i}", forward, model, model_system.params, model_system.opt, within=model_system.within)


def build_rungs(cfg, device, dtype):
    """The three models (eager, compiled, NF4 compiled) on one set of random weights, and a System per rung; a model
    that cannot be built leaves its rungs with the reason."""
    dense = random_llama(cfg, device, dtype)
    base = dict(dense.state_dict())
    builders = {
        "nf4": lambda: ours_system("nf4", qlora_llama(cfg, base, device, dtype), device, dtype, LR, compile=True),
        "compiled": lambda: ours_system("compiled", dense_llama(cfg, base, device, dtype), device, dtype, LR, True),
        "eager": lambda: ours_system("eager", dense, device, dtype, LR),  # last: it adapts `dense` in place
    }
    models = {}
    for name, build in builders.items():
        try:
            models[name] = build()
        except FAILURES as e:
            models[name] = System(name, status=f"failed: {one_line(e)}")
    return [
        rung_system(i, models[m]) if not models[m].status else System(f"rung{i}", status=models[m].status)
        for i, (*_, m) in enumerate(RUNGS)
    ]


def gains(result, warmup):
    """Each rung's gain in supervised tokens/s over the rung before and over the baseline: medians of per-round
    ratios."""
    runs = result["systems"]

    def ratio(a, b):
        if "summary" not in runs.get(a, {}) or "summary" not in runs.get(b, {}):
            return None
        rate = lambda r: r["supervised"] / r["time"]  # noqa: E731
        pairs = zip(runs[a]["steps"][warmup:], runs[b]["steps"][warmup:], strict=False)
        return median_ratio([(rate(x), rate(y)) for x, y in pairs])

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


def gpu_ladder_arguments(sub):
    g = sub.add_parser("gpu-ladder", help="the GPU optimization ladder: one technique per rung, natural batching")
    g.add_argument("--shape", choices=list(SHAPES), default="8b", help="8b, 3b, 1b or tiny (CPU smoke test)")
    g.add_argument("--rows", type=int, default=1, help="rows per step (default 1)")
    g.add_argument("--warmup", type=int, default=2, help="steps per rung left out (default 2: compilation)")
    g.add_argument("--rounds", type=int, default=3, help="measured steps per rung, interleaved (default 3)")
    g.add_argument("--deadline", type=float, default=0, help="time.time() after which no round starts (0: none)")
    g.add_argument("--out", required=True, help="the JSON file of the results")
