"""LoRA adapters: add them to a (possibly NF4-quantized) Llama, train them, merge them into the base.

LoRA (Hu et al. 2021, https://arxiv.org/abs/2106.09685) freezes a pretrained linear layer W (out, in) and learns a
low-rank update instead of W itself:

    y = x W^T + scale * B(A(dropout(x)))        A: (r, in), B: (out, r), r << min(in, out)

so a 4096x4096 projection trains 2 * 4096 * r numbers instead of 16.7M. A starts Kaiming-uniform (as nn.Linear and
PEFT do: kaiming_uniform_ with a=sqrt(5)) and B starts at zero, so at step 0 the product B A is exactly zero: the
adapted model *is* the base model and training starts from its behaviour rather than from noise. B's gradient is then
non-zero (it sees A x) while A only starts moving once B has. `scale = alpha / r` keeps the update's size roughly
independent of r for a fixed learning rate; rsLoRA (Kalajdzievski 2023, https://arxiv.org/abs/2312.03732) shows that
this makes large ranks learn no better than small ones and that `alpha / sqrt(r)` is the rank-stable choice. Dropout
acts on the LoRA branch's input only. Its mask is a hash of each row's key and each element's place in the row, not a
draw from torch's generator: train.py keys a row by (seed, step, its index in the step's global batch) through
`dropout_rows`, so a row drops the same features whichever rank and micro-batch it falls in, and again when activation
checkpointing recomputes the forward. A run on 4 ranks, on 1, or resumed on another number of ranks trains the same.

QLoRA (Dettmers et al. 2023, https://arxiv.org/abs/2305.14314) keeps the frozen W in 4-bit NF4 (quant.py) and trains
the same A, B on top: y = x dequant(W_nf4)^T + scale * B A x. The LoRA linears here are thin subclasses of the base
class (LoRALinear(nn.Linear), LoRANF4Linear(quant.NF4Linear)) that take over the base's own tensors, so the base keeps
its names (`q_proj.weight`, the NF4 buffers too) and the adapter adds `q_proj.lora_A.weight` / `q_proj.lora_B.weight`.
LoRA parameters live in the base's floating dtype unless `lora_dtype` says otherwise (e.g. fp32 masters under bf16
autocast); the branch always computes in the input's dtype.

Merging folds the update into the base, W' = W + scale * B @ A ((out, r) @ (r, in) -> (out, in), computed in fp32),
after which the model is a plain Llama with no inference overhead. The NF4 caveat: the adapter was trained against
dequant(W_nf4), not W. Merging into the dequantized weights reproduces the adapter-on-4-bit model exactly but bakes
the 4-bit rounding error into a 16-bit model; merging into the original 16-bit weights gives the model users expect,
and differs from what was trained by exactly the quantization error. merge_lora_ uses the original weights whenever
it is given them and reports, per module, which weights it started from.

Adapters are saved and loaded in PEFT's format by support/hf.py, so transformers + PEFT read them.
"""

import math
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

import quant
from model import find_linears


def lora_scale(r, alpha, use_rslora=False):
    """alpha / r, or rsLoRA's rank-stable alpha / sqrt(r)."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def _signed(c):  # a 64-bit constant as the int64 torch holds it
    return c - 2**64 if c >= 2**63 else c


GOLDEN, MIX1, MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def mix64_(z):
    """SplitMix64's finalizer (Steele et al. 2014), in place on an int64 tensor: every output bit depends on every
    input bit. int64 products wrap as uint64's do; `>>` is arithmetic on int64, so the masks make each shift logical.
    In place, because fresh int64 tensors of a quarter of the input's elements cost more than the arithmetic."""
    z ^= (z >> 30) & (2**34 - 1)
    z *= MIX1
    z ^= (z >> 27) & (2**37 - 1)
    z *= MIX2
    z ^= (z >> 31) & (2**33 - 1)
    return z


