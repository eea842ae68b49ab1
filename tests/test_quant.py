"""quant.py against its references: NF4 bytes and values equal bitsandbytes 0.50 on CPU (both ways), NF4Linear equals
bitsandbytes' Linear4bit and F.linear on the dequantized weight, quantize_ swaps exactly the chosen linears (from a
live model or from a checkpoint into a meta model, with identical buffers), pre-quantized checkpoints round-trip
bit-exactly and share the bnb-4bit format with transformers in both directions, bad files fail with one-line errors,
and the quantized SmolLM2-135M blocks take at most 4.13 bits per parameter.

bitsandbytes 0.50.2's AVX-512 CPU dequantize kernel looks up a row's absmax as if every row started a new block, which
is wrong when in_features is a multiple of 16 but not of 64; comparisons that run bnb's CPU kernels use shapes where
its flat (correct) indexing applies: in_features a multiple of 64, or not a multiple of 16.
"""

import json
import os

import bitsandbytes as bnb
import bitsandbytes.functional as BF
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

import quant
from model import Checkpoint, Llama, LlamaConfig, load_weights_

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (out, in): whole blocks; n = 1000 (partial last block); 338 blocks (two nested blocks, the last partial); n = 63 odd
SHAPES = [(128, 256), (10, 100), (300, 72), (7, 9)]
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
)


def buffers(layer):
    return [layer.weight, layer.absmax, layer.nested_absmax, layer.offset]


def tiny_llama(dtype=torch.float32):
    return Llama(LlamaConfig(**TINY)).to(dtype)


