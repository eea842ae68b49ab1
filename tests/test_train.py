"""What this file proves about train.py, on a tiny random Llama that shares SmolLM2's tokenizer:

- config files and --key=value overrides load; a typo names the nearest valid key; a wrong type is refused;
- gradient accumulation over micro-batches gives the same update as one batch (1e-6, fp32), although the micro-batches
  hold different numbers of supervised tokens, because the loss is normalised by the global supervised-token count;
- a run interrupted at step 2 and resumed reaches the same losses and the same adapter bytes as an uninterrupted run;
- torchrun with 2 CPU processes (gloo) gives the same losses as one process with the same global batch;
- a config typo, a missing data file, an unwritable out_dir, a corrupted checkpoint and a NaN loss each end with a
  one-line error and leave the existing checkpoint untouched;
- the real SmolLM2 QLoRA run lowers the validation loss and writes a PEFT adapter, a loss plot and metrics.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import train
from examples import stdlib_examples
from hf import load_model, read_config
from model import Llama, LlamaConfig
from pack import PackedDataset, build_dataset
from tokenizer import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_dir(smollm2_dir, tmp_path_factory):
    """A 2-layer random Llama with SmolLM2's vocabulary, tokenizer files and chat template."""
    out = tmp_path_factory.mktemp("tiny-llama")
    src, _ = read_config(smollm2_dir)
    cfg = LlamaConfig.from_hf(
        {
            **src.to_hf(),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
        }
    )
    torch.manual_seed(0)
    model = Llama(cfg)
    with torch.no_grad():
        for p in model.parameters():  # the usual N(0, 0.02) init, norms at 1: a model with sane logits
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    from safetensors.torch import save_file

    state = {
        k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight" or not cfg.tie_word_embeddings
    }
    save_file(state, os.path.join(out, "model.safetensors"))
    json.dump(cfg.to_hf(), open(os.path.join(out, "config.json"), "w"))
    for name in os.listdir(smollm2_dir):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            shutil.copy(os.path.join(smollm2_dir, name), out)
    return str(out)


def args(tiny_dir, tmp_path, *extra):
    return [
        "configs/tiny.py",
        f"--model={tiny_dir}",
        f"--out_dir={tmp_path / 'out'}",
        f"--cache_dir={tmp_path / 'cache'}",
        *extra,
    ]


def run(argv):
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return train.fit(train.load_config(argv))
    finally:
        os.chdir(cwd)


def adapter(tmp_path):
    return load_file(os.path.join(tmp_path, "out", "adapter", "adapter_model.safetensors"))


def test_config_file_overrides_and_typos(tmp_path):
    cfg = train.load_config([os.path.join(ROOT, "configs/tiny.py"), "--lr=3e-4", "--pack=False", "--model=some/dir"])
    assert (cfg.lr, cfg.pack, cfg.model, cfg.context_length) == (3e-4, False, "some/dir", 128)
    with pytest.raises(ValueError, match="--lora_alpah: unknown config key 'lora_alpah'; did you mean 'lora_alpha'"):
        train.load_config(["--lora_alpah=1"])
    with pytest.raises(ValueError, match="--max_steps: 'max_steps' must be int"):
        train.load_config(["--max_steps=abc"])
    bad = tmp_path / "bad.py"
    bad.write_text("lora_rank = 8\n")
    with pytest.raises(ValueError, match=f"{bad}: unknown config key 'lora_rank'; did you mean 'lora_r'"):
        train.load_config([str(bad)])


def test_accumulation_equals_one_batch(tiny_dir, tmp_path):
    one = tmp_path / "one"
    many = tmp_path / "many"
    run(args(tiny_dir, one, "--max_steps=1", "--micro_batch_tokens=512", "--eval_every=0"))
    run(args(tiny_dir, many, "--max_steps=1", "--micro_batch_tokens=128", "--eval_every=0"))
    a, b = adapter(one), adapter(many)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)
    # the update is not trivially zero, and the micro-batches really held different supervised counts
    assert any(v.abs().max() > 0 for k, v in a.items() if "lora_B" in k)


def test_resume_is_step_exact(tiny_dir, tmp_path, monkeypatch):
    full = run(args(tiny_dir, tmp_path / "full"))
    real_step_batch = PackedDataset.step_batch

    def interrupt_at_2(ds, step, *a):
        if step == 2:
            raise KeyboardInterrupt
        return real_step_batch(ds, step, *a)

    monkeypatch.setattr(PackedDataset, "step_batch", interrupt_at_2)
    with pytest.raises(SystemExit):
        run(args(tiny_dir, tmp_path / "resumed"))
    assert torch.load(tmp_path / "resumed" / "out" / "checkpoint.pt", weights_only=False)["step"] == 2
    monkeypatch.setattr(PackedDataset, "step_batch", real_step_batch)
    resumed = run(args(tiny_dir, tmp_path / "resumed", "--resume"))
    losses = lambda h: [(r["step"], r["loss"]) for r in h if "loss" in r]  # noqa: E731
    assert losses(resumed) == losses(full)
    a = open(tmp_path / "full" / "out" / "adapter" / "adapter_model.safetensors", "rb").read()
    b = open(tmp_path / "resumed" / "out" / "adapter" / "adapter_model.safetensors", "rb").read()
    assert a == b


