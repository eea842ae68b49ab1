"""train.py: the plain QLoRA fine-tuning loop, end to end.

    python train.py                                  # the default: SmolLM2-135M on stdlib code, minutes on CPU
    python train.py configs/magicoder.py --lr=1e-4   # a config file plus --key=value overrides
    python train.py configs/tiny.py --resume         # continue step-exactly from out_dir/checkpoint.pt
    python train.py configs/qwen.py --preview        # the first examples as the model sees them, then stop
    python train.py configs/magicoder.py --plan=L4   # what fits a 24 GB card for this model, then stop
    torchrun --nproc_per_node=2 train.py ...         # data parallel (nccl on CUDA, gloo on CPU)

Read top to bottom, in the order a run happens:
1. Config. Each setting is a field below, declared once: its default, what it allows, whether --resume must match.
2. Data (pack.py). Examples are chat-formatted and tokenized with their loss masks, then packed best-fit-decreasing
   into rows of `context_length` tokens whose position_ids restart at every document.
3. Model (model.py, quant.py, lora.py). The Llama is built on the meta device, its block linears quantized to NF4 one
   16-bit weight at a time as the checkpoint is read; the chosen linears get fp32 low-rank adapters, the only
   parameters that require grad.
4. Optimizer. AdamW over the adapters (fused on CUDA, foreach on CPU, or bitsandbytes' 8-bit), linear warmup then
   cosine decay.
5. The step. An optimizer step sees `batch_tokens` tokens, split into micro-batches and, under torchrun, across
   ranks. The loss is summed over supervised tokens and divided by their global count in the step, so accumulation
   and data parallelism give exactly the gradient of one big batch however the supervised tokens fall:
       grad = sum_over_micro_batches_and_ranks( d loss_sum_i ) / N_supervised_global
   Precision: bf16 autocast over 16-bit base weights with fp32 LoRA masters, fp16 with a loss scaler on older GPUs,
   or plain fp32 (what "auto" picks on a CPU that emulates bf16).
6. The loop, with its once-in-a-while blocks: evaluate (validation loss, adapter health), log, save a checkpoint; at
   the end the PEFT adapter, a loss plot, a sample before and after, on request a merged export and a GGUF.

What a step does not need to be understood lives in support/, one question per file, called by one line each
(docs/internals.md lists them); docs/ says what can go wrong and how the whole is proven correct.
"""

import functools
import itertools
import math
import sys
import time
from dataclasses import dataclass, field

import support.run.threads  # noqa: F401 (before torch: how idle threads wait, support/run/threads.py)

# isort: split
import torch
import torch.distributed as dist
from tqdm import tqdm

import lora
import pack
import quant
from model import LOSS_CHUNK, Llama, Options, find_linears
from support.accounting.plan import micro_batch_rows, mlp_tile_tokens, plan_for
from support.data import examples
from support.data.tokenizer import Tokenizer, renders
from support.evaluation import humaneval
from support.formats import hf
from support.kernels import choice
from support.run import progress, ranks, run_dir
from support.run.config import (
    GGUF_TYPES,
    TARGETS,
    TASK,
    TEMPLATE,
    above,
    at_least,
    auto_or_at_least,
    check_config,
    integer_at_least,
    load_config,
    setting,
    within,
)


