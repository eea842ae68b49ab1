"""support/kernels/nf4_ops.py: the ops that dequantize NF4 for a built model, the CUDA kernels, and their choice.

The reference op (torch.ops.nanoqlora.dequantize_nf4) passes torch.library's opcheck and gives quant.dequantize_nf4's
tensor; its fake gives the shape and dtype.

Proven without a GPU (on Linux: triton has no release for macOS or Windows, where these tests skip, saying so): the
Triton kernel, run by Triton's CPU interpreter, is bit-identical to the PyTorch reference (quant.dequantize_nf4) for
fp32/bf16/fp16 and awkward shapes; compiled for real GPUs (sm_75 to sm_120) with the launch options, its PTX has no FMA,
and it has FMA without them (so that check can fail); a kernel that raises or differs on the one-tensor trial before
CUDA picks it is passed over, with one line. With a GPU, the tests marked cuda check every installed CUDA implementation
and NF4Linear on CUDA against the CPU reference.
"""

import importlib.util
import json
import os
import platform
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from test_quant import DTYPES, ROOT, SHAPES, cuda, nf4_linear
from test_requirements import OURS
from torch import nn

import quant
from support.kernels import nf4_ops

INTERPRET = """
import json, sys, torch, quant
from support.kernels import nf4_ops
torch.manual_seed(0)
kernel = type(nf4_ops._triton_kernel()).__name__
results = []
for shape in json.loads(sys.argv[1]):
    for name in ("float32", "bfloat16", "float16"):
        dtype = getattr(torch, name)
        q = quant.quantize_nf4((torch.randn(shape) * 0.02).to(dtype))
        ref, out = quant.dequantize_nf4(*q, shape, dtype), nf4_ops.dequantize_triton(*q, shape, dtype)
        same = out.dtype == dtype and out.shape == ref.shape and torch.equal(out, ref)
        results.append(dict(shape=shape, dtype=name, equal=same, differ=int((out != ref).sum())))
tried = nf4_ops.runs_like_reference(nf4_ops.dequantize_triton, "cpu")
print(json.dumps(dict(kernel=kernel, results=results, tried=tried)))
"""


def need_triton():
    """Triton where requirements-test.txt installs it (Linux: missing there, the test install is incomplete); on a
    system without a triton release (macOS, Windows) the test skips, saying so."""
    if not OURS["triton"].marker.evaluate():
        pytest.skip(f"triton has no release for {platform.system()}; requirements-test.txt installs it on Linux only")
    if importlib.util.find_spec("triton") is None:
        pytest.fail("triton is not installed: pip install -r requirements-test.txt")


def interpret(script, shapes):
    """`script`'s last line of JSON, run with `shapes` in a subprocess under Triton's CPU interpreter
    (TRITON_INTERPRET=1, which triton reads at import)."""
    need_triton()
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(shapes)], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["kernel"] == "InterpretedFunction"  # the interpreter ran it, not a GPU
    return out


def test_triton_kernel_equals_reference_in_the_interpreter():
    """dequantize_triton, run by Triton's CPU interpreter (TRITON_INTERPRET=1, in a subprocess because triton reads it
    at import), equals dequantize_nf4 bit for bit in fp32, bf16 and fp16 for every shape of SHAPES: whole blocks, a
    partial last block, two nested blocks and an odd count, spread over several programs; runs_like_reference says
    so too."""
    out = interpret(INTERPRET, SHAPES)
    assert out["tried"]  # the one-tensor trial that lets cuda_dequantize pick it agrees
    assert len(out["results"]) == len(SHAPES) * len(DTYPES)
    for r in out["results"]:
        assert r["equal"], r
    print(f"\nTriton kernel (interpreter) vs reference: {len(out['results'])} cases, 0 differing values")


