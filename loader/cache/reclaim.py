"""Reclaim what a killed loader left behind: shared-memory segments and disk-tier directories.

Each segment (`prescient_<pid>_<random>` in /dev/shm) and directory (`prescient-<pid>-<random>`
under cache_disk) has an owner file that its loader holds an exclusive flock on for as long
as it lives: the segment itself, and `OWNER_FILE` inside a directory. The kernel drops the
lock when the last process holding it ends, however it ends (its forked workers hold it
too, so a segment outlives the main process only while they do). A clean exit, an
exception or garbage collection removes segment and directory, and the resource tracker
unlinks a segment when the owner is SIGKILLed; only a killed tracker (OOM killer, a killed
process group) or a SIGKILLed disk tier leaves something behind. The next loader to start
removes what nobody locks.

The pid in the name is for people only. Judged by pid, a loader would remove the live
segments of a loader in another PID namespace (another container on the node: the pid
means nothing here) and the live directories of another node on a shared cache_disk; a
lock means the same to every process that can see the file (flock works across NFS
clients through the lock manager). Where the filesystem has no flock at all, the owner
goes on unlocked and no reclaimer removes anything there (its own flock fails too).

The owner locks right after creating: a reclaimer that gets in between removes a name
whose creator then finds it gone (another inode, or none, under its name) and creates
another. A directory's owner file is created exclusively (O_EXCL) by its loader, or by a
reclaimer that finds a directory without one: whoever creates it owns the directory.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Callable
from functools import partial
from multiprocessing import resource_tracker, shared_memory

SHM_DIR = "/dev/shm"
OWNER_FILE = ".owner"  # in each disk-tier directory: the file its loader keeps locked


def _lock(fd: int, wait: bool) -> bool | None:
    """True: locked; False: someone else holds it; None: this filesystem has no flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        return True
    except BlockingIOError:
        return False
    except OSError as error:
        if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
            return None
        raise


def _same_file(path: str, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def create_segment(prefix: str, size: int) -> tuple[shared_memory.SharedMemory, int]:
    """A new segment `<prefix><pid>_<random>` of `size` bytes, and the fd of its held lock (close
    it after unlinking the segment)."""
    while True:
        name = f"{prefix}{os.getpid()}_{secrets.token_hex(6)}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # reclaimed before it could be opened
            fd = None
        if fd is not None and _lock(fd, wait=True) is not False and _same_file(path, fd):
            return shm, fd
        if fd is not None:
            os.close(fd)
        shm.close()
        resource_tracker.unregister(shm._name, "shared_memory")  # the name is no longer ours


def create_directory(root: str, prefix: str) -> tuple[str, int]:
    """A new directory `<root>/<prefix><pid>-<random>`, and the fd of its owner file's held lock
    (close it after removing the directory)."""
    while True:
        path = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=root)
        owner = os.path.join(path, OWNER_FILE)
        try:
            fd = os.open(owner, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except (FileNotFoundError, FileExistsError):  # a reclaimer took the directory first
            continue
        if _lock(fd, wait=True) is not False and _same_file(owner, fd):
            return path, fd
        os.close(fd)


def release(fd: int | None) -> None:
    """Drop an owner lock (after the segment or directory is gone)."""
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def _unlocked(path: str) -> int | None:
    """An fd holding the lock of `path` when nobody else held it; None when someone does (or the
    file is gone, or this filesystem has no flock)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    if _lock(fd, wait=False):
        return fd
    os.close(fd)
    return None


def _matching(root: str, pattern: str) -> list[str]:
    """The names in `root` that fullmatch `pattern`; none when `root` cannot be listed."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    regex = re.compile(pattern)
    return [name for name in names if regex.fullmatch(name)]


def _remove_owned(owner: str, fd: int, remove: Callable[[], object]) -> bool:
    """remove() if `owner` is still the file whose lock `fd` holds (not a newer one under its name); closes
    fd. Whether it removed."""
    try:
        if _same_file(owner, fd):
            remove()
            return True
    except OSError:  # its tracker got there first, or not ours to remove
        pass
    finally:
        os.close(fd)
    return False


def reclaim_shared_memory(prefix: str) -> list[str]:
    """Unlink /dev/shm segments named `<prefix><pid>_...` that no process locks; the names removed."""
    removed = []
    for name in _matching(SHM_DIR, re.escape(prefix) + r"\d+_[0-9a-f]+"):
        path = os.path.join(SHM_DIR, name)
        fd = _unlocked(path)
        if fd is not None and _remove_owned(path, fd, partial(os.unlink, path)):
            removed.append(name)
    return removed


def reclaim_directories(root: str, prefix: str) -> list[str]:
    """Remove directories under `root` named `<prefix><pid>-...` whose owner file no process locks
    (or that have none: a loader killed while creating it, or one older than owner files); the
    paths removed."""
    removed = []
    for name in _matching(root, re.escape(prefix) + r"\d+-.+"):
        path = os.path.join(root, name)
        if not os.path.isdir(path) or os.path.islink(path):
            continue
        owner = os.path.join(path, OWNER_FILE)
        try:  # no owner file yet: take the directory as its owner would, whoever creates the file wins
            fd = os.open(owner, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            if not _lock(fd, wait=False):
                os.close(fd)
                continue
        except FileExistsError:
            fd = _unlocked(owner)
        except OSError:
            continue
        if fd is not None and _remove_owned(owner, fd, partial(shutil.rmtree, path, ignore_errors=True)):
            removed.append(path)
    return removed