@dataclass
class Config:
    # --- model and data ---
    model: str = setting("", resume=True)  # HF model dir or Hub id; "" = SmolLM2-135M
    data: str = setting("", resume=True)  # JSONL, JSON or Parquet file, or Hub dataset id; "" = stdlib code
    data_format: str = setting("auto", ("auto", "magicoder", "alpaca", "pairs", "messages"), resume=True)
    val_data: str = setting("", resume=True)  # a validation file; "" = hold out val_fraction of `data`
    val_fraction: float = setting(0.02, within(0, 1, "()"), resume=True)  # share held out when val_data is ""
    max_examples: int = setting(0, at_least(0, " (0 = all)"), resume=True)  # at most this many (0 = all)
    template: str = setting("", TEMPLATE, resume=True)  # "" = the chat template; else "{instruction}...{response}"
    train_on_prompt: bool = setting(False, resume=True)  # also supervise prompt tokens
    context_length: int | str = setting(256, auto_or_at_least(16), resume=True)  # tokens per row, or "auto" (p95)
    truncate: bool = setting(True, resume=True)  # cut examples longer than context_length (False: drop them)
    skip_bad_rows: bool = setting(False, resume=True)  # skip (and count) malformed rows instead of stopping
    pack: bool = setting(True, resume=True)  # sample packing; False = one example per row, padded
    pad_to_max: bool = setting(False)  # with pack=False: pad rows to context_length (the naive baseline)
    # --- QLoRA ---
    quantize: bool = setting(True, resume=True)  # NF4 double-quantized base weights (QLoRA); False = 16-bit (LoRA)
    lora_r: int = setting(16, integer_at_least(1), resume=True)  # adapter rank
    lora_alpha: float = setting(32.0, above(0), resume=True)  # scale = alpha / r (alpha / sqrt(r) with rsLoRA)
    lora_dropout: float = setting(0.05, within(0, 1))  # dropout on the adapter branch only
    lora_targets: str = setting("all-linear", TARGETS, resume=True)  # "all-linear" or names: "q_proj,v_proj"
    use_rslora: bool = setting(False, resume=True)  # rank-stabilised scale alpha / sqrt(r)
    # --- optimisation ---
    max_steps: int = setting(24, at_least(1))  # optimizer steps
    batch_tokens: int = setting(512, at_least(1), resume=True)  # tokens per optimizer step, all ranks
    micro_batch_tokens: int | str = setting("auto", auto_or_at_least(1))  # per forward/backward; "auto" = what fits
    lr: float = setting(1e-3, above(0), resume=True)  # peak learning rate
    min_lr_ratio: float = setting(0.1, within(0, 1, "[]"))  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = setting(2, at_least(0))  # linear warmup steps
    weight_decay: float = setting(0.0, at_least(0), resume=True)  # AdamW weight decay
    beta1: float = setting(0.9, within(0, 1), resume=True)  # AdamW beta1
    beta2: float = setting(0.999, within(0, 1), resume=True)  # AdamW beta2
    optimizer: str = setting("adamw", ("adamw", "adamw8bit", "paged_adamw8bit"), resume=True)  # 8-bit: bitsandbytes
    grad_clip: float = setting(1.0, at_least(0, " (0 = off)"))  # max global gradient norm (0 = off)
    precision: str = setting("auto", ("auto", "bf16", "fp16", "fp32"))  # auto: bf16 (fp16 on old GPUs; CPU: faster)
    tf32: bool = setting(False)  # CUDA fp32 matmuls in TF32 (10-bit mantissa, faster); False: fp32 is fp32
    compile: bool = setting(False)  # torch.compile each block's training forward (slow to start; best on CUDA)
    activation_checkpointing: bool = setting(False)  # recompute each block in backward: less memory
    offload_checkpoints: bool = setting(False)  # checkpointed block inputs in CPU memory (long rows)
    mlp_tile_tokens: int | str = setting("auto", auto_or_at_least(0))  # a row's tokens per MLP tile; auto: if needed
    chunked_loss: bool = setting(True)  # lm_head + cross-entropy in chunks; False = full-vocabulary fp32 logits
    seed: int = setting(1337, resume=True)  # seeds data order, adapter init and dropout
    # --- evaluation, logging, checkpoints ---
    eval_every: int = setting(12, at_least(0, " (0 = never)"))  # validation loss every N steps and at the end
    eval_rows: int = setting(8, at_least(0, " (0 = all)"))  # validation rows per evaluation (0 = all)
    save_every: int = setting(12, at_least(0, " (0 = at the end only)"))  # a resumable checkpoint every N steps
    out_dir: str = setting("out")  # adapter, checkpoint, metrics.jsonl, loss.png
    resume: bool = setting(False)  # continue from out_dir/checkpoint.pt
    preview: bool = setting(False)  # print the data report and the first examples, tokenized; no training
    plan: str = setting("")  # print what fits a GPU ("H100", "24GB") with these settings; no training
    overwrite: bool = setting(False)  # replace a run in out_dir (else a chosen out_dir holding one is refused)
    eval_samples: int = setting(1, at_least(0, " (0 = none)"))  # held-out prompts answered at evaluations
    sample_tokens: int = setting(96, at_least(1))  # max new tokens of each answer
    eval_task: str = setting("", TASK)  # "humaneval" or a problems JSONL: greedy pass@1 at evaluations
    eval_task_at: str = setting("evals", ("evals", "ends"))  # at every evaluation, or the first and last only
    eval_task_problems: int = setting(0, at_least(0, " (0 = all)"))  # only the first N problems of eval_task
    eval_task_unconfined: bool = setting(False)  # eval_task's code under the Python guards alone (no Landlock)
    log: str = setting("", ("", "tensorboard", "wandb"))  # also log to TensorBoard or W&B
    export_merged: bool = setting(False)  # also write the merged model (run's dtype) to out_dir/merged
    export_gguf: str = setting("", GGUF_TYPES)  # also write out_dir/model-<type>.gguf (llama.cpp, Ollama)
    cache_dir: str = setting("data/cache")  # tokenized-data cache
    device: str = setting("auto", ("auto", "cpu", "cuda"))
    parallel: str = setting("ddp", ("ddp", "fsdp"))  # under torchrun: replicate the model, or shard it (FSDP2)
    cpu_offload: bool = setting(False)  # with fsdp: sharded parameters in CPU memory between uses
    rank_timeout: float = setting(30.0, above(0))  # minutes a rank waits in one collective for a stuck one

    def adapters(self) -> dict:
        """The LoRA settings, as lora.add_lora_ and memory.estimate take them."""
        targets = self.lora_targets if self.lora_targets == "all-linear" else self.lora_targets.split(",")
        return dict(targets=targets, r=self.lora_r, alpha=self.lora_alpha, dropout=self.lora_dropout,
                    use_rslora=self.use_rslora)  # fmt: skip


