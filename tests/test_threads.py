"""support/run/threads.py: every entry point sets OpenMP's wait policy before torch loads OpenMP.

What this file proves: importing train, rl, generate, convert or bench reaches `import torch` with
support/run/threads.py already imported and OMP_WAIT_POLICY=PASSIVE already set (libgomp reads it only when torch
loads it), or the value the user set kept. A stand-in torch package, first on PYTHONPATH, reports both the moment it
is imported and ends the process, so no real torch loads.
"""

import os
import subprocess
import sys

import pytest
from conftest import ROOT

ENTRY_POINTS = ["train", "rl", "generate", "convert", "bench"]
STAND_IN = """import os, sys
print(os.environ.get("OMP_WAIT_POLICY"), "support.run.threads" in sys.modules, flush=True)
os._exit(0)
"""


def at_torch_import(module, user, tmp_path):
    """[OMP_WAIT_POLICY, whether support.run.threads was imported] at the moment `import <module>` imports torch."""
    (tmp_path / "torch").mkdir(exist_ok=True)
    (tmp_path / "torch" / "__init__.py").write_text(STAND_IN)
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | ({"OMP_WAIT_POLICY": user} if user else {})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    command = [sys.executable, "-c", f"import {module}"]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.split()


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_the_wait_policy_is_set_before_torch_loads(module, tmp_path):
    """Importing an entry point imports support.run.threads, which sets PASSIVE, before torch."""
    assert at_torch_import(module, None, tmp_path) == ["PASSIVE", "True"]


@pytest.mark.parametrize("user", ["ACTIVE", "passive"])
def test_a_policy_the_user_chose_is_kept(user, tmp_path):
    """OMP_WAIT_POLICY set by the user reaches torch as the user wrote it."""
    assert at_torch_import("train", user, tmp_path) == [user, "True"]
