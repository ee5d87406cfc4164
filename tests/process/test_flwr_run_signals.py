"""Preemption under ``flwr run``: real signals to the processes Flower 1.41 runs a simulation in.

``flwr run . <federation>`` only submits the run (``--stream`` then prints its log); the run executes
in ``flower-superlink`` -> ``flower-superexec`` (a session and process group of its own) ->
``flwr-simulation`` (the ServerApp in a thread, Ray's driver in the main thread) -> Ray's
processes (gcs_server, raylet, ClientAppActor workers; all in SuperExec's process group). A
scheduler that stops the job signals these processes (their group, or the one running the
ServerApp), and a SIGTERM to ``flwr run`` itself ends only the CLI. docs/flwr_run.md section 7
describes what each does; this test checks it:

1. SIGTERM to SuperExec's process group (SuperExec, ``flwr-simulation`` and Ray's workers at once),
   sent again every 20 ms until the stop's checkpoint is on disk: ``flwr run --stream`` exits 0,
   every checkpoint verifies and the newest one is the stop's.
2. Resume; SIGTERM to ``flwr-simulation`` alone, again every 20 ms: the same.
3. Resume; SIGTERM to ``flwr run`` itself: it exits -15 (143) and the run goes on to its last round;
   the final model has the bytes of an uninterrupted run (computed in-process: the same ServerApp and
   ClientApp give the same bytes on Flower's engine and on experiments.inprocess).

``checkpoint.every_rounds=0``: checkpoints are written only by a stop and after the last round, so
each one on disk was written by a stop. Two fast tests check the two hooks this relies on without
processes (Flower's exit path waits for the round loop; Ray's SIGTERM handler is replaced).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.process.test_fault_processes import committed, wait_for
from tests.support.flower_processes import (
    FlowerProcesses,
    Proc,
    app_copy,
    descendants,
    executable,
    write_flwr_home,
)
from tests.support.simulation import federation_options

REPO = Path(__file__).resolve().parents[2]
FEDERATION = "fedrobust-sim"
ROUNDS = 6
SETTINGS = {"num_rounds": ROUNDS, "num_clients": 4, "num_byzantine": 1, "clients_per_round": 4,
            "client.local_epochs": 1, "checkpoint.every_rounds": 0}
STOPPED = "is on disk"  # "stopping: the checkpoint of round N is on disk"


def _run_config(out: Path, ckpt: Path, settings: dict[str, object] = SETTINGS) -> str:
    pairs = [f"{k}={v}" for k, v in settings.items()] + [f"output_dir='{out}'", f"checkpoint.dir='{ckpt}'"]
    return " ".join(pairs)


def _flwr_run(fp: FlowerProcesses, out: Path, ckpt: Path, name: str, settings: dict[str, object] = SETTINGS) -> Proc:
    log = fp.tmp_path / f"{name}.log"
    with log.open("ab") as sink:
        popen = subprocess.Popen(
            [executable("flwr"), "run", str(app_copy(REPO, fp.tmp_path / "app")), FEDERATION, "--stream",
             "--run-config", _run_config(out, ckpt, settings)],
            cwd=REPO, env=fp.env(), stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
        )
    return Proc(name=name, popen=popen, log_path=log)


def _superlink(fp: FlowerProcesses) -> Proc:
    link = fp.start_superlink(simulation=True)
    write_flwr_home(fp.tmp_path, FEDERATION, link.address, options=federation_options(SETTINGS["num_clients"]))
    return link


def _simulation_pid(link: Proc) -> int:
    for pid, _ in descendants(link.pid):
        with contextlib.suppress(OSError):
            if b"flwr-simulation" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    raise AssertionError(f"no flwr-simulation under the SuperLink\n{link.tail()}")


def _signal_until_stopped(run: Proc, send: signal.Signals, target: int, *, group: bool) -> None:
    """``send`` to ``target`` (its process group when ``group``) every 20 ms until the stop's checkpoint is on disk."""
    deadline = time.monotonic() + 120
    while STOPPED not in run.log_path.read_text(errors="replace") and run.alive() and time.monotonic() < deadline:
        with contextlib.suppress(ProcessLookupError):
            (os.killpg if group else os.kill)(target, send)
        time.sleep(0.02)


def _rounds_done(out: Path) -> int:
    """The last round in the run's ``metrics.jsonl``: written as each round ends, with no delay.

    The streamed log of ``flwr run --stream`` lags the run by seconds (Flower pushes and pulls it
    periodically), several rounds of this small run: a signal timed by it may land after the last round.
    """
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((json.loads(line)["round"] for line in lines if line.strip()), default=0)


