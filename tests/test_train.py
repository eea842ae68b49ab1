"""What this file proves about train.py, end to end, on a tiny random Llama that shares SmolLM2's tokenizer:

- gradient accumulation over micro-batches gives the same update as one batch (1e-11 in float64, a bound derived in
  the test), although the micro-batches hold different numbers of supervised tokens, because the loss is normalised
  by the global supervised-token count;
- a run interrupted at step 2 (Ctrl-C lets the step finish) and resumed reaches the same losses and the same adapter
  bytes as an uninterrupted run, with LoRA dropout on (its randomness is a function of the step, so nothing random
  needs saving); a second Ctrl-C stops at once and writes nothing;
- torchrun with 2 CPU processes (gloo) gives the same losses and gradient norms as one process with the same global
  batch, dropout on; a global batch the ranks cannot share equally is refused in one line;
- blocks through torch.compile train with the MLP in tiles, with the eager run's losses;
- on a GPU (simulated) setup leaves fp32 matmuls in fp32 unless tf32 asks for TF32;
- a config typo, a value out of range, a missing data file, an unwritable out_dir, a corrupted checkpoint, a resume
  with changed optimizer or data settings, a NaN loss, a non-finite gradient (never applied), an 8-bit optimizer
  without bitsandbytes and a wrong merge each end with a one-line error and leave the existing checkpoint untouched;
  a folder holding only a finished run's adapter is still a run;
- the real SmolLM2 QLoRA run lowers the validation loss and writes a PEFT adapter, a loss plot and metrics, and prints
  the memory estimate beside the measured peak;
- on CPU and, where there is one, on a GPU: a bf16 QLoRA step gives the fp32 step's loss and LoRA gradients within
  bf16 rounding, and make_optimizer's AdamW (fused on CUDA) equals torch's single-tensor loop;
- on a GPU only: the micro-batch probe under a capped memory fraction picks a size that trains while one row more
  does not fit, and train.py runs end to end on a random 1B-shaped Llama (loss falls, resume, PEFT and merged export).

The pieces train.py calls are tested in their own files: test_config.py, test_choice.py, test_flops.py,
test_plan.py (the micro-batch probe), test_run_dir.py, test_merge_check.py.
"""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from conftest import TINY, fixed_outcome_problems, free_port, random_model_dir, threads_env
from safetensors.torch import load_file

import quant
import train
from pack import PackedDataset, build_dataset
from support.accounting import memory, plan
from support.accounting.flops import flops_per_token
from support.data.examples import stdlib_examples
from support.data.tokenizer import Tokenizer
from support.formats import atomic
from support.formats.hf import read_config
from support.kernels import choice, dropout
from support.run import optional, progress, ranks, run_dir
from support.run.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRECISIONS = (torch.bfloat16, torch.float32)


def args(tiny_dir, tmp_path, *extra):
    return [
        "configs/tiny.py",
        f"--model={tiny_dir}",
        f"--out_dir={tmp_path / 'out'}",
        f"--cache_dir={tmp_path / 'cache'}",
        "--device=cpu",  # exact-equality proofs: on a GPU machine too, where the GPU tests are further down
        *extra,
    ]


def run(argv):
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return train.train(load_config(train.Config, argv))
    finally:
        os.chdir(cwd)


def test_accumulation_equals_one_batch(tiny_dir):
    """One step of 4 rows as one micro-batch and as 4 micro-batches of one row gives the same adapters. In float64: the
    two orders of summation then differ by about 1e-16 of a gradient's scale, and AdamW's first step, lr * g / (|g| +
    eps), magnifies a gradient difference d by at most lr * d / eps (for g near zero), 1e-3 * 1e-16 / 1e-8 = 1e-11;
    a normalisation by each micro-batch's own count instead of the global one moves them by about lr * 10%. In fp32
    the same bound is lr * 6e-8 / 1e-8, larger than the update itself, so fp32 cannot show exactness this way."""
    cfg = train.Config(model=tiny_dir, lora_r=4, lora_alpha=8.0, lora_dropout=0.0, lr=1e-3)
    place = ranks.Placement(0, 1, torch.device("cpu"), torch.float64)
    tok = Tokenizer(tiny_dir)
    batch = build_dataset(stdlib_examples("train")[:64], tok, 128).step_batch(0, 4)
    counts = [int((row != -100).sum()) for row in batch["labels"]]
    assert len(set(counts)) > 1, counts  # the micro-batches hold different numbers of supervised tokens
    adapters = []
    for micro_rows in (4, 1):
        torch.manual_seed(0)
        lora = dict(targets="all-linear", r=4, alpha=8.0, dropout=0.0, lora_dtype=torch.float64)
        model = train.load_model(tiny_dir, torch.float64, quantize=True, add_lora=lora)
        params = [p for p in model.parameters() if p.requires_grad]
        opt, scaler = train.make_optimizer(cfg, params, place.device), torch.amp.GradScaler("cuda", enabled=False)
        train.train_step(model, opt, scaler, batch, micro_rows, 0, cfg, place)
        adapters.append([p.detach().clone() for p in params])
    for a, b in zip(*adapters, strict=True):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=0)
    assert max(float(p.abs().max()) for p in adapters[0][1::2]) > 1e-4  # every B moved from zero: a real update


