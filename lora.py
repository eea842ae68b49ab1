"""LoRA adapters: add them to a (possibly NF4-quantized) Llama, save/load them in PEFT's format, merge and export.

LoRA (Hu et al. 2021, https://arxiv.org/abs/2106.09685) freezes a pretrained linear layer W (out, in) and learns a
low-rank update instead of W itself:

    y = x W^T + scale * B(A(dropout(x)))        A: (r, in), B: (out, r), r << min(in, out)

so a 4096x4096 projection trains 2 * 4096 * r numbers instead of 16.7M. A starts Kaiming-uniform (as nn.Linear and
PEFT do: kaiming_uniform_ with a=sqrt(5)) and B starts at zero, so at step 0 the product B A is exactly zero: the
adapted model *is* the base model and training starts from its behaviour rather than from noise. B's gradient is then
non-zero (it sees A x) while A only starts moving once B has. `scale = alpha / r` keeps the update's size roughly
independent of r for a fixed learning rate; rsLoRA (Kalajdzievski 2023, https://arxiv.org/abs/2312.03732) shows that
this makes large ranks learn no better than small ones and that `alpha / sqrt(r)` is the rank-stable choice. Dropout
acts on the LoRA branch's input only.

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

PEFT's adapter format (what transformers + PEFT, vLLM and other serving engines load) is a directory with
adapter_config.json (peft_type "LORA", task_type "CAUSAL_LM", r, lora_alpha, lora_dropout, use_rslora, target_modules,
bias "none", ...) and adapter_model.safetensors holding `base_model.model.<module>.lora_A.weight` (r, in) and
`base_model.model.<module>.lora_B.weight` (out, r), e.g. <module> = model.layers.0.self_attn.q_proj.
"""

import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import quant

PEFT_PREFIX = "base_model.model."
# adapter_config.json options that change what the adapter computes and that plain LoRA here does not implement
UNSUPPORTED = (
    "use_dora fan_in_fan_out rank_pattern alpha_pattern layers_to_transform modules_to_save lora_bias "
    "target_parameters trainable_token_indices"
).split()
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json")


def cheap_dropout(x, p):
    """Dropout for CPU, where drawing the random mask costs ten times the q_proj matmul it guards: the mask comes from
    16-bit random integers, four per 64-bit draw (p rounded to a multiple of 1/65536; int16 is uniform on +-32768)."""
    k = round(p * 65536)
    bits = torch.randint(-(2**63), 2**63 - 1, (-(-x.numel() // 4),), dtype=torch.int64, device=x.device)
    keep = bits.view(torch.int16)[: x.numel()].view(x.shape) >= k - 32768  # P(keep) = 1 - k / 65536
    return x * keep * (65536 / (65536 - k))


class _LoRA:
    """The LoRA part shared by both linear flavours: init, the low-rank branch, and the merged delta weight."""

    def _init_lora(self, r, alpha, dropout, use_rslora, dtype, device):
        self.r, self.lora_alpha, self.use_rslora = r, alpha, use_rslora
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device=device, dtype=dtype)  # weight (r, in)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device=device, dtype=dtype)  # weight (out, r)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)  # B = 0: the adapted model starts as the base model

    def lora(self, x):  # x (..., in) -> (..., out), in x's dtype (fp32 masters are cast down under bf16)
        a, b = self.lora_A.weight.to(x.dtype), self.lora_B.weight.to(x.dtype)
        if self.training and isinstance(self.lora_dropout, nn.Dropout) and not x.is_cuda:
            x = cheap_dropout(x, self.lora_dropout.p)
        else:
            x = self.lora_dropout(x)
        return F.linear(F.linear(x, a), b) * self.scaling

    def delta_weight(self):  # scale * B @ A: (out, r) @ (r, in) -> (out, in), in fp32
        return self.scaling * (self.lora_B.weight.float() @ self.lora_A.weight.float())


class LoRALinear(_LoRA, nn.Linear):
    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        return y + self.lora(x).to(y.dtype)


class LoRANF4Linear(_LoRA, quant.NF4Linear):
    def forward(self, x):
        y = quant.NF4Linear.forward(self, x)
        return y + self.lora(x).to(y.dtype)


def _wrap(base, r, alpha, dropout, use_rslora, lora_dtype):
    """A LoRA linear built on meta that takes over `base`'s own tensors (no copy), plus fresh A, B on its device."""
    has_bias = base.bias is not None
    if isinstance(base, quant.NF4Linear):
        m = LoRANF4Linear(base.in_features, base.out_features, has_bias, base.compute_dtype, device="meta")
        dtype = base.compute_dtype
    else:
        m = LoRALinear(base.in_features, base.out_features, bias=has_bias, device="meta")
        dtype = base.weight.dtype
    m.requires_grad_(False)  # assign=True keeps the module's requires_grad, so the taken-over base stays frozen
    state = base.state_dict(keep_vars=True)
    m.load_state_dict(state, assign=True)
    m._init_lora(r, alpha, dropout, use_rslora, lora_dtype or dtype, next(iter(state.values())).device)
    return m


def _lora_modules(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, _LoRA)}


def _set_module(model, name, module):
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def count_parameters(model):
    """(trainable, total) parameter counts; an NF4 weight counts as the in*out weights it represents."""
    params = list(model.parameters())  # tied embeddings once
    nf4 = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, quant.NF4Linear))
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params) + nf4


