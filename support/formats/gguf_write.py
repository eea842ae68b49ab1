"""How does a merged Hugging Face model become a GGUF file in llama.cpp's own layout? (The format is read back by
gguf_read.py.)

llama.cpp's loader is strict: each key has a fixed type (gguf.GGUFWriter's add_* get it right) and the tensor set must
be exactly what the architecture consumes. Weights take the requested type, 1-D tensors stay F32; a q8_0 row must hold
whole 32-value blocks. Tensors are converted and written one at a time. A tokenizer is written only when it is exactly
one of PRE_TOKENIZERS; anything else is refused before a byte is written.
"""

import collections
import dataclasses
import functools
import json
import os
from typing import NamedTuple

import numpy as np
import torch

from model import Llama, rope_inv_freq
from support.data import tokenizer
from support.formats import atomic, gguf_read, hf
from support.formats.gguf_read import CONTROL, LAYER_NAMES, NORMAL, PRE_TOKENIZERS, TOP_NAMES, UNUSED, USER_DEFINED

GGUF_NAMES = {v: k for k, v in (LAYER_NAMES | TOP_NAMES).items()}  # Hugging Face module path -> GGUF name
# config.json model_type -> GGUF architecture; only llama's W_q/W_k rows are permuted (gguf_read.rope_rows)
GGUF_ARCHS = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}
# --type -> (ggml tensor type of the weight matrices, general.file_type), names in gguf's enums
FILE_TYPES = {"f32": ("F32", "ALL_F32"), "f16": ("F16", "MOSTLY_F16"), "bf16": ("BF16", "MOSTLY_BF16")}
FILE_TYPES["q8_0"] = ("Q8_0", "MOSTLY_Q8_0")


def _merged_model(model_dir):
    """(LlamaConfig, Checkpoint) of a merged model directory, or a one-line error that says what it is instead."""
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"{model_dir}: no such directory (expected a merged Hugging Face model directory)")
    cfg_file = os.path.join(model_dir, "config.json")
    if not os.path.isfile(cfg_file) and os.path.isfile(os.path.join(model_dir, "adapter_config.json")):
        raise ValueError(
            f"{model_dir}: a LoRA adapter (adapter_config.json), not a merged model; merge it into its base first "
            "(train.py --export_merged=True)"
        )
    if os.path.isfile(cfg_file) and "quantization_config" in (raw := atomic.read_json(cfg_file)):
        method = raw["quantization_config"].get("quant_method", "?")
        raise ValueError(
            f"{cfg_file}: quantization_config ({method}) says the weights are quantized; expected a merged 16/32-bit "
            "model (hf.export_merged after merging)"
        )
    cfg, _ = hf.read_config(model_dir)
    return cfg, hf.Checkpoint(model_dir)


def _gguf_arch(cfg, path):
    """The GGUF architecture for a config, or a one-line error for what llama.cpp cannot run."""
    kind = cfg.model_type
    if kind not in GGUF_ARCHS:
        raise ValueError(f"{path}: model_type {kind!r} cannot be written to GGUF (expected {', '.join(GGUF_ARCHS)})")
    arch = GGUF_ARCHS[kind]
    if (cfg.rope_scaling or {}).get("rope_type") == "llama3" and arch != "llama":
        raise ValueError(f"{path}: llama3 rope_scaling is only read by llama.cpp's llama architecture, not {arch}")
    if arch != "llama" and cfg.o_bias:
        raise ValueError(f"{path}: attention_bias puts a bias on o_proj, which llama.cpp's {arch} does not load")
    if arch == "qwen2" and cfg.num_attention_heads * cfg.head_dim != cfg.hidden_size:
        raise ValueError(f"{path}: llama.cpp's qwen2 needs head_dim x num_attention_heads == hidden_size")
    return arch


def _gguf_name(name):
    """Hugging Face parameter name -> GGUF tensor name (the inverse of gguf_read._hf_name)."""
    module, leaf = name.rsplit(".", 1)
    if module.startswith("model.layers."):
        _, _, i, rest = module.split(".", 3)
        return f"blk.{i}.{GGUF_NAMES[rest]}.{leaf}"
    return f"{GGUF_NAMES[module]}.{leaf}"


