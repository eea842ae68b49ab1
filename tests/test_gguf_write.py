"""gguf_write.py writes merged Hugging Face directories out as GGUF files that llama.cpp can run, against llama.cpp's
own conversion of SmolLM2 (the published GGUF), transformers' GGUF reader, the gguf package's reader and name map,
transformers' RoPE, and gguf_read.py for the round trip:
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
- bad input (no directory, no config, an adapter, NF4, LoRA leftovers, a missing tensor, an unknown type, rows that
  q8_0 cannot cut, sentencepiece, an unknown pre-tokenizer) is one line naming the file, and writes nothing; files are
  written atomically with ordinary permissions; the command line writes, reads back and fails in one line.
"""

import errno
import filecmp
import json
import os
import stat

import numpy as np
import pytest
import torch
from conftest import CHATML
from test_gguf_read import LOSSY, MESSAGES, SPLIT_DIFFERS, TEXTS
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

import convert
import lora
from model import Llama, LlamaConfig
from support.data import tokenizer
from support.evaluation.sampling import generate_batch
from support.formats import atomic, gguf_read, gguf_write, hf
from support.formats.hf import from_hf
from train import load_model

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
def official(smollm2_gguf):
    from gguf import GGUFReader

    return GGUFReader(os.path.join(*smollm2_gguf))


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
    model = load_model(src, torch.float32)
    expected = [generate_batch(model, [ids], new_tokens)[0] for ids in prompts]
    for back in backs:
        model = load_model(back, torch.float32)
        assert [generate_batch(model, [ids], new_tokens)[0] for ids in prompts] == expected, back


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
        path = gguf_write.export_gguf(src, str(root / f"tiny-{t}.gguf"), t)
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
    assert hf.read_config(back)[0] == hf.read_config(tiny["src"])[0]
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
    path = gguf_write.export_gguf(src, str(tmp_path / "llama3.gguf"), "q8_0")
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
    path = gguf_write.export_gguf(src, str(tmp_path / "m.gguf"), "f32")
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
    path = gguf_write.export_gguf(src, str(tmp_path / "m.gguf"), "f32")
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
    path = gguf_write.export_gguf(src, str(tmp_path / "m.gguf"), "f32")
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
    assert hf.read_config(back)[0] == hf.read_config(src)[0]
    tok = tokenizer.Tokenizer(src)
    _assert_same_generations(src, [back], [tok.encode(p) for p in PROMPTS[:2]])


def test_llama_tensor_names_follow_the_gguf_package(tiny):
    from gguf import GGUFReader

    names = _name_map("llama", LLAMA["num_hidden_layers"])
    expected = {names.get_name(k, try_suffixes=(".weight", ".bias")) for k in _tensors(tiny["src"])}
    assert {t.name for t in GGUFReader(tiny["f32"][0]).tensors} == expected


def _small(path, bpe_dir, **cfg):
    return _model_dir(path, LLAMA | dict(num_hidden_layers=1) | cfg, bpe_dir)


def _adapter(path, bpe_dir):
    model = load_model(_small(path.parent / "base", bpe_dir))
    lora.add_lora_(model, "all-linear", r=4, alpha=8, dropout=0.0)
    hf.save_adapter(model, path)
    return path


def _nf4(path, bpe_dir):
    hf.save_quantized(load_model(_small(path.parent / "base", bpe_dir), quantize=True), path)
    return path


def _unmerged(path, bpe_dir):
    src = _small(path, bpe_dir)
    model = load_model(src)
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
    assert sorted(os.listdir(tmp_path)) == ["m.gguf", "probe"]
    assert stat.S_IMODE(os.stat(out).st_mode) == mode
    assert filecmp.cmp(out, tiny["f16"][0], shallow=False)  # the same model gives the same bytes


def test_command_line(tiny, tmp_path, capsys):
    """`to-gguf DIR OUT --type T` writes the GGUF; `from-gguf GGUF DIR` and the older bare form read a
    GGUF back; a bad argument ends the command with one line."""
    from gguf import GGUFReader, LlamaFileType

    out = tmp_path / "cli.gguf"
    convert.main(["to-gguf", str(tiny["src"]), str(out), "--type", "bf16"])
    assert str(out) in capsys.readouterr().out
    assert GGUFReader(out).fields["general.file_type"].contents() == LlamaFileType.MOSTLY_BF16
    for argv in (["from-gguf", str(out), str(tmp_path / "a")], [str(out), str(tmp_path / "b")]):
        convert.main(argv)
        assert filecmp.cmp(os.path.join(argv[-1], "config.json"), os.path.join(tiny["bf16"][1], "config.json"), False)
    with pytest.raises(SystemExit, match=r"^convert\.py: .*'q4'.*f32, f16, bf16, q8_0"):
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
    gguf_write.export_gguf(src, str(tmp_path / "m.gguf"), "f32")
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.Tokenizer(bpe_dir).encode(PROMPTS[0])])
    with torch.no_grad():
        torch.testing.assert_close(ref(ids).logits, load_model(src, torch.float32)(ids), atol=1e-5, rtol=0)


def test_check_gguf_export_refuses_before_any_weight_is_read(tmp_path, smollm2_dir):
    """check_gguf_export (what train.py runs before training when export_gguf is set) decides from config.json and the
    tokenizer alone, with no weights file: an unknown type and q8_0 rows that are not a multiple of 32 are refused,
    f16 of the same model is not."""

    cfg = LlamaConfig(vocab_size=49152, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=24)  # fmt: skip
    atomic.write_json(tmp_path / "config.json", hf.config_json(cfg, torch.float32))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes(open(os.path.join(smollm2_dir, name), "rb").read())
    with pytest.raises(ValueError, match="'q4_k'.*f32, f16, bf16, q8_0"):
        gguf_write.check_gguf_export(str(tmp_path), "q4_k")
    with pytest.raises(ValueError, match="has rows of 48 values; q8_0 needs a multiple of 32"):
        gguf_write.check_gguf_export(str(tmp_path), "q8_0")
    gguf_write.check_gguf_export(str(tmp_path), "f16")
    assert not (tmp_path / "model.safetensors").exists()
