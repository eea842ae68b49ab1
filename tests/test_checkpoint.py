"""support/checkpoint.py: what a checkpoint holds comes back on resume: fp16's loss scale; optimizer state keyed by
parameter name, and the older state keyed by position (even with no step taken). (Step-exact resume, resume across
rank counts, refused settings and a corrupted file, through train.py: test_train.py and test_fsdp.py.)"""

import pytest
import torch

import train
from support import checkpoint


def test_the_fp16_loss_scale_is_checkpointed(tmp_path):
    """fp16's GradScaler state goes into the checkpoint and comes back on resume (it used to restart at its initial
    scale, so a resumed fp16 run was not step-exact). On CPU, torch's GradScaler for "cpu" stands in for CUDA's."""
    cfg, model = train.Config(), torch.nn.Linear(4, 2)

    def optimizer():
        return torch.optim.AdamW(model.parameters())

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    scaler.scale(torch.ones(()))
    scaler.update(new_scale=1234.0)
    checkpoint.save_checkpoint(tmp_path / "c.pt", model, optimizer(), scaler, 7, cfg)
    fresh = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    assert checkpoint.load_checkpoint(tmp_path / "c.pt", model, optimizer(), fresh, cfg) == 7
    assert fresh.get_scale() == 1234.0


@pytest.mark.parametrize("steps", [0, 2])
def test_optimizer_state_keyed_by_position_still_loads(steps):
    """A checkpoint written before optimizer state was keyed by parameter name (torch's own state_dict, keyed by
    position), also one written before any step (no state at all), loads into the same optimizer exactly."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    old = torch.optim.AdamW(trainable, lr=1e-2)
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
        old.step()
    named = checkpoint.optimizer_state(model, old)  # keyed by name, as checkpoints hold it now
    assert set(named["state"]) == ({"0.bias", "1.weight", "1.bias"} if steps else set())
    fresh = torch.optim.AdamW(trainable, lr=1e-2)
    checkpoint.load_optimizer(model, fresh, old.state_dict())
    assert fresh.state_dict()["param_groups"] == old.state_dict()["param_groups"]
    for p in trainable:
        assert fresh.state[p].keys() == old.state[p].keys()
        assert all(torch.equal(fresh.state[p][k], old.state[p][k]) for k in old.state[p])
