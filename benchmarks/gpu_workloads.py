"""What does each system of the GPU benchmark train on, and how is a step timed, summarized and compared?

Two workloads, each run interleaved (run_workload): step s of every system, then step s + 1; the first --warmup steps
are left out.
- equal work: identical tensors for all, --rows documents of exactly --row tokens per step, one per row, every
  token supervised: nothing to pad or pack, so tokens/s compares compute efficiency. The peer gets our batch through
  hf_batch, the conversion tests/test_bench.py proves gives our loss.
- natural batching: 2,048 documents with lengths from a seeded log-normal shaped like instruction data (median 400
  tokens, sigma 0.8, clipped to the row; the first 10-60% of each is an unsupervised prompt). Ours packs them into
  rows (pack.PackedDataset, best-fit-decreasing); the peer gets them one per row, padded to the longest of its batch,
  each batch as many consecutive documents of a seeded shuffle as fit in our --rows x --row slots once padded (the
  kindest padded batching: a fixed batch size would have to fit the longest documents). Only supervised tokens/s
  compares useful work here.

Per system: tokens/s and supervised tokens/s over the measured steps; fill = real (non-padding) tokens over slots; MFU =
model FLOPs / time / the peak of support.accounting.flops.peak_flops (the datasheet bf16 peak of a known GPU, else a
measured one), with model FLOPs from support.accounting.flops.batch_flops (train.py's count), 4N per token for a
frozen-base LoRA step (no weight gradients) plus causal attention, each document (or run of padding) at its own length.
Peak memory is each system's own, as if it ran alone: the bytes it holds between steps (weights, counted whole even
where shared, optimizer state) plus the most its steps allocated above what was resident before them
(torch.cuda.max_memory_allocated; not measured on CPU). Ratios are the median (and range) of per-round ratios: tokens/s
on equal work, supervised tokens/s on natural batching. A system whose step fails (out of memory) sits out the rest of
the workload; the others run on.
"""

import contextlib
import statistics
import time

import numpy as np
import torch

import train
from benchmarks.common import LORA, SEED, median_ratio
from benchmarks.gpu_systems import FAILURES, PAIRS, free_cache, one_line
from pack import PackedDataset
from support.accounting import memory
from support.accounting.flops import batch_flops

# Natural batching: document lengths like instruction data (a log-normal, median 400 tokens, a tail to a few
# thousand), each opening with an unsupervised prompt of 10-60% of it.
DOC_COUNT, DOC_MEDIAN, DOC_SIGMA, PROMPT_SHARE = 2048, 400, 0.8, (0.1, 0.6)


def doc_lengths(n, row, seed=SEED, median=DOC_MEDIAN, sigma=DOC_SIGMA):
    """n document lengths from a seeded log-normal, clipped to 8..row; the median shrinks to row / 16 for short rows
    (the tiny shape) so that a row still holds many documents."""
    rng = np.random.default_rng([seed, 1])
    lengths = rng.lognormal(np.log(min(median, row / 16)), sigma, n)
    return np.clip(np.rint(lengths), 8, row).astype(np.int64)


def documents(lengths, vocab, seed=SEED, prompt_share=PROMPT_SHARE):
    """{tokens uint32, mask uint8, offsets int64}, the stream pack.PackedDataset takes: random ids in 1..vocab-1 (0 is
    the pad id, so the real tokens of a batch are its non-zero ones), the first prompt_share of each document
    unsupervised (a share drawn uniformly per document)."""
    rng = np.random.default_rng([seed, 2])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = rng.integers(1, vocab, int(offsets[-1]), dtype=np.uint32)
    mask = np.ones(int(offsets[-1]), dtype=np.uint8)
    prompts = np.rint(np.asarray(lengths) * rng.uniform(*prompt_share, len(lengths))).astype(np.int64)
    for start, n in zip(offsets[:-1], prompts, strict=True):
        mask[start : start + n] = 0
    return dict(tokens=tokens, mask=mask, offsets=offsets)


