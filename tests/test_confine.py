"""What this file proves about support/evaluation/confine.py: its system-call numbers are the kernel's own for x86_64
and aarch64, and its BPF program is well formed (every jump lands inside it, every path ends in a return); a process
that applied it, in a child interpreter, cannot read, write, create or change files outside its two lists (in a folder
any user may write, so only the kernel stands in the way), cannot fork, exec, open a socket, signal or limit its parent
(nor aim a file's SIGIO at it), make System V shared memory, a memory file, a directory (even inside) or change a
file's flags, and runs as uid 65534 under root, while it reads and
writes within its lists, starts threads, signals itself and gets ENOSYS for a system call newer than the table; where
the kernel lacks Landlock, or the machine has no table, or the process has a second thread, apply() raises Unavailable
naming what is missing, and changes nothing first."""

import json
import os
import re
import subprocess
import sys

import pytest

from support.evaluation import confine, sandbox

HEADERS = {"x86_64": "/usr/include/x86_64-linux-gnu/asm/unistd_64.h", "aarch64": "/usr/include/asm-generic/unistd.h"}
CHILD = """
import json, os, sys, threading
sys.path.insert(0, {root!r})
from support.evaluation import confine
read, write = {read!r}, {write!r}
{before}
abi = confine.apply(read, write, owned=[write[0]])
out = {{"abi": abi, "uid": os.getuid()}}
def attempt(name, act):
    try:
        act()
        out[name] = "ok"
    except OSError as e:
        out[name] = e.errno
attempt("read inside", lambda: open(os.path.join(read[0], "readable.txt")).read())
attempt("write inside", lambda: open(os.path.join(write[0], "new.txt"), "w").write("x"))
attempt("read outside", lambda: open({victim!r}).read())
attempt("write outside", lambda: open({victim!r}, "a").write("x"))
attempt("create outside", lambda: open({marker!r}, "w"))
attempt("list outside", lambda: os.listdir({outside!r}))
attempt("chmod", lambda: os.chmod({victim!r}, 0o600))
attempt("truncate by path", lambda: os.truncate({victim!r}, 0))
attempt("fork", os.fork)
attempt("exec", lambda: os.execv("/bin/true", ["true"]))
attempt("socket", lambda: __import__("socket").socket())
attempt("kill parent", lambda: os.kill(os.getppid(), 0))
attempt("kill all", lambda: os.kill(-1, 0))
attempt("limit parent", lambda: __import__("resource").prlimit(os.getppid(), 7))
attempt("kill self", lambda: os.kill(os.getpid(), 0))
attempt("thread", lambda: [t.start() or t.join() for t in [threading.Thread(target=len, args=("x",))]])
attempt("newer syscall", lambda: confine.syscall(confine.NEWEST + 1))
attempt("clone3", lambda: confine.syscall(confine.CLONE3[0], 0, 0))
import fcntl
r, w = os.pipe()
attempt("SIGIO at the parent", lambda: fcntl.fcntl(r, fcntl.F_SETOWN, os.getppid()))
attempt("System V memory", lambda: confine.syscall(confine.REFUSED["shmget"][confine.machine()[1]], 0, 4096, 0o1666))
attempt("mkdir inside", lambda: os.mkdir(os.path.join(write[0], "d")))
attempt("memfd", lambda: os.memfd_create("m"))
inside = os.open(os.path.join(write[0], "new.txt"), os.O_RDONLY)
attempt("file flags", lambda: fcntl.ioctl(inside, 0x40086602, bytearray(8)))  # FS_IOC_SETFLAGS, flags 0
print(json.dumps(out))
"""


def header_numbers(path) -> dict:
    """{name: number} of a unistd header; asm-generic's __NR3264_ names are the 64-bit ones."""
    text = open(path).read()
    return {name: int(n) for name, n in re.findall(r"#define __NR(?:3264)?_(\w+)\s+(\d+)", text)}


def test_numbers_are_the_kernels():
    """Every number in the tables equals the one the installed kernel headers define for its architecture (a call
    newer than those headers is numbered past their newest), none repeats, none is past NEWEST, and the calls marked
    absent on aarch64 are absent from its header."""
    missing = [p for p in HEADERS.values() if not os.path.isfile(p)]
    if missing:
        pytest.skip(f"the kernel headers are not installed ({missing[0]}; Debian's linux-libc-dev): nothing to check")
    tables = confine.REFUSED | confine.ON_ITSELF
    tables |= {"clone": confine.CLONE, "clone3": confine.CLONE3, "seccomp": confine.SECCOMP, "capset": confine.CAPSET}
    tables |= {name: numbers for name, (numbers, _) in confine.COMMANDS.items()}
    for arch, column in ((a, c) for a, (_, c) in confine.ARCHES.items()):
        kernel = header_numbers(HEADERS[arch])
        newest = max(n for name, n in kernel.items() if name != "syscalls")  # the headers' age
        ours = {name: numbers[column] for name, numbers in tables.items() if numbers[column] is not None}
        assert len(set(ours.values())) == len(ours) and max(ours.values()) <= confine.NEWEST, arch
        for name, number in ours.items():
            assert kernel.get(name) == number or number > newest and name not in kernel, (arch, name, number)
        assert not {n for n, numbers in tables.items() if numbers[column] is None} & set(kernel), arch


