"""train.py: the plain QLoRA fine-tuning loop, end to end.

    python train.py                                 # SmolLM2-135M on stdlib code
    python train.py configs/magicoder.py --lr=1e-4  # a config file, then flags
    python train.py configs/tiny.py --resume        # on from out_dir/checkpoint.pt
    python train.py configs/qwen.py --preview       # the first examples, then stop
    python train.py configs/magicoder.py --plan=L4  # what fits a 24 GB card
    torchrun --nproc_per_node=2 train.py ...        # data parallel

Read top to bottom, in the order a run happens:
1. Config. Each setting is a field, declared once: its default, what it allows, whether
   --resume must match.
2. Data (pack.py). Examples are chat-formatted, tokenized with their loss masks and packed
   into rows of context_length tokens; position_ids restart at each document.
3. Model (model.py, quant.py, lora.py). The Llama is built on the meta device, its linears
   quantized to NF4 as the checkpoint is read; the chosen ones get fp32 low-rank adapters, the
   only parameters that require grad.
4. Optimizer. AdamW over the adapters; warmup, then cosine decay.
5. The step: batch_tokens tokens, in micro-batches and, under torchrun, across ranks. The loss
   is summed over supervised tokens and divided by their count in the whole step, so that
   accumulation and data parallelism give one big batch's gradient:
       grad = sum over micro-batches and ranks of d(loss_i) / N_sup
   Precision: bf16 autocast, fp32 adapters; fp16 and a loss scaler on older GPUs; fp32 on a
   CPU without bf16.
6. The loop (support/run/lifecycle.py): evaluate, log and save once in a while; at the end
   the PEFT adapter, a loss plot, an answer before and after; a merged model or a GGUF.
The rest is in support/, one question per file (docs/internals.md), one line each here.
"""

import dataclasses
import itertools
import math
import sys
import time
from dataclasses import dataclass

import support.run.threads  # noqa: F401 (first: how idle threads wait)

# isort: split
import torch
import torch.distributed as dist

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
from support.run import config, lifecycle, progress, ranks, run_dir, stopping
from support.run.config import setting


