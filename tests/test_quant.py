"""quant.py against its references.

On CPU: NF4 bytes and values equal bitsandbytes 0.50 (both ways); NF4Linear equals bitsandbytes' Linear4bit and
F.linear on the dequantized weight; quantize_ swaps exactly the chosen linears (from a live model or from a source of
checkpoint tensors into a meta model, with identical buffers), and the quantized SmolLM2-135M blocks take at most 4.13
bits per parameter. (The bnb-4bit file format is tested in test_hf.py.)

torch.compile: the dequantize op passes torch.library.opcheck; dynamo traces an NF4Linear forward and backward as one
graph, the compiled forward keeps only the 4-bit buffers for backward (no dense weight) and the backward recomputes W;
Inductor's outputs and input gradients equal eager ones; a training step of a quantized Llama has no graph break in
quant.py.

Quantization error: the recorded ||W - dequant(W)|| / ||W|| equals the same norm over bitsandbytes' own dequantized
weights, progress.nf4_error reports their mean and worst layer, and on SmolLM2 every layer stays under a bound derived
from NF4's error on Gaussian blocks.

bitsandbytes 0.50.2's AVX-512 CPU dequantize kernel looks up a row's absmax as if every row started a new block, which
is wrong when in_features is a multiple of 16 but not of 64; comparisons that run bnb's CPU kernels use shapes where
its flat (correct) indexing applies: in_features a multiple of 64, or not a multiple of 16. bitsandbytes is imported by
the tests that use it (the `bnb` fixture), so this file also runs on a GPU machine without it.
"""

import copy
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

import quant
from model import Llama, LlamaConfig
from support.formats.hf import Checkpoint, load_weights_, to_hf
from support.kernels import nf4_ops
from support.run import progress
from train import load_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CUDA dequantize paths)")


def nf4_linear(linear, compute_dtype):
    """An nn.Linear (weight and bias) quantized into a quant.NF4Linear on its device, its rel_error recorded, as
    quant.quantize_ quantizes a model's linears."""
    q = quant.quantize_nf4(linear.weight)
    layer = quant.NF4Linear.from_nf4(q, linear.out_features, linear.in_features, linear.bias, compute_dtype)
    layer.rel_error = quant.relative_error(linear.weight, q)
    return layer


@pytest.fixture
def bnb():
    """bitsandbytes (with .functional loaded), the NF4 reference; requirements-test.txt installs it."""
    pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes is the NF4 reference (requirements-test.txt)")
    import bitsandbytes

    return bitsandbytes


@pytest.fixture(scope="module")
def smollm2_nf4(smollm2_dir):
    """SmolLM2-135M with NF4 block linears in bf16, quantized from its checkpoint tensor by tensor (a meta model)."""
    return load_model(smollm2_dir, torch.bfloat16, quantize=True)


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
        json.dump(to_hf(model.config), f)


def test_code_books_match_bitsandbytes_and_the_paper(bnb):
    """NF4 equals bnb's table and the paper's construction (normal quantiles, 8 positive + 7 negative + 0, scaled to
    [-1, 1]) to 1 ulp; the nested 8-bit dynamic map equals bnb's create_dynamic_map bit for bit."""
    BF = bnb.functional
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
def test_quantize_and_dequantize_equal_bitsandbytes(bnb, shape, dtype):
    """Packed codes, 8-bit absmax, nested absmax and offset equal bnb.functional.quantize_4bit(nf4, blocksize 64,
    compress_statistics) byte for byte; the dequantized weights are bit-identical; and each side dequantizes the other's
    buffers to the same tensor."""
    w = (torch.randn(shape) * 0.02).to(dtype)
    ours = quant.quantize_nf4(w)
    BF = bnb.functional
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
def test_nf4linear_matches_linear4bit_and_f_linear(bnb, compute_dtype):
    """Forward output and input gradient equal bitsandbytes' Linear4bit (same bytes, bias on) and F.linear on the
    dequantized weight; only the bias is a parameter, the buffers never get a gradient; bitsandbytes' kernel (the
    CUDA path's QuantState over our buffers, nf4_ops.dequantize_bnb) gives the same weight."""
    linear = nn.Linear(128, 96, bias=True)
    ours = nf4_linear(linear, compute_dtype)
    ref = bnb.nn.Linear4bit(128, 96, bias=True, compute_dtype=compute_dtype, quant_type="nf4", compress_statistics=True)
    ref.weight = bnb.nn.Params4bit(linear.weight.data.clone(), requires_grad=False, quant_type="nf4")
    ref.bias = nn.Parameter(linear.bias.data.clone())
    ref = ref.to("cpu")  # quantizes
    assert torch.equal(ref.weight.data, ours.weight)
    bnb_weight = nf4_ops.dequantize_bnb(*ours.nf4_weight(), (96, 128), compute_dtype)
    assert torch.equal(bnb_weight, ours.dequantize())

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