def keyed_dropout(x, p, keys):
    """Dropout of x (rows, ...) whose mask is a function of each row's key (keys: (rows,) int64) and of each element's
    place in its row, nothing else. Each 64-bit hash of (key, counter) gives four 16-bit draws, so the cost is that of
    drawing a quarter of x's elements as random int64 (a Bernoulli per element costs more than the small matmul it
    guards on CPU); p is rounded to a multiple of 1/65536. The draws are cut out by shifts, not by viewing the int64
    hashes as int16: Inductor miscompiles such a view next to a matmul when shapes are dynamic."""
    if keys.shape != x.shape[:1]:
        raise ValueError(f"keyed_dropout: {tuple(keys.shape)} keys for an input of {x.shape[0]} rows")
    k, n = round(p * 65536), x[0].numel()
    counters = torch.arange(-(-n // 4), device=x.device).mul_(GOLDEN)  # (ceil(n / 4),): the hashes of one row
    bits = mix64_(keys.to(x.device)[:, None] + counters)  # (rows, ceil(n / 4)) int64
    draws = [(bits >> shift).bitwise_and_(0xFFFF) >= k for shift in (0, 16, 32, 48)]  # 4 x P(keep) = 1 - k / 65536
    keep = torch.stack(draws, -1).flatten(1)[:, :n].view(x.shape)
    return x * keep * (65536 / (65536 - k))


def row_keys(seed, step, rows, device=None):
    """(len(rows),) int64 keys of the rows `rows` (indices in optimizer step `step`'s global batch) for a run seeded
    `seed`: the dropout of a row is a function of these three numbers only."""
    rows = torch.as_tensor(rows, dtype=torch.int64, device=device)
    return mix64_(mix64_(mix64_(torch.full_like(rows, seed)) ^ step) ^ rows)


@contextmanager
def dropout_rows(model, keys):
    """Within the block, every adapted linear of `model` drops features by the row keys `keys` (row_keys: one per row
    of the micro-batch in flight), each module hashing them with its own index; forward and backward (and activation
    checkpointing's recomputation) must run inside. Outside, dropout keys each row from torch's generator."""
    modules = list(lora_modules(model).values())
    for i, m in enumerate(modules):
        m.dropout_keys = mix64_(keys ^ _signed((i + 1) * GOLDEN % 2**64))
    try:
        yield
    finally:
        for m in modules:
            m.dropout_keys = None


class LoRA:
    """The LoRA part shared by both linear flavours: init, the low-rank branch, and the merged delta weight."""

    def init_lora(self, r, alpha, dropout, use_rslora, dtype, device):
        self.r, self.lora_alpha, self.use_rslora = r, alpha, use_rslora
        self.scaling = lora_scale(r, alpha, use_rslora)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.dropout_keys = None  # (rows,) int64 while dropout_rows is in effect
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device=device, dtype=dtype)  # weight (r, in)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device=device, dtype=dtype)  # weight (out, r)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)  # B = 0: the adapted model starts as the base model

    def lora(self, x):  # x (rows, ..., in) -> (rows, ..., out), in x's dtype (fp32 masters are cast down under bf16)
        a, b = self.lora_A.weight.to(x.dtype), self.lora_B.weight.to(x.dtype)
        if self.training and isinstance(self.lora_dropout, nn.Dropout):  # nn.Dropout holds p (PEFT's layout)
            keys = self.dropout_keys
            if keys is None:  # outside dropout_rows: a key per row from torch's generator
                keys = torch.randint(-(2**63), 2**63 - 1, x.shape[:1], dtype=torch.int64, device=x.device)
            x = keyed_dropout(x, self.lora_dropout.p, keys)
        return F.linear(F.linear(x, a), b) * self.scaling

    def delta_weight(self):  # scale * B @ A: (out, r) @ (r, in) -> (out, in), in fp32
        return self.scaling * (self.lora_B.weight.float() @ self.lora_A.weight.float())


class LoRALinear(LoRA, nn.Linear):
    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        return y + self.lora(x).to(y.dtype)


class LoRANF4Linear(LoRA, quant.NF4Linear):
    def forward(self, x):
        y = quant.NF4Linear.forward(self, x)
        return y + self.lora(x).to(y.dtype)


def with_lora(base, r, alpha, dropout, use_rslora, lora_dtype):
    """A LoRA linear built on meta that takes over `base`'s own tensors (no copy), plus fresh A, B on its device, in
    `base`'s train/eval mode (an adapter loaded into a model in eval mode must not start with live dropout)."""
    has_bias = base.bias is not None
    if isinstance(base, quant.NF4Linear):
        m = LoRANF4Linear(base.in_features, base.out_features, has_bias, base.compute_dtype, device="meta")
        m.rel_error, dtype = base.rel_error, base.compute_dtype  # the quantization error survives the swap
    else:
        m = LoRALinear(base.in_features, base.out_features, bias=has_bias, device="meta")
        dtype = base.weight.dtype
    m.requires_grad_(False)  # assign=True keeps the module's requires_grad, so the taken-over base stays frozen
    state = base.state_dict(keep_vars=True)
    m.load_state_dict(state, assign=True)
    m.init_lora(r, alpha, dropout, use_rslora, lora_dtype or dtype, next(iter(state.values())).device)
    return m.train(base.training)


def lora_modules(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRA)}


def count_parameters(model):
    """(trainable, total) parameter counts; an NF4 weight counts as the in*out weights it represents."""
    params = list(model.parameters())  # tied embeddings once
    nf4 = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, quant.NF4Linear))
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params) + nf4


