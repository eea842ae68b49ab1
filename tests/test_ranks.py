"""support/run/ranks.py: runs on many ranks that cannot hang. torchrun with 2 gloo ranks on CPU runs train.py through
tests/ranks_worker.py, which gives one rank a fault of its own; LoRA dropout is on (0.05), so every resumed run is
compared with one uninterrupted process, step for step.

- The ranks agree on the micro-batch: under FSDP, two ranks whose free-memory readings differ (1 MiB against 1 TiB;
  each sizes micro_batch_tokens="auto" from its own) both take the smaller and train as one process does. They used
  to pick 1 and 2 rows, run different numbers of forwards, and wait for each other's all-gathers forever.
- For DDP and for FSDP: Ctrl-C (SIGINT to torchrun) stops both ranks after the step under way with a checkpoint of
  exactly that step; resumed, one rank is killed (SIGKILL) in the middle of a later step, and the other ends by itself,
  exit code 2 and not by torchrun's signals (gloo fails its collective as the dead rank's connection closes), with one
  line that names the step and the checkpoint that is intact; resumed again, in one process, the run reaches the
  uninterrupted run's losses and gradient norms (1e-6 relative) and adapter (1e-6). It used to end in a traceback.
- A user error that one rank meets alone ends every rank with that one line, by itself (a run that waited for the lost
  collective, rank_timeout's 30 minutes, fails the test at launch's 240 s): a bad row in rank 1's share
  (injected: every rank reads every row here) under DDP, an unwritable checkpoint path (rank 0 alone writes) under
  FSDP. The other rank used to end in a traceback of the broken collective.

Sharding (FSDP2): QLoRA sharded with PyTorch's FSDP2 over gloo ranks on CPU, against one process, LoRA dropout on
(0.05: its masks are a function of (seed, step, global row), so no split of the batch may change them).

- With 2 and 4 ranks, on a tiny Llama and a tiny Qwen3, with an NF4 and a 16-bit base, with and without activation
  checkpointing, eager and (on one rank) compiled, and in one process with micro-batches of 1 row and of 2: the losses
  and gradient norms of every step and the saved PEFT adapter equal one process's. Tolerance: losses and gradient norms
  within 1e-6 relative, adapters within 5e-6 absolute: the fp32 rounding of summing gradients in another order (the
  ranks' partial sums are reduce-scattered, once a step), which AdamW's first steps magnify near g = 0 by at most
  lr*d/eps (measured: 1.1e-7 relative in losses and norms; 1.1e-6 in one entry of an adapter of the 4-rank Qwen3, below
  6e-8 in all others). A wrong normalisation of the loss over ranks moves the gradient norm by 50% (AdamW hides a
  uniform scale in the adapters, not in the norm), a dropout mask drawn per rank or per micro-batch moves both by
  percents and the adapters by 1e-4.
- Each rank holds 1/N of the parameter bytes between steps (the ranks' shards add up to the whole, each within 1% of
  1/N: tensors are cut into whole rows), and while a block computes, that block and the root's weights (embeddings,
  norm, lm_head) in full; while loading, of the blocks never more than its shards and the one block being sharded, and
  the checkpoint is read once across the ranks (rank 0 reads it and sends each rank its shards): measured from the
  tensors and the bytes read.
- NF4 bytes survive sharding and gathering bit for bit on 2 and 4 ranks, every byte value and every 16-bit pattern
  (bf16 and fp16 NaNs among them) included.
- A run sharded over 2 ranks, resumed in one process, then resumed sharded over 4 ranks reaches the losses and the
  adapter of one uninterrupted process (the checkpoint holds whole tensors named by parameter); so do checkpoints
  written by older code (commit 062b437, one process and 2 ranks), resumed.
- Gradients are reduce-scattered once a step, whatever the number of micro-batches.
- Two "nodes" on localhost (two torchrun launches, --nnodes=2, c10d rendezvous) give one process's losses.
- What FSDP does not offer (a merged export, 8-bit AdamW, CPU offload on a CPU) is one line each, and so is CPU
  offload without FSDP.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import DATA, ROOT, TINY, free_port, random_model_dir, threads_env
from safetensors.torch import load_file
from test_train import args, one_line_error, run

from support.run.run_dir import read_checkpoint

SAVE = ["--save_every=1"]  # a checkpoint after every step: a lost rank loses nothing but the step under way


def launch(fault, argv, tmp_path):
    """(exit code, printed lines, the fault's events, seconds it ended after the last event) of train.py under torchrun
    with 2 ranks and `fault` (ranks_worker.py). A run that hangs is ended (torchrun passes SIGTERM on) and fails."""
    log = tmp_path / f"faults-{time.monotonic_ns()}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    env = threads_env(2, FAULT_LOG=str(log))
    proc = subprocess.Popen([*cmd, "tests/ranks_worker.py", fault, *argv], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        out = proc.communicate(timeout=240)[0]
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
        pytest.fail(f"torchrun with {fault} hung:\n{out[-3000:]}")
    ended = time.time()
    events = [json.loads(line) for line in open(log)] if log.exists() else []
    seconds = ended - events[-1]["time"] if events else None
    return proc.returncode, out.splitlines(), events, seconds


def errors(lines):
    """The error lines of all ranks (one may start after the other's progress bar, on the same line)."""
    assert not any('train.py", line' in line for line in lines), "\n".join(lines[-40:])  # no rank's traceback
    return [line[line.index("error: ") :] for line in lines if "error: " in line]


def test_ranks_agree_on_the_micro_batch(tiny_dir, steps, one_process, tmp_path):
    argv = args(tiny_dir, tmp_path, *steps, "--parallel=fsdp", "--micro_batch_tokens=auto")
    code, lines, _, _ = launch("memory:1", argv, tmp_path)
    assert code == 0, "\n".join(lines[-40:])
    assert any("2 rank(s) x 2 micro-batch(es) x 1 rows" in line for line in lines)
    assert_same_run(one_process, tmp_path)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_ctrl_c_then_a_lost_rank_then_resume(tiny_dir, steps, one_process, tmp_path, parallel):
    argv = args(tiny_dir, tmp_path, *steps, *SAVE, f"--parallel={parallel}")
    out = tmp_path / "out"
    code, lines, _, _ = launch("sigint:1", argv, tmp_path)  # Ctrl-C at the terminal reaches torchrun alone
    assert code != 0 and sum("Ctrl-C: stopping after this step" in line for line in lines) == 2, "\n".join(lines)
    stopped = read_checkpoint(out / "checkpoint.pt")["step"]
    assert f"interrupted: checkpoint at step {stopped} written; continue with --resume --out_dir={out}" in lines
    assert stopped in (1, 2, 3) and len(losses(tmp_path)) == stopped  # exactly between two steps

    killed = min(stopped + 2, 4)  # the run has 4 steps; with a checkpoint each step, the one before is intact
    code, lines, events, seconds = launch(f"kill:1:{killed}", [*argv, "--resume"], tmp_path)
    assert code != 0 and [e["event"] for e in events] == ["kill"]
    assert errors(lines) == [
        f"error: rank 0: another rank was lost during step {killed} (it exited without a word: killed, out of "
        f"memory or its machine gone); the checkpoint of step {killed - 1} in {out} is intact; continue with --resume"
    ]
    assert "exitcode  : -15" not in "\n".join(lines)  # rank 0 exits with code 2, not by torchrun's SIGTERM
    print(f"\n{parallel}: rank 1 killed in step {killed}; torchrun ended {seconds:.1f} s later")

    run([*args(tiny_dir, tmp_path, *steps, *SAVE), "--resume"])  # in one process
    assert_same_run(one_process, tmp_path)


@pytest.mark.parametrize("parallel, case", [("ddp", "bad row"), ("fsdp", "unwritable checkpoint")])
def test_a_user_error_on_one_rank_ends_every_rank_with_its_line(tiny_dir, steps, tmp_path, parallel, case):
    """A user error that one rank meets alone: under DDP rank 1 a bad row of its share at step 2, under FSDP rank 0 a
    checkpoint path it cannot write at step 1 (each error and each way of running once: the line travels the same way
    in both). Every rank ends with that rank's line (exit code 2, none by torchrun's SIGTERM), where waiting for the
    lost collective would take rank_timeout (30 minutes)."""
    out = tmp_path / "out"
    if case == "bad row":
        fault, line, rank = "error:1:2", "data.jsonl:7: missing field 'response'", 1
    else:  # a directory in the checkpoint's place
        (out / "checkpoint.pt" / "x").mkdir(parents=True)
        fault, rank = "none", 0
        line = f"{out / 'checkpoint.pt'}: could not write it (Is a directory); the previous file is kept"
    started = time.time()
    argv = args(tiny_dir, tmp_path, *steps, *SAVE, f"--parallel={parallel}", "--overwrite")
    code, lines, _, _ = launch(fault, argv, tmp_path)
    seconds = time.time() - started
    said = [f"error: {line}", f"error: {line} (from rank {rank}; rank {1 - rank} stopped with it)"]
    assert sorted(errors(lines)) == said, "\n".join(lines[-40:])
    assert "exitcode  : -15" not in "\n".join(lines)  # each rank exits with code 2, none by torchrun's SIGTERM
    print(f"\n{parallel}, {case}: every rank ended with the line of rank {rank}; the run took {seconds:.1f} s")


@pytest.fixture(scope="module")
def models(smollm2_dir, tiny_dir, tmp_path_factory):
    """A tiny Llama and a tiny Qwen3 (per-head q/k norms) with SmolLM2's vocabulary and tokenizer."""
    qwen3 = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=32)
    return {
        "llama": tiny_dir,
        "qwen3": random_model_dir(tmp_path_factory.mktemp("qwen3"), smollm2_dir, **TINY, **qwen3),
    }


def torchrun(ranks, argv, script="train.py"):
    """`script` (train.py) under torchrun with `ranks` processes on this machine (gloo)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master_port={free_port()}"]
    proc = subprocess.run([*cmd, script, *argv], cwd=ROOT, env=threads_env(ranks), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def losses(out, key="loss"):
    return [json.loads(line)[key] for line in open(out / "out" / "metrics.jsonl") if '"loss"' in line]


def assert_same_run(a, b):
    """The losses, gradient norms and the PEFT adapter of two runs, within the tolerance of the file docstring."""
    assert losses(a) == pytest.approx(losses(b), rel=1e-6, abs=0), (losses(a), losses(b))
    assert losses(a, "grad_norm") == pytest.approx(losses(b, "grad_norm"), rel=1e-6, abs=0)
    x, y = (load_file(d / "out" / "adapter" / "adapter_model.safetensors") for d in (a, b))
    assert x.keys() == y.keys() and all(float((x[k] - y[k]).abs().max()) <= 5e-6 for k in x)


# The Llama on an NF4 base over 2 ranks without checkpointing is test_ranks_agree_on_the_micro_batch's run (its ranks
# take micro-batches of 1 row; the 16-bit Llama's here take 2).
@pytest.mark.parametrize(  # each base, each rank count, each family, with and without checkpointing
    "family, ranks, base, checkpointing",
    [
        ("llama", 2, "--quantize=False", True),
        ("qwen3", 4, "--quantize=True", True),
    ],
)
def test_sharded_runs_equal_one_process(models, steps, tmp_path, family, ranks, base, checkpointing):
    flags = [*steps, base, f"--activation_checkpointing={checkpointing}"]
    run(args(models[family], tmp_path / "one", *flags))
    printed = torchrun(ranks, args(models[family], tmp_path / "sharded", *flags, "--parallel=fsdp"))
    assert_same_run(tmp_path / "one", tmp_path / "sharded")
    assert printed.count("FSDP: rank ") == ranks and f"sharded over {ranks} rank(s)" in printed


def test_micro_batches_of_one_row_equal_two(models, steps, one_process, tmp_path):
    """One process, micro-batches of 1 row (4 a step) against the reference's 2 rows (2 a step), dropout on."""
    run(args(models["llama"], tmp_path, *steps, "--micro_batch_tokens=128"))
    assert_same_run(one_process, tmp_path)


def test_compiled_blocks_under_fsdp_equal_one_process(tiny_dir, steps, one_process, tmp_path):
    """--compile with --parallel=fsdp compiles each block's computation inside the block's call, so FSDP's hooks
    gather and free its weights around the graph: 2 steps sharded over the one rank of this process (compiling on
    several ranks costs each of them the same minutes on CPU; what the rank count changes, the all-gather, runs in
    the hooks, outside the graph, as the eager sharded runs prove) against the eager reference (compiled kernels
    round differently from eager ones: 1.1e-7 measured, within the file's tolerance)."""
    run(args(tiny_dir, tmp_path, *steps, "--parallel=fsdp", "--compile", "--max_steps=2"))
    for key in ("loss", "grad_norm"):
        assert losses(tmp_path, key) == pytest.approx(losses(one_process, key)[:2], rel=1e-6, abs=0)


def test_gradients_are_reduce_scattered_once_a_step(tiny_dir, steps, tmp_path, monkeypatch):
    """Sharded over the one rank of this process, 2 steps with 2 micro-batches a step and with 4 (after the CPU heap
    probe's step, which reduces as a step does) start the same number of gradient reduce-scatters, one a step for each
    sharded group holding adapters: after the last micro-batch only (set_requires_gradient_sync). Without it, 4
    micro-batches would reduce twice as often as 2. Counted where FSDP2 starts each group's reduce-scatter
    (foreach_reduce)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    calls, start = [], group.foreach_reduce
    monkeypatch.setattr(group, "foreach_reduce", lambda *a, **k: calls.append(1) or start(*a, **k))
    counts, settings = {}, [s for s in steps if not s.startswith("--micro_batch_tokens")]
    for tokens in (256, 128):  # 2 and 4 micro-batches in each 512-token step of configs/tiny.py
        calls.clear()
        sharded = ["--parallel=fsdp", "--max_steps=2", f"--micro_batch_tokens={tokens}"]
        run(args(tiny_dir, tmp_path / str(tokens), *settings, *sharded))
        counts[tokens] = len(calls)
    assert counts[256] == counts[128] > 0 and counts[256] % 2 == 0, counts


LAYERS = 8  # enough blocks that "its shards and one whole block" is well below all of them


@pytest.fixture(scope="module")
def four_ranks(smollm2_dir, tmp_path_factory):
    """(model directory, fsdp_worker.py's line of each rank) for an 8-block tiny Llama over 4 ranks."""
    tmp = tmp_path_factory.mktemp("four-ranks")
    deep = random_model_dir(tmp / "deep", smollm2_dir, **(TINY | dict(num_hidden_layers=LAYERS)), head_dim=16)
    torchrun(4, [str(tmp / "ranks.jsonl"), deep], script="tests/fsdp_worker.py")
    return deep, sorted((json.loads(line) for line in open(tmp / "ranks.jsonl")), key=lambda r: r["rank"])


def test_each_rank_holds_a_shard_and_gathers_one_block(four_ranks):
    layers, (_, ranks) = LAYERS, four_ranks
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    whole, block = ranks[0]["whole"], ranks[0]["block"]
    root = whole - layers * block  # the rest is the embeddings (tied to lm_head) and the final norm
    assert sum(r["between"] for r in ranks) == whole  # every byte held by exactly one rank
    for r in ranks:
        assert abs(r["between"] - whole / 4) <= 0.01 * whole / 4, r  # torch.chunk's rows: the last shards are shorter
        gathered = r["during"] - r["between"]  # a block and the root, each in full less this rank's own shard
        assert 0.75 * (block + root) * 0.99 <= gathered <= 0.75 * (block + root) * 1.01 + block, r
        # loading the blocks: this rank's shards of those before and the one being sharded (whole), never all of them
        assert r["loading_blocks"] <= layers * block / 4 * 1.01 + block < layers * block / 2, r
        assert r["loading_root"] <= layers * block / 4 * 1.01 + root, r  # then the root, whole, beside the shards
    print(
        f"\nper rank: {ranks[0]['between']:,} of {whole:,} bytes between steps; {ranks[0]['during']:,} at most; "
        f"while loading the blocks ({layers * block:,} bytes) at most {max(r['loading_blocks'] for r in ranks):,}"
    )


def test_the_checkpoint_is_read_once_across_the_ranks(four_ranks):
    """Rank 0 reads every tensor of the checkpoint once and the other ranks read none (they used to read it all,
    each, and quantize every block): their shards come from rank 0 (and equal one process's: the sharded runs)."""
    deep, ranks = four_ranks
    stored = sum(t.nbytes for t in load_file(os.path.join(deep, "model.safetensors")).values())
    assert [r["read"] for r in ranks] == [stored, 0, 0, 0], (stored, [r["read"] for r in ranks])
    print(f"\nbytes read per rank: {[r['read'] for r in ranks]} of a {stored:,}-byte checkpoint")


def test_nf4_bytes_survive_sharding_bit_for_bit(four_ranks):
    """fsdp_worker.py's NF4 weight, every byte value and every 16-bit pattern among its codes, sharded over the 4 ranks
    and over each pair of them (a 2-rank mesh) and gathered, is every rank's single-process bytes (NF4 stays uint8: a
    bf16 copy of such codes loses NaN patterns when cast, 253 of the 65,536 in a round trip through fp32)."""
    assert [r["nf4_bytes_survive"] for r in four_ranks[1]] == [{"4": True, "2": True}] * 4


def test_resume_across_rank_counts(models, steps, one_process, tmp_path):
    moved = args(models["llama"], tmp_path / "moved", *steps)
    torchrun(2, [*moved, "--max_steps=2", "--parallel=fsdp"])
    run([*moved, "--max_steps=3", "--resume"])
    torchrun(4, [*moved, "--max_steps=4", "--resume", "--parallel=fsdp"])
    assert_same_run(one_process, tmp_path / "moved")


OLD = DATA / "checkpoints-062b437"  # checkpoints written by older code, and the examples they trained on


@pytest.fixture(scope="module")
def without_dropout(tiny_dir, steps, tmp_path_factory):
    """(the settings, the uninterrupted 4-step run) of the stored checkpoints' run: `steps` with LoRA dropout off, on
    the 80 examples they were written with (the stdlib's own docstrings differ from one Python release to another)."""
    settings = [s for s in steps if not s.startswith(("--lora_dropout", "--data="))]
    settings += ["--lora_dropout=0.0", f"--data={OLD / 'data.jsonl'}"]
    root = tmp_path_factory.mktemp("without-dropout")
    run(args(tiny_dir, root, *settings))
    return settings, root


@pytest.mark.parametrize("written_by", ["one-process", "fsdp-2"])
def test_checkpoints_written_by_older_code_resume_exactly(tiny_dir, without_dropout, tmp_path, written_by):
    """Checkpoints main wrote at 062b437, before checkpoints went through torch.distributed.checkpoint.state_dict and
    weights_only (tests/data/checkpoints-062b437: 2 steps of the tiny Llama, dropout off, whose masks changed since),
    one from one process and one from 2 ranks, resume (in one process, and on 2 ranks) to step 4 and reach the losses,
    gradient norms and adapter of an uninterrupted run of this code, within the file's tolerance. Their config's model
    and data were the writer's paths; they are pointed at this run's copies first."""
    settings, whole = without_dropout
    out, stored = tmp_path / "resumed" / "out", OLD / written_by
    out.mkdir(parents=True)
    state = torch.load(stored / "checkpoint.pt", weights_only=True)
    state["config"] |= dict(model=tiny_dir, data=str(OLD / "data.jsonl"))
    torch.save(state, out / "checkpoint.pt")
    shutil.copy(stored / "metrics.jsonl", out)
    resume = [*args(tiny_dir, tmp_path / "resumed", *settings), "--resume"]
    torchrun(2, [*resume, "--parallel=fsdp"]) if written_by == "fsdp-2" else run(resume)
    assert len(losses(tmp_path / "resumed")) == 4
    assert_same_run(whole, tmp_path / "resumed")


def test_two_nodes_on_localhost(models, steps, one_process, tmp_path):
    argv = args(models["llama"], tmp_path / "nodes", *steps, "--parallel=fsdp")
    rendezvous = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}"]
    launcher = [sys.executable, "-m", "torch.distributed.run", *rendezvous]
    output = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    nodes = [
        subprocess.Popen([*launcher, f"--node_rank={n}", "train.py", *argv], cwd=ROOT, env=threads_env(2), **output)
        for n in (0, 1)
    ]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), outputs[0][-2000:] + outputs[1][-2000:]
    assert_same_run(one_process, tmp_path / "nodes")