def test_quantize_hands_every_layer_the_dequantize_op_it_is_given():
    """quantize_ gives every NF4Linear it makes the op it is handed (how a model built on a GPU gets its kernel,
    support/kernels/nf4_ops.py), and the layer's forward, backward and dequantize() all run that op; by default it is
    the reference function, and a model holding it deep-copies."""
    copied = copy.deepcopy(quant.quantize_(tiny_llama()))
    default = [m for m in copied.modules() if isinstance(m, quant.NF4Linear)]
    assert len(default) == 14 and all(m.dequantize_op is quant.dequantize_nf4 for m in default)
    shapes = []

    def recorded(*args):
        shapes.append(tuple(args[4]))
        return quant.dequantize_nf4(*args)

    model = quant.quantize_(tiny_llama(), compute_dtype=torch.float32, dequantize_op=recorded)
    layers = [m for m in model.modules() if isinstance(m, quant.NF4Linear)]
    assert len(layers) == 14 and all(m.dequantize_op is recorded for m in layers)
    model(torch.randint(0, 128, (1, 5))).sum().backward()  # the embeddings train: each layer's input gradient
    assert len(shapes) == 2 * len(layers)
    layers[0].dequantize()
    assert shapes[-1] == (layers[0].out_features, layers[0].in_features)


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_qlora_model_equals_transformers_bitsandbytes_from_an_fp32_checkpoint(bnb, tmp_path, dtype):
    """A 16-bit QLoRA model loaded from an fp32 checkpoint (as the converted SmolLM2 is stored) holds the NF4 bytes
    that transformers + bitsandbytes hold for the same checkpoint and dtype (they round each weight to the dtype,
    then quantize), and its training-mode forward gives their logits bit for bit."""
    import transformers

    save_dense(tiny_llama(torch.float32), tmp_path)
    ours = load_model(str(tmp_path), dtype, quantize=True)
    quantization = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype
    )
    theirs = transformers.LlamaForCausalLM.from_pretrained(
        str(tmp_path), dtype=dtype, device_map="cpu", quantization_config=quantization
    )
    for name, layer in ours.named_modules():
        if isinstance(layer, quant.NF4Linear):
            ref = theirs.get_submodule(name).weight
            assert torch.equal(layer.weight.view(-1), ref.data.view(-1)), name
            assert torch.equal(layer.absmax, ref.quant_state.absmax), name
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():  # training mode: bitsandbytes dequantizes and calls F.linear, as NF4Linear does
        assert torch.equal(ours.train()(ids), theirs.train()(ids).logits)


def test_smollm2_blocks_take_at_most_4_13_bits_per_parameter(smollm2_nf4):
    """Quantizing SmolLM2-135M's block linears from its checkpoint (meta model, tensor by tensor) stores at most 4.13
    bits per quantized parameter, counted from the buffers (codes, 8-bit absmax, nested absmax, offset)."""
    model = smollm2_nf4
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


# ----------------------------------------------------------------------------- the Triton kernel, on CPU


