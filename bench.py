"""Benchmarks. Speed is measured here and printed as tables, never asserted in tests.

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
    python bench.py pack               tokenize + pack 75,000 Magicoder-sized examples, then again from the cache
    python bench.py first-run          the default `python train.py` as a newcomer runs it: wall time, steps,
                                       validation loss before and after, peak RSS, the CPU kind and the precision

Quant timings are the best of --repeat runs after one warm-up run; the machine's other load shows up as noise.

Interleaving
------------
A shared machine drifts: the same run can be tens of percent faster or slower an hour later, as neighbours come and
go and clocks throttle. Running one system after the other puts that drift into their ratio. Both benchmarks
therefore alternate the systems (A, B, A, B, ...) and report, for each pair, the median of the per-round ratios: each
ratio compares two measurements taken moments apart, and the median ignores the odd round a neighbour spoiled.

The GPU benchmark
-----------------
`bench.py gpu` needs nothing but PyTorch, transformers and PEFT, and no network: the model is a random-initialised
Llama of a published shape (--shape: 8b = Llama-3.1-8B, 3b = Llama-3.2-3B, 1b = Llama-3.2-1B, tiny = a 2-layer toy for
CPU), built straight on the device in bf16 (on the meta device first, so no fp32 copy ever exists), weights N(0, 0.02).
Up to four systems train LoRA r=16, alpha 32, dropout 0.05 on every linear of the blocks, fp32 adapters under bf16
autocast, fused AdamW, gradient clipping at 1.0, all in one process on the same weights:

- nanoqlora LoRA: model.Llama with the packed-document attention train.py would pick (model.varlen_attention), 16-bit
  base, lora.add_lora_, train.forward_loss and train.make_optimizer;
- nanoqlora QLoRA: the same, its block linears quant.quantize_'d to NF4 from those weights;
- transformers + PEFT LoRA: LlamaForCausalLM from the same config, attn_implementation="sdpa", holding our very
  weight tensors (load_state_dict(assign=True): the frozen base is shared, not copied, which is what lets three 8B
  models and 8,192-token activations fit on one GPU), peft.get_peft_model(target_modules="all-linear");
- transformers + PEFT + bitsandbytes QLoRA, when bitsandbytes is installed: the same weights written to a temporary
  directory and loaded with BitsAndBytesConfig (NF4, double quantization, bf16 compute).

Two workloads, each run interleaved: step s of every system, then step s + 1; the first --warmup steps are left out.
- equal work: identical tensors for all, --rows documents of exactly --row tokens per step, one per row, every
  token supervised: nothing to pad or pack, so tokens/s compares compute efficiency. The peer gets our batch through
  hf_batch, the conversion tests/test_bench.py proves gives our loss.
- natural batching: 2,048 documents with lengths from a seeded log-normal shaped like instruction data (median 400
  tokens, sigma 0.8, clipped to the row; the first 10-60% of each is an unsupervised prompt). Ours packs them into
  rows (pack.PackedDataset, best-fit-decreasing); the peer gets them one per row, padded to the longest of its batch,
  each batch as many consecutive documents of a seeded shuffle as fit in our --rows x --row slots once padded (the
  kindest padded batching: a fixed batch size would have to fit the longest documents). Only supervised tokens/s
  compares useful work here.

Per system: tokens/s and supervised tokens/s over the measured steps; fill = real (non-padding) tokens over slots;
MFU = model FLOPs / time / the peak of train.peak_flops (the datasheet bf16 peak of a known GPU, else a measured one),
with model FLOPs from model.flops_per_token, 4N for a frozen-base LoRA step (no weight gradients) plus causal
attention, each document (or run of padding) at its own length. Peak memory is each system's own, as if it ran alone:
the bytes it holds between steps (weights, counted whole even where shared, optimizer state) plus the most its steps
allocated above what was resident before them (torch.cuda.max_memory_allocated; not measured on CPU). Ratios are the
median (and range) of per-round ratios: tokens/s on equal work, supervised tokens/s on natural batching.

--memory: the QLoRA model alone (the others freed) at 1, 2 and 4 rows per micro-batch, with and without activation
checkpointing: the measured peak beside the estimate train.py prints (train.estimate) for the same setting.
--profile: torch.profiler over one step of ours (LoRA and QLoRA): the kernels that take the device time, and their
share by kind. A system that fails (out of memory, a missing package) prints "failed: <why>" in its row and the
others carry on. Raw per-step records: out/bench/gpu.json.

The training benchmark
----------------------
Every configuration runs in a fresh child process, so its peak RSS (its VmHWM, read from /proc while it runs; the same
measure for both systems) is its own. Ours is `python train.py --key=value ...`; its per-step times come from
metrics.jsonl. The peer is `python bench.py peer ...`: transformers' LlamaForCausalLM from the same converted SmolLM2
directory, PEFT LoRA (r=16, alpha=32, dropout 0.05, target_modules="all-linear"), AdamW as transformers' Trainer picks
it (fused), gradient clipping at 1.0 (both), and batches built by pack.py exactly as train.py builds them
(tests/test_bench.py proves both the identity of the token tensors and that the peer's labels and attention mask give
our loss). Precision is the same on both sides: fp32 everywhere, or bf16 base weights + fp32 LoRA parameters under
torch.autocast(bf16); the peer's QLoRA is bitsandbytes NF4 with double quantization and bf16 compute.

Two workloads, 4 x 512 tokens per optimizer step:
- padded: long standard-library functions, each truncated to 512 tokens, every token supervised, one per row. Both
  systems see the very same (4, 512) tensors: equal work, so tokens/s compares compute efficiency.
- stdlib: the real variable-length stdlib dataset with each system's natural batching: packed rows for us, one example
  per row padded to the longest of the 4 for the peer (its default SFT collator). Only supervised tokens/s is a fair
  comparison there, as padding counts as tokens processed.

Per run: N steps; the first `--warmup` are dropped. Step time is the median of the rest; token rates are the tokens of
those steps over their total time, leaving out any step under half the median tokens/s (a hiccup of the shared
machine; such steps are counted and named). MFU = model FLOPs per token (train.py's formula: 4N for a frozen-base
LoRA step plus causal attention at 512 tokens) x tokens/s / train.matmul_peak of the precision in use (the 2048^3
matmul train.py times on CPU, timed for 1.5 s here). With --repeat=R the whole plan runs R times in rounds (every
configuration once per round), so each ours/peer pair is measured minutes apart in every round; the tables pool the
repeats' steps, take the highest peak RSS, and give each ratio as the median of the R per-round ratios.
"""

import argparse
import gc
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import lora
import quant
import train
from model import Llama, doc_bounds, flops_per_token, varlen_attention
from pack import PackedDataset, build_dataset, tokenize_cached
from support import atomic, hf, hf_config, memory
from support.examples import load_examples, stdlib_examples
from support.hf_config import from_hf, to_hf
from support.tokenizer import Tokenizer

REPO = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(REPO, "out", "bench")
ROWS, CONTEXT, SEED = 4, 512, 1337  # 4 x 512 tokens per optimizer step; train.Config's seed (data order, LoRA init)
CACHE_DIR = "data/cache"  # train.Config's tokenized-data cache


