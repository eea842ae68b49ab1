"""What do the GPU commands measure: ours against transformers + PEFT, the longest row, what each technique buys?

`bench.py gpu` trains the systems of gpu_systems.py on one set of random weights, interleaved (--memory: our QLoRA
beside train.py's estimate; --profile: the kernels of one step; raw records in out/bench/gpu.json); `bench.py
gpu-context` finds the longest single row per setting (SETTINGS); `bench.py gpu-ladder` adds one technique per rung
(RUNGS). --shape=smollm2 or tiny runs each on CPU.
"""

import os
import platform
import re
import sys
import time

import numpy as np
import psutil
import torch

from benchmarks.common import REPO, cpu_name, package_versions, print_table
from benchmarks.gpu_systems import (
    FAILURES,
    LORA,
    SHAPES,
    SYSTEMS,
    System,
    build_systems,
    equal_work,
    free_cache,
    measured_step,
    natural_batch,
    natural_work,
    one_line,
    our_llama,
    ours_system,
    pair_ratio,
    qlora_estimate,
    random_weights,
    run_workload,
    timed_step,
    weights_of,
    workload_result,
)
from model import LOSS_CHUNK, Llama, Options
from support.accounting import memory, plan
from support.accounting.flops import flops_per_token, fmt_flops, peak_flops
from support.formats import atomic
from support.formats.hf import from_hf, to_hf
from support.kernels import dropout_cuda
from support.kernels.attention import varlen_attention
from support.kernels.choice import pick_precision
from support.kernels.nf4_ops import cuda_dequantize
from support.run import ranks

# Kinds of kernel (on CPU: of operator) by name, for the profile's summary line; the first pattern that matches wins.
KERNEL_KINDS = [
    ("attention", r"flash|fmha|attention|attn|sdpa"),  # first: FlashAttention's names hold "cutlass", cuDNN's "sdpa"
    ("matmul", r"gemm|cutlass|nvjet|xmma|wgmma|^aten::(mm|addmm|bmm)$"),
    ("NF4 dequantize", r"dequant"),  # bitsandbytes' kDequantizeBlockwise, nf4_ops.py's nf4_dequantize_kernel
    ("LoRA dropout", r"keyed_dropout"),  # support/kernels/dropout_cuda.py's keyed_dropout_kernel
]


NATURAL_TITLE = "natural batching: ours and the packed peer packed, the other peers padded to a batch's longest"


def kernel_kind(name):
    return next((k for k, pattern in KERNEL_KINDS if re.search(pattern, name, re.IGNORECASE)), "other")


