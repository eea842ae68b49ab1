"""How is a file (or a directory) written whole?

atomic_write fills a temp file (or directory) in a private folder beside the target, flushes it and renames it over
the target, so a crash or a full disk leaves the old file or the new one, never a part. It gets the mode an ordinary
open() would give (0666 minus the umask); a directory replaces an old one in two renames (a moment with neither).
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
    """write(tmp) into a fresh temp file (directory=True: an empty directory), then put in place; a failed write
    raises one OSError line naming the file, the reason and what was kept."""
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
    except (OSError, RuntimeError, SafetensorError) as e:  # RuntimeError: torch.save's zip writer
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0][:160]
        raise OSError(f"{path}: could not write it ({why}); {kept}") from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # the folder may never have been created
        if lock is not None:
            os.close(lock)


def remove_dead_temps(parent, name):
    """Remove atomic_write's temp folders for `name` whose writer is gone: nobody holds its flock (the kernel drops it
    when the process dies) and nothing in it changed for a minute, so a writer not yet locked is never taken."""
    pattern = re.compile(re.escape(f".{name}.") + r"[0-9a-f]{8}\.tmp")
    for entry in filter(pattern.fullmatch, os.listdir(parent)):
        folder = os.path.join(parent, entry)
        with contextlib.suppress(OSError):  # gone meanwhile, not ours to open, or locked by a live writer
            if time.time() - os.stat(folder).st_mtime < 60:
                continue
            fd = os.open(os.path.join(folder, ".lock"), os.O_CREAT | os.O_WRONLY, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(folder, ignore_errors=True)
            finally:
                os.close(fd)


def write_json(path, obj):
    text = json.dumps(obj, indent=2, ensure_ascii=False) + "\n"
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))  # JSON is UTF-8, whatever the locale


def write_safetensors(path, tensors):
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))


def read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None