def best_time(fn, repeat):
    """Seconds of the fastest of `repeat` calls, after one warm-up call (lazy tables, first allocations)."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def print_table(headers, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=True)]
    for row in [headers, ["-" * w for w in widths], *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)))


def bench_quant(size=4096, repeat=5, smollm2=False):
    """NF4 quantize / dequantize of a size x size bf16 weight on CPU, pure-PyTorch (quant.py) vs bitsandbytes."""
    import bitsandbytes.functional as bnb

    import quant

    w = (torch.randn(size, size) * 0.02).to(torch.bfloat16)
    n = w.numel()
    ours = quant.quantize_nf4(w)
    packed, state = bnb.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    cases = [
        ("quantize bf16 -> nf4", "quant.py", lambda: quant.quantize_nf4(w)),
        (
            "quantize bf16 -> nf4",
            "bitsandbytes",
            lambda: bnb.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4"),
        ),
        ("dequantize nf4 -> bf16", "quant.py", lambda: quant.dequantize_nf4(*ours, w.shape, torch.bfloat16)),
        ("dequantize nf4 -> bf16", "bitsandbytes", lambda: bnb.dequantize_4bit(packed, state)),
    ]
    rows = []
    for op, impl, fn in cases:
        t = best_time(fn, repeat)
        rows.append((op, impl, f"{t * 1e3:.1f}", f"{n / t / 1e6:.0f}", f"{2 * n / t / 1e9:.2f}"))
    print(f"NF4 on CPU ({torch.get_num_threads()} threads), {size} x {size} weight, best of {repeat}")
    print_table(["operation", "implementation", "ms", "Mparams/s", "GB/s of bf16"], rows)
    if smollm2:
        print()
        bench_smollm2_load(repeat)


def bench_smollm2_load(repeat):
    """SmolLM2-135M into a QLoRA-ready model: quantize its 16-bit checkpoint tensor by tensor vs load our pre-quantized
    (bnb-4bit) checkpoint; both through hf.load_model."""
    import quant
    from support import gguf_files

    load = lambda path: hf.load_model(path, torch.bfloat16, quantize=True)  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        dense, prequantized = os.path.join(tmp, "bf16"), os.path.join(tmp, "nf4")
        gguf_files.convert_gguf(gguf_files.smollm2_gguf_path(), dense, dtype=torch.bfloat16)
        model = load(dense)
        hf.save_quantized(model, prequantized)
        rows = []
        for label, path in [("quantize the bf16 checkpoint", dense), ("load pre-quantized (bnb-4bit)", prequantized)]:
            t = best_time(lambda path=path: load(path), repeat)
            mib = os.path.getsize(os.path.join(path, "model.safetensors")) / 2**20
            rows.append((label, f"{t:.2f}", f"{mib:.1f}"))
    layers = [m for m in model.modules() if isinstance(m, quant.NF4Linear)]
    params = sum(m.in_features * m.out_features for m in layers)
    nf4_bytes = sum(b.numel() * b.element_size() for m in layers for b in m.buffers())
    rest = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"SmolLM2-135M load on CPU ({torch.get_num_threads()} threads), best of {repeat}")
    print_table(["path", "seconds", "file MiB"], rows)
    print(
        f"{params / 1e6:.1f}M parameters in {len(layers)} NF4 linears at {8 * nf4_bytes / params:.4f} bits each "
        f"({nf4_bytes / 2**20:.1f} MiB) + {rest / 2**20:.1f} MiB of bf16 embeddings and norms "
        f"= {(nf4_bytes + rest) / 2**20:.1f} MiB (bf16 model: {(2 * params + rest) / 2**20:.1f} MiB)"
    )


# ----------------------------------------------------------------------------- training benchmark: what both sides see
def cpu_name() -> str:
    return next((s.split(":", 1)[1].strip() for s in open("/proc/cpuinfo") if s.startswith("model name")), "unknown")


def package_versions(names) -> dict:
    """{name: installed version, or "not installed"}."""
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def machine() -> dict:
    import psutil

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    versions |= package_versions(("transformers", "peft", "bitsandbytes"))
    return dict(
        cpu=cpu_name(),
        cores=os.cpu_count(),
        threads=torch.get_num_threads(),
        ram_gib=round(psutil.virtual_memory().total / 2**30, 1),
        **versions,
    )


def write_padded_jsonl(path, tok, cache_dir=CACHE_DIR, min_tokens=CONTEXT):
    """The equal-work data: the stdlib functions whose chat-formatted example has at least `min_tokens` tokens, one
    {"instruction", "response"} per line. Truncated to CONTEXT, each fills a row: no padding on either side."""
    examples = stdlib_examples("train")
    _, _, offsets = tokenize_cached(examples, tok, train_on_prompt=True, cache_dir=cache_dir)
    long = [ex for ex, n in zip(examples, offsets[1:] - offsets[:-1], strict=True) if n >= min_tokens]
    lines = [json.dumps({"instruction": ex["instruction"], "response": ex["response"]}) + "\n" for ex in long]
    atomic.atomic_write(path, lambda tmp: Path(tmp).write_text("".join(lines)))
    return len(long)


def peer_dataset(data, tok, train_on_prompt, cache_dir=CACHE_DIR):
    """One example per row, the dataset train.py builds with pack=False for `data` ("" = the stdlib dataset) used as
    both training and validation file, so nothing is held out."""
    examples = load_examples(data) if data else stdlib_examples("train")
    kw = dict(pack=False, train_on_prompt=train_on_prompt, seed=SEED, cache_dir=cache_dir)
    return build_dataset(examples, tok, CONTEXT, **kw)


def hf_batch(batch):
    """Our batch -> transformers' causal-LM inputs. Our labels are pre-shifted (labels[t] is the target of position
    t); transformers shifts them itself, so they move one place right. One example per row: the padding is the
    second run of positions starting at 0, and the attention mask is 0 there."""
    labels = torch.full_like(batch["labels"], -100)
    labels[:, 1:] = batch["labels"][:, :-1]
    mask = ((batch["position_ids"] == 0).cumsum(1) == 1).long()  # (rows, width)
    return dict(input_ids=batch["input_ids"], attention_mask=mask, labels=labels)


def batch_hash(batch) -> str:
    h = hashlib.sha256()
    for k in ("input_ids", "labels", "position_ids"):
        h.update(batch[k].numpy().tobytes())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------- the peer: transformers + PEFT
def run_peer(data, train_on_prompt, precision, nf4, steps, out):
    """N optimizer steps of transformers + PEFT LoRA on our batches; per-step seconds, tokens and supervised tokens,
    the step-1 loss and the first batch's hash go to the JSON file `out`."""
    import peft
    import transformers

    from support import gguf_files

    model_dir = gguf_files.smollm2_dir()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    ds = peer_dataset(data, Tokenizer(model_dir), train_on_prompt)
    kw = {}
    if nf4:
        kw["device_map"] = "cpu"
        kw["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype, **kw)
    model.config.use_cache = False
    torch.manual_seed(SEED)
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lora)  # adapters in fp32 over a bf16 base (autocast_adapter_dtype)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)  # transformers' Trainer default: adamw_torch_fused
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    records, first = [], None
    for step in range(steps):
        start = time.perf_counter()
        batch = ds.step_batch(step, ROWS)
        first = first or batch_hash(batch)
        inputs = hf_batch(batch)
        with amp:
            loss = model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - start
        sup = int((batch["labels"] != -100).sum())
        records.append(dict(time=dt, tokens=batch["input_ids"].numel(), supervised=sup, loss=loss.item()))
        print(f"step {step + 1}: loss {loss.item():.4f}, {dt:.2f}s, {records[-1]['tokens']} tokens, {sup} supervised")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"peak RSS: {rss / 2**30:.2f} GiB")
    atomic.write_json(out, dict(steps=records, first_batch=first, trainable=sum(p.numel() for p in params)))


# ----------------------------------------------------------------------------- runs: one child process each

