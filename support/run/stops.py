"""How does a run stop early without losing or corrupting anything?

Ctrl-C (or SIGTERM) asks the loop to stop after the step under way, so the checkpoint it writes sits exactly between
two steps (and the step's record is kept); a second Ctrl-C stops at once, writing nothing. Under torchrun every rank
must leave the loop at the same step, or the others would wait in their next all-reduce forever: one scalar
all-reduce per step agrees on it. torchrun kills its workers 30 s after passing Ctrl-C on (--shutdown_timeout sets
it from torch 2.13), so an evaluation due at the stop step is skipped. A NaN or inf loss or gradient is never
applied: the run stops before the update, writes the metrics up to it and says which checkpoint is intact.
"""

import math
import os
import signal
import sys
import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist

from support.run import ranks
from support.run.checkpoint import last_checkpoint, save_metrics


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
