"""Where else do the metrics go? TensorBoard or Weights & Biases, beside metrics.jsonl.

With `log = "tensorboard"` or `log = "wandb"` every record that goes into metrics.jsonl also goes to the tracker, as it
is made (rank 0 only): every number in it, nested keys joined by "/" ("adapters/mean", "nf4_error/worst"), at the
record's step, and the held-out answers of each evaluation as text. TensorBoard's event files go to
out_dir/tensorboard/<start time> (`tensorboard --logdir out`), one run per launch, so that a resumed run (which repeats
the steps after its checkpoint) or an overwritten one shows as a run of its own; its scalars are in double precision, to
hold metrics.jsonl's values exactly. W&B runs offline unless an API key is set (WANDB_API_KEY, or `wandb login`), into
out_dir/wandb and the project nanoqlora unless WANDB_DIR and WANDB_PROJECT say otherwise, with the Config as the run's
config; `wandb sync` uploads an offline run later. Both packages are optional installs.
"""

import dataclasses
import netrc
import os
import time


def open_tracker(cfg):
    """The tracker cfg.log asks for, None for "" (config.check_config has checked its package is installed)."""
    if not cfg.log:
        return None
    return TensorBoard(cfg) if cfg.log == "tensorboard" else WandB(cfg)


def numbers(record, prefix="") -> dict:
    """{"a/b": number} for every number in a nested record (booleans and text left out)."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out |= numbers(value, f"{prefix}{key}/")
        elif isinstance(value, int | float) and not isinstance(value, bool) and key != "step":
            out[prefix + key] = value
    return out


def sample_text(sample) -> str:
    """A held-out prompt and its answer as one text entry."""
    return f"prompt:\n{sample['prompt']}\n\nanswer:\n{sample['answer']}"


def has_api_key() -> bool:
    """Whether W&B has an API key: WANDB_API_KEY, or the one `wandb login` keeps in ~/.netrc."""
    try:
        return bool(os.environ.get("WANDB_API_KEY") or netrc.netrc().authenticators("api.wandb.ai"))
    except (OSError, netrc.NetrcParseError):
        return False


class TensorBoard:
    def __init__(self, cfg):
        from torch.utils.tensorboard import SummaryWriter

        started = time.strftime("%Y%m%d-%H%M%S")  # a run of its own per launch: a resumed one does not overwrite
        self.writer = SummaryWriter(log_dir=os.path.join(cfg.out_dir, "tensorboard", started))

    def log(self, record):
        step = record["step"]
        for tag, value in numbers(record).items():
            self.writer.add_scalar(tag, value, step, new_style=True, double_precision=True)
        for i, sample in enumerate(record.get("samples", [])):
            self.writer.add_text(f"samples/{i}", sample_text(sample), step)
        self.writer.flush()

    def close(self):
        self.writer.close()


class WandB:
    def __init__(self, cfg):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if has_api_key() else "offline")
        self.wandb, self.samples = wandb, []
        # W&B's own environment wins where set: wandb.init's arguments would override WANDB_PROJECT and WANDB_DIR
        project, folder = os.environ.get("WANDB_PROJECT") or "nanoqlora", os.environ.get("WANDB_DIR") or cfg.out_dir
        self.run = wandb.init(project=project, dir=folder, config=dataclasses.asdict(cfg), mode=mode)

    def log(self, record):
        data = numbers(record)
        if "samples" in record:
            self.samples += [[record["step"], s["prompt"], s["answer"]] for s in record["samples"]]
            data["samples"] = self.wandb.Table(columns=["step", "prompt", "answer"], data=self.samples)
        self.run.log(data, step=record["step"])

    def close(self):
        self.run.finish()
