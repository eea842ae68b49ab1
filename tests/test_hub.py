"""support/formats/hub.py: models and datasets by Hub id, through huggingface_hub's own cache (no network: a stand-in
Hub on localhost, tests/fake_hub.py, at HF_ENDPOINT).

- train.py given a model id and a dataset id fetches, into HF_HOME, only the model's config, safetensors and tokenizer
  files and the dataset's data file, laid out by huggingface_hub itself; then with HF_HUB_OFFLINE=1 and the Hub gone
  the same ids resolve to that cache and train to the same losses;
- a dataset with train and test files takes its train files; a named file in a dataset repo is fetched alone; a missing
  local path (its first folder is here, or a data file's name) and a name the Hub cannot hold are one line each, never
  sent to the Hub;
- one line each, naming the repo and what to do: a repo absent from the cache offline, a gated repo (401 as the Hub
  answers one whose licence is not accepted), a missing repo (404), a model without safetensors weights; offline
  after --plan (which fetched config.json alone), that the weights were never downloaded;
- a local directory named like a Hub id wins over the Hub, and the output says so;
- a sharded model fetches its index first, then the shards it names, and no other weights (a consolidated.safetensors
  beside them, as Mistral's repos hold one, is never fetched).
"""

import json
import os
import shutil
import subprocess
import sys

import huggingface_hub
import pytest
from conftest import ROOT, instruction_jsonl
from fake_hub import FakeHub
from safetensors.torch import load, save
from test_train import args, one_line_error, run

from support.data.examples import stdlib_examples
from support.formats import hub
from support.formats.hf import Checkpoint


def sharded(files):
    """The files of a model directory with its model.safetensors split into two shards and their index, plus a
    consolidated.safetensors holding every tensor again (as Mistral's repos ship one, for another loader)."""
    state = load(files["model.safetensors"])
    names = sorted(state)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    index = {"metadata": {}, "weight_map": {n: shard for shard, ns in shards.items() for n in ns}}
    out = {k: v for k, v in files.items() if k != "model.safetensors"} | {"consolidated.safetensors": save(state)}
    out |= {shard: save({n: state[n] for n in ns}) for shard, ns in shards.items()}
    return out | {"model.safetensors.index.json": json.dumps(index).encode()}


@pytest.fixture(scope="module")
def fake_hub(tiny_dir):
    """A model repo (the files of a tiny Llama, plus a README and a .bin copy that training never reads), the same
    model in two shards beside a consolidated.safetensors, a dataset repo with one JSONL file, one with train and test
    files, a gated model and a model with only .bin weights."""
    files = {f: open(os.path.join(tiny_dir, f), "rb").read() for f in os.listdir(tiny_dir)}
    extras = {"README.md": b"# tiny", "pytorch_model.bin": files["model.safetensors"]}
    code = instruction_jsonl(stdlib_examples("train")[:64]).encode()
    split = {"data/train.jsonl": code, "data/test.jsonl": instruction_jsonl(stdlib_examples("val")[:8]).encode()}
    no_safetensors = {k: v for k, v in (files | extras).items() if k != "model.safetensors"}
    server = FakeHub({
        ("model", "acme/tiny"): {"files": files | extras, "gated": False},
        ("model", "acme/sharded"): {"files": sharded(files), "gated": False},
        ("dataset", "acme/code"): {"files": {"code.jsonl": code, "README.md": b"#"}, "gated": False},
        ("dataset", "acme/split"): {"files": split, "gated": False},
        ("dataset", "acme/words"): {"files": {"unconstrained.jsonl": code, "main.jsonl": code}, "gated": False},
        ("model", "acme/gated"): {"files": files, "gated": True},
        ("model", "acme/bin-only"): {"files": no_safetensors, "gated": False},
    })  # fmt: skip
    yield server
    server.close()