COMPARE = [  # (name, data, precision, NF4 base)
    ("padded-fp32", "padded", "fp32", False),
    ("padded-bf16", "padded", "bf16", False),
    ("padded-bf16-nf4", "padded", "bf16", True),
    ("stdlib-fp32", "stdlib", "fp32", False),
    ("stdlib-bf16", "stdlib", "bf16", False),
]
LADDER = [  # cumulative train.py overrides on the stdlib dataset; each rung adds one technique
    (
        "baseline: fp32, padded to 512, full-vocab logits, checkpointing, AdamW, 1-row micro-batches",
        dict(
            precision="fp32",
            pack=False,
            pad_to_max=True,
            chunked_loss=False,
            activation_checkpointing=True,
            quantize=False,
            optimizer="adamw",
            micro_batch_tokens=CONTEXT,
        ),
    ),
    ("+ packing", dict(pack=True, pad_to_max=False)),
    ("+ chunked cross-entropy", dict(chunked_loss=True)),
    ("+ activation checkpointing off", dict(activation_checkpointing=False)),
    ("+ bf16 autocast", dict(precision="bf16")),
    ("+ NF4 base (QLoRA)", dict(quantize=True)),
    ("+ 8-bit AdamW", dict(optimizer="adamw8bit")),
    ("+ auto micro-batch size", dict(micro_batch_tokens="auto")),
]


def plan(padded_path):
    """Every run: name, group, system, precision, and the peer's arguments or train.py's --key=value overrides."""
    from support import gguf_files

    model_dir = gguf_files.smollm2_dir()
    common = dict(
        model=model_dir,
        context_length=CONTEXT,
        batch_tokens=ROWS * CONTEXT,
        micro_batch_tokens=ROWS * CONTEXT,
        lora_r=16,
        lora_alpha=32.0,
        lora_dropout=0.05,
        lora_targets="all-linear",
        optimizer="adamw",
        activation_checkpointing=False,
        chunked_loss=True,
        seed=SEED,
        eval_every=0,
        save_every=0,
        sample=False,
        cache_dir=CACHE_DIR,
    )
    runs = []
    for name, data, precision, nf4 in COMPARE:
        path = padded_path if data == "padded" else ""
        peer = ["peer", f"--data={path}", f"--precision={precision}"] + ["--train_on_prompt"] * bool(path)
        peer += ["--nf4"] * nf4
        one = dict(group="compare", precision=precision)
        runs.append(dict(one, name=f"{name}/peer", system="transformers + PEFT", argv=peer))
        kw = dict(common, precision=precision, quantize=nf4)
        kw |= dict(data=path, val_data=path, pack=False, train_on_prompt=True) if path else dict(pack=True)
        runs.append(dict(one, name=f"{name}/ours", system="nanoqlora", overrides=kw))
    kw = dict(common)
    for i, (label, overrides) in enumerate(LADDER):
        kw |= overrides
        one = dict(group="ladder", precision=kw["precision"], label=label, overrides=dict(kw))
        runs.append(dict(one, name=f"ladder/{i}", system="nanoqlora"))
    return runs


def run_child(argv, log_path):
    """(exit code, peak RSS bytes, wall seconds) of `python argv...`, stdout and stderr to log_path. The peak is the
    child's own VmHWM, read from /proc while it runs: ru_maxrss from wait4 would also count what this process held
    when it forked the child (Linux carries the parent's high-water mark across fork and exec)."""
    start, peak = time.perf_counter(), 0
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            peak = max(peak, memory.vm_hwm(proc.pid))
            time.sleep(0.05)
    return proc.returncode, peak, time.perf_counter() - start


def execute(run, steps, work, repeat=0):
    """Run one configuration (the `repeat`-th time); its per-step records: seconds, tokens, supervised tokens, loss."""
    stem = run["name"].replace("/", "-") + (f"-r{repeat}" if repeat else "")
    out = os.path.join(work, stem)
    os.makedirs(out, exist_ok=True)
    log = os.path.join(OUT_DIR, "logs", stem + ".log")
    if "argv" in run:
        argv = ["bench.py", *run["argv"], f"--steps={steps}", f"--out={out}/peer.json"]
    else:
        kw = dict(run["overrides"], max_steps=steps, out_dir=out)
        argv = ["train.py", *(f"--{k}={v}" for k, v in kw.items())]
    rc, rss, wall = run_child(argv, log)
    result = dict(argv=argv, rc=rc, peak_rss=rss, wall_s=wall, log=os.path.relpath(log, REPO))
    if rc != 0:
        tail = open(log).read().strip().splitlines()[-1:] or ["(no output)"]
        return result | dict(error=tail[0][:200])
    if "argv" in run:
        return result | json.load(open(os.path.join(out, "peer.json")))
    records = []
    for line in open(os.path.join(out, "metrics.jsonl")):
        m = json.loads(line)
        if "tokens_per_s" in m:  # rows x context_length tokens per step: every run here fills its rows to 512
            dt = ROWS * CONTEXT / m["tokens_per_s"]
            records.append(dict(time=dt, tokens=ROWS * CONTEXT, supervised=m["supervised_per_s"] * dt, loss=m["loss"]))
    return result | dict(steps=records)


def summarize(results, warmup, flops_per_token, peak):
    """Over the measured steps of one or more runs of a configuration (each run's first `warmup` left out): median
    step time; tokens and supervised tokens per second; MFU. A step whose tokens/s is under half the median is a hiccup
    of the shared machine, not of the system, and is left out (and counted)."""
    steps = [s for r in results for s in r["steps"][warmup:]]
    typical = statistics.median(s["tokens"] / s["time"] for s in steps)
    kept = [s for s in steps if s["tokens"] / s["time"] >= typical / 2]
    total = sum(s["time"] for s in kept)
    tokens, sup = sum(s["tokens"] for s in kept), sum(s["supervised"] for s in kept)
    return dict(
        step_s=statistics.median(s["time"] for s in steps),
        tokens_per_s=tokens / total,
        supervised_per_s=sup / total,
        mfu=flops_per_token * tokens / total / peak,
        loss_step1=results[0]["steps"][0]["loss"],
        hiccups=len(steps) - len(kept),
    )


def median_ratio(pairs):
    """The median, lowest and highest of a / b over (a, b) pairs measured together, or None without pairs."""
    ratios = [a / b for a, b in pairs]
    if not ratios:
        return None
    return dict(median=statistics.median(ratios), low=min(ratios), high=max(ratios), n=len(ratios))


def fmt_gb(n):
    return f"{n / 2**30:.2f} GiB"


def merge_repeats(results):
    """{name: one entry per configuration}: the summary over all its successful repeats, the highest peak RSS, and a
    summary per repeat (keyed by round) for the per-round ratios. Runs from before --repeat existed are round 0."""
    groups = {}
    for r in results["runs"]:
        groups.setdefault(r["name"], []).append(r)
    by = {}
    for name, runs in groups.items():
        ok = [r for r in runs if "error" not in r]
        entry = {k: runs[0].get(k) for k in ("name", "system", "precision", "label")}
        if not ok:
            by[name] = entry | dict(error=runs[-1]["error"])
            continue
        args = (results["warmup"], results["flops_per_token"], results["peaks"][entry["precision"]])
        entry["summary"] = summarize(ok, *args)
        entry["rounds"] = {r.get("repeat", 0): summarize([r], *args) for r in ok}
        entry["peak_rss"] = max(r["peak_rss"] for r in ok)
        entry["first_batch"] = ok[0].get("first_batch")
        by[name] = entry
    return by


def round_ratio(a, b, key):
    """Median over the rounds both entries ran of a's `key` / b's `key` (see median_ratio)."""
    common = sorted(a["rounds"].keys() & b["rounds"].keys())
    return median_ratio([(a["rounds"][k][key], b["rounds"][k][key]) for k in common])


def print_tables(results):
    by = merge_repeats(results)
    print_compare(by)
    print_ladder(by)
    hiccups = [f"{n} ({e['summary']['hiccups']})" for n, e in by.items() if e.get("summary", {}).get("hiccups")]
    if hiccups:
        print(f"\nsteps left out as machine hiccups (under half the median tokens/s): {', '.join(hiccups)}")