def profile_step(system, batch, device, cfg, top=15):
    """torch.profiler over one step: the `top` kernels by device time (on CPU: operators by own CPU time), and the
    share of each kind of KERNEL_KINDS."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *[ProfilerActivity.CUDA] * cuda]) as prof:
        timed_step(system, batch, device, cfg)
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [(e, getattr(e, attr)) for e in prof.key_averages() if not cuda or e.device_type == DeviceType.CUDA]
    total = sum(t for _, t in events) or 1
    kinds = dict.fromkeys([k for k, _ in KERNEL_KINDS] + ["other"], 0.0)
    for e, t in events:
        kinds[kernel_kind(e.key)] += t / total
    ranked = sorted(events, key=lambda et: -et[1])[:top]
    kernels = [dict(name=e.key, calls=e.count, ms=t / 1e3, share=t / total) for e, t in ranked]
    return dict(measure=attr, total_ms=total / 1e3, kinds=kinds, kernels=kernels)


def profile_table(p):
    """(headers, rows) of a profile: the kernels (operators) by time, the most first."""
    rows = [(k["name"][:100], k["calls"], f"{k['ms']:.2f}", f"{k['share']:.1%}") for k in p["kernels"]]
    return ["name", "calls", "ms", "share"], rows


def print_profile(label, p):
    what = "kernels by device time" if p["measure"] == "self_device_time_total" else "operators by own CPU time"
    print(f"\nprofile of one equal-work step, {label}: {what}, {p['total_ms']:.1f} ms in all")
    print_table(*profile_table(p))
    print("by kind: " + ", ".join(f"{k} {v:.1%}" for k, v in p["kinds"].items()))


def qlora_system(cfg, weights, device, dtype, options):
    """Our QLoRA system over the NF4 `weights`, its model built with `options`."""
    return ours_system("ours-qlora", our_llama(cfg, weights, device, dtype, options, nf4=True), device, dtype)


def memory_rows(weights, cfg, cells, device, dtype):
    """One step of our QLoRA over `weights` on an equal-work batch per cell (rows, tokens per row, checkpointing):
    measured_step's peak beside train.py's estimate."""
    out, place, systems = [], ranks.Placement(0, 1, device, dtype), {}
    for rows, row, ckpt in cells:
        if ckpt not in systems:  # a model built with checkpointing, or without, over the same NF4 weights
            systems[ckpt] = qlora_system(cfg, weights, device, dtype, Options(checkpointing=ckpt))
        rec = dict(rows=rows, row=row, checkpointing=ckpt, estimate_bytes=qlora_estimate(cfg, rows * row, place, ckpt))
        rec |= measured_step(systems[ckpt], equal_work(cfg.vocab_size, row, rows, 1)[0], device, cfg)
        out.append(rec)
        print(f"memory: {rows} x {row}, checkpointing {'on' if ckpt else 'off'}: {rec['status']}")
    return out


def print_memory(label, rows):
    print(f"\npeak memory of {label}, one step per micro-batch (the other systems freed)")
    table = []
    for r in rows:
        peak = memory.fmt(r["peak_bytes"]) if "peak_bytes" in r else r["status"]
        speed = (f"{r['step_s']:.2f}", f"{r['tokens_per_s']:,.0f}") if "step_s" in r else ("", "")
        on = "on" if r["checkpointing"] else "off"
        table.append((f"{r['rows']} x {r['row']:,}", on, peak, memory.fmt(r["estimate_bytes"]), *speed))
    print_table(["micro-batch", "checkpointing", "measured peak", "memory.run_estimate", "step s", "tokens/s"], table)


def workload_table(result):
    """(headers, rows) of a workload_result: a row per system, its status where it did not run."""
    rows = []
    for key, r in result["systems"].items():
        label = SYSTEMS[key] + (f" ({r['note']})" if "note" in r else "")
        if "summary" not in r:
            rows.append((label, r["status"], *[""] * 7))
            continue
        m = r["summary"]
        batch = f"{m['rows']:.3g} x {m['width']:.0f}"
        rates = (f"{m['step_s']:.3f}", f"{m['tokens_per_s']:,.0f}", f"{m['supervised_per_s']:,.0f}", f"{m['mfu']:.1%}")
        peak = memory.fmt(m["peak_bytes"]) if "peak_bytes" in m else "-"
        rows.append((label, batch, f"{m['fill']:.1%}", *rates, peak, f"{m['loss_step1']:.4f}"))
    headers = ["system", "rows x width", "fill", "step s", "tokens/s", "supervised/s", "MFU", "peak memory"]
    return [*headers, "step-1 loss"], rows


def ratio_table(result):
    """(headers, rows) of a workload's ratios."""
    rows, metric = [], "tokens/s"
    for pair, r in result["ratios"].items():
        a, b = pair.split("/")
        rows.append((f"{SYSTEMS[a]} / {SYSTEMS[b]}", f"{r['median']:.2f}x", f"{r['low']:.2f}-{r['high']:.2f}", r["n"]))
        metric = "supervised tokens/s" if r["metric"] == "supervised" else "tokens/s"
    return [f"ratio of {metric}", "median of rounds", "range", "rounds"], rows


