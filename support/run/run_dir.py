"""What does a run keep in its out_dir, from the claim before any work to what it leaves at the end?

One folder per run, kept whole however the run ends: claimed before any work, checkpointed as it trains (and when it
stops early), and holding the outputs at the end.

The claim
---------
Are the inputs there, and may this run write to out_dir? Checked before any work: the model's config.json and the data
exist (Hub ids resolved by support/formats/hub.py), a GGUF export of something llama.cpp cannot read is refused now
rather than after the training, and out_dir is writable and holds no other run. A run already there (a checkpoint, an
adapter or metrics) is continued with --resume or replaced with --overwrite; a chosen out_dir holding one is refused,
and the default one moves on to out-2, out-3, ... (saying so), so running the default twice keeps both runs.

Checkpoints
-----------
What does a checkpoint hold, and when may a run resume from it? checkpoint.pt holds the adapter weights, the optimizer
state, fp16's loss scale and the settings, every tensor whole and named by its parameter, so a run sharded over N ranks
resumes on M ranks or on one process (torch's torch.distributed.checkpoint.state_dict gathers the optimizer state and
lays every tensor out again as its parameter is). No RNG state, no schedule and no data position: dropout is a function
of (seed, step, a row's place in the step's global batch), every step takes the rows pack.py gives it, and the learning
rate is the schedule's at that step, so the step number is all a resumed run needs, on any number of ranks and any
micro-batch. It is read with weights_only: tensors and plain values, never a pickle that would run code. A resumed run
must share the settings declared with resume=True in train.Config: they shape the adapters, the optimizer (whose saved
state carries lr, betas and weight decay: a new value would be silently ignored) or the data and its order. max_steps,
warmup_steps and min_lr_ratio may change: the schedule is recomputed from them. metrics.jsonl is rewritten whole with
each checkpoint, so the two always agree.

Stopping early
--------------
How does a run stop early without losing or corrupting anything? Ctrl-C (or SIGTERM) asks the loop to stop after the
step under way, so the checkpoint it writes sits exactly between two steps (and the step's record is kept); a second
Ctrl-C stops at once, writing nothing. Under torchrun every rank must leave the loop at the same step, or the others
would wait in their next all-reduce forever: one scalar all-reduce per step agrees on it. torchrun kills its workers 30
s after passing Ctrl-C on (--shutdown_timeout sets it from torch 2.13), so an evaluation due at the stop step is
skipped. A NaN or inf loss or gradient is never applied: the run stops before the update, writes the metrics up to it
and says which checkpoint is intact.

What a finished run leaves
--------------------------
What does a finished run leave behind? In out_dir: adapter/ (PEFT's format, which transformers + PEFT load), loss.png
(training and validation loss over the steps), and on request merged/ (the adapters folded into the base, a plain
Hugging Face model) and model-<type>.gguf with its Ollama Modelfile. The merge is checked before anything of it is
written (support/evaluation/merge_check.py) and its report joins metrics.jsonl. On the terminal: the validation loss
before and after, eval_task's pass@1 at the first and the last evaluation that scored it, and the first held-out
prompt's answer at the first and the last evaluation beside the reference, each with its similarity to it."""

import dataclasses
import difflib
import json
import math
import os
import pickle
import signal
import sys
import threading
from contextlib import contextmanager
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
from support.formats import gguf_read, gguf_write, hf, hub, modelfile
from support.formats.atomic import atomic_write
from support.run import ranks
from support.run.config import resume_keys
from support.run.ranks import full


def claim_inputs(cfg) -> tuple[str, dict]:
    """Fail before any work when out_dir is not writable, holds another run, the model, data or checkpoint is missing,
    or context_length is beyond the model's positions; returns the model directory (the embedded SmolLM2 when cfg.model
    is "", converted on first use) and the data files {"data": [...], "val_data": [...]} (empty lists for "", the stdlib
    dataset), Hub ids resolved into the Hugging Face cache. A preview writes nothing, so it claims no out_dir; a plan
    reads no data."""
    model_dir = hub.model_dir(cfg.model, only_config=bool(cfg.plan)) if cfg.model else gguf_read.smollm2_dir()
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"model: {os.path.join(model_dir, 'config.json')} not found (not a model directory)")
    files = data_files(cfg)
    max_positions = hf.read_config(model_dir)[0].max_position_embeddings
    if isinstance(cfg.context_length, int) and cfg.context_length > max_positions:
        raise ValueError(
            f"context_length: {cfg.context_length} is beyond the model's max_position_embeddings {max_positions}"
            " (positions it was never trained on); lower it or use 'auto'"
        )
    if cfg.export_gguf:  # what llama.cpp cannot read is refused now, not after the training
        gguf_write.check_gguf_export(model_dir, cfg.export_gguf)
    if not (cfg.preview or cfg.plan):
        claim_out_dir(cfg)
    return model_dir, files


def data_files(cfg) -> dict:
    """{"data": [...], "val_data": [...]}: the files of each (a local path, or a Hub dataset's in the cache); none for
    "" (the stdlib dataset) or for a plan, which reads no data."""
    return {key: hub.data_files(getattr(cfg, key)) if getattr(cfg, key) and not cfg.plan else []
            for key in ("data", "val_data")}  # fmt: skip


