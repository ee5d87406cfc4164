"""Hydra runs as real processes: start one in a session of its own, wait for a log line, kill its tree,
and check the checkpoints it left on disk."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedrobust.checkpoint import CheckpointStore
from fedrobust.dir_lock import LOCK_FILE
from tests.support.flower_processes import Proc, descendants, stop

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 6


def run_overrides(*overrides: str, rounds: int = ROUNDS) -> list[str]:
    """The experiment every Hydra process test runs: 5 clients (one Byzantine), then ``overrides``.

    Each client asks for every core, so Ray starts one ClientApp actor, not one per core (why:
    tests/support/simulation.py); :func:`start` keeps it on one thread, as the in-process reference.
    """
    return [
        "num_clients=5",
        "clients_per_round=5",
        f"num_rounds={rounds}",
        "num_byzantine=1",
        "aggregator=trimmed_mean",
        f"simulation.client_cpus={os.cpu_count() or 1}",
        *overrides,
    ]


def hydra_command(run_dir: Path, ckpt_dir: Path, *overrides: str, rounds: int = ROUNDS) -> list[str]:
    """The Hydra entry point on :func:`run_overrides`, checkpointing every round into ``ckpt_dir``."""
    return [
        sys.executable,
        "-m",
        "experiments.run",
        *run_overrides(*overrides, rounds=rounds),
        f"checkpoint.dir={ckpt_dir}",
        f"hydra.run.dir={run_dir}",
    ]


def uninterrupted_final_bytes(out_dir: Path, *overrides: str, rounds: int = ROUNDS) -> bytes:
    """The final model of an uninterrupted run of the same experiment, without checkpoints.

    Hydra composes the config as ``python -m experiments.run`` does; the run goes through the same
    ServerApp loop and ClientApp in this process (``experiments.inprocess``), not on Ray: the bytes
    are the same on both transports, so a resumed Hydra run that matches them matches an
    uninterrupted Hydra run, and the test does not pay for one more Ray cluster.
    """
    from hydra import compose, initialize_config_dir

    from experiments.inprocess import run_inprocess
    from experiments.run import to_run_config, with_parameter_tables

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=with_parameter_tables(run_overrides(*overrides, rounds=rounds)))
    run_inprocess(to_run_config(cfg), out_dir)
    return (out_dir / "final_model.safetensors").read_bytes()


def start(command: list[str], log: Path) -> Proc:
    """``command`` in a session of its own: its pid is its process group's id, as a batch job's."""
    env = {
        **os.environ,
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        # Ray would give an actor of N CPUs N threads; one keeps the bytes of the in-process reference.
        "OMP_NUM_THREADS": "1",
    }
    with log.open("ab") as out:
        popen = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Proc(name=log.stem, popen=popen, log_path=log)


def wait_for(proc: Proc, text: str, timeout: float = 240.0) -> None:
    """Until ``text`` is in the process's log (fails when it exits first or after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in proc.log_path.read_text(errors="replace"):
            return
        if not proc.alive():
            pytest.fail(f"{proc.name} exited {proc.popen.returncode} before {text!r}:\n{proc.tail()}")
        time.sleep(0.05)
    pytest.fail(f"{proc.name}: no {text!r} after {timeout} s:\n{proc.tail()}")


def finish(proc: Proc, timeout: float = 300.0) -> int:
    """The exit code (the process and what it left behind are stopped in any case)."""
    try:
        return proc.popen.wait(timeout=timeout)
    finally:
        stop(proc)


def kill_tree(proc: Proc) -> None:
    """SIGKILL to the process's group and to every descendant (Ray's processes start sessions of their own)."""
    tree = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    for pid, _start_time in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def rounds_on_disk(ckpt_dir: Path) -> list[int]:
    """Rounds with a checkpoint directory, after checking that none lacks its manifest (half-written)."""
    dirs = sorted(ckpt_dir.glob("round-*"))
    assert all((p / "manifest.json").exists() for p in dirs), [p.name for p in dirs]
    return [int(p.name.split("-")[1]) for p in dirs]


def committed(ckpt_dir: Path, kept_aside: int = 0) -> int:
    """The newest round, after checking that every entry is a complete checkpoint (or one of the
    ``kept_aside`` checkpoints a resume found corrupt and moved aside) and the newest verifies."""
    entries = sorted(p.name for p in ckpt_dir.iterdir() if p.name != LOCK_FILE)  # the run's lock stays, by design
    aside = [name for name in entries if name.startswith("aside-")]
    assert len(aside) == kept_aside, f"checkpoints kept aside: {aside}"
    entries = [name for name in entries if name not in aside]
    assert all(name.startswith("round-") for name in entries), f"half-written or leftover entries: {entries}"
    rounds = rounds_on_disk(ckpt_dir)
    newest = CheckpointStore(str(ckpt_dir)).latest_valid()
    assert newest is not None and newest.round == rounds[-1], entries
    return newest.round
