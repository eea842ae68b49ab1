"""Is the merge right? The merged model against the adapter on the very weights it was merged into.

A QLoRA adapter is trained against the dequantized NF4 base, and merged (lora.merge_lora_) into the original 16-bit
weights when they are at hand, which is what users expect of a merged model. Comparing the merged model with the
adapter on the NF4 base would then mix two things: the merge's own error, which must be rounding, and the 4-bit gap
the adapter was trained against, which can be tens of logits and is no fault of the merge. So the check rebases first
(lora.rebase_: the adapters kept, their bases replaced by the weights the merge will use), takes the reference
logits there, folds (lora.fold_) and compares: that is the merge error. The 4-bit gap is reported apart, beside the
same gap of the untrained base (NF4 base against the 16-bit one), so a user sees the adapter's gap is about what the
base already had.

The check computes in fp32, whatever the run's dtype. In 16 bits the merged model and the adapter round differently
(W + scale B A rounded once, against W and the branch rounded apart, and every activation after them), and that
rounding moves the logits about as far as a short run's adapter does: a bf16 check cannot tell a merge that folded
every delta from one that folded none, whatever its tolerance. Judging the merge against the adapter's own effect
instead (a tenth of it, say) would catch a merge that folds nothing, but not one that drops one delta of hundreds,
which moves the logits by a few hundredths of that effect. In fp32 a right merge is off by rounding alone, about 1e-6
of the largest logit, and one dropped delta by thousands of times that. So the rebased model is brought to fp32
(twice its 16-bit memory, for the length of the check), the adapters are folded there, the check compares, and the
merged weights are then rounded once to the run's dtype. That last rounding is no error of the merge, but the model
written carries it: the report gives it (the rounded model against the adapter, in fp32) beside the adapter's own
effect (the adapter against its base alone), so a user sees how much of the adapter a 16-bit merged model keeps.
"""

from contextlib import contextmanager
from itertools import chain

import torch
import torch.nn as nn

import quant
from lora import fold_, lora_modules, rebase_
from support.kernels.choice import name


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


@contextmanager
def in_fp32(model):
    """Inside, every floating parameter and buffer is fp32 and CUDA's fp32 matmuls are too (not TF32, whatever the
    tf32 setting); on leaving, each tensor goes back to the dtype its name had on entry (a weight that fold_ replaced
    inside is rounded once to its predecessor's dtype), and the matmul precision to what it was."""
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


# The merge error allowed, as a share of the largest logit: fp32 rounding carried through every layer. Measured on
# SmolLM2 (bf16, fp16 or fp32 weights): 1e-6 to 3e-6 of the largest logit for a right merge, 3e-3 with one layer's
# delta of 210 left out.
MERGE_TOLERANCE = 1e-4


@torch.no_grad()
def merge_and_check_(model, prompts, original=None):
    """merge_lora_, checked in fp32 on `prompts` (a few lists of token ids); returns (sources, report), every number in
    the report a largest |logit difference| over the prompts.

    merge_error: the merged model against the adapter on the very weights the merge started from (original 16-bit,
    dequantized or dense), both in fp32: rounding, or a wrong merge when above `tolerance` (MERGE_TOLERANCE of the
    largest logit; a ValueError, before anything is written). adapter_effect: the adapter against the base alone, in
    fp32. rounding, for a 16-bit model: the merged weights as rounded to that dtype (what is written) against the
    adapter, in fp32. gap_4bit, when an NF4-trained adapter goes into the original weights: the adapter on the NF4 base
    against the adapter on the original weights, in the run's dtype, beside gap_4bit_base, the same gap of the
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
    """The merge check in words, one line: the merge error beside the adapter's effect, the 16-bit rounding of the
    written model, then the 4-bit gap beside the base's own."""
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