def test_nf4linear_traces_as_one_graph_and_saves_only_4_bit_buffers():
    """dynamo traces an NF4Linear forward (with its backward, as autograd functions are traced) as one graph with no
    break; AOTAutograd's forward graph calls the dequantize op once and keeps for backward the four NF4 buffers and no
    (out, in) tensor, and the backward graph dequantizes again to form the input gradient."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    layer = nf4_linear(nn.Linear(128, 96, bias=True), torch.float32)
    layer.dequantize_op = nf4_ops.REFERENCE_OP  # the opaque op a model's builder hands its layers
    x = torch.randn(2, 5, 128, requires_grad=True)
    step = lambda x: layer(x).square().sum()  # noqa: E731
    explained = torch._dynamo.explain(step)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons

    graphs = {}

    def capture(name):
        def compiler(gm, inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)

        return compiler

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=aot_autograd(fw_compiler=capture("fw"), bw_compiler=capture("bw")))
    compiled(x).backward()
    op = torch.ops.nanoqlora.dequantize_nf4.default
    calls = {k: [n for n in g.graph.nodes if n.target == op] for k, g in graphs.items()}
    assert len(calls["fw"]) == 1 and len(calls["bw"]) == 1
    saved = [n.meta["val"] for n in graphs["bw"].graph.find_nodes(op="placeholder") if "tangents" not in n.name]
    assert not any(t.shape == (96, 128) for t in saved), [t.shape for t in saved]
    buffers_saved = [t for t in saved if t.dtype == torch.uint8 or t.dim() < 2]
    assert [t.shape for t in buffers_saved] == [t.shape for t in layer.nf4_weight()]
    torch._dynamo.reset()


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_compiled_nf4linear_equals_eager(compute_dtype):
    """torch.compile (Inductor, CPU) of an NF4Linear gives eager's output, input gradient and bias gradient (up to the
    summation order of the matmuls), and a compiled dequantize() gives eager's weight bit for bit."""
    layer = nf4_linear(nn.Linear(128, 96, bias=True), compute_dtype)
    layer.dequantize_op = nf4_ops.REFERENCE_OP  # the opaque op a model's builder hands its layers
    x = torch.randn(2, 5, 128, dtype=compute_dtype, requires_grad=True)
    x_c = x.detach().clone().requires_grad_(True)
    compiled = torch.compile(layer)
    y, y_c = layer(x), compiled(x_c)
    grad = torch.randn_like(y)
    y.backward(grad)
    bias_grad = layer.bias.grad.clone()
    layer.bias.grad = None
    y_c.backward(grad)
    torch.testing.assert_close(y_c, y)
    torch.testing.assert_close(x_c.grad, x.grad)
    torch.testing.assert_close(layer.bias.grad, bias_grad)
    assert torch.equal(torch.compile(layer.dequantize)(), layer.dequantize())
    torch._dynamo.reset()


def test_quantized_llama_training_step_has_no_graph_break_in_quant():
    """A training forward with loss of a one-block Llama quantized by quantize_ (7 NF4 linears): dynamo's graph breaks
    (model.py's data-dependent loss code) never come from quant.py, and the traced graphs hold every NF4 linear's
    autograd function with the dequantize op in its forward and its backward: 2 x 7 calls."""
    model = Llama(LlamaConfig(**TINY | dict(num_hidden_layers=1)))
    model = quant.quantize_(model, compute_dtype=torch.float32, dequantize_op=nf4_ops.REFERENCE_OP)
    ids = torch.randint(0, 128, (2, 12))
    labels = ids.masked_fill(torch.arange(12) < 3, -100)

    def step(ids, labels):
        loss, n = model(ids, labels=labels)
        return loss / n

    explained = torch._dynamo.explain(step)(ids, labels)
    for reason in explained.break_reasons:
        assert not any(os.path.basename(f.filename) == "quant.py" for f in reason.user_stack), reason.reason
    op = torch.ops.nanoqlora.dequantize_nf4.default
    traced = sum(n.target == op for g in explained.graphs for m in g.modules() for n in m.graph.nodes)
    assert traced == 2 * 7, traced
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- quantization error