def test_filter_is_well_formed():
    """For both architectures: under BPF's 4096 instructions, every jump lands inside the program, and it ends in
    RET ALLOW; the first instructions kill a process of another architecture."""
    for audit_arch, column in confine.ARCHES.values():
        program = confine.seccomp_program(audit_arch, column, pid=1234)
        assert len(program) < 4096
        for pc, instruction in enumerate(program):
            code, jt, jf, _ = confine.struct.unpack("=HBBI", instruction)
            if code in (confine.JEQ, confine.JGT):
                assert pc + 1 + max(jt, jf) < len(program), pc
        assert program[-1] == confine.bpf(confine.RET, confine.ALLOW)
        assert program[2] == confine.bpf(confine.RET, confine.KILL_PROCESS)


def confined_child(tmp_path, before=""):
    """Run CHILD (apply(), then each attempt) in a fresh interpreter; its JSON line, or its error output."""
    base = tmp_path / "base"
    read, write, outside = base / "read", base / "write", base / "outside"
    for d in (base, read, write, outside):
        d.mkdir()
        d.chmod(0o777)  # any user may write here: only the confinement stands in the way
    (read / "readable.txt").write_text("r")
    victim = outside / "victim.txt"
    victim.write_text("secret")
    victim.chmod(0o666)
    roots = sandbox.readable()  # the interpreter's own files
    script = CHILD.format(
        root=os.path.dirname(os.path.dirname(os.path.abspath(confine.__file__))),
        read=[str(read), *roots], write=[str(write), os.devnull], before=before,
        victim=str(victim), marker=str(outside / "pwned"), outside=str(outside),
    )  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    return done, victim


@pytest.mark.skipif(bool(sandbox.confinement()), reason=f"the kernel cannot confine here: {sandbox.confinement()}")
def test_a_confined_process_stays_inside(tmp_path):
    """From inside: what its lists allow works, and everything else answers EACCES (Landlock) or EPERM (seccomp);
    threads and signals to itself work; a newer system call and clone3 answer ENOSYS. From outside: the victim file
    is intact, with its mode, and nothing was created beside it."""
    done, victim = confined_child(tmp_path)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    eacces, eperm, enosys = 13, 1, 38
    assert out["abi"] >= 1 and out["uid"] == (65534 if os.geteuid() == 0 else os.getuid())
    for name in ("read inside", "write inside", "kill self", "thread"):
        assert out[name] == "ok", (name, out[name])
    for name in ("read outside", "write outside", "create outside", "list outside", "mkdir inside"):
        assert out[name] == eacces, (name, out[name])
    for name in ("chmod", "truncate by path", "fork", "exec", "socket", "kill parent", "kill all", "limit parent",
                 "SIGIO at the parent", "System V memory", "memfd", "file flags"):  # fmt: skip
        assert out[name] == eperm, (name, out[name])
    assert out["newer syscall"] == enosys and out["clone3"] == enosys
    assert victim.read_text() == "secret" and victim.stat().st_mode & 0o777 == 0o666
    assert os.listdir(victim.parent) == ["victim.txt"]


def test_a_second_thread_is_refused_before_any_change(tmp_path):
    """A process with a second thread (Landlock would bind only the calling one) gets Unavailable naming the count,
    before apply() changes anything: it still runs as its own user and can still open a socket."""
    before = (
        "import socket, time\nthreading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
        "try:\n    confine.apply(read, write, owned=[write[0]])\nexcept confine.Unavailable as e:\n"
        "    socket.socket().close()\n    print(json.dumps({'refused': str(e), 'uid': os.getuid()}))\n    sys.exit()"
    )
    done, _ = confined_child(tmp_path, before)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out == {"refused": "the process to confine has 2 threads, not 1", "uid": os.getuid()}


def test_missing_mechanisms_are_named(monkeypatch):
    """Landlock not built in (ENOSYS), built in but not enabled (EOPNOTSUPP), and a machine without a table each give
    one line saying what is missing and what would provide it."""

    def failing(errno):
        def syscall(*args):
            raise OSError(errno, os.strerror(errno))

        return syscall

    monkeypatch.setattr(confine, "syscall", failing(38))
    with pytest.raises(confine.Unavailable, match=r"^Landlock is not in this kernel .*Linux >= 5\.13") as e:
        confine.landlock_abi()
    assert "\n" not in str(e.value)
    monkeypatch.setattr(confine, "syscall", failing(95))
    with pytest.raises(confine.Unavailable, match=r"^Landlock .*not enabled.*landlock"):
        confine.landlock_abi()
    monkeypatch.setattr(confine.os, "uname", lambda: os.uname_result(("Linux", "h", "6.18", "#1", "riscv64")))
    with pytest.raises(confine.Unavailable, match=r"x86_64 or aarch64.*riscv64"):
        confine.machine()
