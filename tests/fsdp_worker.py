"""Run under torchrun by test_ranks.py: `fsdp_worker.py OUT [MODEL_DIR]` writes, per rank, a JSON line to OUT: whether
an NF4 weight whose bytes take every value (every 16-bit pattern as a pair of bytes, NaNs of bf16 and fp16 among them,
and fp32 NaNs in its float tensors) comes back bit for bit when sharded over all the ranks and, where they pair up, over
each pair of them, and gathered; and, with MODEL_DIR, that tiny model sharded over the ranks: the parameter bytes a
rank holds between steps, the most it holds while a block computes (its hooks run inside the block's forward, once
FSDP has gathered it), the most it held while loading (all the model's tensors it held at each `fully_shard` of a
block, and at the root's) and the bytes it read from the checkpoint's files."""

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import quant  # noqa: E402
import train  # noqa: E402
from support.formats import hf  # noqa: E402
from support.run import ranks  # noqa: E402


def tensor_bytes(module):
    """Bytes of the parameters and buffers `module` holds on this rank now (a shard counts its local part)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors if not t.is_meta)


def every_byte_survives(place) -> dict:
    """{ranks sharded over: whether every byte survived}: over all the ranks, and over 2 where more ranks pair up (a
    2-rank mesh of each pair: 2 ranks tested without a launch of their own)."""
    meshes = {place.world: ranks.init_device_mesh("cpu", (place.world,))}
    if place.world > 2 and place.world % 2 == 0:
        meshes[2] = ranks.init_device_mesh("cpu", (place.world // 2, 2), mesh_dim_names=("pairs", "pair"))["pair"]
    return {n: survives(mesh) for n, mesh in meshes.items()}


def survives(mesh) -> bool:
    """An NF4Linear of a (512, 512) weight: its packed codes are every 16-bit pattern once (as byte pairs), its absmax
    bytes 0..255 over and over, its nested absmax and offset fp32 bit patterns with NaNs; sharded over `mesh` and
    gathered (what FSDP does before each forward), every tensor's bytes are the ones it started with."""
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.uint8)  # 131,072 bytes
    floats = torch.tensor([0x7FC00001, -1, 0x7F800000, -(2**31), 1, 0x3F800000] * 3, dtype=torch.int32)[:16]
    w = quant.NF4Weight(patterns.view(-1, 1), torch.arange(4096).to(torch.uint8), floats.view(torch.float32),
                        torch.tensor(0x7FA00BAD, dtype=torch.int32).view(torch.float32))  # fmt: skip
    layer = quant.NF4Linear.from_nf4(w, 512, 512, compute_dtype=torch.bfloat16)
    before = {name: bytes_of(t) for name, t in zip(quant.BUFFERS, w, strict=True)}
    ranks.params_from_nf4(layer)
    ranks.fully_shard(layer, mesh=mesh)
    layer.unshard()
    gathered = {name: bytes_of(getattr(layer, name)) for name in quant.BUFFERS}
    layer.reshard()
    return gathered == before


def bytes_of(t):
    return bytes(t.detach().reshape(-1).view(torch.uint8).tolist())


def main(out, model_dir=None):
    cfg = train.Config(model=model_dir or "", device="cpu", precision="fp32", parallel="fsdp", lora_r=4, lora_alpha=8.0)
    place = ranks.setup(cfg, shard=True)
    line = dict(rank=place.rank, world=place.world, nf4_bytes_survive=every_byte_survives(place))
    if model_dir:
        line |= load_and_step(cfg, place, model_dir)
    with open(out, "a") as f:
        f.write(json.dumps(line) + "\n")
    ranks.end_process_group()  # the model above is freed with the group, before the interpreter exits


def load_and_step(cfg, place, model_dir) -> dict:
    """The tiny model's bytes held and read, as the file docstring says."""
    built, loading, fully_shard, open_checkpoint = [], {"blocks": 0, "root": 0}, ranks.fully_shard, hf.open_checkpoint

    def open_and_keep(path, model):  # the loader's model, so that every byte it holds can be counted
        built.append(model)
        return open_checkpoint(path, model)

    def shard_and_count(module, **kw):  # the loader's every fully_shard: each block, then the whole model
        held = tensor_bytes(built[0])  # every real tensor of the model on this rank (meta ones are not yet loaded)
        key = "root" if module is built[0] else "blocks"
        loading[key] = max(loading[key], held)
        return fully_shard(module, **kw)

    read, get = [0], hf.Checkpoint.get

    def get_and_count(ckpt, name, shape=None):  # every tensor read from the checkpoint's files
        t = get(ckpt, name, shape)
        read[0] += t.nbytes
        return t

    hf.open_checkpoint, ranks.fully_shard, hf.Checkpoint.get = open_and_keep, shard_and_count, get_and_count
    model = train.build_model(cfg, place, model_dir, mlp_tile=0)
    between, whole = ranks.resident_bytes(model)
    during = []
    for block in model.model.layers:
        block.register_forward_hook(lambda *_: during.append(ranks.resident_bytes(model)[0]))
        block_bytes = sum(p.numel() * p.element_size() for p in block.parameters())
    pos = torch.cat([torch.arange(n) for n in (40, 24, 64)])[None]
    ids = torch.randint(0, 1000, pos.shape, generator=torch.Generator().manual_seed(0))
    loss, _ = model(ids, pos, labels=ids)
    loss.backward()
    line = dict(between=between, whole=whole, during=max(during), block=block_bytes, read=read[0])
    return line | {f"loading_{k}": v for k, v in loading.items()}


if __name__ == "__main__":
    main(*sys.argv[1:])
