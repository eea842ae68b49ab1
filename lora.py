"""LoRA adapters: add them to a (possibly NF4-quantized) Llama, train them, merge them into the base.

LoRA (Hu et al. 2021, https://arxiv.org/abs/2106.09685) freezes a pretrained linear layer W (out, in) and learns a
low-rank update instead of W itself:

    y = x W^T + scale * B(A(dropout(x)))        A: (r, in), B: (out, r), r << min(in, out)

so a 4096x4096 projection trains 2 * 4096 * r numbers instead of 16.7M. A starts Kaiming-uniform (as nn.Linear and
PEFT do: kaiming_uniform_ with a=sqrt(5)) and B starts at zero, so at step 0 the product B A is exactly zero: the
adapted model *is* the base model and training starts from its behaviour, not from noise. B's gradient is then
non-zero (it sees A x); A starts moving once B has. `scale = alpha / r` keeps the update's size roughly
independent of r for a fixed learning rate; rsLoRA (Kalajdzievski 2023, https://arxiv.org/abs/2312.03732) shows that
this makes large ranks learn no better than small ones and that `alpha / sqrt(r)` is the rank-stable choice. Dropout
acts on the LoRA branch's input only, with a mask keyed by (seed, step, row) instead of drawn from torch's generator
(support/kernels/dropout.py), so a run on 4 ranks, on 1, or resumed on another number of ranks trains the same.

QLoRA (Dettmers et al. 2023, https://arxiv.org/abs/2305.14314) keeps the frozen W in 4-bit NF4 (quant.py) and trains
the same A, B on top: y = x dequant(W_nf4)^T + scale * B A x. The two LoRA linears, LoRALinear(nn.Linear) and its NF4
twin LoRANF4Linear(quant.NF4Linear), hold the tensors of the base layer they are built from and carry one adapter,
set up by attach_adapter_ and applied by `adapted`. So the base keeps its names (`q_proj.weight`, the NF4 buffers
too) and the adapter adds `q_proj.lora_A.weight` / `q_proj.lora_B.weight`.
LoRA parameters live in the base's floating dtype unless `lora_dtype` says otherwise (e.g. fp32 masters under bf16
autocast); the branch always computes in the input's dtype.

Merging folds the update into the base, W' = W + scale * B @ A ((out, r) @ (r, in) -> (out, in), computed in fp32),
after which the model is a plain Llama with no inference overhead. The NF4 caveat: the adapter was trained against
dequant(W_nf4), not W. Merging into the dequantized weights reproduces the adapter-on-4-bit model exactly but bakes
the 4-bit rounding error into a 16-bit model; merging into the original 16-bit weights gives the model users expect,
and differs from what was trained by exactly the quantization error. merge_lora_ uses the original weights whenever
it is given them and reports, per module, which weights it started from.

Adapters are saved and loaded in PEFT's format by support/formats/hf.py, so transformers + PEFT read them.

The base model for free: within `adapters_off(model)` every adapter is skipped, so the same model computes as its
frozen base. Reinforcement learning (rl.py) needs the policy before training as a reference; with LoRA it is this,
with no second copy of the model held.
"""

import math
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

import quant
from model import find_linears
from support.kernels.dropout import KeyedDropout, dropout_rows, row_keys


class LoRALinear(nn.Linear):
    """A frozen nn.Linear with an adapter: y = x W^T + b + scale * B(A(dropout(x))). It holds the base layer's own
    weight and bias (no copy: they keep their names and stay frozen) beside a fresh lora_A (r, in) and lora_B
    (out, r): A Kaiming-uniform, B zero."""

    def __init__(self, base, r, alpha, dropout=0.0, use_rslora=False, lora_dtype=None, dropout_op=None):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight, self.bias = base.weight, base.bias
        attach_adapter_(self, base, r, alpha, dropout, use_rslora, lora_dtype or base.weight.dtype, dropout_op)

    def forward(self, x):  # x (..., in) -> (..., out)
        return adapted(self, x, super().forward(x))


