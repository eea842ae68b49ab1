"""How does a block train on one very long sequence without holding its activations?

With activation checkpointing (model.py) a block keeps only its input between forward and backward, 2h bytes a token
in bf16, and recomputes itself in backward. Two costs remain that grow with the sequence, and this file removes each:

Tiled MLP. While one block is recomputed and differentiated, everything it saves is alive at once. The MLP saves the
most: gate, silu(gate) and up, 3 x intermediate_size values a token (Llama-3-8B: 43,008 against a hidden size of 4,096),
plus the LoRA branches' inputs. `tiled_mlp` runs the MLP over tiles of `tile` tokens of each row, each tile checkpointed
on its own: the forward keeps only the tile's input (a view of the norm's output, which is kept anyway), and backward
recomputes and differentiates one tile at a time, so the MLP's intermediates exist for one tile only. The MLP acts on
each token alone, so the tiles' outputs are the MLP's output, and their gradients sum to its gradients (in another
order: equal within rounding). LoRA's keyed dropout drops in a tile what it drops in the whole row
(support/kernels/dropout.py's tile_of_rows). The price is one more forward of the MLP per step (about a sixth more
compute with checkpointing).

Offloaded checkpoints. The block inputs checkpointing keeps add up to 2h bytes x tokens x layers (an 8B model: 256 KiB
a token, 32 GiB at 128K tokens). `OffloadedSaves` is a pair of saved-tensor hooks (torch.autograd.graph) around the
checkpointed blocks: what autograd saves there, each checkpoint's inputs, is copied to CPU memory as it is saved and
copied back when backward asks for it, so the GPU holds the inputs of none of the blocks (one block's, while it is
recomputed). On CUDA the host copies are pinned and made on a side stream that waits for the compute stream, so the
copy of block k's input overlaps block k's forward; record_stream tells the caching allocator that the GPU tensor is
in use there until the copy ends, so it is not reused too early. RoPE's cos and sin go into every checkpoint and are
copied once; what is in CPU memory already (the documents' bounds, which the per-document attention reads on the host)
stays as it is. On CPU the same hooks run (a copy to a fresh tensor): nothing moves, and the tests prove the losses
and gradients through them.

Both are settings of train.py (mlp_tile_tokens, offload_checkpoints) and known to support/accounting/memory.py's
estimate.
"""

import weakref

import torch
from torch.utils.checkpoint import checkpoint

from support.kernels.dropout import tile_of_rows


def tiled_mlp(mlp, x, tile):
    """mlp(x) for x (B, T, hidden), `tile` tokens of every row at a time, each tile recomputed in backward."""
    tiles = [(first, part) for first, part in zip(range(0, x.shape[1], tile), x.split(tile, dim=1), strict=True)]
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