def ptx(dtype, capability, options):
    """The kernel's PTX for one output dtype and GPU, compiled ahead of time (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    out = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}[dtype]
    pointers = dict(packed="*u8", absmax="*u8", nested_absmax="*fp32", offset="*fp32", nf4="*fp32", dyn="*fp32")
    consts = dict(SIZE=nf4_ops.TRITON_BLOCK, Q=quant.BLOCK, NESTED=quant.NESTED_BLOCK, BF16=dtype == torch.bfloat16)
    signature = pointers | dict(out=out, n="i32") | dict.fromkeys(consts, "constexpr")
    source = ASTSource(nf4_ops._triton_kernel(), signature, constexprs=consts)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options).asm["ptx"]


def test_triton_kernel_compiles_for_gpus_without_fma():
    """The kernel compiles to PTX and a cubin for sm_75 (T4) to sm_120 and every output dtype; with the launch options
    (TRITON_OPTIONS) no instruction fuses a multiply and an add, which keeps it bit-identical to the reference on a GPU
    (the interpreter never fuses). Without them the compiler does emit fma.rn.f32, so the check can fail."""
    need_triton()
    for capability in (75, 80, 90, 100, 120):
        for dtype in DTYPES:
            code = ptx(dtype, capability, nf4_ops.TRITON_OPTIONS)
            assert "st.global" in code and not re.search(r"\bfma\.", code), (capability, dtype)
    assert re.search(r"\bfma\.rn\.f32", ptx(torch.float32, 90, dict(enable_fp_fusion=True)))


def test_a_kernel_that_fails_or_differs_is_not_chosen(capsys, monkeypatch):
    """runs_like_reference, the trial behind cuda_dequantize's choice: the reference passes; a kernel that raises (as
    Triton does where it cannot build its launcher, or here, handed CPU tensors outside its interpreter) or returns
    other bits fails, each with one line naming the kernel and saying that PyTorch dequantizes instead. Without
    bitsandbytes, cuda_dequantize takes the Triton kernel exactly when the trial passes."""
    assert nf4_ops.runs_like_reference(quant.dequantize_nf4, "cpu")
    assert capsys.readouterr().out == ""

    def no_compiler(*args):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.\nmore")

    def off_by_one_ulp(*args):
        out = quant.dequantize_nf4(*args)
        out.view(torch.int16)[0, 0] += 1
        return out

    failing = [no_compiler, off_by_one_ulp]
    if importlib.util.find_spec("triton") and not os.environ.get("TRITON_INTERPRET"):  # interpreted, it would run
        failing.append(nf4_ops.dequantize_triton)
    for impl in failing:
        assert not nf4_ops.runs_like_reference(impl, "cpu"), impl.__name__
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == 1 and lines[0].startswith(impl.__name__), lines
        assert lines[0].endswith("NF4 dequantizes with PyTorch"), lines
    print(f"\n{lines[0]}")

    monkeypatch.setattr(nf4_ops, "_bnb_functional", lambda: None)
    for verdict in (False, True):
        tried = []
        trial = lambda impl, device, v=verdict, t=tried: t.append(impl) or v  # noqa: E731
        monkeypatch.setattr(nf4_ops, "runs_like_reference", trial)
        chosen = nf4_ops.cuda_dequantize.__wrapped__()  # the choice itself, not the one cached for this process
        assert tried == [nf4_ops.dequantize_triton]
        assert chosen is (nf4_ops.dequantize_triton if verdict else quant.dequantize_nf4), chosen.__name__


def test_a_model_built_on_cuda_gets_the_cuda_op(monkeypatch):
    """dequantize_op_for: off CUDA the reference op; on CUDA dequantize_cuda's, its kernel chosen
    then (a failing trial speaks while the model is built, not at the first step); the CUDA op's fake implementation
    gives torch.compile the output's shape and dtype without a GPU."""
    assert nf4_ops.dequantize_op_for("cpu") is nf4_ops.REFERENCE_OP is torch.ops.nanoqlora.dequantize_nf4.default
    choices = []
    monkeypatch.setattr(nf4_ops, "cuda_dequantize", lambda: choices.append("chosen"))
    assert nf4_ops.dequantize_op_for(torch.device("cuda", 1)) is torch.ops.nanoqlora.dequantize_nf4_cuda.default
    assert choices == ["chosen"]
    q = quant.quantize_nf4(torch.randn(10, 100))
    with torch._subclasses.FakeTensorMode() as mode:
        fake = nf4_ops.dequantize_cuda(*(mode.from_tensor(t) for t in q), [10, 100], torch.bfloat16)
    assert fake.shape == (10, 100) and fake.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- torch.compile


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_dequantize_equals_cpu_reference(shape, dtype):
    """On CUDA, NF4Linear.dequantize() (through the op a model built there gets, nf4_ops.dequantize_cuda) and every
    installed implementation (the PyTorch reference, the Triton kernel, bitsandbytes' kernel) equal the CPU reference
    bit for bit."""
    q = quant.quantize_nf4((torch.randn(shape) * 0.02).to(dtype))
    ref = quant.dequantize_nf4(*q, shape, dtype)
    layer = quant.NF4Linear.from_nf4(q.to("cuda"), *shape, compute_dtype=dtype)
    layer.dequantize_op = nf4_ops.dequantize_op_for("cuda")  # as a model built on CUDA gets it
    assert torch.equal(layer.dequantize().cpu(), ref), nf4_ops.cuda_dequantize().__name__
    impls = [quant.dequantize_nf4]
    impls += [nf4_ops.dequantize_triton] if importlib.util.find_spec("triton") else []
    impls += [nf4_ops.dequantize_bnb] if importlib.util.find_spec("bitsandbytes") else []
    for impl in impls:
        out = impl(*q.to("cuda"), shape, dtype)
        assert out.dtype == dtype and out.shape == shape and torch.equal(out.cpu(), ref), impl.__name__
    chosen = nf4_ops.cuda_dequantize().__name__
    print(f"\nCUDA: chosen {chosen}; equal to the CPU reference: {[f.__name__ for f in impls]}")


