"""support/run/run_dir.py: what a checkpoint holds comes back on resume: fp16's loss scale; the checkpoints of the
older layouts (optimizer state keyed by parameter name, as written before torch.distributed.checkpoint.state_dict did
it, and the older one keyed by position, even with no step taken) resume exactly; a checkpoint that would run code when
unpickled is refused in one line. (Step-exact resume, resume across rank counts, refused settings and a corrupted file,
through train.py: test_train.py and test_ranks.py.)"""

import dataclasses
import os

import pytest
import torch

import train
from support.run import run_dir


def test_the_fp16_loss_scale_is_checkpointed(tmp_path):
    """fp16's GradScaler state goes into the checkpoint and comes back on resume (it used to restart at its initial
    scale, so a resumed fp16 run was not step-exact). On CPU, torch's GradScaler for "cpu" stands in for CUDA's."""
    cfg, model = train.Config(), torch.nn.Linear(4, 2)

    def optimizer():
        return torch.optim.AdamW(model.parameters())

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    scaler.scale(torch.ones(()))
    scaler.update(new_scale=1234.0)
    run_dir.save_checkpoint(tmp_path / "c.pt", model, optimizer(), scaler, 7, cfg)
    fresh = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    assert run_dir.load_checkpoint(tmp_path / "c.pt", model, optimizer(), fresh, cfg) == 7
    assert fresh.get_scale() == 1234.0


def model_and_optimizer(steps):
    """A small model, one weight frozen, and AdamW after `steps` updates (the same draws every call)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def older_layout(model, opt, by_name):
    """opt's state as the older checkpoints held it: torch's own state_dict (keyed by position), or that state_dict
    keyed by parameter name instead, written by the checkpoint code before torch.distributed.checkpoint did it."""
    sd = opt.state_dict()
    if not by_name:
        return sd
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {names[id(params[i])]: dict(s) for i, s in sd["state"].items()}
    groups = [g | {"params": [names[id(params[i])] for i in g["params"]]} for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


@pytest.mark.parametrize("by_name", [True, False], ids=["by-name", "by-position"])
@pytest.mark.parametrize("steps", [0, 2])
def test_checkpoints_of_the_older_layouts_resume_exactly(tmp_path, steps, by_name):
    """A checkpoint in an older layout, written after 2 updates or before any (no optimizer state at all), loads into
    a fresh model and optimizer; the next update then equals the one the original model takes, bit for bit."""
    cfg = train.Config()
    model, opt = model_and_optimizer(steps)
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    old = dict(step=steps, lora=lora, optimizer=older_layout(model, opt, by_name), scaler={},
               config=dataclasses.asdict(cfg))  # fmt: skip
    torch.save(old, tmp_path / "checkpoint.pt")
    fresh_model, fresh_opt = model_and_optimizer(0)
    with torch.no_grad():
        for p in fresh_model.parameters():
            p.add_(1.0)  # the checkpoint, not the fresh init, must set the adapters
        fresh_model[0].weight.copy_(model[0].weight)  # the frozen base comes from the model files, not the checkpoint
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    assert run_dir.load_checkpoint(tmp_path / "checkpoint.pt", fresh_model, fresh_opt, scaler, cfg) == steps
    assert len(fresh_opt.state) == len(opt.state) == (3 if steps else 0)
    x = torch.randn(3, 4)
    for m, o in ((model, opt), (fresh_model, fresh_opt)):
        m(x).sum().backward()
        o.step()
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)


class RunsCode:
    """What a checkpoint from elsewhere may hold: unpickling it calls a function of its choice (here: touch a file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    """A checkpoint.pt whose unpickling would run code is refused in one line that names the file and what it holds,
    and the code never runs (torch.load with weights_only); it used to run on --resume."""
    cfg, model = train.Config(), torch.nn.Linear(4, 2)
    marker = tmp_path / "ran"
    torch.save({"step": 1, "lora": {}, "payload": RunsCode(marker)}, tmp_path / "checkpoint.pt")
    opt, scaler = torch.optim.AdamW(model.parameters()), torch.amp.GradScaler("cpu", enabled=False)
    with pytest.raises(ValueError) as e:
        run_dir.load_checkpoint(tmp_path / "checkpoint.pt", model, opt, scaler, cfg)
    assert not marker.exists()
    assert str(e.value).startswith(f"{tmp_path / 'checkpoint.pt'}: refused: it holds more than tensors and plain ")
    assert "GLOBAL posix.system" in str(e.value) and "\n" not in str(e.value)
