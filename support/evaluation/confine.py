"""How does a process shut itself in for good, with only what the kernel enforces?

apply(readable, writable, owned) confines the calling process irreversibly: under root uid and gid 65534 (nobody), no
new privileges, Landlock (read and execute beneath `readable`, also write beneath `writable`, nothing else) and a
seccomp filter refusing the system calls of the tables below; docs/internals.md and docs/support.md have the details.
Where the kernel cannot, Unavailable: nothing is changed when Landlock, the architecture or a second thread is the
reason; a later failure leaves the process half confined, and its caller must end it without running the code.
"""

import ctypes
import os
import struct
import sys

NOBODY = 65534  # the unprivileged uid and gid a root process becomes

LIBC = ctypes.CDLL(None, use_errno=True)  # the C library already loaded in this process
LIBC.syscall.restype = ctypes.c_long

# Landlock (include/uapi/linux/landlock.h). The three system calls have the same numbers on every architecture.
CREATE_RULESET, ADD_RULE, RESTRICT_SELF = 444, 445, 446
RULESET_VERSION, RULE_PATH_BENEATH = 1, 1
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
MAKE_CHAR, MAKE_DIR, MAKE_BLOCK = 1 << 6, 1 << 7, 1 << 11
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3 and 5
FS_ABI1 = (1 << 13) - 1  # the 13 rights of ABI 1: execute, write, read, read a directory, remove and make each kind
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV  # the rights a rule on a file (not a dir) takes
NET_TCP = 0b11  # ABI 4: bind and connect TCP
SCOPES = 0b11  # ABI 6: abstract UNIX sockets and signals, kept within the process

# seccomp (include/uapi/linux/seccomp.h, filter.h, audit.h)
PR_SET_KEEPCAPS, PR_SET_NO_NEW_PRIVS = 8, 38
SET_MODE_FILTER, FILTER_FLAG_TSYNC = 1, 1
KILL_PROCESS, ERRNO, ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
EPERM, ENOSYS = 1, 38
LD, JEQ, JGT, AND, RET = 0x20, 0x15, 0x25, 0x54, 0x06  # BPF_LD|W|ABS, JMP|JEQ|K, JMP|JGT|K, ALU|AND|K, RET|K
NR, ARCH, ARG0, ARG1 = 0, 4, 16, 24  # offsets in struct seccomp_data; an argument is 64 bits, the low half first
CLONE_THREAD = 0x00010000
CLONE_NAMESPACES = 0x7E020000  # CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
NEWEST = 470  # listns, Linux 6.18's newest system call: anything numbered past it answers ENOSYS