def bnb_relative_error(bnb, w):
    """||W - dequant(W)||_F / ||W||_F with bitsandbytes' own quantize_4bit / dequantize_4bit (fp32 output)."""
    packed, state = bnb.functional.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    state.dtype = torch.float32
    w = w.float()
    return (
        torch.linalg.vector_norm(w - bnb.functional.dequantize_4bit(packed, state)) / torch.linalg.vector_norm(w)
    ).item()


def test_recorded_error_equals_bitsandbytes(bnb):
    """quantize_ records on every NF4Linear it quantizes from a bf16 weight the relative error computed over
    bitsandbytes' dequantized weights (in_features 64 and 128: bnb's CPU kernel indexes those right), progress.nf4_error
    gives their mean and the worst layer, a layer built from a pre-quantized NF4Weight records None and a model of such
    layers has no summary."""
    model = tiny_llama(torch.bfloat16)
    dense = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    quant.quantize_(model)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, quant.NF4Linear)}
    ref = {n: bnb_relative_error(bnb, dense[n]) for n in layers}
    assert {n: m.rel_error for n, m in layers.items()} == ref
    worst = max(ref, key=ref.get)
    summary = progress.nf4_error(model)
    assert summary == dict(layers=14, mean=sum(ref.values()) / 14, worst=ref[worst], worst_layer=worst)

    nf4 = {f"{n}.weight": quant.quantize_nf4(w) for n, w in dense.items()}
    with torch.device("meta"):
        meta = Llama(model.config)
    quant.quantize_(meta, weights=nf4.__getitem__)
    assert all(m.rel_error is None for m in meta.modules() if isinstance(m, quant.NF4Linear))
    assert progress.nf4_error(meta) is None and progress.nf4_error(tiny_llama()) is None


def test_smollm2_quantization_error_is_bounded_by_gaussian_nf4(bnb, smollm2_nf4, smollm2_dir):
    """Every SmolLM2-135M linear loses at most 3 / 2.6 = 1.15x the relative error of NF4 on Gaussian weights, and the
    worst layer's recorded error equals bitsandbytes' on its checkpoint weight rounded to bf16 (the weight quantize_
    quantizes in a bf16 run).

    Why that bound: NF4 stretches its code book to each block's absolute maximum, so a block's error relative to its
    RMS grows with absmax / RMS (less than proportionally: heavier tails put more values near 0, where codes are
    dense). Gaussian blocks of 64 have absmax = 2.6 RMS on average (measured here); the bound admits layers whose
    blocks reach 3 RMS, the usual three-sigma, i.e. tails somewhat heavier than the normal distribution NF4 is built
    for. A layer above it holds outliers that NF4 represents poorly."""
    g = torch.randn(2**20 // 64, 64)
    gaussian = quant.relative_error(g, quant.quantize_nf4(g))
    ratio = (g.abs().amax(1) / g.square().mean(1).sqrt()).mean().item()
    bound = gaussian * 3 / ratio
    summary = progress.nf4_error(smollm2_nf4)
    errors = [m.rel_error for m in smollm2_nf4.modules() if isinstance(m, quant.NF4Linear)]
    print(
        f"\nNF4 relative error: Gaussian blocks {gaussian:.4f} (absmax / RMS {ratio:.3f}), bound {bound:.4f}; "
        f"SmolLM2-135M over {summary['layers']} linears: mean {summary['mean']:.4f}, min {min(errors):.4f}, "
        f"worst {summary['worst']:.4f} ({summary['worst_layer']})"
    )
    assert summary["layers"] == len(errors) == 7 * smollm2_nf4.config.num_hidden_layers
    assert summary["worst"] == max(errors) <= bound
    w = Checkpoint(smollm2_dir).get(f"{summary['worst_layer']}.weight").bfloat16()
    assert summary["worst"] == bnb_relative_error(bnb, w)


# ----------------------------------------------------------------------------- on a GPU