def test_a_step_without_dropout_makes_no_keys_and_draws_no_mask(tiny_dir, monkeypatch):
    """lora_dropout=0: the adapters hold nn.Identity and train_step computes no row keys; with every part of the keyed
    dropout made to fail, the step still trains (and with dropout on, the same patch stops it, so it is reached)."""
    tok = Tokenizer(tiny_dir)
    batch = build_dataset(stdlib_examples("train")[:64], tok, 128).step_batch(0, 2)
    place = ranks.Placement(0, 1, torch.device("cpu"), torch.float32)

    def fail(*args, **kwargs):
        raise AssertionError("the keyed dropout ran")

    for name in ("mix64_", "keyed_dropout"):
        monkeypatch.setattr(dropout, name, fail)
    monkeypatch.setattr("lora.row_keys", fail)  # lora.row_dropout makes the keys
    for p in (0.0, 0.1):
        cfg = train.Config(model=tiny_dir, lora_r=2, lora_alpha=4.0, lora_dropout=p)
        lora = dict(targets="all-linear", r=2, alpha=4.0, dropout=p, lora_dtype=torch.float32)
        model = train.load_model(tiny_dir, torch.float32, add_lora=lora)
        params = [q for q in model.parameters() if q.requires_grad]
        opt, scaler = train.make_optimizer(cfg, params, place.device), torch.amp.GradScaler("cuda", enabled=False)
        if p == 0:
            record = train.train_step(model, opt, scaler, batch, 2, 0, cfg, place)
            assert math.isfinite(record["loss"]) and record["grad_norm"] > 0
        else:
            with pytest.raises(AssertionError, match="the keyed dropout ran"):
                train.train_step(model, opt, scaler, batch, 2, 0, cfg, place)


def test_compiled_blocks_train_with_mlp_tiles(tiny_dir, tmp_path):
    """--compile with the MLP in tiles (dynamo once failed on the tiles' checkpoints inside a compiled block): two
    steps with the eager run's losses, within fp32 rounding."""
    tiles = ["--max_steps=2", "--eval_every=0", "--save_every=0", "--mlp_tile_tokens=32"]
    eager = run(args(tiny_dir, tmp_path / "eager", *tiles))
    compiled = run(args(tiny_dir, tmp_path / "compiled", *tiles, "--compile=True"))
    losses = [[r["loss"] for r in history if "loss" in r] for history in (eager, compiled)]
    assert len(losses[0]) == 2
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def run_interrupted(argv, at_step, monkeypatch, presses=1):
    """Run train.py as if Ctrl-C were pressed `presses` times while step `at_step` (1-based) fetches its batch: once,
    the run finishes that step, writes a checkpoint and exits; twice, it stops at once."""
    real_step_batch = PackedDataset.step_batch

    def interrupt(ds, step, *a):
        for _ in range(presses if step == at_step - 1 else 0):
            signal.raise_signal(signal.SIGINT)
        return real_step_batch(ds, step, *a)

    with monkeypatch.context() as m, pytest.raises(SystemExit) as e:
        m.setattr(PackedDataset, "step_batch", interrupt)
        run(argv)
    assert e.value.code == 130


def test_resume_is_step_exact(tiny_dir, tmp_path, monkeypatch, capsys):
    full = run(args(tiny_dir, tmp_path / "full", "--lora_dropout=0.1"))
    run_interrupted(args(tiny_dir, tmp_path / "resumed", "--lora_dropout=0.1"), 2, monkeypatch)
    out = tmp_path / "resumed" / "out"
    assert (
        f"interrupted: checkpoint at step 2 written; continue with --resume --out_dir={out}" in capsys.readouterr().out
    )
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == 2
    last = [json.loads(x) for x in open(out / "metrics.jsonl")][-1]  # the interrupted step's record, without the
    assert last["step"] == 2 and "val_loss" not in last  # evaluation due then: stopping comes first
    assert "val_loss" in next(h for h in full if h["step"] == 2 and "loss" in h)
    resumed = run(args(tiny_dir, tmp_path / "resumed", "--lora_dropout=0.1", "--resume"))
    losses = lambda h: [(r["step"], r["loss"]) for r in h if "loss" in r]  # noqa: E731
    assert losses(resumed) == losses(full)
    a = open(tmp_path / "full" / "out" / "adapter" / "adapter_model.safetensors", "rb").read()
    b = open(out / "adapter" / "adapter_model.safetensors", "rb").read()
    assert a == b


def test_a_resumed_run_takes_up_its_own_schedule(tiny_dir, tmp_path):
    """Resumed with a new max_steps, every later step's learning rate is the new schedule's, as a fresh run with that
    max_steps has it: the schedule is a function of the step (the checkpoint holds none). Resumed with a max_steps it
    has passed already, it takes no step and ends."""
    run(args(tiny_dir, tmp_path / "a", "--max_steps=2", "--eval_every=0"))
    resumed = run(args(tiny_dir, tmp_path / "a", "--max_steps=6", "--eval_every=0", "--resume"))
    fresh = run(args(tiny_dir, tmp_path / "b", "--max_steps=6", "--eval_every=0"))
    lrs = lambda history: [(r["step"], r["lr"]) for r in history if "lr" in r and r["step"] > 2]  # noqa: E731
    assert lrs(resumed) == lrs(fresh) and len(lrs(fresh)) == 4
    done = run(args(tiny_dir, tmp_path / "a", "--max_steps=4", "--eval_every=0", "--resume"))
    assert [r["step"] for r in done if "loss" in r] == [1, 2, 3, 4, 5, 6]


def test_mfu_counts_attention_per_document(tiny_dir, tmp_path, monkeypatch):
    """Each step's record holds the model FLOPs of the rows it trained on, attention counted per packed document (a
    document of n tokens: n x flops_per_token at n; found here by walking the position ids), and its MFU is those
    FLOPs over the step's time over the peak: the count the benchmarks use, not one at context_length per row."""
    batches, real_step_batch = [], PackedDataset.step_batch
    monkeypatch.setattr(PackedDataset, "step_batch", lambda *a: batches.append(real_step_batch(*a)) or batches[-1])
    monkeypatch.setattr(progress, "peak_flops", lambda device, dtype: (1e9, "measured"))
    history = run(args(tiny_dir, tmp_path, "--max_steps=2", "--eval_every=0", "--save_every=0"))
    config = read_config(tiny_dir)[0]
    steps = [r for r in history if "mfu" in r]
    assert len(steps) == len(batches) == 2
    for record, batch in zip(steps, batches, strict=True):
        lengths = []
        for row in batch["position_ids"].tolist():
            for t, p in enumerate(row):
                lengths += [1] if p == 0 or t == 0 else []
                lengths[-1] += 0 if p == 0 or t == 0 else 1
        assert len(lengths) > len(batch["position_ids"])  # rows hold several documents
        expected = sum(n * flops_per_token(config, n) for n in lengths)
        seconds = batch["input_ids"].numel() / record["tokens_per_s"]
        assert math.isclose(record["mfu"], expected / seconds / 1e9, rel_tol=1e-9)
        assert math.isclose(record["flops"], expected, rel_tol=1e-12)


