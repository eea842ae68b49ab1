"""How long a single row does our QLoRA train on the GPU at hand, and how close is the estimate to its peak?

`python bench.py gpu-context` (--shape=tiny: a 2-layer toy, on CPU; the tests run it). For each setting the length tried
first is the longest single row support/accounting/plan.py's longest_tokens predicts for this GPU's memory, capped by
the CPU memory offloaded checkpoints would take (80% of what is available) and by the time the phase has left: a setting
gets its share of the remaining time, and one step at a single document's length first measures its rate. A step that
runs out of memory is tried again 15% shorter, until one fits or the time is up. Each row holds documents of --doc
tokens (8,192 for the 8b shape) one after the other, so attention costs what it costs per document and a step's time
grows linearly with the row, while its memory is a single row's: the per-document attention keeps no T x T matrix, and
every activation is (tokens, ...) whatever the documents' boundaries. Peak memory is the QLoRA model's resident bytes
plus the most the step allocated (torch.cuda.max_memory_allocated), beside the total of
support.accounting.memory.run_estimate for the same setting: the estimate train.py prints. Results: --out (JSON),
written after every step."""

import time

import psutil
import torch

from benchmarks.gpu_systems import (
    LORA,
    LR,
    SHAPES,
    free_cache,
    our_llama,
    ours_system,
    random_llama,
    weights_of,
)
from benchmarks.gpu_workloads import measured_step, qlora_estimate
from model import Options
from support.accounting import memory, plan
from support.formats import atomic
from support.formats.hf import from_hf
from support.kernels.choice import pick_precision
from support.run import ranks

# (label, MLP tiles of hidden_size tokens, offloaded checkpoints); checkpointing is on in each
SETTINGS = [("checkpointing", False, False), ("+ tiled MLP", True, False), ("+ offloaded checkpoints", True, True)]
RETRY = 0.85  # a length that ran out of memory is tried again this much shorter


def one_row(length, doc, vocab, seed=0):
    """A batch of one row of `length` tokens: documents of `doc` tokens back to back (position_ids restart at each),
    random ids, every token supervised."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (1, length), generator=gen)
    return dict(input_ids=ids, labels=ids.clone(), position_ids=(torch.arange(length) % doc)[None])


def qlora_weights(cfg, device, dtype):
    """Random weights of shape `cfg` with the block linears in NF4 (gpu_systems.weights_of), the dense weights they
    were quantized from freed: what each setting's model is built over."""
    dense = dict(random_llama(cfg, device, dtype).state_dict())
    weights = weights_of(our_llama(cfg, dense, device, dtype, nf4=True))
    del dense
    free_cache(device)
    return weights


def qlora_system(cfg, weights, device, dtype, tiled, offloaded):
    """Our QLoRA system (train.py's model, loss and optimizer) over `weights`, built with checkpointing and the
    setting's MLP tiles and offloaded checkpoints."""
    options = Options(checkpointing=True, offload_checkpoints=offloaded, mlp_tile=cfg.hidden_size if tiled else 0)
    return ours_system("ours-qlora", our_llama(cfg, weights, device, dtype, options, nf4=True), device, dtype, LR)


def predicted(cfg, budget, dtype, tiled, offloaded):
    """(tokens, what limits them): longest_tokens for the GPU's `budget` bytes, and for offloaded checkpoints the CPU
    memory they take within 80% of what is available."""
    lora = dict(r=LORA["r"], targets="all-linear", dropout=LORA["dropout"])
    tokens = plan.longest_tokens(cfg, budget, dtype, lora, True, True, 8, tiled, offloaded)
    if offloaded:
        host = 0.8 * psutil.virtual_memory().available
        per_token = memory.offloaded_bytes(cfg, 1 << 20, dtype) / (1 << 20)
        if tokens * per_token > host:
            return int(host / per_token) // 256 * 256, "CPU memory"
    return tokens, "the estimate"


def try_length(system, cfg, length, doc, place, offloaded):
    """One training step of `system` (built with the setting) on one row of `length` tokens: its record."""
    tile = system.model.options.mlp_tile
    rec = dict(tokens=length, estimate_bytes=qlora_estimate(cfg, length, place, True, offloaded, tile))
    return rec | measured_step(system, one_row(length, doc, cfg.vocab_size), place.device, cfg)


def longest_for(weights, cfg, setting, seconds, place, budget, doc, out, save):
    """The attempts of one setting within `seconds`, appended to `out` (save() after each): a step at one document's
    length measures the setting's rate; then a row of min(prediction, what that rate trains in the time left), 15%
    shorter after each step out of memory."""
    label, tiled, offloaded = setting
    end = time.time() + seconds
    system = qlora_system(cfg, weights, place.device, place.dtype, tiled, offloaded)
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
    """`python bench.py gpu-context`: see the file docstring."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _, config, row = SHAPES[args.shape]
    cfg, doc = from_hf(config), args.doc or row
    dtype = pick_precision("auto", device, cfg)
    place = ranks.Placement(0, 1, device, dtype)
    cuda = device.type == "cuda"
    budget = torch.cuda.get_device_properties(device).total_memory if cuda else int(args.budget_gib * memory.GIB)
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
        save = lambda: atomic.write_json(args.out, results)  # noqa: E731
        seconds = left / (len(SETTINGS) - i)
        longest_for(weights, cfg, setting, seconds, place, budget, doc, results["settings"][-1], save)
        free_cache(device)  # the setting's system (its adapters, optimizer state, activations) went with the call
    atomic.write_json(args.out, results)
