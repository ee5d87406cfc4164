"""One run per checkpoint directory: an advisory lock held while a run writes there.

Two runs on one directory (a requeued job while the first is still stopping, a stale Flower run that
starts next to a new one) would each prune and overwrite the other's checkpoints. The lock is
``flock`` on a file in the directory, so the kernel drops it when its process ends, however it ends
(kill -9 included): a lock is never stale. Local directories only; object stores have no such lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".run.lock"


class DirectoryInUseError(RuntimeError):
    """Another process holds the directory's lock (the message names it)."""


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
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
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
        except BaseException:
            os.close(fd)
            raise
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
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
        return f"pid {holder['pid']} on {holder['host']}, since {holder['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its process is unknown"
