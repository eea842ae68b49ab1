"""What does a run keep in its out_dir, from the claim before any work to what it leaves at the end?

One folder per run, kept whole however the run ends: claimed before any work, checkpointed as it trains (and when it
stops early: Ctrl-C, SIGTERM or a NaN), and holding the outputs at the end (adapter/, loss.png, on request merged/ and
a GGUF). A checkpoint holds every tensor whole, named by its parameter, so a run resumes on any number of ranks, and
is read with weights_only: tensors and plain values, never a pickle that would run code."""

import dataclasses
import difflib
import json
import os
import pickle
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from support.data.tokenizer import render
from support.evaluation import humaneval
from support.evaluation.merge_check import merge_and_check_
from support.formats import gguf_read, gguf_write, hf, hub
from support.formats.atomic import atomic_write
from support.run import ranks
from support.run.config import resume_keys


def find_model(cfg, only_config=False) -> str:
    """The model directory, before any work: a missing model, a context_length beyond the model's positions or a GGUF
    type llama.cpp cannot read fails here. only_config: a plan reads the model's config.json alone."""
    model_dir = hub.model_dir(cfg.model, only_config=only_config) if cfg.model else gguf_read.smollm2_dir()
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"model: {os.path.join(model_dir, 'config.json')} not found (not a model directory)")
    max_positions = hf.read_config(model_dir)[0].max_position_embeddings
    if isinstance(cfg.context_length, int) and cfg.context_length > max_positions:
        raise ValueError(
            f"context_length: {cfg.context_length} is beyond the model's max_position_embeddings {max_positions}"
            " (positions it was never trained on); lower it or use 'auto'"
        )
    if cfg.export_gguf:  # what llama.cpp cannot read is refused now, not after the training
        gguf_write.check_gguf_export(model_dir, cfg.export_gguf)
    return model_dir


def data_files(cfg, keys=("data", "val_data")) -> dict:
    """{key: the files cfg.key names} for each of `keys`, none for "" (the stdlib's); a missing one fails naming key."""
    return {key: hub.data_files(getattr(cfg, key)) if getattr(cfg, key) else [] for key in keys}


def claim_out_dir(cfg) -> str:
    """The folder this run writes to, made sure it may. A run already in out_dir is continued with --resume or
    replaced with --overwrite; otherwise a chosen out_dir is refused and the default one moves on to out-2, out-3..."""
    out_dir = cfg.out_dir
    ckpt = os.path.join(out_dir, "checkpoint.pt")
    if cfg.resume and not os.path.isfile(ckpt):
        raise FileNotFoundError(f"{ckpt}: no checkpoint to resume from")
    if (held := run_files(out_dir)) and not (cfg.resume or cfg.overwrite):
        if out_dir != type(cfg).out_dir:  # a chosen out_dir, not the default
            raise FileExistsError(
                f"out_dir: {out_dir} already holds a run ({held[0]}); continue it with --resume, replace it with "
                "--overwrite, or choose another out_dir"
            )
        n = 2  # the first out-N without a run (every rank of a torchrun finds the same one)
        while run_files(f"{out_dir}-{n}"):
            n += 1
        print(f"out_dir: {out_dir} holds an earlier run, kept as it is; this run writes to {out_dir}-{n}")
        out_dir = f"{out_dir}-{n}"
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".write-test-{os.getpid()}")  # one per process: torchrun's ranks race
        atomic_write(probe, lambda tmp: None)
        os.remove(probe)
    except OSError as e:
        raise PermissionError(f"out_dir: cannot write to '{out_dir}' ({e.strerror})") from None
    return out_dir


def run_files(out_dir) -> list[str]:
    return [p for f in ("checkpoint.pt", "adapter", "metrics.jsonl") if os.path.exists(p := os.path.join(out_dir, f))]