def print_workload(title, result):
    print(f"\n{title}")
    print_table(*workload_table(result))
    if result["ratios"]:
        print_table(*ratio_table(result))


def gpu_device():
    """The current CUDA device when there is one, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # for both sides, as docs/performance.md's figures were measured
    return torch.device("cuda", torch.cuda.current_device())


def gpu_machine(device):
    """The device and the versions that matter to its speed."""
    info = dict(torch=torch.__version__, cuda=torch.version.cuda or "none", python=platform.python_version())
    info |= package_versions(("transformers", "peft", "bitsandbytes", "flash-attn", "triton"))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)  # what get_device_name and get_device_capability read
        info |= dict(device=props.name, memory=props.total_memory, capability=f"{props.major}.{props.minor}")
    else:
        info |= dict(device=f"{cpu_name()} ({torch.get_num_threads()} threads)", memory=None)
    return info


def print_gpu_header(results, cfg, device):
    m, row, rows = results["machine"], results["row"], results["rows"]
    gpu_memory = f", {memory.fmt(m['memory'])}" if m["memory"] else ""
    versions = ", ".join(f"{k} {m[k]}" for k in ("transformers", "peft", "bitsandbytes", "flash-attn", "triton"))
    print(f"{m['device']}{gpu_memory}; torch {m['torch']}, CUDA {m['cuda']}, {versions}")
    with torch.device("meta"):
        params = sum(p.numel() for p in Llama(cfg).parameters())
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.2f}M"
    shape = f"shape {results['shape']} ({SHAPES[results['shape']][0]}, {size} parameters, random weights)"
    lora = f"LoRA r={LORA['r']} alpha={LORA['alpha']:g} dropout {LORA['dropout']} on every block linear"
    print(f"{shape}, {results['precision']}, {lora}")
    dequant = cuda_dequantize().__name__ if device.type == "cuda" else "dequantize_nf4"
    print(f"ours: attention {results['attention']}, NF4 {dequant}, LoRA dropout {results['dropout']}")
    mfu = f"MFU against {fmt_flops(results['peak_flops'])} {results['precision']} ({results['peak_source']})"
    print(f"{mfu}; model FLOPs per token of a {row}-token document: {flops_per_token(cfg, row) / 1e9:.3g} GFLOP")
    warmup, rounds = results["warmup"], results["rounds"]
    print(f"{rows} x {row} tokens per step; {warmup} warm-up step(s), then {rounds} interleaved rounds")


def describe_natural(ours, peer, batches, rows):
    """Print and return the natural workload's lengths and how much of each side's slots are real."""
    lens = peer.lens
    d = dict(documents=len(lens), p50=float(np.median(lens)), mean=float(lens.mean()))
    d |= dict(p95=float(np.percentile(lens, 95)), max=int(lens.max()), packed_rows=len(ours.rows))
    d["ours_fill"] = ours.num_tokens / (len(ours.rows) * ours.context_length)
    d["peer_docs_per_step"] = len(lens) / len(batches)
    d["peer_fill"] = peer.num_tokens / sum(len(b) * int(lens[b].max()) for b in batches)
    print(
        f"natural batching: {d['documents']:,} documents, lengths p50 {d['p50']:.0f}, mean {d['mean']:.0f}, p95 "
        f"{d['p95']:.0f}, max {d['max']}; ours: {d['packed_rows']} packed rows ({d['ours_fill']:.1%} real tokens), "
        f"{rows} per step; peer: one per row padded to the longest of its batch, {d['peer_docs_per_step']:.1f} per "
        f"step on average ({d['peer_fill']:.1%} real tokens)"
    )
    return d


def bench_gpu(args):
    # Before the first CUDA allocation: growable segments keep one system's freed blocks from fragmenting the next's.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    device, (_, config, default_row) = gpu_device(), SHAPES[args.shape]
    cfg, row, steps = from_hf(config), args.row or default_row, args.warmup + args.rounds
    dtype = pick_precision("auto", device, cfg)  # bf16, or on CPU the faster
    if device.type == "cpu" and args.shape not in ("tiny", "smollm2"):
        print(f"warning: --shape={args.shape} on CPU is slow and large; use --shape=smollm2 or tiny on CPU")
    peak, source = peak_flops(device, dtype)
    results = dict(command="python bench.py " + " ".join(sys.argv[1:]), machine=gpu_machine(device), shape=args.shape)
    results |= dict(config=to_hf(cfg), row=row, rows=args.rows, warmup=args.warmup, rounds=args.rounds)
    results |= dict(peak_flops=peak, peak_source=source, workloads={}, deadline=args.deadline)
    results["dropout"] = dropout_cuda.dropout_op_for(device).__name__
    results["precision"] = str(dtype).removeprefix("torch.")
    attend = varlen_attention(device, dtype, cfg.head_dim)
    whole_rows = " (whole rows: batched SDPA, cuDNN first)" if hasattr(attend, "packed") else ""
    results["attention"] = getattr(attend, "packed", attend).__name__ + whole_rows
    print_gpu_header(results, cfg, device)
    equal = equal_work(cfg.vocab_size, row, args.rows, steps)
    natural_data = natural_work(cfg.vocab_size, row, args.rows)
    results["natural_data"] = describe_natural(*natural_data, args.rows)
    systems = build_systems(cfg, args.systems.split(","), device, dtype)
    packs = lambda key: key.startswith("ours") or key == "peer-packed"
    natural = lambda key, step: natural_batch(natural_data, args.rows, packs(key), step)

    equal_title = f"equal work: identical tensors, {args.rows} x {row} tokens per step, every token supervised"
    work = {  # name: (the batch of system `key` at step s, the metric of its ratios, the table's title)
        "equal": (lambda key, s: equal[s], "tokens", equal_title),
        "natural": (natural, "supervised", NATURAL_TITLE),
    }
    for name, (batch_of, metric, _) in work.items():

        def save(records, errors, name=name, metric=metric):  # after every round: a killed run keeps what it measured
            results["workloads"][name] = workload_result(systems, records, errors, args.warmup, peak, metric)
            atomic.write_json(args.out, results)

        save(*run_workload(systems, batch_of, steps, device, cfg, name, args.deadline or None, save))
    for name, (_, _, title) in work.items():
        print_workload(title, results["workloads"][name])
    finish_gpu(args, results, systems, cfg, row, device, dtype, equal[0])


def finish_gpu(args, results, systems, cfg, row, device, dtype, batch):
    """--profile, then --memory (with our QLoRA model alone), then the JSON file."""
    if args.profile and args.deadline and time.time() > args.deadline:
        print("\n--profile: skipped, the deadline has passed")
    elif args.profile:  # one step of each of our systems that runs
        results["profile"] = {}
        for s in (s for s in systems if s.key.startswith("ours") and not s.status):
            results["profile"][s.key] = profile_step(s, batch, device, cfg)
            print_profile(s.label, results["profile"][s.key])
        atomic.write_json(args.out, results)
    if args.memory:
        qlora = [s for s in systems if s.key == "ours-qlora" and not s.status]
        systems.clear()  # the other systems' models go (the caller holds no other reference), so QLoRA runs alone
        free_cache(device)
        if not qlora:
            print("\n--memory: our QLoRA system did not run")
        else:
            cells = [(rows, row, ckpt) for ckpt in (False, True) for rows in (1, 2, 4)]
            label, weights = qlora[0].label, weights_of(qlora.pop().model)  # the system goes, its weights stay
            results["memory"] = memory_rows(weights, cfg, cells, device, dtype)
            print_memory(label, results["memory"])
    atomic.write_json(args.out, results)
    inside = os.path.abspath(args.out).startswith(REPO + os.sep)
    print(f"\nraw results: {os.path.relpath(args.out, REPO) if inside else args.out}")


def gpu_problem(args):
    """What is wrong with `bench.py gpu`'s arguments that argparse cannot check, or ""."""
    if args.warmup < 1 or args.rounds < 1:
        return "--warmup and --rounds must be at least 1 (the first step allocates the optimizer state)"
    if unknown := set(args.systems.split(",")) - set(SYSTEMS):
        return f"--systems: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SYSTEMS)}"
    if args.rows < 1 or args.row < 0:
        return "--rows must be at least 1 and --row positive"
    return ""


