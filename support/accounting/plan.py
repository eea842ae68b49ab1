"""What fits: which settings fit a named GPU (`--plan`), and how many rows go in this run's micro-batch?

`plan` walks the classic decision tree over memory.py's estimate (the base, the optimizer, checkpointing, then the
micro-batch), within the card's memory less the CUDA context. `micro_batch_rows` probes on CUDA, uses the estimate under
FSDP (a probe out of memory on one rank would leave the others waiting in a collective) and on CPU, and
`mlp_tile_tokens` tiles the MLP where one row would not fit untiled.
"""

import itertools

import torch

from support.accounting.memory import (
    GIB,
    MIB,
    estimate,
    fmt,
    model_sizes,
    offloaded_bytes,
    optimizer_bytes,
    reset_peak,
    run_estimate,
)

CUDA_CONTEXT = GIB  # the CUDA context and kernels, outside torch's allocator
GPU_MIB = {  # each card's total as nvidia-smi reports it (often less than the GB it is sold as), for --plan=NAME
    "H200": 143771,
    "H100": 81559,
    "A100-80GB": 81920,
    "A100-40GB": 40960,
    "L40S": 46068,
    "A6000": 49140,
    "L4": 23034,
    "A10G": 23028,
    "RTX4090": 24564,
    "RTX3090": 24576,
    "T4": 15360,
    "V100": 16160,
}


def gpu_count(spec) -> int:
    """N of an "NxSPEC" --plan ("2x24GB", "8xH100"), else 1."""
    count, x, _ = spec.upper().replace(" ", "").partition("X")
    return int(count) if x and count.isdigit() and int(count) >= 1 else 1


def budget_bytes(spec):
    """The memory budget of one GPU from "H100", "24GB", "24GiB" (GB taken as GiB) or "2x24GB", less the CUDA
    context."""
    name = spec.upper().replace(" ", "")
    name = name.partition("X")[2] if gpu_count(spec) > 1 or name.startswith("1X") else name
    if name in GPU_MIB:
        return GPU_MIB[name] * MIB - CUDA_CONTEXT
    try:
        return float(name.removesuffix("GIB").removesuffix("GB")) * GIB - CUDA_CONTEXT
    except ValueError:
        known = ", ".join(GPU_MIB)
        raise ValueError(
            f"plan: {spec!r} is neither a size like 24GB nor a known GPU ({known}), optionally as N x it (2x24GB)"
        ) from None


def plan(config, budget, context, max_rows, dtype, lora, chunked=True, shards=0, offload=False):
    """(table, choice): the estimate of every base, optimizer, checkpointing and micro-batch (powers of two up to
    max_rows) for `config` in `budget` bytes per rank, and the first fit the tree reaches, fastest first (None: none
    fits). shards, offload: as memory.estimate."""
    rows_options = [r for r in (1, 2, 4, 8, 16, 32, 64) if r <= max_rows] or [1]
    table = {}
    kw = dict(chunked=chunked, shards=shards, offload=offload, sizes=model_sizes(config, lora["targets"]))
    for quantize, opt_bytes, ckpt, rows in itertools.product((False, True), (8, 2), (False, True), rows_options):
        parts = estimate(config, rows * context, dtype, quantize, lora, opt_bytes, ckpt, **kw)
        table[quantize, opt_bytes, ckpt, rows] = sum(parts.values())
    fits = lambda key: table[key] <= budget  # noqa: E731
    # Sharded, the base travels every step (gathered from the other ranks, or from CPU memory when offloaded): NF4
    # moves a quarter of the bytes, so it goes first; AdamW only (bitsandbytes' 8-bit AdamW takes no sharded state).
    bases, optimizers = ((True, False), (8,)) if shards else ((False, True), (8, 2))
    base = next(((qz, ob) for qz in bases for ob in optimizers if fits((qz, ob, True, 1))), None)
    if base is None:
        return table, None
    ckpt = not fits((*base, False, 1))
    rows = max(r for r in rows_options if fits((*base, ckpt, r)))
    return table, (*base, ckpt, rows)