def add_lora_(model, targets, r, alpha, dropout, use_rslora=False, lora_dtype=None):
    """Wrap the `targets` linears (as model.find_linears picks them) with LoRA and freeze everything else; returns
    (trainable, total) parameter counts."""
    if lora_modules(model):
        raise ValueError("add_lora_: the model already has LoRA adapters")
    try:
        chosen = find_linears(model, targets, (nn.Linear, quant.NF4Linear))
    except ValueError as e:
        raise ValueError(f"add_lora_: {e}") from None
    model.requires_grad_(False)
    for name, base in chosen.items():
        model.set_submodule(name, with_lora(base, r, alpha, dropout, use_rslora, lora_dtype))
    trainable, total = count_parameters(model)
    print(
        f"LoRA r={r} on {len(chosen)} linears: {trainable:,} trainable of {total:,} parameters "
        f"({100 * trainable / total:.3f}%)"
    )
    return trainable, total


@torch.no_grad()
def adapter_health(model):
    """{module: (||scale * B A|| / ||W||, share of B's entries that moved from zero)}, Frobenius norms: how far each
    adapter has moved its layer, and whether it is training at all (B starts at zero, so a B still all zero after
    some steps means no gradient reaches it). ||B A||^2 = trace((B^T B)(A A^T)) is an (r, r) product, so no (out, in)
    matrix is formed; ||W|| is computed once per module (W is frozen) and kept on it."""
    health = {}
    for name, m in lora_modules(model).items():
        if not hasattr(m, "base_norm"):
            m.base_norm = float((m.dequantize() if isinstance(m, quant.NF4Linear) else m.weight).float().norm())
        a, b = m.lora_A.weight.float(), m.lora_B.weight.float()
        delta = m.scaling * float(torch.trace((b.t() @ b) @ (a @ a.t())).clamp(min=0).sqrt())
        health[name] = (delta / max(m.base_norm, 1e-30), float((b != 0).float().mean()))
    return health


@torch.no_grad()
def rebase_(model, original=None):
    """Give every NF4 linear a 16-bit base, adapters kept: its original weight when `original` (an hf.Checkpoint or a
    mapping name -> tensor) holds `<module>.weight`, else its dequantized copy. Returns {module: "dense" |
    "original" | "dequantized"}, the weights each LoRA or NF4 linear now computes with."""
    sources = {}
    for name, m in [(n, m) for n, m in model.named_modules() if isinstance(m, (LoRA, quant.NF4Linear))]:
        if not isinstance(m, quant.NF4Linear):
            sources[name] = "dense"
            continue
        if original is not None and f"{name}.weight" in original:
            w, sources[name] = original.get(f"{name}.weight"), "original"
            if tuple(w.shape) != (want := (m.out_features, m.in_features)):
                raise ValueError(f"merge: original tensor {name}.weight has shape {tuple(w.shape)}, expected {want}")
        else:
            w, sources[name] = m.dequantize(), "dequantized"
        device = next(iter(m.state_dict().values())).device
        dense = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
        dense.weight = nn.Parameter(w.to(device, m.compute_dtype), requires_grad=False)
        dense.bias = m.bias
        if isinstance(m, LoRA):  # the same A, B, scale and dropout, now over the 16-bit weight
            dense = with_lora(dense, m.r, m.lora_alpha, 0.0, m.use_rslora, m.lora_A.weight.dtype)
            dense.lora_A, dense.lora_B, dense.lora_dropout = m.lora_A, m.lora_B, m.lora_dropout
        model.set_submodule(name, dense.train(m.training))  # in eval mode, dropout stays off
    return sources


@torch.no_grad()
def fold_(model):
    """Fold every adapter into its 16-bit base, W' = W + scale * B @ A (in fp32, rounded once to W's dtype), leaving a
    plain nn.Linear: the model has no LoRA left."""
    for name, m in lora_modules(model).items():
        if isinstance(m, quant.NF4Linear):
            raise ValueError(f"fold_: {name} has a 4-bit base; call rebase_ first")
        dense = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
        dense.weight = nn.Parameter((m.weight.float() + m.delta_weight()).to(m.weight.dtype), requires_grad=False)
        dense.bias = m.bias
        model.set_submodule(name, dense)


def merge_lora_(model, original=None):
    """rebase_ then fold_: a plain 16-bit Llama with the adapters folded in. Returns rebase_'s sources."""
    sources = rebase_(model, original)
    fold_(model)
    counts = {s: list(sources.values()).count(s) for s in ("dense", "original", "dequantized")}
    print("merge_lora_: merged " + ", ".join(f"{k} {v}" for k, v in counts.items() if v) + " linears")
    return sources
