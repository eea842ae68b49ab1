"""support/evaluation/merge_check.py, on the tiny random Llama of test_lora.py:

- the merge error (the merged model against the adapter on the very weights merged into) is at fp32 rounding for a
  dense base, for NF4 merged into its dequantized copy and for NF4 merged into the original weights;
- there the 4-bit gap (the adapter on NF4 against the adapter on the original weights) is reported apart, beside the
  untrained base's own, both far above the merge error; the printed line says what the report holds;
- a merge that drops one layer's delta fails the check in one line; with TF32 asked for, the check's matmuls are
  still full fp32;
- on SmolLM2 in bf16, fp16 and fp32, with adapters that move the logits about as far as two default steps do: the
  correct merge passes, a merge that folds no delta and one that drops a single layer's delta each fail in one line.
"""

import copy
import re

import pytest
import test_lora
import torch
from test_lora import ours, randomize_B

import lora
import quant
from support.data.tokenizer import Tokenizer
from support.evaluation import merge_check
from support.evaluation.merge_check import merge_and_check_, merge_summary
from support.formats.hf import Checkpoint
from train import load_model

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
    delta_weight = lora.delta_weight
    dropped = lora.lora_modules(model)["model.layers.1.mlp.down_proj"]
    lora_B = dropped.lora_B  # rebase_ keeps the adapter's own A and B: the dropped layer is the one holding this B
    monkeypatch.setattr(lora, "delta_weight", lambda m: delta_weight(m) * (m.lora_B is not lora_B))
    original = Checkpoint(base_dir) if base == "original" else None
    with pytest.raises(ValueError) as e:
        merge_and_check_(model, [[1, 2, 3, 4], [9, 8, 7]], original=original)
    assert len(str(e.value).splitlines()) == 1
    assert re.fullmatch(
        r"merge check: the merged model's logits are up to \S+ away from the adapter on the same base weights, in fp32 "
        r"\(allowed \S+, rounding\): the merge is wrong",
        str(e.value),
    )


def test_the_check_runs_in_full_fp32_where_tf32_is_on(base_dir, monkeypatch):
    """With TF32 asked for (--tf32=True), CUDA's fp32 matmuls inside the check are full fp32 ("ieee", as the fold sees
    it), and TF32 is back on after it."""
    model = ours(base_dir)
    lora.add_lora_(model, "all-linear", r=4, alpha=8, dropout=0.0)
    randomize_B(model)
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # conftest's autouse fixture restores it
    seen = []
    monkeypatch.setattr(
        merge_check, "fold_", lambda m: seen.append(torch.backends.cuda.matmul.fp32_precision) or lora.fold_(m)
    )
    merge_and_check_(model, [[1, 2, 3, 4]])
    assert seen == ["ieee"] and torch.backends.cuda.matmul.fp32_precision == "tf32"


# B ~ N(0, 0.015): the adapter then moves SmolLM2's logits by about 2 (the largest |difference| from the base, in
# fp32), as a 2-step default run's adapter does (1.87 measured).
TRAINED_B_STD = 1.5e-2


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def smollm2_adapted(request, smollm2_dir):
    """SmolLM2 in each dtype with train.py's default adapters (rank 16 on every linear, fp32 masters), B drawn at a
    trained adapter's size, and the token ids of a short prompt. The base is dense: what the check compares, the
    merged model against the adapter on the weights merged into, is the same for an NF4-trained adapter once rebased
    (the tests above), and a dense base keeps the 4-bit forward passes out of a test that needs none."""
    torch.manual_seed(0)
    adapters = dict(targets="all-linear", r=16, alpha=32, dropout=0.05, lora_dtype=torch.float32)
    model = load_model(smollm2_dir, request.param, add_lora=adapters).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, TRAINED_B_STD)
    return model, Tokenizer(smollm2_dir).encode("def fibonacci(n):")


@pytest.mark.parametrize("dropped", ["none", "all", "one"])
def test_the_check_tells_a_wrong_merge_from_rounding_on_smollm2(smollm2_adapted, dropped, monkeypatch):
    """SmolLM2 with adapters that move its logits by about 2, in the run's dtype: the correct merge passes; a merge that
    folds no delta at all, and one that drops one layer's delta (1 of 210), fail in one line, in bf16 and fp16 as in
    fp32."""
    model, prompt = copy.deepcopy(smollm2_adapted[0]), smollm2_adapted[1]
    dropped_B = lora.lora_modules(model)["model.layers.1.mlp.down_proj"].lora_B
    kept = dict(none=lambda m: True, all=lambda m: False, one=lambda m: m.lora_B is not dropped_B)[dropped]
    delta_weight = lora.delta_weight
    monkeypatch.setattr(lora, "delta_weight", lambda m: delta_weight(m) * kept(m))
    if dropped == "none":
        _, report = merge_and_check_(model, [prompt])
        assert report["merge_error"] < report["tolerance"] < 0.01 * report["adapter_effect"]
        assert ("rounding" in report) == (next(model.parameters()).dtype != torch.float32), report
        return
    with pytest.raises(ValueError) as e:
        merge_and_check_(model, [prompt])
    assert len(str(e.value).splitlines()) == 1 and str(e.value).endswith("the merge is wrong"), str(e.value)