# bench.py gpu-context: the longest single row

# (label, MLP tiles of hidden_size tokens, offloaded checkpoints); checkpointing is on in each
SETTINGS = [("checkpointing", False, False), ("+ tiled MLP", True, False), ("+ offloaded checkpoints", True, True)]
RETRY = 0.85  # a length that ran out of memory is tried again this much shorter
CPU_BUDGET = 2 * memory.GIB  # on CPU: the memory the estimate must fit


def one_row(length, doc, vocab):
    """One row of `length` tokens: documents of `doc` random tokens back to back, every token supervised."""
    ids = torch.randint(1, vocab, (1, length), generator=torch.Generator().manual_seed(0))
    return dict(input_ids=ids, labels=ids.clone(), position_ids=(torch.arange(length) % doc)[None])


def qlora_weights(cfg, device, dtype):
    """Random weights of shape `cfg`, block linears in NF4 (the dense ones freed): each setting's model's weights."""
    weights = weights_of(our_llama(cfg, random_weights(cfg, device, dtype), device, dtype, nf4=True))
    free_cache(device)
    return weights


def predicted(cfg, budget, dtype, tiled, offloaded):
    """(tokens, what limits them): longest_tokens for `budget` bytes; offloaded, within 80% of the CPU memory free."""
    lora = dict(r=LORA["r"], targets="all-linear", dropout=LORA["dropout"])
    tokens = plan.longest_tokens(cfg, budget, dtype, lora, True, True, 8, tiled, offloaded)
    if offloaded:
        host = 0.8 * psutil.virtual_memory().available
        per_token = memory.offloaded_bytes(cfg, 1 << 20, dtype) / (1 << 20)
        if tokens * per_token > host:
            return int(host / per_token) // 256 * 256, "CPU memory"
    return tokens, "the estimate"


