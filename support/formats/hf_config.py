"""How is a Hugging Face config.json read into a LlamaConfig, and written back?

config.json holds the hyper-parameters and the family (model_type). Qwen2/2.5, Qwen3 and Mistral are the Llama of
model.py with a switch or two, read here: Qwen2 puts biases on q/k/v (o_proj has none); Qwen3 normalises each head of
q and k and sets its head size explicitly; Mistral (v0.1) and Qwen with use_sliding_window attend within a sliding
window, in every layer (Mistral) or in the layers from max_window_layers on (Qwen); Llama's attention_bias puts biases
on all four projections. Families that need more than switches (Gemma's scaled embeddings, Phi's fused projections,
mixtures of experts) are refused with what they would need. RoPE comes in transformers 5's rope_parameters or the
classic top-level rope_theta + rope_scaling; both are read, the classic form is written, as every transformers reads
it. The stored dtype is under "dtype" (transformers 5) and "torch_dtype" (older readers): both are written, either
read.
"""

import os

import torch

from model import LlamaConfig
from support.formats.atomic import read_json

REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
PLAIN_KEYS = ("rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id")
ROPE_KEYS = {"default": (), "linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
# The families this Llama reads, by config.json model_type, and the class name transformers gives each.
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
    """A config.json dict in the classic form (top-level rope_theta + rope_scaling) every transformers reads, as
    the family's own config class spells it. Only Hugging Face keys are written, whatever else a fork stores."""
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
    """(rope_theta, rope_scaling or None) of a config.json dict. transformers 5 writes rope_parameters (with
    rope_theta inside); published checkpoints carry a top-level rope_theta plus rope_scaling, whose kind is under
    "rope_type" (or "type" in older files)."""
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