@dataclass
class Common:
    """The settings of train.py and rl.py alike."""

    # --- model and data ---
    model: str = setting("", resume=True)  # HF model dir or Hub id; "" = SmolLM2-135M
    data: str = setting("", resume=True)  # JSONL, JSON, Parquet or Hub id; "" = stdlib
    max_examples: int = setting(0, config.ALL, resume=True)  # read at most this many
    template: str = setting("", config.TEMPLATE, resume=True)  # "" = chat template
    context_length: int | str = setting(256, config.auto_or_at_least(16), resume=True)  # or "auto"
    # --- QLoRA ---
    quantize: bool = setting(True, resume=True)  # NF4 base (QLoRA); False: 16-bit
    lora_r: int = setting(16, config.integer_at_least(1), resume=True)  # adapter rank
    lora_alpha: float = setting(32.0, config.above(0), resume=True)  # scale = alpha / r
    lora_targets: str = setting("all-linear", config.TARGETS, resume=True)  # or "q_proj,v_proj"
    use_rslora: bool = setting(False, resume=True)  # scale = alpha / sqrt(r)
    # --- optimisation ---
    max_steps: int = setting(24, config.at_least(1))  # optimizer steps
    micro_batch_tokens: int | str = setting("auto", config.auto_or_at_least(1))  # per forward
    lr: float = setting(1e-3, config.above(0), resume=True)  # peak learning rate
    min_lr_ratio: float = setting(0.1, config.within(0, 1, "[]"))  # cosine ends at lr * this
    warmup_steps: int = setting(2, config.at_least(0))  # linear warmup steps
    weight_decay: float = setting(0.0, config.at_least(0), resume=True)
    beta1: float = setting(0.9, config.within(0, 1), resume=True)
    beta2: float = setting(0.999, config.within(0, 1), resume=True)
    optimizer: str = setting("adamw", config.OPTIMIZERS, resume=True)  # 8-bit: bitsandbytes
    grad_clip: float = setting(1.0, config.at_least(0, " (0 = off)"))  # max gradient norm
    precision: str = setting("auto", ("auto", "bf16", "fp16", "fp32"))
    tf32: bool = setting(False)  # CUDA fp32 matmuls in TF32
    activation_checkpointing: bool = setting(False)  # recompute blocks in backward
    offload_checkpoints: bool = setting(False)  # their inputs in CPU memory
    seed: int = setting(1337, resume=True)  # data order, adapter init, dropout
    # --- evaluation, logging, checkpoints ---
    eval_every: int = setting(12, config.NEVER)  # evaluate every N steps and at the end
    save_every: int = setting(12, config.at_least(0, " (0 = at the end only)"))
    out_dir: str = setting("out")  # adapter, checkpoint, metrics.jsonl, loss.png
    resume: bool = setting(False)  # continue from out_dir/checkpoint.pt
    overwrite: bool = setting(False)  # replace the run in out_dir
    sample_tokens: int = setting(96, config.at_least(1))  # max new tokens of an answer
    eval_task: str = setting("", config.TASK)  # "humaneval", "easy" or a problems JSONL
    eval_task_at: str = setting("evals", ("evals", "ends"))  # or first and last only
    eval_task_problems: int = setting(0, config.ALL)  # only its first N problems
    eval_task_samples: int = setting(1, config.integer_at_least(1))  # k > 1: pass@k too
    eval_task_temperature: float = setting(0.8, config.above(0))  # of those k answers
    eval_task_unconfined: bool = setting(False)  # Python guards alone, no Landlock
    log: str = setting("", ("", "tensorboard", "wandb"))  # also to TensorBoard or W&B
    export_merged: bool = setting(False)  # also out_dir/merged, in the run's dtype
    export_gguf: str = setting("", config.GGUF_TYPES)  # also out_dir/model-<type>.gguf
    cache_dir: str = setting("data/cache")  # tokenized data, the parsed stdlib
    device: str = setting("auto", ("auto", "cpu", "cuda"))
    rank_timeout: float = setting(30.0, config.above(0))  # minutes a rank waits for another

    def adapters(self, dropout=0.0) -> dict:
        """The LoRA settings, as lora.add_lora_ and memory.estimate take them."""
        targets = self.lora_targets
        targets = targets if targets == "all-linear" else targets.split(",")
        scale = dict(r=self.lora_r, alpha=self.lora_alpha, use_rslora=self.use_rslora)
        return dict(targets=targets, dropout=dropout, **scale)


@dataclass
class Config(Common):
    """train.py's own settings."""

    # --- data ---
    data_format: str = setting("auto", config.FORMATS, resume=True)
    val_data: str = setting("", resume=True)  # "" = hold out val_fraction of data
    val_fraction: float = setting(0.02, config.within(0, 1, "()"), resume=True)
    train_on_prompt: bool = setting(False, resume=True)  # supervise prompts too
    truncate: bool = setting(True, resume=True)  # cut long examples (False: drop)
    skip_bad_rows: bool = setting(False, resume=True)  # skip and count bad rows
    pack: bool = setting(True, resume=True)  # False: one example per row, padded
    pad_to_max: bool = setting(False)  # unpacked rows padded to context_length
    # --- the step ---
    lora_dropout: float = setting(0.05, config.within(0, 1))  # on the adapter branch only
    batch_tokens: int = setting(512, config.at_least(1), resume=True)  # per step, all ranks
    compile: bool | str = setting("auto", config.AUTO_BOOL)  # torch.compile blocks; auto: long CUDA runs
    mlp_tile_tokens: int | str = setting("auto", config.auto_or_at_least(0))  # MLP tiles
    chunked_loss: bool = setting(True)  # lm_head + loss in chunks
    # --- evaluation, what to print ---
    eval_rows: int = setting(8, config.ALL)  # validation rows per evaluation
    eval_samples: int = setting(1, config.at_least(0, " (0 = none)"))  # prompts answered
    preview: bool = setting(False)  # print the first examples, tokenized; stop
    plan: str = setting("")  # print what fits a GPU ("H100", "24GB"); stop
    # --- ranks ---
    parallel: str = setting("ddp", ("ddp", "fsdp"))  # replicate, or shard (FSDP2)
    cpu_offload: bool = setting(False)  # fsdp: shards in CPU memory between uses


