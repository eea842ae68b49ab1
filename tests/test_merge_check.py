"""support/merge_check.py, on the tiny random Llama of test_lora.py:

- the merge error (the merged model against the adapter on the very weights merged into) is at fp32 rounding for a
  dense base, for NF4 merged into its dequantized copy and for NF4 merged into the original weights;
- there the 4-bit gap (the adapter on NF4 against the adapter on the original weights) is reported apart, beside the
  untrained base's own, both far above the merge error; the printed line says what the report holds;
- a merge that drops one layer's delta fails the check in one line.
"""

import re

import pytest
import test_lora
import torch
from test_lora import ours, randomize_B

import lora
import quant
from support.hf import Checkpoint
from support.merge_check import merge_and_check_, merge_summary

base_dir = test_lora.base_dir  # the tiny random Llama, a fixture shared with test_lora.py


@pytest.mark.parametrize("base", ["dense", "dequantized", "original"])
def test_the_merge_check_separates_the_merge_error_from_the_4bit_gap(base_dir, base, capsys):
    """The merge error (merged model against the adapter on the weights the merge started from) is at fp32 rounding
    for a dense base, for NF4 merged into its dequantized copy and for NF4 merged into the original weights; there the
    report also holds the 4-bit gap, the adapter on NF4 against the adapter on the original weights, beside the
    untrained base's own NF4 gap, both far above the merge error; metrics and the printed line say the same."""
    model = ours(base_dir)
    if base != "dense":
        quant.quantize_(model, compute_dtype=torch.float32)
    lora.add_lora_(model, "all-linear", r=4, alpha=8, dropout=0.1)
    randomize_B(model)
    model.eval()  # quantize_'s new layers start in training mode, as every new module does
    original = Checkpoint(base_dir) if base == "original" else None
    with torch.no_grad():
        largest = max(float(model(torch.tensor([p])).abs().max()) for p in ([1, 2, 3, 4], [9, 8, 7]))
    sources, report = merge_and_check_(model, [[1, 2, 3, 4], [9, 8, 7]], original=original)
    assert set(sources.values()) == {base} and report["merged_into"] == base
    assert report["merge_error"] < 1e-5 < report["tolerance"]  # fp32: 1e-4 of the largest logit
    if base != "original":  # the adapter on the same weights as trained: its largest logit is the scale
        assert report["tolerance"] == pytest.approx(1e-4 * largest)
    assert ("gap_4bit" in report) == (base == "original")
    if base == "original":
        assert (
            report["gap_4bit"] > 1e3 * report["merge_error"] and report["gap_4bit_base"] > 1e3 * report["merge_error"]
        )
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line == merge_summary(report, 2) and "the merge is exact" in line
    assert ("4-bit gap" in line) == (base == "original")


@pytest.mark.parametrize("base", ["dense", "dequantized", "original"])
def test_a_merge_that_drops_one_delta_fails_the_check(base_dir, base, monkeypatch):
    """One layer's delta left out of the merge (a corrupted fold): the check refuses it in one line."""
    model = ours(base_dir)
    if base != "dense":
        quant.quantize_(model, compute_dtype=torch.float32)
    lora.add_lora_(model, "all-linear", r=4, alpha=8, dropout=0.0)
    randomize_B(model)
    delta_weight = lora.LoRA.delta_weight
    dropped = lora.lora_modules(model)["model.layers.1.mlp.down_proj"]
    lora_B = dropped.lora_B  # rebase_ keeps the adapter's own A and B: the dropped layer is the one holding this B
    monkeypatch.setattr(lora.LoRA, "delta_weight", lambda m: delta_weight(m) * (m.lora_B is not lora_B))
    original = Checkpoint(base_dir) if base == "original" else None
    with pytest.raises(ValueError) as e:
        merge_and_check_(model, [[1, 2, 3, 4], [9, 8, 7]], original=original)
    assert len(str(e.value).splitlines()) == 1
    assert re.fullmatch(
        r"merge check: the merged model's logits are up to \S+ away from the adapter on the same base weights "
        r"\(allowed \S+, rounding\): the merge is wrong",
        str(e.value),
    )
