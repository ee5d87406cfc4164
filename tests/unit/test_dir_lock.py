"""One run per checkpoint directory: a second process is refused by name, and a killed holder frees it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fedrobust.dir_lock import DirectoryInUseError, DirectoryLock


def holding_process(directory: Path) -> subprocess.Popen[str]:
    code = (
        "import sys, time\n"
        "from fedrobust.dir_lock import DirectoryLock\n"
        f"DirectoryLock({str(directory)!r}).acquire()\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_process_is_refused_naming_the_holder_and_a_killed_holder_leaves_no_stale_lock(
    tmp_path: Path,
) -> None:
    holder = holding_process(tmp_path)
    try:
        with pytest.raises(DirectoryInUseError, match=rf"in use by another run \(pid {holder.pid} on .*, since "):
            DirectoryLock(tmp_path).acquire()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    lock = DirectoryLock(tmp_path)
    lock.acquire()  # the kernel dropped the dead holder's lock
    lock.release()
    again = DirectoryLock(tmp_path)
    again.acquire()  # and a released lock can be taken again
    again.release()


def test_a_file_system_without_flock_runs_unlocked_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """NFS without lockd answers ENOLCK, Lustre without -o flock ENOSYS (not mountable here: flock's answer
    is what differs, so it is the one part replaced)."""
    import errno
    import fcntl
    import logging

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING, logger="fedrobust.dir_lock"):
        DirectoryLock(tmp_path).acquire()  # no error: the run goes on
    assert f"{tmp_path} cannot be locked" in caplog.text


def test_the_lock_file_follows_the_umask_so_a_group_shares_the_directory(tmp_path: Path) -> None:
    old = os.umask(0o002)
    try:
        lock = DirectoryLock(tmp_path)
        lock.acquire()
        lock.release()
    finally:
        os.umask(old)
    assert (tmp_path / ".run.lock").stat().st_mode & 0o777 == 0o664


def test_a_lock_held_by_this_process_is_named_as_such(tmp_path: Path) -> None:
    first = DirectoryLock(tmp_path)
    first.acquire()
    try:
        with pytest.raises(DirectoryInUseError, match=r"in use by another run \(another run in this process"):
            DirectoryLock(tmp_path).acquire()
    finally:
        first.release()


def test_the_lock_is_where_the_store_writes_a_home_relative_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedrobust.strategies.checkpointing import RoundCheckpointer

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    checkpointer = RoundCheckpointer("~/ckpt", settings={}, every_rounds=1, keep=3, resume="auto", force=False)
    checkpointer.claim()
    checkpointer.release()
    assert (tmp_path / "home" / "ckpt" / ".run.lock").is_file()
    assert not (tmp_path / "~").exists()  # not a literal '~' folder in the working directory
