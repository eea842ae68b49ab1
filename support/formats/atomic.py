"""How is a file (or a directory) written whole?

Every file the project writes, and the converted model directory, goes through atomic_write: the writer fills a
fresh temporary file (or directory) in a private folder beside the target, the result is flushed to disk and then
renamed over the old one (os.replace is atomic on POSIX), so a crash or a full disk leaves either the old file or the
new one, never a part of either. The temporary file is created with the permissions of an ordinary open() (0666 minus
the umask), so adapters and checkpoints stay readable to the other users and containers that serve them. The folder
catches what the writer itself leaves beside its file (safetensors writes its own temp file beside its target), and
its writer holds a lock in it (flock); a process killed mid-write leaves the folder, and a later write of the same
target removes it once nobody holds its lock. A directory (its files flushed, one level deep: the converted model's
layout) replaces an old one in two renames: the old one moves into the private folder first (a rename cannot overwrite
a non-empty directory), so for a moment neither is there.
"""

import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import stat
import time
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import save_file


def atomic_write(path, write, directory=False):
    """write(tmp) into a fresh temp file (directory=True: an empty directory) put in place as the file docstring says;
    a failed write (a full disk, a folder that became read-only) raises one OSError line naming the file, the reason
    and what was kept."""
    path = os.path.abspath(path)  # the folder is removed at the end even if the writer changed directory
    parent, name = os.path.split(path)
    kept = "the previous file is kept" if os.path.exists(path) else "nothing was written"
    folder, lock = os.path.join(parent, f".{name}.{secrets.token_hex(4)}.tmp"), None
    tmp = os.path.join(folder, name)
    try:
        remove_dead_temps(parent, name)
        os.mkdir(folder)
        lock = os.open(os.path.join(folder, ".lock"), os.O_CREAT | os.O_WRONLY, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)  # held while this write lives: how remove_dead_temps tells the dead ones
        if directory:
            os.mkdir(tmp)  # 0777 & ~umask: not mkdtemp, whose 0700 would stick to the published directory
        else:
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # 0666 & ~umask, as open(path, "w")
        mode = os.stat(tmp).st_mode
        write(tmp)
        os.chmod(tmp, mode)  # a writer that recreates the file (safetensors does, as 0600) gets the ordinary mode back
        for file in [tmp] if not directory else [os.path.join(tmp, f) for f in os.listdir(tmp)]:
            if directory:  # the files in it: 0666 & ~umask (the directory's mode less execute), as open() makes them
                os.chmod(file, stat.S_IMODE(mode) & 0o666)
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        if directory and os.path.exists(path):
            os.rename(path, os.path.join(folder, ".old"))  # removed with the folder
        os.replace(tmp, path)
    except BaseException as e:
        if isinstance(e, OSError | RuntimeError | SafetensorError):  # RuntimeError: torch.save's zip writer
            raise OSError(f"{path}: could not write it ({_why(e)}); {kept}") from None
        raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # the folder may never have been created
        if lock is not None:
            os.close(lock)


def remove_dead_temps(parent, name, min_age=60):
    """Remove the temp folders atomic_write left in `parent` for `name` whose writer is gone: nobody holds the folder's
    lock (flock, which the kernel drops when its process dies, across containers too, and NFS shares across hosts) and
    nothing in it changed for a minute (a writer that has made its folder but not yet locked it is never taken). Best
    effort: a folder that cannot be removed (another user's) stays, and the write goes on."""
    pattern = re.compile(re.escape(f".{name}.") + r"[0-9a-f]{8}\.tmp")
    for entry in filter(pattern.fullmatch, os.listdir(parent)):
        folder = os.path.join(parent, entry)
        with contextlib.suppress(OSError):  # gone meanwhile, not ours to open, or locked by a live writer
            if time.time() - os.stat(folder).st_mtime < min_age:
                continue
            fd = os.open(os.path.join(folder, ".lock"), os.O_CREAT | os.O_WRONLY, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(folder, ignore_errors=True)
            finally:
                os.close(fd)


def _why(e):
    """The OS's words for a failed write, or the writer's own first line (safetensors wraps the OS error)."""
    return e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0][:160]


def write_json(path, obj):
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n"))


def write_safetensors(path, tensors):
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None
