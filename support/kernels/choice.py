"""What does a model built on this machine compute with: which dtype, and which kernels?

The dtype. precision "auto" means bf16 where the hardware runs it natively, because bf16 halves the memory of weights
and activations and tensor cores (and AMX on Intel, AVX512-BF16 on AMD Zen 4/5) run it several times faster than fp32.
On a GPU the answer is a property of the card: bf16 from compute capability 8.0 (Ampere) on, fp16 with a loss scaler
before (T4, V100), where torch would emulate bf16. On a CPU it is what the CPU declares (Linux's /proc/cpuinfo flags):
bf16 with AMX or AVX512-BF16 (or an Arm CPU's bf16 feature), fp32 with neither. Getting it wrong is ruinous: a CPU with
AVX2 only emulates bf16 matmuls hundreds of times slower than fp32. Where the CPU declares nothing readable (macOS,
Windows) the two are measured once, at the model's own MLP shape, and the faster wins; a measurement on a busy machine
can mislead, which is why flags come first. An explicit bf16 is kept, with a warning where the CPU lacks it.

The kernels. One call when a model is built (train.load_model) answers it for the three places a kernel is chosen,
each by the file that knows its kernels: the packed-document attention (attention.py: flash-attn, torch's varlen
kernel, or one SDPA call per document), NF4 dequantization (nf4_ops.py: bitsandbytes', a Triton kernel, or the
reference, as an op) and LoRA dropout (dropout_cuda.py: one Triton kernel, or the reference). Both choices are made
once, for the model's life.
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


def kernels_for(device, dtype, config) -> Kernels:
    """The kernels of a model of `config` built on `device`, computing in `dtype`."""
    device = torch.device(device)
    varlen = attention.varlen_attention(device, dtype, config.head_dim, windowed=bool(config.sliding_layers))
    return Kernels(varlen, nf4_ops.dequantize_op_for(device), dropout_cuda.dropout_op_for(device))


PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BF16_FLAGS = {"amx_bf16", "avx512_bf16", "bf16"}  # x86's AMX and AVX512-BF16; Arm's bf16 feature (ARMv8.6)


def pick_precision(precision, device, config, main=True) -> torch.dtype:
    """The compute dtype for `precision` ("auto", "bf16", "fp16" or "fp32") on `device`, for a model of `config`'s
    shapes. Where a CPU must be measured, only `main` (rank 0) measures, and prints what it measured: another rank's
    measurement would compete with it for the same cores, and agreed() gives every rank rank 0's choice."""
    p = precision
    if device.type == "cuda" and p == "auto":
        p = "bf16" if torch.cuda.get_device_capability(device)[0] >= 8 else "fp16"
    elif p == "fp16" and device.type == "cpu":
        raise ValueError("precision: fp16 is not supported on CPU (its matmuls run single-threaded); use bf16 or fp32")
    elif device.type == "cpu" and p in ("auto", "bf16"):
        native = cpu_has_bf16()
        if native is None and main:  # nothing declared: measured
            native, why = measured_bf16(config, device)
        elif native is None:
            native, why = False, ""  # rank 0's measurement decides (agreed)
        else:
            why = "it declares " + ("AMX or AVX512-BF16" if native else "neither AMX nor AVX512-BF16")
        if p == "auto" and main:
            print(f"precision auto: {'bf16' if native else 'fp32'} on this CPU: {why}")
        elif p == "bf16" and not native and main:
            print(f"warning: precision bf16 on a CPU that emulates it, many times slower than fp32: {why}")
        p = "bf16" if native or p == "bf16" else "fp32"
    return PRECISIONS[p]


def cpu_has_bf16(cpuinfo="/proc/cpuinfo") -> bool | None:
    """Whether this CPU declares native bf16 matmuls (Linux's /proc/cpuinfo flags), or None where it declares nothing
    readable."""
    try:
        with open(cpuinfo) as f:
            line = next((line for line in f if line.split(":")[0].strip() in ("flags", "Features")), None)
    except OSError:
        return None
    return None if line is None else bool(BF16_FLAGS & set(line.split(":", 1)[1].split()))


def measured_bf16(config, device) -> tuple[bool, str]:
    """(whether bf16 matmuls are faster than fp32 here, the rates that say so), at the model's MLP shape for a
    micro-batch's worth of rows (fp32 on a tie: it rounds less)."""
    shape = (128, min(config.hidden_size, 2048), min(config.intermediate_size, 4096))
    rates = matmul_rates(shape, (torch.bfloat16, torch.float32), device)
    why = f"measured {fmt_flops(rates[torch.bfloat16])} in bf16, {fmt_flops(rates[torch.float32])} in fp32"
    return rates[torch.bfloat16] > rates[torch.float32], why + f" ({' x '.join(map(str, shape))} matmuls)"


def name(dtype) -> str:
    """The short name of a dtype: bf16, fp16 or fp32."""
    return next(k for k, v in PRECISIONS.items() if v == dtype)


def agreed(dtype, world, device) -> torch.dtype:
    """Rank 0's dtype on every rank (where a CPU is measured, only rank 0 measured, see pick_precision)."""
    if world == 1:
        return dtype
    choice = torch.tensor(list(PRECISIONS.values()).index(dtype), device=device)
    dist.broadcast(choice, src=0)
    return list(PRECISIONS.values())[int(choice)]
