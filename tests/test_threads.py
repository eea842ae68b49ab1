"""support/run/threads.py: every entry point sets OpenMP's wait policy before torch loads OpenMP.

What this file proves: `python -X importtime` of train, rl, generate, convert and bench imports support/run/threads.py
before any torch module (libgomp reads OMP_WAIT_POLICY only when torch loads it); the process then holds
OMP_WAIT_POLICY=PASSIVE, and a value the user set is kept.
"""

import os
import subprocess
import sys

import pytest
from conftest import ROOT

ENTRY_POINTS = ["train", "rl", "generate", "convert", "bench"]


def imported_in_order(module, env):
    """The modules `python -c "import <module>"` imports, in the order -X importtime lists them (each once it is done;
    a module's own imports first)."""
    command = [sys.executable, "-X", "importtime", "-c", f"import {module}"]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line.split("|") for line in run.stderr.splitlines() if line.startswith("import time:")]
    return [row[-1].strip() for row in rows if len(row) == 3]


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_the_wait_policy_is_set_before_torch_loads(module):
    """Importing an entry point imports support.run.threads before the first torch module."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    names = imported_in_order(module, env)
    first_torch = next(i for i, name in enumerate(names) if name == "torch" or name.startswith("torch."))
    assert names.index("support.run.threads") < first_torch, names[: first_torch + 1]


@pytest.mark.parametrize("user", [None, "ACTIVE"])
def test_passive_unless_the_user_chose(user):
    """After `import train` the process holds OMP_WAIT_POLICY=PASSIVE, or the value the user gave it."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | ({"OMP_WAIT_POLICY": user} if user else {})
    code = "import os, train; print(os.environ['OMP_WAIT_POLICY'])"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == [user or "PASSIVE"]
