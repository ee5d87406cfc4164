"""``flwr run`` end to end: our own simulation SuperLink, a temp FLWR_HOME, a real app.

This is the second way users run fedrobust (design.md): a ServerApp/ClientApp declared in a
pyproject.toml, packed into a FAB by ``flwr run`` and executed by a SuperLink started with
``--simulation``. The SuperLink is started here (not through a ``:local:`` address, which would
leave a detached SuperLink behind) on a free port, and stopped by pid.

Here: the helpers' plumbing, the run config keys the tests override, and the quickstart example
(a Flower app built on the public API only). The project's own app runs under ``flwr run`` in
tests/integration/test_components.py (from scratch, with a user's components) and
tests/process/test_flwr_run_signals.py (stopped by signals and resumed to the bytes of an
uninterrupted run).
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
import tomllib
from pathlib import Path

import pytest

from tests.support.flower_processes import (
    FlowerProcesses,
    descendants,
    executable,
    write_flwr_home,
)
from tests.support.simulation import federation_options

REPO = Path(__file__).resolve().parents[2]
FEDERATION = "fedrobust-sim"
RUN_TIMEOUT = 240.0  # seconds; a healthy run takes well under a minute


# What the slow tests' `flwr run --run-config` sets on the project's app.
OVERRIDDEN_KEYS = {
    "num_rounds", "num_clients", "num_byzantine", "clients_per_round", "output_dir", "client.local_epochs",
    "checkpoint.dir", "checkpoint.every_rounds", "model._target_", "dataset._target_", "aggregator._target_",
}


def _missing_run_config_keys() -> list[str]:
    """Keys this test overrides that ``[tool.flwr.app.config]`` does not declare."""
    from flwr.common.config import flatten_dict

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    declared = set(flatten_dict(project["tool"]["flwr"]["app"].get("config", {})))
    return sorted(OVERRIDDEN_KEYS - declared)


MISSING_KEYS_MESSAGE = (
    "[tool.flwr.app.config] in pyproject.toml lacks {}: `flwr run . --run-config` can only override "
    "keys declared there (the SuperLink answers '[code: 15] Invalid run configuration.')"
)


def test_write_flwr_home_is_read_by_flower(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The config.toml the helper writes parses as Flower 1.41's CLI reads it."""
    from flwr.cli.flower_config import read_superlink_connection

    home = write_flwr_home(
        tmp_path,
        FEDERATION,
        "127.0.0.1:45678",
        options={"num-supernodes": 5, "backend.client-resources.num-cpus": 1},
    )
    monkeypatch.setenv("FLWR_HOME", str(home))
    conn = read_superlink_connection(None)  # the default connection
    assert conn.name == FEDERATION and conn.address == "127.0.0.1:45678" and conn.insecure
    assert conn.options is not None and conn.options.num_supernodes == 5
    assert conn.options.backend is not None and conn.options.backend.client_resources is not None
    assert conn.options.backend.client_resources.num_cpus == 1

    ca = tmp_path / "ca.crt"
    home = write_flwr_home(tmp_path, "tls", "127.0.0.1:45679", insecure=False, root_certificates=ca,
                           home=tmp_path / "home2")
    monkeypatch.setenv("FLWR_HOME", str(home))
    conn = read_superlink_connection("tls")
    assert not conn.insecure and conn.root_certificates == str(ca) and conn.options is None


