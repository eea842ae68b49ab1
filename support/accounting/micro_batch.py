"""How many rows go in a micro-batch?

`micro_batch_rows` sizes the micro-batch once per run: on CUDA the largest number of rows whose forward and backward
fit, probed on the longest rows while the optimizer state (allocated at the first step) is held in reserve; sharded
(FSDP), the largest that support/accounting/memory.py's estimate fits, since a probe that ran out of memory on one rank
only would leave the others waiting in a collective. On CPU memory comes first: CPU_MICRO_TOKENS tokens per micro-batch,
fewer rows if the estimate says they would not fit. A micro_batch_tokens setting that is a number overrides all of it.

Before that, `mlp_tile_tokens` decides whether the MLP runs in tiles (support/kernels/long_context.py): where the
estimate says that one row of the context would not fit without them.
"""

import torch

from support.accounting.memory import optimizer_bytes, reset_peak, run_estimate

CPU_MICRO_TOKENS = 512  # tokens per micro-batch on CPU when micro_batch_tokens is "auto"


def micro_batch_rows(cfg, place, model, trainset, rows_per_rank, forward_loss) -> int:
    """Micro-batch size in rows. CUDA: the largest that fits, probed with forward+backward passes on the longest rows
    while the optimizer state (allocated at the first step) is held in reserve; sharded (FSDP), the largest the
    estimate fits in 90% of the GPU (a probe that ran out of memory on one rank only would leave the others waiting
    in a collective). CPU: the smallest of at least CPU_MICRO_TOKENS that the memory estimate allows.
    forward_loss(model, batch, place) -> (loss, tokens)."""
    context = trainset.context_length
    if isinstance(cfg.micro_batch_tokens, int):
        return max(1, min(rows_per_rank, cfg.micro_batch_tokens // context))
    if place.device.type == "cuda" and cfg.parallel != "fsdp":
        return probe_cuda_rows(cfg, place, model, trainset, rows_per_rank, forward_loss)

    def fits(rows):
        return fits_in_memory(
            run_estimate(cfg, model.config, rows * context, place, model.options.mlp_tile * rows), place
        )

    if place.device.type == "cuda":
        rows = rows_per_rank
        while rows > 1 and not fits(rows):
            rows -= 1
        return rows
    # CPU: memory first. Several rows per micro-batch buy a little speed for a much larger resident set (the CPU
    # ladder measures both); set micro_batch_tokens to trade the other way.
    rows = min(rows_per_rank, max(1, CPU_MICRO_TOKENS // context))
    while rows > 1 and not fits(rows):
        rows //= 2
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


def longest_rows(trainset) -> list[int]:
    """The dataset's rows, the most tokens first: what a probe's worst case runs on."""
    return sorted(range(len(trainset)), key=lambda r: -sum(trainset.lens[d] for d in trainset.rows[r]))


def probe_cuda_rows(cfg, place, model, trainset, rows_per_rank, forward_loss) -> int:
    """The largest micro-batch whose forward and backward on the longest rows fit, the optimizer state held in
    reserve (see probe_micro_rows)."""
    longest = longest_rows(trainset)

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
    """The largest rows in 1..max_rows for which attempt(rows) (a forward + backward) does not run out of memory:
    max_rows first, then bisection (memory grows with rows, so 3 is found where halving would stop at 2). A failed
    attempt's tensors die with its frame once the except block is left; only then is the cache emptied, so the next
    attempt starts from a clean device. The peak statistics are reset at the end, so the peak the run reports is its
    own, not a failed probe's."""

    def fits(rows):
        try:
            attempt(rows)
            ok = True
        except torch.OutOfMemoryError:
            ok = False
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return ok

    lo = 1  # the answer lies in lo..hi; one row must fit, or nothing can train
    hi = max_rows
    if not fits(hi):
        hi -= 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
    reset_peak(device)
    return hi
