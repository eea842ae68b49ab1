"""support/kernels/dropout_cuda.py: LoRA dropout's CUDA kernel and its choice.

Proven without a GPU (on Linux; triton has no release for macOS or Windows, where these tests skip, saying so): the
Triton kernel, run by Triton's CPU interpreter, drops and scales exactly the elements the reference (keyed_dropout)
does, bit for bit, in fp32, bf16 and fp16, for rows of lengths that are not multiples of 4 or of the kernel's block,
spread over several programs; its launch grid holds CUDA's limits for every input of an 8B step; a kernel that raises
or differs on the trial is passed over with one line; a model built off CUDA keeps the reference. With a GPU, the tests
marked cuda check the op against the reference there, forward and backward, eager and under torch.compile (one graph,
no break).
"""

import pytest
import torch
from test_nf4_ops import interpret

import lora
from model import Llama, LlamaConfig
from support.kernels import dropout_cuda
from support.kernels.dropout import KEYED_OP, KeyedDropout, keyed_dropout, row_keys

SHAPES = [[3, 7, 11], [2, 5, 300], [4, 2050], [1, 3, 1025]]  # rows x elements: partial blocks, odd lengths
INTERPRET = """
import json, sys, torch
from support.kernels import dropout_cuda
from support.kernels.dropout import keyed_dropout, row_keys
torch.manual_seed(0)
kernel = type(dropout_cuda._triton_kernel()).__name__
results = []
for shape in json.loads(sys.argv[1]):
    for name in ("float32", "bfloat16", "float16"):
        x, keys = torch.randn(shape).to(getattr(torch, name)), row_keys(1337, 5, range(shape[0]))
        for p in (0.05, 0.3, 0.5):
            ref, out = keyed_dropout(x, p, keys), dropout_cuda.keyed_dropout_triton(x, p, keys)
            same = out.dtype == ref.dtype and torch.equal(out, ref) and torch.equal(out.signbit(), ref.signbit())
            results.append(dict(shape=shape, dtype=name, p=p, equal=same, differ=int((out != ref).sum())))
tried = dropout_cuda.runs_like_reference(dropout_cuda.keyed_dropout_triton, "cpu")
print(json.dumps(dict(kernel=kernel, results=results, tried=tried)))
"""
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CUDA dropout kernel)")


def test_triton_kernel_equals_reference_in_the_interpreter():
    """keyed_dropout_triton, run by Triton's CPU interpreter (TRITON_INTERPRET=1, in a subprocess because triton reads
    it at import), equals keyed_dropout bit for bit (zeros' signs included) for every shape of SHAPES, fp32, bf16 and
    fp16, p = 0.05, 0.3, 0.5; runs_like_reference, the trial behind the choice, says so too."""
    out = interpret(INTERPRET, SHAPES)
    assert out["tried"] and len(out["results"]) == len(SHAPES) * 3 * 3
    for r in out["results"]:
        assert r["equal"], r
    print(f"\nTriton dropout kernel (interpreter) vs reference: {len(out['results'])} cases, 0 differing values")


def test_a_kernel_that_fails_or_differs_is_not_chosen(capsys, monkeypatch):
    """runs_like_reference: the reference passes silently; a kernel that raises, or that keeps one element the
    reference drops, fails with one line naming it and saying that PyTorch runs the dropout instead; cuda_keyed_dropout
    takes the Triton kernel exactly when its trial passes."""
    assert dropout_cuda.runs_like_reference(keyed_dropout, "cpu")
    assert capsys.readouterr().out == ""

    def no_compiler(*args):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.\nmore")

    def one_more_kept(x, p, keys):
        out = keyed_dropout(x, p, keys)
        first = (out == 0).flatten().nonzero()[0]
        out.view(-1)[first] = x.reshape(-1)[first] / (1 - p)
        return out

    for impl in (no_compiler, one_more_kept):
        assert not dropout_cuda.runs_like_reference(impl, "cpu"), impl.__name__
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == 1 and lines[0].startswith(impl.__name__), lines
        assert lines[0].endswith("LoRA dropout runs in PyTorch"), lines
    monkeypatch.setattr(dropout_cuda.optional, "installed", lambda package: True)
    for verdict in (False, True):
        tried = []
        trial = lambda impl, device, v=verdict, t=tried: t.append(impl) or v  # noqa: E731
        monkeypatch.setattr(dropout_cuda, "runs_like_reference", trial)
        chosen = dropout_cuda.cuda_keyed_dropout.__wrapped__()  # the choice itself, not this process's cached one
        assert tried == [dropout_cuda.keyed_dropout_triton]
        assert chosen is (dropout_cuda.keyed_dropout_triton if verdict else keyed_dropout), chosen.__name__