# ----------------------------------------------------------------------------- data
def build_data(cfg: Config, tok, files, max_positions: int, place: ranks.Placement):
    """Examples -> (training, validation) packed datasets, and the first eval_samples held-out
    examples that render: the prompts evaluations answer."""
    train_data, val_data = examples.sources(files, cfg.cache_dir)  # val_data None: held out of train_data
    tokenize = dict(template=cfg.template or None, train_on_prompt=cfg.train_on_prompt)
    tokenize |= dict(fmt=cfg.data_format, skip_bad_rows=cfg.skip_bad_rows, cache_dir=cfg.cache_dir)
    train_stream = pack.tokenized(train_data, tok, **tokenize)
    val_stream = None if val_data is None else pack.tokenized(val_data, tok, **tokenize)
    train_kept, val_kept = examples.split(cfg, train_stream, val_stream)  # index masks
    common = dict(pack=cfg.pack, truncate=cfg.truncate, pad_to_max=cfg.pad_to_max, seed=cfg.seed)
    common["max_context"] = max_positions
    context = cfg.context_length
    trainset = pack.build_dataset(train_stream, tok, context, kept=train_kept, **common)
    context = trainset.context_length
    valset = pack.build_dataset(val_stream or train_stream, tok, context, kept=val_kept, **common)
    if place.main:  # the packing report (--preview: also the first examples, checked)
        progress.data_report(cfg, trainset, train_data, tok)
    fmt = (cfg.data_format, cfg.skip_bad_rows)
    held_out = examples.selected(val_data or train_data, valset.kept, *fmt)  # read again
    rendered = (ex for ex in held_out if renders(ex, tok, cfg.template or None))
    return trainset, valset, list(itertools.islice(rendered, cfg.eval_samples))


# ----------------------------------------------------------------------------- model
def load_model(
    model_dir, dtype=None, device="cpu", quantize=False, add_lora=None, adapter=None, options=None, shard=None
):
    """The QLoRA recipe, step by step, never holding the whole 16-bit model. add_lora: lora.add_lora_'s
    keywords, or adapter: a saved PEFT adapter; shard: FSDP's mesh and policy (support/run/ranks.py)."""
    device = torch.device(device)
    architecture, stored = hf.read_config(model_dir)
    dtype = dtype or stored or torch.float32
    # 1. The Llama on the meta device: shapes, no memory; its kernels chosen once, here.
    compiled = options is not None and options.compile
    kernels = choice.kernels_for(device, dtype, architecture, compiled=compiled)
    with torch.device("meta"):
        model = Llama(architecture, kernels.attention, options)
    ckpt, weights = hf.open_checkpoint(model_dir, model)
    nf4 = list(find_linears(model)) if quantize or hf.is_prequantized(ckpt) else []
    ckpt, weights = ranks.what_this_rank_reads(model, ckpt, weights, device, shard)  # rank 0's
    adapters = add_lora or (hf.adapter_settings(adapter, model) if adapter else None)
    adapted = list(find_linears(model, adapters["targets"])) if adapters else []
    lora_kw = {k: v for k, v in (adapters or {}).items() if k != "targets"}
    lora_kw["dropout_op"] = kernels.dropout
    model.requires_grad_(False)
    # 2-4 block by block, then the rest (embeddings, norm, lm_head):
    # a sharded run holds one part whole at most.
    for prefix, part in [*((f"model.layers.{i}.", b) for i, b in enumerate(model.model.layers)), ("", model)]:
        # 2. Its linears become NF4, one 16-bit weight read at a time.
        quant.quantize_(model, of_part(nf4, prefix), dtype, device, weights, kernels.dequantize)
        # 3. The rest of it (norms; at the end embeddings, lm_head).
        hf.load_weights_(model, ckpt, dtype, device, within=prefix)
        # 4. LoRA's A and B beside its chosen linears.
        if adapters:
            lora.add_lora_(model, of_part(adapted, prefix), **lora_kw)
        ranks.shard_part(part, shard)  # sharded: this rank keeps its shard
    if adapters:
        line = progress.adapters_line(model, adapters["r"], len(adapted))
        print(line + ranks.sharded_over(shard))
    if adapter:
        hf.load_adapter_(model, adapter)
    return model


