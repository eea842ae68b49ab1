"""How fast does ours train on CPU against transformers + PEFT, and what does each optimization buy?

`python bench.py train`: every configuration is a fresh child process (its peak RSS is its own VmHWM): ours is `python
train.py --key=value ...` (step times from metrics.jsonl), the peer `python bench.py peer ...` (run_peer) on the very
batches train.py builds. Two workloads of 4 x 512 tokens a step: padded (equal work: compare tokens/s) and stdlib (each
system's natural batching: compare supervised tokens/s); then the optimization ladder (LADDER). docs/performance.md
gives the method and the numbers.
"""

import hashlib
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import pack
from benchmarks.common import (
    LORA,
    OUT_DIR,
    REPO,
    SEED,
    fmt_gb,
    hf_batch,
    machine,
    median_ratio,
    nf4_config,
    peft_lora,
    print_table,
    run_child,
)
from support.accounting.flops import batch_flops, flops_per_token, matmul_peak
from support.data.examples import load_examples, stdlib_examples
from support.data.token_cache import tokenize_cached
from support.data.tokenizer import Tokenizer
from support.formats import atomic, gguf_read, hf

ROWS, CONTEXT = 4, 512  # 4 x 512 tokens per optimizer step
CACHE_DIR = "data/cache"  # train.Config's tokenized-data cache


def write_padded_jsonl(path, tok, cache_dir=CACHE_DIR, min_tokens=CONTEXT):
    """The equal-work data: the stdlib functions whose chat-formatted example has at least `min_tokens` tokens, one
    {"instruction", "response"} per line; truncated to CONTEXT, each fills a row."""
    examples = stdlib_examples("train")
    offsets = tokenize_cached(pack.tokenize_chunk, examples, tok, cache_dir, train_on_prompt=True)["offsets"]
    long = [ex for ex, n in zip(examples, offsets[1:] - offsets[:-1], strict=True) if n >= min_tokens]
    lines = [json.dumps({"instruction": ex["instruction"], "response": ex["response"]}) + "\n" for ex in long]
    atomic.atomic_write(path, lambda tmp: Path(tmp).write_text("".join(lines)))
    return len(long)


def peer_dataset(data, tok, train_on_prompt, cache_dir=CACHE_DIR):
    """The dataset train.py builds with pack=False for `data` ("" = the stdlib dataset) as both training and validation
    file, so nothing is held out."""
    examples = load_examples(data) if data else stdlib_examples("train")
    kw = dict(pack=False, train_on_prompt=train_on_prompt, seed=SEED, cache_dir=cache_dir)
    return pack.build_dataset(examples, tok, CONTEXT, **kw)


def batch_hash(batch) -> str:
    h = hashlib.sha256()
    for k in ("input_ids", "labels", "position_ids"):
        h.update(batch[k].numpy().tobytes())
    return h.hexdigest()[:16]


