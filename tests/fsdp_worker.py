"""Run under torchrun by test_fsdp.py: a tiny model sharded over the ranks; writes, per rank, as JSON lines to argv[2]:
the parameter bytes it holds between steps, the most it holds while a block computes (its hooks run inside the block's
forward, once FSDP has gathered it), and the most it held while loading: all the model's tensors it held at each
`fully_shard` of a block, and at the root's."""

import json
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import train  # noqa: E402
from support import fsdp  # noqa: E402


def tensor_bytes(module):
    """Bytes of the parameters and buffers `module` holds on this rank now (a shard counts its local part)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors if not t.is_meta)


def main(model_dir, out):
    cfg = train.Config(model=model_dir, device="cpu", precision="fp32", parallel="fsdp", lora_r=4, lora_alpha=8.0)
    place = train.setup(cfg)
    built, loading, fully_shard, open_model = [], {"blocks": 0, "root": 0}, fsdp.fully_shard, fsdp.open_model

    def open_and_keep(*args):  # the loader's model, so that every byte it holds can be counted
        opened = open_model(*args)
        built.append(opened[0])
        return opened

    def shard_and_count(module, **kw):  # the loader's every fully_shard: each block, then the whole model
        held = tensor_bytes(built[0])  # every real tensor of the model on this rank (meta ones are not yet loaded)
        key = "root" if module is built[0] else "blocks"
        loading[key] = max(loading[key], held)
        return fully_shard(module, **kw)

    fsdp.open_model, fsdp.fully_shard = open_and_keep, shard_and_count
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
    line |= {f"loading_{k}": v for k, v in loading.items()}
    with open(out, "a") as f:
        f.write(json.dumps(line) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