def test_ctrl_c_twice_stops_at_once_and_saves_nothing(tiny_dir, tmp_path, monkeypatch, capsys):
    """The second Ctrl-C breaks into the step: nothing of it is written, and the SIGINT handler is put back."""
    before = signal.getsignal(signal.SIGINT)
    run_interrupted(args(tiny_dir, tmp_path, "--save_every=0"), 2, monkeypatch, presses=2)
    assert "stopped at once: no checkpoint was written" in capsys.readouterr().err
    assert not (tmp_path / "out" / "checkpoint.pt").exists() and signal.getsignal(signal.SIGINT) is before


def test_torchrun_two_processes_match_one(tiny_dir, steps, one_process, tmp_path):
    """DDP over 2 gloo ranks against one process with the same global batch, LoRA dropout on: the losses and the
    gradient norms of each step within 1e-6 relative (a wrong divide factor over ranks scales every gradient
    uniformly, which AdamW's update hides and the norm shows; a mask drawn per rank moves both by percents)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    cmd += ["train.py", *args(tiny_dir, tmp_path / "ddp", *steps)]
    proc = subprocess.run(cmd, cwd=ROOT, env=threads_env(2), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    read = lambda d, key: [json.loads(x)[key] for x in open(d / "out" / "metrics.jsonl") if '"loss"' in x]  # noqa: E731
    for key in ("loss", "grad_norm"):
        single, ddp = read(one_process, key), read(tmp_path / "ddp", key)
        assert len(single) == len(ddp) == 4 and ddp == pytest.approx(single, rel=1e-6, abs=0), (key, single, ddp)


def test_a_global_batch_the_ranks_cannot_share_is_refused(tiny_dir, tmp_path, monkeypatch, capsys):
    """4 rows a step on 3 ranks are refused in one line that names the nearest batches they can share, before any
    model is loaded (the rows used to be cut to 3, a silently smaller batch)."""
    monkeypatch.setattr(ranks, "setup", lambda cfg, shard: ranks.Placement(0, 3, torch.device("cpu")))  # rank 0 of 3
    monkeypatch.setattr(train, "build_model", lambda *a: pytest.fail("a model was built"))
    assert one_line_error(args(tiny_dir, tmp_path, "--batch_tokens=512"), capsys) == (
        "error: batch_tokens: 512 makes 4 row(s) of 128 tokens, which 3 ranks cannot share equally; use "
        "--batch_tokens=384 (3 rows) or --batch_tokens=768 (6 rows)"
    )
    assert one_line_error(args(tiny_dir, tmp_path, "--batch_tokens=300"), capsys) == (
        "error: batch_tokens: 300 makes 2 row(s) of 128 tokens, which 3 ranks cannot share equally; use "
        "--batch_tokens=384 (3 rows)"
    )


def refused(argv, capsys) -> list[str]:
    """Every line main() printed for a refused run (several mistakes in a config: one line each); exit code 2."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cwd = os.getcwd()
        os.chdir(ROOT)
        try:
            train.main(argv)
        finally:
            os.chdir(cwd)
    assert e.value.code == 2
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]


def one_line_error(argv, capsys):
    lines = refused(argv, capsys)
    assert len(lines) == 1, lines
    return lines[0]


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


def test_resume_refuses_what_it_would_ignore_and_out_dir_sees_any_run(tiny_dir, tmp_path, capsys):
    """--resume with a new lr, weight decay or data setting is refused (the optimizer's saved state would silently
    keep the old values, the data would change under the step count); a broken metrics.jsonl line is named; a folder
    that holds a finished run's adapter but no checkpoint is still a run, not overwritten."""
    run(args(tiny_dir, tmp_path, "--max_steps=2", "--eval_every=0", "--eval_samples=0"))
    out = tmp_path / "out"
    for flag in ("--lr=5e-4", "--weight_decay=0.1", "--train_on_prompt=True", "--truncate=False"):
        err = one_line_error(args(tiny_dir, tmp_path, "--max_steps=4", "--resume", flag), capsys)
        assert err.startswith(f"error: {out / 'checkpoint.pt'}: checkpoint has {flag[2:].split('=')[0]}=")
    metrics = (out / "metrics.jsonl").read_text()
    (out / "metrics.jsonl").write_text(metrics + '{"step": 3, "lo')
    err = one_line_error(args(tiny_dir, tmp_path, "--max_steps=4", "--resume"), capsys)
    assert err.startswith(f"error: {out / 'metrics.jsonl'}:{metrics.count(chr(10)) + 1}: invalid JSON (")
    (out / "checkpoint.pt").unlink()
    before = (out / "adapter" / "adapter_model.safetensors").read_bytes()
    err = one_line_error(args(tiny_dir, tmp_path, "--max_steps=2", "--lora_r=4"), capsys)
    assert err.startswith(f"error: out_dir: {out} already holds a run ({out / 'adapter'})")
    assert (out / "adapter" / "adapter_model.safetensors").read_bytes() == before


def test_data_settings_that_cannot_work_are_one_line(tiny_dir, tmp_path, capsys):
    """A context longer than the model's positions (refused before any work, a --plan's too); a validation share that
    leaves nothing to train on."""
    for stop in ("--preview", "--plan=24GB"):
        err = one_line_error(args(tiny_dir, tmp_path, "--context_length=9000", "--batch_tokens=9000", stop), capsys)
        assert err == (
            "error: context_length: 9000 is beyond the model's max_position_embeddings 8192 (positions it was never "
            "trained on); lower it or use 'auto'"
        )
    (data := tmp_path / "d.jsonl").write_text('{"instruction": "a", "response": "b"}\n' * 2)
    err = one_line_error(args(tiny_dir, tmp_path, f"--data={data}", "--val_fraction=0.9", "--preview"), capsys)
    assert err == f"error: val_fraction: 0.9 of the 2 examples in {data} leaves none to train on"


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
    assert err.startswith("error: loss nan, gradient norm nan at step 3: stopped before the update; the checkpoint")
    assert err.endswith(f"of step 2 in {tmp_path / 'out'} is intact")
    assert ckpt.read_bytes() == before