def save_dense(model, path):
    """A HF-format directory of a 16-bit model (config.json + model.safetensors, tied lm_head omitted)."""
    os.makedirs(path, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    save_file(state, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.config.to_hf(), f)


def load_quantized_llama(path, compute_dtype=torch.float32):
    """The loading recipe for a pre-quantized directory: meta model, quantize_ from the checkpoint, the rest."""
    ckpt = Checkpoint(path)
    with torch.device("meta"):
        model = Llama(LlamaConfig.from_json(os.path.join(path, "config.json")))
    quant.quantize_(model, weights=ckpt, compute_dtype=compute_dtype)
    return load_weights_(model, ckpt)


def test_code_books_match_bitsandbytes_and_the_paper():
    """NF4 equals bnb's table and the paper's construction (normal quantiles, 8 positive + 7 negative + 0, scaled to
    [-1, 1]) to 1 ulp; the nested 8-bit dynamic map equals bnb's create_dynamic_map bit for bit."""
    assert torch.equal(torch.tensor(quant.NF4), BF.get_4bit_type("nf4", device="cpu"))
    assert torch.equal(quant.dynamic_map(), BF.create_dynamic_map())
    p = (1 - 1 / 30 + 1 - 1 / 32) / 2  # outermost quantile: between the 15- and 16-bin end quantiles
    pos = torch.special.ndtri(torch.linspace(p, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -torch.special.ndtri(torch.linspace(p, 0.5, 8, dtype=torch.float64)[:-1])
    values = torch.cat([pos, neg, torch.zeros(1, dtype=torch.float64)]).sort().values
    torch.testing.assert_close(
        values / values.abs().max(), torch.tensor(quant.NF4, dtype=torch.float64), atol=2e-7, rtol=0
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_and_dequantize_equal_bitsandbytes(shape, dtype):
    """Packed codes, 8-bit absmax, nested absmax and offset equal bnb.functional.quantize_4bit(nf4, blocksize 64,
    compress_statistics) byte for byte; the dequantized weights are bit-identical; and each side dequantizes the other's
    buffers to the same tensor."""
    w = (torch.randn(shape) * 0.02).to(dtype)
    ours = quant.quantize_nf4(w)
    packed, state = BF.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    for a, b in zip(ours, [packed, state.absmax, state.state2.absmax, state.offset], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    dense, bnb_dense = quant.dequantize_nf4(*ours, shape, dtype), BF.dequantize_4bit(packed, state)
    assert dense.dtype == dtype and torch.equal(dense, bnb_dense)
    # exchange: we read bnb's buffers, bnb reads ours
    assert torch.equal(
        quant.dequantize_nf4(packed, state.absmax, state.state2.absmax, state.offset, shape, dtype), bnb_dense
    )
    state.absmax, state.state2.absmax, state.offset = ours[1], ours[2], ours[3]
    assert torch.equal(BF.dequantize_4bit(ours[0], state), dense)


def test_quantization_error_is_nf4_sized():
    """Dequantized values are the nearest NF4 value times the block absmax: for N(0, 1) weights the error stays below
    half the widest NF4 gap times the block absmax, and zero blocks stay exactly zero."""
    w = torch.randn(64, 128)
    w[3] = 0
    dense = quant.dequantize_nf4(*quant.quantize_nf4(w), w.shape, torch.float32)
    block_absmax = w.view(-1, 64).abs().amax(1, keepdim=True)
    widest = max(b - a for a, b in zip(quant.NF4[:-1], quant.NF4[1:], strict=True))
    assert ((dense - w).view(-1, 64).abs() <= block_absmax * (widest / 2 + 0.01)).all()
    assert torch.equal(dense[3], torch.zeros(128))


@pytest.mark.parametrize("compute_dtype", DTYPES)
def test_nf4linear_matches_linear4bit_and_f_linear(compute_dtype):
    """Forward output and input gradient equal bitsandbytes' Linear4bit (same bytes, bias on) and F.linear on the
    dequantized weight; only the bias is a parameter, the buffers never get a gradient; dequantize_bnb (the CUDA path's
    QuantState over our buffers) gives the same weight."""
    linear = nn.Linear(128, 96, bias=True)
    ours = quant.NF4Linear.from_linear(linear, compute_dtype)
    ref = bnb.nn.Linear4bit(128, 96, bias=True, compute_dtype=compute_dtype, quant_type="nf4", compress_statistics=True)
    ref.weight = bnb.nn.Params4bit(linear.weight.data.clone(), requires_grad=False, quant_type="nf4")
    ref.bias = nn.Parameter(linear.bias.data.clone())
    ref = ref.to("cpu")  # quantizes
    assert torch.equal(ref.weight.data, ours.weight)
    assert torch.equal(ours.dequantize_bnb(), ours.dequantize())

    x = torch.randn(2, 5, 128, dtype=compute_dtype, requires_grad=True)
    x_ref, x_f = (x.detach().clone().requires_grad_(True) for _ in range(2))
    w = ours.dequantize()
    bias_f = ours.bias.detach().clone().requires_grad_(True)
    y, y_ref, y_f = ours(x), ref(x_ref), F.linear(x_f, w, bias_f)
    grad = torch.randn_like(y)
    for out in (y, y_ref, y_f):
        out.backward(grad)
    assert y.dtype == compute_dtype and torch.equal(y, y_ref) and torch.equal(y, y_f)
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(x.grad, x_f.grad)
    torch.testing.assert_close(ours.bias.grad, bias_f.grad)
    assert [n for n, _ in ours.named_parameters()] == ["bias"]
    assert all(not b.requires_grad and b.grad is None for b in ours.buffers())


def test_quantize_swaps_exactly_the_block_linears():
    """Default: every nn.Linear in model.layers becomes NF4Linear, embeddings and lm_head stay; the quantized model's
    logits equal a dense model holding the dequantized weights; targets= picks modules by name suffix."""
    model = tiny_llama()
    block_linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("model.layers.")}
    dense = tiny_llama()
    dense.load_state_dict(model.state_dict())
    quant.quantize_(model, compute_dtype=torch.float32)
    assert {n for n, m in model.named_modules() if isinstance(m, quant.NF4Linear)} == block_linears
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    for name in block_linears:
        dense.get_submodule(name).weight.data = model.get_submodule(name).dequantize()
    ids = torch.randint(0, 128, (2, 7))
    assert torch.equal(model(ids), dense(ids))

    partial = quant.quantize_(tiny_llama(), targets=["q_proj", "layers.1.mlp.up_proj"])
    chosen = {n for n, m in partial.named_modules() if isinstance(m, quant.NF4Linear)}
    assert chosen == {
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.mlp.up_proj",
    }


def test_meta_model_from_checkpoint_equals_materialised(tmp_path):
    """quantize_ on a meta-device model reading bf16 weights from a Checkpoint gives buffers identical to quantizing
    the materialised model, and (after load_weights_) identical logits."""
    model = tiny_llama(torch.bfloat16)
    save_dense(model, tmp_path)
    quant.quantize_(model)
    ckpt = Checkpoint(str(tmp_path))
    with torch.device("meta"):
        meta = Llama(model.config)
    quant.quantize_(meta, weights=ckpt)
    load_weights_(meta, ckpt)
    for (name, a), (_, b) in zip(model.named_modules(), meta.named_modules(), strict=True):
        if isinstance(a, quant.NF4Linear):
            assert isinstance(b, quant.NF4Linear) and all(map(torch.equal, buffers(a), buffers(b))), name
    ids = torch.randint(0, 128, (1, 9))
    assert torch.equal(model(ids), meta(ids))


def test_save_and_reload_prequantized_is_bit_exact(tmp_path):
    """save_quantized -> quantize_ from the checkpoint reloads bit-identical buffers and identical logits without
    re-quantizing; transformers + bitsandbytes load the same directory to the same logits (fp32 compute)."""
    from transformers import AutoModelForCausalLM

    model = quant.quantize_(tiny_llama(), compute_dtype=torch.float32)
    quant.save_quantized(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["bnb_4bit_quant_type"] == "nf4"
    reloaded = load_quantized_llama(str(tmp_path))
    for (name, a), (_, b) in zip(model.named_modules(), reloaded.named_modules(), strict=True):
        if isinstance(a, quant.NF4Linear):
            assert all(map(torch.equal, buffers(a), buffers(b))), name
    ids = torch.randint(0, 128, (2, 9))
    logits = model(ids)
    assert torch.equal(reloaded(ids), logits)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), device_map="cpu")
    hf.train()  # eval mode on an AVX-512-BF16 CPU would switch Linear4bit to a bf16 kernel
    assert isinstance(hf.model.layers[0].mlp.down_proj, bnb.nn.Linear4bit)
    torch.testing.assert_close(hf(ids).logits, logits, atol=1e-5, rtol=1e-5)


def test_transformers_bnb_4bit_checkpoint_loads(tmp_path):
    """A checkpoint written by transformers + bitsandbytes (BitsAndBytesConfig nf4, double quant, CPU) loads into our
    Llama as is and gives transformers' logits (fp32 compute)."""
    from transformers import BitsAndBytesConfig, LlamaForCausalLM
    from transformers import LlamaConfig as HFConfig

    cfg = dict(TINY, max_position_embeddings=64, rms_norm_eps=1e-6)
    LlamaForCausalLM(HFConfig(**cfg)).save_pretrained(tmp_path / "dense")
    bnb_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "dense", quantization_config=bnb_config, device_map="cpu")
    hf.save_pretrained(tmp_path / "q4")
    assert "model.layers.0.self_attn.q_proj.weight.quant_state.bitsandbytes__nf4" in load_file(
        tmp_path / "q4/model.safetensors"
    )
    ours = load_quantized_llama(str(tmp_path / "q4"))
    hf.train()
    ids = torch.randint(0, 128, (2, 9))
    torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)


def _corrupt(src, dst, edit):
    os.makedirs(dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
        g.write(f.read())


def _with_state(**changes):
    key = "model.layers.1.mlp.up_proj.weight.quant_state.bitsandbytes__nf4"

    def edit(tensors):
        state = json.loads(bytes(tensors[key].tolist()))
        tensors[key] = torch.tensor(list(json.dumps(state | changes).encode()), dtype=torch.uint8)

    return edit


BAD = {
    "missing absmax": (lambda t: t.pop("model.layers.1.mlp.up_proj.weight.absmax"), "up_proj.weight"),
    "missing nested absmax": (
        lambda t: t.pop("model.layers.1.mlp.up_proj.weight.nested_absmax"),
        "up_proj.weight.nested_absmax",
    ),
    "short absmax": (
        lambda t: t.update({"model.layers.0.self_attn.k_proj.weight.absmax": torch.zeros(3, dtype=torch.uint8)}),
        "k_proj.weight.absmax",
    ),
    "short codes": (
        lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(10, 1, dtype=torch.uint8)}),
        "k_proj.weight",
    ),
    "wrong shape": (_with_state(shape=[64, 128]), "up_proj.weight.quant_state"),
    "wrong blocksize": (_with_state(blocksize=128), "up_proj.weight.quant_state"),
    "fp4": (_with_state(quant_type="fp4"), "up_proj.weight.quant_state"),
    "other code book": (
        lambda t: t["model.layers.0.mlp.gate_proj.weight.quant_map"].mul_(0.5),
        "gate_proj.weight.quant_map",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_prequantized_file_fails_with_one_line_error(tmp_path, case):
    """A mismatched pre-quantized file (missing or short tensors, wrong shape, blocksize, quant type or code book)
    raises one line naming the file and the tensor instead of loading garbage."""
    good = tmp_path / "good"
    quant.save_quantized(quant.quantize_(tiny_llama()), good)
    edit, tensor = BAD[case]
    _corrupt(good, tmp_path / "bad", edit)
    with pytest.raises((ValueError, KeyError)) as err:
        load_quantized_llama(str(tmp_path / "bad"))
    message = str(err.value)
    assert "\n" not in message and "model.safetensors" in message and tensor in message, message


def test_truncated_prequantized_file_fails_with_one_line_error(tmp_path):
    """A truncated model.safetensors fails with one line naming the file."""
    quant.save_quantized(quant.quantize_(tiny_llama()), tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError) as err:
        load_quantized_llama(str(tmp_path))
    assert "\n" not in str(err.value) and "model.safetensors" in str(err.value)


def test_smollm2_blocks_take_at_most_4_13_bits_per_parameter(smollm2_dir):
    """Quantizing SmolLM2-135M's block linears from its checkpoint (meta model, tensor by tensor) stores at most 4.13
    bits per quantized parameter, counted from the buffers (codes, 8-bit absmax, nested absmax, offset)."""
    ckpt = Checkpoint(smollm2_dir)
    with torch.device("meta"):
        model = Llama(LlamaConfig.from_json(os.path.join(smollm2_dir, "config.json")))
    quant.quantize_(model, weights=ckpt)
    load_weights_(model, ckpt, dtype=torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, quant.NF4Linear)]
    assert len(layers) == 7 * model.config.num_hidden_layers
    bits = params = 0
    for m in layers:
        b = 8 * sum(t.numel() * t.element_size() for t in buffers(m))
        assert b / (m.in_features * m.out_features) <= 4.13
        bits, params = bits + b, params + m.in_features * m.out_features
    rest = sum(p.numel() * p.element_size() for p in model.parameters())
    print(
        f"\nSmolLM2-135M: {params / 1e6:.1f}M parameters in NF4 at {bits / params:.4f} bits each "
        f"({bits / 8 / 2**20:.1f} MiB) + {rest / 2**20:.1f} MiB bf16 embeddings and norms "
        f"= {(bits / 8 + rest) / 2**20:.1f} MiB in all"
    )
    assert bits / params <= 4.13
