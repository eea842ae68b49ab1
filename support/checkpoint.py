"""What does a checkpoint hold, and when may a run resume from it?

checkpoint.pt holds the adapter weights, the optimizer state, fp16's loss scale and the settings, every tensor whole
and named by its parameter, so a run sharded over N ranks resumes on M ranks or on one process. No RNG state, no
schedule and no data position: dropout is a function of (seed, step, a row's place in the step's global batch), every
step takes the rows pack.py gives it, and the learning rate is the schedule's at that step, so the step number is all a
resumed run needs, on any number of ranks and any micro-batch. A resumed run must share the settings declared with
resume=True in train.Config: they shape the adapters, the optimizer (whose saved state carries lr, betas and weight
decay: a new value would be silently ignored) or the data and its order. max_steps, warmup_steps and min_lr_ratio may
change: the schedule is recomputed from them. metrics.jsonl is rewritten whole with each checkpoint, so the two always
agree.
"""

import dataclasses
import json
import os
from pathlib import Path

import torch

from support.atomic import atomic_write
from support.config import resume_keys
from support.fsdp import full, like


def save_checkpoint(path, model, opt, scaler, step, cfg, main=True):
    """Adapter weights, optimizer and fp16's loss scale, every tensor whole and keyed by its parameter's name (a sharded
    model's shards are gathered: every rank calls this, rank 0 writes). No RNG state and no schedule: dropout is a
    function of (seed, step, row), and the learning rate of the step."""
    lora_state = {n: full(p.detach()).clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer = optimizer_state(model, opt)
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


def optimizer_state(model, opt) -> dict:
    """opt.state_dict() with whole tensors keyed by parameter name instead of position: what any number of ranks, or
    one process, can load (`load_optimizer`)."""
    names, params = {id(p): n for n, p in model.named_parameters()}, [p for g in opt.param_groups for p in g["params"]]
    sd = opt.state_dict()
    state = {names[id(params[i])]: {k: full(v) for k, v in s.items()} for i, s in sd["state"].items()}
    groups = [g | {"params": [names[id(params[i])] for i in g["params"]]} for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_optimizer(model, opt, saved):
    """optimizer_state's dict into `opt`, each tensor laid out as its parameter is (this rank's shard under FSDP). A
    checkpoint keyed by position (written before names were used) is first keyed by name, in the order of the
    optimizer's parameters, which is the order it was written in."""
    names, params = {id(p): n for n, p in model.named_parameters()}, [p for g in opt.param_groups for p in g["params"]]
    if all(isinstance(i, int) for g in saved["param_groups"] for i in g["params"]):
        name_of = [names[id(p)] for p in params]
        groups = [g | {"params": [name_of[i] for i in g["params"]]} for g in saved["param_groups"]]
        saved = {"state": {name_of[i]: s for i, s in saved["state"].items()}, "param_groups": groups}
    index = {names[id(p)]: i for i, p in enumerate(params)}
    state = {index[n]: {k: like(v, params[index[n]]) for k, v in s.items()} for n, s in saved["state"].items()}
    groups = [g | {"params": [index[n] for n in g["params"]]} for g in saved["param_groups"]]
    opt.load_state_dict({"state": state, "param_groups": groups})


def load_checkpoint(path, model, opt, scaler, cfg) -> int:
    """The step a checkpoint was written at, its adapters, optimizer and loss scale loaded into the run (on every
    rank); a corrupted file or one from other settings is a ValueError, loading nothing."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
        step, lora_state = state["step"], state["lora"]
    except Exception as e:  # any unreadable file is reported, never half-loaded
        raise ValueError(f"{path}: corrupted checkpoint ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
    for key in resume_keys(type(cfg)):
        if (saved := state["config"].get(key)) != getattr(cfg, key):
            raise ValueError(f"{path}: checkpoint has {key}={saved!r}, config has {getattr(cfg, key)!r}")
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if params.keys() != lora_state.keys():
        missing = sorted(params.keys() ^ lora_state.keys())[0]
        raise ValueError(f"{path}: checkpoint and model differ in their adapter parameters (first: {missing})")
    with torch.no_grad():
        for name, value in lora_state.items():
            params[name].copy_(like(value, params[name]))
    load_optimizer(model, opt, state["optimizer"])
    if state.get("scaler"):  # fp16's loss scale ({} when off)
        scaler.load_state_dict(state["scaler"])
    return step


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