class LoRANF4Linear(quant.NF4Linear):
    """The same adapter over a frozen quant.NF4Linear (QLoRA): y = x dequant(W)^T + b + scale * B(A(dropout(x))). It
    holds the base's NF4 buffers and bias under their names, its quantization error and its kernel."""

    def __init__(self, base, r, alpha, dropout=0.0, use_rslora=False, lora_dtype=None, dropout_op=None):
        super().__init__(base.in_features, base.out_features, base.bias is not None, base.compute_dtype, device="meta")
        for name, t in zip(quant.BUFFERS, base.nf4_weight(), strict=True):
            setattr(self, name, t)
        self.bias, self.rel_error, self.dequantize_op = base.bias, base.rel_error, base.dequantize_op
        attach_adapter_(self, base, r, alpha, dropout, use_rslora, lora_dtype or base.compute_dtype, dropout_op)

    def forward(self, x):  # x (..., in) -> (..., out)
        return adapted(self, x, super().forward(x))


LORA = (LoRALinear, LoRANF4Linear)


def attach_adapter_(layer, base, r, alpha, dropout, use_rslora, dtype, dropout_op):
    """The adapter both LoRA linears carry, set up on `layer` (which holds `base`'s tensors) in `dtype` on the base's
    device: lora_A (r, in) as nn.Linear and PEFT start it (kaiming_uniform_, a = sqrt(5)), lora_B (out, r) zero, so
    the adapted model starts as its base; the dropout on the branch's input; the scale. In eval mode where `base` is
    (no live dropout there)."""
    device = base.weight.device
    layer.lora_A = nn.Linear(base.in_features, r, bias=False, device=device, dtype=dtype)  # weight (r, in)
    layer.lora_B = nn.Linear(r, base.out_features, bias=False, device=device, dtype=dtype)  # weight (out, r)
    layer.lora_dropout = KeyedDropout(dropout, dropout_op) if dropout > 0 else nn.Identity()
    layer.r = r
    layer.lora_alpha = alpha
    layer.use_rslora = use_rslora
    layer.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r  # rsLoRA: alpha / sqrt(r)
    layer.enabled = True  # False within adapters_off: the base alone
    nn.init.kaiming_uniform_(layer.lora_A.weight, a=math.sqrt(5))
    nn.init.zeros_(layer.lora_B.weight)
    layer.train(base.training)


def adapted(layer, x, out):
    """The base's output `out` (..., out) plus scale * B(A(dropout(x))) in x's dtype (fp32 masters under bf16
    autocast), unless adapters_off holds."""
    if not layer.enabled:
        return out
    a, b = layer.lora_A.weight.to(x.dtype), layer.lora_B.weight.to(x.dtype)  # (r, in), (out, r)
    return out + (F.linear(F.linear(layer.lora_dropout(x), a), b) * layer.scaling).to(out.dtype)


def delta_weight(layer):
    """scale * B @ A: (out, r) @ (r, in) -> (out, in), in fp32: what merging adds to the base weight."""
    return layer.scaling * (layer.lora_B.weight.float() @ layer.lora_A.weight.float())


def with_lora(base, r, alpha, dropout=0.0, use_rslora=False, lora_dtype=None, dropout_op=None):
    """`base` (nn.Linear or quant.NF4Linear) with a fresh rank-r adapter: the LoRA linear of its kind, the adapter in
    lora_dtype (default: the base's floating dtype), its dropout applied by `dropout_op` (default: the reference)."""
    kind = LoRANF4Linear if isinstance(base, quant.NF4Linear) else LoRALinear
    return kind(base, r, alpha, dropout, use_rslora, lora_dtype, dropout_op)


def over(base, layer):
    """A LoRA linear over `base` (another nn.Linear or NF4Linear for the same weight) with `layer`'s adapter: the same
    A, B, dropout and scale, not copies."""
    twin = with_lora(base, layer.r, layer.lora_alpha)
    twin.lora_A, twin.lora_B, twin.lora_dropout = layer.lora_A, layer.lora_B, layer.lora_dropout
    twin.use_rslora, twin.scaling = layer.use_rslora, layer.scaling
    return twin.train(layer.training)


@contextmanager
def adapters_off(model):
    """Within the block every adapter of `model` is skipped and the model computes as its frozen base: rl.py's
    reference policy is the same model, no second copy held."""
    layers = lora_modules(model).values()
    for m in layers:
        m.enabled = False
    try:
        yield
    finally:
        for m in layers:
            m.enabled = True


