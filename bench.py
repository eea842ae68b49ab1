"""Benchmarks. Speed is measured here and printed as tables, never asserted in tests.

    python bench.py quant              NF4 quantize / dequantize throughput on CPU, ours vs bitsandbytes (4096 x 4096)
    python bench.py quant --smollm2    plus SmolLM2-135M load times: quantize 16-bit weights vs load pre-quantized
    python bench.py train              training speed and memory: ours vs transformers + PEFT, and the optimization
                                       ladder (SmolLM2-135M, 4 x 512 tokens per step; about 25 minutes on 2 cores)
    python bench.py train --only=padded-fp32,ladder --steps=6      pieces of it
    python bench.py train --tables     print the tables of out/bench/results.json again
    python bench.py pack               tokenize + pack 75,000 Magicoder-sized examples, then again from the cache

Quant timings are the best of --repeat runs after one warm-up run; the machine's other load shows up as noise.

The training benchmark
----------------------
Every configuration runs in a fresh child process, so its peak RSS (ru_maxrss from os.wait4, the same measure for
both systems) is its own. Ours is `python train.py --key=value ...`; its per-step times come from metrics.jsonl. The
peer is `python bench.py peer ...`: transformers' LlamaForCausalLM from the same converted SmolLM2 directory, PEFT LoRA
(r=16, alpha=32, dropout 0.05, target_modules="all-linear"), AdamW as transformers' Trainer picks it (fused), gradient
clipping at 1.0 (both), and batches built by pack.py exactly as train.py builds them (tests/test_bench.py proves both
the identity of the token tensors and that the peer's labels and attention mask give our loss). Precision is the same
on both sides: fp32 everywhere, or bf16 base weights + fp32 LoRA parameters under torch.autocast(bf16); the peer's
QLoRA is bitsandbytes NF4 with double quantization and bf16 compute.

Two workloads, 4 x 512 tokens per optimizer step:
- padded: long standard-library functions, each truncated to 512 tokens, every token supervised, one per row. Both
  systems see the very same (4, 512) tensors: equal work, so tokens/s compares compute efficiency.
- stdlib: the real variable-length stdlib dataset with each system's natural batching: packed rows for us, one example
  per row padded to the longest of the 4 for the peer (its default SFT collator). Only supervised tokens/s is a fair
  comparison there, as padding counts as tokens processed.

Per run: N steps; the first `--warmup` are dropped. Step time is the median of the rest; token rates are the tokens of
those steps over their total time, leaving out any step under half the median tokens/s (a hiccup of the shared
machine; such steps are counted and named). MFU = model FLOPs per token (train.py's formula: 4N for a frozen-base
LoRA step plus causal attention at 512 tokens) x tokens/s / the matmul peak measured here for the precision in use.
"""

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import hf
from examples import load_examples, stdlib_examples
from model import flops_per_token
from pack import build_dataset, tokenize_cached
from tokenizer import Tokenizer

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
    import convert
    import quant

    load = lambda path: hf.load_model(path, torch.bfloat16, quantize=True)  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        dense, prequantized = os.path.join(tmp, "bf16"), os.path.join(tmp, "nf4")
        convert.convert_gguf(convert.smollm2_gguf_path(), dense, dtype=torch.bfloat16)
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


def matmul_peak(dtype, n=2048, seconds=1.5) -> float:
    """FLOP/s of an n x n @ n x n matmul in `dtype`: the best of three timed windows after a warm-up."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    best = 0.0
    for _ in range(3):
        start, k = time.perf_counter(), 0
        while (elapsed := time.perf_counter() - start) < seconds / 3:
            a @ b
            k += 1
        best = max(best, 2 * n**3 * k / elapsed)
    return best


def machine() -> dict:
    import psutil

    cpu = next((s.split(":", 1)[1].strip() for s in open("/proc/cpuinfo") if s.startswith("model name")), "unknown")
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    versions |= {name: importlib.metadata.version(name) for name in ("transformers", "peft", "bitsandbytes")}
    return dict(
        cpu=cpu,
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
    hf.atomic_write(path, lambda tmp: Path(tmp).write_text("".join(lines)))
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

    import convert

    model_dir = convert.smollm2_dir()
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
    hf.write_json(out, dict(steps=records, first_batch=first, trainable=sum(p.numel() for p in params)))


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
    import convert

    model_dir = convert.smollm2_dir()
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
    """(exit code, peak RSS bytes, wall seconds) of `python argv...`, stdout and stderr to log_path."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss * 1024, time.perf_counter() - start


def execute(run, steps, work):
    """Run one configuration; its per-step records: seconds, tokens, supervised tokens, loss."""
    out = os.path.join(work, run["name"].replace("/", "-"))
    os.makedirs(out, exist_ok=True)
    log = os.path.join(OUT_DIR, "logs", run["name"].replace("/", "-") + ".log")
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


