"""How fast is NF4 on CPU, ours against bitsandbytes, and how fast does a QLoRA model load?

`python bench.py quant` (--smollm2: the load times too): the best of --repeat runs after one warm-up run.
"""

import os
import tempfile

import torch

import quant
from benchmarks.common import best_time, print_table
from support.formats import gguf_read, hf
from train import load_model


def bench_quant(size=4096, repeat=5, smollm2=False):
    """NF4 quantize / dequantize of a size x size bf16 weight on CPU, pure-PyTorch (quant.py) vs bitsandbytes."""
    import bitsandbytes.functional as bnb

    w = (torch.randn(size, size) * 0.02).to(torch.bfloat16)
    n = w.numel()
    ours = quant.quantize_nf4(w)
    bnb_quantize = lambda: bnb.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    packed, state = bnb_quantize()
    cases = [
        ("quantize bf16 -> nf4", "quant.py", lambda: quant.quantize_nf4(w)),
        ("quantize bf16 -> nf4", "bitsandbytes", bnb_quantize),
        ("dequantize nf4 -> bf16", "quant.py", lambda: quant.dequantize_nf4(*ours, w.shape, torch.bfloat16)),
        ("dequantize nf4 -> bf16", "bitsandbytes", lambda: bnb.dequantize_4bit(packed, state)),
    ]
    rows = []
    for op, impl, fn in cases:
        t = best_time(fn, repeat)
        rows.append((op, impl, f"{t * 1e3:.1f}", f"{n / t / 1e6:.0f}", f"{2 * n / t / 1e9:.2f}"))
    print(f"NF4 on CPU ({torch.get_num_threads()} threads), {size} x {size} weight, best of {repeat}")
    print_table(["operation", "implementation", "ms", "Mparams/s", "GB/s of bf16"], rows)
    if smollm2:
        print()
        bench_smollm2_load(repeat)


def bench_smollm2_load(repeat):
    """SmolLM2-135M into a QLoRA model through train.load_model: quantize its 16-bit checkpoint vs load our
    pre-quantized (bnb-4bit) one."""
    load = lambda path: load_model(path, torch.bfloat16, quantize=True)  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        dense, prequantized = os.path.join(tmp, "bf16"), os.path.join(tmp, "nf4")
        gguf_read.convert_gguf(gguf_read.smollm2_gguf_path(), dense, dtype=torch.bfloat16)
        model = load(dense)
        hf.save_quantized(model, prequantized)
        rows = []
        for label, path in [("quantize the bf16 checkpoint", dense), ("load pre-quantized (bnb-4bit)", prequantized)]:
            t = best_time(lambda path=path: load(path), repeat)
            mib = os.path.getsize(os.path.join(path, "model.safetensors")) / 2**20
            rows.append((label, f"{t:.2f}", f"{mib:.1f}"))
    layers = [m for m in model.modules() if isinstance(m, quant.NF4Linear)]
    params = sum(m.in_features * m.out_features for m in layers)
    nf4_bytes = sum(b.numel() * b.element_size() for m in layers for b in m.buffers())
    rest = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"SmolLM2-135M load on CPU ({torch.get_num_threads()} threads), best of {repeat}")
    print_table(["path", "seconds", "file MiB"], rows)
    print(
        f"{params / 1e6:.1f}M parameters in {len(layers)} NF4 linears at {8 * nf4_bytes / params:.4f} bits each "
        f"({nf4_bytes / 2**20:.1f} MiB) + {rest / 2**20:.1f} MiB of bf16 embeddings and norms "
        f"= {(nf4_bytes + rest) / 2**20:.1f} MiB (bf16 model: {(2 * params + rest) / 2**20:.1f} MiB)"
    )