class InfGrad(torch.autograd.Function):
    """The identity whose gradient is infinite: a finite loss with a non-finite gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * math.inf


@pytest.mark.parametrize("save_every", [2, 0])
def test_a_non_finite_gradient_is_never_applied_nor_saved(tiny_dir, tmp_path, monkeypatch, capsys, save_every):
    """Step 3's loss is finite but its gradient is not: the run stops before the update, the checkpoint of step 2 (if
    any was written) stays finite and the metrics up to step 3 are written; it used to apply the NaN update and save
    it over the last checkpoint at the next save."""
    steps, real_step, real_loss = [], train.train_step, train.forward_loss

    def forward_loss(*a):
        loss, n = real_loss(*a)
        return InfGrad.apply(loss) if len(steps) == 3 else loss, n

    applied, real_make = [], train.make_optimizer

    def make_optimizer(*a):  # counts the updates really applied
        opt = real_make(*a)
        opt.register_step_post_hook(lambda *_: applied.append(1))
        return opt

    monkeypatch.setattr(train, "train_step", lambda *a: steps.append(1) or real_step(*a))
    monkeypatch.setattr(train, "forward_loss", forward_loss)
    monkeypatch.setattr(train, "make_optimizer", make_optimizer)
    argv = args(tiny_dir, tmp_path, "--max_steps=4", f"--save_every={save_every}", "--eval_every=0", "--eval_samples=0")
    err = one_line_error(argv, capsys)
    out = tmp_path / "out"
    kept = f"the checkpoint of step 2 in {out} is intact" if save_every else "no checkpoint was written yet"
    assert re.fullmatch(
        rf"error: loss [0-9.]+, gradient norm (nan|inf) at step 3: stopped before the update; {kept}", err
    )
    assert [json.loads(x)["step"] for x in open(out / "metrics.jsonl")][-3:] == [1, 2, 3] and len(applied) == 2
    assert (out / "checkpoint.pt").exists() == bool(save_every)
    if save_every:
        state = torch.load(out / "checkpoint.pt", weights_only=False)
        assert state["step"] == 2 and all(bool(v.isfinite().all()) for v in state["lora"].values())


def test_smollm2_qlora_run_lowers_val_loss(smollm2_dir, tmp_path, capsys):
    """The real SmolLM2, QLoRA: validation loss falls; the adapter, the loss plot and metrics are written, and
    metrics.jsonl holds the held-out answer at the first and the last evaluation; the memory estimate by part and the
    measured peak beside it are printed."""
    out = tmp_path / "out"
    history = run(
        [
            "--max_steps=4",
            "--eval_every=4",
            "--eval_rows=4",
            "--max_examples=400",
            "--context_length=256",
            "--batch_tokens=256",
            "--warmup_steps=1",
            "--eval_samples=1",
            "--sample_tokens=8",
            f"--out_dir={out}",
            f"--cache_dir={tmp_path / 'cache'}",
        ]
    )
    vals = [h["val_loss"] for h in history if "val_loss" in h]
    assert len(vals) == 2 and vals[1] < vals[0] - 0.05, vals
    assert (out / "adapter" / "adapter_config.json").exists() and (out / "loss.png").exists()
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(records) == 6  # NF4's error and the step-0 evaluation, then 4 steps
    answered = {r["step"]: r["samples"] for r in records if "samples" in r}  # the held-out answer at each evaluation
    assert set(answered) == {0, 4} and all(len(a) == 1 and a[0]["prompt"] and a[0]["answer"] for a in answered.values())
    printed = "".join(capsys.readouterr())
    assert re.search(r"memory estimate [\d.]+ [GM]iB: weights .*, activations .*, transient ", printed)
    assert re.search(r"measured peak memory after 2 steps: [\d.]+ [GM]iB \(estimated [\d.]+ [GM]iB\)", printed)


@pytest.mark.parametrize("micro_rows", [1, 3, 4])
def test_evaluate_covers_exactly_the_requested_rows_a_micro_batch_at_a_time(tiny_dir, monkeypatch, micro_rows):
    """The mean over exactly 10 rows, whatever the batching, and no forward wider than a training micro-batch (a wider
    one would need more memory than the steps the estimate was made for)."""
    model = train.load_model(tiny_dir)
    valset = build_dataset(stdlib_examples("val")[:60], Tokenizer(tiny_dir), 128)
    assert len(valset) > 10
    place = ranks.Placement(0, 1, torch.device("cpu"), torch.float32)
    widths, forward_loss = [], train.forward_loss
    monkeypatch.setattr(train, "forward_loss", lambda m, b, p: widths.append(len(b["labels"])) or forward_loss(m, b, p))
    got = train.evaluate(model, valset, 10, micro_rows, place)
    with torch.no_grad():
        loss, n = model(**{k: v for k, v in valset.collate(range(10)).items()})
    assert abs(got - loss.item() / n) < 1e-5
    assert sum(widths) == 10 and max(widths) == micro_rows


def test_8bit_optimizer_without_bitsandbytes(tiny_dir, tmp_path, monkeypatch, capsys):
    installed = optional.installed
    monkeypatch.setattr(optional, "installed", lambda n: n != "bitsandbytes" and installed(n))
    err = one_line_error(args(tiny_dir, tmp_path, "--optimizer=adamw8bit"), capsys)
    assert err == "error: optimizer: adamw8bit needs bitsandbytes (pip install bitsandbytes); or use adamw"


def test_refused_runs_keep_the_existing_checkpoint(tiny_dir, tmp_path, capsys):
    """A fresh run into an out_dir that holds a run, out-of-range settings (every one named, a line each), a batch
    smaller than one row, and non-UTF-8 data: each is refused with exactly these lines and exit code 2, and the
    existing checkpoint keeps its bytes."""
    run(args(tiny_dir, tmp_path, "--max_steps=2", "--eval_every=0"))
    out, ckpt = tmp_path / "out", tmp_path / "out" / "checkpoint.pt"
    before = ckpt.read_bytes()
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes('{"problem": "a", "solution": "b"}\n{"problem": "café", "solution": "b"}\n'.encode("latin-1"))
    cases = [
        (
            [],
            [
                f"out_dir: {out} already holds a run ({ckpt}); continue it with --resume, replace it with --overwrite, "
                "or choose another out_dir"
            ],
        ),
        (["--max_steps=-3"], ["max_steps: -3 is out of range (expected >= 1)"]),
        (
            ["--lora_r=0", "--lr=-1", "--precision=fp8"],
            [
                "lora_r: 0 is out of range (expected an integer >= 1)",
                "lr: -1.0 is out of range (expected > 0)",
                "precision: expected one of auto, bf16, fp16, fp32, got 'fp8'",
            ],
        ),
        (
            ["--overwrite", "--batch_tokens=100"],
            ["batch_tokens: 100 is less than one row of 128 tokens; raise it or lower context_length"],
        ),
        (
            ["--overwrite", f"--data={bad}"],
            [f"{bad}:2: not UTF-8 text (byte 0xe9 at byte 17 of the line); save the file as UTF-8"],
        ),
        (
            ["--resume", "--overwrite"],
            ["overwrite: --resume continues the run in out_dir, --overwrite replaces it; choose one"],
        ),
    ]
    for extra, want in cases:
        assert refused(args(tiny_dir, tmp_path, *extra), capsys) == [f"error: {line}" for line in want]
        assert ckpt.read_bytes() == before


def test_default_out_dir_keeps_earlier_runs(tmp_path, monkeypatch, capsys):
    """`python train.py` twice: the second run writes to out-2 and says so; --resume and --overwrite stay in out."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "checkpoint.pt").write_bytes(b"the earlier run")
    assert run_dir.claim_out_dir(train.Config()) == "out-2"
    assert "out_dir: out holds an earlier run, kept as it is; this run writes to out-2" in capsys.readouterr().out
    (tmp_path / "out-2" / "checkpoint.pt").write_bytes(b"the second run")
    for cfg, want in [
        (train.Config(), "out-3"),
        (train.Config(resume=True), "out"),
        (train.Config(overwrite=True), "out"),
    ]:
        assert run_dir.claim_out_dir(cfg) == want
    assert (tmp_path / "out" / "checkpoint.pt").read_bytes() == b"the earlier run"


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs when this machine lets us mount one (root), else None: the test then simulates the errors."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True)
    yield disk, mounted.returncode == 0
    if mounted.returncode == 0:
        subprocess.run(["umount", str(disk)], check=True)


