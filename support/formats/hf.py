"""How are Hugging Face checkpoints and PEFT adapters read, and adapters and merged models written?

Tensor names are model.Llama's module paths, so nothing is renamed. config.json is read in transformers 5's and the
classic form and written in the classic one, its dtype under both "dtype" and "torch_dtype". Pre-quantized weights
are bnb-4bit (quant.NF4Weight's buffers); adapters are PEFT's `base_model.model.<module>.lora_A.weight` (r, in) and
`lora_B.weight` (out, r), read with or without PEFT's adapter name. Every file is written by atomic.py.
"""

import dataclasses
import json
import math
import os
import re
import shutil

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

import lora
import quant
from model import LlamaConfig, find_linears
from support.formats.atomic import atomic_write, read_json, write_json, write_safetensors

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json")
TOKENIZER_FILES += ("chat_template.jinja",)
PEFT_PREFIX = "base_model.model."
# adapter_config.json options that change what the adapter computes and that plain LoRA here does not implement
UNSUPPORTED = (
    "use_dora fan_in_fan_out rank_pattern alpha_pattern layers_to_transform modules_to_save lora_bias "
    "target_parameters trainable_token_indices alora_invocation_tokens use_qalora exclude_modules layer_replication"
).split()
NF4_STATE = ".quant_state.bitsandbytes__nf4"