# ----------------------------------------------------------------------------- data
def build_data(cfg: Config, tok, files, max_positions: int, place: ranks.Placement):
    """Examples -> (training, validation) packed datasets, and the first eval_samples held-out examples that render:
    the prompts evaluations answer."""
    train_data, val_data = examples.sources(files)  # val_data None: held out of train_data
    tokenize = dict(template=cfg.template or None, train_on_prompt=cfg.train_on_prompt, cache_dir=cfg.cache_dir,
                    fmt=cfg.data_format, skip_bad_rows=cfg.skip_bad_rows)  # fmt: skip
    train_stream = pack.tokenized(train_data, tok, **tokenize)
    val_stream = None if val_data is None else pack.tokenized(val_data, tok, **tokenize)
    train_kept, val_kept = examples.split(cfg, train_stream, val_stream)  # index masks over the examples read
    common = dict(pack=cfg.pack, truncate=cfg.truncate, pad_to_max=cfg.pad_to_max, seed=cfg.seed,
                  max_context=max_positions)  # fmt: skip
    trainset = pack.build_dataset(train_stream, tok, cfg.context_length, kept=train_kept, **common)
    valset = pack.build_dataset(val_stream or train_stream, tok, trainset.context_length, kept=val_kept, **common)
    if place.main:  # the packing report (--preview: also the first examples, checked)
        progress.data_report(cfg, trainset, train_data, tok)
    held_out = examples.selected(val_data or train_data, valset.kept, cfg.data_format, cfg.skip_bad_rows)  # read again
    rendered = (ex for ex in held_out if renders(ex, tok, cfg.template or None))
    return trainset, valset, list(itertools.islice(rendered, cfg.eval_samples))