def try_length(system, cfg, length, doc, place, offloaded):
    """The record of one step of `system` on one row of `length` tokens."""
    tile = system.model.options.mlp_tile
    rec = dict(tokens=length, estimate_bytes=qlora_estimate(cfg, length, place, True, offloaded, tile))
    return rec | measured_step(system, one_row(length, doc, cfg.vocab_size), place.device, cfg)


def longest_for(weights, cfg, setting, seconds, place, budget, doc, out, save):
    """The attempts of one setting within `seconds`, appended to `out` (save() after each): a step at one document's
    length measures the rate, then a row of min(prediction, what that rate trains in the time left), RETRY shorter
    after each out of memory."""
    label, tiled, offloaded = setting
    end = time.time() + seconds
    options = Options(checkpointing=True, offload_checkpoints=offloaded, mlp_tile=cfg.hidden_size if tiled else 0)
    system = qlora_system(cfg, weights, place.device, place.dtype, options)
    calibration = try_length(system, cfg, doc, doc, place, offloaded)
    rate = calibration.get("tokens_per_s", 0.0)
    tokens, limit = predicted(cfg, budget, place.dtype, tiled, offloaded)
    by_time = int(rate * (end - time.time()) * 0.9) // 256 * 256
    out |= dict(predicted=tokens, limited_by=limit if tokens <= by_time else "time", attempts=[calibration])
    save()
    length = min(tokens, by_time, 4 * doc if place.device.type == "cpu" else tokens)  # CPU: the path, not the peak
    while length > doc and time.time() < end:
        rec = try_length(system, cfg, length, doc, place, offloaded)
        out["attempts"].append(rec)
        save()
        print(f"{label}: {length:,} tokens, {rec['status']}", flush=True)
        if rec["status"] != "out of memory":
            break
        length = int(length * RETRY) // 256 * 256