# {machine: (its AUDIT_ARCH, its column in the tables below)}
ARCHES = {"x86_64": (0xC000003E, 0), "aarch64": (0xC00000B7, 1)}
# name: (x86_64, aarch64). aarch64 has only the *at forms of the old path calls: None where there is no such call.
REFUSED = {  # these answer EPERM
    # new processes and programs (clone is allowed for threads, below)
    "fork": (57, None), "vfork": (58, None), "execve": (59, 221), "execveat": (322, 281),
    # sockets of every family
    "socket": (41, 198), "socketpair": (53, 199),
    # other processes: debugging, memory, handles, a signal to one thread of any process, priorities
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "process_madvise": (440, 440), "kcmp": (312, 272), "pidfd_open": (434, 434), "pidfd_getfd": (438, 438),
    "pidfd_send_signal": (424, 424), "tkill": (200, 130), "move_pages": (279, 239), "migrate_pages": (256, 238),
    "setpriority": (141, 140), "ioprio_set": (251, 30), "syslog": (103, 116),
    # System V IPC and POSIX message queues: objects shared with every process of the machine, outside the files
    "shmget": (29, 194), "shmat": (30, 196), "shmctl": (31, 195), "shmdt": (67, 197), "semget": (64, 190),
    "semop": (65, 193), "semctl": (66, 191), "semtimedop": (220, 192), "msgget": (68, 186), "msgsnd": (69, 189),
    "msgrcv": (70, 188), "msgctl": (71, 187), "mq_open": (240, 180), "mq_unlink": (241, 181),
    "mq_timedsend": (242, 182), "mq_timedreceive": (243, 183), "mq_notify": (244, 184), "mq_getsetattr": (245, 185),
    # namespaces and mounts
    "unshare": (272, 97), "setns": (308, 268), "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41),
    "chroot": (161, 51), "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430),
    "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442),
    "statmount": (457, 457), "listmount": (458, 458), "open_tree_attr": (467, 467), "listns": (470, 470),
    # what Landlock does not govern: modes, owners, extended attributes, times, truncation by path, file handles,
    # watching files, quotas
    "chmod": (90, None), "fchmod": (91, 52), "fchmodat": (268, 53), "fchmodat2": (452, 452),
    "chown": (92, None), "fchown": (93, 55), "lchown": (94, None), "fchownat": (260, 54),
    "setxattr": (188, 5), "lsetxattr": (189, 6), "fsetxattr": (190, 7), "setxattrat": (463, 463),
    "removexattr": (197, 14), "lremovexattr": (198, 15), "fremovexattr": (199, 16), "removexattrat": (466, 466),
    "file_setattr": (469, 469), "utime": (132, None), "utimes": (235, None), "futimesat": (261, None),
    "utimensat": (280, 88), "truncate": (76, 45), "open_by_handle_at": (304, 265), "inotify_add_watch": (254, 27),
    "fanotify_init": (300, 262), "fanotify_mark": (301, 263), "quotactl": (179, 60), "quotactl_fd": (443, 443),
    # kernel facilities that reach past the process, or past this filter
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218), "bpf": (321, 280),
    "perf_event_open": (298, 241), "userfaultfd": (323, 282), "uselib": (134, None),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    # memory files: RAM outside the address-space limit, bounded only by the number of open files
    "memfd_create": (319, 279), "memfd_secret": (447, 447),
}  # fmt: skip
ON_ITSELF = {  # allowed only when the first argument (a pid) is 0 or this process's own pid; else EPERM
    "kill": (62, 129), "tgkill": (234, 131), "rt_sigqueueinfo": (129, 138), "rt_tgsigqueueinfo": (297, 240),
    "prlimit64": (302, 261), "sched_setaffinity": (203, 122), "sched_setscheduler": (144, 119),
    "sched_setparam": (142, 118), "sched_setattr": (314, 274),
}  # fmt: skip
COMMANDS = {  # refused (EPERM) when the second argument is one of these
    "fcntl": ((72, 25), (8, 15)),  # F_SETOWN, F_SETOWN_EX: a file's SIGIO aimed at another process
    # FIOSETOWN, SIOCSPGRP (the same by ioctl); FS_IOC_SETFLAGS, its 32-bit twin, FS_IOC_FSSETXATTR (a file's flags)
    "ioctl": ((16, 29), (0x8901, 0x8902, 0x40086602, 0x40046602, 0x401C5820)),
}
CLONE, CLONE3 = (56, 220), (435, 435)  # clone: threads only (below); clone3: ENOSYS
SECCOMP, CAPSET = (317, 277), (126, 91)  # what apply() itself calls


class Unavailable(Exception):
    """The kernel (or this machine) cannot confine the process; the message says what is missing."""


