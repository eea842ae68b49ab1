"""Where does each process of a run compute, how do many ranks stay in step, and how does a run end when one fails?

One process is a Placement: its rank among `world` processes, its device and the dtype it computes in (rank 0 prints,
evaluates and saves). `setup` reads them from torchrun's RANK, WORLD_SIZE and LOCAL_RANK (plain python: one process)
and starts the process group (nccl on CUDA, gloo on CPU) when there are many, or when FSDP asks for one.

Every rank must call the same collectives in the same order, or the others wait for it forever. So whatever a rank
decides from what only it sees is agreed first: the dtype (rank 0's measurement, support/kernels/choice.py), the
micro-batch (each rank reads its own free memory: all take the smallest, `agreed_min`), a stop (run_dir.any_rank). The
rows of a step are shared equally (`rows_per_rank`); a batch the ranks cannot share is refused before any model is
loaded.

A rank can still fail alone: a mistake only it meets (rank 0 alone writes the checkpoints and the outputs), or it is
killed (SIGKILL, out of memory, its machine lost). Then:
- a rank that stops on a user error writes its line to the process group's store before it exits (`tell_the_others`);
- the others learn of it at their next collective, which fails as soon as the lost rank's connections close (gloo
  says "Connection closed by peer"), or from torchrun, which sends SIGTERM to the other ranks once one has exited with
  an error: SIGTERM asks the loop to stop after the step under way (run_dir.py), and that step's next collective fails
  the same way. Each prints the failing rank's line, or, when the lost rank left none (it was killed), that a rank was
  lost during which step and which checkpoint is intact, and exits with code 2.
- a rank alive but stuck (hung in a driver, stopped) is given up on after cfg.rank_timeout minutes in one collective:
  long enough for the slowest rank to finish loading or for rank 0 to evaluate alone, short of holding GPUs for hours.
"""

import gc
import os
import signal
import sys
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

ERROR_KEY = "nanoqlora/error"  # the first user error of any rank, in the process group's store
store = None  # that store, once init_process_group has run in this process


@dataclass
class Placement:
    """Where this process computes: its rank among `world` processes, its device, and the dtype it computes in."""

    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype = torch.float32

    @property
    def main(self) -> bool:  # rank 0 prints, evaluates, saves
        return self.rank == 0

    def autocast(self):
        half = self.dtype in (torch.bfloat16, torch.float16)  # fp32 (and the tests' fp64) run as they are
        return torch.autocast(self.device.type, dtype=self.dtype) if half else nullcontext()


def setup(cfg) -> Placement:
    """Device and process group. torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; plain python runs one process. The dtype is
    chosen once the model's shapes are known (pick_precision). On CUDA, fp32 matmuls use TF32 only when cfg.tf32 asks
    (under bf16 autocast few matmuls are fp32; with precision fp32 all are)."""
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.fp32_precision = "tf32" if cfg.tf32 else "ieee"
    if world > 1 or cfg.parallel == "fsdp":  # FSDP needs a process group, one process or many
        init_process_group("nccl" if use_cuda else "gloo", rank, world, cfg.rank_timeout)
    return Placement(rank, world, device)


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


def end_process_group():
    """Destroy the default process group while the interpreter is whole. A sharded model holds its group in reference
    cycles that only the garbage collector frees: left to the interpreter's exit, a gloo worker thread could free its
    last finished collective after Python began shutting down, and a finished run would abort (SIGABRT, "terminate
    called without an active exception"). So the cycles are freed first and the group's threads joined here. The
    caller drops its own references to the model and optimizer before calling."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def local_first(work):
    """work() on each machine's first rank (LOCAL_RANK 0, as torchrun numbers them) while the machine's other ranks
    wait, then on those, which find on disk what the first one wrote (the token cache) instead of doing it again.
    Every rank calls it alike: the wait is a barrier of the process group, bounded by rank_timeout, and a first rank
    that fails ends the others with its line (one_line_errors: its connection closes, they read the store)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return work()
    first = int(os.environ.get("LOCAL_RANK", 0)) == 0
    done = work() if first else None
    dist.barrier()
    return done if first else work()


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


def rows_per_rank(batch_tokens, context, world) -> int:
    """This rank's rows per step: the global batch, batch_tokens // context rows, shared equally by the ranks (a
    remainder would be dropped: it is refused, naming the nearest batches the ranks can share)."""
    rows = batch_tokens // context
    if rows % world == 0 and rows:
        return rows // world
    if world == 1:
        raise ValueError(f"batch_tokens: {batch_tokens} is less than one row of {context} tokens; raise it or lower "
                         "context_length")  # fmt: skip
    fits = [r for r in (rows // world * world, (rows // world + 1) * world) if r]  # rows the ranks can share
    use = " or ".join(f"--batch_tokens={r * context} ({r} rows)" for r in fits)
    raise ValueError(
        f"batch_tokens: {batch_tokens} makes {rows} row(s) of {context} tokens, which {world} ranks cannot share "
        f"equally; use {use}"
    )


def one_line_errors(command):
    """Run `command` (train.py's run) on this rank. A user's mistake (ValueError, OSError, ImportError: a missing
    optional package; FloatingPointError: a NaN stop) ends it in one line, told to the other ranks; another rank's
    mistake, or its loss, ends this one with that rank's line (`why_lost`). Exit code 2, no traceback."""
    with sigterm_ends_this_rank() as ending:
        try:
            command()
            return
        except (ValueError, OSError, ImportError, FloatingPointError) as e:
            ending()
            lines = tell_the_others(str(e).splitlines())  # several mistakes in a config: one line each
        except Exception as e:  # another rank failed: its line, or that it was lost
            ending()
            if not lost(e):
                raise
            lines = why_lost(e)
        for line in lines:
            print(f"error: {line}", file=sys.stderr)
    raise SystemExit(2)
