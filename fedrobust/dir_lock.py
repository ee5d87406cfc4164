"""One run per checkpoint directory: an advisory lock held while a run writes there.

Two runs on one directory (a requeued job while the first is still stopping, a stale Flower run that
starts next to a new one) would each prune and overwrite the other's checkpoints. The lock is
``flock`` on a file in the directory, so the kernel drops it when the last process holding it ends,
however it ends (kill -9 included): the run's process, or a child it forked (a fork shares the lock).
Local directories only; object stores have no such lock, and a file system without ``flock`` (some NFS,
Lustre or FUSE mounts) runs unlocked, with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".run.lock"

log = logging.getLogger(__name__)

# flock's answers on a file system that has no locks: run unlocked rather than not at all.
_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


class DirectoryInUseError(RuntimeError):
    """Another run holds the directory's lock (the message names it): try again once it has ended."""


class DirectoryLock:
    """The lock of ``directory``: :meth:`acquire` or raise, :meth:`release` (also on process exit)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`DirectoryInUseError` naming who holds it.

        Raises
        ------
        DirectoryInUseError
            Another process (or another run in this one) holds it.
        """
        if self._fd is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:  # 0o666: the umask decides, so a group-shared directory stays usable by the group
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except PermissionError:  # another user's lock file: flock needs no write access
            fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise DirectoryInUseError(
                f"{self.path.parent} is in use by another run ({holder}): two runs on one checkpoint directory "
                "would overwrite each other's checkpoints. Wait for it or stop it, or give this run a "
                "directory of its own"
            ) from None
        except OSError as err:
            os.close(fd)
            if err.errno not in _NO_LOCKS:
                raise
            log.warning("%s cannot be locked (%s): this run does not keep others out of it", self.path.parent, err)
            return
        except BaseException:
            os.close(fd)
            raise
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        data = json.dumps(me).encode()
        try:
            os.pwrite(fd, data, 0)  # the holder first, then the tail cut: a reader never sees an empty file
            os.ftruncate(fd, len(data))
        except OSError:
            pass  # opened read-only: the lock holds, only its holder is not written
        self._fd = fd

    def release(self) -> None:
        """Give the lock back (the file stays: removing it would race with a process taking it)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _read_holder(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        pid, host, since = int(holder["pid"]), str(holder["host"]), str(holder["since"])
    except (OSError, ValueError, KeyError, TypeError):
        return "its process is unknown"
    if host == socket.gethostname() and pid == os.getpid():
        return f"another run in this process, since {since}"
    if host == socket.gethostname() and not pid_alive(pid):
        return f"pid {pid} on {host}, since {since}, has ended: a process it forked still holds the lock"
    return f"pid {pid} on {host}, since {since}"


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