def test_full_disk_and_lost_permission_keep_the_last_checkpoint(tiny_dir, tmp_path, small_disk, monkeypatch, capsys):
    """A checkpoint save that meets a full disk, then one that meets a folder turned read-only mid-run: one line
    naming the file, the reason and what was kept, exit code 2, the last checkpoint's bytes unchanged, no temp file
    left. On a real tmpfs when it can be mounted, else with the errors the OS would raise."""
    import errno

    disk, mounted = small_disk
    argv = lambda *a: [*args(tiny_dir, disk, "--eval_every=0", f"--cache_dir={tmp_path / 'cache'}"), *a]  # noqa: E731
    run(argv("--max_steps=2"))
    out, ckpt = disk / "out", disk / "out" / "checkpoint.pt"
    before = ckpt.read_bytes()
    real_open = os.open

    def failing_open(code):
        def fake(path, *a, **kw):
            if str(path).startswith(str(out / ".checkpoint.pt.")):
                raise OSError(code, os.strerror(code), path)
            return real_open(path, *a, **kw)

        return fake

    if mounted:  # leave room for half a checkpoint: the write fails mid-file
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        (disk / "filler").write_bytes(b"\0" * (free - len(before) // 2))
    else:
        monkeypatch.setattr(atomic.os, "open", failing_open(errno.ENOSPC))
    err = refused(argv("--max_steps=4", "--resume"), capsys)
    assert err == [f"error: {ckpt}: could not write it (No space left on device); the previous file is kept"]
    assert ckpt.read_bytes() == before and not list(out.glob(".*.tmp"))

    if mounted:
        (disk / "filler").unlink()
        real_save = run_dir.save

        def lose_permission(*a, **kw):  # the folder turns read-only while the run is going
            subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
            return real_save(*a, **kw)

        monkeypatch.setattr(run_dir, "save", lose_permission)
    else:
        monkeypatch.setattr(atomic.os, "open", failing_open(errno.EROFS))
    err = refused(argv("--max_steps=4", "--resume"), capsys)
    assert err == [f"error: {ckpt}: could not write it (Read-only file system); the previous file is kept"]
    assert ckpt.read_bytes() == before and not list(out.glob(".*.tmp"))


def test_adapter_health_warns_when_adapters_do_not_train(tiny_dir, tmp_path, monkeypatch, capsys):
    """A normal run reports its adapters moving and NF4's quantization error, with no warning; a run whose B
    matrices are frozen (no gradient reaches them) is warned about at its first evaluation."""
    history = run(args(tiny_dir, tmp_path / "ok", "--max_steps=2"))
    printed = capsys.readouterr().err + capsys.readouterr().out
    assert "warning: every LoRA B" not in printed
    nf4 = next(h["nf4_error"] for h in history if "nf4_error" in h)
    assert nf4["layers"] == 14 and 0 < nf4["mean"] <= nf4["worst"] < 0.2
    health = next(h["adapters"] for h in history if "adapters" in h)
    assert health["b_moved"] > 0.9 and len(health["update"]) == 14 and health["mean"] > 0
    real = train.build_model

    def frozen_b(*a):
        model = real(*a)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.requires_grad_(False)
        return model

    monkeypatch.setattr(train, "build_model", frozen_b)
    history = run(args(tiny_dir, tmp_path / "frozen", "--max_steps=2"))
    captured = capsys.readouterr()
    assert (
        "warning: every LoRA B is still zero after 2 steps: the adapters are not training"
        in captured.err + captured.out
    )
    assert next(h["adapters"] for h in history if "adapters" in h)["b_moved"] == 0


@pytest.mark.parametrize("tf32", [None, False, True])
def test_tf32_only_where_asked(monkeypatch, tf32):
    """On a GPU (simulated: setup only asks torch.cuda whether there is one and selects it) ranks.setup leaves fp32
    matmuls in full fp32 ("ieee") by default and with --tf32=False, whatever they were before, and lets them round to
    TF32 only with --tf32=True; conftest's autouse fixture restores the switch."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    torch.backends.cuda.matmul.fp32_precision = "ieee" if tf32 else "tf32"  # the opposite of what is asked
    place = ranks.setup(load_config(train.Config, [] if tf32 is None else [f"--tf32={tf32}"]))
    assert place.device.type == "cuda"
    assert torch.backends.cuda.matmul.fp32_precision == ("tf32" if tf32 else "ieee")


def test_plan_and_preview_load_no_model_and_write_nothing(tiny_dir, tmp_path, monkeypatch, capsys):
    """--plan prints plan.report's table and choice for the model's config.json; --preview prints the data report and
    the marked examples; neither builds a model nor creates out_dir."""
    monkeypatch.setattr(train, "build_model", lambda *a: pytest.fail("a model was built"))
    assert run(args(tiny_dir, tmp_path, "--plan=24GB")) == []
    out = capsys.readouterr().out
    assert "memory plan for 24GB (23.00 GiB after the CUDA context), rows of 128 tokens" in out
    assert "fastest that fits: 16-bit base, AdamW, checkpointing off, 4 row(s)" in out
    assert run(args(tiny_dir, tmp_path, "--plan=24GB", "--chunked_loss=False", "--lora_targets=q_proj,lm_head")) == []
    assert "rows of 128 tokens, LoRA r=4, full-vocabulary loss" in capsys.readouterr().out
    assert run(args(tiny_dir, tmp_path, "--preview")) == []
    out = capsys.readouterr().out
    first = stdlib_examples("train")[0]["name"]  # each example named by its function
    assert "tokens kept" in out and f"--- {first}: " in out and "supervised ---" in out
    assert not (tmp_path / "out").exists()


def test_exports_keep_a_resumable_checkpoint_and_merge_from_a_bnb_4bit_base(tiny_dir, tmp_path):
    """--export_merged folds the adapters into the base, after the checkpoint is saved: the checkpoint still holds
    the trained adapters and a resumed run continues from them. A bnb-4bit base (no 16-bit original) merges into its
    dequantized weights instead of failing."""

    from support.formats import hf

    run(args(tiny_dir, tmp_path / "a", "--max_steps=2", "--eval_every=0", "--export_merged"))
    out = tmp_path / "a" / "out"
    saved = torch.load(out / "checkpoint.pt", weights_only=False)["lora"]
    trained = load_file(out / "adapter" / "adapter_model.safetensors")
    assert len(saved) == len(trained) == 2 * 14
    for name, t in saved.items():
        assert torch.equal(trained[f"base_model.model.{name}"], t)
    assert (out / "merged" / "model.safetensors").exists()
    merge = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["merge"]  # the check, in metrics too
    assert merge["merged_into"] == "original" and merge["merge_error"] < merge["tolerance"]
    assert merge["gap_4bit"] > 0 and merge["gap_4bit_base"] > 0
    assert len(run(args(tiny_dir, tmp_path / "a", "--max_steps=3", "--eval_every=0", "--resume"))) > 0

    nf4 = tmp_path / "nf4"
    hf.save_quantized(train.load_model(tiny_dir, torch.float32, quantize=True), nf4)
    for name in os.listdir(tiny_dir):
        if name.startswith("tokenizer"):
            shutil.copy(os.path.join(tiny_dir, name), nf4)
    run(args(str(nf4), tmp_path / "b", "--max_steps=1", "--eval_every=0", "--export_merged"))
    merged = train.load_model(tmp_path / "b" / "out" / "merged")
    assert not any(isinstance(m, quant.NF4Linear) for m in merged.modules())
    merge = json.loads((tmp_path / "b" / "out" / "metrics.jsonl").read_text().splitlines()[-1])["merge"]
    assert merge["merged_into"] == "dequantized" and "gap_4bit" not in merge  # no original: no 4-bit gap to show


def test_a_wrong_merge_ends_in_one_line_and_writes_no_merged_model(tiny_dir, tmp_path, monkeypatch, capsys):
    """A merge that drops one layer's delta: the run ends with the merge check's line, after the adapter and the
    checkpoint are written, and no merged directory appears."""
    import lora

    delta_weight, dropped = lora.delta_weight, []

    def delta_but_the_first(m):  # the first module folded (layer 0's q_proj) loses its delta
        dropped.append(dropped[0] if dropped else m)
        return delta_weight(m) * (m is not dropped[0])

    monkeypatch.setattr(lora, "delta_weight", delta_but_the_first)
    err = one_line_error(args(tiny_dir, tmp_path, "--max_steps=2", "--eval_every=0", "--export_merged"), capsys)
    assert err.startswith("error: merge check: the merged model's logits are up to ") and "the merge is wrong" in err
    out = tmp_path / "out"
    assert (out / "adapter" / "adapter_model.safetensors").exists() and (out / "checkpoint.pt").exists()
    assert not (out / "merged").exists()


# ----------------------------------------------------------------------------- on a GPU (and CPU variants)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CUDA training path)")
DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]


def packed_batch(vocab, rows=2, seed=0):
    """rows x 128 random tokens holding documents of 50, 30 and 48 tokens, the first 10 of each unsupervised."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, 128), generator=g)
    pos = torch.cat([torch.arange(n) for n in (50, 30, 48)]).repeat(rows, 1)
    return {"input_ids": ids, "position_ids": pos, "labels": ids.roll(-1, 1).masked_fill(pos < 10, -100)}


def qlora_step(model_dir, device, compute, adapters=None):
    """(loss per supervised token, {adapter name: fp32 gradient}, adapter state) of one QLoRA forward/backward as
    train.py builds it, on `device` in precision `compute`; B drawn away from zero, or the adapters copied from
    `adapters`."""
    cfg = train.Config(model=model_dir, device=device, precision=compute, lora_r=4, lora_alpha=8.0, lora_dropout=0.0)
    dtype = choice.pick_precision(cfg.precision, torch.device(device), read_config(model_dir)[0])
    place = ranks.Placement(0, 1, torch.device(device), dtype)
    model = train.build_model(cfg, place, model_dir, mlp_tile=0)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(adapters[n]) if adapters else p.normal_(0, 0.02) if "lora_B" in n else None
    loss, n = train.forward_loss(model, packed_batch(model.config.vocab_size), place)
    loss.backward()
    grads = {k: p.grad.float().cpu() for k, p in params.items()}
    return loss.item() / n, grads, {k: p.detach().clone() for k, p in params.items()}


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_step_equals_the_fp32_step(smollm2_vocab, tmp_path, device):
    """One bf16 QLoRA step (bf16 autocast over a bf16 base with NF4 blocks, fp32 adapters) against the same step in
    fp32 (TF32 off) on the same adapters and packed batch: the loss within 2e-3 nats and every LoRA gradient within
    5% (the norm of the difference over the norm; bf16 keeps 8 significant bits). On CPU: 1e-4 nats and 1.2%. The
    checkpoint is stored in bf16, so both runs quantize the same weights (quantize_ rounds to the compute dtype
    first, as transformers does): only the arithmetic differs."""
    torch.backends.cuda.matmul.fp32_precision = "ieee"  # conftest's autouse fixture restores it
    model_dir = random_model_dir(tmp_path, smollm2_vocab, dtype=torch.bfloat16, **TINY, head_dim=16)
    loss32, grads32, adapters = qlora_step(model_dir, device, "fp32")
    loss16, grads16, _ = qlora_step(model_dir, device, "bf16", adapters)
    errors = {k: float((grads16[k] - g).norm() / g.norm()) for k, g in grads32.items()}
    worst = max(errors, key=errors.get)
    print(f"\n{device}: loss fp32 {loss32:.5f} bf16 {loss16:.5f}; worst gradient error {errors[worst]:.4f} ({worst})")
    assert abs(loss16 - loss32) < 2e-3 and errors[worst] < 5e-2


@pytest.mark.parametrize("device", DEVICES)
def test_adamw_equals_the_single_tensor_loop(device):
    """make_optimizer's AdamW (fused on CUDA, foreach on CPU) takes the same 5 steps as torch's single-tensor loop on
    the same gradients, within fp32 rounding."""
    cfg, dev = train.Config(lr=1e-2, weight_decay=0.1), torch.device(device)
    ours = [torch.randn(shape, device=dev, requires_grad=True) for shape in ((64, 16), (16,), (3, 5, 7))]
    ref = [p.detach().clone().requires_grad_() for p in ours]
    start = [p.detach().clone() for p in ours]
    opt = train.make_optimizer(cfg, ours, dev)
    assert opt.defaults["fused"] is (device == "cuda")
    kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay, foreach=False, fused=False)
    ref_opt = torch.optim.AdamW(ref, **kw)
    for _ in range(5):
        for p, r in zip(ours, ref, strict=True):
            p.grad = torch.randn_like(p)
            r.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    for p, r, s in zip(ours, ref, start, strict=True):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
        assert (p - s).abs().max() > 1e-3  # the steps really moved the parameters


@cuda
def test_probe_fits_under_a_capped_memory_fraction(smollm2_vocab, tmp_path):
    """The auto micro-batch probe on a GPU whose memory is capped (set_per_process_memory_fraction, which bounds what
    the allocator reserves) between what 2 rows of 2,048 tokens reserve and what 3 rows allocate: it picks 2, with
    the optimizer state held in reserve as the probe holds it, and 2 rows per micro-batch then train a step."""
    shape = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8, head_dim=64)
    model_dir = random_model_dir(tmp_path / "m", smollm2_vocab, torch.bfloat16, "cuda", **shape, num_key_value_heads=2)
    cfg = train.Config(model=model_dir, device="cuda", context_length=2048, batch_tokens=16 * 2048)
    cfg.max_examples, cfg.cache_dir = 600, str(tmp_path / "cache")
    place = ranks.Placement(1, 1, torch.device("cuda"), torch.bfloat16)  # rank 1: builds quietly
    trainset = train.build_data(cfg, Tokenizer(model_dir), run_dir.data_files(cfg), 8192, place)[0]
    model = train.build_model(cfg, place, model_dir, mlp_tile=0)
    longest = sorted(range(len(trainset)), key=lambda r: -sum(trainset.lens[d] for d in trainset.rows[r]))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    def peak(rows):  # (allocated, reserved) peak bytes of the probe's own attempt, its reserve held, from a clean cache
        reserve = torch.empty(memory.optimizer_bytes(cfg.optimizer) * trainable, dtype=torch.uint8, device="cuda")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            loss, _ = train.forward_loss(model, trainset.collate(longest[:rows]), place)
            loss.backward()
        finally:
            model.zero_grad(set_to_none=True)
            del reserve
        return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()

    (_, reserved2), (allocated3, _) = peak(2), peak(3)
    assert reserved2 < allocated3, (reserved2, allocated3)
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction((reserved2 + allocated3) / 2 / torch.cuda.mem_get_info()[1])
    try:
        rows = plan.micro_batch_rows(cfg, place, model, trainset, 16, train.forward_loss)
        assert rows == 2, (rows, reserved2, allocated3)
        with pytest.raises(torch.OutOfMemoryError):
            peak(3)
        torch.cuda.empty_cache()
        params = [p for p in model.parameters() if p.requires_grad]
        opt, scaler = train.make_optimizer(cfg, params, place.device), torch.amp.GradScaler("cuda", enabled=False)
        rec = train.train_step(model, opt, scaler, trainset.collate(longest[:4]), rows, 0, cfg, place)
        assert math.isfinite(rec["loss"])
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    print(f"\n2 rows reserve {reserved2 / 2**20:.0f} MiB, 3 rows allocate {allocated3 / 2**20:.0f} MiB; probe: {rows}")