def compare_row(name, data, system, by):
    """One row of the ours-vs-peer table."""
    r = by[f"{name}/{system}"]
    if "error" in r:
        return (name, r["system"], r["precision"], "failed: " + r["error"], "", "", "", "", "")
    s, peer = r["summary"], by.get(f"{name}/peer", {})
    ratio, key = "", "tokens_per_s" if data == "padded" else "supervised_per_s"
    if system == "ours" and "rounds" in peer and (speed := round_ratio(r, peer, key)):
        ratio = f"{speed['median']:.2f}x / {r['peak_rss'] / peer['peak_rss']:.2f}x"
        ratio += f" ({speed['low']:.2f}-{speed['high']:.2f}, {speed['n']} rounds)" if speed["n"] > 1 else ""
    precision = r["precision"] + (" NF4" if name.endswith("nf4") else "")
    rates = (f"{s['step_s']:.2f}", f"{s['tokens_per_s']:.0f}", f"{s['supervised_per_s']:.0f}", f"{100 * s['mfu']:.1f}%")
    return (name, r["system"], precision, *rates, fmt_gb(r["peak_rss"]), ratio)


def print_compare(by):
    """The ours-vs-peer table from the entries by name."""
    rows = [
        compare_row(name, data, system, by)
        for name, data, *_ in COMPARE
        for system in ("peer", "ours")
        if f"{name}/{system}" in by
    ]
    if not rows:
        return
    print("\nours vs transformers + PEFT (LoRA r=16 on all linears, 4 x 512 tokens per step)")
    headers = ["workload", "system", "precision", "step s", "tokens/s", "supervised/s", "MFU", "peak RSS"]
    print_table([*headers, "ours/peer speed (median of rounds) / RSS"], rows)
    fp32 = by.get("padded-fp32/peer", {})
    for n, data, precision, _ in COMPARE:
        ours = by.get(f"{n}/ours", {})
        if data == "padded" and precision == "bf16" and "summary" in ours and "summary" in fp32:
            if speed := round_ratio(ours, fp32, "tokens_per_s"):
                print(f"{n}: ours {speed['median']:.2f}x the peer's fp32 tokens/s")
    for n, data, *_ in COMPARE:
        ours, peer = by.get(f"{n}/ours", {}), by.get(f"{n}/peer", {})
        if data == "padded" and "summary" in ours and "summary" in peer:
            o, p = ours["summary"]["loss_step1"], peer["summary"]["loss_step1"]
            print(f"{n}: step-1 loss on the identical batch {peer['first_batch']}: ours {o:.5f}, peer {p:.5f}")


def print_ladder(by):
    """The optimization-ladder table from the entries by name; gains are medians of per-round ratios."""
    rows, base = [], by.get("ladder/0", {})
    for i, (label, _) in enumerate(LADDER):
        r = by.get(f"ladder/{i}")
        if r is None:
            continue
        if "error" in r:
            rows.append((label, "failed: " + r["error"], "", "", "", "", ""))
            continue
        s = r["summary"]
        gain = round_ratio(r, base, "supervised_per_s") if "summary" in base else None
        rows.append(
            (
                label,
                f"{s['step_s']:.2f}",
                f"{s['tokens_per_s']:.0f}",
                f"{s['supervised_per_s']:.0f}",
                f"{100 * s['mfu']:.1f}%",
                fmt_gb(r["peak_rss"]),
                f"{gain['median']:.2f}x" if gain else "",
            )
        )
    if rows:
        print("\noptimization ladder (ours, stdlib dataset, 4 x 512 tokens per step, each row adds one technique)")
        print_table(
            ["configuration", "step s", "tokens/s", "supervised/s", "MFU", "peak RSS", "supervised/s gain"], rows
        )


def select_runs(runs, only):
    """The runs --only names: a group (compare, ladder), a workload (padded-fp32), NAME/ours, NAME/peer or ladder/N."""
    names = only.split(",")
    runs = [r for r in runs if any(t in (r["group"], r["name"]) or r["name"].startswith(t + "/") for t in names)]
    if not runs:
        known = ", ".join(["compare", "ladder", *(c[0] for c in COMPARE)])
        raise SystemExit(f"--only={only}: matches no run; use {known}, NAME/ours, NAME/peer or ladder/N")
    return runs


def bench_train(steps, warmup, only, repeat=1):
    from support import gguf_files

    os.makedirs(os.path.join(OUT_DIR, "logs"), exist_ok=True)
    model_dir = gguf_files.smollm2_dir()
    config, _ = hf_config.read_config(model_dir)
    padded = os.path.join(OUT_DIR, "padded512.jsonl")
    n_long = write_padded_jsonl(padded, Tokenizer(model_dir))
    runs = select_runs(plan(padded), only) if only else plan(padded)
    info = machine()
    cpu = torch.device("cpu")  # train.py's CPU peak, timed longer
    peaks = {"fp32": train.matmul_peak(cpu, torch.float32, 1.5), "bf16": train.matmul_peak(cpu, torch.bfloat16, 1.5)}
    print(
        f"{info['cpu']}, {info['cores']} cores ({info['threads']} torch threads), {info['ram_gib']} GiB RAM; python "
        f"{info['python']}, torch {info['torch']}, transformers {info['transformers']}, peft {info['peft']}, "
        f"bitsandbytes {info['bitsandbytes']}"
    )
    print(f"matmul peak (2048^3): fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s")
    flops = flops_per_token(config, CONTEXT)
    print(f"model FLOPs per token (LoRA step at {CONTEXT} tokens): {flops / 1e9:.3f} GFLOP")
    print(f"padded workload: {n_long} stdlib functions of at least {CONTEXT} tokens; {steps} steps, {warmup} warm-up")
    command = "python bench.py train" + "".join(f" {a}" for a in sys.argv[2:])
    results = dict(command=command, machine=info, peaks=peaks, flops_per_token=flops, steps=steps, warmup=warmup)
    results |= dict(repeat=repeat, runs=[])
    with tempfile.TemporaryDirectory(dir=OUT_DIR) as work:
        for k in range(repeat):  # rounds: every configuration once per round, so the pairs alternate A, B, A, B
            for i, run in enumerate(runs, 1):
                r = dict(name=run["name"], system=run["system"], precision=run["precision"], label=run.get("label"))
                r |= dict(repeat=k) | execute(run, steps, work, k)
                print(
                    f"[{k * len(runs) + i}/{repeat * len(runs)}] {run['name']}: {progress(r, warmup, flops, peaks)}",
                    flush=True,
                )
                results["runs"].append(r)
                atomic.write_json(os.path.join(OUT_DIR, "results.json"), results)
    print_tables(results)
    print(f"\nraw results: {os.path.relpath(os.path.join(OUT_DIR, 'results.json'), REPO)}")


def progress(r, warmup, flops, peaks):
    """One line on a finished run."""
    if "error" in r:
        return f"FAILED ({r['error']}); see {r['log']} (wall {r['wall_s']:.0f} s)"
    s = summarize([r], warmup, flops, peaks[r["precision"]])
    done = f"{s['step_s']:.2f} s/step, {s['tokens_per_s']:.0f} tokens/s, {s['supervised_per_s']:.0f} supervised/s"
    return done + f", peak RSS {fmt_gb(r['peak_rss'])} (wall {r['wall_s']:.0f} s)"


# ----------------------------------------------------------------------------- GPU benchmark: shapes and data

