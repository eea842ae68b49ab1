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
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, free_port
from test_fsdp import assert_same_run, losses
from test_train import args, run

from support.run.run_dir import read_checkpoint

SAVE = ["--save_every=1"]  # a checkpoint after every step: a lost rank loses nothing but the step under way


def launch(fault, argv, tmp_path):
    """(exit code, printed lines, the fault's events, seconds it ended after the last event) of train.py under torchrun
    with 2 ranks and `fault` (ranks_worker.py). A run that hangs is ended (torchrun passes SIGTERM on) and fails."""
    log = tmp_path / f"faults-{time.monotonic_ns()}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FAULT_LOG": str(log)}
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