def frozen_linear(weight, bias):
    """A frozen nn.Linear over `weight` (out, in) and `bias` (out,) or None themselves, no copy."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    linear.bias = bias
    return linear


def row_dropout(model, seed, step, rows, device):
    """A context within which LoRA dropout drops, in row i of the micro-batch in flight, what row rows[i] of step
    `step`'s global batch drops in a run seeded `seed`, on any number of ranks and micro-batches (the keyed mask of
    support/kernels/dropout.py, its keys on `device`). lora_dropout 0: no keys, no mask."""
    live = any(isinstance(m, KeyedDropout) for m in model.modules())
    return dropout_rows(model, row_keys(seed, step, rows, device) if live else None)


def lora_modules(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, LORA)}


def count_parameters(model):
    """(trainable, total) parameter counts; an NF4 weight counts as the in*out weights it represents."""
    params = list(model.parameters())  # tied embeddings once
    nf4 = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, quant.NF4Linear))
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params) + nf4


def add_lora_(model, targets, r, alpha, dropout, use_rslora=False, lora_dtype=None, dropout_op=None):
    """Wrap the `targets` linears (as model.find_linears picks them: "all-linear", or module names) with LoRA and
    freeze all but the adapters (a model built part by part gets them in several calls); returns (trainable, total)
    parameter counts. dropout_op: what applies the dropout (on CUDA support/kernels/dropout_cuda.py's kernel)."""
    try:
        chosen = find_linears(model, targets, (nn.Linear, quant.NF4Linear))
    except ValueError as e:
        raise ValueError(f"add_lora_: {e}") from None
    if twice := [n for n, m in chosen.items() if isinstance(m, LORA)]:
        raise ValueError(f"add_lora_: {twice[0]} already has a LoRA adapter")
    earlier = {id(p) for m in lora_modules(model).values() for p in (m.lora_A.weight, m.lora_B.weight)}
    for p in model.parameters():
        p.requires_grad_(id(p) in earlier and p.requires_grad)
    for name, base in chosen.items():
        model.set_submodule(name, with_lora(base, r, alpha, dropout, use_rslora, lora_dtype, dropout_op))
    return count_parameters(model)


@torch.no_grad()
def rebase_(model, original=None):
    """Give every NF4 linear a 16-bit base, adapters kept: its original weight when `original` (an hf.Checkpoint or a
    mapping name -> tensor) holds `<module>.weight`, else its dequantized copy. Returns {module: "dense" |
    "original" | "dequantized"}, the weights each LoRA or NF4 linear now uses."""
    sources = {}
    layers = {n: m for n, m in model.named_modules() if isinstance(m, (*LORA, quant.NF4Linear))}  # before any swap
    for name, m in layers.items():
        if not isinstance(m, quant.NF4Linear):
            sources[name] = "dense"
            continue
        if original is not None and f"{name}.weight" in original:
            w = original.get(f"{name}.weight")
            sources[name] = "original"
            want = (m.out_features, m.in_features)
            if tuple(w.shape) != want:
                raise ValueError(f"merge: original tensor {name}.weight has shape {tuple(w.shape)}, expected {want}")
        else:
            w = m.dequantize()
            sources[name] = "dequantized"
        device = next(iter(m.state_dict().values())).device
        dense = frozen_linear(w.to(device, m.compute_dtype), m.bias)
        if isinstance(m, LORA):  # the same adapter, now over the 16-bit weight
            dense = over(dense, m)
        model.set_submodule(name, dense.train(m.training))  # in eval mode, dropout stays off
    return sources


@torch.no_grad()
def fold_(model):
    """Fold every adapter into its 16-bit base, W' = W + scale * B @ A (in fp32, rounded once to W's dtype), leaving a
    plain nn.Linear: the model has no LoRA left."""
    for name, m in lora_modules(model).items():
        if isinstance(m, quant.NF4Linear):
            raise ValueError(f"fold_: {name} has a 4-bit base; call rebase_ first")
        merged = (m.weight.float() + delta_weight(m)).to(m.weight.dtype)
        model.set_submodule(name, frozen_linear(merged, m.bias))


def merge_lora_(model, original=None):
    """rebase_ then fold_: a plain 16-bit Llama with the adapters folded in. Returns rebase_'s sources."""
    sources = rebase_(model, original)
    fold_(model)
    counts = {s: list(sources.values()).count(s) for s in ("dense", "original", "dequantized")}
    print("merge_lora_: merged " + ", ".join(f"{k} {v}" for k, v in counts.items() if v) + " linears")
    return sources
