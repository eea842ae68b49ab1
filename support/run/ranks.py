"""How do the processes of a run share it: where each computes, how they stay in step, how a model too large for one
GPU is sharded over them (FSDP2), and how a run ends when one of them fails?

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

Sharding: a model too large for one GPU
---------------------------------------
QLoRA sharded with PyTorch's FSDP2 (`fully_shard`). DDP replicates the whole base on every GPU: a 70B model in NF4 is
about 37 GB of weights before any activation, more than a 24 or 48 GB card holds. Fully sharded data parallelism
(Rajbhandari et al., ZeRO, https://arxiv.org/abs/1910.02054; PyTorch FSDP, https://arxiv.org/abs/2304.11277) splits
every parameter across the N ranks instead: each keeps 1/N of the base and of the adapters, gathers one block's weights
for its forward (and again for its backward), and frees them after; the adapters' gradients are reduce-scattered, so
each rank's optimizer holds only its shard.

The NF4 base shards like any weight. FSDP2 shards parameters, not buffers, so the four buffers of every NF4 linear (the
packed codes, the 8-bit absmax, the nested absmax, the offset) become frozen parameters first (`params_from_nf4`).
Tensors of different dtypes are all-gathered as their raw bytes (FSDP2 views mixed-dtype groups as uint8), so the bytes
a rank gathers are bit for bit the bytes a single process holds, and dequantization gives the same weight. The offset, a
0-d tensor, becomes shape (1,), which broadcasts the same. No MixedPrecisionPolicy: every tensor stays in its stored
dtype (NF4 bytes, a 16-bit base, fp32 LoRA masters) and bf16 autocast computes as without sharding.

Loading: train.load_model builds every model block by block, and a sharded one takes a step more after each part: rank 0
reads its 16-bit weights and quantizes them one at a time while the other ranks hold zeros of the same shapes
(`what_this_rank_reads`), every rank adds the block's adapters (in the same order, so from the same random draws, as one
process adds them), the block is sharded, and rank 0 sends each rank its shards of what it read (`shard_part`), which
frees the whole block everywhere. The checkpoint is read, and quantized, once across the ranks, and no rank ever holds
more than its shards plus one block. The loss: each rank divides its summed loss by the global number of supervised
tokens, so the gradients must be summed over ranks, not averaged: the divide factor is 1. With several micro-batches a
step, gradients are reduce-scattered after the last one only (`sync_gradients`).

What needs every rank: a sharded model computes only when all ranks run the same forward, so evaluation, samples and
adapter health run on every rank (rank 0 keeps the results); checkpoints gather full tensors so that a run resumes on
any number of ranks, or on one process. torch.compile (model.Options.compile) compiles each block's forward, which runs
inside the block's own call, so FSDP's hooks gather and free its weights around the graph. A merged export is not
offered with FSDP: it needs the whole model in one place.
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
    one line rather than silently; inside, run_dir.stop_requests takes it as a request to stop after the step. Yields
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


def params_from_nf4(module):
    """Re-register the NF4 buffers of every NF4Linear under `module` as frozen parameters (FSDP2 shards parameters);
    the offset becomes shape (1,)."""
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
    """(checkpoint, weights) as train.load_model reads them here: the files themselves, unless the model is sharded
    and this is not rank 0, which reads nothing and holds zeros of each tensor's shape until rank 0 scatters them."""
    if shard is None or dist.get_rank() == 0:
        return ckpt, weights
    unread = Unread(model, device)
    return unread, unread


def sharded_over(shard) -> str:
    """The end of the model's one line: ', sharded over N rank(s)', or '' when not sharded."""
    return "" if shard is None else f", sharded over {shard['mesh'].size()} rank(s)"


def shard_part(part, shard):
    """train.load_model's step for a part it has built (a block, then the whole model): its NF4 buffers become frozen
    parameters, it is sharded, and rank 0 sends each rank its shards; the whole model's gradients are then summed.
    Nothing when not sharded (shard None)."""
    if shard is None:
        return
    if not isinstance(part, Llama):
        params_from_nf4(part)
    shard_from_rank0(part, shard)  # from here this rank keeps only its shard of the part
    if isinstance(part, Llama):
        for m in part.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)  # the loss is already divided by the global supervised-token count
                m.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-multiplied sum)


class Unread:
    """The checkpoint as the ranks that do not read it see it: zeros of each tensor's shape, for hf.load_weights_
    (`get`) and for quant.quantize_ (called with a key: an NF4Weight of zeros, or a zero bias)."""

    def __init__(self, model, device):
        self.shapes, self.device = {n: p.shape for n, p in model.named_parameters()}, device

    def get(self, name, shape=None):
        return torch.zeros(shape or self.shapes[name], device=self.device)

    def __call__(self, key):
        return self.get(key) if key.endswith(".bias") else quant.zeros_nf4(self.shapes[key].numel(), self.device)


@torch.no_grad()
def shard_from_rank0(module, shard):
    """fully_shard(module), then each of its frozen parameters not sharded before (a block's are, when the root is)
    filled from rank 0's whole tensor: rank 0 sends every rank its shard (distribute_tensor from rank 0), so the
    checkpoint is read once across the ranks. The adapters are drawn alike on every rank and stay as they are."""
    whole = {n: p for n, p in module.named_parameters() if not p.requires_grad and not isinstance(p, DTensor)}
    fully_shard(module, **shard)
    for name, p in module.named_parameters():
        if name in whole and shard["mesh"].size() > 1:
            sent = distribute_tensor(whole.pop(name), p.device_mesh, p.placements, src_data_rank=0)
            p.to_local().copy_(sent.to_local())


def resident_bytes(model) -> tuple[int, int]:
    """(bytes of the parameters this rank holds now, bytes of the whole model's): a sharded parameter counts its local
    shard, a gathered one (a block in its forward) in full."""
    held = whole = 0
    for p in model.parameters():
        held += (p.to_local() if isinstance(p, DTensor) else p).nbytes
        whole += p.numel() * p.element_size()
    return held, whole


def is_sharded(model) -> bool:
    return isinstance(model, FSDPModule)


def sync_gradients(model, last: bool):
    """Gradients of a sharded model are reduce-scattered once a step: after the backward of its `last` micro-batch;
    before, each rank sums its micro-batches' gradients unsharded (the adapters' only: the base has none)."""
    if is_sharded(model):
        model.set_requires_gradient_sync(last)


def full(t):
    """The whole tensor of a parameter or optimizer state on every rank (a collective for a DTensor)."""
    return t.full_tensor() if isinstance(t, DTensor) else t