def test_stop_ends_children_in_other_sessions(tmp_path: Path) -> None:
    """Like SuperLink -> SuperExec (own session) -> ServerApp: stop() ends all three."""
    import sys

    from tests.support.flower_processes import _spawn, flower_env, stop

    # root (ignores SIGTERM) -> middle (own session, like SuperExec) -> leaf (like the ServerApp)
    (tmp_path / "leaf.py").write_text("import time\ntime.sleep(60)\n")
    (tmp_path / "middle.py").write_text(
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, {str(tmp_path / 'leaf.py')!r}])\n"
        "time.sleep(60)\n"
    )
    (tmp_path / "root.py").write_text(
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"subprocess.Popen([sys.executable, {str(tmp_path / 'middle.py')!r}], start_new_session=True,\n"
        "                 preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))\n"
        "time.sleep(60)\n"
    )
    proc = _spawn("tree", [sys.executable, str(tmp_path / "root.py")], tmp_path, flower_env(), cwd=tmp_path)
    deadline = time.monotonic() + 20
    while len(descendants(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    tree = descendants(proc.pid)
    assert len(tree) == 2, proc.tail()
    stop(proc, timeout=2.0, grace=1.0)
    assert not proc.alive() and proc.popen.returncode == -9  # SIGTERM ignored: SIGKILL after timeout
    assert all(_state(pid) in ("gone", "Z") for pid, _ in tree)


def test_pyproject_declares_the_run_config_keys_flwr_run_overrides() -> None:
    """``flwr run --run-config k=v`` is rejected by the SuperLink unless ``k`` is declared in
    ``[tool.flwr.app.config]`` (flwr.common.config.fuse_dicts(check_keys=True))."""
    missing = _missing_run_config_keys()
    assert not missing, MISSING_KEYS_MESSAGE.format(missing)


@pytest.mark.slow(seconds=25)
@pytest.mark.timeout(360)
def test_quickstart_robust_example_trains_under_flwr_run(tmp_path: Path) -> None:
    """examples/quickstart-robust (a Flower app using only fedrobust's public API) trains offline."""
    out = tmp_path / "out"
    with FlowerProcesses(tmp_path) as fp:
        link = fp.start_superlink(simulation=True)
        write_flwr_home(
            tmp_path, FEDERATION, link.address,
            options=federation_options(4),
        )
        res = subprocess.run(
            [executable("flwr"), "run", str(REPO / "examples" / "quickstart-robust"), FEDERATION, "--stream",
             "--run-config", f"num-server-rounds=3 output-dir='{out}' checkpoint-dir='{tmp_path / 'ckpt'}'"],
            cwd=tmp_path, env=fp.env(), capture_output=True, text=True, timeout=RUN_TIMEOUT,
        )
        report = f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}\n{fp.tails()}"
        assert res.returncode == 0, report
        match = re.search(r"Successfully started run (\d+)", res.stdout)
        assert match, report
        assert _run_status(fp, int(match.group(1))).endswith("completed"), report
        fp.stop(link)
    history = json.loads((out / "history.json").read_text())
    assert sorted(int(r) for r in history) == [0, 1, 2, 3], history
    assert history["3"]["accuracy"] > max(0.5, history["0"]["accuracy"] + 0.3), history  # it trains
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3] and all(r["accepted"] == 4 for r in rows), rows
    assert (out / "rounds.png").read_bytes().startswith(b"\x89PNG")  # the user's app drew its rounds
    assert res.stdout.count("[round   3/3]") == 1, report  # per-round progress reaches the operator's stream, once
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("round-"))[-1] == "round-000003"


@pytest.mark.slow(seconds=40)
@pytest.mark.timeout(360)
def test_a_users_own_app_stops_on_sigterm_with_the_checkpoint_of_its_last_round(tmp_path: Path) -> None:
    """The quickstart, its strategy set to checkpoint only at the end (``checkpoint_every=0``): a SIGTERM to
    ``flwr-simulation`` mid-run makes the user's ServerApp write the checkpoint of its last completed round
    and end, as fedrobust's own app does (tests/process/test_flwr_run_signals.py)."""
    import os
    import shutil
    import signal

    from tests.process.test_flwr_run_signals import _simulation_pid, every_checkpoint_verifies

    app = tmp_path / "app"
    shutil.copytree(REPO / "examples" / "quickstart-robust", app)
    server = app / "quickstart_robust" / "server_app.py"
    call = "    strategy = RobustStrategy(\n"
    assert server.read_text().count(call) == 1
    server.write_text(server.read_text().replace(call, call + "        checkpoint_every=0,\n"))
    ckpt, log = tmp_path / "ckpt", tmp_path / "run.log"
    with FlowerProcesses(tmp_path) as fp:
        link = fp.start_superlink(simulation=True)
        write_flwr_home(tmp_path, FEDERATION, link.address, options=federation_options(4))
        with log.open("wb") as sink:
            run = subprocess.Popen(
                [executable("flwr"), "run", str(app), FEDERATION, "--stream",
                 "--run-config", f"num-server-rounds=200 checkpoint-dir='{ckpt}'"],
                cwd=tmp_path, env=fp.env(), stdout=sink, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + RUN_TIMEOUT
        while "[round   2/200]" not in log.read_text(errors="replace"):
            assert run.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.05)
        assert not list(ckpt.glob("round-*"))  # checkpoint_every=0: nothing before a stop or the last round
        simulation = _simulation_pid(link)
        while "is on disk" not in log.read_text(errors="replace") and run.poll() is None:
            assert time.monotonic() < deadline, log.read_text(errors="replace")
            with contextlib.suppress(ProcessLookupError):
                os.kill(simulation, signal.SIGTERM)
            time.sleep(0.05)
        assert run.wait(timeout=120) == 0
        fp.stop(link)
    said = log.read_text(errors="replace")
    assert "received SIGTERM" in said, said
    stopped_at = every_checkpoint_verifies(ckpt)  # written by the stop: the run had 200 rounds to go
    assert 2 <= stopped_at < 200, said


def _run_status(fp: FlowerProcesses, run_id: int) -> str:
    """The run's status as ``flwr ls --format json`` reports it (e.g. ``finished:completed``)."""
    deadline = time.monotonic() + 30.0
    while True:
        res = subprocess.run(
            [executable("flwr"), "ls", FEDERATION, "--run-id", str(run_id), "--format", "json"],
            cwd=fp.tmp_path, env=fp.env(), capture_output=True, text=True, timeout=60,
        )
        assert res.returncode == 0, f"flwr ls failed:\n{res.stdout}\n{res.stderr}"
        runs = json.loads(res.stdout)["runs"]
        status = str(runs[0]["status"])
        if status.startswith("finished") or time.monotonic() > deadline:
            return status
        time.sleep(1.0)


def _state(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return raw[raw.rfind(")") + 2 :].split()[0]
