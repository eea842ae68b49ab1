"""LoRA adapters: add them to a (maybe NF4) Llama, train them, merge them in.

LoRA (Hu et al. 2021, https://arxiv.org/abs/2106.09685) freezes a pretrained linear W
(out, in) and learns a low-rank update, A (r, in) and B (out, r) with r << min(in, out):

    y = x W^T + scale * B(A(dropout(x)))

A 4096x4096 projection trains 2 * 4096 * r numbers, not 16.7M. A starts Kaiming-uniform, B
at zero: B A = 0, so training starts from the base, not noise; B's gradient sees A x, and A
moves once B has. scale = alpha / r keeps the update's size about independent of r, but
then large ranks learn no better than small ones: rsLoRA (Kalajdzievski 2023,
https://arxiv.org/abs/2312.03732) uses alpha / sqrt(r). Dropout acts on the branch's input,
its mask keyed by (seed, step, row) (support/kernels/dropout.py), so runs on any number of
ranks, resumed or not, train the same.

QLoRA (Dettmers et al. 2023, https://arxiv.org/abs/2305.14314) trains the same A, B over W
in NF4 (quant.py): y = x dequant(W)^T + scale * B A x. LoRALinear and LoRANF4Linear keep
their base's tensors and names (`q_proj.weight`, the NF4 buffers) and add PEFT's
`q_proj.lora_A.weight`, `q_proj.lora_B.weight` (support/formats/hf.py). The adapter is in
the base's float dtype unless `lora_dtype` says otherwise (fp32 masters under bf16 autocast).

Merging folds the update in, W' = W + scale * B @ A (fp32): a plain Llama, no overhead. But
the adapter learnt dequant(W), not W: merged into the dequantized weights it is the 4-bit
model exactly, rounding error included; into the original 16-bit weights, the model users
expect, off by the quantization error. merge_lora_ takes the originals when given them.

Within `adapters_off(model)` the model is its frozen base: rl.py's reference, no copy held.
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
    """A frozen nn.Linear with an adapter: y = x W^T + b + scale * B(A(dropout(x))). It holds
    its base's own weight and bias (same names, still frozen)."""

    def __init__(self, base, r, alpha, dropout=0.0, use_rslora=False, lora_dtype=None, dropout_op=None):
        super().__init__(base.in_features, base.out_features, base.bias is not None, device="meta")
        self.weight = base.weight
        self.bias = base.bias
        dtype = lora_dtype or base.weight.dtype
        attach_adapter_(self, base, r, alpha, dropout, use_rslora, dtype, dropout_op)

    def forward(self, x):  # x (..., in) -> (..., out)
        return adapted(self, super().forward, x)


class LoRANF4Linear(quant.NF4Linear):
    """The same adapter over a frozen quant.NF4Linear (QLoRA), holding its base's NF4 buffers,
    bias, rel_error and dequantize_op."""

    def __init__(self, base, r, alpha, dropout=0.0, use_rslora=False, lora_dtype=None, dropout_op=None):
        dims = (base.in_features, base.out_features)
        super().__init__(*dims, base.bias is not None, base.compute_dtype, device="meta")
        for name in (*quant.BUFFERS, "bias", "rel_error", "dequantize_op"):
            setattr(self, name, getattr(base, name))
        dtype = lora_dtype or base.compute_dtype
        attach_adapter_(self, base, r, alpha, dropout, use_rslora, dtype, dropout_op)

    def forward(self, x):  # x (..., in) -> (..., out)
        return adapted(self, super().forward, x)


LORA = (LoRALinear, LoRANF4Linear)


def attach_adapter_(layer, base, r, alpha, dropout, use_rslora, dtype, dropout_op):
    """Give `layer` (with `base`'s tensors) an adapter in `dtype` on the base's device."""
    opts = dict(bias=False, device=base.weight.device, dtype=dtype)
    layer.lora_A = nn.Linear(base.in_features, r, **opts)  # weight (r, in)
    layer.lora_B = nn.Linear(r, base.out_features, **opts)  # weight (out, r)
    layer.lora_dropout = KeyedDropout(dropout, dropout_op) if dropout > 0 else nn.Identity()
    layer.r = r
    layer.lora_alpha = alpha
    layer.use_rslora = use_rslora
    layer.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
    layer.enabled = True  # False within adapters_off: the base alone
    nn.init.kaiming_uniform_(layer.lora_A.weight, a=math.sqrt(5))  # as nn.Linear and PEFT
    nn.init.zeros_(layer.lora_B.weight)  # B A = 0: the model starts as its base
    layer.train(base.training)  # eval mode if base is: no live dropout


def adapted(layer, base_forward, x):
    """base_forward(x) + scale * B(A(dropout(x))), x (..., in) -> (..., out). The base's output, (N, out) as addmm_
    takes it, is fresh, so B's matmul adds into it in place (one kernel, not three). Dropout sees x's rows (keyed per
    row)."""
    out = base_forward(x.reshape(-1, x.shape[-1]))  # (N, out)
    if layer.enabled:
        a = layer.lora_A.weight.to(x.dtype)  # (r, in)
        b = (layer.lora_B.weight * layer.scaling).to(out.dtype)  # (out, r)
        h = F.linear(layer.lora_dropout(x), a).reshape(-1, a.shape[0]).to(out.dtype)  # (N, r)
        out.addmm_(h, b.t())
    return out.view(*x.shape[:-1], -1)


def delta_weight(layer):
    """scale * B @ A, (out, r) @ (r, in) -> (out, in) in fp32: what merging adds to W."""
    return layer.scaling * (layer.lora_B.weight.float() @ layer.lora_A.weight.float())