def bench_gpu_context(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _, config, doc = SHAPES[args.shape]  # the row holds documents of the shape's default row length
    cfg = from_hf(config)
    dtype = pick_precision("auto", device, cfg)
    place = ranks.Placement(0, 1, device, dtype)
    cuda = device.type == "cuda"
    budget = torch.cuda.get_device_properties(device).total_memory if cuda else CPU_BUDGET
    results = dict(shape=args.shape, device=torch.cuda.get_device_name(device) if cuda else "cpu", doc=doc)
    results |= dict(budget_bytes=budget, precision=str(dtype).removeprefix("torch."), settings=[])
    weights = qlora_weights(cfg, device, dtype)
    deadline = args.deadline or time.time() + 600
    for i, setting in enumerate(SETTINGS):
        results["settings"].append(dict(setting=setting[0]))
        left = deadline - time.time()
        if left <= 0:
            results["settings"][-1]["skipped"] = "the deadline has passed"
            print(f"{setting[0]}: skipped, the deadline has passed", flush=True)
            continue
        save = lambda: atomic.write_json(args.out, results)
        seconds = left / (len(SETTINGS) - i)
        longest_for(weights, cfg, setting, seconds, place, budget, doc, results["settings"][-1], save)
        free_cache(device)  # the setting's system (its adapters, optimizer state, activations) went with the call
    atomic.write_json(args.out, results)


# bench.py gpu-ladder: one technique per rung

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
    """A System per rung, each its own model over one set of random weights; one that cannot be built keeps its row
    with the reason."""
    base = random_weights(cfg, device, dtype)
    rungs = []
    for i, (_, _, chunk, checkpointing, compiled, nf4) in enumerate(RUNGS):
        options = Options(checkpointing=checkpointing, loss_chunk=chunk, compile=compiled)
        try:
            rungs.append(ours_system(f"rung{i}", our_llama(cfg, base, device, dtype, options, nf4), device, dtype))
        except FAILURES as e:
            rungs.append(System(f"rung{i}", status=f"failed: {one_line(e)}"))
    return rungs


def gains(result, warmup):
    """Each rung's gain in supervised tokens/s over the rung before and over the baseline."""
    ratio = lambda a, b: pair_ratio(result["systems"], a, b, "supervised", warmup)
    return {f"rung{i}": dict(previous=ratio(f"rung{i}", f"rung{i - 1}"), baseline=ratio(f"rung{i}", "rung0"))
            for i in range(1, len(RUNGS))}  # fmt: skip


def bench_gpu_ladder(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _, config, row = SHAPES[args.shape]
    cfg = from_hf(config)
    dtype = pick_precision("auto", device, cfg)
    peak, source = peak_flops(device, dtype)
    natural = natural_work(cfg.vocab_size, row, args.rows)
    systems = build_rungs(cfg, device, dtype)
    batch_of = lambda key, step: natural_batch(natural, args.rows, RUNGS[int(key.removeprefix("rung"))][1], step)
    steps = args.warmup + args.rounds
    records, errors = run_workload(systems, batch_of, steps, device, cfg, "ladder", args.deadline or None)
    result = workload_result(systems, records, errors, args.warmup, peak, "supervised", pairs=[])
    result |= dict(rungs=[r[0] for r in RUNGS], gains=gains(result, args.warmup), shape=args.shape, row=row)
    result |= dict(rows=args.rows, peak_flops=peak, peak_source=source, precision=str(dtype).removeprefix("torch."))
    atomic.write_json(args.out, result)
    print(f"ladder: {time.strftime('%H:%M:%S')} written to {args.out}")
