"""support/kernels/attention.py: the packed-document attention kernels and their choice.

Every backend that runs on CPU equals an fp64 per-document reference (forward and gradients, GQA, windows), the
per-document SDPA loop and its opaque twin (the compile path) alike; flash-attn and torch's varlen kernel are checked
by contract against stand-ins that enforce their own input checks and signatures; the backend choice is right for
simulated GPUs (pre-Ampere, fp32, big heads) and broken flash-attn installs; per-document attention and the loss
chunks reach their kernels only at a few bucket lengths; micro-batches of whole rows take batched SDPA, packed ones
the varlen kernel. On a GPU, every kernel it runs equals the reference in bf16, whole rows included.
"""

import inspect
import math
import sys

import pytest
import torch
from test_model import cuda, packed_batch, rel, tiny_config
from torch.nn.attention import SDPBackend

import model as M
import support.kernels.attention as A
from model import Llama


def naive_varlen(q, k, v, cu_seqlens, window=None):
    """The reference: per document, scores (H, len, len) in fp64, causal (and windowed) mask, softmax, times v."""
    out, b = torch.empty_like(q, dtype=torch.float64), cu_seqlens.tolist()
    rep = q.shape[1] // k.shape[1]
    for s, e in zip(b[:-1], b[1:], strict=True):
        qd, kd, vd = (t[s:e].double().repeat_interleave(r, 1).transpose(0, 1) for t, r in ((q, 1), (k, rep), (v, rep)))
        i, j = torch.arange(e - s, device=q.device)[:, None], torch.arange(e - s, device=q.device)
        allowed = (j <= i) & (i - j < (window or e - s + 1))
        scores = (qd @ kd.transpose(1, 2) / math.sqrt(q.shape[-1])).masked_fill(~allowed, float("-inf"))
        out[s:e] = (scores.softmax(-1) @ vd).transpose(0, 1)
    return out


def test_kernels_meet_only_bucket_lengths():
    """Per-document attention (windowed too) and the loss chunks reach PyTorch's kernels only at bucket lengths,
    forward and backward, for documents and chunks on either side of SHAPE_BUCKET (PyTorch's bf16 CPU kernels keep
    state per shape); with documents longer than the bucket, attention still equals the reference."""
    assert [A.bucket(n) for n in (1, 3, 4, 5, 63, 64, 65, 130)] == [1, 4, 4, 8, 64, 64, 128, 192]
    lengths = [63, 64, 65, 130, 3, 59]  # two rows of 192 tokens
    pos = torch.cat([torch.arange(n) for n in lengths]).view(2, 192)
    ids = torch.randint(0, 97, (2, 192))
    labels = ids.clone()
    labels[:, ::4] = -100  # 288 supervised: chunks of 100, 100 and 88 rows, each padded to 128
    model = Llama(tiny_config(num_hidden_layers=1), options=M.Options(loss_chunk=100))
    (q, k, v), docs = (torch.randn(384, h, 8) for h in (4, 2, 2)), M.doc_bounds(pos)
    with torch.profiler.profile(record_shapes=True) as prof:
        model(ids, pos, labels=labels)[0].backward()
        A.sdpa_varlen(q.requires_grad_(), k, v, docs, 100).sum().backward()
    spans = [e.input_shapes[0][2] for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")]
    mms = [e.input_shapes[:2] for e in prof.events() if e.name == "aten::mm"]
    rows = [a[1] if a[0] == 97 else a[0] for a, b in mms if 97 in a + b]  # the token dimension beside the vocab
    assert len(spans) == 24 and len(rows) == 9  # 6 documents, twice, forward and backward; 3 chunks x 3 matmuls
    assert sorted(set(spans)) == [4, 64, 128, 192] and set(rows) == {128}, (spans, rows)
    for window in (None, 100):
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = naive_varlen(*leaves, docs.cu_seqlens, window)
        grad = torch.randn_like(q)
        want = torch.autograd.grad(ref, leaves, grad.double())
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = A.sdpa_varlen(*leaves, docs, window)
        assert (out - ref).abs().max() < 1e-5
        for g, w in zip(torch.autograd.grad(out, leaves, grad), want, strict=True):
            assert (g - w).abs().max() < 1e-5


class FakeFlashAttn:
    """A stand-in for the flash_attn package whose varlen function enforces flash-attn 2's own checks and computes
    the naive reference; `capability` plays the GPU's compute capability."""

    def __init__(self, capability=(8, 0)):
        self.capability, self.calls = capability, []

    def flash_attn_varlen_func(self, q, k, v, cu_q, cu_k, max_q, max_k, causal=False, window_size=(-1, -1)):
        if self.capability < (8, 0):
            raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")
        if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
            raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
        if cu_q.dtype != torch.int32 or cu_k.dtype != torch.int32:
            raise RuntimeError("cu_seqlens_q must have dtype int32")
        if any(t.stride(-1) != 1 for t in (q, k, v)) or q.shape[-1] > 256 or q.shape[1] % k.shape[1]:
            raise RuntimeError("Input tensor must have contiguous last dimension / head_dim <= 256 / GQA groups")
        assert torch.equal(cu_q, cu_k) and max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max()) and causal
        self.calls.append(window_size)
        window = None if window_size[0] < 0 else window_size[0] + 1
        return naive_varlen(q, k, v, cu_q, window).to(q.dtype)