def save_checkpoint(path, model, opt, scaler, step, cfg, main=True):
    """Adapter weights, optimizer and fp16's loss scale, every tensor whole and keyed by its parameter's name (every
    rank calls this, gathering a sharded model; rank 0 writes)."""
    # The adapters alone are gathered here: get_model_state_dict would also gather a frozen tied embedding (its
    # ignore_frozen_params drops a shared parameter under its first name only) and return a replicated NF4 base whole.
    lora_state = {n: ranks.full(p.detach()).clone() for n, p in model.named_parameters() if p.requires_grad}
    fresh = not opt.state  # no update applied yet (fp16's scaler skips steps whose gradients overflow)
    optimizer = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if fresh:  # get_optimizer_state_dict made zero state by a step with lr 0, which AdamW would count: dropped again
        opt.state.clear()
        optimizer["state"] = {}
    if not main:
        return
    state = dict(step=step, lora=lora_state, optimizer=optimizer, scaler=scaler.state_dict(),
                 config=dataclasses.asdict(cfg))  # fmt: skip

    def write(tmp):
        with open(tmp, "wb") as f:  # a file object: torch's zip writer refuses the temp file's dotted name
            torch.save(state, f)

    atomic_write(path, write)


def keyed_by_name(model, opt, saved) -> dict:
    """Optimizer state keyed by parameter name, as checkpoints hold it, from one written before names were used
    (keyed by the position of the optimizer's parameters)."""
    if not all(isinstance(i, int) for g in saved["param_groups"] for i in g["params"]):
        return saved
    names = {id(p): n for n, p in model.named_parameters()}
    name_of = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    groups = [g | {"params": [name_of[i] for i in g["params"]]} for g in saved["param_groups"]]
    return {"state": {name_of[i]: s for i, s in saved["state"].items()}, "param_groups": groups}


def load_checkpoint(path, model, opt, scaler, cfg) -> int:
    """Load a checkpoint into the run (on every rank, this rank's shard under FSDP); returns its step. A corrupted
    file, one from other settings or one that would run code is a ValueError, loading nothing."""
    state = read_checkpoint(path)
    for key in resume_keys(type(cfg)):
        if (saved := state["config"].get(key)) != getattr(cfg, key):
            raise ValueError(f"{path}: checkpoint has {key}={saved!r}, config has {getattr(cfg, key)!r}")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if trainable != state["lora"].keys():
        missing = sorted(trainable ^ state["lora"].keys())[0]
        raise ValueError(f"{path}: checkpoint and model differ in their adapter parameters (first: {missing})")
    # every rank read the file; rank 0's copy is sent to the others (broadcast_from_rank0 needs a process group)
    load = StateDictOptions(full_state_dict=True, broadcast_from_rank0=dist.is_initialized(), strict=False)
    set_model_state_dict(model, state["lora"], options=load)
    saved = keyed_by_name(model, opt, state["optimizer"])
    for group, saved_group in zip(opt.param_groups, saved["param_groups"], strict=True):  # initial_lr (of the LambdaLR
        group |= {k: v for k, v in saved_group.items() if k not in group}  # older runs had): set_ fails without it
    set_optimizer_state_dict(model, opt, saved, options=load)
    if not state["optimizer"]["state"]:  # saved before any update: the zero state set_ made by a step with lr 0 goes
        opt.state.clear()
    if state.get("scaler"):  # fp16's loss scale ({} when off)
        scaler.load_state_dict(state["scaler"])
    return state["step"]