def add_lora_(model, targets, r, alpha, dropout, use_rslora=False, lora_dtype=None):
    """Wrap the target linears with LoRA and freeze everything else; returns (trainable, total) parameter counts.

    targets: "all-linear" (every linear inside model.model.layers, never lm_head) or a list of names matched like PEFT
    does (a module whose full name equals the entry or ends with "." + entry, e.g. "q_proj" or "layers.0.mlp.up_proj").
    """
    if _lora_modules(model):
        raise ValueError("add_lora_: the model already has LoRA adapters")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, quant.NF4Linear))}
    if targets == "all-linear":
        chosen = [n for n in linears if n.startswith("model.layers.")]
    else:
        for t in targets:
            if not any(n == t or n.endswith("." + t) for n in linears):
                raise ValueError(f"add_lora_: target module {t!r} matches no linear layer of the model")
        chosen = [n for n in linears if any(n == t or n.endswith("." + t) for t in targets)]
    model.requires_grad_(False)
    for n in chosen:
        _set_module(model, n, _wrap(linears[n], r, alpha, dropout, use_rslora, lora_dtype))
    trainable, total = count_parameters(model)
    print(
        f"LoRA r={r} on {len(chosen)} linears: {trainable:,} trainable of {total:,} parameters "
        f"({100 * trainable / total:.3f}%)"
    )
    return trainable, total


@torch.no_grad()
def merge_lora_(model, original=None):
    """Fold every adapter into its base and turn every LoRA/NF4 linear into a plain 16-bit nn.Linear.

    original: a model.Checkpoint or mapping name -> tensor with the 16-bit weights; NF4 bases are rebuilt from it
    when their `<module>.weight` is in it, else from the dequantized 4-bit copy. Returns {module: "dense" | "original" |
    "dequantized"}, the weights each merged module started from.
    """
    sources = {}
    for name, m in [(n, m) for n, m in model.named_modules() if isinstance(m, (_LoRA, quant.NF4Linear))]:
        if not isinstance(m, quant.NF4Linear):
            w, dtype, sources[name] = m.weight, m.weight.dtype, "dense"
        elif original is not None and f"{name}.weight" in original:
            w, dtype, sources[name] = original.get(f"{name}.weight"), m.compute_dtype, "original"
            if tuple(w.shape) != (m.out_features, m.in_features):
                raise ValueError(
                    f"merge_lora_: original tensor {name}.weight has shape {tuple(w.shape)}, expected "
                    f"{(m.out_features, m.in_features)}"
                )
        else:
            w, dtype, sources[name] = m.dequantize(), m.compute_dtype, "dequantized"
        device = next(iter(m.state_dict().values())).device
        w = w.to(device=device, dtype=torch.float32)
        if isinstance(m, _LoRA):
            w = w + m.delta_weight()
        lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
        lin.weight = nn.Parameter(w.to(dtype), requires_grad=False)
        lin.bias = m.bias
        _set_module(model, name, lin)
    counts = {s: list(sources.values()).count(s) for s in ("dense", "original", "dequantized")}
    print("merge_lora_: merged " + ", ".join(f"{k} {v}" for k, v in counts.items() if v) + " linears")
    return sources