def syscall(number: int, *args) -> int:
    """A raw system call; integers are passed as C longs, buffers and None as pointers. OSError on failure."""
    result = LIBC.syscall(ctypes.c_long(number), *(ctypes.c_long(a) if isinstance(a, int) else a for a in args))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def prctl(option: int, value: int):
    """prctl(option, value), OSError on failure (os has no prctl)."""
    if LIBC.prctl(ctypes.c_int(option), ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def machine() -> tuple[int, int]:
    """(AUDIT_ARCH, table column) of this machine; Unavailable where there is no table for it."""
    name = os.uname().machine
    if sys.platform != "linux" or name not in ARCHES:
        raise Unavailable(f"Landlock and seccomp confinement needs Linux on x86_64 or aarch64; this is {sys.platform} "
                          f"on {name}")  # fmt: skip
    return ARCHES[name]


def landlock_abi() -> int:
    """The Landlock ABI version the running kernel offers; Unavailable without one."""
    try:
        return syscall(CREATE_RULESET, None, 0, RULESET_VERSION)
    except OSError as e:
        if e.errno == 95:  # EOPNOTSUPP: built in, not enabled at boot
            raise Unavailable("Landlock is in this kernel but not enabled: add landlock to the lsm= boot parameter "
                              "(see /sys/kernel/security/lsm)") from None  # fmt: skip
        raise Unavailable(f"Landlock is not in this kernel ({e.strerror}): it needs Linux >= 5.13 built with "
                          "CONFIG_SECURITY_LANDLOCK") from None  # fmt: skip


def handled(abi: int) -> tuple[int, int, int]:
    """(file rights, network rights, scopes) an ABI knows: all of them are denied but where a rule allows."""
    fs = FS_ABI1 | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0) | (IOCTL_DEV if abi >= 5 else 0)
    return fs, NET_TCP if abi >= 4 else 0, SCOPES if abi >= 6 else 0


def landlock(abi: int, readable: list[str], writable: list[str]):
    """Restrict this thread (and every thread and process it starts later) to the two lists of paths."""
    fs, net, scoped = handled(abi)
    attr = struct.pack("=QQQ", fs, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]  # the ABI's struct size
    ruleset = syscall(CREATE_RULESET, ctypes.create_string_buffer(attr, len(attr)), len(attr), 0)
    try:
        read = EXECUTE | READ_FILE | READ_DIR
        # all but devices, exec (refused anyway) and directories (a huge tree would stall the work directory's removal)
        write = fs & ~(EXECUTE | MAKE_CHAR | MAKE_BLOCK | MAKE_DIR)
        for paths, rights in ((readable, read), (writable, write)):
            for path in paths:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                try:
                    allowed = rights if os.path.isdir(path) else rights & FILE_RIGHTS
                    rule = struct.pack("=Qi", allowed & fs, fd)  # struct landlock_path_beneath_attr, packed
                    syscall(ADD_RULE, ruleset, RULE_PATH_BENEATH, ctypes.create_string_buffer(rule, len(rule)), 0)
                finally:
                    os.close(fd)
        syscall(RESTRICT_SELF, ruleset, 0)
    finally:
        os.close(ruleset)


