"""When does a run's loop stop before max_steps, and what does it say then?

Four ways, each leaving out_dir's last checkpoint intact and saying which step it holds: Ctrl-C or SIGTERM (stop after
the step under way, with a checkpoint of exactly that step; a second one stops at once), a NaN or inf loss or gradient
norm (the update is never applied), and another rank lost. Ranks of a torchrun stop together: the request is agreed
across ranks before each step."""

import math
import os
import signal
import sys
import threading
from contextlib import contextmanager

from support.run import ranks, run_dir


@contextmanager
def stop_requests():
    """Ctrl-C (SIGINT) or SIGTERM while training asks the loop to stop after the step under way; a second one stops at
    once. Yields a list that is non-empty once a stop was asked for. Outside the main thread: no-op."""
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
    """Whether any rank was asked to stop: all ranks must leave the loop at the same step."""
    return ranks.reduce_min(int(not asked), world, device) == 0  # 0: some rank was asked


def last_checkpoint(out_dir, step) -> str:
    """Which checkpoint a run stopped early leaves intact (step None: none was written)."""
    return "no checkpoint was written yet" if step is None else f"the checkpoint of step {step} in {out_dir} is intact"


def finite(record, scaler) -> bool:
    """Whether a step's loss and gradient norm are finite; fp16's scaler skips steps with inf gradients itself, so
    with it only the loss counts."""
    return math.isfinite(record["loss"]) and (math.isfinite(record["grad_norm"]) or scaler.is_enabled())


def stop_unless_finite(run, record):
    """Stop on a NaN or inf loss or gradient norm (the update was not applied), writing the metrics up to it."""
    if finite(record, run.scaler):
        return
    if run.place.main:
        run_dir.save_metrics(run.cfg.out_dir, run.history + [record])
    raise FloatingPointError(
        f"loss {record['loss']}, gradient norm {record['grad_norm']} at step {record['step']}: stopped before the "
        f"update; {last_checkpoint(run.cfg.out_dir, run.last_saved)}"
    )


@contextmanager
def abrupt_ends(run):
    """The loop's two abrupt ends, a second Ctrl-C and another rank lost, each in one line naming the checkpoint that
    is intact (run.last_saved)."""
    try:
        yield
    except KeyboardInterrupt:
        print(f"\nstopped at once: {last_checkpoint(run.cfg.out_dir, run.last_saved)}", file=sys.stderr)
        raise SystemExit(130) from None
    except Exception as e:
        if not ranks.lost(e):
            raise
        kept = last_checkpoint(run.cfg.out_dir, run.last_saved)
        raise ranks.RankLost(ranks.lost_during(e, run.step + 1, kept)) from None