# ----------------------------------------------------------------------------- model
def load_model(model_dir: str, dtype=None, device="cpu", quantize=False, add_lora=None, adapter=None, options=None,
               shard=None):  # fmt: skip
    """The QLoRA recipe, step by step, never holding the whole 16-bit model in memory. dtype: of the 16-bit weights and
    the compute (default: config.json's, else fp32); add_lora: lora.add_lora_'s keywords for fresh adapters; adapter: a
    saved PEFT adapter directory instead (support/formats/hf.py); options: how the training forward runs
    (model.Options); shard: FSDP's mesh and policy, to shard each block as it is built (support/run/ranks.py)."""
    device = torch.device(device)
    config, stored = hf.read_config(model_dir)
    dtype = dtype or stored or torch.float32
    # 1. The Llama on the meta device: shapes, no memory. Its kernels for this device are chosen once, here: the
    #    packed-document attention, NF4 dequantization (on CUDA the fastest with the reference's bits), LoRA dropout.
    kernels = choice.kernels_for(device, dtype, config, compiled=options is not None and options.compile)
    with torch.device("meta"):
        model = Llama(config, kernels.attention, options)
    ckpt, weights = hf.open_checkpoint(model_dir, model)
    nf4 = list(find_linears(model)) if quantize or hf.is_prequantized(ckpt) else []
    ckpt, weights = ranks.what_this_rank_reads(model, ckpt, weights, device, shard)  # sharded: rank 0 reads alone
    adapters = add_lora or (hf.adapter_settings(adapter, model) if adapter else None)
    adapted = list(find_linears(model, adapters["targets"])) if adapters else []
    lora_kw = {k: v for k, v in (adapters or {}).items() if k != "targets"} | dict(dropout_op=kernels.dropout)
    model.requires_grad_(False)
    # 2-4 block by block, then the rest (embeddings, norm, lm_head): a sharded run holds one part whole at most.
    for prefix, part in [*((f"model.layers.{i}.", block) for i, block in enumerate(model.model.layers)), ("", model)]:
        # 2. Its linears become NF4: each 16-bit weight read, rounded to `dtype` and quantized, one at a time.
        quant.quantize_(model, of_part(nf4, prefix), dtype, device, weights, kernels.dequantize)
        # 3. The rest of it (norms; at the end embeddings and lm_head), read in `dtype`.
        hf.load_weights_(model, ckpt, dtype, device, within=prefix)
        # 4. LoRA's A and B beside its chosen linears.
        if adapters:
            lora.add_lora_(model, of_part(adapted, prefix), **lora_kw)
        ranks.shard_part(part, shard)  # sharded: this rank keeps only its shard of the part
    if adapters:
        print(progress.adapters_line(model, adapters["r"], len(adapted)) + ranks.sharded_over(shard))
    if adapter:
        hf.load_adapter_(model, adapter)
    return model


def of_part(names, prefix):
    """The module names inside the block `prefix` ("model.layers.3."), or for prefix "" outside every block."""
    return [n for n in names if (n.startswith(prefix) if prefix else not n.startswith("model.layers."))]


def build_model(cfg: Config, place: ranks.Placement, model_dir: str, mlp_tile: int):
    """The run's QLoRA (or LoRA) model: fp32 adapters, sharded when parallel=fsdp, with the run's Options."""
    torch.manual_seed(cfg.seed)  # the same adapter init on every rank
    options = Options(cfg.activation_checkpointing, cfg.offload_checkpoints, mlp_tile,
                      LOSS_CHUNK if cfg.chunked_loss else 0, cfg.compile)  # fmt: skip
    shard = ranks.sharding(place.device, place.world, cfg.cpu_offload) if cfg.parallel == "fsdp" else None
    adapters = cfg.adapters() | dict(lora_dtype=torch.float32)
    return load_model(model_dir, place.dtype, place.device, cfg.quantize, adapters, options=options, shard=shard)


# ----------------------------------------------------------------------------- optimizer
def make_optimizer(cfg: Config, params, device):
    """AdamW: fused on CUDA, foreach on CPU; or bitsandbytes' 8-bit AdamW (paged: its state may spill to the host)."""
    kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, **kw, fused=device.type == "cuda", foreach=device.type != "cuda" or None)
    if cfg.optimizer == "paged_adamw8bit" and device.type != "cuda":
        raise ValueError("optimizer: paged_adamw8bit needs CUDA; use adamw8bit or adamw on CPU")
    import bitsandbytes as bnb

    return (bnb.optim.PagedAdamW8bit if cfg.optimizer == "paged_adamw8bit" else bnb.optim.AdamW8bit)(params, **kw)


