"""Run under torchrun by test_ranks.py: train.py's main with one fault that only one rank meets, named by argv[1]:

    kill:R:S      rank R kills itself (SIGKILL) in the middle of step S (1-based): inside its second block's forward
    error:R:S     rank R meets a user error of its own while fetching step S's rows (a bad row only it would see)
    sigint:S      rank 0 sends SIGINT to torchrun (its parent) as step S starts: Ctrl-C at the terminal
    memory:R      rank R reads almost no free memory, the others plenty (each sizes its micro-batch from its own)
    none          no fault: train.py as it is

then argv[2:] as train.py's. Times of the faults go to $FAULT_LOG as JSON lines."""

import json
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import psutil  # noqa: E402

import train  # noqa: E402
from pack import PackedDataset  # noqa: E402

RANK = int(os.environ["RANK"])


def note(event):
    with open(os.environ["FAULT_LOG"], "a") as f:
        f.write(json.dumps({"event": event, "rank": RANK, "time": time.time()}) + "\n")


def at_step(step, act):
    """`act()` when this rank fetches the rows of `step` (1-based)."""
    real = PackedDataset.step_batch

    def step_batch(ds, index, *a):
        if index == step - 1:
            act()
        return real(ds, index, *a)

    PackedDataset.step_batch = step_batch


def kill_mid_step(step):
    """SIGKILL this rank inside step `step`'s forward: after the step's first all-reduce and, under FSDP, its first
    block's all-gather."""
    real, started = train.build_model, []

    def build_model(*a):
        model = real(*a)

        def kill(*_):
            if started and model.training:
                note("kill")
                os.kill(os.getpid(), signal.SIGKILL)

        model.model.layers[1].register_forward_pre_hook(kill)
        return model

    train.build_model = build_model
    at_step(step, lambda: started.append(step))


def bad_row():
    raise ValueError("data.jsonl:7: missing field 'response'")


def interrupt_torchrun():
    note("sigint")
    os.kill(os.getppid(), signal.SIGINT)


def main(fault, argv):
    kind, *where = fault.split(":")
    if kind == "kill" and RANK == int(where[0]):
        kill_mid_step(int(where[1]))
    elif kind == "error" and RANK == int(where[0]):
        at_step(int(where[1]), bad_row)
    elif kind == "sigint" and RANK == 0:
        at_step(int(where[0]), interrupt_torchrun)
    elif kind == "memory":
        real, little = psutil.virtual_memory, RANK == int(where[0])

        def virtual_memory():
            return real()._replace(available=2**20 if little else 2**40)

        psutil.virtual_memory = virtual_memory
    train.main(argv)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