def of_part(names, prefix):
    """The names inside the block `prefix` ("model.layers.3."); prefix "": outside every block."""
    return [n for n in names if (n.startswith(prefix) if prefix else not n.startswith("model.layers."))]


def build_model(cfg: Config, place: ranks.Placement, model_dir: str, mlp_tile: int):
    """The run's QLoRA (or LoRA) model: fp32 adapters, its Options, sharded when parallel=fsdp."""
    torch.manual_seed(cfg.seed)  # the same adapter init on every rank
    chunk = LOSS_CHUNK if cfg.chunked_loss else 0
    ckpt = (cfg.activation_checkpointing, cfg.offload_checkpoints)
    tokens = cfg.max_steps * cfg.batch_tokens
    compiled = choice.compile_pays(cfg.compile, place.device, tokens, sharded=cfg.parallel == "fsdp")
    options = Options(*ckpt, mlp_tile, chunk, compiled)
    shard = ranks.sharding(place.device, place.world, cfg.cpu_offload) if cfg.parallel == "fsdp" else None
    adapters = cfg.adapters(cfg.lora_dropout) | dict(lora_dtype=torch.float32)
    return load_model(model_dir, place.dtype, place.device, cfg.quantize, adapters, options=options, shard=shard)


def build(cfg: Config, place: ranks.Placement, model_dir: str, architecture, context: int):
    """The model, with MLP tiles if a row of `context` tokens needs them, and its optimizer."""
    mlp_tile = mlp_tile_tokens(cfg, place, architecture, context)  # 0 unless needed
    model = build_model(cfg, place, model_dir, mlp_tile)
    params = [p for p in model.parameters() if p.requires_grad]
    return model, make_optimizer(cfg, params, place.device)


# ----------------------------------------------------------------------------- optimizer
def make_optimizer(cfg: Common, params, device):
    """AdamW: fused on CUDA, foreach on CPU; or bitsandbytes' 8-bit AdamW (paged: its state may
    spill to the host)."""
    kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
    cuda = device.type == "cuda"
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, **kw, fused=cuda, foreach=not cuda or None)
    if cfg.optimizer == "paged_adamw8bit" and not cuda:
        raise ValueError("optimizer: paged_adamw8bit needs CUDA; use adamw8bit or adamw on CPU")
    import bitsandbytes as bnb

    if cfg.optimizer == "paged_adamw8bit":
        return bnb.optim.PagedAdamW8bit(params, **kw)
    return bnb.optim.AdamW8bit(params, **kw)


def learning_rate(cfg: Common, step: int) -> float:
    """Step `step`'s learning rate: linear warmup over warmup_steps, then cosine decay to lr *
    min_lr_ratio at max_steps. A function of the step, like the data and the dropout: a resumed
    run takes up its schedule."""
    if step < cfg.warmup_steps:
        return cfg.lr * ((step + 1) / cfg.warmup_steps)
    done = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, done)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


# ----------------------------------------------------------------------------- the step
def forward_loss(model, batch, place: ranks.Placement):
    """(summed loss, supervised tokens) of one micro-batch, under autocast."""
    with place.autocast():
        keys = ("input_ids", "position_ids", "labels")
        ids, pos, labels = (batch[k].to(place.device) for k in keys)
        return model(ids, pos, labels=labels)