def summarize(result, warmup, flops_per_token, peak):
    """Median step time; tokens and supervised tokens per second over the measured steps; MFU. A step whose tokens/s
    is under half the median is a hiccup of the shared machine, not of the system, and is left out (and counted)."""
    steps = result["steps"][warmup:]
    typical = statistics.median(s["tokens"] / s["time"] for s in steps)
    kept = [s for s in steps if s["tokens"] / s["time"] >= typical / 2]
    total = sum(s["time"] for s in kept)
    tokens, sup = sum(s["tokens"] for s in kept), sum(s["supervised"] for s in kept)
    return dict(
        step_s=statistics.median(s["time"] for s in steps),
        tokens_per_s=tokens / total,
        supervised_per_s=sup / total,
        mfu=flops_per_token * tokens / total / peak,
        loss_step1=result["steps"][0]["loss"],
        hiccups=len(steps) - len(kept),
    )


def fmt_gb(n):
    return f"{n / 2**30:.2f} GiB"


def print_tables(results):
    for r in results["runs"]:
        if "error" not in r:
            peak = results["peaks"][r["precision"]]
            r["summary"] = summarize(r, results["warmup"], results["flops_per_token"], peak)
    by = {r["name"]: r for r in results["runs"]}
    print_compare(by)
    print_ladder(by)
    hiccups = [
        f"{r['name']} ({r['summary']['hiccups']})" for r in results["runs"] if r.get("summary", {}).get("hiccups")
    ]
    if hiccups:
        print(f"\nsteps left out as machine hiccups (under half the median tokens/s): {', '.join(hiccups)}")


def print_compare(by):
    """The ours-vs-peer table from the runs by name."""
    rows = []
    for name, data, *_ in COMPARE:
        for system in ("peer", "ours"):
            r = by.get(f"{name}/{system}")
            if r is None:
                continue
            if "error" in r:
                rows.append((name, r["system"], r["precision"], "failed: " + r["error"], "", "", "", "", ""))
                continue
            s, p = r["summary"], by.get(f"{name}/peer", {}).get("summary")
            key = "tokens_per_s" if data == "padded" else "supervised_per_s"
            ratio = ""
            if system == "ours" and p:
                ratio = f"{s[key] / p[key]:.2f}x / {r['peak_rss'] / by[f'{name}/peer']['peak_rss']:.2f}x"
            rows.append(
                (
                    name,
                    r["system"],
                    r["precision"] + (" NF4" if name.endswith("nf4") else ""),
                    f"{s['step_s']:.2f}",
                    f"{s['tokens_per_s']:.0f}",
                    f"{s['supervised_per_s']:.0f}",
                    f"{100 * s['mfu']:.1f}%",
                    fmt_gb(r["peak_rss"]),
                    ratio,
                )
            )
    if rows:
        print("\nours vs transformers + PEFT (LoRA r=16 on all linears, 4 x 512 tokens per step)")
        headers = ["workload", "system", "precision", "step s", "tokens/s", "supervised/s", "MFU", "peak RSS"]
        print_table([*headers, "ours/peer speed / RSS"], rows)
        fp32 = by.get("padded-fp32/peer", {}).get("summary")
        for n, data, precision, _ in COMPARE:
            ours = by.get(f"{n}/ours", {}).get("summary")
            if data == "padded" and precision == "bf16" and ours and fp32:
                print(f"{n}: ours {ours['tokens_per_s'] / fp32['tokens_per_s']:.2f}x the peer's fp32 tokens/s")
        for n, data, *_ in COMPARE:
            ours, peer = by.get(f"{n}/ours", {}), by.get(f"{n}/peer", {})
            if data == "padded" and "summary" in ours and "summary" in peer:
                o, p = ours["summary"]["loss_step1"], peer["summary"]["loss_step1"]
                print(f"{n}: step-1 loss on the identical batch {peer['first_batch']}: ours {o:.5f}, peer {p:.5f}")


def print_ladder(by):
    """The optimization-ladder table from the runs by name."""
    rows, base = [], None
    for i, (label, _) in enumerate(LADDER):
        r = by.get(f"ladder/{i}")
        if r is None:
            continue
        if "error" in r:
            rows.append((label, "failed: " + r["error"], "", "", "", "", ""))
            continue
        s = r["summary"]
        base = base or (s if i == 0 else None)
        gain = f"{s['supervised_per_s'] / base['supervised_per_s']:.2f}x" if base else ""
        rows.append(
            (
                label,
                f"{s['step_s']:.2f}",
                f"{s['tokens_per_s']:.0f}",
                f"{s['supervised_per_s']:.0f}",
                f"{100 * s['mfu']:.1f}%",
                fmt_gb(r["peak_rss"]),
                gain,
            )
        )
    if rows:
        print("\noptimization ladder (ours, stdlib dataset, 4 x 512 tokens per step, each row adds one technique)")
        print_table(
            ["configuration", "step s", "tokens/s", "supervised/s", "MFU", "peak RSS", "supervised/s gain"], rows
        )


