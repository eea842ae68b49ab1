"""How much work is a token, and how fast can this machine do it: the two halves of MFU.

MFU (model FLOPs utilisation, PaLM, https://arxiv.org/abs/2204.02311) is the model FLOPs a step needs (`batch_flops`)
over its time, divided by `peak_flops`: a known GPU's datasheet dense 16-bit peak (half for fp32 with TF32), else a
matmul rate measured in the run's dtype, the only honest peak a CPU has (timed in CPU time, see cpu_clock).
"""

import re
import time

import torch

from model import doc_bounds


def flops_per_token(c, context):
    """Model FLOPs per token of a frozen-base LoRA training step at `context` tokens per document: 2N forward plus 2N
    backward (input gradients only: the frozen base has no weight gradients) over the N matmul weights, plus causal
    attention, 2 * layers * context * H*D forward (QK^T and PV at 2 FLOPs each, halved by the mask) and twice that
    backward. Recomputation by activation checkpointing is not counted (that would be hardware FLOPs)."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    n = c.num_hidden_layers * (c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size)
    n += c.hidden_size * c.vocab_size  # lm_head
    return 4 * n + 3 * 2 * c.num_hidden_layers * context * q


def batch_flops(c, position_ids) -> float:
    """Model FLOPs of a training step over rows of packed documents, position_ids (B, T): each span model.doc_bounds
    finds (a document, or a run of padding) at its own length, as varlen attention computes it."""
    return float(sum(n * flops_per_token(c, n) for n in doc_bounds(position_ids).bounds.diff().tolist()))


# Dense bf16 (fp16 on pre-Ampere cards) tensor-core peaks in TFLOP/s, no sparsity, by the words of
# torch.cuda.get_device_name: every word of a key must appear, so "L40" is not "L40S" and "A10" is not "A10G".
# The first key that matches wins (the PCIe H100 before the SXM one); a GPU none matches gets a measured peak.
# fmt: off
PEAK_TFLOPS = {
    ("H100", "PCIE"): 756, ("H100",): 989, ("H200",): 989, ("A100",): 312, ("L40S",): 362, ("L40",): 181,
    ("L4",): 121, ("A10",): 125, ("A6000",): 155, ("V100",): 125, ("T4",): 65,
}
# fmt: on


def matmul_rates(shape, dtypes, device, seconds=0.3, clock=time.perf_counter) -> dict:
    """{dtype: FLOP/s} of an (m, k) @ (k, n) matmul on `device`, the best call of each: the dtypes take turns, each
    at least twice, until `seconds` of `clock` have passed, so that a shared machine's drift stays out of the
    comparison. A call is timed by `clock` (seconds), and so is the budget: timed in CPU time, a busy machine takes
    as many calls as an idle one."""
    m, k, n = shape
    pairs = {dt: (torch.randn(m, k, device=device).to(dt), torch.randn(k, n, device=device).to(dt)) for dt in dtypes}
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    for a, b in pairs.values():
        a @ b
    best, start, turns = dict.fromkeys(dtypes, 0.0), clock(), 0
    while turns < 2 or clock() - start < seconds:
        for dt, (a, b) in pairs.items():
            sync()
            t = clock()
            a @ b
            sync()
            best[dt] = max(best[dt], 2 * m * k * n / max(clock() - t, 1e-9))
        turns += 1
    return best


def cpu_clock() -> float:
    """Seconds of this process's CPU time per torch thread, the clock of a CPU's peak. Beside other busy processes a
    thread waits its turn for a core, which stretches wall time but not CPU time (idle torch threads sleep,
    support/run/threads.py). On an idle machine the two agree for a call that keeps every torch thread busy
    throughout, as the peak's large square matmuls do; where threads spin (OMP_WAIT_POLICY=ACTIVE) the spinning
    counts too, and the peak comes out lower."""
    return time.process_time() / torch.get_num_threads()


def matmul_peak(device, dtype, seconds=0.3) -> float:
    """FLOP/s of square n x n matmuls in `dtype` on `device`, at the largest n of 256, 512, ... 2048 (4096 on CUDA)
    that keeps a call under a tenth of `seconds`, so that a dtype the CPU emulates (a minute a call at n = 2048) is
    timed in `seconds` too. Smaller matmuls swing with what the caches hold, so the largest affordable is the peak."""
    n, top = 256, 4096 if device.type == "cuda" else 2048
    clock = time.perf_counter if device.type == "cuda" else cpu_clock  # a busy CPU measures its idle peak
    while n < top and 2 * (2 * n) ** 3 / matmul_rates((n, n, n), (dtype,), device, 0, clock)[dtype] < seconds / 10:
        n *= 2
    return matmul_rates((n, n, n), (dtype,), device, seconds, clock)[dtype]


def fmt_flops(rate) -> str:
    """A FLOP/s rate in the unit that keeps three significant digits (a CPU's bf16 emulation runs at GFLOP/s)."""
    for unit, scale in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6)):
        if rate >= scale:
            return f"{rate / scale:.3g} {unit}"
    return f"{rate:.3g} FLOP/s"


def peak_flops(device, dtype) -> tuple[float, str]:
    """(the FLOP/s that MFU divides by, where it comes from): a GPU's datasheet peak when its name is known, else a
    measured matmul peak (always on CPU), which is never zero."""
    if device.type == "cuda":
        words = set(re.findall(r"[A-Z0-9]+", torch.cuda.get_device_name(device).upper()))
        tflops = next((v for k, v in PEAK_TFLOPS.items() if words.issuperset(k)), None)
        tf32 = torch.backends.cuda.matmul.fp32_precision == "tf32"
        if tflops is not None and (dtype != torch.float32 or tf32):
            return tflops * 1e12 * (0.5 if dtype == torch.float32 else 1.0), "datasheet"  # TF32: half the 16-bit rate
    return matmul_peak(device, dtype), "measured"