def train_step(model, opt, scaler, batch, micro_rows, step, cfg, place) -> dict:
    """Step `step` on this rank's rows: forward and backward per micro-batch, the loss over the
    step's supervised-token count, gradients summed over ranks, clipping, and the update unless
    loss or gradient is not finite. Returns its record."""
    params = [p for group in opt.param_groups for p in group["params"]]
    rows = len(batch["labels"])
    n_sup = (batch["labels"] != -100).sum().to(place.device, torch.float32)
    if place.world > 1:
        dist.all_reduce(n_sup)  # on `device`: NCCL reduces only CUDA tensors
    clock = progress.PhaseClock(place.device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=place.device)
    for i in range(0, rows, micro_rows):
        b = {k: v[i : i + micro_rows] for k, v in batch.items()}
        first = place.rank * rows + i  # its first row in the step's global batch
        rows_of_b = range(first, first + len(b["labels"]))
        last = i + micro_rows >= rows
        ranks.sync_gradients(model, last)  # sharded: reduce-scatter after the last
        # dropout: a function of (seed, step, global row) only
        with lora.row_dropout(model, cfg.seed, step, rows_of_b, place.device):
            loss, _ = forward_loss(model, b, place)
            clock.mark("fwd_s")
            scaler.scale(loss / n_sup.clamp(min=1)).backward()
        clock.mark("bwd_s")
        loss_sum += loss.detach().double()
    if place.world > 1 and not ranks.is_sharded(model):  # sharded: reduced already
        sum_gradients(params)
    if place.world > 1:
        dist.all_reduce(loss_sum)
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or math.inf)
    record = {"loss": loss_sum.item() / max(1.0, n_sup.item()), "grad_norm": float(ranks.full(norm))}
    record["supervised"] = n_sup.item()
    if stopping.finite(record, scaler):  # else never applied; the loop stops
        scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    clock.mark("opt_s")
    return record | clock.seconds()


def sum_gradients(params):
    """Data parallel by hand: one all-reduce sums the adapters' gradients, each already divided by
    the global count: the step's gradient on any number of ranks (torch's DDP averages)."""
    flat = torch.cat([p.grad.flatten() for p in params])
    dist.all_reduce(flat)
    for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
        p.grad.copy_(g.view_as(p))


# ----------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(model, valset, rows: int, micro_rows: int, place: ranks.Placement) -> float:
    """Mean loss per supervised token over the first `rows` validation rows (0 = all),
    `micro_rows` rows a forward (the training micro-batch)."""
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    end = min(rows or len(valset), len(valset))
    for i in range(0, end, micro_rows):
        batch = valset.collate(range(i, min(i + micro_rows, end)))
        loss, n = forward_loss(model, batch, place)
        total += loss.double().cpu()
        count += n
    model.train()
    return total.item() / max(1, count)


def evaluation_record(run, data) -> dict:
    """Validation loss, answers to the held-out prompts, eval_task's pass@1 when due, adapter health
    (support/evaluation/humaneval.py, support/run/progress.py). Sharded: every rank computes."""
    cfg = run.cfg
    place = run.place
    if not (place.main or ranks.is_sharded(run.model)):
        return {}
    val_loss = evaluate(run.model, data.valset, cfg.eval_rows, data.micro_rows, place)
    record = {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50))}
    record |= humaneval.generated(cfg, run.model, run.tok, data.prompts, run.task, place.autocast, run.step)
    if run.step:
        record |= progress.adapter_record(run.model, run.step, run.bar, place.main)
    return record


# ----------------------------------------------------------------------------- the run
@dataclass
class Data:
    """What train.py's steps read, beside the run (lifecycle.Run)."""

    trainset: pack.PackedDataset
    valset: pack.PackedDataset
    prompts: list  # the held-out examples every evaluation answers
    rows: int  # this rank's rows per optimizer step
    micro_rows: int  # rows per forward/backward
    peak_flops: float  # FLOP/s of this device: MFU's denominator