_LLAMA3 = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=128256,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=131072,
)
_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
# --shape: (name, config.json keys of the published model, default tokens per row). The weights are random.
SHAPES = {
    "8b": (
        "Llama-3.1-8B",
        _LLAMA3
        | dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32)
        | dict(rope_scaling=_ROPE | dict(factor=8.0)),
        8192,
    ),
    "3b": (
        "Llama-3.2-3B",
        _LLAMA3
        | dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24)
        | dict(tie_word_embeddings=True, rope_scaling=_ROPE | dict(factor=32.0)),
        8192,
    ),
    "1b": (
        "Llama-3.2-1B",
        _LLAMA3
        | dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, head_dim=64)
        | dict(tie_word_embeddings=True, rope_scaling=_ROPE | dict(factor=32.0)),
        8192,
    ),
    "tiny": (
        "a 2-layer toy",
        _LLAMA3
        | dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4)
        | dict(num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
        | dict(rope_scaling=_ROPE | dict(factor=8.0, original_max_position_embeddings=128)),
        256,
    ),
}
LORA = dict(r=16, alpha=32.0, dropout=0.05)
LR = 1e-4  # the same for every system; speed does not depend on it
# Natural batching: document lengths like instruction data (a log-normal, median 400 tokens, a tail to a few
# thousand), each opening with an unsupervised prompt of 10-60% of it.
DOC_COUNT, DOC_MEDIAN, DOC_SIGMA, PROMPT_SHARE = 2048, 400, 0.8, (0.1, 0.6)
SYSTEMS = {  # key: row label
    "ours-lora": "nanoqlora LoRA",
    "ours-qlora": "nanoqlora QLoRA (NF4)",
    "peer-lora": "transformers + PEFT LoRA",
    "peer-qlora": "transformers + PEFT + bitsandbytes QLoRA",
}
PAIRS = [
    ("ours-lora", "peer-lora"),
    ("ours-qlora", "peer-qlora"),
    ("ours-qlora", "peer-lora"),
    ("ours-qlora", "ours-lora"),
]
# What a system can fail with while being built or stepped: out of memory (a RuntimeError), a missing or mismatched
# package, a bad setting. Each is reported in the system's row; the other systems carry on.
FAILURES = (RuntimeError, ImportError, ValueError, TypeError, OSError)


def doc_lengths(n, row, seed=SEED, median=DOC_MEDIAN, sigma=DOC_SIGMA):
    """n document lengths from a seeded log-normal, clipped to 8..row; the median shrinks to row / 16 for short rows
    (the tiny shape) so that a row still holds many documents."""
    rng = np.random.default_rng([seed, 1])
    lengths = rng.lognormal(np.log(min(median, row / 16)), sigma, n)
    return np.clip(np.rint(lengths), 8, row).astype(np.int64)


def documents(lengths, vocab, seed=SEED, prompt_share=PROMPT_SHARE):
    """(tokens uint32, mask uint8, offsets int64), what pack.PackedDataset takes: random ids in 1..vocab-1 (0 is the
    pad id, so the real tokens of a batch are its non-zero ones), the first prompt_share of each document unsupervised
    (a share drawn uniformly per document)."""
    rng = np.random.default_rng([seed, 2])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = rng.integers(1, vocab, int(offsets[-1]), dtype=np.uint32)
    mask = np.ones(int(offsets[-1]), dtype=np.uint8)
    prompts = np.rint(np.asarray(lengths) * rng.uniform(*prompt_share, len(lengths))).astype(np.int64)
    for start, n in zip(offsets[:-1], prompts, strict=True):
        mask[start : start + n] = 0
    return tokens, mask, offsets


def equal_work(vocab, row, rows, steps):
    """The batches of steps 0..steps-1, the same tensors for every system: `rows` documents of exactly `row` tokens,
    one per row, every token supervised, none seen twice."""
    data = documents(np.full(rows * steps, row), vocab, prompt_share=(0.0, 0.0))
    ds = PackedDataset(*data, row, pack=False, seed=SEED)
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
    ours = PackedDataset(*data, row, pack=True, seed=SEED)
    peer = PackedDataset(*data, row, pack=False, seed=SEED)  # row d holds document d
    order = np.random.default_rng([SEED, 3]).permutation(len(peer.lens))
    return ours, peer, budget_batches(peer.lens, order, rows * row)


def step_flops(cfg, position_ids):
    """Model FLOPs of a step over these positions: every span model.doc_bounds finds (a document, or a run of
    padding) costs its tokens x flops_per_token at its own length."""
    spans = np.diff(doc_bounds(position_ids).bounds.numpy())
    return float(sum(int(n) * flops_per_token(cfg, int(n)) for n in spans))


def batch_stats(batch):
    ids = batch["input_ids"]
    return dict(
        rows=ids.shape[0],
        width=ids.shape[1],
        tokens=ids.numel(),
        real=int((ids != 0).sum()),
        supervised=int((batch["labels"] != -100).sum()),
    )


# ----------------------------------------------------------------------------- GPU benchmark: the systems
@dataclass
class System:
    """One trainer under test: forward(batch) gives the mean loss over the supervised tokens, on the device."""

    key: str
    forward: object = None
    model: object = None
    params: list | None = None
    opt: object = None
    status: str = ""  # why it does not run ("failed: ...", "skipped: ..."); "" when it does

    @property
    def label(self):
        return SYSTEMS[self.key]


class Skipped(Exception):
    """A system left out on purpose (its optional package is not installed)."""


def one_line(e):
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"


def free_cache(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def random_llama(cfg, device, dtype):
    """Our Llama of shape `cfg` on `device` in `dtype`, built on the meta device first (no fp32 copy ever exists), with
    the attention train.py would pick; weights N(0, 0.02) and norms 1 from a seeded generator."""
    with torch.device("meta"):
        model = Llama(cfg, varlen_attention(device, dtype, cfg.head_dim, windowed=bool(cfg.sliding_layers)))
    model = model.to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty gives every parameter its own storage
        model.lm_head.weight = model.model.embed_tokens.weight
    gen = torch.Generator(device).manual_seed(SEED)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=gen) if p.dim() > 1 else p.fill_(1.0)
    return model


def qlora_llama(cfg, base, device, dtype):
    """Our NF4 model of the weights `base` (a state dict): block linears quantized from them on `device`, the
    embeddings, norms and lm_head shared with them (the same storage)."""
    with torch.device("meta"):
        model = Llama(cfg, varlen_attention(device, dtype, cfg.head_dim, windowed=bool(cfg.sliding_layers)))
    quant.quantize_(model.to(dtype), compute_dtype=dtype, device=device, weights=base.__getitem__)
    rest = {k: base[k] for k, v in model.state_dict().items() if v.is_meta}
    model.load_state_dict(rest, strict=False, assign=True)
    return model


def ours_system(key, model, device, dtype, lr, compile=False):
    """Adapters on our model, as train.build_model adds them; the loss and optimizer of train.py."""
    torch.manual_seed(SEED)  # the same adapters on LoRA and QLoRA
    lora.add_lora_(model, "all-linear", LORA["r"], LORA["alpha"], LORA["dropout"], lora_dtype=torch.float32)
    if compile:
        model.compile_blocks()
    run = train.Run(train.Config(lr=lr), 0, 1, device, dtype)
    params = [p for p in model.parameters() if p.requires_grad]

    def forward(batch):
        loss, n = train.forward_loss(model, batch, run)
        return loss / max(n, 1)

    return System(key, forward, model, params, train.make_optimizer(run.cfg, params, device))


def peer_llama(cfg, base, device, dtype):
    """transformers' LlamaForCausalLM of the same config with sdpa attention, holding the tensors of `base`."""
    import transformers

    with torch.device(device):  # a bf16 model, randomly initialised, whose tensors are then replaced by ours
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.LlamaConfig.from_dict(to_hf(cfg)), attn_implementation="sdpa", dtype=dtype
        )
    model.load_state_dict(base, assign=True)  # strict: the names are the same
    return model