def learning_rate(cfg: Config, step: int) -> float:
    """Step `step`'s learning rate: linear warmup over warmup_steps, then cosine decay to lr * min_lr_ratio at
    max_steps. A function of the step, like the data and the dropout: a resumed run takes up its own schedule."""
    if step < cfg.warmup_steps:
        return cfg.lr * ((step + 1) / cfg.warmup_steps)
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


# ----------------------------------------------------------------------------- the step
def forward_loss(model, batch, place: ranks.Placement):
    """(summed loss, supervised tokens) of one micro-batch, under the run's autocast."""
    with place.autocast():
        ids, pos, labels = (batch[k].to(place.device) for k in ("input_ids", "position_ids", "labels"))
        return model(ids, pos, labels=labels)


def train_step(model, opt, scaler, batch, micro_rows, step, cfg: Config, place: ranks.Placement) -> dict:
    """Step `step` on this rank's rows: forward/backward per micro-batch, the loss over the global supervised-token
    count, gradients summed over ranks, clipping, and the update unless loss or gradient is not finite; its record."""
    params = [p for group in opt.param_groups for p in group["params"]]
    rows = len(batch["labels"])
    n_sup = (batch["labels"] != -100).sum().to(place.device, torch.float32)
    if place.world > 1:
        dist.all_reduce(n_sup)  # on `device`: NCCL reduces only CUDA tensors
    clock, loss_sum = progress.PhaseClock(place.device), torch.zeros((), dtype=torch.float64, device=place.device)
    for i in range(0, rows, micro_rows):
        b = {k: v[i : i + micro_rows] for k, v in batch.items()}
        first = place.rank * rows + i  # its first row's index in the step's global batch
        rows_of_b = range(first, first + len(b["labels"]))
        ranks.sync_gradients(model, i + micro_rows >= rows)  # sharded: reduce-scatter after the last only
        with lora.row_dropout(model, cfg.seed, step, rows_of_b, place.device):  # (seed, step, global row) only
            loss, _ = forward_loss(model, b, place)
            clock.mark("fwd_s")
            scaler.scale(loss / n_sup.clamp(min=1)).backward()
        clock.mark("bwd_s")
        loss_sum += loss.detach().double()
    if place.world > 1 and not ranks.is_sharded(model):  # sharded: reduce-scattered already
        # Data parallel by hand, not torch's DDP: the adapters' gradients are a few MB, one all-reduce after the last
        # micro-batch is cheap, and it is the plain sum the global count asks for (DDP averages each bucket in backward
        # and needs no_sync to accumulate); the same sum on any number of ranks makes a resumed run equal.
        flat = torch.cat([p.grad.flatten() for p in params])
        dist.all_reduce(flat)  # summed over ranks: each already divided by the global count
        for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.grad.copy_(g.view_as(p))
    if place.world > 1:
        dist.all_reduce(loss_sum)
    scaler.unscale_(opt)
    norm = float(ranks.full(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or math.inf)))  # clipped or not
    record = {"loss": loss_sum.item() / max(1.0, n_sup.item()), "grad_norm": norm, "supervised": n_sup.item()}
    if run_dir.finite(record, scaler):  # else the update is never applied, and the loop stops
        scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    clock.mark("opt_s")
    return record | clock.seconds()


# ----------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(model, valset, rows: int, micro_rows: int, place: ranks.Placement) -> float:
    """Mean loss per supervised token over the first `rows` validation rows (0 = all), `micro_rows` rows per forward
    (the training micro-batch, which fits)."""
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    end = min(rows or len(valset), len(valset))
    for i in range(0, end, micro_rows):
        loss, n = forward_loss(model, valset.collate(range(i, min(i + micro_rows, end))), place)
        total += loss.double().cpu()
        count += n
    model.train()
    return total.item() / max(1, count)


