"""Which elements does LoRA dropout drop, the same on any number of ranks?

LoRA's dropout (lora.py) acts on the adapter branch's input. Drawn from torch's generator, its mask would depend on
which rank a row lands on and which micro-batch it shares: a run on 4 ranks, on 1, or resumed on another number of
ranks would train differently, and a checkpoint would have to carry every rank's generator state. Here the mask is a
hash instead: of a key per row and of each element's place in that row, nothing else. train.py keys a row by (seed,
step, its index in the step's global batch) through `dropout_rows`, and each adapted linear mixes in its own index, so
a row drops the same features whichever rank and micro-batch it falls in, and again when activation checkpointing
recomputes the forward.

The hash is SplitMix64's finalizer (Steele et al. 2014) on int64 tensors, in place. It is also the CPU's speed-up: one
64-bit hash gives four 16-bit draws, so a mask costs what drawing a quarter of the input's elements as random int64
would, where a Bernoulli draw per element costs more than the small matmul it guards. p is rounded to a multiple of
1/65536.

`KeyedDropout` is the module a LoRA linear holds, chosen once when the layer is built (nn.Identity when p is 0). It
holds p as nn.Dropout does (PEFT's adapter_config reads it there), and the op that applies the mask: `keyed_dropout`
here, or on CUDA the one-kernel op of support/kernels/dropout_cuda.py that the model's builder hands it. Outside
`dropout_rows` (a plain forward in training mode) it keys each row from torch's generator.
"""

from contextlib import contextmanager

import torch
import torch.nn as nn


def _signed(c):  # a 64-bit constant as the int64 torch holds it
    return c - 2**64 if c >= 2**63 else c


GOLDEN = _signed(0x9E3779B97F4A7C15)  # 2**64 / the golden ratio: SplitMix64's step between counters
MIX1 = _signed(0xBF58476D1CE4E5B9)  # the finalizer's two multipliers
MIX2 = _signed(0x94D049BB133111EB)
DRAW_BITS = 16  # bits of one uniform draw; four to a 64-bit hash
DRAWS = 2**DRAW_BITS


def mix64_(z):
    """SplitMix64's finalizer, in place on an int64 tensor: every output bit depends on every input bit. int64
    products wrap as uint64's do; `>>` is arithmetic on int64, so the masks make each shift logical. In place, because
    fresh int64 tensors of a quarter of the input's elements cost more than the arithmetic."""
    z ^= (z >> 30) & (2**34 - 1)
    z *= MIX1
    z ^= (z >> 27) & (2**37 - 1)
    z *= MIX2
    z ^= (z >> 31) & (2**33 - 1)
    return z


def keyed_dropout(x, p, keys):
    """Dropout of x (rows, ...) whose mask is a function of each row's key (keys: (rows,) int64) and of each element's
    place in its row, nothing else; the kept elements are scaled by 1 / (1 - p)."""
    if keys.shape != x.shape[:1]:
        raise ValueError(f"keyed_dropout: {tuple(keys.shape)} keys for an input of {x.shape[0]} rows")
    threshold = round(p * DRAWS)  # a draw below it drops its element
    row_numel = x[0].numel()
    counters = torch.arange(-(-row_numel // 4), device=x.device).mul_(GOLDEN)  # (ceil(n / 4),): the hashes of a row
    bits = mix64_(keys.to(x.device)[:, None] + counters)  # (rows, ceil(n / 4)) int64
    # Four 16-bit draws from each hash, cut out by shifts: viewing the int64 hashes as int16 would be cheaper, but
    # Inductor miscompiles such a view next to a matmul when shapes are dynamic.
    keeps = [(bits >> shift).bitwise_and_(DRAWS - 1) >= threshold for shift in (0, 16, 32, 48)]
    keep = torch.stack(keeps, -1).flatten(1)[:, :row_numel].view(x.shape)
    return x * keep * (DRAWS / (DRAWS - threshold))


def row_keys(seed, step, rows, device=None):
    """(len(rows),) int64 keys of the rows `rows` (indices in optimizer step `step`'s global batch) for a run seeded
    `seed`: the dropout of a row is a function of these three numbers only."""
    rows = torch.as_tensor(rows, dtype=torch.int64, device=device)
    return mix64_(mix64_(mix64_(torch.full_like(rows, seed)) ^ step) ^ rows)


class KeyedDropout(nn.Module):
    """Dropout with probability p whose mask keyed_dropout derives from `keys` (one int64 per row of the input, set by
    dropout_rows), or from keys drawn from torch's generator where none are set. In eval mode, the identity. `op`
    applies it: keyed_dropout, or an implementation with its bits (support/kernels/dropout_cuda.py)."""

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
        elif self.first_token:  # a tile of the rows: its elements' hashes continue the row's (see tile_of_rows)
            first = self.first_token * x[0, 0].numel()  # the tile's first element's place in its row
            if first % 4:
                raise ValueError(f"keyed dropout: a tile starting at element {first} of its rows, not a multiple of 4")
            keys = keys + _signed(first // 4 * GOLDEN % 2**64)
        return self.op(x, self.p, keys)

    def extra_repr(self):
        return f"p={self.p}"


@contextmanager
def tile_of_rows(module, first_token):
    """Within the block, the KeyedDropouts of `module` see tiles of their rows (x (rows, tile, in), tokens first_token..
    of each row; support/kernels/long_context.py's tiled MLP) and drop what they would drop in the whole rows. A row's
    element e takes its draw from hash number e // 4 of the row, hash c being mix64(key + c * GOLDEN); a tile whose
    first element is e0 = first_token * in starts at hash e0 // 4, so its key is the row's plus (e0 // 4) * GOLDEN
    (exact when e0 is a multiple of 4, as it is for tiles of a multiple of 4 tokens; otherwise an error)."""
    dropouts = [m for m in module.modules() if isinstance(m, KeyedDropout)]
    for dropout in dropouts:
        dropout.first_token = first_token
    try:
        yield
    finally:
        for dropout in dropouts:
            dropout.first_token = 0


@contextmanager
def dropout_rows(model, keys):
    """Within the block, every KeyedDropout of `model` drops features by the row keys `keys` (row_keys: one per row of
    the micro-batch in flight), each module hashing them with its own index (its place among the model's dropouts);
    forward and backward (and activation checkpointing's recomputation) must run inside. keys None: a model without
    dropout, nothing to set."""
    if keys is None:
        yield
        return
    dropouts = [m for m in model.modules() if isinstance(m, KeyedDropout)]
    for index, dropout in enumerate(dropouts):
        dropout.keys = mix64_(keys ^ _signed((index + 1) * GOLDEN % 2**64))
    try:
        yield
    finally:
        for dropout in dropouts:
            dropout.keys = None