def report(config, spec, context, max_rows, dtype, lora, chunked=True, base=(True, 8)):
    """The plan as text: the longest single row for `base` (quantize, optimizer bytes), the table, the choice. On
    several GPUs it tries DDP, then FSDP, then FSDP with CPU offload."""
    gpus, budget = gpu_count(spec), budget_bytes(spec)
    loss = "chunked" if chunked else "full-vocabulary"
    lines = [
        f"memory plan for {spec} ({fmt(budget)}{' per GPU' * (gpus > 1)} after the CUDA context), rows of {context} "
        f"tokens, LoRA r={lora['r']}, {loss} loss",
        longest_row(config, budget, dtype, lora, chunked, *base),
    ]
    ways = [("", 0, False)] + ([("FSDP", gpus, False), ("FSDP, CPU offload", gpus, True)] if gpus > 1 else [])
    for way, shards, offload in ways:
        table, choice = plan(config, budget, context, max_rows, dtype, lora, chunked, shards, offload)
        lines += [f"-- {way or 'DDP'}: bytes per GPU"] if gpus > 1 else []
        lines += plan_table(table, budget)
        if choice is not None:
            lines.append(plan_choice(choice, context, gpus, way, offload))
            return "\n".join(lines)
    lines.append("nothing fits: even an NF4 base with 8-bit AdamW and checkpointing needs more at one row")
    return "\n".join(lines)


def longest_tokens(config, budget, dtype, lora, chunked, quantize, opt_bytes, tiled, offloaded, sizes=None) -> int:
    """The longest single row (tokens, a multiple of 256) the estimate fits in `budget` with checkpointing; `tiled`:
    with MLP tiles of hidden_size tokens too; `offloaded`: with the checkpoints in CPU memory too."""
    kw = dict(sizes=sizes or model_sizes(config, lora["targets"]), offload_checkpoints=offloaded)
    kw["tile_tokens"] = config.hidden_size if tiled else 0

    def fits(tokens):
        return sum(estimate(config, tokens, dtype, quantize, lora, opt_bytes, True, chunked, **kw).values()) <= budget

    return 256 * largest(lambda n: fits(256 * n), 0, 2**16)  # up to 16M tokens


def largest(fits, low, high) -> int:
    """The largest n in low..high with fits(n), by bisection: fits(low) is taken as true, fits false from some n on."""
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def longest_row(config, budget, dtype, lora, chunked, quantize, opt_bytes) -> str:
    """longest_tokens plain, tiled and offloaded, as one line."""
    sizes = model_sizes(config, lora["targets"])
    plain, tiled, offloaded = (
        longest_tokens(config, budget, dtype, lora, chunked, quantize, opt_bytes, t, o, sizes)
        for t, o in ((False, False), (True, False), (True, True))
    )
    base = f"{'NF4' if quantize else '16-bit'} base, {'AdamW' if opt_bytes == 8 else '8-bit AdamW'}"
    return (
        f"longest single row ({base}, checkpointing): {plain:,} tokens; with a tiled MLP {tiled:,}; and offloaded "
        f"checkpoints {offloaded:,} (their CPU memory {fmt(offloaded_bytes(config, offloaded, dtype))}); the model "
        f"was trained on {config.max_position_embeddings:,} positions"
    )


def plan_table(table, budget) -> list[str]:
    rows = sorted({k[3] for k in table})
    lines = [f"{'base':7} {'optimizer':10} {'checkpointing':14}" + "".join(f"{f'{r} row(s)':>12}" for r in rows)]
    for quantize, opt_bytes, ckpt in itertools.product((False, True), (8, 2), (False, True)):
        cells = [table[quantize, opt_bytes, ckpt, r] for r in rows]
        head = f"{'NF4' if quantize else '16-bit':7} {'AdamW' if opt_bytes == 8 else '8-bit':10} "
        head += f"{'yes' if ckpt else 'no':14}"
        lines.append(head + "".join(f"{fmt(v) + (' ' if v <= budget else '*'):>12}" for v in cells))
    return lines + ["* does not fit"]


def plan_choice(choice, context, gpus, way, offload) -> str:
    quantize, opt_bytes, ckpt, rows = choice  # a key of plan's table
    optimizer = "AdamW" if opt_bytes == 8 else "8-bit AdamW"
    flags = f"--quantize={quantize} --optimizer={'adamw' if opt_bytes == 8 else 'adamw8bit'} "
    flags += f"--activation_checkpointing={ckpt} --micro_batch_tokens={rows * context}"
    command = "train.py" if gpus == 1 else f"torchrun --nproc_per_node={gpus} train.py"
    if way:
        flags += f" --parallel=fsdp --cpu_offload={offload}"
    where = f" on {gpus} GPUs, {way or 'DDP'}" if gpus > 1 else ""
    return (
        f"fastest that fits{where}: {'NF4' if quantize else '16-bit'} base, {optimizer}, checkpointing "
        f"{'on' if ckpt else 'off'}, {rows} row(s) per micro-batch ({command}: {flags})"
    )


