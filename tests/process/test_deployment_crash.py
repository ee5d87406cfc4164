"""Server crashes in deployment: the ServerApp, then the SuperLink, killed with SIGKILL mid-run.

Real processes, set up as docs/deployment.md tells an operator to (sections 2-6): one
``flower-superlink`` with TLS, SuperNode authentication and a ``--database`` state file, three
``flower-supernode`` processes on device-local data; node 2's node config also says ``attack='nan'``,
which the shipped ClientApp (``fedrobust.clients.client_app:app``, always honest) ignores with a warning.
Signing is off (the app's default). Then, recovering as section 10 says:

0. Reference: the same run uninterrupted, NUM_ROUNDS rounds, replayed in the test's process on the same
   nodes (their node ids and device data files; ``experiments.inprocess``: the same ServerApp loop and
   ClientApp as on the SuperLink and SuperNodes, which give the same bytes when torch uses as many
   threads: one, OMP_NUM_THREADS=1 for every process the test starts) while the runs below go on.
1. Run A, ``flwr run . <federation>`` with ``checkpoint.dir`` set: once round 1's checkpoint is committed and
   round 2's train message has reached every SuperNode (the round is in flight on the devices), the
   ServerApp process (``flwr-serverapp``, started by the SuperLink's SuperExec) gets SIGKILL. The
   SuperLink marks the run ``finished:failed`` once its heartbeats stop (Flower: at most 60 s).
2. Run B, the same ``flwr run`` again: it logs ``resumed after round 1``. Once every SuperNode has
   received its round-2 train message (the round is in flight on the devices), the SuperLink gets
   SIGKILL with everything it started, as in a power cut of the server.
3. The SuperLink is started again with the same command (same port, certificates, ``--database``); the
   SuperNodes, never restarted, reconnect on their own; run C, the same ``flwr run`` again, logs
   ``resumed after round 1`` (round 2 was never committed) and completes.

What must hold: the SuperLink exits -9 and the killed ServerApp is gone; the SuperNodes run throughout,
take run C's messages from the restarted SuperLink and exit 0 when stopped at the end; ``flwr run`` A exits
0 once the SuperLink reports its run finished (1 if the SuperLink died first), B exits 1 (it lost the
SuperLink), C exits 0; on the restarted SuperLink runs A and B are ``finished:failed`` and
C ``finished:completed``; each resume starts right after the newest committed round; every ``round-*``
checkpoint verifies on its own, after each kill and at the end, and at the end no temporary leftovers
remain; the metrics hold each round once, as the reference's, with every reply accepted (node 2's
too, and its log says its attack was ignored); and the final model has the bytes of the
uninterrupted reference run. That last one holds because the same nodes answered every round: discovery
orders nodes by partition, training is seeded by (seed, round, partition), replies are aggregated in
partition order, and a checkpoint restores the model, server optimizer, liveness and RNG state.
``aggregator.name='mean'``: its float sums depend on the order of the replies, so equal bytes show that
the order is the same too (and it skips the median's numba kernels, whose first call took ~25 s in every
deployed ServerApp here).

Wall time: 120 s and 161 CPU-s on an idle 2-core machine with three devices (149 s and 244 CPU-s with five;
180 s with five when run A's ServerApp was killed as soon as round 1 was
committed: run B's discovery then waited ~55 s on SuperNodes stuck with a half-sent message; 266 s when the
reference was a fourth ``flwr run``). Every message starts a ClientApp process on its SuperNode (flwr and
torch imported each time); the three runs train 1, 1 (killed in round 2) and 1 rounds, plus a discovery query
to every node each.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from experiments.inprocess import run_inprocess
from fedrobust import tls
from fedrobust.checkpoint import CheckpointStore
from fedrobust.clients.client_app import app as shipped_app
from fedrobust.config import from_flat
from fedrobust.dir_lock import LOCK_FILE
from tests.process.test_deployment import (
    ATTACK,
    REPO,
    _alive,
    _finish_run,
    _kill_device,
    _ProcessCensus,
    _rows,
    _run_statuses,
    _start_run,
    _wait_online,
    device_node_config,
    start_devices,
)
from tests.support.flower_processes import FlowerProcesses, Proc, app_copy, descendants

NUM_ROUNDS = 2
# Three devices: what is tested is the crashes and the resume, which need no more. Every message starts a
# ClientApp process (flwr and torch imported, ~3.3 s of CPU), so five devices cost ~50 s more CPU.
NUM_NODES = 3
ATTACK_NODE = 2  # its node config names an attack, which the shipped ClientApp ignores
# Every reply must be in time: a dropped one would make the run differ from the reference.
ROUND_TIMEOUT = 300.0
RUN_TIMEOUT = 420.0  # one `flwr run` (run C: discovery and round 2)
EVENT_TIMEOUT = 300.0  # waiting for a checkpoint or a message to reach the SuperNodes


SETTINGS = {
    "num_rounds": NUM_ROUNDS, "num_clients": NUM_NODES, "clients_per_round": NUM_NODES, "num_byzantine": 0,
    "aggregator.name": "mean", "fault.round_timeout": ROUND_TIMEOUT, "fault.wait_for_nodes": 120,
}


# Node 2's node config asks for an attack; the shipped ClientApp is always honest: it ignores it, says
# so in the SuperNode's log, and its replies are accepted like every other node's.
NODE_CONFIGS: list[dict[str, str]] = [{"attack": ATTACK} if i == ATTACK_NODE else {} for i in range(NUM_NODES)]


def _config(out: Path, ckpt: Path) -> str:
    """The run config of every ``flwr run`` of the test: SETTINGS, and its output and checkpoint places."""
    settings = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in SETTINGS.items())
    return f"{settings} output_dir='{out}' checkpoint.dir='{ckpt}'"


def _wait(what: str, done: Callable[[], bool], run: subprocess.Popen[str], log: Path, fp: FlowerProcesses) -> None:
    """Poll ``done()`` until it is true; fail if ``run`` exits first or after EVENT_TIMEOUT."""
    deadline = time.monotonic() + EVENT_TIMEOUT
    while time.monotonic() < deadline:
        if done():
            return
        if run.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"{what}: not seen\n{log.name}:\n{log.read_text(errors='replace')}\n{fp.tails()}")


def _verified_rounds(ckpt: Path, scratch: Path) -> list[int]:
    """Every ``round-*`` checkpoint, each checked on its own: loaded from a copy of the store cut after it."""
    names = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("round-"))
    for name in names:
        copy = scratch / f"verify-{name}"
        shutil.copytree(
            ckpt, copy, ignore=lambda d, entries, n=name: [e for e in entries if d == str(ckpt) and e > n]
        )
        store = CheckpointStore(str(copy))
        latest = store.latest_valid()
        assert latest is not None and f"round-{latest.round:06d}" == name and not store.skipped, (
            name, store.skipped
        )
        shutil.rmtree(copy)
    return [int(n.split("-")[1]) for n in names]


def _serverapp(link: Proc) -> tuple[int, int]:
    """(pid, start time) of the ServerApp process the SuperLink started (``flwr-serverapp``)."""
    for pid, start in descendants(link.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"flwr-serverapp" in cmdline:
            return pid, start
    raise AssertionError(f"no flwr-serverapp process under the SuperLink ({link.pid})")


def _run_id(log: Path) -> int:
    match = re.search(r"Successfully started run (\d+)", log.read_text(errors="replace"))
    assert match, log.read_text(errors="replace")
    return int(match.group(1))


def _received_train(node: Proc, run_id: int, count: int = 1) -> bool:
    """The SuperNode has pulled ``count`` train messages of ``run_id``, the last one whole.

    Its log: ``[RUN id]`` then ``Receiving: train message``, and ``Received successfully`` after the
    ``count``-th (a SuperNode takes one message at a time).
    """
    text = node.log_path.read_text(errors="replace")
    starts = [m.end() for m in re.finditer(rf"\[RUN {run_id}\][^\n]*\n[^\n]*Receiving: train message", text)]
    return len(starts) >= count and "Received successfully" in text[starts[count - 1] :]


@pytest.mark.slow(seconds=120)
@pytest.mark.timeout(1500)
def test_serverapp_then_superlink_killed_resume_to_the_bytes_of_an_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = time.monotonic()
    # torch on one thread in every process the test starts, as in the in-process reference: float
    # results may depend on how many threads share a matrix product (with 2 the bytes differed).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (tmp_path / "superlink").mkdir()
    tls_files = tls.generate_tls_certificates(tmp_path / "certs")
    link_options = {
        "simulation": False,
        "tls": (tls_files.ca_cert, tls_files.server_cert, tls_files.server_key),
        "enable_supernode_auth": True,
        "database": tmp_path / "superlink" / "state.db",
    }
    # Absolute: the ServerApp runs in the SuperLink's working directory.
    ref_out, out, ckpt = tmp_path / "ref-out", tmp_path / "out", tmp_path / "ckpt"
    logs = tmp_path / "logs"
    run_logs = {name: logs / f"flwr-run-{name}.log" for name in ("a", "b", "c")}
    runs: dict[str, subprocess.Popen[str]] = {}
    seconds: dict[str, float] = {}
    app = app_copy(REPO, tmp_path / "app")  # the operator's `flwr run .`, without walking .venv each time
    nodes: list[Proc] = []

    with ThreadPoolExecutor(1) as pool, FlowerProcesses(tmp_path) as fp, _ProcessCensus(fp) as census:
        try:
            # Sections 2-6 of docs/deployment.md.
            link = fp.start_superlink(**link_options)
            auth_keys = tls.generate_supernode_keys(tmp_path / "certs", NUM_NODES)
            node_ids, nodes = start_devices(fp, link, tls_files, auth_keys, NODE_CONFIGS)
            seconds["setup"] = time.monotonic() - started

            # 0. The uninterrupted reference, on the same nodes, in this process while the runs go on.
            devices = {
                node_id: device_node_config(fp.tmp_path, i) | NODE_CONFIGS[i] for i, node_id in enumerate(node_ids)
            }
            # The shipped ClientApp, as on the SuperNodes: it reads the run config from its context and
            # stays honest whatever a node config asks for.
            reference = pool.submit(run_inprocess, from_flat(SETTINGS), ref_out, client_app=shipped_app, nodes=devices)

            # 1. Run A: SIGKILL to the ServerApp once round 1 is committed.
            t0 = time.monotonic()
            runs["a"] = _start_run(fp, app, _config(out, ckpt), run_logs["a"])
            # A round-* directory is renamed into place complete: its existence is the commit.
            _wait("round 1 committed", (ckpt / "round-000001").is_dir, runs["a"], run_logs["a"], fp)
            # Round 2 in flight: its train message whole on every SuperNode. (Killed while it sends them,
            # the ServerApp may leave a message whose content never arrives; a SuperNode, which takes one
            # message at a time, then waits on it until the SuperLink fails the run, about a minute.)
            run_a = _run_id(run_logs["a"])
            _wait("round 2 of run A on every SuperNode", lambda: all(_received_train(n, run_a, 2) for n in nodes),
                  runs["a"], run_logs["a"], fp)
            serverapp = _serverapp(link)
            os.kill(serverapp[0], signal.SIGKILL)
            deadline = time.monotonic() + 10.0
            while _alive(*serverapp) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _alive(*serverapp), "the SIGKILLed ServerApp is still running"
            assert link.alive() and all(n.alive() for n in nodes), fp.tails()
            committed_a = _verified_rounds(ckpt, tmp_path)
            seconds["run A"] = time.monotonic() - t0

            # 2. Run B, as the operator recovers: the same flwr run. SIGKILL to the SuperLink once round 2
            #    reached every SuperNode.
            t0 = time.monotonic()
            runs["b"] = _start_run(fp, app, _config(out, ckpt), run_logs["b"])
            _wait("run B started", lambda: "Successfully started run" in run_logs["b"].read_text(),
                  runs["b"], run_logs["b"], fp)
            run_b = _run_id(run_logs["b"])
            _wait("round 2 of run B on every SuperNode", lambda: all(_received_train(n, run_b) for n in nodes),
                  runs["b"], run_logs["b"], fp)
            _kill_device(link)
            assert fp.stop(link) == -signal.SIGKILL
            committed_b = _verified_rounds(ckpt, tmp_path)
            seconds["run B"] = time.monotonic() - t0

            # 3. The SuperLink again, exactly as before; the SuperNodes come back on their own; run C.
            t0 = time.monotonic()
            link = fp.start_superlink(**link_options, port=int(link.address.rsplit(":", 1)[1]), name="superlink-2")
            _wait_online(fp, node_ids, nodes)
            seconds["restart"] = time.monotonic() - t0
            t0 = time.monotonic()
            runs["c"] = _start_run(fp, app, _config(out, ckpt), run_logs["c"])
            runs["c"].wait(timeout=RUN_TIMEOUT)
            output_c = _finish_run(fp, runs["c"], run_logs["c"])
            seconds["run C"] = time.monotonic() - t0

            for name in ("a", "b"):
                runs[name].wait(timeout=60.0)
            statuses = dict(zip("ab", _run_statuses(fp, [_run_id(run_logs[name]) for name in "ab"]), strict=True))
            nodes_ran_throughout = all(n.alive() for n in nodes)
            # Every SuperNode, never restarted, took run C's messages from the restarted SuperLink.
            run_c = _run_id(run_logs["c"])
            reconnected = [f"[RUN {run_c}]" in n.log_path.read_text(errors="replace") for n in nodes]
            ref_rows = reference.result()
        except BaseException:
            for log in run_logs.values():
                print(f"{log.name}:\n{log.read_text(errors='replace') if log.exists() else '-'}")
            print(fp.tails(80))
            raise
        finally:
            for run in runs.values():
                if run.poll() is None:
                    run.kill()
                    run.wait(timeout=10.0)
            census.sample()
            for node in nodes:
                fp.stop(node)  # before the SuperLink, so that they leave it as a device does
            fp.stop_all()

    report = "\n".join(f"{log.name}:\n{log.read_text(errors='replace')}" for log in run_logs.values())
    # Exit codes: the killed SuperLink -9 (above); flwr run A 0 when the SuperLink had reported its run
    # finished before it was killed, else 1 like B, which lost the SuperLink mid-run; C 0 (in _finish_run).
    # Which of the two happened is read from A's log: polling A before the kill raced with its exit.
    a_lost_link = "Connection to the SuperLink is unavailable" in run_logs["a"].read_text(errors="replace")
    assert runs["a"].returncode == (1 if a_lost_link else 0), report
    assert runs["b"].returncode == 1, report
    assert "Connection to the SuperLink is unavailable" in run_logs["b"].read_text(), report
    # The restarted SuperLink kept both runs in its database; neither can end well without its ServerApp.
    assert statuses == {"a": "finished:failed", "b": "finished:failed"}, statuses
    assert nodes_ran_throughout, "a SuperNode exited: it should retry until the SuperLink is back"
    assert all(reconnected), reconnected
    # ... and still leave cleanly when stopped (SIGTERM) at the end.
    assert [fp.exit_codes[node.name] for node in nodes] == [0] * NUM_NODES, fp.exit_codes
    # Nothing the test started is left running: the roots, and every process they spawned.
    deadline = time.monotonic() + 10.0
    while (left := census.left_running()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes still running after stop: {left}"

    # Each resume started right after the newest committed round.
    assert committed_a == [1] and committed_b == [1], (committed_a, committed_b)
    assert "resumed after round 1 " in run_logs["b"].read_text(), report
    assert "resumed after round 1 " in output_c, report
    # Only complete checkpoints, each verifying on its own; no temporary leftovers.
    assert sorted(p.name for p in ckpt.iterdir() if p.name != LOCK_FILE) == ["round-000001", "round-000002"]
    assert _verified_rounds(ckpt, tmp_path) == [1, 2]
    rows = _rows(out / "metrics.jsonl")
    assert [r["round"] for r in rows] == list(range(1, NUM_ROUNDS + 1)), rows
    # The shipped app with signing off: every reply accepted, node 2's too; its node config's attack was
    # ignored, and the app said so in node 2's log.
    assert all((r["accepted"], r["rejected"], r["dropped"]) == (NUM_NODES, {}, 0) for r in rows), rows
    byzantine_log = nodes[ATTACK_NODE].log_path.read_text(errors="replace")
    assert f"attack '{ATTACK}' ignored: this is the honest ClientApp" in byzantine_log, byzantine_log[-5000:]
    assert [(r["accepted"], r["dropped"], r["accuracy"]) for r in rows] == [
        (r["accepted"], r["dropped"], r["accuracy"]) for r in ref_rows
    ], (rows, ref_rows)
    # The guarantee: the bytes of the uninterrupted run.
    assert (out / "final_model.safetensors").read_bytes() == (ref_out / "final_model.safetensors").read_bytes()
    print(
        "deployment crash test: "
        + ", ".join(f"{k} {v:.1f}s" for k, v in seconds.items())
        + f", total {time.monotonic() - started:.1f}s"
    )
