"""Are the inputs there, and may this run write to out_dir?

Checked before any work: the model's config.json and the data exist (Hub ids resolved by support/formats/hub.py), a GGUF
export of something llama.cpp cannot read is refused now rather than after the training, and out_dir is writable and
holds no other run. A run already there (a checkpoint, an adapter or metrics) is continued with --resume or replaced
with --overwrite; a chosen out_dir holding one is refused, and the default one moves on to out-2, out-3, ... (saying
so), so running the default twice keeps both runs.
"""

import os

from support.formats import gguf_read, gguf_write, hub
from support.formats.atomic import atomic_write


def claim_inputs(cfg) -> tuple[str, dict]:
    """Fail before any work when out_dir is not writable, holds another run, or the model, data or checkpoint is
    missing; returns the model directory (the embedded SmolLM2 when cfg.model is "", converted on first use) and the
    data files {"data": [...], "val_data": [...]} (empty lists for "", the stdlib dataset), Hub ids resolved into the
    Hugging Face cache. A preview writes nothing, so it claims no out_dir; a plan reads no data."""
    model_dir = hub.model_dir(cfg.model, only_config=bool(cfg.plan)) if cfg.model else gguf_read.smollm2_dir()
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"model: {os.path.join(model_dir, 'config.json')} not found (not a model directory)")
    files = data_files(cfg)
    if cfg.export_gguf:  # what llama.cpp cannot read is refused now, not after the training
        gguf_write.check_gguf_export(model_dir, cfg.export_gguf)
    if not (cfg.preview or cfg.plan):
        claim_out_dir(cfg)
    return model_dir, files


def data_files(cfg) -> dict:
    """{"data": [...], "val_data": [...]}: the files of each (a local path, or a Hub dataset's in the cache); none for
    "" (the stdlib dataset) or for a plan, which reads no data."""
    return {key: hub.data_files(getattr(cfg, key)) if getattr(cfg, key) and not cfg.plan else []
            for key in ("data", "val_data")}  # fmt: skip


def claim_out_dir(cfg):
    """Make sure this run may write to out_dir. A run already there (see run_files) is continued with --resume or
    replaced with --overwrite; otherwise a chosen out_dir is refused, and the default one moves on to out-2, out-3,
    ... (saying so), so running the default twice keeps both runs. cfg.out_dir is updated in place."""
    ckpt = os.path.join(cfg.out_dir, "checkpoint.pt")
    if cfg.resume and not os.path.isfile(ckpt):
        raise FileNotFoundError(f"{ckpt}: no checkpoint to resume from")
    if (held := run_files(cfg.out_dir)) and not (cfg.resume or cfg.overwrite):
        if cfg.out_dir != type(cfg).out_dir:  # a chosen out_dir, not the default
            raise FileExistsError(
                f"out_dir: {cfg.out_dir} already holds a run ({held[0]}); continue it with --resume, replace it with "
                "--overwrite, or choose another out_dir"
            )
        n = 2  # the first out-N without a run (every rank of a torchrun finds the same one)
        while run_files(f"{cfg.out_dir}-{n}"):
            n += 1
        print(f"out_dir: {cfg.out_dir} holds an earlier run, kept as it is; this run writes to {cfg.out_dir}-{n}")
        cfg.out_dir = f"{cfg.out_dir}-{n}"
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
        probe = os.path.join(cfg.out_dir, f".write-test-{os.getpid()}")  # one per process: torchrun's ranks race
        atomic_write(probe, lambda tmp: None)
        os.remove(probe)
    except OSError as e:
        raise PermissionError(f"out_dir: cannot write to '{cfg.out_dir}' ({e.strerror})") from None


def run_files(out_dir) -> list[str]:
    """The files in out_dir that show a run was there: its checkpoint, its adapter, its metrics."""
    return [p for f in ("checkpoint.pt", "adapter", "metrics.jsonl") if os.path.exists(p := os.path.join(out_dir, f))]
