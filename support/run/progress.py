"""What does a run tell its user while it trains, and where else do its records go?

Before the first step: its data (the packing report; with --preview the first examples and their checks), how a step
is split, the memory estimate by part and what MFU is measured against, and the NF4 quantization error. Every step: a
progress bar with loss, lr, rates, MFU and phase times; after step 2, the measured peak memory beside the estimate. At
every evaluation: each adapter's size relative to its layer and the share of B that has moved from zero. With `log`,
every record of metrics.jsonl also goes to TensorBoard or W&B (rank 0 only).
"""

import dataclasses
import itertools
import math
import netrc
import os
import time

import torch

import lora
import quant
from support.accounting import memory
from support.accounting.flops import batch_flops, fmt_flops, peak_flops
from support.data.examples import selected
from support.data.preview import check_examples, packing_report, preview
from support.kernels.choice import name
from support.run import ranks


class PhaseClock:
    """Seconds spent in named phases of a step: CUDA events on a GPU, read after the step's last kernel (the host runs
    ahead of the GPU), time.perf_counter on CPU. mark(phase) ends `phase` at this point."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.marks = []
        self.mark(None)

    def mark(self, phase):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((phase, event))
        else:
            self.marks.append((phase, time.perf_counter()))

    def seconds(self) -> dict:
        if self.cuda:
            self.marks[-1][1].synchronize()
        out = {}
        for (_, start), (phase, end) in itertools.pairwise(self.marks):
            out[phase] = out.get(phase, 0.0) + (start.elapsed_time(end) / 1000 if self.cuda else end - start)
        return out


def data_report(cfg, trainset, data, tok):
    """What a run prints about its training data: the packing report; with --preview also the first examples of `data`
    that trainset holds, as the model will see them, then the checks over every one."""
    print(packing_report(trainset))
    if not cfg.preview:
        return
    examples = list(selected(data, trainset.kept, cfg.data_format, cfg.skip_bad_rows))  # the files read again
    seen = dict(template=cfg.template or None, train_on_prompt=cfg.train_on_prompt, skip_bad_rows=cfg.skip_bad_rows)
    print(preview(examples, tok, **seen))
    warnings = check_examples(examples, tok, **seen)
    print(f"{len(warnings)} warning(s) over all {len(examples)} training examples")
    for w in warnings[:20]:
        print(f"warning: {w}")


def describe_step(cfg, place, model, context, rows, micro_rows) -> tuple[int, float]:
    """Print how a step is split, the memory estimate by part and what MFU is measured against; returns (estimated
    bytes, the peak FLOP/s MFU divides by)."""
    parts = memory.run_estimate(cfg, model.config, micro_rows * context, place, model.options.mlp_tile * micro_rows)
    peak, source = peak_flops(place.device, place.dtype)
    if ranks.is_sharded(model):  # every rank says what it holds: its shard
        held, whole = ranks.resident_bytes(model)
        print(f"FSDP: rank {place.rank} holds {memory.fmt(held)} of the model's {memory.fmt(whole)} of parameters")
    if place.main:
        print(
            f"batch: {rows * place.world} rows x {context} tokens per step = {place.world} rank(s) x "
            f"{math.ceil(rows / micro_rows)} micro-batch(es) x {micro_rows} rows"
        )
        by_part = ", ".join(f"{k} {memory.fmt(v)}" for k, v in parts.items())
        if model.options.mlp_tile:
            print(f"MLP in tiles of {model.options.mlp_tile} tokens of each row, recomputed in backward")
        print(f"memory estimate {memory.fmt(sum(parts.values()))}: {by_part}")
        print(f"MFU is measured against a {source} {name(place.dtype)} peak of {fmt_flops(peak)}")
    return sum(parts.values()), peak


def adapters_line(model, r, linears) -> str:
    trainable, total = lora.count_parameters(model)
    return f"LoRA r={r} on {linears} linears: {trainable:,} trainable of {total:,} parameters ({trainable / total:.3%})"


def nf4_error(model) -> dict | None:
    """Print and return the NF4 quantization error ||W - dequant(W)|| / ||W|| quant.quantize_ recorded on the layers it
    quantized: {"layers", "mean", "worst", "worst_layer"}, or None when there are none."""
    errors = {
        n: m.rel_error for n, m in model.named_modules() if isinstance(m, quant.NF4Linear) and m.rel_error is not None
    }
    if not errors:
        return None
    worst = max(errors, key=errors.get)
    summary = dict(layers=len(errors), mean=sum(errors.values()) / len(errors), worst=errors[worst], worst_layer=worst)
    print(
        f"NF4 quantization error ||W - W_nf4|| / ||W|| over {len(errors)} linears: mean "
        f"{summary['mean']:.4f}, worst {summary['worst']:.4f} ({worst})"
    )
    return summary


@torch.no_grad()
def adapter_health(model):
    """{module: (||scale * B A|| / ||W||, share of B's entries that moved from zero)}, Frobenius norms. ||B A||^2 =
    trace((B^T B)(A A^T)), an (r, r) product: no (out, in) matrix is formed; ||W|| (frozen) is kept on the module."""
    health = {}
    for module, m in lora.lora_modules(model).items():
        if not hasattr(m, "base_norm"):
            m.base_norm = float((m.dequantize() if isinstance(m, quant.NF4Linear) else m.weight).float().norm())
        a, b = m.lora_A.weight.float(), m.lora_B.weight.float()
        delta = m.scaling * float(torch.trace((b.t() @ b) @ (a @ a.t())).clamp(min=0).sqrt())
        health[module] = (delta / max(m.base_norm, 1e-30), float((b != 0).float().mean()))
    return health


def sharded_adapter_health(model) -> dict:
    """adapter_health of a model sharded with FSDP2, each block gathered on every rank in turn, then the root's own
    adapters (an adapted lm_head)."""
    health = {}
    for i, block in enumerate(model.model.layers):
        block.unshard()
        health |= {f"model.layers.{i}.{n}": h for n, h in adapter_health(block).items()}
        block.reshard()
    outside = {n: m for n, m in lora.lora_modules(model).items() if not n.startswith("model.layers.")}
    if outside:
        model.unshard()
        health |= {n: adapter_health(m)[""] for n, m in outside.items()}
        model.reshard()
    return health


def adapter_record(model, step, bar, main=True) -> dict:
    """{"adapters": health} for the step's record, and one line, with a warning when no B has moved. Every rank of a
    sharded model computes it; rank 0 writes."""
    health = sharded_adapter_health(model) if ranks.is_sharded(model) else adapter_health(model)
    updates = {n: u for n, (u, _) in health.items()}
    moved = sum(m for _, m in health.values()) / len(health)
    worst = max(updates, key=updates.get)
    mean = sum(updates.values()) / len(updates)
    if main:
        bar.write(
            f"adapters at step {step}: ||scale B A|| / ||W|| mean {mean:.2e}, largest "
            f"{updates[worst]:.2e} ({worst}); {100 * moved:.1f}% of B moved from zero"
        )
    if main and moved == 0:
        bar.write(
            f"warning: every LoRA B is still zero after {step} steps: the adapters are not training "
            "(no gradient reaches them: frozen by mistake, or cut off, e.g. by checkpointing inputs that need no grad)"
        )
    return {"adapters": dict(update=updates, mean=mean, b_moved=moved)}


def step_line(record) -> str:
    """The progress bar's line for a train.py step."""
    val = f" val {record['val_loss']:.3f}" if "val_loss" in record else ""
    return (
        f"loss {record['loss']:.3f} lr {record['lr']:.1e} tok/s {record['tokens_per_s']:.0f} sup/s "
        f"{record['supervised_per_s']:.0f} mfu {100 * record['mfu']:.1f}% fwd/bwd/opt "
        f"{record['fwd_s']:.2f}/{record['bwd_s']:.2f}/{record['opt_s']:.2f}s{val}"
    )


def rl_step_line(record) -> str:
    """The progress bar's line for an rl.py step: the reward with the audit's count beside it."""
    reward = f"reward {record['reward']:.2f} (audit {record['audit']})"
    line = f"{reward} no-signal {record['no_signal']:.2f} loss {record['loss']:.4f}"
    return f"{line} gen {record['generated_per_s']:.0f} tok/s"


def rollout_record(answers, generate_s, reward_s) -> dict:
    """A rollout's answer lengths (tokens; answers: their ids) and rates."""
    lengths = [len(a) for a in answers]
    record = {"answer_tokens": sum(lengths) / len(lengths), "answer_tokens_max": max(lengths)}
    return record | {"generate_s": generate_s, "reward_s": reward_s, "generated_per_s": sum(lengths) / generate_s}


def with_rates(record, batch, seconds, place, config, peak_flops) -> dict:
    """A step's record with its rates: tokens/s (all ranks), supervised tokens/s (in place of the count), this rank's
    model FLOPs and MFU over this rank's device."""
    flops = batch_flops(config, batch["position_ids"])
    rates = dict(tokens_per_s=batch["input_ids"].numel() * place.world / seconds, flops=flops)
    rates |= dict(supervised_per_s=record["supervised"] / seconds, mfu=flops / seconds / peak_flops)
    return {k: v for k, v in record.items() if k != "supervised"} | rates


def print_peak(place):
    print(f"peak {'RSS' if place.device.type == 'cpu' else 'GPU memory'}: {memory.fmt(memory.peak(place.device))}")


def open_tracker(cfg):
    if not cfg.log:
        return None
    return TensorBoard(cfg) if cfg.log == "tensorboard" else WandB(cfg)


def numbers(record, prefix="") -> dict:
    """{"a/b": number} for every number in a nested record (booleans and text left out)."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out |= numbers(value, f"{prefix}{key}/")
        elif isinstance(value, int | float) and not isinstance(value, bool) and key != "step":
            out[prefix + key] = value
    return out


def sample_text(sample) -> str:
    return f"prompt:\n{sample['prompt']}\n\nanswer:\n{sample['answer']}"


def has_api_key() -> bool:
    """Whether W&B has an API key: WANDB_API_KEY, or the one `wandb login` keeps in ~/.netrc."""
    try:
        return bool(os.environ.get("WANDB_API_KEY") or netrc.netrc().authenticators("api.wandb.ai"))
    except (OSError, netrc.NetrcParseError):
        return False


class TensorBoard:
    def __init__(self, cfg):
        from torch.utils.tensorboard import SummaryWriter

        started = time.strftime("%Y%m%d-%H%M%S")  # a run of its own per launch: a resumed one does not overwrite
        self.writer = SummaryWriter(log_dir=os.path.join(cfg.out_dir, "tensorboard", started))

    def log(self, record):
        step = record["step"]
        for tag, value in numbers(record).items():
            self.writer.add_scalar(tag, value, step, new_style=True, double_precision=True)
        for i, sample in enumerate(record.get("samples", [])):
            self.writer.add_text(f"samples/{i}", sample_text(sample), step)
        self.writer.flush()

    def close(self):
        self.writer.close()


class WandB:
    def __init__(self, cfg):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if has_api_key() else "offline")
        self.wandb, self.samples = wandb, []
        # W&B's own environment wins where set: wandb.init's arguments would override WANDB_PROJECT and WANDB_DIR
        project, folder = os.environ.get("WANDB_PROJECT") or "nanoqlora", os.environ.get("WANDB_DIR") or cfg.out_dir
        self.run = wandb.init(project=project, dir=folder, config=dataclasses.asdict(cfg), mode=mode)

    def log(self, record):
        data = numbers(record)
        if "samples" in record:
            self.samples += [[record["step"], s["prompt"], s["answer"]] for s in record["samples"]]
            data["samples"] = self.wandb.Table(columns=["step", "prompt", "answer"], data=self.samples)
        self.run.log(data, step=record["step"])

    def close(self):
        self.run.finish()
