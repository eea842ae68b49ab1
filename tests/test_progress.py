"""support/run/progress.py: what a run tells its user while it trains.

What this file proves: adapter_health's norms, formed through an (r, r) trace, equal ||scale * B @ A|| / ||W|| formed
explicitly, over dense and NF4 bases, and B's moved share is 0 at initialisation and the true fraction after some
entries move (that the warning fires when no B moves is tests/test_train.py's, end to end).

The trackers: a short run's records reach TensorBoard and W&B exactly as they reach metrics.jsonl.

- TensorBoard: the event files, read back with tensorboard's own reader (EventAccumulator), hold every number of every
  record of metrics.jsonl at its step, exactly (double-precision scalars), and each evaluation's held-out answers as
  text.
- W&B, offline (no API key): the run file, read back with wandb's own reader (`wandb leet inspect --json`), holds the
  same numbers at the same steps, the Config as the run's config, and the answers in a table.
- W&B's own environment holds where it is set: WANDB_PROJECT names the run's project and WANDB_DIR takes its files;
  unset, they are nanoqlora and out_dir.
- Asking for a tracker whose package is not installed is one line saying what to pip install.
"""

import dataclasses
import glob
import json
import os
import subprocess
from collections import defaultdict

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util.tensor_util import make_ndarray
from test_train import args, one_line_error, run

import lora
import quant
import train
from support.run import optional, progress
from support.run.config import load_config
from support.run.progress import WandB, numbers, sample_text
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


FLAGS = ["--max_steps=3", "--eval_every=2", "--eval_samples=1", "--sample_tokens=6"]


def metrics(out):
    """{step: {tag: number}} and {step: [sample text]} of metrics.jsonl, as the trackers should hold them."""
    values, texts = defaultdict(dict), defaultdict(list)
    for line in open(out / "metrics.jsonl"):
        record = json.loads(line)
        values[record["step"]] |= numbers(record)
        texts[record["step"]] += [sample_text(s) for s in record.get("samples", [])]
    return dict(values), {k: v for k, v in texts.items() if v}


def test_tensorboard_holds_the_metrics(tiny_dir, tmp_path):
    run(args(tiny_dir, tmp_path, *FLAGS, "--log=tensorboard"))
    (logdir,) = glob.glob(str(tmp_path / "out" / "tensorboard" / "*"))  # one run per launch
    events = EventAccumulator(logdir, size_guidance={"tensors": 0})
    events.Reload()
    logged, texts = defaultdict(dict), defaultdict(list)
    for tag in events.Tags()["tensors"]:
        plugin = events.SummaryMetadata(tag).plugin_data.plugin_name
        for e in events.Tensors(tag):
            value = make_ndarray(e.tensor_proto).item()
            if plugin == "scalars":
                logged[e.step][tag] = value
            else:  # add_text("samples/0", ...) is stored under "samples/0/text_summary"
                texts[e.step].append(value.decode())
    values, samples = metrics(tmp_path / "out")
    assert dict(logged) == values and set(values) == {0, 1, 2, 3}
    assert dict(texts) == samples and set(samples) == {0, 2, 3}
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "supervised_per_s", "mfu", "adapters/mean"} <= set(values[2])


def offline_wandb(tmp_path, monkeypatch):
    """W&B offline, with its cache, data and config folders in tmp_path and neither WANDB_PROJECT nor WANDB_DIR set."""
    for name in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):  # nothing outside tmp_path
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_PROJECT", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)


def run_records(path):
    """The records of a W&B run file, read back with wandb's own reader."""
    inspect = subprocess.run(["wandb", "leet", "inspect", "--json", path], capture_output=True, text=True, check=True)
    return [json.loads(line) for line in inspect.stdout.splitlines() if line.startswith("{")]


def test_wandb_holds_the_metrics_and_the_config(tiny_dir, tmp_path, monkeypatch):
    offline_wandb(tmp_path, monkeypatch)
    argv = args(tiny_dir, tmp_path, *FLAGS, "--log=wandb")
    run(argv)
    (path,) = glob.glob(str(tmp_path / "out" / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = run_records(path)
    rows = defaultdict(dict)
    for r in records:
        if r["type"] == "history":
            rows[r["history"]["step"]["num"]] |= r["history"]["item"]
    values, samples = metrics(tmp_path / "out")
    for step, want in values.items():
        assert {k: v for k, v in rows[step].items() if k in want} == want, step
    table = rows[3]["samples.path"]  # the table of every answer so far, a file of the run (the reader flattens keys)
    data = json.load(open(os.path.join(os.path.dirname(path), "files", table)))["data"]
    answers = [t for step in sorted(samples) for t in samples[step]]
    assert [sample_text(dict(prompt=p, answer=a)) for _, p, a in data] == answers
    (config,) = [r["run"]["config"]["update"] for r in records if r["type"] == "run"]
    cfg = load_config(train.Config, argv)
    want = json.loads(json.dumps(dataclasses.asdict(cfg)))
    assert {k: config[k] for k in want} == want | {"out_dir": str(tmp_path / "out")}


@pytest.mark.parametrize("environment", [False, True])
def test_wandb_keeps_the_project_and_folder_the_environment_sets(tmp_path, monkeypatch, environment):
    """With WANDB_PROJECT and WANDB_DIR set, the run goes to that project and its files under that folder; without
    them, to the project nanoqlora and under out_dir."""
    offline_wandb(tmp_path, monkeypatch)
    if environment:
        monkeypatch.setenv("WANDB_PROJECT", "their-project")
        monkeypatch.setenv("WANDB_DIR", str(tmp_path / "their-folder"))
        (tmp_path / "their-folder").mkdir()
    tracker = WandB(load_config(train.Config, [f"--out_dir={tmp_path / 'out'}", "--log=wandb"]))
    tracker.log({"step": 1, "loss": 2.5})
    tracker.close()
    folder = tmp_path / ("their-folder" if environment else "out")
    (path,) = glob.glob(str(tmp_path / "*" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert path.startswith(str(folder / "wandb"))
    (project,) = [r["run"]["project"] for r in run_records(path) if r["type"] == "run"]
    assert project == ("their-project" if environment else "nanoqlora")


def test_a_tracker_that_is_not_installed_is_one_line(tiny_dir, tmp_path, monkeypatch, capsys):
    installed = optional.installed
    monkeypatch.setattr(optional, "installed", lambda name: name != "wandb" and installed(name))
    err = one_line_error(args(tiny_dir, tmp_path, "--log=wandb"), capsys)
    assert err == "error: log: wandb needs the wandb package (pip install wandb); or leave log empty"
