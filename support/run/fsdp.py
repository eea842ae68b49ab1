"""How does a model too large for one GPU train? QLoRA sharded with PyTorch's FSDP2 (`fully_shard`).

DDP replicates the whole base on every GPU: a 70B model in NF4 is about 37 GB of weights before any activation, more
than a 24 or 48 GB card holds. Fully sharded data parallelism (Rajbhandari et al., ZeRO, https://arxiv.org/abs/1910.02054;
PyTorch FSDP, https://arxiv.org/abs/2304.11277) splits every parameter across the N ranks instead: each keeps 1/N of
the base and of the adapters, gathers one block's weights for its forward (and again for its backward), and frees them
after; the adapters' gradients are reduce-scattered, so each rank's optimizer holds only its shard.

The NF4 base shards like any weight. FSDP2 shards parameters, not buffers, so the four buffers of every NF4 linear
(the packed codes, the 8-bit absmax, the nested absmax, the offset) become frozen parameters first (`params_from_nf4`).
Tensors of different dtypes are all-gathered as their raw bytes (FSDP2 views mixed-dtype groups as uint8), so the
bytes a rank gathers are bit for bit the bytes a single process holds, and dequantization gives the same weight. The
offset, a 0-d tensor, becomes shape (1,), which broadcasts the same. No MixedPrecisionPolicy: every tensor stays in
its stored dtype (NF4 bytes, a 16-bit base, fp32 LoRA masters) and bf16 autocast computes as without sharding.

Loading: train.load_model builds every model block by block, and a sharded one takes a step more after each part: rank
0 reads its 16-bit weights and quantizes them one at a time while the other ranks hold zeros of the same shapes
(`what_this_rank_reads`), every rank adds the block's adapters (in the same order, so from the same random draws, as
one process adds them), the block is sharded, and rank 0 sends each rank its shards of what it read (`shard_part`),
which frees the whole block everywhere. The
checkpoint is read, and quantized, once across the ranks, and no rank ever holds more than its shards plus one
block. The loss: each rank divides its summed loss by the global number of supervised tokens, so the gradients must be
summed over ranks, not averaged: the divide factor is 1. With several micro-batches a step, gradients are
reduce-scattered after the last one only (`sync_gradients`).

What needs every rank: a sharded model computes only when all ranks run the same forward, so evaluation, samples and
adapter health run on every rank (rank 0 keeps the results); checkpoints gather full tensors so that a run resumes on
any number of ranks, or on one process. torch.compile (model.Options.compile) compiles each block's forward, which
runs inside the block's own call, so FSDP's hooks gather and free its weights around the graph. A merged export
is not offered with FSDP: it needs the whole model in one place.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

import quant
from model import Llama


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