def claim_out_dir(cfg):
    """Make sure this run may write to out_dir. A run already there (see run_files) is continued with --resume or
    replaced with --overwrite; otherwise a chosen out_dir is refused, and the default one moves on to out-2, out-3,
    ... (saying so), so running the default twice keeps both runs. cfg.out_dir is updated in place."""
    ckpt = os.path.join(cfg.out_dir, "checkpoint.pt")
    if cfg.resume and not os.path.isfile(ckpt):
        raise FileNotFoundError(f"{ckpt}: no checkpoint to resume from")
    if (held := run_files(cfg.out_dir)) and not (cfg.resume or cfg.overwrite):
        if cfg.out_dir != type(cfg).out_dir:  # a chosen out_dir, not the default
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
        atomic_write(probe, lambda tmp: None)
        os.remove(probe)
    except OSError as e:
        raise PermissionError(f"out_dir: cannot write to '{cfg.out_dir}' ({e.strerror})") from None


def run_files(out_dir) -> list[str]:
    """The files in out_dir that show a run was there: its checkpoint, its adapter, its metrics."""
    return [p for f in ("checkpoint.pt", "adapter", "metrics.jsonl") if os.path.exists(p := os.path.join(out_dir, f))]


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


def resume(cfg, model, opt, scaler) -> tuple[int, list[dict]]:
    """--resume: (the step of out_dir's checkpoint, loaded into the run as load_checkpoint loads it, and the metrics
    up to that step)."""
    step = load_checkpoint(os.path.join(cfg.out_dir, "checkpoint.pt"), model, opt, scaler, cfg)
    return step, read_metrics(os.path.join(cfg.out_dir, "metrics.jsonl"), step)


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


def write_outputs(cfg, model, tok, prompts, history, adapter, model_dir, tracker=None):
    """The adapter (`adapter`: its tensors by parameter name, whole), the loss plot, the first held-out answer at the
    first and at the last evaluation beside its reference and, on request, a merged export and a GGUF."""
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
    save_metrics(cfg, history)
    if tracker:
        tracker.log(history[-1])
    hf.export_merged(model, merged_dir, tokenizer_dir=model_dir)
    print(f"merged model written to {merged_dir} (merged into {report['merged_into']} weights)")
    if cfg.export_gguf:
        gguf = os.path.join(cfg.out_dir, f"model-{cfg.export_gguf}.gguf")
        path = gguf_write.export_gguf(merged_dir, gguf, cfg.export_gguf)
        print(f"GGUF written to {path} (Ollama: ollama create NAME -f {modelfile.modelfile_path(path)})")


def plot_losses(history, path):
    """Training and validation loss over the steps, as a PNG."""
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


@contextmanager
def stop_requests():
    """Ctrl-C (SIGINT) or SIGTERM (a cluster's scheduler, or torchrun passing either on) while training asks the loop
    to stop after the step under way, so that the checkpoint it writes sits exactly between two steps (and the step's
    record is kept); a second one stops at once, saving nothing. Yields a list that is non-empty once a stop was asked
    for. Outside the main thread signals cannot be caught: no-op."""
    asked: list = []

    def on_signal(signum, frame):
        if asked:
            raise KeyboardInterrupt
        asked.append(signum)
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        # os.write, not print: a handler that prints while the loop is inside a print fails ("reentrant call")
        os.write(2, f"\n{name}: stopping after this step (again: stop at once, without a checkpoint)\n".encode())

    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        yield asked
    finally:  # None: a handler set outside Python, which cannot be put back; the default takes its place
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


def any_rank(asked, world, device) -> bool:
    """Whether any rank was asked to stop: all ranks must leave the loop at the same step, or the others would wait
    in their next all-reduce forever."""
    if world == 1:
        return bool(asked)
    flag = torch.tensor(float(bool(asked)), device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def stop_not_finite(cfg, history, last_saved, main=True):
    """A NaN or inf loss or gradient norm (the update was not applied): the metrics up to it are written for a look,
    the last checkpoint is left as it is, and the run stops."""
    record, kept = history[-1], last_checkpoint(cfg, last_saved)
    if main:
        save_metrics(cfg, history)
    raise FloatingPointError(
        f"loss {record['loss']}, gradient norm {record['grad_norm']} at step {record['step']}: stopped before the "
        f"update; {kept}"
    )


def finite(record, scaler) -> bool:
    """Whether a step's loss and gradient norm are finite; fp16's scaler expects inf gradients now and then (it skips
    those steps and lowers its scale), so with it only the loss counts."""
    return math.isfinite(record["loss"]) and (math.isfinite(record["grad_norm"]) or scaler.is_enabled())


@contextmanager
def abrupt_ends(cfg, run):
    """The loop's two abrupt ends, each in one line naming the checkpoint that is intact (run.last_saved): a second
    Ctrl-C in the middle of a step, of which nothing is saved, and another rank lost, whose collective fails here
    (support/run/ranks.py)."""
    try:
        yield
    except KeyboardInterrupt:
        print(f"\nstopped at once: {last_checkpoint(cfg, run.last_saved)}", file=sys.stderr)
        raise SystemExit(130) from None
    except Exception as e:
        if not ranks.lost(e):
            raise
        raise ranks.RankLost(ranks.lost_during(e, run.step + 1, last_checkpoint(cfg, run.last_saved))) from None