def packed_qkv(dtype=torch.float32, hkv=2, d=8):
    """q (30, 4, D), k/v (30, Hkv, D) over the documents of packed_batch (the longest, 11 tokens, is in row 1)."""
    docs = M.doc_bounds(packed_batch()[1])
    return (torch.randn(30, h, d).to(dtype) for h in (4, hkv, hkv)), docs


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_cpu_backends_equal_the_reference(hkv, window):
    """sdpa_varlen and its opaque twin (the compile path) equal the per-document reference in fp32, forward and
    gradients, for MHA and GQA, with and without a window shorter than the longest document."""
    (q, k, v), docs = packed_qkv(hkv=hkv)
    assert docs.cu_seqlens.tolist() == [0, 5, 8, 15, 19, 30] and docs.max_seqlen == 11
    grad = torch.randn_like(q)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = naive_varlen(*leaves, docs.cu_seqlens, window)
    want = torch.autograd.grad(ref, leaves, grad.double())
    for fn in (A.sdpa_varlen, A.sdpa_varlen_opaque):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, docs, window)
        assert (out - ref).abs().max() < 1e-5
        for g, w in zip(torch.autograd.grad(out, leaves, grad), want, strict=True):
            assert (g - w).abs().max() < 1e-5


@pytest.mark.parametrize("backend", [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION])
def test_whole_rows_take_batched_sdpa(backend):
    """whole_rows_first sends documents of one length that fill the micro-batch (3 rows of 8 tokens) to batched
    causal SDPA through CPU's `backend`, equal to the fp64 reference forward and backward (GQA 2:1), traced by
    torch.compile without a graph break; packed documents of several lengths, and whole rows that a window shorter
    than a row cuts, go to the packed kernel unchanged; compiled blocks get the packed kernel alone (a branch on the
    document count would guard their graph)."""
    seen = []

    def packed(q, k, v, docs, window=None):
        seen.append(window)
        return A.sdpa_varlen(q, k, v, docs, window)

    attend = A.whole_rows_first(packed, [backend])
    rows = M.doc_bounds(torch.arange(8).repeat(3, 1))
    q, k, v = (torch.randn(24, h, 8) for h in (4, 2, 2))
    grad = torch.randn_like(q)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = naive_varlen(*leaves, rows.cu_seqlens)
    want = torch.autograd.grad(ref, leaves, grad.double())
    traced = torch.compile(attend, backend="eager", fullgraph=True)
    for fn, window in [(attend, None), (attend, 8), (traced, None)]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, rows, window)
        assert out.shape == q.shape and (out - ref).abs().max() < 1e-5
        for g, w in zip(torch.autograd.grad(out, leaves, grad), want, strict=True):
            assert (g - w).abs().max() < 1e-5
    assert seen == []
    (q, k, v), docs = packed_qkv()
    assert (attend(q, k, v, docs) - naive_varlen(q, k, v, docs.cu_seqlens)).abs().max() < 1e-5
    attend(*(t[:24] for t in (q, k, v)), rows, 4)
    assert seen == [None, 4] and A.compilable(attend) is packed