@torch.no_grad()
def merge_and_check_(model, prompts, original=None):
    """merge_lora_ plus the max |logit| difference between the adapter-on-base and merged model on `prompts`.

    prompts: a few lists of token ids. Returns (sources, max_diff). With an NF4 base merged into original weights the
    difference is the 4-bit quantization error the adapter was trained against, not a merge error.
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    before = [model(torch.tensor([p], device=device)).float() for p in prompts]
    sources = merge_lora_(model, original)
    diff = max(
        (model(torch.tensor([p], device=device)).float() - b).abs().max().item()
        for p, b in zip(prompts, before, strict=True)
    )
    model.train(was_training)
    print(f"merge check: max |logit difference| {diff:.3e} on {len(prompts)} prompts")
    return sources, diff


def atomic_write(path, write):
    """write(tmp) to a temp file in path's folder, then os.replace it onto path."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".tmp-")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _write_json(path, obj):
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=2)))


def save_adapter(model, out_dir, base_model_name_or_path=None):
    """Write adapter_config.json + adapter_model.safetensors in PEFT's format."""
    mods = _lora_modules(model)
    if not mods:
        raise ValueError("save_adapter: the model has no LoRA adapters (call add_lora_ first)")
    m0 = next(iter(mods.values()))
    # Name targets by their short names when that selects exactly the adapted modules, else by full module names.
    short = sorted({n.rsplit(".", 1)[-1] for n in mods})
    same_short = [
        n
        for n, m in model.named_modules()
        if isinstance(m, (nn.Linear, quant.NF4Linear)) and n.rsplit(".", 1)[-1] in short
    ]
    # fmt: off
    config = {
        "base_model_name_or_path": base_model_name_or_path, "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "r": m0.r, "lora_alpha": m0.lora_alpha, "lora_dropout": getattr(m0.lora_dropout, "p", 0.0),
        "use_rslora": m0.use_rslora, "target_modules": short if len(same_short) == len(mods) else sorted(mods),
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "modules_to_save": None, "layers_to_transform": None, "use_dora": False,
    }
    # fmt: on
    tensors = {
        f"{PEFT_PREFIX}{n}.{ab}.weight": getattr(m, ab).weight.detach().cpu().contiguous()
        for n, m in mods.items()
        for ab in ("lora_A", "lora_B")
    }
    os.makedirs(out_dir, exist_ok=True)
    atomic_write(os.path.join(out_dir, "adapter_model.safetensors"), lambda t: save_file(tensors, t, {"format": "pt"}))
    _write_json(os.path.join(out_dir, "adapter_config.json"), config)


