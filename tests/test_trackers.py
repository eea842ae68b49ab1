"""support/trackers.py: a short run's records reach TensorBoard and W&B exactly as they reach metrics.jsonl.

- TensorBoard: the event files, read back with tensorboard's own reader (EventAccumulator), hold every number of every
  record of metrics.jsonl at its step, exactly (double-precision scalars), and each evaluation's held-out answers as
  text.
- W&B, offline (no API key): the run file, read back with wandb's own reader (`wandb leet inspect --json`), holds the
  same numbers at the same steps, the Config as the run's config, and the answers in a table.
- Asking for a tracker whose package is not installed is one line saying what to pip install.
"""

import dataclasses
import glob
import json
import os
import subprocess
from collections import defaultdict

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util.tensor_util import make_ndarray
from test_train import args, one_line_error, run

import train
from support import optional
from support.config import load_config
from support.trackers import numbers, sample_text

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


def test_wandb_holds_the_metrics_and_the_config(tiny_dir, tmp_path, monkeypatch):
    for name in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):  # nothing outside tmp_path
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    argv = args(tiny_dir, tmp_path, *FLAGS, "--log=wandb")
    run(argv)
    (path,) = glob.glob(str(tmp_path / "out" / "wandb" / "offline-run-*" / "run-*.wandb"))
    inspect = subprocess.run(["wandb", "leet", "inspect", "--json", path], capture_output=True, text=True, check=True)
    records = [json.loads(line) for line in inspect.stdout.splitlines() if line.startswith("{")]
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


def test_a_tracker_that_is_not_installed_is_one_line(tiny_dir, tmp_path, monkeypatch, capsys):
    installed = optional.installed
    monkeypatch.setattr(optional, "installed", lambda name: name != "wandb" and installed(name))
    err = one_line_error(args(tiny_dir, tmp_path, "--log=wandb"), capsys)
    assert err == "error: log: wandb needs the wandb package (pip install wandb); or leave log empty"
