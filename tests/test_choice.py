"""support/kernels/choice.py: precision "auto" follows the hardware.

On simulated GPUs it is fp16 before compute capability 8.0 and bf16 from it, without measuring; on CPU it follows the
flags the CPU declares (read from cpuinfo files of the three kinds), measuring only where none are readable, and says
why in one line; an explicit bf16 stays bf16 with a warning where the CPU lacks it. Generation's transposed product of
few rows is chosen by the CPU's vendor. compile="auto" compiles the shipped GPU config's run and no CPU or short run; a
set value always wins.
"""

import pytest
import torch

import train
from model import LlamaConfig
from support.accounting.flops import fmt_flops
from support.kernels import choice
from support.run.config import check_config, load_config


@pytest.mark.parametrize(
    "capability, want", [((7, 5), torch.float16), ((7, 0), torch.float16), ((8, 0), torch.bfloat16)]
)
def test_auto_precision_on_simulated_gpus(monkeypatch, capability, want):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(choice, "matmul_rates", lambda *a: pytest.fail("a GPU's precision is not measured"))
    assert choice.pick_precision("auto", torch.device("cuda"), LlamaConfig(64, 64, 128, 1, 4, 2, 16)) == want


@pytest.mark.parametrize("declared, want", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_precision_on_cpu_follows_what_it_declares(monkeypatch, capsys, declared, want):
    """A CPU that declares native bf16 gets bf16, one that declares neither AMX nor AVX512-BF16 fp32, each said in one
    line, nothing measured (a busy machine's measurement could mislead); an explicit bf16 stays bf16, warned about
    where the CPU lacks it; every rank decides alike."""
    config = LlamaConfig(64, 576, 1536, 1, 4, 2, 16)
    monkeypatch.setattr(choice, "cpu_has_bf16", lambda: declared)
    monkeypatch.setattr(choice, "matmul_rates", lambda *a: pytest.fail("a CPU that declares is not measured"))
    assert choice.pick_precision("auto", torch.device("cpu"), config) == want
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"precision auto: {choice.name(want)} on this CPU: it declares ") and "\n" not in line
    assert choice.pick_precision("bf16", torch.device("cpu"), config) == torch.bfloat16
    assert ("warning: precision bf16 on a CPU that emulates it" in capsys.readouterr().out) == (not declared)
    assert choice.pick_precision("auto", torch.device("cpu"), config, main=False) == want
    assert choice.pick_precision("fp32", torch.device("cpu"), config) == torch.float32


@pytest.mark.parametrize("bf16_rate, want", [(2e9, torch.float32), (1e11, torch.float32), (3e11, torch.bfloat16)])
def test_a_cpu_that_declares_nothing_is_measured(monkeypatch, capsys, bf16_rate, want):
    """Where the CPU declares nothing readable (macOS, Windows), given the two rates (a stand-in for the measurement)
    auto takes the faster (fp32 on a tie: it rounds less) and says why in one line, at the model's own MLP shape; only
    rank 0 measures (another takes rank 0's choice through broadcast_dtype)."""
    config, asked = LlamaConfig(64, 576, 1536, 1, 4, 2, 16), []

    def rates(shape, dtypes, device):
        asked.append(shape)
        return {torch.bfloat16: bf16_rate, torch.float32: 1e11}

    monkeypatch.setattr(choice, "cpu_has_bf16", lambda: None)
    monkeypatch.setattr(choice, "matmul_rates", rates)
    assert choice.pick_precision("auto", torch.device("cpu"), config) == want
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"precision auto: {choice.name(want)} on this CPU: measured")
    assert f"{fmt_flops(bf16_rate)} in bf16, 100 GFLOP/s in fp32 (128 x 576 x 1536 matmuls)" in line
    assert asked == [(128, 576, 1536)]  # the model's own MLP shape, for a micro-batch's worth of rows
    assert choice.pick_precision("auto", torch.device("cpu"), config, main=False) == torch.float32
    assert len(asked) == 1 and capsys.readouterr().out == ""


@pytest.mark.parametrize(
    "text, want",
    [
        ("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n", True),  # AMD Zen 4/5
        ("flags\t\t: fpu avx2 amx_bf16 amx_tile\n", True),  # Intel with AMX
        ("flags\t\t: fpu sse avx2 fma\n", False),  # AVX2 only
        ("Features\t: fp asimd bf16 i8mm\n", True),  # Arm with bf16 (ARMv8.6)
        ("processor\t: 0\n", None),  # no flags line
    ],
)
def test_cpu_flags_are_read_from_cpuinfo(tmp_path, text, want):
    """cpu_has_bf16 reads the flags (or Arm's Features) line of a cpuinfo file; no such line, or no file, says
    nothing (None)."""
    (tmp_path / "cpuinfo").write_text(text)
    assert choice.cpu_has_bf16(str(tmp_path / "cpuinfo")) is want
    assert choice.cpu_has_bf16(str(tmp_path / "missing")) is None


@pytest.mark.parametrize(
    "text, want",
    [
        ("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2\n", True),
        ("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 amx_bf16\n", False),
        ("processor\t: 0\nFeatures\t: fp asimd bf16\n", False),  # Arm: no vendor_id line
    ],
)
def test_the_transposed_decode_product_is_chosen_by_the_cpus_vendor(tmp_path, text, want):
    """few_rows_transposed reads the vendor_id line of a cpuinfo file: AMD's CPUs take DecodeLinear's transposed
    product, Intel's and those that name no vendor the plain one, as does a machine with no cpuinfo file."""
    (tmp_path / "cpuinfo").write_text(text)
    assert choice.few_rows_transposed(str(tmp_path / "cpuinfo")) is want
    assert choice.few_rows_transposed(str(tmp_path / "missing")) is False


def test_compile_auto_compiles_long_cuda_runs_only():
    """configs/magicoder.py as it ships (compile unset: "auto") compiles on CUDA, not on CPU, not when its run is
    cut to a few steps and not sharded (FSDP); --compile=True or False, or a bare --compile, decides on any device."""
    magicoder = ["configs/magicoder.py"]

    def compiles(argv, device):
        cfg = load_config(train.Config, magicoder + argv)
        check_config(cfg)
        return choice.compile_pays(cfg.compile, device, cfg.max_steps * cfg.batch_tokens)

    assert load_config(train.Config, magicoder).compile == "auto"
    assert compiles([], "cuda") and not compiles([], "cpu")
    assert not compiles(["--max_steps=10"], "cuda")
    assert not choice.compile_pays("auto", "cuda", 10**12, sharded=True) and choice.compile_pays(True, "cuda", 0, True)
    assert compiles(["--compile=True"], "cpu") and compiles(["--compile"], "cpu")
    assert not compiles(["--compile=False"], "cuda")
    assert not choice.compile_pays("auto", "cpu", 10**12)
    with pytest.raises(ValueError, match=r'compile: .yes. is out of range \(expected "auto", True or False\)'):
        compiles(["--compile=yes"], "cpu")