def test_flash_attn_contract_and_selection(monkeypatch, tmp_path):
    """flash_varlen passes flash-attn's own checks (16-bit, int32 cu_seqlens, contiguous last dim, head_dim <= 256)
    and equals the reference, window included; varlen_attention picks it only where those checks would pass (CUDA,
    compute capability 8.0+, fp16/bf16), and a broken install (a wheel for another torch, flash-attn 4's namespace
    package) falls back to another kernel with one line instead of failing at the first forward."""
    fake = FakeFlashAttn()
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    (q, k, v), docs = packed_qkv(torch.bfloat16)
    for window in (None, 3):
        out = A.flash_varlen(q, k, v, docs, window)
        assert (out.float() - naive_varlen(q, k, v, docs.cu_seqlens, window)).abs().max() < 1e-2
    assert fake.calls == [(-1, 0), (2, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: fake.capability)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    pick = lambda dtype=torch.bfloat16, d=128: A.varlen_attention("cuda", dtype, d)  # noqa: E731
    assert pick().packed is A.flash_varlen and pick(torch.float16).packed is A.flash_varlen
    assert A.varlen_attention("cpu", torch.bfloat16) is A.sdpa_varlen and pick(torch.float32) is A.sdpa_varlen
    assert pick(d=512) is A.sdpa_varlen
    fake.capability = (7, 5)  # a T4: no FlashAttention kernels at all
    assert pick() is A.sdpa_varlen
    fake.capability = (9, 0)
    for name, init in [
        ("broken", "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDevice')")
    ]:
        pkg = tmp_path / name / "flash_attn"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(init)
    (tmp_path / "fa4" / "flash_attn" / "cute").mkdir(parents=True)  # flash-attn 4: a namespace package only
    for root in ("broken", "fa4"):
        monkeypatch.delitem(sys.modules, "flash_attn")
        monkeypatch.syspath_prepend(str(tmp_path / root))
        assert pick().packed is A.torch_varlen  # torch's own kernel takes over
        monkeypatch.setitem(sys.modules, "flash_attn", fake)
        monkeypatch.syspath_prepend(str(tmp_path))  # pushes the fake package's folder back down the path


@pytest.mark.parametrize("release", ["first", "2.11", "newer"])
def test_torch_varlen_contract(monkeypatch, release):
    """torch_varlen against stand-ins of torch.nn.attention.varlen.varlen_attn in the three signatures seen in
    releases: the first takes is_causal (default False) and no window_size (a window is refused loudly, and
    varlen_attention does not pick it for a sliding model), then window_size=(left, 0), then enable_gqa, which must
    be True for unequal head counts. In all three the k/v reach the kernel with their own 2 heads, never copied up
    to the query heads (the kernel does GQA itself; memory.py counts them so)."""

    def check(q, k, v, cu_q, cu_k, max_q, max_k, window_size, enable_gqa):
        assert k.shape[1] == v.shape[1] == 2 < q.shape[1], "k/v copied up to the query heads"
        assert enable_gqa or release != "newer", "unequal head counts without enable_gqa"
        assert window_size[1] == 0 and cu_q.dtype == torch.int32 and max_q == max_k == 11
        return naive_varlen(q, k, v, cu_q, None if window_size[0] < 0 else window_size[0] + 1).to(q.dtype)

    def first(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):
        assert is_causal, "is_causal left at its default: attention over the whole document"
        return check(q, k, v, cu_q, cu_k, max_q, max_k, (-1, 0), False)

    def older(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
        return check(q, k, v, cu_q, cu_k, max_q, max_k, window_size, False)

    def newer(
        q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False
    ):
        return check(q, k, v, cu_q, cu_k, max_q, max_k, window_size, enable_gqa)

    stand_in = {"first": first, "2.11": older, "newer": newer}[release]
    monkeypatch.setattr(A, "varlen_attn", stand_in)  # attention.py reads the function and its signature at import
    monkeypatch.setattr(A, "VARLEN_PARAMS", frozenset(inspect.signature(stand_in).parameters))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # flash-attn absent: torch's kernel is the fused choice
    (q, k, v), docs = packed_qkv(hkv=2)
    for window in (None, 4) if release != "first" else (None,):
        out = A.torch_varlen(q, k, v, docs, window)
        assert (out - naive_varlen(q, k, v, docs.cu_seqlens, window)).abs().max() < 1e-5
    assert A.varlen_attention("cuda", torch.bfloat16, 8).packed is A.torch_varlen
    windowed = A.varlen_attention("cuda", torch.bfloat16, 8, windowed=True)
    assert getattr(windowed, "packed", windowed) is (A.sdpa_varlen if release == "first" else A.torch_varlen)
    if release == "first":
        with pytest.raises(TypeError, match="window_size"):
            A.torch_varlen(q, k, v, docs, 4)


def gpu_backends(d, windowed):
    """The packed-attention backends varlen_attention considers on this GPU for head size d: the per-document SDPA
    loop always; torch's varlen kernel (from compute capability 8.0, head size a multiple of 8, taking a window when
    one is asked for) and flash-attn where they are there."""
    found = [A.sdpa_varlen]
    if torch.cuda.get_device_capability()[0] >= 8 and d % 8 == 0 and torch.backends.cuda.is_flash_attention_available():
        if A.varlen_attn is not None and (not windowed or "window_size" in A.VARLEN_PARAMS):
            found.append(A.torch_varlen)
        if A._flash_attn_imports():
            found.append(A.flash_varlen)
    return found


@cuda
@pytest.mark.parametrize("window", [None, 96])
@pytest.mark.parametrize("hkv, d", [(8, 128), (2, 64)])
def test_cuda_backends_equal_the_reference(hkv, d, window):
    """On the GPU, in bf16, every packed-attention backend it runs equals the fp64 per-document reference on the same
    bf16 inputs, forward and gradients (within bf16 rounding: 2e-2 relative), on documents of 1 to 700 tokens, MHA and
    GQA 4:1, with and without a window shorter than the longest document; varlen_attention picks a fused kernel
    whenever one runs."""
    lens = [1, 700, 37, 256, 130]
    pos = torch.cat([torch.arange(n) for n in lens])[None].cuda()
    docs = M.doc_bounds(pos)
    q, k, v = (torch.randn(pos.numel(), h, d, device="cuda").bfloat16() for h in (8, hkv, hkv))
    grad = torch.randn_like(q)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = naive_varlen(*leaves, docs.cu_seqlens, window)
    want = torch.autograd.grad(ref, leaves, grad.double())
    backends = gpu_backends(d, window is not None)
    chosen = A.varlen_attention("cuda", torch.bfloat16, d, windowed=window is not None)
    packed = getattr(chosen, "packed", chosen)
    assert packed in backends and (packed is not A.sdpa_varlen or len(backends) == 1), packed.__name__
    errors = {}
    for fn in backends:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, docs, window)
        assert out.dtype == torch.bfloat16 and out.shape == q.shape
        got = torch.autograd.grad(out, leaves, grad)
        errors[fn.__name__] = [rel(out, ref)] + [rel(g, w) for g, w in zip(got, want, strict=True)]
    print(f"\nchosen {packed.__name__}; relative errors (out, dq, dk, dv): {errors}")
    assert all(e < 2e-2 for errs in errors.values() for e in errs), errors


@cuda
@pytest.mark.parametrize("rows, row", [(1, 2048), (3, 512)])
def test_cuda_whole_rows_equal_the_reference(rows, row):
    """On the GPU, in bf16, varlen_attention picks a fused kernel with the whole-row path, and that path (batched SDPA,
    cuDNN first) equals the fp64 reference on micro-batches of whole rows (one row of 2,048 tokens, three of 512),
    forward and gradients, GQA 4:1, without reaching the packed kernel."""
    docs = M.doc_bounds(torch.arange(row).repeat(rows, 1).cuda())
    q, k, v = (torch.randn(rows * row, h, 128, device="cuda").bfloat16() for h in (8, 2, 2))
    grad = torch.randn_like(q)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = naive_varlen(*leaves, docs.cu_seqlens)
    want = torch.autograd.grad(ref, leaves, grad.double())
    assert hasattr(A.varlen_attention("cuda", torch.bfloat16, 128), "packed"), "no fused kernel: no whole-row path"

    def packed(*args):
        raise AssertionError("whole rows went to the packed kernel")

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = A.whole_rows_first(packed)(*leaves, docs)
    got = torch.autograd.grad(out, leaves, grad)
    errors = [rel(out, ref)] + [rel(g, w) for g, w in zip(got, want, strict=True)]
    assert all(e < 2e-2 for e in errors), errors
