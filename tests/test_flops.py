"""support/accounting/flops.py: the model FLOPs of a batch and the peak FLOP/s MFU divides by.

A batch of packed rows costs each document (and each run of padding) flops_per_token at its own length, a row that is
one whole document costs flops_per_token at the row's length.

On simulated GPUs the peak comes from the datasheet for a known name matched word by word (L40 is not L4, A10G not
A10) and from a measured matmul for any other; for fp32 half the 16-bit peak with TF32 on, measured with it off (no
tensor core runs full fp32); on this CPU it is measured, never zero, in fp32 and in bf16 (also where bf16 is emulated:
the matmul size adapts to the time a call takes). Beside a busy process that shares its core, the CPU peak is the
idle one, though a call's wall time grows by half or more.
"""

import os
import statistics
import subprocess
import sys
import time

import pytest
import torch

from model import LlamaConfig
from support.accounting import flops
from support.accounting.flops import batch_flops, flops_per_token, fmt_flops


@pytest.mark.parametrize(
    "name, source, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "datasheet", 989),
        ("NVIDIA H100 PCIe", "datasheet", 756),
        ("NVIDIA L40", "datasheet", 181),
        ("NVIDIA L4", "datasheet", 121),
        ("Tesla T4", "datasheet", 65),
        ("NVIDIA A10G", "measured", 42),
        ("NVIDIA B200", "measured", 42),
        ("Some Future GPU", "measured", 42),
    ],
)
def test_peak_flops_of_simulated_gpus(monkeypatch, name, source, tflops):
    """A known name's datasheet 16-bit peak, a measured one for any other; in fp32, half the 16-bit peak with TF32 on
    and the measured rate with it off."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    measured = []
    monkeypatch.setattr(flops, "matmul_peak", lambda device, dtype: measured.append(device) or 42e12)
    peak, got = flops.peak_flops(torch.device("cuda"), torch.bfloat16)
    assert (got, peak) == (source, tflops * 1e12) and len(measured) == (source == "measured")
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # conftest's autouse fixture restores it
    assert flops.peak_flops(torch.device("cuda"), torch.float32)[0] == (peak / 2 if source == "datasheet" else 42e12)
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    assert flops.peak_flops(torch.device("cuda"), torch.float32) == (42e12, "measured")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_peak_is_measured(dtype):
    """In either dtype, also one this CPU emulates (a minute a 2048^3 call there): the size adapts to the time."""
    peak, source = flops.peak_flops(torch.device("cpu"), dtype)
    assert source == "measured" and peak > 0  # MFU divides by it
    assert fmt_flops(1.24e9) == "1.24 GFLOP/s" and fmt_flops(989e12) == "989 TFLOP/s"


def test_the_budget_is_counted_by_the_given_clock():
    """matmul_rates stops when its clock, not the wall, has run `seconds`: a clock that moves 0.01 s a reading ends a
    0.1 s budget after about ten readings (a wall-clock budget would take thousands of 8 x 8 matmuls), and never
    before two turns (five readings)."""
    readings = []

    def clock():
        readings.append(1)
        return 0.01 * len(readings)

    flops.matmul_rates((8, 8, 8), (torch.float32,), torch.device("cpu"), 0.1, clock)
    assert 5 <= len(readings) <= 15, len(readings)


def test_cpu_peak_beside_a_busy_process_is_the_idle_peak():
    """This thread (one torch thread) and a busy Python loop pinned to the same core, interleaved with the loop gone:
    a call's wall time at least 1.4x its idle time (the core is shared), the measured peak within 0.7x-1.43x of the
    idle peak (medians of five), since a call is timed in CPU time. Timed in wall time it was 0.64x; what
    is left is this VM's drift and the caches the loop evicts."""
    threads, affinity = torch.get_num_threads(), os.sched_getaffinity(0)
    core = min(affinity)
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {core})  # this thread only: torch's other threads are not used with one thread
    a = torch.randn(512, 512)
    walls, peaks = {"idle": [], "busy": []}, {"idle": [], "busy": []}
    try:
        for _ in range(5):
            for load in ("idle", "busy"):
                loop = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"
                hog = subprocess.Popen([sys.executable, "-c", loop]) if load == "busy" else None
                time.sleep(0.3 if hog else 0)  # the loop started and spinning
                start = time.perf_counter()
                for _ in range(8):
                    a @ a
                walls[load].append(time.perf_counter() - start)
                peaks[load].append(flops.matmul_peak(torch.device("cpu"), torch.float32, 0.2))
                if hog:
                    hog.kill()
                    hog.wait()
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
    wall, peak = ({k: statistics.median(v) for k, v in d.items()} for d in (walls, peaks))
    assert wall["busy"] > 1.4 * wall["idle"], walls
    assert 0.7 < peak["busy"] / peak["idle"] < 1 / 0.7, peaks


def test_batch_flops_counts_attention_per_document():
    """Two full rows of one 64-token document each cost 2 x 64 tokens at 64; a row of documents of 5, 3 and 7 tokens
    costs each at its own length, not at the row's 15."""
    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8)  # fmt: skip
    assert batch_flops(cfg, torch.arange(64).repeat(2, 1)) == 2 * 64 * flops_per_token(cfg, 64)
    pos = torch.cat([torch.arange(5), torch.arange(3), torch.arange(7)])[None]
    assert batch_flops(cfg, pos) == pytest.approx(sum(n * flops_per_token(cfg, n) for n in (5, 3, 7)))
    assert batch_flops(cfg, pos) < 15 * flops_per_token(cfg, 15)
