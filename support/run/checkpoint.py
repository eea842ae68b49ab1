"""What does a checkpoint hold, and when may a run resume from it?

checkpoint.pt holds the adapter weights, the optimizer state, fp16's loss scale and the settings, every tensor whole
and named by its parameter, so a run sharded over N ranks resumes on M ranks or on one process (torch's
torch.distributed.checkpoint.state_dict gathers the optimizer state and lays every tensor out again as its parameter
is). No RNG state, no schedule and no data position: dropout is a function of (seed, step, a row's place in the step's
global batch), every step takes the rows pack.py gives it, and the learning rate is the schedule's at that step, so the
step number is all a resumed run needs, on any number of ranks and any micro-batch. It is read with weights_only:
tensors and plain values, never a pickle that would run code. A resumed run must share the settings declared with
resume=True in train.Config: they shape the adapters, the optimizer (whose saved state carries lr, betas and weight
decay: a new value would be silently ignored) or the data and its order. max_steps, warmup_steps and min_lr_ratio may
change: the schedule is recomputed from them. metrics.jsonl is rewritten whole with each checkpoint, so the two always
agree.
"""

import dataclasses
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

from support.formats.atomic import atomic_write
from support.run.config import resume_keys
from support.run.fsdp import full


def save_checkpoint(path, model, opt, scaler, step, cfg, main=True):
    """Adapter weights, optimizer and fp16's loss scale, every tensor whole and keyed by its parameter's name (a sharded
    model's shards are gathered: every rank calls this, rank 0 writes). No RNG state and no schedule: dropout is a
    function of (seed, step, row), and the learning rate of the step."""
    # The adapters alone are gathered here: get_model_state_dict would also gather a frozen tied embedding (its
    # ignore_frozen_params drops a shared parameter under its first name only) and return a replicated NF4 base whole.
    lora_state = {n: full(p.detach()).clone() for n, p in model.named_parameters() if p.requires_grad}
    fresh = not opt.state  # no update applied yet (fp16's scaler skips steps whose gradients overflow)
    optimizer = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if fresh:  # get_optimizer_state_dict made zero state by a step with lr 0, which AdamW would count: dropped again
        opt.state.clear()
        optimizer["state"] = {}
    if not main:
        return
    # fmt: off
    state = dict(step=step, lora=lora_state, optimizer=optimizer, scaler=scaler.state_dict(),
                 config=dataclasses.asdict(cfg))
    # fmt: on

    def write(tmp):
        with open(tmp, "wb") as f:  # a file object: torch's zip writer refuses the temp file's dotted name
            torch.save(state, f)

    atomic_write(path, write)


def keyed_by_name(model, opt, saved) -> dict:
    """Optimizer state as checkpoints hold it, {"state": {name: ...}, "param_groups": [{"params": [names]}]}, from one
    written before names were used (torch's own state_dict, keyed by the position of the optimizer's parameters)."""
    if not all(isinstance(i, int) for g in saved["param_groups"] for i in g["params"]):
        return saved
    names = {id(p): n for n, p in model.named_parameters()}
    name_of = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    groups = [g | {"params": [name_of[i] for i in g["params"]]} for g in saved["param_groups"]]
    return {"state": {name_of[i]: s for i, s in saved["state"].items()}, "param_groups": groups}


def load_checkpoint(path, model, opt, scaler, cfg) -> int:
    """The step a checkpoint was written at, its adapters, optimizer and loss scale loaded into the run (on every
    rank, each tensor laid out as its parameter is: this rank's shard under FSDP); a corrupted file, one from other
    settings or one that holds more than tensors and plain values is a ValueError, loading nothing."""
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
    """checkpoint.pt's contents, read as tensors and plain values only (weights_only): a checkpoint from elsewhere
    that would run code when unpickled is refused, as is any file that cannot be read."""
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


def save(cfg, model, opt, scaler, step, history, main=True) -> int:
    """out_dir/checkpoint.pt and out_dir/metrics.jsonl, each written whole by rank 0 (every rank calls it: a sharded
    model's tensors are gathered); returns the step saved."""
    save_checkpoint(os.path.join(cfg.out_dir, "checkpoint.pt"), model, opt, scaler, step, cfg, main)
    if main:
        save_metrics(cfg, history)
    return step


def save_metrics(cfg, history):
    """out_dir/metrics.jsonl: one JSON record per line, step 0's first."""
    lines = "".join(json.dumps(h) + "\n" for h in history)
    atomic_write(os.path.join(cfg.out_dir, "metrics.jsonl"), lambda tmp: Path(tmp).write_text(lines))


def read_metrics(path, step) -> list[dict]:
    """The metrics of a resumed run up to its checkpoint's step."""
    history = []
    for i, line in enumerate(open(path) if os.path.exists(path) else [], 1):
        try:
            history.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: invalid JSON ({e.msg}); fix or delete that line to resume") from None
    return [h for h in history if h["step"] <= step]


def last_checkpoint(cfg, step) -> str:
    """What a run stopped early leaves: the checkpoint of `step` (None: none was written by this run)."""
    return (
        "no checkpoint was written yet" if step is None else f"the checkpoint of step {step} in {cfg.out_dir} is intact"
    )