@cuda
def test_cuda_end_to_end_on_a_1b_shape(smollm2_vocab, tmp_path, monkeypatch):
    """train.py end to end on the GPU: a random-initialised Llama of Llama-3.2-1B's shape (with SmolLM2's vocabulary
    and tokenizer) fine-tuned with QLoRA for 30 steps on the stdlib data, auto micro-batch and all. The validation
    loss falls. A run interrupted at step 12 and resumed is as close to the uninterrupted run as a second
    uninterrupted run is: GPU kernels sum in an order that varies from run to run (atomics in attention's backward,
    split-K matmuls), so no fixed tolerance is the right one; the spread of two plain runs is measured and the resumed
    run must stay within 4x of it (equal where the kernels are deterministic), where a resume that lost or mis-keyed
    its optimizer state or schedule moves the losses by far more. The adapter loads in PEFT and the merged export in
    transformers, and in fp32 their logits
    agree within 2% (the merged weights are rounded to bf16: about 2e-3 on a tiny model) and within a tenth of how far
    training moved them from the base's."""
    import peft
    import transformers

    shape = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, head_dim=64)
    base = random_model_dir(tmp_path / "base", smollm2_vocab, torch.bfloat16, "cuda", **shape, num_key_value_heads=8)
    common = [f"--model={base}", "--max_examples=3000", "--context_length=1024", "--batch_tokens=16384"]
    common += ["--max_steps=30", "--warmup_steps=3", "--eval_every=10", "--save_every=10", "--eval_samples=0"]
    common += [f"--cache_dir={tmp_path / 'cache'}"]
    full = run([*common, f"--out_dir={tmp_path / 'full'}", "--export_merged"])
    vals = [h["val_loss"] for h in full if "val_loss" in h]
    assert len(vals) == 4 and vals[-1] < vals[0] - 0.05, vals
    run_interrupted([*common, f"--out_dir={tmp_path / 'resumed'}"], 12, monkeypatch)
    resumed = run([*common, f"--out_dir={tmp_path / 'resumed'}", "--resume"])
    again = run([*common, f"--out_dir={tmp_path / 'again'}"])
    losses = lambda h: torch.tensor([r["loss"] for r in h if "loss" in r], dtype=torch.float64)  # noqa: E731
    spread = float(((losses(again) - losses(full)) / losses(full)).abs().max())
    drift = float(((losses(resumed) - losses(full)) / losses(full)).abs().max())
    print(f"\nresumed vs uninterrupted: {drift:.2e} relative; two uninterrupted runs: {spread:.2e}")
    assert len(losses(resumed)) == len(losses(full)) == 30 and drift <= 4 * spread + 1e-7

    tok = Tokenizer(base)
    ids = torch.tensor([tok.encode("def add(a, b):\n    return a + b\n", bos=False)], device="cuda")
    load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).cuda().eval()  # noqa: E731
    with torch.no_grad():
        merged = load(tmp_path / "full" / "merged")(ids).logits
        untrained = load(base)(ids).logits
        adapted = peft.PeftModel.from_pretrained(load(base), tmp_path / "full" / "adapter").eval()(ids).logits
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    print(
        f"\nval loss {vals}; merged vs PEFT logits {rel(merged, adapted):.2e}, vs the base {rel(merged, untrained):.2e}"
    )
    assert rel(merged, adapted) < 2e-2 and rel(merged, adapted) < 0.1 * rel(merged, untrained)


