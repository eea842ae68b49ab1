"""quant.py against its references: NF4 bytes and values equal bitsandbytes 0.50 on CPU (both ways), NF4Linear equals
bitsandbytes' Linear4bit and F.linear on the dequantized weight, quantize_ swaps exactly the chosen linears (from a
live model or from a source of checkpoint tensors into a meta model, with identical buffers), and the quantized
SmolLM2-135M blocks take at most 4.13 bits per parameter. (The bnb-4bit file format is tested in test_hf.py.)

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
from safetensors.torch import save_file
from torch import nn

import quant
from hf import Checkpoint, load_model, load_weights_
from model import Llama, LlamaConfig

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
    """quantize_ on a meta-device model reading bf16 weights one by one from a Checkpoint gives buffers identical to
    quantizing the materialised model, and (after load_weights_) identical logits."""
    model = tiny_llama(torch.bfloat16)
    save_dense(model, tmp_path)
    quant.quantize_(model)
    ckpt = Checkpoint(str(tmp_path))
    with torch.device("meta"):
        meta = Llama(model.config)
    quant.quantize_(meta, weights=ckpt.get)
    load_weights_(meta, ckpt)
    for (name, a), (_, b) in zip(model.named_modules(), meta.named_modules(), strict=True):
        if isinstance(a, quant.NF4Linear):
            assert isinstance(b, quant.NF4Linear) and all(map(torch.equal, buffers(a), buffers(b))), name
    ids = torch.randint(0, 128, (1, 9))
    assert torch.equal(model(ids), meta(ids))


def test_smollm2_blocks_take_at_most_4_13_bits_per_parameter(smollm2_dir):
    """Quantizing SmolLM2-135M's block linears from its checkpoint (meta model, tensor by tensor) stores at most 4.13
    bits per quantized parameter, counted from the buffers (codes, 8-bit absmax, nested absmax, offset)."""
    model = load_model(smollm2_dir, torch.bfloat16, quantize=True)
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