def test_the_launch_grid_fits_cuda_limits():
    """The kernel's grid holds CUDA's limits (first axis below 2**31, second at most 65,535) for every adapted input
    of a Llama-3.1-8B step, 1 to 16 rows of 8,192 tokens (down_proj's: 114,688 blocks a row, more than the second
    axis takes); an input of more rows than one launch takes goes to the reference, with its bits."""
    for rows in (1, 2, 16):
        for width in (4096, 14336):
            blocks, launched_rows = dropout_cuda.launch_grid(rows, 8192 * width)
            assert blocks * dropout_cuda.TRITON_BLOCK >= 8192 * width and launched_rows == rows
            assert blocks < 2**31 and launched_rows <= 65_535
    assert dropout_cuda.launch_grid(65_536, 8) is None
    x, keys = torch.randn(65_536, 8), row_keys(1, 2, range(65_536))
    assert torch.equal(dropout_cuda.keyed_dropout_triton(x, 0.2, keys), keyed_dropout(x, 0.2, keys))


def adapted(device, op):
    """The KeyedDropouts of a one-block Llama on `device` with LoRA on every linear, applied by `op`."""
    shape = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    config = LlamaConfig(vocab_size=64, num_hidden_layers=1, **shape)
    with torch.device(device):
        model = Llama(config)
    lora.add_lora_(model, "all-linear", r=2, alpha=4, dropout=0.1, dropout_op=op)
    return [m for m in model.modules() if isinstance(m, KeyedDropout)]


def test_a_model_built_off_cuda_keeps_the_reference():
    """dropout_op_for: off CUDA the reference, as one opaque op (KEYED_OP) where the blocks are compiled, which every
    KeyedDropout add_lora_ builds then holds (7 in a block)."""
    for compiled, want in ((False, keyed_dropout), (True, KEYED_OP)):
        assert dropout_cuda.dropout_op_for("cpu", compiled) is want
        dropouts = adapted("cpu", dropout_cuda.dropout_op_for("cpu", compiled))
        assert len(dropouts) == 7 and all(d.op is want for d in dropouts)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_op_equals_the_reference_forward_and_backward(dtype):
    """On the GPU: the op a model built there holds (the Triton kernel, chosen by its trial) gives the reference's
    output and gradient bit for bit on a (4, 300, 1000) input at p = 0.1, and on a tile of its rows from token 8 the
    whole rows' output there; compiled in one graph with a matmul after it (fullgraph: no break), output and gradient
    equal eager's within the dtype's rounding (another mask would move a tenth of the elements)."""
    op = dropout_cuda.dropout_op_for("cuda")
    assert op is dropout_cuda.CUDA_OP and dropout_cuda.cuda_keyed_dropout() is dropout_cuda.keyed_dropout_triton
    assert all(d.op is op for d in adapted("cuda", op))
    torch.manual_seed(0)
    x = torch.randn(4, 300, 1000, device="cuda", dtype=dtype, requires_grad=True)
    w, keys = torch.randn(8, 1000, device="cuda", dtype=dtype), row_keys(1337, 7, range(4), "cuda")

    def output_and_grad(f, upstream):
        out = f(x)
        (grad,) = torch.autograd.grad(out, x, upstream)
        return out.detach(), grad

    g = torch.randn_like(x)
    ref, ours = [output_and_grad(lambda x, drop=drop: drop(x, 0.1, keys), g) for drop in (keyed_dropout, op)]
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    tile = op(x.detach()[:, 8:], 0.1, keys, 8 * 1000)  # a tile from token 8 drops what the whole rows drop there
    assert torch.equal(tile, ref[0][:, 8:])
    g = torch.randn(4, 300, 8, device="cuda", dtype=dtype)
    compiled = torch.compile(lambda x: op(x, 0.1, keys) @ w.T, fullgraph=True)
    eager = output_and_grad(lambda x: keyed_dropout(x, 0.1, keys) @ w.T, g)
    for got, want in zip(output_and_grad(compiled, g), eager, strict=True):
        torch.testing.assert_close(got, want)