def bench_train(steps, warmup, only):
    import convert

    os.makedirs(os.path.join(OUT_DIR, "logs"), exist_ok=True)
    model_dir = convert.smollm2_dir()
    config, _ = hf.read_config(model_dir)
    padded = os.path.join(OUT_DIR, "padded512.jsonl")
    n_long = write_padded_jsonl(padded, Tokenizer(model_dir))
    runs = plan(padded)
    if only:
        names = only.split(",")
        runs = [r for r in runs if any(t in (r["group"], r["name"]) or r["name"].startswith(t + "/") for t in names)]
        if not runs:
            known = ", ".join(["compare", "ladder", *(c[0] for c in COMPARE)])
            raise SystemExit(f"--only={only}: matches no run; use {known}, NAME/ours, NAME/peer or ladder/N")
    info = machine()
    peaks = {"fp32": matmul_peak(torch.float32), "bf16": matmul_peak(torch.bfloat16)}
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
    results["runs"] = []
    with tempfile.TemporaryDirectory(dir=OUT_DIR) as work:
        for k, run in enumerate(runs, 1):
            r = dict(name=run["name"], system=run["system"], precision=run["precision"], label=run.get("label"))
            r |= execute(run, steps, work)
            if "error" not in r:
                r["summary"] = summarize(r, warmup, flops, peaks[run["precision"]])
                s = r["summary"]
                done = f"{s['step_s']:.2f} s/step, {s['tokens_per_s']:.0f} tokens/s, "
                done += f"{s['supervised_per_s']:.0f} supervised/s, peak RSS {fmt_gb(r['peak_rss'])}"
            else:
                done = f"FAILED ({r['error']}); see {r['log']}"
            print(f"[{k}/{len(runs)}] {run['name']}: {done} (wall {r['wall_s']:.0f} s)", flush=True)
            results["runs"].append(r)
            hf.write_json(os.path.join(OUT_DIR, "results.json"), results)
    print_tables(results)
    print(f"\nraw results: {os.path.relpath(os.path.join(OUT_DIR, 'results.json'), REPO)}")


def bench_pack(n=75_000, context=2048):
    """A Magicoder-OSS-Instruct-sized JSONL (problem -> solution pairs cut from stdlib code and docstrings), tokenized
    and packed with the SmolLM2 chat template, then built a second time from the token cache."""
    import convert

    path = os.path.join(OUT_DIR, f"magicoder{n // 1000}k.jsonl")
    if not os.path.exists(path):
        examples = stdlib_examples("train")
        os.makedirs(OUT_DIR, exist_ok=True)
        lines = []
        for i in range(n):  # Magicoder's problems and solutions run to a few hundred tokens each
            a, b = examples[i % len(examples)], examples[(7 * i + 1) % len(examples)]
            row = {"problem": f"{i}: " + a["instruction"], "solution": a["response"] + b["response"]}
            lines.append(json.dumps(row) + "\n")
        hf.atomic_write(path, lambda tmp: Path(tmp).write_text("".join(lines)))
    tok = Tokenizer(convert.smollm2_dir())
    with tempfile.TemporaryDirectory(dir=OUT_DIR) as cache:
        for label in ("first run (tokenize + pack)", "second run (cache hit)"):
            t = time.perf_counter()
            ds = build_dataset(path, tok, context, cache_dir=cache)
            print(f"{label}: {time.perf_counter() - t:.1f} s")
    print(ds.report())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{quant,train,pack}")
    q = sub.add_parser("quant", help="NF4 quantize / dequantize throughput, ours vs bitsandbytes (CPU)")
    q.add_argument("--size", type=int, default=4096, help="the weight is size x size (default 4096)")
    q.add_argument("--repeat", type=int, default=5, help="timed runs per case; the best is reported (default 5)")
    q.add_argument("--smollm2", action="store_true", help="also time SmolLM2-135M loading (quantize vs pre-quantized)")
    t = sub.add_parser("train", help="training speed and memory: ours vs transformers + PEFT, and the ladder")
    t.add_argument("--steps", type=int, default=8, help="optimizer steps per run (default 8)")
    t.add_argument("--warmup", type=int, default=2, help="first steps left out of the statistics (default 2)")
    t.add_argument("--tables", action="store_true", help="only print the tables of out/bench/results.json again")
    t.add_argument("--only", default="", help="comma-separated: compare, ladder, padded-fp32, ..., NAME/ours, ladder/3")
    sub.add_parser("pack", help="tokenizing and packing 75,000 Magicoder-sized examples, then the cache hit")
    p = sub.add_parser("peer")  # one transformers + PEFT run, started by `train` in a child process
    p.add_argument("--data", default="", help="JSONL of equal-work examples; '' = the stdlib dataset")
    p.add_argument("--train_on_prompt", action="store_true")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--nf4", action="store_true", help="bitsandbytes NF4 base weights (QLoRA)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", required=True, help="JSON file for the per-step records")
    args = parser.parse_args()
    if args.command == "quant":
        bench_quant(args.size, args.repeat, args.smollm2)
    elif args.command == "pack":
        bench_pack()
    elif args.command == "train":
        if args.steps <= args.warmup:
            parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
        if args.tables:
            print_tables(json.load(open(os.path.join(OUT_DIR, "results.json"))))
        else:
            bench_train(args.steps, args.warmup, args.only)
    else:
        run_peer(args.data, args.train_on_prompt, args.precision, args.nf4, args.steps, args.out)


if __name__ == "__main__":
    main()