def equal_work(vocab, row, rows, steps):
    """The batches of steps 0..steps-1, the same tensors for every system: `rows` documents of exactly `row` tokens,
    one per row, every token supervised, none seen twice."""
    data = documents(np.full(rows * steps, row), vocab, prompt_share=(0.0, 0.0))
    ds = PackedDataset(data, row, pack=False, seed=SEED)
    return [ds.step_batch(s, rows) for s in range(steps)]


def budget_batches(lens, order, budget):
    """Documents in `order` cut into consecutive batches, each as long as its count x its longest length stays within
    `budget` tokens (a document longer than the budget alone in its batch)."""
    batches, current, longest = [], [], 0
    for d in order:
        n = int(lens[d])
        if current and (len(current) + 1) * max(longest, n) > budget:
            batches.append(current)
            current, longest = [], 0
        current.append(int(d))
        longest = max(longest, n)
    return batches + [current] * bool(current)


def natural_work(vocab, row, rows, n_docs=DOC_COUNT):
    """The same documents two ways: packed into rows of `row` tokens for us (step s: step_batch(s, rows)), and one per
    row for the peer with its batches (lists of documents) of at most rows x row padded tokens."""
    data = documents(doc_lengths(n_docs, row), vocab)
    ours = PackedDataset(data, row, pack=True, seed=SEED)
    peer = PackedDataset(data, row, pack=False, seed=SEED)  # row d holds document d
    order = np.random.default_rng([SEED, 3]).permutation(len(peer.lens))
    return ours, peer, budget_batches(peer.lens, order, rows * row)


def batch_stats(batch):
    ids = batch["input_ids"]
    return dict(
        rows=ids.shape[0],
        width=ids.shape[1],
        tokens=ids.numel(),
        real=int((ids != 0).sum()),
        supervised=int((batch["labels"] != -100).sum()),
    )


