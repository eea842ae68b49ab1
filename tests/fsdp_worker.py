"""Run under torchrun by test_fsdp.py: a tiny model sharded over the ranks; writes, per rank, the parameter bytes it
holds between steps and the most it holds while a block computes (its hooks run inside the block's forward, once FSDP
has gathered it), as JSON lines to argv[2]."""

import json
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import train  # noqa: E402
from support import fsdp  # noqa: E402


def main(model_dir, out):
    cfg = train.Config(model=model_dir, device="cpu", precision="fp32", parallel="fsdp", lora_r=4, lora_alpha=8.0)
    place = train.setup(cfg)
    model = train.build_model(cfg, place, model_dir)
    between, whole = fsdp.resident_bytes(model)
    during = []
    for block in model.model.layers:
        block.register_forward_hook(lambda *_: during.append(fsdp.resident_bytes(model)[0]))
        block_bytes = sum(p.numel() * p.element_size() for p in block.parameters())
    pos = torch.cat([torch.arange(n) for n in (40, 24, 64)])[None]
    ids = torch.randint(0, 1000, pos.shape, generator=torch.Generator().manual_seed(0))
    loss, _ = model(ids, pos, labels=ids)
    loss.backward()
    line = dict(rank=place.rank, world=place.world, between=between, whole=whole, during=max(during), block=block_bytes)
    with open(out, "a") as f:
        f.write(json.dumps(line) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
