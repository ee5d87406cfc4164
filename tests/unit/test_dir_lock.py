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