def test_torchrun_two_processes_match_one(tiny_dir, tmp_path):
    run(args(tiny_dir, tmp_path / "single", "--eval_every=0", "--micro_batch_tokens=256"))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_port=29517",
        "train.py",
        *args(tiny_dir, tmp_path / "ddp", "--eval_every=0", "--micro_batch_tokens=256"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    read = lambda d: [json.loads(x)["loss"] for x in open(d / "out" / "metrics.jsonl") if '"loss"' in x]  # noqa: E731
    single, ddp = read(tmp_path / "single"), read(tmp_path / "ddp")
    assert len(single) == len(ddp) == 4
    for s, d in zip(single, ddp, strict=True):
        assert abs(s - d) < 1e-5, (single, ddp)


def one_line_error(argv, capsys):
    capsys.readouterr()  # drop what earlier runs printed
    with pytest.raises(SystemExit) as e:
        cwd = os.getcwd()
        os.chdir(ROOT)
        try:
            train.main(argv)
        finally:
            os.chdir(cwd)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after whatever the progress bar drew
    assert err.startswith("error: "), err
    return err


def test_bad_input_gives_one_line_errors_and_keeps_checkpoints(tiny_dir, tmp_path, capsys):
    run(args(tiny_dir, tmp_path, "--max_steps=2", "--eval_every=0"))
    ckpt = tmp_path / "out" / "checkpoint.pt"
    before = ckpt.read_bytes()
    assert "did you mean 'max_steps'" in one_line_error(args(tiny_dir, tmp_path, "--max_step=3"), capsys)
    assert "missing.jsonl" in one_line_error(args(tiny_dir, tmp_path, "--data=missing.jsonl"), capsys)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.access(ro, os.W_OK):  # root ignores permissions: use a path below a regular file instead
        ro = tmp_path / "file"
        ro.write_text("x")
    assert "out_dir" in one_line_error(args(tiny_dir, tmp_path, f"--out_dir={ro / 'sub'}"), capsys)
    assert ckpt.read_bytes() == before
    corrupt = tmp_path / "corrupt"
    (corrupt / "out").mkdir(parents=True)
    (corrupt / "out" / "checkpoint.pt").write_bytes(before[: len(before) // 3])
    err = one_line_error(args(tiny_dir, corrupt, "--max_steps=4", "--resume"), capsys)
    assert "corrupted checkpoint" in err and "checkpoint.pt" in err
    assert (corrupt / "out" / "checkpoint.pt").read_bytes() == before[: len(before) // 3]
    assert ckpt.read_bytes() == before


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tiny_dir, tmp_path, monkeypatch, capsys):
    run(args(tiny_dir, tmp_path, "--max_steps=2", "--eval_every=0"))
    ckpt = tmp_path / "out" / "checkpoint.pt"
    before = ckpt.read_bytes()
    real = train.forward_loss

    def nan_loss(*a):
        loss, n = real(*a)
        return loss * float("nan"), n

    monkeypatch.setattr(train, "forward_loss", nan_loss)
    err = one_line_error(args(tiny_dir, tmp_path, "--max_steps=4", "--resume"), capsys)
    assert "loss is nan at step 3" in err
    assert ckpt.read_bytes() == before


def test_smollm2_qlora_run_lowers_val_loss(smollm2_dir, tmp_path):
    out = tmp_path / "out"
    history = run(
        [
            "--max_steps=8",
            "--eval_every=8",
            "--eval_rows=8",
            "--max_examples=400",
            "--context_length=256",
            "--batch_tokens=1024",
            "--warmup_steps=2",
            "--sample=False",
            f"--out_dir={out}",
            f"--cache_dir={tmp_path / 'cache'}",
        ]
    )
    vals = [h["val_loss"] for h in history if "val_loss" in h]
    assert len(vals) == 2 and vals[1] < vals[0] - 0.05, vals
    assert (out / "adapter" / "adapter_config.json").exists() and (out / "loss.png").exists()
    assert len(open(out / "metrics.jsonl").readlines()) == 9


def test_evaluate_covers_exactly_the_requested_rows(tiny_dir):
    model = load_model(tiny_dir)
    valset = build_dataset(stdlib_examples("val")[:60], Tokenizer(tiny_dir), 128)
    assert len(valset) > 10
    run = train.Run(train.Config(), 0, 1, torch.device("cpu"), torch.float32)
    got = train.evaluate(model, valset, 10, run)  # batches of 4, 4 and 2 rows
    with torch.no_grad():
        loss, n = model(**{k: v for k, v in valset.collate(range(10)).items()})
    assert abs(got - loss.item() / n) < 1e-5