def resident_bytes(system):
    """What a system holds between steps: its weights and buffers (each storage once, counted whole where shared:
    they are its own too), bitsandbytes' quantization state, and the optimizer state."""
    tensors = [*system.model.parameters(), *system.model.buffers()]
    for p in list(tensors):
        state = getattr(p, "quant_state", None)
        for s in (state, getattr(state, "state2", None)):
            tensors += [v for v in vars(s).values() if isinstance(v, torch.Tensor)] if s is not None else []
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    opt = [v for st in system.opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return sum(storages.values()) + sum(v.numel() * v.element_size() for v in opt)


def timed_step(system, batch, device, cfg):
    """One optimizer step (forward, backward, clipping at 1.0, AdamW) between device syncs: its seconds, loss, batch
    counts and model FLOPs, and on CUDA the most it allocated above what was allocated before it."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    with system.within(batch) if system.within else contextlib.nullcontext():
        loss = system.forward(batch)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(system.params, 1.0)
    system.opt.step()
    system.opt.zero_grad(set_to_none=True)
    value = loss.item()  # waits for the step
    if cuda:
        torch.cuda.synchronize(device)
    rec = dict(time=time.perf_counter() - start, loss=value, **batch_stats(batch))
    rec["flops"] = batch_flops(cfg, batch["position_ids"])
    if cuda:
        rec["extra_bytes"] = torch.cuda.max_memory_allocated(device) - before
    return rec


def measured_step(system, batch, device, cfg):
    """One step of `system` (timed_step) for a memory table: status ("fits", "out of memory", "failed: ..."), seconds,
    tokens/s and, on CUDA, the peak = resident + the step's own allocation. A failed step's gradients and cached blocks
    are freed."""
    try:
        step = timed_step(system, batch, device, cfg)
    except torch.OutOfMemoryError:
        rec = dict(status="out of memory")
    except FAILURES as e:
        rec = dict(status=f"failed: {one_line(e)}")
    else:
        rec = dict(status="fits", step_s=step["time"], tokens_per_s=step["tokens"] / step["time"])
        if "extra_bytes" in step:
            rec["peak_bytes"] = resident_bytes(system) + step["extra_bytes"]
        return rec
    system.opt.zero_grad(set_to_none=True)
    free_cache(device)
    return rec


def qlora_estimate(cfg, tokens, place, checkpointing, offloaded=False, tile=0):
    """The total of support.accounting.memory.run_estimate, the memory estimate train.py prints, for our QLoRA (LORA on
    every block linear) on a micro-batch of `tokens` with these settings."""
    adapters = dict(lora_r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"], lora_targets="all-linear")
    run = train.Config(quantize=True, activation_checkpointing=checkpointing, offload_checkpoints=offloaded, **adapters)
    return sum(memory.run_estimate(run, cfg, tokens, place, tile_tokens=tile).values())


def run_workload(systems, batch_of, steps, device, cfg, title, deadline=None, save=None):
    """Steps 0..steps-1 of every system that runs, interleaved (step s of each in turn, then s + 1): {key: records}
    and {key: "failed: ..."} for a system whose step failed (it sits out the rest of the workload). No round starts
    after `deadline` (time.time() seconds); save(records, errors) after every round."""
    records, errors = {s.key: [] for s in systems}, {}
    for step in range(steps):
        if deadline is not None and time.time() > deadline:
            print(f"{title}: stopped at the deadline after {step} of {steps} rounds", flush=True)
            break
        done = []
        for s in systems:
            if s.status or s.key in errors:
                continue
            try:
                rec = timed_step(s, batch_of(s.key, step), device, cfg)
            except FAILURES as e:
                errors[s.key] = f"failed: {one_line(e)}"
                print(f"{title} step {step + 1}: {s.label} {errors[s.key]}", flush=True)
            else:
                records[s.key].append(rec)
                done.append(f"{s.key} {rec['time']:.3f} s")
                continue
            s.opt.zero_grad(set_to_none=True)  # the failed step's activations went with the exception
            free_cache(device)
        print(f"{title} step {step + 1}/{steps}: {', '.join(done)}", flush=True)
        if save:
            save(records, errors)
    return records, errors


def summarize_system(system, records, warmup, peak_flops):
    """Rates over the measured steps (after `warmup`), the batch shape, and peak memory = resident + the largest
    step's own allocation."""
    m = records[warmup:]
    total = lambda k: sum(r[k] for r in m)  # noqa: E731
    t = total("time")
    s = dict(
        step_s=statistics.median(r["time"] for r in m),
        tokens_per_s=total("tokens") / t,
        supervised_per_s=total("supervised") / t,
        fill=total("real") / total("tokens"),
        mfu=total("flops") / t / peak_flops,
        rows=total("rows") / len(m),
        width=total("width") / len(m),
        loss_step1=records[0]["loss"],
        resident_bytes=resident_bytes(system),
    )
    if "extra_bytes" in m[0]:
        s["peak_bytes"] = s["resident_bytes"] + max(r["extra_bytes"] for r in m)
    return s


def workload_result(systems, records, errors, warmup, peak_flops, metric, pairs=PAIRS):
    """{"systems": {key: summary, records or status}, "ratios": {"a/b": median_ratio of the per-round metric}} for the
    `pairs` (a, b) of system keys."""
    out = {"systems": {}, "ratios": {}}
    for s in systems:
        status = s.status or errors.get(s.key, "")
        if not status and len(records[s.key]) <= warmup:
            status = "stopped: no measured step (a deadline or a time limit)"
        out["systems"][s.key] = {"status": status} if status else {"steps": records[s.key]}
        if not status:
            out["systems"][s.key]["summary"] = summarize_system(s, records[s.key], warmup, peak_flops)
    for a, b in pairs:
        if ratio := pair_ratio(out["systems"], a, b, metric, warmup):
            out["ratios"][f"{a}/{b}"] = ratio | dict(metric=metric)
    return out


def pair_ratio(runs, a, b, metric, warmup):
    """median_ratio of a's `metric` per second over b's, round by round over the measured rounds both completed; None
    when either has no summary. runs: workload_result's {key: summary and steps, or status}."""
    if "summary" not in runs.get(a, {}) or "summary" not in runs.get(b, {}):
        return None
    rate = lambda r: r[metric] / r["time"]  # noqa: E731
    rounds = zip(runs[a]["steps"][warmup:], runs[b]["steps"][warmup:], strict=False)
    return median_ratio([(rate(x), rate(y)) for x, y in rounds])
