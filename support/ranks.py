"""How do many ranks stay in step, and how does a run end when one of them fails?

Every rank must call the same collectives in the same order, or the others wait for it forever. So whatever a rank
decides from what only it sees is agreed first: the dtype (rank 0's measurement, support/precision.py), the micro-batch
(each rank reads its own free memory: all take the smallest, `agreed_min`), a stop (stops.any_rank).

A rank can still fail alone: a mistake only it meets (rank 0 alone writes the checkpoints and the outputs), or it is
killed (SIGKILL, out of memory, its machine lost). Then:
- a rank that stops on a user error writes its line to the process group's store before it exits (`tell_the_others`);
- the others learn of it at their next collective, which fails as soon as the lost rank's connections close (gloo
  says "Connection closed by peer"), or from torchrun, which sends SIGTERM to the other ranks once one has exited with
  an error: SIGTERM asks the loop to stop after the step under way (stops.py), and that step's next collective fails
  the same way. Each prints the failing rank's line, or, when the lost rank left none (it was killed), that a rank was
  lost during which step and which checkpoint is intact, and exits with code 2.
- a rank alive but stuck (hung in a driver, stopped) is given up on after cfg.rank_timeout minutes in one collective:
  long enough for the slowest rank to finish loading or for rank 0 to evaluate alone, short of holding GPUs for hours.
"""

import os
import signal
import sys
import threading
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

ERROR_KEY = "nanoqlora/error"  # the first user error of any rank, in the process group's store
store = None  # that store, once init_process_group has run in this process


class RankLost(Exception):
    """Another rank is gone: this one's collectives have no partner left."""


def init_process_group(backend, rank, world, timeout_minutes):
    """The default process group, its collectives and rendezvous bounded by `timeout_minutes`; its store is kept for
    the ranks' one-line errors. torchrun sets RANK/WORLD_SIZE/MASTER_*; plain python runs a group of one."""
    global store
    timeout = timedelta(minutes=timeout_minutes)
    if "RANK" in os.environ:  # torchrun's env:// rendezvous, as init_process_group makes it, keeping the store
        store = next(dist.rendezvous("env://", rank, world, timeout=timeout))[0]
        store.set_timeout(timeout)
    else:
        store = dist.HashStore()
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world,
                            timeout=timeout)  # fmt: skip


def agreed_min(value: int, world: int, device) -> int:
    """The smallest of every rank's `value`."""
    if world == 1:
        return value
    t = torch.tensor(value, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t)


def lost(e: BaseException) -> bool:
    """Whether `e` is a collective failing because another rank is gone: gloo raises a RuntimeError from its
    transport ("Connection closed by peer", "Timed out waiting"), NCCL a DistBackendError."""
    return isinstance(e, RankLost | dist.DistError) or (isinstance(e, RuntimeError) and "/gloo/" in str(e))


def tell_the_others(lines: list[str]) -> list[str]:
    """Keep this rank's error lines in the store for the other ranks (the first error of a run wins); returns them."""
    if store is not None and dist.is_initialized() and dist.get_world_size() > 1:
        try:
            store.compare_set(ERROR_KEY, "", f"{dist.get_rank()}\n" + "\n".join(lines))
        except (RuntimeError, dist.DistError):  # the store's host is gone too: this rank still says it
            pass
    return lines


def why_lost(e: BaseException) -> list[str]:
    """What a rank whose partner is gone prints: the error another rank left in the store, else what `e` says (the
    loop's RankLost names the step and the checkpoint that is intact)."""
    try:
        said = store.get(ERROR_KEY).decode() if store is not None and store.check([ERROR_KEY]) else ""
    except (RuntimeError, dist.DistError):  # the store's host (torchrun's agent) is gone as well
        said = ""
    if said:
        rank, *lines = said.split("\n")
        return [f"{line} (from rank {rank}; rank {dist.get_rank()} stopped with it)" for line in lines]
    if isinstance(e, RankLost):
        return [str(e)]
    return [f"{whoami()}: another rank was lost (it exited without a word: killed, out of memory or its machine gone)"]


def lost_during(e: BaseException, step: int, intact: str) -> str:
    """The line of a rank whose collective failed (`e`) during `step`; `intact`: which checkpoint is."""
    how = "was lost during step {} (it exited without a word: killed, out of memory or its machine gone)"
    if "Timed out" in str(e):
        how = "did not answer during step {} (within rank_timeout: stuck, or far slower than this one)"
    return f"{whoami()}: another rank {how.format(step)}; {intact}; continue with --resume"


def whoami() -> str:
    return f"rank {dist.get_rank()}" if dist.is_initialized() else "this process"


@contextmanager
def sigterm_ends_this_rank():
    """SIGTERM outside the training loop (torchrun sends it to every rank once one has failed) ends this rank with
    one line rather than silently; inside, stops.stop_requests takes it as a request to stop after the step. Yields
    `ending()`, which ignores SIGTERM from then on: this rank is printing its line and exiting (a rank of many keeps
    ignoring it to the end, or torchrun's SIGTERM would turn its exit code 2 into -15)."""
    main = threading.current_thread() is threading.main_thread()  # only the main thread may set handlers
    ended = []

    def ending():
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            ended.append(dist.is_initialized() and dist.get_world_size() > 1)

    def on_sigterm(signum, frame):
        ending()
        if sys.exc_info()[1] is None:  # else an error on its way out (the loop's, say) ends the rank with its line
            raise RankLost(f"{whoami()}: stopped by SIGTERM (torchrun sends it to every rank once one has failed)")

    previous = signal.signal(signal.SIGTERM, on_sigterm) if main else None
    try:
        yield ending
    finally:  # None: a handler set outside Python, which cannot be put back; the default takes its place
        if main and not any(ended):
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
