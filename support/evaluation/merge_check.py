"""Is the merge right? The merged model against the adapter on the very weights it was merged into.

The check rebases (lora.rebase_: the adapters over the weights the merge will use), takes the logits, folds (lora.fold_)
and compares, in fp32: in 16 bits rounding moves the logits about as far as a short run's adapter does
(docs/correctness.md). The 4-bit gap the adapter was trained against is reported apart, beside the base's own.
"""

from contextlib import contextmanager
from itertools import chain

import torch
import torch.nn as nn

import quant
from lora import adapters_off, fold_, rebase_
from support.kernels.choice import name


@contextmanager
def in_fp32(model):
    """Inside, every floating tensor is fp32 and so are CUDA's fp32 matmuls (not TF32); on leaving, each tensor goes
    back to its name's dtype on entry (a weight fold_ replaced is rounded once), the matmul precision too."""
    tensors = lambda: chain(model.named_parameters(remove_duplicate=False), model.named_buffers())  # noqa: E731
    dtypes, matmul = {key: t.dtype for key, t in tensors()}, torch.backends.cuda.matmul.fp32_precision
    model.float()
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    try:
        yield model
    finally:
        torch.backends.cuda.matmul.fp32_precision = matmul
        for key, t in tensors():
            t.data = t.data.to(dtypes.get(key, t.dtype))


# The merge error allowed, as a share of the largest logit: fp32 rounding carried through every layer.
MERGE_TOLERANCE = 1e-4


@torch.no_grad()
def merge_and_check_(model, prompts, original=None):
    """merge_lora_, checked in fp32 on `prompts` (lists of token ids): (sources, report), each a largest |logit gap|:
    merge_error (merged against the adapter on the same base; above `tolerance` a ValueError, nothing written),
    adapter_effect (the adapter against its base), rounding (16-bit: the merged weights as written against the adapter),
    gap_4bit and gap_4bit_base (adapter, then untrained base, on NF4 against on the original weights, run's dtype)."""
    device, was_training = next(model.parameters()).device, model.training
    to_original = original is not None and any(
        f"{n}.weight" in original for n, m in model.named_modules() if isinstance(m, quant.NF4Linear)
    )
    model.eval()

    def logits():
        return torch.cat([model(torch.tensor([p], device=device))[0].float() for p in prompts])

    def gap(a, b):
        return float((a - b).abs().max())

    if to_original:  # the adapter on the NF4 base, and the untrained NF4 base
        trained = logits()
        with adapters_off(model):
            trained_base = logits()
    sources = rebase_(model, original)
    report = dict(merged_into="/".join(sorted(set(sources.values()))))
    if to_original:
        with adapters_off(model):
            report["gap_4bit_base"] = gap(trained_base, logits())
        report["gap_4bit"] = gap(trained, logits())
    dtype = next(m.weight.dtype for m in model.modules() if isinstance(m, nn.Linear))
    with in_fp32(model):
        reference = logits()
        with adapters_off(model):
            report["adapter_effect"] = gap(reference, logits())
        fold_(model)
        report |= dict(merge_error=gap(logits(), reference), tolerance=MERGE_TOLERANCE * gap(reference, 0))
    if report["merge_error"] > report["tolerance"]:
        raise ValueError(
            f"merge check: the merged model's logits are up to {report['merge_error']:.2e} away from the adapter on "
            f"the same base weights, in fp32 (allowed {report['tolerance']:.1e}, rounding): the merge is wrong"
        )
    if dtype != torch.float32:  # the merged weights as written, rounded to the run's dtype, against the adapter
        with in_fp32(model):
            report |= dict(rounding=gap(logits(), reference), dtype=name(dtype))
    model.train(was_training)
    print(merge_summary(report, len(prompts)))
    return sources, report


def merge_summary(report, prompts=1):
    """The merge check's report in words, one line."""
    line = (
        f"merge check on {prompts} prompt(s), in fp32: merge error {report['merge_error']:.1e} (largest |logit "
        f"difference|; rounding allows {report['tolerance']:.1e}) on an adapter that moves the logits by "
        f"{report['adapter_effect']:.2f}: the merge is exact"
    )
    if "rounding" in report:
        line += f"; rounded to {report['dtype']} as written, {report['rounding']:.2f} from the adapter"
    if "gap_4bit" in report:
        line += (
            f"; 4-bit gap (the adapter on NF4 vs on the original weights) {report['gap_4bit']:.2f}, the untrained "
            f"base's own {report['gap_4bit_base']:.2f}"
        )
    return line
