"""In which dtype does this run compute?

precision "auto" means bf16 where the hardware runs it natively, because bf16 halves the memory of weights and
activations and tensor cores (and AMX on Intel, AVX512-BF16 on AMD Zen 4/5) run it several times faster than fp32.
On a GPU the answer is a property of the card: bf16 from compute capability 8.0 (Ampere) on, fp16 with a loss scaler
before (T4, V100), where torch would emulate bf16. On a CPU the answer cannot be read off reliably, and getting it
wrong is ruinous: a CPU with AVX2 only emulates bf16 matmuls hundreds of times slower than fp32 (a 2048^3 matmul took
79-120 s against 0.24 s). So it is measured, once per run, at the model's own MLP shape for a micro-batch's worth of
rows, and the faster dtype wins; an explicit bf16 is kept, with a warning where it is the slower one.
"""

import torch
import torch.distributed as dist

from support.accounting.flops import fmt_flops, matmul_rates

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def pick_precision(precision, device, config, main=True) -> torch.dtype:
    """The compute dtype for `precision` ("auto", "bf16", "fp16" or "fp32") on `device`, for a model of `config`'s
    shapes. On CPU only `main` (rank 0) measures, and prints what it measured: another rank's measurement would
    compete with it for the same cores, and agreed() gives every rank rank 0's choice in place of the fp32 stand-in."""
    p = precision
    if device.type == "cuda" and p == "auto":
        p = "bf16" if torch.cuda.get_device_capability(device)[0] >= 8 else "fp16"
    elif p == "fp16" and device.type == "cpu":
        raise ValueError("precision: fp16 is not supported on CPU (its matmuls run single-threaded); use bf16 or fp32")
    elif device.type == "cpu" and p == "auto" and not main:
        p = "fp32"
    elif device.type == "cpu" and p in ("auto", "bf16") and main:
        shape = (128, min(config.hidden_size, 2048), min(config.intermediate_size, 4096))
        rates = matmul_rates(shape, (torch.bfloat16, torch.float32), device)
        faster = faster_precision(rates)
        why = f"{fmt_flops(rates[torch.bfloat16])} in bf16, {fmt_flops(rates[torch.float32])} in fp32"
        why += f" ({' x '.join(map(str, shape))} matmuls)"
        if p == "auto":
            print(f"precision auto: {faster} on this CPU, the faster here: {why}")
        elif faster == "fp32":
            print(f"warning: precision bf16 runs slower than fp32 on this CPU, which emulates bf16: {why}")
        p = faster if p == "auto" else p
    return PRECISIONS[p]


def faster_precision(rates) -> str:
    """Which of bf16 and fp32 has the higher measured FLOP/s in {dtype: rate} (fp32 on a tie: it rounds less)."""
    return "bf16" if rates[torch.bfloat16] > rates[torch.float32] else "fp32"


def name(dtype) -> str:
    """The short name of a dtype: bf16, fp16 or fp32."""
    return next(k for k, v in PRECISIONS.items() if v == dtype)


def agreed(dtype, world, device) -> torch.dtype:
    """Rank 0's dtype on every rank (on CPU only rank 0 measured, see pick_precision)."""
    if world == 1:
        return dtype
    choice = torch.tensor(list(PRECISIONS.values()).index(dtype), device=device)
    dist.broadcast(choice, src=0)
    return list(PRECISIONS.values())[int(choice)]
