"""Is the merge right? The merged model against the adapter on the very weights it was merged into.

A QLoRA adapter is trained against the dequantized NF4 base, and merged (lora.merge_lora_) into the original 16-bit
weights when they are at hand, which is what users expect of a merged model. Comparing the merged model with the
adapter on the NF4 base would then mix two things: the merge's own error, which must be rounding, and the 4-bit gap
the adapter was trained against, which can be tens of logits and is no fault of the merge. So the check rebases first
(lora.rebase_: the adapters kept, their bases replaced by the weights the merge will use), takes the reference
logits there, folds (lora.fold_) and compares: that is the merge error. The 4-bit gap is reported apart, beside the
same gap of the untrained base (NF4 base against the 16-bit one), so a user sees the adapter's gap is about what the
base already had.
"""

from contextlib import contextmanager

import torch
import torch.nn as nn

import quant
from lora import fold_, lora_modules, rebase_


@contextmanager
def adapters_off(model):
    """Inside, every adapter's scale is 0: the model computes as its base alone (PEFT's disable_adapter)."""
    mods = lora_modules(model).values()
    scales = [m.scaling for m in mods]
    for m in mods:
        m.scaling = 0.0
    try:
        yield model
    finally:
        for m, s in zip(mods, scales, strict=True):
            m.scaling = s


# The merge error allowed, as a share of the largest logit. The merged weights are W + scale * B A rounded once to the
# compute dtype; the unmerged model rounds W and the branch apart; the two differ by that dtype's rounding carried
# through every layer. Measured on SmolLM2, of the largest logit: 2e-6 in fp32, 2.9e-2 in bf16, whose 8 significant bits
# hold a small trained delta only coarsely, so in 16 bits the check tells a grossly wrong merge from rounding, no more.
MERGE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-1, torch.float16: 2e-2}


@torch.no_grad()
def merge_and_check_(model, prompts, original=None):
    """merge_lora_, checked on `prompts` (a few lists of token ids); returns (sources, report), every number in the
    report a largest |logit difference| over the prompts.

    merge_error: the merged model against the adapter on the very weights the merge started from (original 16-bit,
    dequantized or dense): rounding, or a wrong merge when above `tolerance` (MERGE_TOLERANCE of the largest logit; a
    ValueError, before anything is written). gap_4bit, when an NF4-trained adapter goes into the original weights: the
    adapter on the NF4 base against the adapter on the original weights, beside gap_4bit_base, the same gap of the
    untrained base. That gap is what the adapter was trained against, not an error of the merge.
    """
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
    reference = logits()
    report = dict(merged_into="/".join(sorted(set(sources.values()))))
    if to_original:
        with adapters_off(model):
            report |= dict(gap_4bit=gap(trained, reference), gap_4bit_base=gap(trained_base, logits()))
    fold_(model)
    dtype = next(m.weight.dtype for m in model.modules() if isinstance(m, nn.Linear))
    report |= dict(merge_error=gap(logits(), reference), tolerance=MERGE_TOLERANCE[dtype] * gap(reference, 0))
    model.train(was_training)
    if report["merge_error"] > report["tolerance"]:
        raise ValueError(
            f"merge check: the merged model's logits are up to {report['merge_error']:.2e} away from the adapter on "
            f"the same base weights (allowed {report['tolerance']:.1e}, rounding): the merge is wrong"
        )
    print(merge_summary(report, len(prompts)))
    return sources, report


def merge_summary(report, prompts=1):
    """The merge check in words, one line: the merge error, then the 4-bit gap beside the base's own."""
    line = (
        f"merge check on {prompts} prompt(s): merge error {report['merge_error']:.1e} (largest |logit difference|; "
        f"rounding allows {report['tolerance']:.1e}): the merge is exact"
    )
    if "gap_4bit" in report:
        line += (
            f"; 4-bit gap (the adapter on NF4 vs on the original weights) {report['gap_4bit']:.2f}, the untrained "
            f"base's own {report['gap_4bit_base']:.2f}"
        )
    return line
