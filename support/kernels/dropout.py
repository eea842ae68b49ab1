"""Which elements does LoRA dropout drop, the same on any number of ranks?

The mask hashes (SplitMix64's finalizer, Steele et al. 2014) a key per row and each element's place in its row, not
torch's generator: train.py keys a row by (seed, step, its index in the step's global batch) through `dropout_rows`, so
a row drops the same on any rank, in any micro-batch, and when recomputed. A hash gives four 16-bit draws: p is rounded
to a multiple of 1/65536.

Compiled blocks off CUDA apply it as the op `KEYED_OP`, which torch.compile calls but does not trace into: Inductor's
C++ code for the hash is wrong (docs/internals.md), so they drop by the same eager code, bit for bit on every CPU. The
op's backward is the op again on the gradient (dropout is linear in x): no mask is kept, the hash runs twice.
"""

import sys
from contextlib import contextmanager, nullcontext

import torch
import torch.nn as nn
from torch import Tensor


def _signed(c):  # a 64-bit constant as the int64 torch holds it
    return c - 2**64 if c >= 2**63 else c


GOLDEN = _signed(0x9E3779B97F4A7C15)  # 2**64 / the golden ratio: SplitMix64's step between counters
MIX1 = _signed(0xBF58476D1CE4E5B9)  # the finalizer's two multipliers
MIX2 = _signed(0x94D049BB133111EB)
DRAW_BITS = 16  # bits of one uniform draw; four to a 64-bit hash
DRAWS = 2**DRAW_BITS
HALF = 2 ** (DRAW_BITS - 1)  # an int16's sign bit


def mix64_(z):
    """SplitMix64's finalizer, in place (fresh int64 tensors cost more than the arithmetic). int64 products wrap as
    uint64's do; `>>` is arithmetic on int64, so the masks make each shift logical."""
    z ^= (z >> 30) & (2**34 - 1)
    z *= MIX1
    z ^= (z >> 27) & (2**37 - 1)
    z *= MIX2
    z ^= (z >> 31) & (2**33 - 1)
    return z


