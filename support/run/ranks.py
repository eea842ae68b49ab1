"""How do the processes of a run share it: where each computes, how they stay in step, how a model too large for one
GPU is sharded over them (FSDP2), and how a run ends when one of them fails?

Every rank must call the same collectives in the same order, or the others wait for it forever: what a rank decides
from what only it sees is agreed first (`reduce_min`, stopping.any_rank). A rank that stops on a user error leaves its
line in the process group's store (`tell_the_others`); the others' next collective fails, and each prints that line,
or that a rank was lost, and exits with code 2. A sharded model is built block by block: rank 0 reads and quantizes,
the others hold zeros, and rank 0 sends each rank its shards (`shard_part`).
"""

import gc
import os
import signal
import sys
import threading
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

import quant
from model import Llama

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


def setup(cfg, shard=False) -> Placement:
    """Device and process group from torchrun's RANK/WORLD_SIZE/LOCAL_RANK (plain python: one process; `shard`: FSDP,
    which needs a group even then); the dtype is chosen later (pick_precision). On CUDA, fp32 matmuls use TF32 only
    when cfg.tf32 asks."""
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.fp32_precision = "tf32" if cfg.tf32 else "ieee"
    if world > 1 or shard:  # FSDP needs a process group, one process or many
        init_process_group("nccl" if use_cuda else "gloo", rank, world, cfg.rank_timeout)
    return Placement(rank, world, device)


class RankLost(Exception):
    """Another rank is gone: this one's collectives have no partner left."""


def init_process_group(backend, rank, world, timeout_minutes):
    """The default process group, bounded by `timeout_minutes`; its store is kept for the ranks' one-line errors."""
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
    """Destroy the default process group while the interpreter is whole: a sharded model's reference cycles, freed at
    exit, could abort a finished run (SIGABRT). The caller drops its references to the model and optimizer first; their
    cycles are collected too where they hold a GPU's memory (a next run in this process sizes its micro-batch from what
    is free), and not otherwise (a collection of a large heap takes a while)."""
    if dist.is_initialized() or torch.cuda.is_initialized():
        gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def reduce_min(value: int, world: int, device) -> int:
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
        with suppress(RuntimeError, dist.DistError):  # the store's host may be gone too: this rank still says it
            store.compare_set(ERROR_KEY, "", f"{dist.get_rank()}\n" + "\n".join(lines))
    return lines


def why_lost(e: BaseException) -> list[str]:
    """What a rank whose partner is gone prints: the error another rank left in the store, else what `e` says."""
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
    """SIGTERM outside the training loop (torchrun's, once a rank has failed) ends this rank with one line. Yields
    `ending()`, which ignores SIGTERM from then on (to the end: torchrun's would turn exit code 2 into -15)."""
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
    """This rank's share of the batch_tokens // context rows of a step; a remainder is refused, naming the nearest
    batches the ranks can share."""
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
    """Run `command` on this rank. A user's mistake (ValueError, OSError, ImportError, FloatingPointError: a NaN stop)
    ends it in one line, told to the other ranks; another rank's mistake, or its loss, ends this one with that rank's
    line. Exit code 2, no traceback."""
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


def params_from_nf4(module):
    """The NF4 buffers under `module` as frozen parameters (FSDP2 shards only parameters); the offset as shape (1,)."""
    for m in module.modules():
        if isinstance(m, quant.NF4Linear):
            for name in quant.BUFFERS:
                t = m._buffers.pop(name)
                m.register_parameter(name, nn.Parameter(t.reshape(1) if name == "offset" else t, requires_grad=False))


def sharding(device, world, cpu_offload=False) -> dict:
    """fully_shard's mesh (`world` ranks) and policy (parameters in CPU memory between uses, or not)."""
    mesh = init_device_mesh(device.type, (world,))
    return dict(mesh=mesh, offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())


def what_this_rank_reads(model, ckpt, weights, device, shard):
    """(checkpoint, weights) as train.load_model reads them here: the files, or zeros of each tensor's shape on a
    rank other than 0 of a sharded model, until rank 0 scatters them."""
    if shard is None or dist.get_rank() == 0:
        return ckpt, weights
    unread = Unread(model, device)
    return unread, unread


def sharded_over(shard) -> str:
    return "" if shard is None else f", sharded over {shard['mesh'].size()} rank(s)"


@torch.no_grad()
def shard_part(part, shard):
    """Shard a part train.load_model has built (a block, then the whole model), its frozen parameters not sharded
    before filled from rank 0's whole tensors; the whole model's gradients are then summed over ranks. The adapters,
    drawn alike on every rank, stay as they are. Nothing when shard is None."""
    if shard is None:
        return
    if not isinstance(part, Llama):
        params_from_nf4(part)
    whole = {n: p for n, p in part.named_parameters() if not p.requires_grad and not isinstance(p, DTensor)}
    fully_shard(part, **shard)  # from here this rank keeps only its shard of the part
    for name, p in part.named_parameters():
        if name in whole and shard["mesh"].size() > 1:
            sent = distribute_tensor(whole.pop(name), p.device_mesh, p.placements, src_data_rank=0)
            p.to_local().copy_(sent.to_local())
    if isinstance(part, Llama):
        for m in part.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)  # the loss is already divided by the global supervised-token count
                m.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-multiplied sum)


class Unread:
    """The checkpoint as the ranks that do not read it see it: zeros of each tensor's shape, for hf.load_weights_
    (`get`) and quant.quantize_ (called with a key)."""

    def __init__(self, model, device):
        self.shapes, self.device = {n: p.shape for n, p in model.named_parameters()}, device

    def get(self, name, shape=None):
        return torch.zeros(shape or self.shapes[name], device=self.device)

    def __call__(self, key):
        return self.get(key) if key.endswith(".bias") else quant.zeros_nf4(self.shapes[key].numel(), self.device)


def resident_bytes(model) -> tuple[int, int]:
    """(bytes of the parameters this rank holds now, bytes of the whole model's)."""
    held = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters())
    return held, sum(p.numel() * p.element_size() for p in model.parameters())


def is_sharded(model) -> bool:
    return isinstance(model, FSDPModule)


def sync_gradients(model, last: bool):
    """A sharded model's gradients are reduce-scattered once a step, after the backward of its `last` micro-batch."""
    if is_sharded(model):
        model.set_requires_gradient_sync(last)


def full(t):
    """The whole tensor on every rank (a collective for a DTensor)."""
    return t.full_tensor() if isinstance(t, DTensor) else t