def bpf(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    """One BPF instruction (struct sock_filter); jt and jf count the instructions skipped when true and false."""
    return struct.pack("=HBBI", code, jt, jf, k)


def when(number: int | None, body: list[bytes]) -> list[bytes]:
    """`body` runs for the system call `number`; any other skips it. Every body ends in RET, so A is free to reuse."""
    return [] if number is None else [bpf(JEQ, number, 0, len(body))] + body


def seccomp_program(audit_arch: int, column: int, pid: int) -> list[bytes]:
    """The filter: the architecture checked, then the tables above, in BPF."""
    program = [bpf(LD, ARCH), bpf(JEQ, audit_arch, 1, 0), bpf(RET, KILL_PROCESS)]  # another ABI (i386 on x86_64)
    program += [bpf(LD, NR), bpf(JGT, NEWEST, 0, 1), bpf(RET, ERRNO | ENOSYS)]  # x32's numbers included
    for numbers in REFUSED.values():
        program += when(numbers[column], [bpf(RET, ERRNO | EPERM)])
    # clone3's flags are in memory, which BPF cannot read: ENOSYS, and the C library falls back to clone, whose flags
    # are an argument. A thread shares the process (CLONE_THREAD) and enters no new namespace.
    program += when(CLONE3[column], [bpf(RET, ERRNO | ENOSYS)])
    thread = [bpf(LD, ARG0), bpf(AND, CLONE_THREAD | CLONE_NAMESPACES), bpf(JEQ, CLONE_THREAD, 0, 1)]
    program += when(CLONE[column], thread + [bpf(RET, ALLOW), bpf(RET, ERRNO | EPERM)])
    on_itself = [
        bpf(LD, ARG0 + 4), bpf(JEQ, 0, 0, 4),  # the high half of a pid that is 0 or ours is 0 (-1 is not)
        bpf(LD, ARG0), bpf(JEQ, 0, 1, 0), bpf(JEQ, pid, 0, 1),
        bpf(RET, ALLOW), bpf(RET, ERRNO | EPERM),
    ]  # fmt: skip
    for numbers in ON_ITSELF.values():
        program += when(numbers[column], on_itself)
    for numbers, commands in COMMANDS.values():  # the command is an unsigned int: its low half is all of it
        jumps = [bpf(JEQ, command, len(commands) - i, 0) for i, command in enumerate(commands)]  # to the EPERM
        program += when(numbers[column], [bpf(LD, ARG1), *jumps, bpf(RET, ALLOW), bpf(RET, ERRNO | EPERM)])
    return program + [bpf(RET, ALLOW)]


def seccomp(audit_arch: int, column: int):
    """Install the filter on every thread of this process, for good."""
    program = b"".join(seccomp_program(audit_arch, column, os.getpid()))

    class Program(ctypes.Structure):  # struct sock_fprog
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    instructions = ctypes.create_string_buffer(program, len(program))
    fprog = Program(len(program) // 8, ctypes.addressof(instructions))
    syscall(SECCOMP[column], SET_MODE_FILTER, FILTER_FLAG_TSYNC, ctypes.byref(fprog))


def drop_root(owned: list[str], reachable: list[str], column: int):
    """Under root: hand `owned` to nobody and become nobody, with no capability but CAP_DAC_READ_SEARCH, and that
    only where nobody could not reach all of `reachable` by its path (the interpreter's files, the directory)."""
    if os.geteuid() != 0:
        return
    for path in owned:
        os.chown(path, NOBODY, NOBODY)
    prctl(PR_SET_KEEPCAPS, 1)  # the permitted capabilities survive setresuid; capset below keeps at most one
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
    reach = all(os.access(p, os.R_OK | (os.X_OK if os.path.isdir(p) else 0)) for p in reachable)  # as nobody now
    keep = 0 if reach else 1 << 2  # CAP_DAC_READ_SEARCH
    header = struct.pack("=Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = struct.pack("=6I", keep, keep, 0, 0, 0, 0)  # effective, permitted, inheritable; the upper 32 all clear
    syscall(CAPSET[column], ctypes.create_string_buffer(header, 8), ctypes.create_string_buffer(data, 24))


def apply(readable: list[str], writable: list[str], owned: list[str]) -> int:
    """Confine this process for good (the file docstring); the Landlock ABI in force, or Unavailable with the reason."""
    audit_arch, column = machine()
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:  # Landlock binds the calling thread only: every other one would stay free
        raise Unavailable(f"the process to confine has {threads} threads, not 1")
    abi = landlock_abi()
    for step, act in (
        ("becoming uid 65534", lambda: drop_root(owned, readable + writable, column)),
        ("PR_SET_NO_NEW_PRIVS", lambda: prctl(PR_SET_NO_NEW_PRIVS, 1)),
        (f"Landlock (ABI {abi})", lambda: landlock(abi, readable, writable)),
        ("the seccomp filter (needs CONFIG_SECCOMP_FILTER)", lambda: seccomp(audit_arch, column)),
    ):
        try:
            act()
        except OSError as e:
            raise Unavailable(f"{step} failed: {e.strerror}" + (f" ({e.filename})" if e.filename else "")) from None
    return abi
