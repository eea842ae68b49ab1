"""How does a block train on one very long sequence without holding its activations?

Beyond activation checkpointing (docs/performance.md; docs/support.md: how): `tiled_mlp` runs the MLP over tiles of
tokens, each checkpointed on its own, so its (tokens, intermediate) tensors exist for one tile at a time, for one more
MLP forward a step; `OffloadedSaves` keeps what autograd saves in the checkpointed blocks (their inputs) in CPU memory
until backward.
"""

import weakref

import torch
from torch.utils.checkpoint import checkpoint

from support.kernels.dropout import tile_of_rows


@torch.compiler.disable  # eager inside a compiled block: dynamo fails on a checkpoint around adapted linears
def tiled_mlp(mlp, x, tile):
    """mlp(x) for x (B, T, hidden), `tile` tokens of every row at a time, each tile recomputed in backward."""
    tiles = zip(range(0, x.shape[1], tile), x.split(tile, dim=1), strict=True)
    return torch.cat([checkpoint(mlp_tile, mlp, part, first, use_reentrant=False) for first, part in tiles], dim=1)


def mlp_tile(mlp, part, first):
    """The MLP on tokens first.. of every row: part (B, t, hidden) -> (B, t, hidden)."""
    with tile_of_rows(mlp, first):
        return mlp(part)


class OffloadedSaves(torch.autograd.graph.saved_tensors_hooks):
    """Within the block, tensors autograd saves (a checkpoint's inputs) live in CPU memory until backward needs them."""

    def __init__(self, device):
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.copies = {}  # id(tensor) -> (weakref to it, its packed copy): a tensor saved twice is copied once
        super().__init__(self.pack, self.unpack)

    def pack(self, t):
        known = self.copies.get(id(t))
        if known is not None and known[0]() is t:
            return known[1]
        if self.side is not None and not t.is_cuda:  # in CPU memory already (the documents' bounds): kept as it is
            return (None, t, None)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.side is not None)
        if self.side is None:
            host.copy_(t)
            packed = (t.device, host, None)
        else:
            self.side.wait_stream(torch.cuda.current_stream(t.device))  # t is written
            with torch.cuda.stream(self.side):
                host.copy_(t, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record()
            t.record_stream(self.side)  # t's memory is not reused before the copy has read it
            packed = (t.device, host, copied)
        self.copies[id(t)] = (weakref.ref(t), packed)
        return packed

    @staticmethod
    def unpack(packed):
        device, host, copied = packed
        if device is None:
            return host
        if copied is None:
            return host.to(device, copy=True)
        torch.cuda.current_stream(device).wait_event(copied)  # the host copy is complete before it is read back
        return host.to(device, non_blocking=True)
