"""support/run/precision.py: precision "auto" follows the hardware.

On simulated GPUs it is fp16 before compute capability 8.0 and bf16 from it, without measuring; on CPU, given the two
measured rates (a stand-in), it takes the faster and says why in one line, an explicit bf16 stays bf16 with a warning
where it is the slower, and only rank 0 measures.
"""

import pytest
import torch

from model import LlamaConfig
from support.accounting.flops import fmt_flops
from support.run import precision


@pytest.mark.parametrize(
    "capability, want", [((7, 5), torch.float16), ((7, 0), torch.float16), ((8, 0), torch.bfloat16)]
)
def test_auto_precision_on_simulated_gpus(monkeypatch, capability, want):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(precision, "matmul_rates", lambda *a: pytest.fail("a GPU's precision is not measured"))
    assert precision.pick_precision("auto", torch.device("cuda"), LlamaConfig(64, 64, 128, 1, 4, 2, 16)) == want


@pytest.mark.parametrize("bf16_rate, want", [(2e9, torch.float32), (1e11, torch.float32), (3e11, torch.bfloat16)])
def test_auto_precision_on_cpu_follows_the_measurement(monkeypatch, capsys, bf16_rate, want):
    """Given the two rates (a stand-in for the measurement), auto takes the faster (fp32 on a tie: it rounds less)
    and says why in one line; an explicit bf16 stays bf16, warned about where it is the slower; fp32 and fp16 measure
    nothing."""
    config, asked = LlamaConfig(64, 576, 1536, 1, 4, 2, 16), []

    def rates(shape, dtypes, device):
        asked.append(shape)
        return {torch.bfloat16: bf16_rate, torch.float32: 1e11}

    monkeypatch.setattr(precision, "matmul_rates", rates)
    assert precision.pick_precision("auto", torch.device("cpu"), config) == want
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"precision auto: {'bf16' if want == torch.bfloat16 else 'fp32'} on this CPU")
    assert f"{fmt_flops(bf16_rate)} in bf16, 100 GFLOP/s in fp32 (128 x 576 x 1536 matmuls)" in line
    assert asked == [(128, 576, 1536)]  # the model's own MLP shape, for a micro-batch's worth of rows
    assert precision.pick_precision("bf16", torch.device("cpu"), config) == torch.bfloat16
    assert ("warning: precision bf16 runs slower than fp32" in capsys.readouterr().out) == (want == torch.float32)
    assert precision.pick_precision("fp32", torch.device("cpu"), config) == torch.float32
    assert len(asked) == 2
    # another rank than 0 measures nothing and prints nothing: it takes rank 0's choice (agreed) in place of fp32
    assert precision.pick_precision("auto", torch.device("cpu"), config, main=False) == torch.float32
    assert precision.pick_precision("bf16", torch.device("cpu"), config, main=False) == torch.bfloat16
    assert len(asked) == 2 and capsys.readouterr().out == ""