def peer_qlora_llama(cfg, base, device, dtype):
    """transformers + bitsandbytes NF4 (double quantization, bf16 compute) of the weights `base`, through the one door
    bitsandbytes quantization has in transformers: from_pretrained of a directory, written here to a temporary one."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise Skipped("bitsandbytes is not installed")
    import transformers

    os.makedirs(OUT_DIR, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=OUT_DIR) as tmp:
        tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
        atomic.write_safetensors(
            os.path.join(tmp, "model.safetensors"), {k: v for k, v in base.items() if k not in tied}
        )
        atomic.write_json(os.path.join(tmp, "config.json"), hf_config.config_json(cfg, dtype))
        q = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype
        )
        where = device.index if device.type == "cuda" else "cpu"
        return transformers.LlamaForCausalLM.from_pretrained(
            tmp, dtype=dtype, quantization_config=q, device_map={"": where}, attn_implementation="sdpa"
        )


def peer_system(key, model, device, dtype, lr):
    """PEFT LoRA on a transformers model (adapters in fp32: PEFT's autocast_adapter_dtype), fused AdamW as the
    Trainer's default; the loss on our batch converted by hf_batch, under the same autocast as ours."""
    import peft

    model.config.use_cache = False
    torch.manual_seed(SEED)
    config = peft.LoraConfig(
        r=LORA["r"],
        lora_alpha=LORA["alpha"],
        lora_dropout=LORA["dropout"],
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(model, config)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    amp = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def forward(batch):
        inputs = {k: v.to(device) for k, v in hf_batch(batch).items()}
        with amp:
            return model(**inputs).loss

    return System(key, forward, model, params, torch.optim.AdamW(params, lr=lr, fused=True))


def build_system(key, cfg, base, base_model, device, dtype, args):
    """One system on the weights `base` (the state dict of `base_model`, our dense Llama)."""
    if key == "peer-lora":
        return peer_system(key, peer_llama(cfg, base, device, dtype), device, dtype, LR)
    if key == "peer-qlora":
        return peer_system(key, peer_qlora_llama(cfg, base, device, dtype), device, dtype, LR)
    model = qlora_llama(cfg, base, device, dtype) if key == "ours-qlora" else base_model
    return ours_system(key, model, device, dtype, LR, args.compile)


def build_systems(cfg, keys, device, dtype, args):
    """The systems named in `keys`, in SYSTEMS order, all on one set of random weights; a system that cannot be built
    gets its reason as status. The dense base tensors live on only as long as some system holds them."""
    base_model = random_llama(cfg, device, dtype)
    base = dict(base_model.state_dict())  # references, no copies
    built = {}
    # The peers and our QLoRA read `base` before our LoRA model takes its linears over (add_lora_ adapts in place).
    for key in ("peer-lora", "peer-qlora", "ours-qlora", "ours-lora"):
        if key not in keys:
            continue
        start = time.perf_counter()
        try:
            built[key] = build_system(key, cfg, base, base_model, device, dtype, args)
        except Skipped as e:
            built[key] = System(key, status=f"skipped: {e}")
        except FAILURES as e:
            built[key] = System(key, status=f"failed: {one_line(e)}")
            free_cache(device)
        print(f"{SYSTEMS[key]}: built in {time.perf_counter() - start:.1f} s {built[key].status}".rstrip(), flush=True)
    return [built[k] for k in SYSTEMS if k in built]


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
    loss = system.forward(batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(system.params, 1.0)
    system.opt.step()
    system.opt.zero_grad(set_to_none=True)
    value = loss.item()  # waits for the step
    if cuda:
        torch.cuda.synchronize(device)
    rec = dict(time=time.perf_counter() - start, loss=value, **batch_stats(batch))
    rec["flops"] = step_flops(cfg, batch["position_ids"])
    if cuda:
        rec["extra_bytes"] = torch.cuda.max_memory_allocated(device) - before
    return rec


def run_workload(systems, batch_of, steps, device, cfg, title):
    """Steps 0..steps-1 of every system that runs, interleaved (step s of each in turn, then s + 1): {key: records}
    and {key: "failed: ..."} for a system whose step failed (it sits out the rest of the workload)."""
    records, errors = {s.key: [] for s in systems}, {}
    for step in range(steps):
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


def workload_result(systems, records, errors, warmup, peak_flops, metric):
    """{"systems": {key: summary, records or status}, "ratios": {"a/b": median_ratio of the per-round metric}}."""
    out = {"systems": {}, "ratios": {}}
    for s in systems:
        status = s.status or errors.get(s.key, "")
        if not status and len(records[s.key]) <= warmup:
            status = "failed: no measured step"
        out["systems"][s.key] = {"status": status} if status else {"steps": records[s.key]}
        if not status:
            out["systems"][s.key]["summary"] = summarize_system(s, records[s.key], warmup, peak_flops)
    for a, b in PAIRS:
        ra, rb = out["systems"].get(a, {}), out["systems"].get(b, {})
        if "summary" in ra and "summary" in rb:
            rate = lambda r: r[metric] / r["time"]  # noqa: E731
            pairs = zip(ra["steps"][warmup:], rb["steps"][warmup:], strict=False)  # the rounds both completed
            out["ratios"][f"{a}/{b}"] = median_ratio([(rate(x), rate(y)) for x, y in pairs]) | dict(metric=metric)
    return out


# ----------------------------------------------------------------------------- GPU benchmark: profile, memory, tables

# Kinds of kernel (on CPU: of operator) by name, for the profile's summary line; the first pattern that matches wins.
KERNEL_KINDS = [
    ("attention", r"flash|fmha|attention|attn"),  # first: FlashAttention's kernel names hold "cutlass" too
    ("matmul", r"gemm|cutlass|nvjet|xmma|wgmma|^aten::(mm|addmm|bmm)$"),
    ("NF4 dequantize", r"dequant|^kernel$"),  # `kernel`: the name of quant.py's Triton kernel
]


def kernel_kind(name):
    return next((k for k, pattern in KERNEL_KINDS if re.search(pattern, name, re.IGNORECASE)), "other")


def profile_step(system, batch, device, cfg, top=15):
    """torch.profiler over one step: the `top` kernels by device time (on CPU: operators by their own CPU time), and
    the share of each kind of KERNEL_KINDS."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *[ProfilerActivity.CUDA] * cuda]) as prof:
        timed_step(system, batch, device, cfg)
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if not cuda or e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(getattr(e, attr) for e in events) or 1
    kinds = dict.fromkeys([k for k, _ in KERNEL_KINDS] + ["other"], 0.0)
    for e in events:
        kinds[kernel_kind(e.key)] += getattr(e, attr) / total
    ranked = sorted(events, key=lambda e: -getattr(e, attr))[:top]
    kernels = [
        dict(name=e.key, calls=e.count, ms=getattr(e, attr) / 1e3, share=getattr(e, attr) / total) for e in ranked
    ]
    return dict(measure=attr, total_ms=total / 1e3, kinds=kinds, kernels=kernels)


def print_profile(label, p):
    what = "kernels by device time" if p["measure"] == "self_device_time_total" else "operators by own CPU time"
    print(f"\nprofile of one equal-work step, {label}: {what}, {p['total_ms']:.1f} ms in all")
    rows = [(k["name"][:100], k["calls"], f"{k['ms']:.2f}", f"{k['share']:.1%}") for k in p["kernels"]]
    print_table(["name", "calls", "ms", "share"], rows)
    print("by kind: " + ", ".join(f"{k} {v:.1%}" for k, v in p["kinds"].items()))


def memory_rows(system, cfg, row, device, dtype, sizes=(1, 2, 4)):
    """One step of `system` (our QLoRA) on equal-work batches of each size, without then with activation
    checkpointing: the measured peak (resident + the step's own allocation) beside the total of train.estimate, the
    memory estimate train.py prints, for the same setting."""
    out, adapters = [], dict(lora_r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"])
    for ckpt in (False, True):
        system.model.activation_checkpointing = ckpt
        for rows in sizes:
            setting = train.Config(quantize=True, activation_checkpointing=ckpt, lora_targets="all-linear", **adapters)
            est = train.estimate(train.Run(setting, 0, 1, device, dtype), cfg, rows * row)  # what train.py prints
            rec = dict(rows=rows, checkpointing=ckpt, estimate_bytes=sum(est.values()))
            try:
                step = timed_step(system, equal_work(cfg.vocab_size, row, rows, 1)[0], device, cfg)
            except torch.OutOfMemoryError:
                rec["status"] = "out of memory"
            except FAILURES as e:
                rec["status"] = f"failed: {one_line(e)}"
            else:
                rec |= dict(step_s=step["time"], tokens_per_s=step["tokens"] / step["time"])
                if "extra_bytes" in step:
                    rec["peak_bytes"] = resident_bytes(system) + step["extra_bytes"]
            if "status" in rec:
                system.opt.zero_grad(set_to_none=True)
                free_cache(device)
            out.append(rec)
            print(f"memory: {rows} x {row}, checkpointing {'on' if ckpt else 'off'}: {rec.get('status', 'done')}")
    system.model.activation_checkpointing = False
    return out


def print_memory(label, row, rows):
    print(f"\npeak memory of {label}, one step per micro-batch size (the other systems freed)")
    table = []
    for r in rows:
        peak = memory.fmt(r["peak_bytes"]) if "peak_bytes" in r else r.get("status", "-")
        speed = (f"{r['step_s']:.2f}", f"{r['tokens_per_s']:,.0f}") if "step_s" in r else ("", "")
        on = "on" if r["checkpointing"] else "off"
        table.append((f"{r['rows']} x {row}", on, peak, memory.fmt(r["estimate_bytes"]), *speed))
    print_table(["micro-batch", "checkpointing", "measured peak", "train.estimate", "step s", "tokens/s"], table)


def print_workload(title, result, systems):
    """A workload's table (a row per system) and its ratios (median of the per-round ratios, and their range)."""
    print(f"\n{title}")
    rows = []
    for s in systems:
        r = result["systems"][s.key]
        if "summary" not in r:
            rows.append((s.label, r["status"], *[""] * 7))
            continue
        m = r["summary"]
        batch = f"{m['rows']:.3g} x {m['width']:.0f}"
        rates = (f"{m['step_s']:.3f}", f"{m['tokens_per_s']:,.0f}", f"{m['supervised_per_s']:,.0f}", f"{m['mfu']:.1%}")
        peak = memory.fmt(m["peak_bytes"]) if "peak_bytes" in m else "-"
        rows.append((s.label, batch, f"{m['fill']:.1%}", *rates, peak, f"{m['loss_step1']:.4f}"))
    headers = ["system", "rows x width", "fill", "step s", "tokens/s", "supervised/s", "MFU", "peak memory"]
    print_table([*headers, "step-1 loss"], rows)
    ratios = [
        (f"{SYSTEMS[a]} / {SYSTEMS[b]}", f"{r['median']:.2f}x", f"{r['low']:.2f}-{r['high']:.2f}", r["n"])
        for pair, r in result["ratios"].items()
        for a, b in [pair.split("/")]
    ]
    if ratios:
        metric = (
            "supervised tokens/s" if next(iter(result["ratios"].values()))["metric"] == "supervised" else "tokens/s"
        )
        print_table([f"ratio of {metric}", "median of rounds", "range", "rounds"], ratios)


def gpu_device(name):
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # as train.setup
    return device


def gpu_machine(device):
    """The device and the versions that matter to its speed."""
    info = dict(torch=torch.__version__, cuda=torch.version.cuda or "none", python=platform.python_version())
    info |= package_versions(("transformers", "peft", "bitsandbytes", "flash-attn", "triton"))
    if device.type == "cuda":
        info |= dict(
            device=torch.cuda.get_device_name(device), memory=torch.cuda.get_device_properties(device).total_memory
        )
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
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
    print(
        f"shape {results['shape']} ({SHAPES[results['shape']][0]}, {size} parameters, random weights), "
        f"{results['precision']}, "
        f"LoRA r={LORA['r']} alpha={LORA['alpha']:g} dropout {LORA['dropout']} on every block linear"
    )
    dequant = quant.cuda_dequantize().__name__ if device.type == "cuda" else "dequantize_nf4"
    compiled = ", blocks torch.compile'd" if results["compile"] else ""
    print(f"ours: attention {results['attention']}, NF4 {dequant}{compiled}")
    print(
        f"MFU against {train.fmt_flops(results['peak_flops'])} {results['precision']} ({results['peak_source']}); "
        "model FLOPs per "
        f"token of a {row}-token document: {flops_per_token(cfg, row) / 1e9:.3g} GFLOP"
    )
    warmup, rounds = results["warmup"], results["rounds"]
    print(f"{rows} x {row} tokens per step; {warmup} warm-up step(s), then {rounds} interleaved rounds")


def describe_natural(ours, peer, batches, rows):
    """Print and return what the natural workload holds: the lengths, and how much of each side's slots are real."""
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
    """`python bench.py gpu`: see the file docstring."""
    # Before the first CUDA allocation: the systems' steps alternate in one caching allocator, and growable segments
    # keep one system's freed blocks from fragmenting memory for the next.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    device, (_, config, default_row) = gpu_device(args.device), SHAPES[args.shape]
    cfg, row, steps = from_hf(config), args.row or default_row, args.warmup + args.rounds
    dtype = train.pick_precision(train.Config(precision=args.precision), device, cfg)  # bf16, or on CPU the faster
    if device.type == "cpu" and args.shape != "tiny":
        print(f"warning: --shape={args.shape} on CPU is slow and large; --shape=tiny is the CPU smoke test")
    peak, source = train.peak_flops(device, dtype)
    results = dict(command="python bench.py " + " ".join(sys.argv[1:]), machine=gpu_machine(device), shape=args.shape)
    results |= dict(config=to_hf(cfg), row=row, rows=args.rows, warmup=args.warmup, rounds=args.rounds)
    results |= dict(compile=args.compile, peak_flops=peak, peak_source=source, workloads={})
    results["precision"] = str(dtype).removeprefix("torch.")
    results["attention"] = varlen_attention(device, dtype, cfg.head_dim).__name__
    print_gpu_header(results, cfg, device)
    equal = equal_work(cfg.vocab_size, row, args.rows, steps)
    ours_ds, peer_ds, peer_batches = natural_work(cfg.vocab_size, row, args.rows)
    results["natural_data"] = describe_natural(ours_ds, peer_ds, peer_batches, args.rows)
    systems = build_systems(cfg, args.systems.split(","), device, dtype, args)

    def natural(key, step):
        return (
            ours_ds.step_batch(step, args.rows)
            if key.startswith("ours")
            else peer_ds.collate(peer_batches[step % len(peer_batches)])
        )

    equal_title = f"equal work: identical tensors, {args.rows} x {row} tokens per step, every token supervised"
    work = {  # name: (the batch of system `key` at step s, the metric of its ratios, the table's title)
        "equal": (lambda key, s: equal[s], "tokens", equal_title),
        "natural": (natural, "supervised", "natural batching: ours packed, the peer padded to the longest of a batch"),
    }
    for name, (batch_of, metric, _) in work.items():
        records, errors = run_workload(systems, batch_of, steps, device, cfg, name)
        results["workloads"][name] = workload_result(systems, records, errors, args.warmup, peak, metric)
        atomic.write_json(args.out, results)
    for name, (_, _, title) in work.items():
        print_workload(title, results["workloads"][name], systems)
    finish_gpu(args, results, systems, cfg, row, device, dtype, equal[0])


def profiles(systems, batch, device, cfg):
    """The profile of one step of each of our systems that runs."""
    out = {}
    for s in systems:
        if s.key.startswith("ours") and not s.status:
            out[s.key] = profile_step(s, batch, device, cfg)
            print_profile(s.label, out[s.key])
    return out


def finish_gpu(args, results, systems, cfg, row, device, dtype, batch):
    """--profile, then --memory (with our QLoRA model alone), then the JSON file."""
    if args.profile:
        results["profile"] = profiles(systems, batch, device, cfg)
    if args.memory:
        qlora = [s for s in systems if s.key == "ours-qlora" and not s.status]
        systems.clear()  # the other systems' models go (the caller holds no other reference), so QLoRA runs alone
        free_cache(device)
        if qlora:
            results["memory"] = memory_rows(qlora[0], cfg, row, device, dtype)
            print_memory(qlora[0].label, row, results["memory"])
        else:
            print("\n--memory: our QLoRA system did not run")
    atomic.write_json(args.out, results)
    inside = os.path.abspath(args.out).startswith(REPO + os.sep)
    print(f"\nraw results: {os.path.relpath(args.out, REPO) if inside else args.out}")


def cpu_kind() -> str:
    """What this CPU has for bf16 matmuls, from its flags: AMX, AVX512-BF16, or neither (bf16 emulated on AVX2)."""
    flags = next((s.split(":", 1)[1].split() for s in open("/proc/cpuinfo") if s.startswith("flags")), [])
    kinds = (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"), ("avx2", "AVX2 only, no native bf16"))
    return next((name for flag, name in kinds if flag in flags), "no AVX2")


def bench_first_run(repeat=1):
    """`python bench.py first-run`: the default `python train.py` in a fresh process as a newcomer runs it (a fresh
    token cache and out_dir), `repeat` times: wall time, steps, validation loss before and after, peak RSS, the
    precision "auto" chose; and the one-time conversion of the GGUF weights that comes before a newcomer's first run."""
    from support import gguf_files

    print(f"CPU: {cpu_name()} ({cpu_kind()}), {os.cpu_count()} cores; torch {torch.__version__}")
    os.makedirs(os.path.join(OUT_DIR, "logs"), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=OUT_DIR) as tmp:
        start = time.perf_counter()
        gguf_files.convert_gguf(gguf_files.smollm2_gguf_path(), os.path.join(tmp, "smollm2"))
        print(f"converting SmolLM2 from GGUF (once, before the first run): {time.perf_counter() - start:.1f} s")
        rows = []
        for r in range(repeat):
            out, log = os.path.join(tmp, f"run{r}"), os.path.join(OUT_DIR, "logs", f"first-run-{r}.log")
            rc, rss, wall = run_child(["train.py", f"--out_dir={out}", f"--cache_dir={out}/cache"], log)
            if rc != 0:
                raise SystemExit(f"error: python train.py failed (exit code {rc}); see {log}")
            text = open(log).read()
            history = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
            vals = [h["val_loss"] for h in history if "val_loss" in h]
            steps = max(h["step"] for h in history)
            precision = re.search(r"precision auto: (\w+)", text)
            similarity = re.findall(r"training \(similarity ([\d.]+)\)", text)
            rows.append([f"{wall:.0f} s", steps, f"{vals[0]:.3f} -> {vals[-1]:.3f}", " -> ".join(similarity),
                         fmt_gb(rss), precision[1] if precision else "?"])  # fmt: skip
    print_table(["wall time", "steps", "val loss", "sample similarity", "peak RSS", "precision"], rows)


def bench_pack(n=75_000, context=2048):
    """A Magicoder-OSS-Instruct-sized JSONL (problem -> solution pairs cut from stdlib code and docstrings), tokenized
    and packed with the SmolLM2 chat template, then built a second time from the token cache."""
    from support import gguf_files

    path = os.path.join(OUT_DIR, f"magicoder{n // 1000}k.jsonl")
    if not os.path.exists(path):
        examples = stdlib_examples("train")
        os.makedirs(OUT_DIR, exist_ok=True)
        lines = []
        for i in range(n):  # Magicoder's problems and solutions run to a few hundred tokens each
            a, b = examples[i % len(examples)], examples[(7 * i + 1) % len(examples)]
            row = {"problem": f"{i}: " + a["instruction"], "solution": a["response"] + b["response"]}
            lines.append(json.dumps(row) + "\n")
        atomic.atomic_write(path, lambda tmp: Path(tmp).write_text("".join(lines)))
    tok = Tokenizer(gguf_files.smollm2_dir())
    with tempfile.TemporaryDirectory(dir=OUT_DIR) as cache:
        for label in ("first run (tokenize + pack)", "second run (cache hit)"):
            t = time.perf_counter()
            ds = build_dataset(path, tok, context, cache_dir=cache)
            print(f"{label}: {time.perf_counter() - t:.1f} s")
    print(ds.report())


def gpu_arguments(sub):
    g = sub.add_parser("gpu", help="ours (LoRA, QLoRA) vs transformers + PEFT on a random Llama, in one process")
    g.add_argument(
        "--shape", choices=list(SHAPES), default="8b", help="8b, 3b, 1b (Llama 3.x) or tiny (CPU smoke test)"
    )
    g.add_argument("--row", type=int, default=0, help="tokens per row (default: 8192; 256 for tiny)")
    g.add_argument("--rows", type=int, default=1, help="rows per step, one micro-batch (default 1)")
    g.add_argument("--warmup", type=int, default=2, help="steps per system left out of the statistics (default 2)")
    g.add_argument("--rounds", type=int, default=8, help="measured steps per system, interleaved (default 8)")
    g.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {', '.join(SYSTEMS)}")
    g.add_argument("--device", default="auto", help="auto (CUDA when available), cuda, cuda:N or cpu")
    g.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="auto: bf16 on a GPU, the faster of bf16 and fp32 on CPU (train.pick_precision)",
    )
    g.add_argument("--compile", action="store_true", help="torch.compile our blocks (compilation is in the warm-up)")
    g.add_argument("--memory", action="store_true", help="QLoRA peak memory at 1, 2, 4 rows, checkpointing off/on")
    g.add_argument("--profile", action="store_true", help="the kernels of one step of ours (torch.profiler)")
    g.add_argument("--out", default=os.path.join(OUT_DIR, "gpu.json"), help="raw results (default out/bench/gpu.json)")
    return g


def check_gpu_arguments(parser, args):
    if args.warmup < 1 or args.rounds < 1:
        parser.error("--warmup and --rounds must be at least 1 (the first step allocates the optimizer state)")
    if unknown := set(args.systems.split(",")) - set(SYSTEMS):
        parser.error(f"--systems: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SYSTEMS)}")
    if args.rows < 1 or args.row < 0:
        parser.error("--rows must be at least 1 and --row positive")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{gpu,quant,train,pack,first-run}")
    gpu_arguments(sub)
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
    sub.add_parser("pack", help="tokenizing and packing 75,000 Magicoder-sized examples, then the cache hit")
    f = sub.add_parser("first-run", help="the default python train.py as a newcomer runs it: wall time, losses, memory")
    f.add_argument("--repeat", type=int, default=1, help="runs, one after the other (default 1)")
    p = sub.add_parser("peer")  # one transformers + PEFT run, started by `train` in a child process
    p.add_argument("--data", default="", help="JSONL of equal-work examples; '' = the stdlib dataset")
    p.add_argument("--train_on_prompt", action="store_true")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--nf4", action="store_true", help="bitsandbytes NF4 base weights (QLoRA)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", required=True, help="JSON file for the per-step records")
    args = parser.parse_args()
    if args.command == "gpu":
        check_gpu_arguments(parser, args)
        bench_gpu(args)
    elif args.command == "quant":
        bench_quant(args.size, args.repeat, args.smollm2)
    elif args.command == "pack":
        bench_pack()
    elif args.command == "first-run":
        bench_first_run(args.repeat)
    elif args.command == "train":
        if args.steps <= args.warmup or args.repeat < 1:
            parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}); --repeat must be at least 1")
        if args.tables:
            print_tables(json.load(open(os.path.join(OUT_DIR, "results.json"))))
        else:
            bench_train(args.steps, args.warmup, args.only, args.repeat)
    else:
        run_peer(args.data, args.train_on_prompt, args.precision, args.nf4, args.steps, args.out)


if __name__ == "__main__":
    main()
