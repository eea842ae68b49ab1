"""What do the benchmarks share? Where they write, how they time, print and compare, and what machine they ran on.

Systems run interleaved (A, B, A, B, ...) and each ratio is the median of the per-round ratios (median_ratio), so a
shared machine's drift stays out of it. The peers (transformers + PEFT) train on our batches, converted by hf_batch.
"""

import importlib.metadata
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

from support.accounting import memory
from support.kernels import choice

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(REPO, "out", "bench")
SEED = 1337  # train.Config's seed (data order, LoRA init)
LORA = dict(r=16, alpha=32.0, dropout=0.05)  # every benchmark's adapters (train.Config's), on every block linear


def timed(fn, *args, **kwargs):
    """{"texts": fn(*args, **kwargs), "seconds": how long it took} (the keys of bench.py humaneval's saved phases)."""
    start = time.perf_counter()
    texts = fn(*args, **kwargs)
    return {"texts": texts, "seconds": time.perf_counter() - start}


def best_time(fn, repeat):
    """Seconds of the fastest of `repeat` calls, after one warm-up call (lazy tables, first allocations)."""
    fn()
    return min(timed(fn)["seconds"] for _ in range(repeat))


def print_table(headers, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=True)]
    for row in [headers, ["-" * w for w in widths], *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)))


def fmt_gb(n):
    return f"{n / 2**30:.2f} GiB"


def cpu_name() -> str:
    return choice.cpuinfo_value(("model name",)) or "unknown"


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
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    versions |= package_versions(("transformers", "peft", "bitsandbytes"))
    ram = round(psutil.virtual_memory().total / 2**30, 1)
    return dict(cpu=cpu_name(), cores=os.cpu_count(), threads=torch.get_num_threads(), ram_gib=ram, **versions)


def run_child_ok(argv, log_path, what, with_workers=False):
    """(peak RSS bytes, wall seconds) of `python argv...`, the benchmark stopped (child_failed) when the child fails.
    The peak is the child's own VmHWM, read from /proc while it runs (wait4's ru_maxrss would include this process's
    own high-water mark, which Linux carries across fork and exec); with_workers: plus the peaks of the processes it
    starts (an upper bound)."""
    start = time.perf_counter()
    peaks, pid = run_watched([sys.executable, *argv], log_path, what, descendants=with_workers)
    peak = sum(peaks.values()) if with_workers else peaks.get(pid, 0)
    return peak, time.perf_counter() - start


def run_records(out_dir) -> list[dict]:
    """The records of a finished run's out_dir/metrics.jsonl, in order ([] where it wrote none)."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def child_failed(what, code, log_path):
    """Stop the benchmark: `what` failed with exit code `code`; the end of its log says why."""
    raise SystemExit(f"error: {what} failed (exit code {code}); see {log_path}:\n{Path(log_path).read_text()[-3000:]}")


def run_two_ranks(argv, log_path, what, env=None):
    """{pid: peak RSS bytes} of the processes `torchrun --nproc_per_node=2 argv...` starts; child_failed if it fails."""
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}", *argv]
    peaks, pid = run_watched(ranks, log_path, what, env, descendants=True)
    peaks.pop(pid, None)  # torchrun itself
    return peaks


def run_watched(cmd, log_path, what, env=None, descendants=False):
    """({pid: peak RSS bytes (VmHWM)} of `cmd`'s process, and with `descendants` of every process it starts, polled
    until it exits; its pid): `cmd` run in the repository, its output to log_path; child_failed if it fails."""
    peaks = {}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            try:
                watched = [proc, *(psutil.Process(proc.pid).children(recursive=True) if descendants else [])]
            except psutil.NoSuchProcess:  # it exited since the poll
                break
            for p in watched:
                peaks[p.pid] = max(peaks.get(p.pid, 0), memory.vm_hwm(p.pid))
            time.sleep(0.05)
    if proc.returncode:
        child_failed(what, proc.returncode, log_path)
    return peaks, proc.pid


def median_ratio(pairs):
    """The median, lowest and highest of a / b over (a, b) pairs measured together, or None without pairs."""
    ratios = [a / b for a, b in pairs]
    return dict(median=statistics.median(ratios), low=min(ratios), high=max(ratios), n=len(ratios)) if ratios else None


def hf_batch(batch):
    """Our batch -> transformers' causal-LM inputs: our pre-shifted labels move one place right (transformers shifts
    them itself); one example per row, so the padding is the second run of positions from 0 (attention mask 0)."""
    mask = ((batch["position_ids"] == 0).cumsum(1) == 1).long()  # (rows, width)
    return dict(input_ids=batch["input_ids"], attention_mask=mask, labels=shifted_labels(batch))


def hf_packed_batch(batch):
    """Our packed batch -> transformers' inputs as TRL's padding-free collator makes them: the rows laid end to end in
    one (flash-attn's path in transformers looks for documents only in a batch of one row), no attention mask, labels
    moved one place right per row as in hf_batch (a document's first token then has -100: nothing predicts it across
    a boundary), and the position ids, from which transformers finds where documents start."""
    inputs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=shifted_labels(batch))
    return {k: v.reshape(1, -1) for k, v in inputs.items()}


def shifted_labels(batch):
    """Our pre-shifted labels (rows, width) one place right, as transformers' loss expects them (-100 first)."""
    labels = torch.full_like(batch["labels"], -100)
    labels[:, 1:] = batch["labels"][:, :-1]
    return labels


def nf4_config(compute_dtype):
    """The peers' QLoRA: bitsandbytes NF4 with double quantization, computing in `compute_dtype`."""
    import transformers

    return transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def peft_lora(model, lr):
    """(PEFT model in training mode, its trainable parameters, fused AdamW as the Trainer's default): LORA on
    "all-linear" of a transformers model, adapters in fp32 (PEFT's autocast_adapter_dtype)."""
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
    return model, params, torch.optim.AdamW(params, lr=lr, fused=True)


def random_model_dir(out, smollm2_dir, dtype=torch.float32, device="cpu", **shape):
    """A random Llama of the given shape with SmolLM2's vocabulary, tokenizer files and chat template, written as a
    Hugging Face directory in `dtype` (weights N(0, 0.02), norms at 1: a model with sane logits), built on `device`."""
    from safetensors.torch import save_file

    from model import Llama
    from support.formats.hf import config_json, from_hf, read_config, to_hf

    os.makedirs(out, exist_ok=True)
    cfg = from_hf({**to_hf(read_config(smollm2_dir)[0]), **shape})
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    state = {k: v.contiguous().cpu() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        del state["lm_head.weight"]
    save_file(state, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config_json(cfg, dtype), f)
    for name in os.listdir(smollm2_dir):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            shutil.copy(os.path.join(smollm2_dir, name), out)
    return str(out)