def train(cfg: Config) -> list[dict]:
    """Fine-tune as `cfg` says; returns the metrics history. --plan and --preview stop after
    printing, before any model is loaded."""
    config.check_config(cfg, config.train_conflicts(cfg))
    task = humaneval.task_problems(cfg)  # a bad eval_task file fails first
    model_dir = run_dir.find_model(cfg, only_config=bool(cfg.plan))
    architecture = hf.read_config(model_dir)[0]
    if cfg.plan:  # for the machine it names, not this one
        print(plan_for(cfg, architecture))
        return []
    files = run_dir.data_files(cfg)
    if not cfg.preview:
        cfg = dataclasses.replace(cfg, out_dir=run_dir.claim_out_dir(cfg))
    place = ranks.setup(cfg, shard=cfg.parallel == "fsdp")
    tok = Tokenizer(model_dir)
    max_positions = architecture.max_position_embeddings
    trainset, valset, prompts = build_data(cfg, tok, files, max_positions, place)
    rows = ranks.rows_per_rank(cfg.batch_tokens, trainset.context_length, place.world)
    if cfg.preview:
        return []
    context = trainset.context_length
    run = lifecycle.open_run(
        cfg, place, tok, model_dir, task, lambda p: build(cfg, p, model_dir, architecture, context)
    )
    micro_rows = micro_batch_rows(cfg, place, run.model, trainset, rows, forward_loss)
    micro_rows = ranks.reduce_min(micro_rows, place.world, place.device)  # fits every rank
    run.estimated, peak_flops = progress.describe_step(cfg, place, run.model, context, rows, micro_rows)
    data = Data(trainset, valset, prompts, rows, micro_rows, peak_flops)
    if not lifecycle.resume(run):
        first_records(run, data)
    loop(run, data)
    return lifecycle.close_run(run, prompts)


def first_records(run, data):
    """A fresh run's first records: NF4's quantization error and the step-0 evaluation."""
    if run.place.main and (errors := progress.nf4_error(run.model)):
        lifecycle.keep(run, {"step": 0, "nf4_error": errors})
    if run.cfg.eval_every and (record := evaluation_record(run, data)):
        lifecycle.keep(run, {"step": 0} | record)
        if run.place.main:
            print(f"step 0: val loss {record['val_loss']:.4f}")


def loop(run, data):
    """Steps from run.step to max_steps, each followed by what is due once in a while. Ctrl-C
    stops after the step under way, with its checkpoint; twice, at once. No evaluation once
    stopping: torchrun kills its workers 30 s after a Ctrl-C."""
    with lifecycle.steps(run) as stop_asked:
        while run.step < run.cfg.max_steps and not stop_asked():
            record = optimizer_step(run, data)
            if lifecycle.evaluation_due(run) and not stop_asked():
                record |= evaluation_record(run, data)
            lifecycle.end_step(run, record, progress.step_line(record))
    lifecycle.end_loop(run)


def optimizer_step(run, data) -> dict:
    """Step run.step at the schedule's learning rate; its record, with rates."""
    start = time.perf_counter()
    step = run.step
    place = run.place
    batch = data.trainset.step_batch(step, data.rows, place.rank, place.world)
    lr = learning_rate(run.cfg, step)
    for group in run.opt.param_groups:
        group["lr"] = lr
    args = (batch, data.micro_rows, step, run.cfg, place)
    record = {"step": step + 1, "lr": lr} | train_step(run.model, run.opt, run.scaler, *args)
    stopping.stop_unless_finite(run, record)
    run.step = step + 1
    seconds = time.perf_counter() - start
    return progress.with_rates(record, batch, seconds, place, run.model.config, data.peak_flops)


def main(argv=None):
    """The command: config files and --key=value flags; a mistake ends every rank in one line."""
    argv = sys.argv[1:] if argv is None else argv
    ranks.one_line_errors(lambda: train(config.load_config(Config, argv)))


if __name__ == "__main__":
    main()