def plan_for(cfg, config) -> str:
    """--plan: report() for a run's settings, at its context length (2048 tokens for "auto", capped by the model)."""
    context = cfg.context_length if isinstance(cfg.context_length, int) else min(2048, config.max_position_embeddings)
    dtype = torch.float32 if cfg.precision == "fp32" else torch.bfloat16
    rows = max(1, cfg.batch_tokens // context // gpu_count(cfg.plan))  # a rank's share of a step's rows
    base = (cfg.quantize, optimizer_bytes(cfg.optimizer))  # the run's own, for its longest row
    lora = cfg.adapters(cfg.lora_dropout)
    return report(config, cfg.plan, context, rows, dtype, lora, chunked=cfg.chunked_loss, base=base)


CPU_MICRO_TOKENS = 512  # tokens per micro-batch on CPU when micro_batch_tokens is "auto"


def micro_batch_rows(cfg, place, model, trainset, rows_per_rank, forward_loss) -> int:
    """Micro-batch size in rows: on CUDA the largest that fits (probed; under FSDP by the estimate), on CPU
    CPU_MICRO_TOKENS // context rows (at least 1), fewer if the estimate says so. forward_loss(model, batch, place) ->
    (loss, tokens)."""
    context = trainset.context_length
    if isinstance(cfg.micro_batch_tokens, int):
        return max(1, min(rows_per_rank, cfg.micro_batch_tokens // context))
    if place.device.type == "cuda" and cfg.parallel != "fsdp":
        return probe_cuda_rows(cfg, place, model, trainset, rows_per_rank, forward_loss)

    def fits(rows):
        return fits_in_memory(
            run_estimate(cfg, model.config, rows * context, place, model.options.mlp_tile * rows), place
        )

    # CUDA under FSDP: the most rows the estimate fits. CPU: memory first (more rows buy a little speed for a much
    # larger resident set, as the CPU ladder measures); set micro_batch_tokens to trade the other way.
    cuda = place.device.type == "cuda"
    rows = rows_per_rank if cuda else min(rows_per_rank, max(1, CPU_MICRO_TOKENS // context))
    while rows > 1 and not fits(rows):
        rows = rows - 1 if cuda else rows // 2
    return rows


def fits_in_memory(parts, place) -> bool:
    """Whether the estimate's `parts` fit this device: on a GPU in 90% of its memory, on CPU what grows during a step
    (activations and transient: the rest is loaded already) in 60% of the memory available."""
    if place.device.type == "cuda":
        return sum(parts.values()) <= 0.9 * torch.cuda.mem_get_info(place.device)[1]
    import psutil

    return parts["activations"] + parts["transient"] <= 0.6 * psutil.virtual_memory().available


def mlp_tile_tokens(cfg, place, config, context) -> int:
    """Tokens of each row per MLP tile (0: the MLP over whole rows): the setting, or for "auto" the hidden size (a tile
    of intermediates about the size of the MLP's weights) where one row of `context` tokens would not fit untiled."""
    if isinstance(cfg.mlp_tile_tokens, int):
        return cfg.mlp_tile_tokens
    tile = config.hidden_size
    return tile if context > tile and not fits_in_memory(run_estimate(cfg, config, context, place), place) else 0


def probe_cuda_rows(cfg, place, model, trainset, rows_per_rank, forward_loss) -> int:
    """The largest micro-batch whose forward and backward on the longest rows fit, with the optimizer state (allocated
    at the first step) held in reserve."""
    longest = sorted(range(len(trainset)), key=lambda r: -sum(trainset.lens[d] for d in trainset.rows[r]))

    def attempt(rows):
        try:
            loss, _ = forward_loss(model, trainset.collate(longest[:rows]), place)
            loss.backward()
        finally:
            model.zero_grad(set_to_none=True)

    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    reserve = torch.empty(optimizer_bytes(cfg.optimizer) * trainable, dtype=torch.uint8, device=place.device)
    rows = probe_micro_rows(attempt, rows_per_rank, place.device)
    del reserve
    return rows


def probe_micro_rows(attempt, max_rows, device) -> int:
    """The largest rows in 1..max_rows for which attempt(rows) does not run out of memory: max_rows, then bisection.
    The peak statistics are reset at the end, so the peak the run reports is its own, not a failed probe's."""

    def fits(rows):
        try:
            attempt(rows)
            ok = True
        except torch.OutOfMemoryError:
            ok = False
        if device.type == "cuda":  # after the except block, which freed the failed attempt's tensors
            torch.cuda.empty_cache()
        return ok

    if fits(max_rows):
        rows = max_rows
    else:  # below max_rows one row is taken to fit (nothing could train otherwise); max_rows = 1 not fitting gives 0
        rows = largest(fits, 1, max_rows - 1) if max_rows > 1 else 0
    reset_peak(device)
    return rows