def _encode(ckpt, name, shape, n_head, ggml_type):
    """Tensor `name` (q/k rows permuted when n_head is given) as GGUF stores it for `ggml_type`, a slab at a time."""
    import gguf

    t = ckpt.get(name, shape)
    t = gguf_read.rope_rows(t, n_head, to_gguf=True) if n_head else t
    if ggml_type == "F32":  # every 1-D tensor too
        return t.float().numpy()
    rows = max(1, (1 << 22) // t.shape[1])  # ~16 MB of fp32 per slab: quantize's temporaries stay small
    qtype = gguf.GGMLQuantizationType[ggml_type]
    return np.concatenate([gguf.quants.quantize(s.float().numpy(), qtype) for s in t.split(rows)])


def _plan(cfg, ckpt, arch, file_type):
    """Every tensor of the file in order, checked before a byte is written: (GGUF name, shape, ggml type name, a
    function that makes the bytes when their turn comes)."""
    with torch.device("meta"):
        model = Llama(cfg)
    known = {n for n, _ in model.named_parameters(remove_duplicate=False)}  # a tied lm_head may be stored or not
    extra = sorted(n for n in ckpt.keys() if n not in known and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ValueError(
            f"{ckpt.where(extra[0])}: tensor {extra[0]} is not a weight of a merged {cfg.model_type} model "
            f"({len(extra)} such; LoRA or NF4 entries must be merged away first)"
        )
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads} if arch == "llama" else {}
    plan, weight_type = [], FILE_TYPES[file_type][0]
    for name, p in model.named_parameters():  # tied: lm_head is embed_tokens, listed once
        if name not in ckpt:
            raise ValueError(f"{ckpt.path}: tensor {name} is missing (expected every weight of a merged model)")
        ggml_type = "F32" if p.ndim == 1 else weight_type
        _check_rows(ckpt.where(name), name, p.shape, ggml_type)
        make = functools.partial(_encode, ckpt, name, p.shape, heads.get(name.split(".")[-2]), ggml_type)
        plan.append((_gguf_name(name), tuple(p.shape), ggml_type, make))
    if (cfg.rope_scaling or {}).get("rope_type") == "llama3":
        scaled, plain = rope_inv_freq(cfg), rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None))
        plan.insert(1, ("rope_freqs.weight", tuple(scaled.shape), "F32", lambda: (plain / scaled).numpy()))
    return plan


class Vocab(NamedTuple):
    """The tokenizer as GGUF stores it."""

    tokens: list  # token strings by id, vocab_size of them
    types: list  # gguf.TokenType values by id
    merges: list  # "a b", best first
    pre: str  # tokenizer.ggml.pre
    ids: dict  # "bos" / "eos" / "unk" / "pad" -> id or None
    add_eos: bool
    tok: tokenizer.Tokenizer  # for add_bos and the chat template


def _pre_step(step):
    """One tokenizer.json pre-tokenizer step in PRE_TOKENIZERS' notation (anything else matches no entry)."""
    kind = step.get("type")
    if kind == "ByteLevel" and not step.get("add_prefix_space"):
        return ("ByteLevel", step.get("use_regex", True))
    if kind == "Digits" and step.get("individual_digits"):
        return ("Digits",)
    if kind == "Split" and step.get("behavior") == "Isolated" and not step.get("invert"):
        if "Regex" in step.get("pattern", {}):
            return ("Split", step["pattern"]["Regex"])
    return (kind, json.dumps(step, sort_keys=True))


def _pre_name(tj, path):
    """The name of the llama.cpp pre-tokenizer that tokenizer.json `tj` defines exactly, or a one-line error."""
    pre = tj.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    found = (
        (tj.get("normalizer") or {}).get("type"),
        tuple(map(_pre_step, steps)),
        bool(tj["model"].get("ignore_merges")),
    )
    for name, definition in PRE_TOKENIZERS.items():
        if found == definition:
            return name
    raise ValueError(
        f"{path}: normalizer {found[0]!r}, pre_tokenizer steps {[s[0] for s in found[1]]} and ignore_merges "
        f"{found[2]} match no pre-tokenizer llama.cpp implements that this file knows ({', '.join(PRE_TOKENIZERS)})"
    )


def _bpe_tokens(tj, n, path):
    """(token strings, token types) for ids 0..n-1 of tokenizer.json `tj`; ids without a token get `[PAD<id>]`."""
    names = {i: t for t, i in tj["model"]["vocab"].items()}
    added = {a["id"]: a for a in tj.get("added_tokens", [])}
    names |= {i: a["content"] for i, a in added.items()}
    if (top := max(names)) >= n:
        raise ValueError(f"{path}: token id {top} ({names[top]!r}) is not below config.json's vocab_size {n}")
    tokens = [names.get(i, f"[PAD{i}]") for i in range(n)]
    kinds = {i: CONTROL if a["special"] else USER_DEFINED for i, a in added.items()}
    types = [kinds.get(i, NORMAL if i in names else UNUSED) for i in range(n)]
    if len(set(tokens)) != n:
        dup = next(t for t, count in collections.Counter(tokens).items() if count > 1)
        raise ValueError(f"{path}: token {dup!r} appears at two ids; llama.cpp needs every token string once")
    return tokens, types