class Checkpoint:
    """Lazy reader of model.safetensors or of shards listed in model.safetensors.index.json."""

    def __init__(self, path):
        self.path, self._handles = str(path), {}
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            d = read_json(index)
            weight_map = d.get("weight_map") if isinstance(d, dict) else None
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: no weight_map (tensor name -> shard file)")
            self.files = {name: os.path.join(path, f) for name, f in weight_map.items()}
        else:
            single = os.path.join(path, "model.safetensors")
            if not os.path.isfile(single):
                raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
            self.files = dict.fromkeys(self._open(single).keys(), single)

    def _open(self, file):
        if file not in self._handles:
            if not os.path.isfile(file):
                raise FileNotFoundError(f"{file}: checkpoint shard not found")
            try:
                self._handles[file] = safe_open(file, framework="pt")
            except SafetensorError as e:
                raise ValueError(f"{file}: not a valid safetensors file ({e})") from None
        return self._handles[file]

    def keys(self):
        return self.files.keys()

    def __contains__(self, name):
        return name in self.files

    def where(self, name):
        """The file that holds (or should hold) tensor `name`, for error messages."""
        return self.files.get(name, self.path)

    def get(self, name, shape=None):
        """Tensor `name`, checked to exist and, when `shape` is given, to have that shape."""
        if name not in self.files:
            raise ValueError(f"{self.path}: tensor {name} is missing from the checkpoint")
        try:
            t = self._open(self.files[name]).get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{self.files[name]}: cannot read tensor {name} ({e})") from None
        if shape is not None and t.shape != shape:
            raise ValueError(f"{self.where(name)}: tensor {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        return t


def open_checkpoint(path, model):
    """(Checkpoint of `path`, checked to hold no tensor `model` (meta device) lacks; weights(key) for quant.quantize_:
    a bnb-4bit entry as it is, or a 16-bit tensor to quantize)."""
    ckpt = Checkpoint(path)
    known = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    # bnb-4bit extras ("<linear>.weight.absmax", ...) belong to their weight
    owner = lambda n: n.split(".weight.")[0] + ".weight" if ".weight." in n else n  # noqa: E731
    extra = sorted(n for n in ckpt.keys() if owner(n) not in known and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ValueError(f"{ckpt.path}: checkpoint has tensors the model lacks: {', '.join(extra[:5])}")
    shapes = {n: p.shape for n, p in model.named_parameters()}

    def weights(key):
        return read_nf4(ckpt, key, shapes[key]) if f"{key}.absmax" in ckpt else ckpt.get(key, shapes[key])

    return ckpt, weights


def load_weights_(model, ckpt, dtype=None, device=None, within=""):
    """Fill every parameter still on the meta device from `ckpt`, one tensor at a time, then tie lm_head. within: fill
    only the modules under this name ("model.layers.3."), for a model loaded block by block (support/run/ranks.py)."""
    tied = model.config.tie_word_embeddings
    for mod_name, module in model.named_modules():
        for p_name, p in list(module.named_parameters(recurse=False)):
            name = f"{mod_name}.{p_name}"
            if not p.is_meta or (tied and name == "lm_head.weight") or not name.startswith(within):
                continue
            t = ckpt.get(name, p.shape)
            t = t.to(device, dtype or t.dtype, copy=True)  # a copy: a view keeps the whole file mapped, resident
            setattr(module, p_name, nn.Parameter(t, requires_grad=p.requires_grad))
    if tied and not within:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def read_nf4(ckpt, key, shape):
    """The bnb-4bit entries of weight `key` (out, in) as a quant.NF4Weight, each checked against `shape`."""
    n = shape[0] * shape[1]
    nb = -(-n // quant.BLOCK)

    def get(suffix, dtype, numel=None, equal=None):
        k = key + suffix
        if k not in ckpt:
            raise ValueError(f"{ckpt.where(key)}: tensor {k} is missing (expected a bnb-4bit nf4 checkpoint)")
        t = ckpt.get(k)
        if t.dtype != dtype or (numel is not None and t.numel() != numel) or (equal is not None and not t.equal(equal)):
            want = f"{dtype}" + (f" with {numel} values" if numel is not None else "")
            want += " equal to the standard code book" if equal is not None else ""
            raise ValueError(f"{ckpt.where(k)}: tensor {k} is {t.dtype} {tuple(t.shape)}, expected {want}")
        return t

    where = f"{ckpt.where(key + NF4_STATE)}: {key + NF4_STATE}"
    try:
        state = json.loads(bytes(get(NF4_STATE, torch.uint8).tolist()).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where} is not JSON ({e})") from None
    expected = dict(quant_type="nf4", blocksize=quant.BLOCK, shape=list(shape), nested_blocksize=quant.NESTED_BLOCK)
    for field, value in expected.items():
        if state.get(field) != value:
            raise ValueError(f"{where} has {field} = {state.get(field)!r}, expected {value!r}")
    get(".quant_map", torch.float32, equal=torch.tensor(quant.NF4))
    get(".nested_quant_map", torch.float32, equal=quant.dynamic_map())
    return quant.NF4Weight(
        get("", torch.uint8, (n + 1) // 2).view(-1, 1),
        get(".absmax", torch.uint8, nb),
        get(".nested_absmax", torch.float32, -(-nb // quant.NESTED_BLOCK)),
        torch.tensor(float(state["nested_offset"])),
    )


def is_prequantized(source):
    """Whether a checkpoint (or model directory) holds bnb-4bit weights, which have no 16-bit original to merge into."""
    ckpt = source if isinstance(source, Checkpoint) else Checkpoint(source)
    return any(k.endswith(".weight.absmax") for k in ckpt.keys())


def save_quantized(model, out_dir):
    """Write model.safetensors (bnb-4bit entries for NF4Linear, tied copies once) and config.json with a
    quantization_config."""
    os.makedirs(out_dir, exist_ok=True)
    nf4 = {n: m for n, m in model.named_modules() if isinstance(m, quant.NF4Linear)}
    tensors, seen = {}, set()
    for key, t in model.state_dict().items():
        owner, _, leaf = key.rpartition(".")
        if (owner in nf4 and leaf != "bias") or (t.numel() and t.data_ptr() in seen):
            continue  # NF4 buffers are written below; a tied weight (lm_head = embed_tokens) is stored once
        seen.add(t.data_ptr())
        tensors[key] = t
    for name, m in nf4.items():
        w = m.nf4_weight()
        # fmt: off
        state = dict(quant_type="nf4", blocksize=quant.BLOCK, dtype=dtype_name(m.compute_dtype),
                     shape=[m.out_features, m.in_features], nested_blocksize=quant.NESTED_BLOCK,
                     nested_dtype="float32", nested_offset=w.offset.item())
        # fmt: on
        tensors |= {
            f"{name}.weight": w.packed,
            f"{name}.weight.absmax": w.absmax,
            f"{name}.weight.quant_map": torch.tensor(quant.NF4),
            f"{name}.weight.nested_absmax": w.nested_absmax,
            f"{name}.weight.nested_quant_map": quant.dynamic_map(),
            f"{name}.weight{NF4_STATE}": torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8),
        }
    dense = [v.dtype for v in tensors.values() if v.is_floating_point()]  # dtype of the unquantized tensors
    config = config_json(model.config, dense[0] if dense else torch.bfloat16)
    compute = dtype_name(next((m.compute_dtype for m in nf4.values()), torch.bfloat16))
    # fmt: off
    config["quantization_config"] = dict(quant_method="bitsandbytes", load_in_4bit=True, load_in_8bit=False,
                                         bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                         bnb_4bit_compute_dtype=compute, bnb_4bit_quant_storage="uint8")
    # fmt: on
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
    write_json(os.path.join(out_dir, "config.json"), config)


def save_adapter(model, out_dir, base_model_name_or_path=None, weights=None):
    """Write adapter_config.json + adapter_model.safetensors in PEFT's format. weights: {"<module>.lora_A.weight":
    tensor, ...} to write instead of the modules' own (a sharded model's, gathered whole)."""
    mods = lora.lora_modules(model)
    if not mods:
        raise ValueError("save_adapter: the model has no LoRA adapters (call add_lora_ first)")
    m0 = next(iter(mods.values()))
    # Name targets by their short names when that selects exactly the adapted modules, else by full module names.
    short = sorted({n.rsplit(".", 1)[-1] for n in mods})
    same_short = find_linears(model, short, (nn.Linear, quant.NF4Linear))
    # fmt: off
    config = {
        "base_model_name_or_path": base_model_name_or_path, "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "r": m0.r, "lora_alpha": m0.lora_alpha, "lora_dropout": getattr(m0.lora_dropout, "p", 0.0),
        "use_rslora": m0.use_rslora, "target_modules": short if len(same_short) == len(mods) else sorted(mods),
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "modules_to_save": None, "layers_to_transform": None, "use_dora": False,
    }
    # fmt: on
    weights = weights or {
        f"{n}.{ab}.weight": getattr(m, ab).weight for n, m in mods.items() for ab in ("lora_A", "lora_B")
    }
    tensors = {PEFT_PREFIX + k: v for k, v in weights.items()}
    os.makedirs(out_dir, exist_ok=True)
    write_safetensors(os.path.join(out_dir, "adapter_model.safetensors"), tensors)
    write_json(os.path.join(out_dir, "adapter_config.json"), config)


def _read_adapter(adapter_dir):
    """(its two files' paths, adapter_config, {"<module>.lora_A.weight": tensor, ...}) of a PEFT adapter, checked."""
    cfg_path, path = (os.path.join(adapter_dir, f) for f in ("adapter_config.json", "adapter_model.safetensors"))
    for p in (cfg_path, path):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{p} not found (a PEFT adapter directory holds it)")
    cfg = read_json(cfg_path)
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
    return cfg_path, path, cfg, state


def adapter_settings(adapter_dir, model) -> dict:
    """lora.add_lora_'s keywords for the PEFT adapter in `adapter_dir`, its targets checked against `model`'s linears
    (target_modules absent, or a regex: the modules the tensors name)."""
    cfg_path, _, cfg, state = _read_adapter(adapter_dir)
    targets = cfg.get("target_modules")
    if targets is None or (isinstance(targets, str) and targets != "all-linear"):
        targets = sorted({k.rsplit(".lora_", 1)[0] for k in state})
    try:
        find_linears(model, targets, (nn.Linear, quant.NF4Linear))
    except ValueError as e:
        raise ValueError(f"{cfg_path}: {e}") from None
    settings = dict(targets=targets, r=cfg.get("r", 8), alpha=cfg.get("lora_alpha", 8))
    return settings | dict(dropout=cfg.get("lora_dropout", 0.0), use_rslora=cfg.get("use_rslora", False))


@torch.no_grad()
def load_adapter_(model, adapter_dir):
    """A PEFT adapter's tensors into `model`'s LoRA modules, which must match its r, scaling, modules and shapes (add
    them with lora.add_lora_(model, **adapter_settings(...))); returns the adapter_config dict."""
    cfg_path, path, cfg, state = _read_adapter(adapter_dir)
    r, alpha, use_rslora = cfg.get("r", 8), cfg.get("lora_alpha", 8), cfg.get("use_rslora", False)
    mods = lora.lora_modules(model)
    if not mods:
        raise ValueError(f"{cfg_path}: the model has no LoRA modules to load it into (add them with lora.add_lora_)")
    scaling = alpha / math.sqrt(r) if use_rslora else alpha / r  # as lora's layers scale
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
    leftover = [n for n, m in model.named_modules() if isinstance(m, (*lora.LORA, quant.NF4Linear))]
    if leftover:
        raise ValueError(f"export_merged: {leftover[0]} is still a LoRA/NF4 linear (call merge_lora_ first)")
    # a merged lm_head adapter unties lm_head from the embedding: then both are written, and config.json says so
    tied = model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    state = {k: v for k, v in model.state_dict().items() if not (k == "lm_head.weight" and tied)}
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
        write_safetensors(os.path.join(out_dir, name), shard)
    if n > 1:
        total = sum(v.numel() * v.element_size() for v in state.values())
        weight_map = {k: name for name, shard in zip(names, shards, strict=True) for k in shard}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_json(os.path.join(out_dir, "model.safetensors.index.json"), index)
    config = dataclasses.replace(model.config, tie_word_embeddings=tied)
    write_json(os.path.join(out_dir, "config.json"), config_json(config, next(iter(state.values())).dtype))
    for f in (*TOKENIZER_FILES, "generation_config.json"):
        if tokenizer_dir and os.path.isfile(os.path.join(tokenizer_dir, f)):
            atomic_write(os.path.join(out_dir, f), lambda t, f=f: shutil.copyfile(os.path.join(tokenizer_dir, f), t))


REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
PLAIN_KEYS = ("rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id")
ROPE_KEYS = {"default": (), "linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
# config.json model_type -> transformers' class name, for the families this Llama reads
FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
FAMILIES["mistral"] = "MistralForCausalLM"
# Near relatives that need more than a switch: what each would add.
MISSING = {
    "gemma": "embeddings scaled by sqrt(hidden), (1 + w) RMSNorm weights and a GeGLU MLP",
    "gemma2": "Gemma's changes plus logit soft-capping, extra feed-forward norms and alternating window layers",
    "gemma3_text": "Gemma 2's changes plus two RoPE bases",
    "phi": "LayerNorm, a parallel attention + MLP block and partial rotary embeddings",
    "phi3": "fused qkv_proj and gate_up_proj weights",
    "mixtral": "a mixture-of-experts MLP",
    "qwen2_moe": "a mixture-of-experts MLP with a shared expert",
    "qwen3_moe": "a mixture-of-experts MLP",
    "ministral": "a sliding window that varies by layer type",
}


def from_hf(d, path="config.json") -> LlamaConfig:
    """Read a Hugging Face config.json dict; `path` names the file in errors."""
    kind = d.get("model_type")
    if kind not in FAMILIES:
        why = f": it needs {MISSING[kind]}" if kind in MISSING else ""
        raise ValueError(f"{path}: model_type {kind!r} is not supported{why} (expected {', '.join(FAMILIES)})")
    if FAMILIES[kind] not in (d.get("architectures") or [FAMILIES[kind]]):
        raise ValueError(f"{path}: architectures {d['architectures']!r} is not supported (expected {FAMILIES[kind]})")
    if missing := [k for k in REQUIRED_KEYS if k not in d]:
        raise ValueError(f"{path}: missing key(s) {', '.join(missing)}")
    for key, want in (("hidden_act", "silu"), ("mlp_bias", False)):
        if d.get(key, want) != want:
            raise ValueError(f"{path}: {key} = {d[key]!r} is not supported (expected {want!r})")
    heads, bias = d["num_attention_heads"], bool(d.get("attention_bias")) and kind != "mistral"
    cfg = LlamaConfig(
        **{k: d[k] for k in REQUIRED_KEYS},
        **{k: d.get(k, getattr(LlamaConfig, k)) for k in PLAIN_KEYS},  # absent: the field's default
        num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or (128 if kind == "qwen3" else d["hidden_size"] // heads),  # transformers'
        model_type=kind,
        qkv_bias=bias or kind == "qwen2",
        o_bias=bias and kind != "qwen2",
        qk_norm=kind == "qwen3",
    )
    cfg.rope_theta, cfg.rope_scaling = _rope(d, path, cfg.max_position_embeddings)
    cfg.sliding_window, cfg.sliding_layers = _windows(d, path, kind)
    return cfg


def to_hf(config: LlamaConfig) -> dict:
    """A config.json dict in the classic form, as the family's own config class spells it (Hugging Face keys only)."""
    keys = [*REQUIRED_KEYS, "num_key_value_heads", "head_dim", "rope_theta", *PLAIN_KEYS]
    kind, layers = config.model_type, config.num_hidden_layers
    d = {"architectures": [FAMILIES[kind]], "model_type": kind, "hidden_act": "silu"}
    d |= {k: getattr(config, k) for k in keys}
    d["rope_scaling"] = dict(config.rope_scaling) if config.rope_scaling else None
    if kind in ("llama", "qwen3"):
        d["attention_bias"] = config.o_bias
    if kind == "mistral":  # written even when None: absent, transformers would assume 4096
        d["sliding_window"] = config.sliding_window
    if kind in ("qwen2", "qwen3"):
        sliding = config.sliding_layers or []
        d |= dict(use_sliding_window=bool(sliding), sliding_window=config.sliding_window)
        d["max_window_layers"] = sliding[0] if sliding else layers
        d["layer_types"] = ["sliding_attention" if i in sliding else "full_attention" for i in range(layers)]
    return d


def _rope(d, path, context):
    """(rope_theta, rope_scaling or None) of a config.json dict: transformers 5's rope_parameters (theta inside), or
    the classic rope_theta + rope_scaling (its kind under "rope_type", or "type" in older files)."""
    key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
    rope = dict(d.get(key) or {})
    theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    if kind not in ROPE_KEYS:
        raise ValueError(f"{path}: {key} type {kind!r} is not supported (expected default, linear or llama3)")
    if missing := [k for k in ROPE_KEYS[kind] if k not in rope]:
        raise ValueError(f"{path}: {key} of type {kind!r} lacks {', '.join(missing)}")
    if kind == "llama3":  # as in transformers: the pre-training length defaults to the context length
        rope.setdefault("original_max_position_embeddings", context)
    return float(theta), None if kind == "default" else {"rope_type": kind, **rope}


def _windows(d, path, kind):
    """(sliding_window, sliding layers) as transformers reads them: Mistral slides every layer (its window defaults to
    4096 when the key is absent); Qwen only with use_sliding_window, in the layers from max_window_layers on (or as
    layer_types lists them); Llama never."""
    layers = d["num_hidden_layers"]
    if kind == "mistral":
        window = d.get("sliding_window", 4096)
        return window, None if window is None else list(range(layers))
    if kind not in ("qwen2", "qwen3"):
        return None, None
    window = d.get("sliding_window") if d.get("use_sliding_window") else None
    if d.get("layer_types"):
        sliding = [i for i, t in enumerate(d["layer_types"]) if t == "sliding_attention"]
    else:
        sliding = [] if window is None else list(range(d.get("max_window_layers", 28), layers))
    if sliding and window is None:
        raise ValueError(
            f"{path}: layer_types lists sliding layers but use_sliding_window/sliding_window set no window"
        )
    return (window, sliding) if sliding else (None, None)


def dtype_name(dtype):
    return str(dtype).removeprefix("torch.")  # torch.bfloat16 -> "bfloat16", the spelling config.json uses


def config_json(config, dtype):
    """config.json for `config` with weights stored in `dtype`, under both dtype keys."""
    return to_hf(config) | {"dtype": dtype_name(dtype), "torch_dtype": dtype_name(dtype)}


def read_config(path):
    """(LlamaConfig, stored dtype or None) of a model directory."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file}: not found (expected a Hugging Face model directory)")
    d = read_json(file)
    name = d.get("dtype") or d.get("torch_dtype")
    if name is not None and not isinstance(getattr(torch, str(name), None), torch.dtype):
        raise ValueError(f"{file}: dtype {name!r} is not a torch dtype (expected e.g. bfloat16)")
    return from_hf(d, file), getattr(torch, name) if name else None