def keyed_dropout(x, p, keys, first=0):
    """Dropout of x (rows, ...) whose mask is a function of each row's key (keys: (rows,) int64) and of each element's
    place in its row, nothing else; the kept elements are scaled by 1 / (1 - p). first: x's first element's place in
    its rows, where x is a tile of them (see tile_of_rows)."""
    if keys.shape != x.shape[:1]:
        raise ValueError(f"keyed_dropout: {tuple(keys.shape)} keys for an input of {x.shape[0]} rows")
    threshold = round(p * DRAWS)  # a draw below it drops its element
    row_numel = x[0].numel()
    counters = torch.arange(-(-row_numel // 4), device=x.device).mul_(GOLDEN)  # (ceil(n / 4),): the hashes of a row
    bits = mix64_(tile_keys(keys.to(x.device), first)[:, None] + counters)  # (rows, ceil(n / 4)) int64
    draws = bits.view(torch.int16).view(*bits.shape, 4)  # (rows, ceil(n / 4), 4): each hash's 16-bit draws
    if sys.byteorder == "big":
        draws = draws.flip(-1)  # the low 16 bits first, as on a little-endian CPU
    # the draw d in [0, 65536) held as the int16 s: s ^ -32768 is d - 32768, so d >= t is s ^ -32768 >= t - 32768
    # (t - 32768 fits an int16 for every p < 1)
    keep = (draws ^ -HALF).flatten(1)[:, :row_numel].view(x.shape) >= threshold - HALF
    return x * keep * (DRAWS / (DRAWS - threshold))


def tile_keys(keys, first):
    """The keys of a tile of the rows starting at element `first` (a multiple of 4): element e of a row draws from
    hash e // 4 = mix64(key + (e // 4) * GOLDEN), so the tile's keys are the rows' plus (first // 4) * GOLDEN."""
    if first % 4:
        raise ValueError(f"keyed dropout: a tile starting at element {first} of its rows, not a multiple of 4")
    return keys + _signed(first // 4 * GOLDEN % 2**64) if first else keys


@torch.library.custom_op("nanoqlora::keyed_dropout", mutates_args=())
def keyed_dropout_op(x: Tensor, p: float, keys: Tensor, first: int = 0) -> Tensor:
    """keyed_dropout as one op, opaque to torch.compile (the CUDA op is dropout_cuda.py's)."""
    return keyed_dropout(x, p, keys, first)


@keyed_dropout_op.register_fake
def _(x, p, keys, first=0):  # what the compiler needs: the output's metadata
    return torch.empty_like(x)


def register_backward_(op):
    """Give op(x, p, keys, first) its backward: the same op, p, keys and first on the gradient (dropout is linear in
    x); only the keys are saved."""

    def save_keys(ctx, inputs, output):
        ctx.p = inputs[1]
        ctx.first = inputs[3]
        ctx.save_for_backward(inputs[2])

    def backward(ctx, grad):
        (keys,) = ctx.saved_tensors
        return op(grad, ctx.p, keys, ctx.first), None, None, None

    op.register_autograd(backward, setup_context=save_keys)


register_backward_(keyed_dropout_op)
KEYED_OP = torch.ops.nanoqlora.keyed_dropout.default  # as KeyedDropout holds it


def row_keys(seed, step, rows, device=None):
    """(len(rows),) int64 keys of the rows `rows` (indices in step `step`'s global batch) of a run seeded `seed`."""
    rows = torch.as_tensor(rows, dtype=torch.int64, device=device)
    return mix64_(mix64_(mix64_(torch.full_like(rows, seed)) ^ step) ^ rows)


class KeyedDropout(nn.Module):
    """Dropout with probability p (held as nn.Dropout holds it, where PEFT reads it) masked by `op` (keyed_dropout,
    KEYED_OP or dropout_cuda.py's) from `keys`, one int64 per row set by dropout_rows, else drawn from torch's
    generator."""

    def __init__(self, p, op=None):
        super().__init__()
        if not 0 <= p <= 1:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p = p
        self.op = op or keyed_dropout
        self.keys = None  # (rows,) int64 while dropout_rows is in effect
        self.first_token = 0  # x's first token's place in its rows, while tile_of_rows is in effect

    def forward(self, x):  # x (rows, ..., in) -> the same shape and dtype
        if not self.training:
            return x
        keys = self.keys
        if keys is None:  # outside dropout_rows: a key per row from torch's generator
            keys = torch.randint(-(2**63), 2**63 - 1, x.shape[:1], dtype=torch.int64, device=x.device)
        first = self.first_token * x[0, 0].numel()  # x's first element's place in its rows (see tile_of_rows)
        return self.op(x, self.p, keys, first)

    def extra_repr(self):
        return f"p={self.p}"


def tile_of_rows(module, first_token):
    """Within the block, the KeyedDropouts of `module` see tiles of their rows (x (rows, tile, in), from token
    first_token) and drop what the whole rows would (tile_keys; a tile's first element a multiple of 4, else an
    error)."""
    return _set_within(module, "first_token", lambda index: first_token, 0)


def dropout_rows(model, keys):
    """Within the block, every KeyedDropout of `model` drops by the row keys `keys` (row_keys: one per row of the
    micro-batch), each hashing them with its index among the model's dropouts; forward and backward (and any
    recomputation) must run inside. keys None: a model without dropout."""
    if keys is None:
        return nullcontext()
    return _set_within(model, "keys", lambda index: mix64_(keys ^ _signed((index + 1) * GOLDEN % 2**64)), None)


@contextmanager
def _set_within(module, name, value, after):
    """Within the block, attribute `name` of the index-th KeyedDropout of `module` is value(index); then `after`."""
    dropouts = [m for m in module.modules() if isinstance(m, KeyedDropout)]
    for index, dropout in enumerate(dropouts):
        setattr(dropout, name, value(index))
    try:
        yield
    finally:
        for dropout in dropouts:
            setattr(dropout, name, after)