@cuda
@pytest.mark.parametrize("compute_dtype", DTYPES)
def test_cuda_nf4linear_matches_f_linear(compute_dtype):
    """On CUDA, NF4Linear's forward (through the CUDA op) equals F.linear on its dequantized weight and the input and
    bias gradients agree; the weight is the CPU layer's bit for bit and the buffers get no gradient."""
    linear = nn.Linear(128, 96, bias=True)
    cpu = nf4_linear(linear, compute_dtype)
    ours = nf4_linear(linear, compute_dtype).cuda()
    ours.dequantize_op = nf4_ops.dequantize_op_for("cuda")  # as a model built on CUDA gets it
    w = ours.dequantize()
    assert torch.equal(w.cpu(), cpu.dequantize())
    x = torch.randn(2, 5, 128, dtype=compute_dtype, device="cuda", requires_grad=True)
    x_f = x.detach().clone().requires_grad_(True)
    bias_f = ours.bias.detach().clone().requires_grad_(True)
    y, y_f = ours(x), F.linear(x_f, w, bias_f)
    grad = torch.randn_like(y)
    y.backward(grad)
    y_f.backward(grad)
    assert y.dtype == compute_dtype and torch.equal(y, y_f)
    torch.testing.assert_close(x.grad, x_f.grad)
    torch.testing.assert_close(ours.bias.grad, bias_f.grad)
    assert all(not b.requires_grad and b.grad is None for b in ours.buffers())


def test_dequantize_op_contract():
    """torch.ops.nanoqlora.dequantize_nf4 passes torch.library.opcheck (schema, fake tensor, dispatch) for every dtype,
    returns dequantize_nf4's tensor on CPU, and its fake implementation gives the real output's shape and dtype."""
    q = quant.quantize_nf4(torch.randn(10, 100))
    for dtype in DTYPES:
        torch.library.opcheck(nf4_ops.dequantize, (*q, [10, 100], dtype))
        assert torch.equal(nf4_ops.dequantize(*q, [10, 100], dtype), quant.dequantize_nf4(*q, (10, 100), dtype))
    with torch._subclasses.FakeTensorMode() as mode:
        fake = nf4_ops.dequantize(*(mode.from_tensor(t) for t in q), [10, 100], torch.bfloat16)
    assert fake.shape == (10, 100) and fake.dtype == torch.bfloat16