def merged_weight(layer, weight):
    """weight + scale * B @ A of `layer`'s adapter, summed in fp32 and rounded once to weight's dtype."""
    return (weight.float() + delta_weight(layer)).to(weight.dtype)


def with_lora(base, r, alpha, dropout=0.0, use_rslora=False, lora_dtype=None, dropout_op=None):
    """`base` (nn.Linear or NF4Linear) in a LoRA linear of its kind with a fresh rank-r adapter
    (lora_dtype, dropout_op: None for the base's float dtype and the reference dropout)."""
    kind = LoRANF4Linear if isinstance(base, quant.NF4Linear) else LoRALinear
    return kind(base, r, alpha, dropout, use_rslora, lora_dtype, dropout_op)


def share_adapter(base, layer):
    """A LoRA linear over `base` sharing `layer`'s A, B, dropout and scale (no copies)."""
    twin = with_lora(base, layer.r, layer.lora_alpha)
    for shared in ("lora_A", "lora_B", "lora_dropout", "use_rslora", "scaling"):
        setattr(twin, shared, getattr(layer, shared))
    return twin.train(layer.training)


@contextmanager
def adapters_off(model):
    """Within the block `model` skips every adapter: it computes as its frozen base."""
    layers = lora_modules(model).values()
    for m in layers:
        m.enabled = False
    try:
        yield
    finally:
        for m in layers:
            m.enabled = True


def frozen_linear(weight, bias, kind=nn.Linear):
    """A frozen `kind` (nn.Linear or a subclass) over `weight` (out, in) and `bias` (out,) or None, not copies."""
    linear = kind(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    linear.bias = bias
    return linear


def row_dropout(model, seed, step, rows, device):
    """A context in which LoRA dropout drops in micro-batch row i what row rows[i] of step `step`'s
    global batch drops in a run seeded `seed`, whatever the ranks and micro-batches."""
    live = any(isinstance(m, KeyedDropout) for m in model.modules())
    return dropout_rows(model, row_keys(seed, step, rows, device) if live else None)


def lora_modules(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, LORA)}


def count_parameters(model):
    """(trainable, total) parameter counts, an NF4 weight as its in * out weights."""
    params = list(model.parameters())  # tied embeddings once
    nf4 = (m for m in model.modules() if isinstance(m, quant.NF4Linear))
    total = sum(p.numel() for p in params) + sum(m.in_features * m.out_features for m in nf4)
    return sum(p.numel() for p in params if p.requires_grad), total


def add_lora_(model, targets, r, alpha, dropout, use_rslora=False, lora_dtype=None, dropout_op=None):
    """Wrap the `targets` linears ("all-linear" or names) with LoRA, freeze all but adapters, and
    return count_parameters. dropout_op: on CUDA, support/kernels/dropout_cuda.py's kernel."""
    try:
        chosen = find_linears(model, targets, (nn.Linear, quant.NF4Linear))
    except ValueError as e:
        raise ValueError(f"add_lora_: {e}") from None
    if twice := [n for n, m in chosen.items() if isinstance(m, LORA)]:
        raise ValueError(f"add_lora_: {twice[0]} already has a LoRA adapter")
    adapters = lora_modules(model).values()  # of earlier calls (a model built in parts)
    earlier = {id(p) for m in adapters for p in (m.lora_A.weight, m.lora_B.weight)}
    for p in model.parameters():
        p.requires_grad_(id(p) in earlier and p.requires_grad)
    for name, base in chosen.items():
        layer = with_lora(base, r, alpha, dropout, use_rslora, lora_dtype, dropout_op)
        model.set_submodule(name, layer)
    return count_parameters(model)


@torch.no_grad()
def rebase_(model, original=None):
    """Give every NF4 linear a 16-bit base, adapters kept: its original weight if `original` (an
    hf.Checkpoint or a mapping) holds `<module>.weight`, else its dequantized copy. Returns
    {module: "dense" | "original" | "dequantized"}, the weights each linear now holds."""
    sources = {}
    kinds = (*LORA, quant.NF4Linear)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, kinds)}  # before any swap
    for name, m in layers.items():
        if not isinstance(m, quant.NF4Linear):
            sources[name] = "dense"
            continue
        key = f"{name}.weight"
        if original is not None and key in original:
            w = original.get(key)
            sources[name] = "original"
            want = (m.out_features, m.in_features)
            got = tuple(w.shape)
            if got != want:
                raise ValueError(f"merge: original tensor {key} has shape {got}, expected {want}")
        else:
            w = m.dequantize()
            sources[name] = "dequantized"
        dense = frozen_linear(w.to(m.weight.device, m.compute_dtype), m.bias)
        if isinstance(m, LORA):  # the same adapter over the 16-bit weight
            dense = share_adapter(dense, m)
        model.set_submodule(name, dense.train(m.training))  # eval mode: dropout stays off
    return sources


@torch.no_grad()
def fold_(model):
    """Fold every adapter into its 16-bit base: W' = W + scale * B @ A in fp32, rounded once."""
    for name, m in lora_modules(model).items():
        if isinstance(m, quant.NF4Linear):
            raise ValueError(f"fold_: {name} has a 4-bit base; call rebase_ first")
        model.set_submodule(name, frozen_linear(merged_weight(m, m.weight), m.bias))


def merge_lora_(model, original=None):
    """rebase_, then fold_: a plain 16-bit Llama. Returns rebase_'s sources."""
    sources = rebase_(model, original)
    fold_(model)
    counts = {s: list(sources.values()).count(s) for s in ("dense", "original", "dequantized")}
    merged = ", ".join(f"{k} {v}" for k, v in counts.items() if v)
    print(f"merge_lora_: merged {merged} linears")
    return sources