def test_what_fsdp_does_not_offer_is_one_line(models, tmp_path, capsys, monkeypatch):
    for flag in ("--export_merged", "--optimizer=adamw8bit", "--cpu_offload=True"):  # on this CPU
        err = one_line_error(args(models["llama"], tmp_path, "--parallel=fsdp", flag), capsys)
        assert err.startswith(f"error: {flag[2:].split('=')[0]}: not with parallel=fsdp ("), err
    with monkeypatch.context() as m:  # torch 2.11 (as on a GPU machine): its FSDP2 fails on frozen NF4 shards
        m.setattr(torch, "__version__", "2.11.0+cu130")
        err = one_line_error(args(models["llama"], tmp_path, "--parallel=fsdp", "--quantize=True"), capsys)
    assert err.startswith("error: quantize: not with parallel=fsdp (torch 2.11.0+cu130's FSDP2 cannot shard"), err
    err = one_line_error(args(models["llama"], tmp_path, "--cpu_offload=True"), capsys)
    assert err == "error: cpu_offload: needs parallel=fsdp (it keeps the shards of a sharded model in CPU memory)"
    # the 70B config planned on this CPU for two GPUs: the plan is for them, so their settings are not refused here
    assert run(["configs/llama70b.py", f"--model={models['llama']}", "--plan=2x24GB"]) == []
    assert "memory plan for 2x24GB (23.00 GiB per GPU" in capsys.readouterr().out
