"""The server's own faults, with real processes and real signals.

One reference run goes uninterrupted. A second run of the same config is stopped with
SIGTERM (it must checkpoint and exit 75), resumed and then killed with SIGKILL at a random
moment (possibly while a checkpoint is being written); its newest checkpoint is then
corrupted, and a last resume must fall back to the previous checkpoint and still end
with final model bytes identical to the reference run's.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedrobust.strategies.errors import EXIT_PREEMPTED
from tests.flower_processes import Proc, descendants, stop

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 6


def _command(run_dir: Path, ckpt_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "experiments.run",
        "num_clients=5",
        "clients_per_round=5",
        f"num_rounds={ROUNDS}",
        "num_byzantine=1",
        "aggregator=trimmed_mean",
        f"checkpoint.dir={ckpt_dir}",
        f"hydra.run.dir={run_dir}",
    ]


def _start(run_dir: Path, ckpt_dir: Path, log: Path) -> Proc:
    env = {**os.environ, "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    with log.open("ab") as out:
        popen = subprocess.Popen(
            _command(run_dir, ckpt_dir), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Proc(name=log.stem, popen=popen, log_path=log)


def _wait_for(proc: Proc, text: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in proc.log_path.read_text(errors="replace"):
            return
        if not proc.alive():
            pytest.fail(f"{proc.name} exited {proc.popen.returncode} before {text!r}:\n{proc.tail()}")
        time.sleep(0.1)
    pytest.fail(f"{proc.name}: no {text!r} after {timeout} s:\n{proc.tail()}")


def _finish(proc: Proc, timeout: float = 240.0) -> int:
    try:
        return proc.popen.wait(timeout=timeout)
    finally:
        stop(proc)


def _rounds(ckpt_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in ckpt_dir.glob("round-*") if (p / "manifest.json").exists())


def test_sigterm_then_kill9_then_corruption_still_resume_to_identical_bytes(tmp_path: Path) -> None:
    reference = _start(tmp_path / "ref", tmp_path / "ref-ckpt", tmp_path / "ref.log")
    assert _finish(reference) == 0, reference.tail()
    expected = (tmp_path / "ref" / "final_model.safetensors").read_bytes()

    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    # 1. Preemption: SIGTERM after round 2 -> checkpoint written, exit code 75.
    first = _start(run_dir, ckpt, tmp_path / "first.log")
    _wait_for(first, "[round   2/")
    first.popen.send_signal(signal.SIGTERM)
    assert _finish(first) == EXIT_PREEMPTED, first.tail()
    assert "checkpoint written" in first.log_path.read_text()
    stopped_at = max(_rounds(ckpt))
    assert stopped_at >= 2

    # 2. Resume, then kill -9 the whole process tree at a random moment after round 4 began.
    second = _start(run_dir, ckpt, tmp_path / "second.log")
    _wait_for(second, f"resumed after round {stopped_at}")
    _wait_for(second, f"[round   {stopped_at + 1}/")
    time.sleep(random.uniform(0.0, 1.5))
    tree = descendants(second.pid)
    os.killpg(second.pid, signal.SIGKILL)
    for pid, _start_time in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _finish(second)
    committed = _rounds(ckpt)
    assert committed and max(committed) > stopped_at

    # 3. Corrupt the newest checkpoint: the resume must detect it and use the one before.
    newest = ckpt / f"round-{max(committed):06d}" / "tensors.safetensors"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    third = _start(run_dir, ckpt, tmp_path / "third.log")
    assert _finish(third) == 0, third.tail()
    log = third.log_path.read_text()
    assert "resumed after round" in log and f"resumed after round {max(committed)}" not in log
    assert (run_dir / "final_model.safetensors").read_bytes() == expected