def train_py(argv, env):
    proc = subprocess.run([sys.executable, "train.py", *argv], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_ids_download_once_then_train_offline(fake_hub, tmp_path):
    home = tmp_path / "hf"
    online = {**os.environ, "HF_HOME": str(home), "HF_ENDPOINT": fake_hub.url}
    argv = ["configs/tiny.py", "--model=acme/tiny", "--data=acme/code", "--device=cpu", "--eval_every=0"]
    printed = train_py([*argv, f"--out_dir={tmp_path / 'a'}", f"--cache_dir={tmp_path / 'cache'}"], online)
    snapshot = home / "hub" / "models--acme--tiny" / "snapshots"
    (commit,) = os.listdir(snapshot)
    assert f"model: acme/tiny from the Hugging Face cache ({snapshot / commit})" in printed
    assert "data: acme/code from the Hugging Face cache (code.jsonl)" in printed
    assert (
        sorted(fake_hub.fetched)
        == sorted([f"acme/tiny/{f}" for f in os.listdir(snapshot / commit)] + ["acme/code/code.jsonl"])
        and "acme/tiny/pytorch_model.bin" not in fake_hub.fetched
    )  # only what training reads
    offline = {**online, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing listens there
    train_py([*argv, f"--out_dir={tmp_path / 'b'}", f"--cache_dir={tmp_path / 'cache'}"], offline)
    losses = [[json.loads(x)["loss"] for x in open(tmp_path / d / "metrics.jsonl") if '"loss"' in x] for d in "ab"]
    assert losses[0] == losses[1] and len(losses[0]) == 4


@pytest.mark.parametrize("listing", ["kept", "lost"])
def test_offline_after_plan_the_weights_were_never_downloaded(hub_here, tmp_path, listing):
    """--plan fetches config.json alone; an offline run after it says, in one line, that the weights were never
    downloaded and how to get them, whether huggingface_hub kept the repo's file listing in its cache (it then knows
    what is missing) or has none (older releases keep none). The plan runs in this process (hub_here), the offline run
    in a fresh one, as a user's next command: huggingface_hub also keeps the listing in memory."""
    cache, argv = tmp_path / "hf-cache", ["configs/tiny.py", "--model=acme/tiny", "--device=cpu"]
    assert run([*argv, f"--out_dir={tmp_path / 'plan'}", "--plan=24GB"]) == []
    assert sorted(os.listdir(next((cache / "models--acme--tiny" / "snapshots").iterdir()))) == ["config.json"]
    if listing == "lost":
        shutil.rmtree(cache / "models--acme--tiny" / "trees", ignore_errors=True)
    offline = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
    command = [sys.executable, "train.py", *argv, f"--out_dir={tmp_path / 'out'}"]
    proc = subprocess.run(command, cwd=ROOT, env=offline, capture_output=True, text=True)  # nothing listens at :9
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1:] == [
        "error: model: acme/tiny: its weights were never downloaded (the Hugging Face cache holds only config.json of "
        "it) and the Hub cannot be reached (HF_HUB_OFFLINE is set); run `hf download acme/tiny` where there is a "
        "network, or give a local path"
    ], proc.stderr[-3000:]


@pytest.fixture
def hub_here(fake_hub, tmp_path, monkeypatch):
    """huggingface_hub pointed at the stand-in Hub, with an empty cache, in this process (it reads its environment
    at import, so its constants are set instead)."""
    constants = huggingface_hub.constants
    monkeypatch.setattr(constants, "ENDPOINT", fake_hub.url)
    template = fake_hub.url + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return constants


def test_a_dataset_takes_its_train_files_or_the_named_one(hub_here, fake_hub):
    """A dataset's files named train (as a word of the path: not "unconstrained") are its training files; else all of
    its data files; a named file is fetched alone."""
    assert [os.path.basename(f) for f in hub.data_files("acme/split")] == ["train.jsonl"]
    assert "acme/split/data/test.jsonl" not in fake_hub.fetched
    assert [os.path.basename(f) for f in hub.data_files("acme/split/data/test.jsonl")] == ["test.jsonl"]
    assert [os.path.basename(f) for f in hub.data_files("acme/words")] == ["main.jsonl", "unconstrained.jsonl"]


def test_hub_failures_are_one_line(hub_here, tiny_dir, tmp_path, capsys, monkeypatch):
    def error(model):
        return one_line_error(args(tiny_dir, tmp_path, f"--model={model}"), capsys)

    assert error("acme/gated") == (
        "error: model: acme/gated is gated: accept its licence on https://huggingface.co/acme/gated, then log in with "
        "`hf auth login` (or set HF_TOKEN)"
    )
    assert error("acme/nope") == (
        "error: model: acme/nope is not a model on the Hugging Face Hub, or it is private: log in with `hf auth "
        "login`, or give a local path"
    )
    assert error("acme/bin-only").startswith("error: model: acme/bin-only has no safetensors weights on the Hub")
    monkeypatch.setattr(hub_here, "HF_HUB_OFFLINE", True)
    assert error("acme/elsewhere") == (
        f"error: model: acme/elsewhere is not in the Hugging Face cache ({hub_here.HF_HUB_CACHE}) and the Hub cannot "
        "be reached (HF_HUB_OFFLINE is set); run `hf download acme/elsewhere` where there is a network, or give a "
        "local path"
    )


def test_a_missing_local_path_is_never_sent_to_the_hub(hub_here, fake_hub, tiny_dir, tmp_path, capsys):
    """A path whose first folder is here (checkpoints/X), a file name with a data suffix, and a name the Hub cannot
    hold are one line each, without a request to the Hub."""
    asked = len(fake_hub.fetched)
    err = one_line_error(args(tiny_dir, tmp_path, "--model=tests/no-such-model"), capsys)
    assert err == "error: model: tests/no-such-model: no such directory (expected a model directory or a Hub id)"
    err = one_line_error(args(tiny_dir, tmp_path, "--data=data/mine.jsonl"), capsys)
    assert err == "error: data: data/mine.jsonl: no such file (expected a data file or a Hub dataset id)"
    err = one_line_error(args(tiny_dir, tmp_path, "--model=acme/b--c"), capsys)
    assert err.startswith("error: model: acme/b--c is neither a local path nor a valid Hub id (")
    assert len(fake_hub.fetched) == asked


def test_a_sharded_model_fetches_its_index_then_the_shards_it_names(hub_here, fake_hub, tiny_dir):
    """A repo with an index, two shards and a consolidated.safetensors: its weights fetched are the index and the two
    shards, and they hold every tensor of the model."""
    asked = len(fake_hub.fetched)
    path = hub.model_dir("acme/sharded")
    weights = sorted(f for f in fake_hub.fetched[asked:] if "safetensors" in f)
    shards = [f"acme/sharded/model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    assert weights == [*shards, "acme/sharded/model.safetensors.index.json"]
    assert set(Checkpoint(path).keys()) == set(Checkpoint(tiny_dir).keys())


def test_a_local_directory_named_like_an_id_wins(tiny_dir, tmp_path, capsys, monkeypatch):
    (tmp_path / "acme").mkdir()
    shutil.copytree(tiny_dir, tmp_path / "acme" / "tiny")
    monkeypatch.chdir(tmp_path)
    assert hub.model_dir("acme/tiny") == "acme/tiny"
    assert "model: acme/tiny is a directory here: using it, not the Hub repo of that name" in capsys.readouterr().out