# ----------------------------------------------------------------------------- the run
@dataclass
class Run:
    """What the loop works with: the model and its optimizer state, the data, and where its records go."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    trainset: pack.PackedDataset
    valset: pack.PackedDataset
    tok: Tokenizer
    prompts: list  # the held-out examples every evaluation answers
    problems: list  # eval_task's problems, [] without one
    rows: int  # this rank's rows per optimizer step
    micro_rows: int  # rows per forward/backward
    estimated: int  # bytes: the memory estimate, checked against the first steps
    peak_flops: float  # FLOP/s of this device: MFU's denominator
    tracker: object = None  # TensorBoard or W&B, on rank 0
    step: int = 0  # optimizer steps taken
    last_saved: int | None = None  # the step of this run's last checkpoint
    history: list = field(default_factory=list)  # rank 0's records: step 0's, then one per step


def train(cfg: Config) -> list[dict]:
    """Fine-tune as `cfg` says; returns the metrics history (step 0's records, then one per step). --plan and
    --preview stop after printing, before any model is loaded."""
    check_config(cfg)
    problems = humaneval.task_problems(cfg)  # a bad eval_task file fails here, before out_dir is claimed
    model_dir, files = run_dir.claim_inputs(cfg)
    architecture = hf.read_config(model_dir)[0]
    if cfg.plan:  # for the machine it names, not this one: no device, no process group
        print(plan_for(cfg, architecture))
        return []
    place = ranks.setup(cfg)
    tok = Tokenizer(model_dir)
    trainset, valset, prompts = build_data(cfg, tok, files, architecture.max_position_embeddings, place)
    rows = ranks.rows_per_rank(cfg.batch_tokens, trainset.context_length, place.world)
    if cfg.preview:
        return []
    dtype = choice.pick_precision(cfg.precision, place.device, architecture, place.main)
    place.dtype = choice.agreed(dtype, place.world, place.device)  # every rank computes in rank 0's choice
    mlp_tile = mlp_tile_tokens(cfg, place, architecture, trainset.context_length)  # 0 unless a row needs it
    model = build_model(cfg, place, model_dir, mlp_tile)
    opt = make_optimizer(cfg, [p for p in model.parameters() if p.requires_grad], place.device)
    scaler = torch.amp.GradScaler("cuda", enabled=place.dtype == torch.float16)
    micro_rows = micro_batch_rows(cfg, place, model, trainset, rows, forward_loss)
    micro_rows = ranks.agreed_min(micro_rows, place.world, place.device)  # the least any rank's memory allows
    estimated, peak_flops = progress.describe_step(cfg, place, model, trainset.context_length, rows, micro_rows)
    run = Run(model, opt, scaler, trainset, valset, tok, prompts, problems, rows, micro_rows, estimated, peak_flops)
    run.tracker = progress.open_tracker(cfg) if place.main else None
    if cfg.resume:  # out_dir's checkpoint and metrics
        run.step, run.history = run_dir.resume(cfg, model, opt, scaler)
        run.last_saved = run.step
    else:
        before_training(cfg, place, run)
    loop(cfg, place, run)
    adapter = {n: ranks.full(p.detach()) for n, p in model.named_parameters() if p.requires_grad}  # gathered if sharded
    if place.main:
        run_dir.write_outputs(cfg, model, tok, prompts, run.history, adapter, model_dir, run.tracker)
        progress.print_peak(place)
    history = run.history
    del run, model, opt  # a sharded model holds the process group until freed
    ranks.end_process_group()
    return history


def evaluation_record(cfg: Config, place: ranks.Placement, run: Run) -> dict:
    """The validation loss, then what the model generates (support/evaluation/humaneval.py: greedy answers to the
    held-out prompts, eval_task's pass@1 when due), for the step's record."""
    val_loss = evaluate(run.model, run.valset, cfg.eval_rows, run.micro_rows, place)
    record = {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50))}
    return record | humaneval.generated(cfg, run.model, run.tok, run.prompts, run.problems, place.autocast, run.step)


def before_training(cfg: Config, place: ranks.Placement, run: Run):
    """A fresh run's first records, on rank 0: NF4's quantization error and the step-0 evaluation (every rank of a
    sharded model evaluates: it computes only when all ranks do)."""
    if place.main and (errors := progress.nf4_error(run.model)):
        run.history.append({"step": 0, "nf4_error": errors})
    if cfg.eval_every and (place.main or ranks.is_sharded(run.model)):
        record = {"step": 0} | evaluation_record(cfg, place, run)
        run.history += [record] if place.main else []
        if place.main:
            print(f"step 0: val loss {record['val_loss']:.4f}")
    for record in run.history if run.tracker else []:
        run.tracker.log(record)


def loop(cfg: Config, place: ranks.Placement, run: Run):
    """Steps from run.step to max_steps. Each turn does what is due once in a while for the step just taken (evaluate,
    show, save), then takes one step. Ctrl-C stops after the step under way, with its checkpoint; twice, at once."""
    first = run.step
    record = None  # the record of the step just taken
    bar = tqdm(total=cfg.max_steps, initial=run.step, disable=not place.main, dynamic_ncols=True)
    with bar, run_dir.stop_requests() as asked, run_dir.abrupt_ends(cfg, run):
        stopping = functools.partial(run_dir.any_rank, asked, place.world, place.device)  # every rank agrees
        progress.reset_peak(place)
        while True:
            # ---------------------------------------------- once in a while, for the step just taken
            if run.step > first:  # no evaluation when stopping: torchrun kills its workers 30 s after Ctrl-C
                due = cfg.eval_every and (run.step % cfg.eval_every == 0 or run.step == cfg.max_steps)
                if due and not stopping() and (place.main or ranks.is_sharded(run.model)):  # sharded: all ranks
                    record |= evaluation_record(cfg, place, run)
                    progress.adapter_report(run.model, record, bar, place.main)
                if place.main:
                    progress.show_step(bar, record, place, run.estimated, cfg.max_steps, run.tracker)
                if cfg.save_every and run.step % cfg.save_every == 0:
                    run.last_saved = run_dir.save(cfg, run.model, run.opt, run.scaler, run.step, run.history,
                                                     place.main)  # fmt: skip
            if run.step >= cfg.max_steps or stopping():  # resumed with a lower max_steps: done
                break
            # ---------------------------------------------- one optimizer step
            record = optimizer_step(cfg, place, run)
    if run.last_saved != run.step:  # before the merged export changes the model
        run_dir.save(cfg, run.model, run.opt, run.scaler, run.step, run.history, place.main)
    if run.step < cfg.max_steps:  # Ctrl-C: stopped between two steps, the checkpoint exactly that step
        if place.main:
            print(f"interrupted: checkpoint at step {run.step} written; continue with --resume --out_dir={cfg.out_dir}")
        raise SystemExit(130)


def optimizer_step(cfg: Config, place: ranks.Placement, run: Run) -> dict:
    """Step run.step at the schedule's learning rate; its record (on rank 0 also in run.history, before any evaluation
    a second Ctrl-C may break into)."""
    start, step = time.perf_counter(), run.step
    batch = run.trainset.step_batch(step, run.rows, place.rank, place.world)
    lr = learning_rate(cfg, step)
    for group in run.opt.param_groups:
        group["lr"] = lr
    record = {"step": step + 1, "lr": lr} | train_step(run.model, run.opt, run.scaler, batch, run.micro_rows, step,
                                                         cfg, place)  # fmt: skip
    if not run_dir.finite(record, run.scaler):
        run_dir.stop_not_finite(cfg, run.history + [record], run.last_saved, place.main)
    run.step = step + 1
    record = progress.with_rates(record, batch, time.perf_counter() - start, place, run.model.config, run.peak_flops)
    if place.main:
        run.history.append(record)
    return record


def main(argv=None):
    """The command: a config file and --key=value flags. A user's mistake, or another rank's, ends every rank in one
    line."""
    ranks.one_line_errors(lambda: train(load_config(Config, sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    main()