def read_checkpoint(path) -> dict:
    """checkpoint.pt's contents, tensors and plain values only (weights_only): a pickle that would run code is
    refused, as is any file that cannot be read."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        state["step"], state["lora"]  # noqa: B018  (a checkpoint has both)
    except pickle.UnpicklingError as e:  # what weights_only refuses: a global (a function, a class) to call
        found = next((line for line in str(e).splitlines() if "GLOBAL" in line), str(e).splitlines()[0])
        raise ValueError(f"{path}: refused: it holds more than tensors and plain values ({found.strip()[:120]}), which "
                         "unpickling would run as code; resume only from checkpoints you trust") from None  # fmt: skip
    except Exception as e:  # any unreadable file is reported, never half-loaded
        raise ValueError(f"{path}: corrupted checkpoint ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
    return state


def save(cfg, model, opt, scaler, step, history, main=True):
    """out_dir/checkpoint.pt and metrics.jsonl, written by rank 0 (every rank calls it)."""
    save_checkpoint(os.path.join(cfg.out_dir, "checkpoint.pt"), model, opt, scaler, step, cfg, main)
    if main:
        save_metrics(cfg.out_dir, history)


def save_metrics(out_dir, history):
    lines = "".join(json.dumps(h) + "\n" for h in history)
    atomic_write(os.path.join(out_dir, "metrics.jsonl"), lambda tmp: Path(tmp).write_text(lines))


def resume(cfg, model, opt, scaler) -> tuple[int, list[dict]]:
    """--resume: (the step of out_dir's checkpoint, loaded into the run, and the metrics up to that step)."""
    step = load_checkpoint(os.path.join(cfg.out_dir, "checkpoint.pt"), model, opt, scaler, cfg)
    path, history = os.path.join(cfg.out_dir, "metrics.jsonl"), []
    for i, line in enumerate(open(path) if os.path.exists(path) else [], 1):
        try:
            history.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: invalid JSON ({e.msg}); fix or delete that line to resume") from None
    return step, [h for h in history if h["step"] <= step]


def write_outputs(cfg, model, tok, prompts, history, adapter, model_dir, tracker=None):
    """The adapter (`adapter`: its whole tensors by name), the loss plot, the first held-out answer before and after
    beside its reference and, on request, a merged export and a GGUF."""
    adapter_dir = os.path.join(cfg.out_dir, "adapter")
    hf.save_adapter(model, adapter_dir, base_model_name_or_path=os.path.abspath(model_dir), weights=adapter)
    print(f"adapter written to {adapter_dir}")
    plot_losses(history, os.path.join(cfg.out_dir, "loss.png"))
    vals = [h["val_loss"] for h in history if "val_loss" in h]
    if len(vals) > 1:
        print(f"val loss: {vals[0]:.4f} -> {vals[-1]:.4f}")
    if task := humaneval.summary(cfg.eval_task, history):
        print(task)
    answers = [(h["step"], h["samples"][0]["answer"]) for h in history if h.get("samples")]
    if prompts and len(answers) > 1:
        prompt, reference, _ = render(prompts[0], tok, cfg.template or None)
        print(f"--- held-out prompt ---\n{prompt}\n--- reference ---\n{reference}")
        for (step, text), when in zip((answers[0], answers[-1]), ("before", "after"), strict=True):
            sim = difflib.SequenceMatcher(None, text, reference).ratio()
            print(f"--- {when} training (step {step}, similarity {sim:.3f}) ---\n{text}")
    if cfg.export_merged or cfg.export_gguf:
        export(cfg, model, history, model_dir, held_out_ids(cfg, tok, prompts), tracker)
    if tracker:
        tracker.close()


def held_out_ids(cfg, tok, prompts) -> list[int]:
    """The token ids the merge check runs: the first held-out prompt, or a few fixed tokens without one."""
    if not prompts:
        return tok.encode("def fibonacci(n):")
    prompt, _, bos = render(prompts[0], tok, cfg.template or None)
    return tok.encode(prompt, bos=bos)


def export(cfg, model, history, model_dir, prompt_ids, tracker=None):
    """The merge, checked on the held-out prompt, into out_dir/merged; its check joins metrics.jsonl; then the GGUF."""
    merged_dir = os.path.join(cfg.out_dir, "merged")
    original = hf.Checkpoint(model_dir) if cfg.quantize and not hf.is_prequantized(model_dir) else None
    _, report = merge_and_check_(model, [prompt_ids], original=original)
    history.append({"step": cfg.max_steps, "merge": report})
    save_metrics(cfg.out_dir, history)
    if tracker:
        tracker.log(history[-1])
    hf.export_merged(model, merged_dir, tokenizer_dir=model_dir)
    print(f"merged model written to {merged_dir} (merged into {report['merged_into']} weights)")
    if cfg.export_gguf:
        gguf = os.path.join(cfg.out_dir, f"model-{cfg.export_gguf}.gguf")
        path = gguf_write.export_gguf(merged_dir, gguf, cfg.export_gguf)
        print(f"GGUF written to {path}")


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
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)