def _wait_for_round(run: Proc, out: Path, server_round: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while _rounds_done(out) < server_round:
        if not run.alive() or time.monotonic() > deadline:
            pytest.fail(f"{run.name}: round {server_round} not done ({_rounds_done(out)})\n{run.tail()}")
        time.sleep(0.02)


def _finish(run: Proc, timeout: float = 120) -> int:
    try:
        return run.popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        run.popen.kill()
        raise AssertionError(f"{run.name}: flwr run did not end\n{run.tail()}") from None


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def every_checkpoint_verifies(ckpt: Path) -> int:
    """Every round-* entry is complete (its files match its manifest); the newest loads. Returns its round."""
    for entry in sorted(ckpt.glob("round-*")):
        manifest = json.loads((entry / "manifest.json").read_text())
        files = manifest["files"]
        assert sorted(p.name for p in entry.iterdir()) == sorted([*files, "manifest.json"]), entry
        for name, expected in files.items():
            data = (entry / name).read_bytes()
            assert len(data) == expected["size"] and hashlib.sha256(data).hexdigest() == expected["sha256"], entry
    return committed(ckpt)


def _reference(tmp_path: Path, settings: dict[str, object] = SETTINGS) -> bytes:
    from experiments.inprocess import run_inprocess
    from fedrobust.config import from_flat

    run_inprocess(from_flat({k: v for k, v in settings.items() if not k.startswith("checkpoint.")}), tmp_path / "ref")
    return (tmp_path / "ref" / "final_model.safetensors").read_bytes()


@pytest.mark.slow(seconds=100)
@pytest.mark.timeout(900)
def test_signals_under_flwr_run_checkpoint_and_resume_to_identical_bytes(tmp_path: Path) -> None:
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    with ThreadPoolExecutor(1) as pool, FlowerProcesses(tmp_path) as fp:
        reference = pool.submit(_reference, tmp_path)

        # 1. SIGTERM to SuperExec's process group: flwr-simulation and Ray's workers at once.
        link = _superlink(fp)
        first = _flwr_run(fp, out, ckpt, "first")
        _wait_for_round(first, out, 1)
        _signal_until_stopped(first, signal.SIGTERM, os.getpgid(_simulation_pid(link)), group=True)
        assert _finish(first) == 0, first.tail()
        log = first.log_path.read_text()
        # The stop's own evidence is on disk: with checkpoint.every_rounds=0 only a stop writes a checkpoint
        # before the last round. Its log line ("... is on disk") is not required: Flower may drop a run's
        # last log lines (push-logs refused once the task has pushed its output).
        assert "received SIGTERM" in log, f"{first.tail()}\n{fp.tails()}"
        stopped_at = every_checkpoint_verifies(ckpt)
        assert 1 <= stopped_at < ROUNDS
        fp.stop(link)  # its SuperExec is gone with the group: a new SuperLink for the next run

        # 2. Resume; SIGTERM to flwr-simulation alone, repeated while the stop writes its checkpoint.
        link = _superlink(fp)
        second = _flwr_run(fp, out, ckpt, "second")
        _wait_for_round(second, out, stopped_at + 1)  # the file holds rounds 1..stopped_at until the resume
        _signal_until_stopped(second, signal.SIGTERM, _simulation_pid(link), group=False)
        assert _finish(second) == 0, second.tail()
        log = second.log_path.read_text()
        assert f"resumed after round {stopped_at}" in log, second.tail()
        assert "received SIGTERM" in log, f"{second.tail()}\n{fp.tails()}"
        resumed_at = every_checkpoint_verifies(ckpt)
        assert stopped_at < resumed_at < ROUNDS

        # 3. Resume; SIGTERM to `flwr run` ends the CLI only: the run goes on to its last round.
        third = _flwr_run(fp, out, ckpt, "third")
        wait_for(third, f"resumed after round {resumed_at}")
        simulation = _simulation_pid(link)
        third.popen.send_signal(signal.SIGTERM)
        assert _finish(third) == -signal.SIGTERM, third.tail()
        deadline = time.monotonic() + 180
        while _running(simulation) and time.monotonic() < deadline:  # SuperExec leaves it a zombie
            time.sleep(0.2)
        assert (out / "final_model.safetensors").exists(), fp.tails()
        expected = reference.result(timeout=300)
    assert every_checkpoint_verifies(ckpt) == ROUNDS
    assert (out / "final_model.safetensors").read_bytes() == expected


STOP_ROUNDS = 40  # 0.4-1 s a round: `flwr stop` (~3 s of CLI, ~1 s to land) stopped a run at round 14-18 here


@pytest.mark.slow(seconds=110)
@pytest.mark.timeout(600)
def test_flwr_stop_checkpoints_ends_the_run_and_resumes_to_identical_bytes(tmp_path: Path) -> None:
    """``flwr stop <run-id>``: the SuperLink marks the run ``finished:stopped`` and revokes the task's token;
    flwr-simulation's next call to it (a log upload after the next log line, at the latest a heartbeat,
    every 17.5-22.5 s) gets 401, on which Flower has the process ``os.kill`` itself with SIGINT. The ServerApp
    then checkpoints the last completed round and ends; no final model. The stop's log line cannot reach
    the run's log any more (every upload is refused). The same ``flwr run`` resumes to the bytes of an
    uninterrupted run."""
    settings = {**SETTINGS, "num_rounds": STOP_ROUNDS}
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"

    def flwr(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([executable("flwr"), *args], cwd=REPO, env=fp.env(), capture_output=True, text=True,
                              timeout=60)

    with ThreadPoolExecutor(1) as pool, FlowerProcesses(tmp_path) as fp:
        link = _superlink(fp)
        first = _flwr_run(fp, out, ckpt, "first", settings)
        _wait_for_round(first, out, 1)
        expected = pool.submit(_reference, tmp_path, settings)  # once Ray is up: the CPUs are the run's till then
        run_id = re.search(r"Successfully started run (\d+)", first.log_path.read_text()).group(1)  # type: ignore[union-attr]
        simulation = _simulation_pid(link)
        stop = flwr("stop", run_id, FEDERATION)
        stopped = time.monotonic()
        assert stop.returncode == 0 and "successfully stopped" in stop.stdout, stop.stdout + stop.stderr
        assert _finish(first, timeout=60) == 0, first.tail()
        while _running(simulation) and time.monotonic() < stopped + 45:  # a heartbeat, then Flower's ~6 s exit
            time.sleep(0.1)
        assert not _running(simulation), f"flwr-simulation still runs 45 s after flwr stop\n{fp.tails()}"
        listed = json.loads(flwr("ls", FEDERATION, "--run-id", run_id, "--format", "json").stdout)
        assert [run["status"] for run in listed["runs"]] == ["finished:stopped"], listed
        # checkpoint.every_rounds=0: a checkpoint before the last round is the stop's
        stopped_at = every_checkpoint_verifies(ckpt)
        assert 1 <= stopped_at < STOP_ROUNDS and _rounds_done(out) == stopped_at
        assert not (out / "final_model.safetensors").exists()

        second = _flwr_run(fp, out, ckpt, "second", settings)  # the same SuperLink: flwr stop leaves SuperExec running
        assert _finish(second, timeout=300) == 0, second.tail()
        assert f"resumed after round {stopped_at}" in second.log_path.read_text(), second.tail()
        assert every_checkpoint_verifies(ckpt) == STOP_ROUNDS
        assert (out / "final_model.safetensors").read_bytes() == expected.result(timeout=300)


def test_flower_exit_path_requests_the_stop_and_waits_for_the_round_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """What flwr-simulation's main thread does on SIGINT/SIGTERM (Flower's exit handlers, before its
    force-exit timer) asks the round loop to stop and returns only once the loop has ended."""
    from flwr.supercore.exit import exit_handler

    from fedrobust.strategies import stopping

    monkeypatch.setattr(exit_handler, "registered_exit_handlers", [])
    monkeypatch.setattr(stopping, "_set_handler", lambda *_: None)  # leave pytest's SIGTERM/SIGINT handlers alone
    stop = threading.Event()
    ended_at: list[float] = []
    watch = stopping.FlowerExitWatch(stop.set)

    def round_loop() -> None:  # ends 0.3 s after the stop request, as after writing a checkpoint
        stop.wait(10)
        time.sleep(0.3)
        ended_at.append(time.monotonic())
        watch.finish()

    assert watch.start()
    loop = threading.Thread(target=round_loop)
    loop.start()
    watch.loop_thread = loop.ident  # the watch belongs to the loop's thread; Flower's exit runs in this one
    exit_handler.trigger_exit_handlers(run_before_force_exit=True)
    returned_at = time.monotonic()
    loop.join()
    assert stop.is_set() and ended_at and returned_at >= ended_at[0]


def test_sigterm_handler_ray_installs_in_flwr_simulation_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """In flwr-simulation, the SIGTERM handler Ray's init installs becomes the one that takes Flower's exit path."""
    from fedrobust.strategies import stopping

    installed: list[tuple[int, object]] = []
    monkeypatch.setattr(stopping, "_set_handler", lambda signum, handler: installed.append((signum, handler)))
    monkeypatch.setattr(signal, "signal", stopping._set_handler)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/flwr-simulation", "--token", "x"])
    stopping._chain_ray_sigterm_handler()

    def ray_handler(signum: int, frame: object) -> None:  # as ray._private.worker.init's
        raise SystemExit(signum)

    ray_handler.__module__ = "ray._private.worker"

    def other(signum: int, frame: object) -> None:
        pass

    signal.signal(signal.SIGTERM, ray_handler)
    signal.signal(signal.SIGTERM, other)
    signal.signal(signal.SIGINT, ray_handler)
    assert installed == [
        (signal.SIGTERM, stopping._on_sigterm_under_flwr_simulation),
        (signal.SIGTERM, other),
        (signal.SIGINT, ray_handler),
    ]
