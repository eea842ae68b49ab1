"""What does a model built on this machine compute with: which dtype, and which kernels?

precision "auto" is bf16 where the hardware runs it natively: a GPU from compute capability 8.0 (before, fp16), a CPU
that declares AMX, AVX512-BF16 or Arm's bf16 (where it declares nothing, the two are measured once); else fp32, since an
emulating CPU runs bf16 matmuls hundreds of times slower. `kernels_for` makes a model's kernel choices once, and
`compile_pays` decides whether a run's blocks are compiled at all.
"""

from typing import NamedTuple

import torch
import torch.distributed as dist

from support.accounting.flops import fmt_flops, matmul_rates
from support.kernels import attention, dropout_cuda, nf4_ops


class Kernels(NamedTuple):
    attention: object  # varlen(q, k, v, docs, window): the model's packed-document attention
    dequantize: object  # the op every NF4 linear dequantizes with
    dropout: object  # the op every LoRA dropout applies its keyed mask with


def kernels_for(device, dtype, config, compiled=False) -> Kernels:
    """The kernels of a model of `config` built on `device`, computing in `dtype`, its blocks `compiled` or not."""
    device = torch.device(device)
    varlen = attention.varlen_attention(device, dtype, config.head_dim, windowed=bool(config.sliding_layers))
    dropout = dropout_cuda.dropout_op_for(device, compiled)
    return Kernels(varlen, nf4_ops.dequantize_op_for(device), dropout)


COMPILE_PAYS_TOKENS = 4_000_000  # compile="auto" compiles a CUDA run that trains at least this many tokens


def compile_pays(setting, device, tokens, sharded=False) -> bool:
    """Whether a run on `device` that trains `tokens` tokens compiles its blocks: compile=True or False as set; "auto"
    on CUDA from COMPILE_PAYS_TOKENS, unless the model is `sharded` (FSDP: its compiled blocks are proven over gloo on
    CPU only, docs/correctness.md). On an H200, compiling an 8B Llama's block took 41-60 s at the first step and made
    each later step 1.17-1.19x faster (docs/performance.md): at about 10,000 tokens/s that is repaid after some 4M
    tokens (configs/magicoder.py trains 34M). Never on CPU by itself: Inductor's code differs between CPU kinds
    (AVX2, AVX-512, AMX) and a CPU run is short."""
    if setting != "auto":
        return setting
    return torch.device(device).type == "cuda" and tokens >= COMPILE_PAYS_TOKENS and not sharded


PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BF16_FLAGS = {"amx_bf16", "avx512_bf16", "bf16"}  # x86's AMX and AVX512-BF16; Arm's bf16 feature (ARMv8.6)


def pick_precision(precision, device, config, main=True) -> torch.dtype:
    """The compute dtype for `precision` ("auto", "bf16", "fp16" or "fp32") on `device`, for a model of `config`'s
    shapes. Only `main` (rank 0) measures a CPU (others would compete for its cores); broadcast_dtype() shares its
    choice."""
    if device.type == "cuda" and precision == "auto":
        return PRECISIONS["bf16" if torch.cuda.get_device_capability(device)[0] >= 8 else "fp16"]
    elif precision == "fp16" and device.type == "cpu":
        raise ValueError("precision: fp16 is not supported on CPU (its matmuls run single-threaded); use bf16 or fp32")
    elif device.type == "cpu" and precision in ("auto", "bf16"):
        native = cpu_has_bf16()
        if native is None and main:  # nothing declared: measured
            native, why = measured_bf16(config, device)
        elif native is None:
            native, why = False, ""  # rank 0's measurement decides (broadcast_dtype)
        else:
            why = "it declares " + ("AMX or AVX512-BF16" if native else "neither AMX nor AVX512-BF16")
        if precision == "auto" and main:
            print(f"precision auto: {'bf16' if native else 'fp32'} on this CPU: {why}")
        elif precision == "bf16" and not native and main:
            print(f"warning: precision bf16 on a CPU that emulates it, many times slower than fp32: {why}")
        return PRECISIONS["bf16" if native or precision == "bf16" else "fp32"]
    return PRECISIONS[precision]


def cpu_has_bf16(cpuinfo="/proc/cpuinfo") -> bool | None:
    """Whether this CPU declares native bf16 matmuls (Linux's /proc/cpuinfo flags); None where nothing is readable."""
    flags = cpuinfo_value(("flags", "Features"), cpuinfo)
    return None if flags is None else bool(BF16_FLAGS & set(flags.split()))


def few_rows_transposed(cpuinfo="/proc/cpuinfo") -> bool:
    """Whether generation's fp32 products of a few rows run as (W x^T)^T (sampling.DecodeLinear) rather than x W^T:
    on AMD's CPUs, where MKL's GEMM runs the transposed product faster, not on Intel's, where it runs the plain one
    faster (docs/performance.md); elsewhere, or where the vendor is unreadable, the plain product."""
    return cpuinfo_value(("vendor_id",), cpuinfo) == "AuthenticAMD"


def cpuinfo_value(keys, cpuinfo="/proc/cpuinfo") -> str | None:
    """The value of the first line of a Linux cpuinfo file whose key is one of `keys`; None where there is none."""
    try:
        with open(cpuinfo) as f:
            line = next((line for line in f if line.split(":")[0].strip() in keys), None)
    except OSError:
        return None
    return None if line is None else line.split(":", 1)[1].strip()


def measured_bf16(config, device) -> tuple[bool, str]:
    """(whether bf16 matmuls are faster than fp32 here at the model's MLP shape (fp32 on a tie), the rates)."""
    shape = (128, min(config.hidden_size, 2048), min(config.intermediate_size, 4096))
    rates = matmul_rates(shape, (torch.bfloat16, torch.float32), device)
    why = f"measured {fmt_flops(rates[torch.bfloat16])} in bf16, {fmt_flops(rates[torch.float32])} in fp32"
    return rates[torch.bfloat16] > rates[torch.float32], why + f" ({' x '.join(map(str, shape))} matmuls)"


def name(dtype) -> str:
    return next(k for k, v in PRECISIONS.items() if v == dtype)


def broadcast_dtype(dtype, world, device) -> torch.dtype:
    """Rank 0's dtype on every rank (where a CPU is measured, only rank 0 measured, see pick_precision)."""
    if world == 1:
        return dtype
    choice = torch.tensor(list(PRECISIONS.values()).index(dtype), device=device)
    dist.broadcast(choice, src=0)
    return list(PRECISIONS.values())[int(choice)]
