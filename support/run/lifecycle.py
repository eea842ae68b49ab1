"""How does a run open, go from step to step and close? The same for train.py and rl.py.

Functions a chapter calls in order, not hooks: each chapter keeps its own step, its own evaluation and its loop on
its page, in about ten lines:

    run = lifecycle.open_run(cfg, place, tok, model_dir, task, build)  # build(place): model, optimizer
    if not lifecycle.resume(run):                        # --resume: out_dir's checkpoint and records
        <the chapter's first records>
    with lifecycle.steps(run) as stop_asked:             # the progress bar; Ctrl-C, SIGTERM, a lost rank
        while run.step < cfg.max_steps and not stop_asked():
            record = <the chapter's step>                # a NaN stops here: stopping.stop_unless_finite
            if lifecycle.evaluation_due(run) and not stop_asked():
                record |= <the chapter's evaluation>
            lifecycle.end_step(run, record, <its line>)  # kept, shown, tracked; a checkpoint when due
    lifecycle.end_loop(run)                              # the last checkpoint; Ctrl-C's line and exit code
    return lifecycle.close_run(run, prompts)             # the outputs in out_dir; the peak; the process group

A record is finished before it is kept: nothing changes it once it is in the history."""

import functools
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from support.accounting import memory
from support.data.tokenizer import Tokenizer
from support.formats import hf
from support.kernels import choice
from support.run import progress, ranks, run_dir, stopping


@dataclass
class Run:
    """What both loops work with: the run's settings (with the out_dir it claimed), the model and
    its optimizer state, where the records go, and how far it is."""

    cfg: object
    place: ranks.Placement
    tok: Tokenizer
    model_dir: str
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    task: list  # eval_task's problems, [] without one
    tracker: object = None  # TensorBoard or W&B, on rank 0
    bar: object = None  # the progress bar, while the loop runs
    estimated: int | None = None  # bytes: the memory estimate the first steps are checked against
    step: int = 0  # optimizer steps taken
    last_saved: int | None = None  # the step of this run's last checkpoint
    history: list = field(default_factory=list)  # rank 0's records, in step order


def open_run(cfg, place, tok, model_dir, task, build) -> Run:
    """The run: its compute dtype (rank 0's choice, on every rank), the model and its optimizer from the chapter's
    `build(place)`, fp16's loss scaler and the tracker on rank 0."""
    architecture = hf.read_config(model_dir)[0]
    dtype = choice.pick_precision(cfg.precision, place.device, architecture, place.main)
    place.dtype = choice.broadcast_dtype(dtype, place.world, place.device)
    model, opt = build(place)
    scaler = torch.amp.GradScaler("cuda", enabled=place.dtype == torch.float16)
    return Run(cfg, place, tok, model_dir, model, opt, scaler, task, progress.open_tracker(cfg) if place.main else None)


def resume(run) -> bool:
    """With --resume, out_dir's checkpoint into the model and optimizer and the records up to its step; whether it
    resumed (False: a fresh run, nothing done)."""
    if not run.cfg.resume:
        return False
    run.step, run.history = run_dir.resume(run.cfg, run.model, run.opt, run.scaler)
    run.last_saved = run.step
    return True


def keep(run, record):
    """A finished record into the history and to the tracker (rank 0)."""
    if run.place.main:
        run.history.append(record)
    if run.tracker:
        run.tracker.log(record)


@contextmanager
def steps(run):
    """The loop's frame: the progress bar, Ctrl-C and SIGTERM asking to stop after the step under
    way, a second Ctrl-C or a lost rank ending at once in one line. Yields stop_asked(): whether any
    rank was asked to stop."""
    bar = tqdm(total=run.cfg.max_steps, initial=run.step, disable=not run.place.main, dynamic_ncols=True)
    with bar, stopping.stop_requests() as asked, stopping.abrupt_ends(run):
        run.bar = bar
        memory.reset_peak(run.place.device)  # the measured peak starts here (on CUDA; a CPU's is the process's)
        yield functools.partial(stopping.any_rank, asked, run.place.world, run.place.device)


def evaluation_due(run) -> bool:
    """Whether the step just taken is evaluated: every eval_every steps, and the last."""
    every = run.cfg.eval_every
    return bool(every) and (run.step % every == 0 or run.step == run.cfg.max_steps)


def end_step(run, record, line):
    """The step just taken, its record finished: kept, its `line` on the progress bar, after step
    2 the measured peak memory beside the estimate; then a checkpoint when save_every is due
    (every rank: a sharded model gathers)."""
    if run.place.device.type == "cuda":
        record = record | {"peak_mem": memory.peak(run.place.device)}
    keep(run, record)
    run.bar.set_postfix_str(line)
    run.bar.update(1)
    if run.estimated and run.place.main and record["step"] == min(2, run.cfg.max_steps):
        peak = memory.fmt(memory.peak(run.place.device))
        estimated = memory.fmt(run.estimated)
        run.bar.write(f"measured peak memory after {record['step']} steps: {peak} (estimated {estimated})")
    if run.cfg.save_every and run.step % run.cfg.save_every == 0:
        save(run)


def save(run):
    """out_dir's checkpoint and metrics of this step."""
    run_dir.save(run.cfg, run.model, run.opt, run.scaler, run.step, run.history, run.place.main)
    run.last_saved = run.step


def end_loop(run):
    """After the loop: the checkpoint of the last step, unless it was just saved. Stopped early by
    Ctrl-C or SIGTERM, between two steps: the line saying how to go on, and exit code 130."""
    if run.last_saved != run.step:  # before the merged export changes the model
        save(run)
    if run.step >= run.cfg.max_steps:
        return
    if run.place.main:
        print(f"interrupted: checkpoint at step {run.step} written; continue with --resume --out_dir={run.cfg.out_dir}")
    raise SystemExit(130)


def close_run(run, prompts=()) -> list[dict]:
    """The outputs in out_dir (support/run/run_dir.py: the adapter, the loss plot, on request
    merged and GGUF exports) and the peak memory, written by rank 0; then the process group ends.
    Returns the history."""
    adapter = {n: ranks.full(p.detach()) for n, p in run.model.named_parameters() if p.requires_grad}  # gathered
    if run.place.main:
        run_dir.write_outputs(run.cfg, run.model, run.tok, prompts, run.history, adapter, run.model_dir, run.tracker)
        progress.print_peak(run.place)
    run.model = None  # a sharded model holds the process group until freed
    run.opt = None
    ranks.end_process_group()
    return run.history
