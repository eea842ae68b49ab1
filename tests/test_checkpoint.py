"""support/checkpoint.py: what a checkpoint holds comes back on resume. (Step-exact resume, refused settings and a
corrupted file, through train.py: test_train.py.)"""

import torch

import train
from support import checkpoint


def test_the_fp16_loss_scale_is_checkpointed(tmp_path):
    """fp16's GradScaler state goes into the checkpoint and comes back on resume (it used to restart at its initial
    scale, so a resumed fp16 run was not step-exact). On CPU, torch's GradScaler for "cpu" stands in for CUDA's."""
    cfg, model = train.Config(), torch.nn.Linear(4, 2)

    def parts():  # an optimizer and its schedule
        opt = torch.optim.AdamW(model.parameters())
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    scaler.scale(torch.ones(()))
    scaler.update(new_scale=1234.0)
    checkpoint.save_checkpoint(tmp_path / "c.pt", model, *parts(), scaler, 7, cfg)
    fresh = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    assert checkpoint.load_checkpoint(tmp_path / "c.pt", model, *parts(), fresh, cfg) == 7
    assert fresh.get_scale() == 1234.0