def run_peer(data, train_on_prompt, precision, nf4, steps, out):
    """`steps` optimizer steps of transformers + PEFT LoRA on our batches; the per-step records and the first batch's
    hash go to the JSON file `out`."""
    import transformers

    model_dir = gguf_read.smollm2_dir()
    config = hf.read_config(model_dir)[0]
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    ds = peer_dataset(data, Tokenizer(model_dir), train_on_prompt)
    kw = dict(device_map="cpu", quantization_config=nf4_config(torch.bfloat16)) if nf4 else {}
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype, **kw)
    model, params, opt = peft_lora(model, lr=1e-3)  # adapters in fp32 over a bf16 base
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
        flops = batch_flops(config, batch["position_ids"])  # its padding run counted as a document: it is computed
        records.append(dict(time=dt, tokens=batch["input_ids"].numel(), supervised=sup, flops=flops, loss=loss.item()))
        print(f"step {step + 1}: loss {loss.item():.4f}, {dt:.2f}s, {records[-1]['tokens']} tokens, {sup} supervised")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"peak RSS: {rss / 2**30:.2f} GiB")
    atomic.write_json(out, dict(steps=records, first_batch=first, trainable=sum(p.numel() for p in params)))


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
    common = dict(
        model=gguf_read.smollm2_dir(),
        context_length=CONTEXT,
        batch_tokens=ROWS * CONTEXT,
        micro_batch_tokens=ROWS * CONTEXT,
        lora_r=LORA["r"],
        lora_alpha=LORA["alpha"],
        lora_dropout=LORA["dropout"],
        lora_targets="all-linear",
        optimizer="adamw",
        activation_checkpointing=False,
        chunked_loss=True,
        seed=SEED,
        eval_every=0,
        save_every=0,
        eval_samples=0,
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
            sup = m["supervised_per_s"] * dt
            records.append(dict(time=dt, tokens=ROWS * CONTEXT, supervised=sup, flops=m["flops"], loss=m["loss"]))
    return result | dict(steps=records)


def summarize(results, warmup, peak):
    """Median step time, tokens and supervised tokens per second and MFU over the measured steps of one or more runs
    of a configuration; a step under half the median tokens/s is a hiccup of the machine, left out and counted."""
    steps = [s for r in results for s in r["steps"][warmup:]]
    typical = statistics.median(s["tokens"] / s["time"] for s in steps)
    kept = [s for s in steps if s["tokens"] / s["time"] >= typical / 2]
    total = sum(s["time"] for s in kept)
    tokens, sup = sum(s["tokens"] for s in kept), sum(s["supervised"] for s in kept)
    return dict(
        step_s=statistics.median(s["time"] for s in steps),
        tokens_per_s=tokens / total,
        supervised_per_s=sup / total,
        mfu=sum(s["flops"] for s in kept) / total / peak,
        loss_step1=results[0]["steps"][0]["loss"],
        hiccups=len(steps) - len(kept),
    )


def merge_repeats(results):
    """{name: entry}: the summary over a configuration's successful repeats, the highest peak RSS, and a summary per
    round (runs from before --repeat existed are round 0)."""
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
        args = (results["warmup"], results["peaks"][entry["precision"]])
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


def print_saved_tables():
    """`bench.py train --tables`: the tables of out/bench/results.json again."""
    print_tables(json.load(open(os.path.join(OUT_DIR, "results.json"))))


def rate_cells(s):
    """A summary's step seconds, tokens/s, supervised tokens/s and MFU, as the tables print them."""
    return f"{s['step_s']:.2f}", f"{s['tokens_per_s']:.0f}", f"{s['supervised_per_s']:.0f}", f"{100 * s['mfu']:.1f}%"


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
    return (name, r["system"], precision, *rate_cells(s), fmt_gb(r["peak_rss"]), ratio)


def print_compare(by):
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
        rows.append((label, *rate_cells(s), fmt_gb(r["peak_rss"]), f"{gain['median']:.2f}x" if gain else ""))
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
    os.makedirs(os.path.join(OUT_DIR, "logs"), exist_ok=True)
    model_dir = gguf_read.smollm2_dir()
    config, _ = hf.read_config(model_dir)
    padded = os.path.join(OUT_DIR, "padded512.jsonl")
    n_long = write_padded_jsonl(padded, Tokenizer(model_dir))
    runs = select_runs(plan(padded), only) if only else plan(padded)
    info = machine()
    cpu = torch.device("cpu")  # train.py's CPU peak, timed longer
    peaks = {"fp32": matmul_peak(cpu, torch.float32, 1.5), "bf16": matmul_peak(cpu, torch.bfloat16, 1.5)}
    print(
        f"{info['cpu']}, {info['cores']} cores ({info['threads']} torch threads), {info['ram_gib']} GiB RAM; python "
        f"{info['python']}, torch {info['torch']}, transformers {info['transformers']}, peft {info['peft']}, "
        f"bitsandbytes {info['bitsandbytes']}"
    )
    print(f"matmul peak: fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s")
    flops = flops_per_token(config, CONTEXT)
    print(f"model FLOPs per token of a {CONTEXT}-token document (LoRA step): {flops / 1e9:.3f} GFLOP")
    print(f"padded workload: {n_long} stdlib functions of at least {CONTEXT} tokens; {steps} steps, {warmup} warm-up")
    command = "python bench.py train" + "".join(f" {a}" for a in sys.argv[2:])
    results = dict(command=command, machine=info, peaks=peaks, steps=steps, warmup=warmup)
    results |= dict(repeat=repeat, runs=[])
    with tempfile.TemporaryDirectory(dir=OUT_DIR) as work:
        for k in range(repeat):  # rounds: every configuration once per round, so the pairs alternate A, B, A, B
            for i, run in enumerate(runs, 1):
                r = dict(name=run["name"], system=run["system"], precision=run["precision"], label=run.get("label"))
                r |= dict(repeat=k) | execute(run, steps, work, k)
                done = f"[{k * len(runs) + i}/{repeat * len(runs)}]"
                print(f"{done} {run['name']}: {progress(r, warmup, peaks)}", flush=True)
                results["runs"].append(r)
                atomic.write_json(os.path.join(OUT_DIR, "results.json"), results)
    print_tables(results)
    print(f"\nraw results: {os.path.relpath(os.path.join(OUT_DIR, 'results.json'), REPO)}")


def progress(r, warmup, peaks):
    """One line on a finished run."""
    if "error" in r:
        return f"FAILED ({r['error']}); see {r['log']} (wall {r['wall_s']:.0f} s)"
    s = summarize([r], warmup, peaks[r["precision"]])
    done = f"{s['step_s']:.2f} s/step, {s['tokens_per_s']:.0f} tokens/s, {s['supervised_per_s']:.0f} supervised/s"
    return done + f", peak RSS {fmt_gb(r['peak_rss'])} (wall {r['wall_s']:.0f} s)"