def test_eval_task_scores_the_first_and_last_evaluation_and_bad_tasks_are_one_line(tiny_dir, tmp_path, capsys):
    """eval_task with eval_task_at=ends: pass@1 of a problems file at step 0 and at the last step only (none at the
    evaluation between), in metrics.jsonl and in the end-of-run line; a missing file, a file with a bad line and an
    unknown task are each one line naming it."""
    problems = fixed_outcome_problems(tmp_path / "tasks.jsonl")
    task = [f"--eval_task={problems}", "--eval_task_at=ends", "--sample_tokens=4", "--eval_samples=0"]
    history = run(args(tiny_dir, tmp_path, "--max_steps=2", "--eval_every=1", *task))
    scored = {h["step"]: h["eval_task"] for h in history if "eval_task" in h}
    assert scored == {0: {"pass@1": 0.5, "passed": 1, "problems": 2}, 2: {"pass@1": 0.5, "passed": 1, "problems": 2}}
    assert [h["step"] for h in history if "val_loss" in h] == [0, 1, 2]
    metrics = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [m["eval_task"] for m in metrics if "eval_task" in m] == list(scored.values())
    assert "tasks.jsonl pass@1: 50.0% -> 50.0% (2 problems)" in capsys.readouterr().out
    missing = one_line_error(args(tiny_dir, tmp_path / "b", "--eval_task=missing.jsonl"), capsys)
    assert "eval_task: missing.jsonl: no such file" in missing
    problems.write_text('{"task_id": "x"}\n')
    assert "tasks.jsonl:1: missing field 'prompt'" in one_line_error(args(tiny_dir, tmp_path / "b", *task), capsys)
    assert "eval_task: 'mbpp' is out of range" in one_line_error(
        args(tiny_dir, tmp_path / "b", "--eval_task=mbpp"), capsys
    )
    assert not (tmp_path / "b").exists()