def _vocab(model_dir, cfg):
    """The Vocab of a model directory's byte-level BPE tokenizer.json, or a one-line error for other tokenizers."""
    json_file, sp_file = (os.path.join(model_dir, f) for f in ("tokenizer.json", "tokenizer.model"))
    if not os.path.isfile(json_file):
        if os.path.isfile(sp_file):
            raise ValueError(f"{sp_file}: sentencepiece tokenizers are not written to GGUF (expected tokenizer.json)")
        raise FileNotFoundError(f"{json_file}: not found (expected a byte-level BPE tokenizer)")
    tj = atomic.read_json(json_file)
    bpe = tj.get("model") or {}
    if bpe.get("type") != "BPE" or bpe.get("byte_fallback") or bpe.get("continuing_subword_prefix"):
        kind = "BPE with byte_fallback (sentencepiece-style)" if bpe.get("byte_fallback") else bpe.get("type")
        raise ValueError(f"{json_file}: model is {kind}, expected a byte-level BPE (GPT-2 style)")
    pre = _pre_name(tj, json_file)
    tokens, types = _bpe_tokens(tj, cfg.vocab_size, json_file)
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe.get("merges", [])]
    if bad := next((m for m in merges if m.count(" ") != 1), None):
        raise ValueError(f"{json_file}: merge {bad!r} is not two tokens separated by one space")
    tok = tokenizer.Tokenizer(model_dir)
    index = {t: i for i, t in enumerate(tokens)}
    ids = {k: index.get(tok.special_tokens.get(f"{k}_token")) for k in ("bos", "eos", "unk", "pad")}
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) else cfg.eos_token_id
    # config.json names the id where the tokenizer names no token (Qwen's tokenizer has no bos_token)
    ids["bos"] = cfg.bos_token_id if ids["bos"] is None else ids["bos"]
    ids["eos"] = eos if ids["eos"] is None else ids["eos"]
    tok_cfg_file = os.path.join(model_dir, "tokenizer_config.json")
    add_eos = os.path.isfile(tok_cfg_file) and bool(atomic.read_json(tok_cfg_file).get("add_eos_token"))
    return Vocab(tokens, types, merges, pre, ids, add_eos, tok)


def _write_hparams(w, cfg, file_type, name):
    import gguf

    w.add_type("model")
    w.add_name(name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_theta))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_rope_dimension_count(cfg.head_dim)
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:  # llama.cpp assumes hidden / heads otherwise
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if (cfg.rope_scaling or {}).get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(cfg.rope_scaling["factor"]))
    w.add_file_type(gguf.LlamaFileType[FILE_TYPES[file_type][1]])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _write_vocab(w, vocab):
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(vocab.merges)
    for key, token_id in vocab.ids.items():  # bos, eos, unk, pad
        if token_id is not None:
            getattr(w, f"add_{key}_token_id")(token_id)
    w.add_add_bos_token(vocab.tok.add_bos)  # always written: some pre-tokenizer names imply a default otherwise
    w.add_add_eos_token(vocab.add_eos)
    if vocab.tok.chat_template:
        w.add_chat_template(vocab.tok.chat_template)


def _write_gguf(path, arch, cfg, vocab, plan, file_type, name):
    """Header, metadata and tensor table first (the table only needs shapes), then each tensor's bytes as made."""
    import gguf

    w = gguf.GGUFWriter(path, arch)
    try:
        _write_hparams(w, cfg, file_type, name)
        _write_vocab(w, vocab)
        for tensor_name, shape, ggml_type, _ in plan:
            qtype = gguf.GGMLQuantizationType[ggml_type]
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            # the shape in values, not bytes: gguf reads it as a byte shape only for a uint8 tensor_dtype
            w.add_tensor_info(tensor_name, shape, np.float32, int(np.prod(shape)) // block * size, qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for *_, make in plan:
            w.write_tensor_data(make())
    finally:
        w.close()


def _check_rows(where, name, shape, ggml_type):
    if ggml_type == "Q8_0" and len(shape) == 2 and shape[-1] % 32:
        raise ValueError(
            f"{where}: tensor {name} has rows of {shape[-1]} values; q8_0 needs a multiple of 32 "
            "(f16, bf16 and f32 have no such limit)"
        )


def check_gguf_export(model_dir, file_type):
    """The checks of export_gguf that need only config.json and the tokenizer, so a training run can refuse an export
    llama.cpp could not read before it trains."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"GGUF file type {file_type!r} is not one of {', '.join(FILE_TYPES)}")
    cfg, _ = hf.read_config(model_dir)
    _gguf_arch(cfg, os.path.join(model_dir, "config.json"))
    _vocab(model_dir, cfg)
    with torch.device("meta"):  # shapes only
        for name, p in Llama(cfg).named_parameters():
            _check_rows(os.path.join(model_dir, "config.json"), name, p.shape, FILE_TYPES[file_type][0])


def export_gguf(model_dir, out_path, file_type="q8_0"):
    """Write the merged model in `model_dir` as the GGUF file `out_path`, its weight matrices in `file_type`. Every
    check runs before a byte is written. Returns out_path."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"GGUF file type {file_type!r} is not one of {', '.join(FILE_TYPES)}")
    cfg, ckpt = _merged_model(model_dir)
    arch = _gguf_arch(cfg, cfg_file := os.path.join(model_dir, "config.json"))
    vocab = _vocab(model_dir, cfg)
    if cfg.sliding_layers and cfg.sliding_window < cfg.max_position_embeddings:
        print(f"{cfg_file}: sliding_window {cfg.sliding_window} is not kept: llama.cpp's {arch} attends to all tokens")
    plan = _plan(cfg, ckpt, arch, file_type)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    name = os.path.basename(os.path.abspath(model_dir))
    atomic.atomic_write(out_path, lambda tmp: _write_gguf(tmp, arch, cfg, vocab, plan, file_type, name))
    return out_path