@torch.no_grad()
def load_adapter_(model, adapter_dir):
    """Load a PEFT-format LoRA adapter (ours or PEFT's own); returns its adapter_config as a dict.

    A model without LoRA gets add_lora_ applied from adapter_config.json; a model that already has LoRA (e.g. when
    resuming) must match the file's r and scaling and receives the weights.
    """
    cfg_path = os.path.join(adapter_dir, "adapter_config.json")
    path = os.path.join(adapter_dir, "adapter_model.safetensors")
    for p in (cfg_path, path):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"load_adapter_: {p} not found")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{cfg_path}: peft_type {cfg['peft_type']!r} is not LORA")
    bad = [k for k in UNSUPPORTED if cfg.get(k)] + (["bias"] if cfg.get("bias", "none") != "none" else [])
    if bad:
        raise ValueError(f"{cfg_path}: unsupported LoRA options {bad} (only plain LoRA on linear layers)")
    state = {}
    for key, t in load_file(path).items():  # PEFT may keep its adapter name: ...lora_A.default.weight
        match = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.(lora_[AB])(?:\.[^.]+)?\.weight", key)
        if match is None:
            raise ValueError(f"{path}: tensor {key} is not a LoRA A/B weight of a linear layer")
        state[f"{match[1]}.{match[2]}.weight"] = t
    r, alpha, use_rslora = cfg.get("r", 8), cfg.get("lora_alpha", 8), cfg.get("use_rslora", False)
    targets = cfg.get("target_modules")
    if targets is None or (isinstance(targets, str) and targets != "all-linear"):  # absent or a regex: use the file
        targets = sorted({k.rsplit(".lora_", 1)[0] for k in state})
    mods = _lora_modules(model)
    if not mods:
        try:
            add_lora_(model, targets, r, alpha, cfg.get("lora_dropout", 0.0), use_rslora)
        except ValueError as e:  # name the file whose target_modules do not fit the model
            raise ValueError(f"{cfg_path}: {e}") from None
        mods = _lora_modules(model)
    scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
    for n, m in mods.items():
        if m.r != r or not math.isclose(m.scaling, scaling):
            raise ValueError(
                f"{cfg_path}: r={r}, scaling={scaling:g} but the model's {n} has r={m.r}, scaling={m.scaling:g}"
            )
    params = {f"{n}.{ab}.weight": getattr(m, ab).weight for n, m in mods.items() for ab in ("lora_A", "lora_B")}
    if state.keys() - params.keys():
        raise ValueError(f"{path}: tensor {min(state.keys() - params.keys())} has no LoRA module in the model")
    if params.keys() - state.keys():
        raise ValueError(f"{path}: missing tensor {min(params.keys() - state.keys())} for a LoRA module in the model")
    for k, p in params.items():
        if state[k].shape != p.shape:
            raise ValueError(
                f"{path}: tensor {k} has shape {tuple(state[k].shape)}, expected {tuple(p.shape)} "
                f"from r={r} in adapter_config.json and the model's linear shapes"
            )
        p.copy_(state[k])
    return cfg


def export_merged(model, out_dir, tokenizer_dir=None, shard_size=5 * 10**9):
    """Write a merged model as a HF-format directory: config.json, safetensors shards (+ index), tokenizer files."""
    leftover = [n for n, m in model.named_modules() if isinstance(m, (_LoRA, quant.NF4Linear))]
    if leftover:
        raise ValueError(f"export_merged: {leftover[0]} is still a LoRA/NF4 linear (call merge_lora_ first)")
    cfg = model.config.to_hf()
    state = {k: v for k, v in model.state_dict().items() if not (k == "lm_head.weight" and cfg["tie_word_embeddings"])}
    cfg["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    shards, size = [{}], 0  # greedy: start a new shard when the next tensor would overflow the current one
    for k, v in state.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > shard_size:
            shards, size = shards + [{}], 0
        shards[-1][k], size = v, size + nbytes
    os.makedirs(out_dir, exist_ok=True)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for stale in os.listdir(out_dir):  # a previous export with another sharding would confuse loaders
        if stale.startswith("model") and ".safetensors" in stale and stale not in names:
            os.remove(os.path.join(out_dir, stale))
    for name, shard in zip(names, shards, strict=True):
        tensors = {k: v.detach().cpu().contiguous() for k, v in shard.items()}
        atomic_write(os.path.join(out_dir, name), lambda t, tensors=tensors: save_file(tensors, t, {"format": "pt"}))
    if n > 1:
        total = sum(v.numel() * v.element_size() for v in state.values())
        weight_map = {k: name for name, shard in zip(names, shards, strict=True) for k in shard}
        _write_json(
            os.path.join(out_dir, "model.safetensors.index.json"),
            {"metadata": {"total_size": total}, "weight_map": weight_map},
        )
    _write_json(os.path.join(out_dir, "config.json"), cfg)
    for f in (*TOKENIZER_FILES, "generation_config.json"):
        if tokenizer_dir and os.path.isfile(os.path.join(tokenizer_dir, f)):
            atomic_write(os.path.join(out_dir, f), lambda t, f=f: shutil.copyfile(os.path.join(tokenizer_dir, f), t))
