"""support/run/progress.py: what a run tells its user while it trains.

What this file proves: adapter_health's norms, formed through an (r, r) trace, equal ||scale * B @ A|| / ||W|| formed
explicitly, over dense and NF4 bases, and B's moved share is 0 at initialisation and the true fraction after some
entries move (that the warning fires when no B moves is tests/test_train.py's, end to end).
"""

import pytest
import torch

import lora
import quant
from support.run import progress
from train import load_model


@pytest.mark.parametrize("nf4", [False, True])
def test_adapter_health_equals_direct_norms(tiny_dir, nf4):
    """adapter_health's (r, r) trace trick equals ||scale * B @ A|| / ||W|| formed explicitly, and B's moved share
    is 0 at initialisation and the true fraction after some entries move."""
    model = load_model(tiny_dir).eval()
    if nf4:
        quant.quantize_(model, compute_dtype=torch.float32)
    lora.add_lora_(model, ["q_proj", "down_proj"], r=4, alpha=8, dropout=0.0)
    assert all(v == (0.0, 0.0) for v in progress.adapter_health(model).values())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.3)
        model.model.layers[0].self_attn.q_proj.lora_B.weight[:10] = 0  # 10 of 64 rows still at zero
    health = progress.adapter_health(model)
    assert len(health) == 4
    for name, m in lora.lora_modules(model).items():
        w = m.dequantize() if nf4 else m.weight
        want = (m.scaling * m.lora_B.weight @ m.lora_A.weight).norm() / w.norm()
        assert abs(health[name][0] - want.item()) < 1e-5 * want.item()
    assert health["model.layers.0.self_attn.q_proj"][1] == 1 - 10 / 64
