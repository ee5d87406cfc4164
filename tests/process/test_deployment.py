"""Deployment end to end: real SuperLink and SuperNodes on 127.0.0.1, TLS, node auth, signed updates.

The third way users run fedrobust (design.md), done as docs/deployment.md tells a user to do it:

1. TLS certificates and SuperNode authentication keys (``fedrobust.tls``), Ed25519 update-signing
   keys and the server's trust store (``fedrobust.keygen``), all under ``tmp_path``.
2. One ``flower-superlink`` in deployment mode (no ``--simulation``): TLS on,
   ``--enable-supernode-auth``, its one HTTP port chosen free, the default ``--isolation subprocess``
   (it starts the ServerApp as a separate process).
3. ``flwr supernode register`` for each SuperNode public key, against a federation in a temp
   ``FLWR_HOME`` whose connection carries ``root-certificates``.
4. Five ``flower-supernode`` processes, each with its own runtime port, its own FLWR_HOME (as on
   separate devices) and ``--node-config "data-path=... signing-key=... device=cpu"`` (its own data file);
   each starts its ClientApp processes itself (default subprocess isolation).
   Node 3's node config also says ``attack='nan'`` (it holds a trusted key); node 4 signs with a key
   that is not in the trust store (a forger).
5. Signing on, with the Byzantine drill app: ``flwr run examples/byzantine-drill <federation> --stream
   --run-config "... signing.require=true signing.trust_dir=..."`` (ClientApp
   ``fedrobust.clients.byzantine_app:app``: node 3 plays the attack its node config names, the others
   stay honest), and partition 2's SuperNode is SIGKILLed, with everything it started, once the first
   metrics row is written.

What must hold: the run completes; every reply of the forger is rejected as ``unknown_key``, every
reply of node 3 carries a valid signature and is rejected as ``non_finite`` (the drill app played the
attack; validation caught it after the signature passed), nothing else is ever rejected, and the model
still learns (central accuracy well above chance);
the killed node counts as dropped in the round after the kill (it misses the grace the live nodes' replies
give it, ``fault.grace_after_quorum``, or the SuperLink answers NODE_UNAVAILABLE first) and, dead for the
liveness tracker, is not sampled in round 3; every process the test started is gone at the end. (The
shipped, honest ClientApp with signing off, and its ignoring of a node config's ``attack``, run in
tests/process/test_deployment_crash.py.)

``attack.name`` is left at its default, ``none``: no seed-chosen partition is Byzantine, so with the
drill app only node 3's own node config makes it Byzantine, and ``num_byzantine`` is only the ``f``
the rule tolerates.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from fedrobust import data, keygen, protocol, signing, tls
from fedrobust.clients.signing_mod import node_config_key, sign_reply
from fedrobust.config import from_flat
from fedrobust.strategies.from_config import trust_store_for
from fedrobust.strategies.signatures import SignatureCheck
from fedrobust.validation import NON_FINITE
from tests.support.flower_processes import (
    FlowerProcesses,
    Proc,
    descendants,
    executable,
    write_flwr_home,
)

REPO = Path(__file__).resolve().parents[2]
DRILL_APP = REPO / "examples" / "byzantine-drill"  # ClientApp fedrobust.clients.byzantine_app:app
FEDERATION = "fedrobust-edge"
NUM_NODES = 5
NUM_ROUNDS = 3  # the signed drill run
BYZANTINE = 3  # attack=ATTACK in its node config, trusted key
ATTACK = "nan"  # its update is signed, then refused by validation: a trace of the attack in every round
FORGER = 4  # signs with a key the server does not trust
KILLED = 2  # honest; SIGKILLed after round 1 of the signed run
# fault.round_timeout. Every message starts a fresh ClientApp process on its SuperNode (flwr and torch
# are imported each time), five of them at once on a 2-core machine:
# round 1 took 28-42 s on the shared development machine, 55-61 s at load 10.
ROUND_TIMEOUT = 90.0
# fault.grace_after_quorum. Round 2 waits this long for the killed node once the live nodes' replies can
# be aggregated (one honest reply after one rejection), unless the SuperLink marks it offline first
# (60 s without heartbeats) and answers NODE_UNAVAILABLE. Run alone, round 2 took 24 s with it and 49 s
# without it (waiting for that answer). The live nodes' replies come within a few seconds of each
# other (their ClientApps start together): all are in within the grace, the forger's and node 3's too.
GRACE_AFTER_QUORUM = 15.0
RUN_TIMEOUT = 420.0  # flwr run; the signed run took 155-170 s on the shared 2-core development machine
CLI_TIMEOUT = 120.0


def _run_config(out_dir: Path, *, num_rounds: int, trust_dir: Path) -> str:
    """The run config of the drill's ``flwr run``: signing required, against ``trust_dir``."""
    return (
        f"num_rounds={num_rounds} num_clients={NUM_NODES} clients_per_round={NUM_NODES} num_byzantine=1 "
        f"aggregator.name='median' signing.require=true signing.trust_dir='{trust_dir}' "
        f"fault.round_timeout={ROUND_TIMEOUT} fault.grace_after_quorum={GRACE_AFTER_QUORUM} "
        f"fault.wait_for_nodes=120 "
        f"liveness.quarantine_after=0 liveness.dead_after=1 "
        f"output_dir='{out_dir}'"
    )


def _device_data(device_dir: Path, i: int) -> Path:
    """Device ``i``'s own training data: a fifth of digits in an .npz file, as docs/deployment.md prepares it."""
    device_dir.mkdir(parents=True, exist_ok=True)
    x, y = data.load_partition("digits", i, NUM_NODES, seed=0).tensors
    path = device_dir / "train.npz"
    np.savez(path, x=x.numpy(), y=y.numpy())
    return path


def device_node_config(root: Path, i: int, *, write: bool = False) -> dict[str, str]:
    """Device ``i``'s node config: its own data file under ``root`` (written when ``write``), on the CPU."""
    device = root / f"device-{i}"
    path = _device_data(device, i) if write else device / "train.npz"
    return {"data-path": str(path), "device": "cpu"}


def _flwr(fp: FlowerProcesses, *args: str, timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """One ``flwr`` CLI call against the temp FLWR_HOME (``flwr`` itself runs to completion here)."""
    return subprocess.run(
        [executable("flwr"), *args], cwd=fp.tmp_path, env=fp.env(), capture_output=True, text=True, timeout=timeout
    )


def _json_out(res: subprocess.CompletedProcess[str]) -> dict:
    """The JSON document of ``flwr ... --format json`` (1.41 prints a 'Using SuperLink' line first)."""
    start = res.stdout.find("{")
    assert res.returncode == 0 and start >= 0, f"flwr failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    return json.loads(res.stdout[start:])


def _register(fp: FlowerProcesses, public_keys: list[Path]) -> list[int]:
    """``flwr supernode register <pub> <federation>`` for every key, concurrently; the node ids, in order."""
    calls = [
        subprocess.Popen(
            [executable("flwr"), "supernode", "register", str(pub), FEDERATION, "--format", "json"],
            cwd=fp.tmp_path, env=fp.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for pub in public_keys
    ]
    node_ids = []
    for call in calls:
        out, err = call.communicate(timeout=CLI_TIMEOUT)
        doc = _json_out(subprocess.CompletedProcess(call.args, call.returncode, out, err))
        assert doc.get("success") is True, doc
        node_ids.append(int(doc["node-id"]))
    return node_ids


def _wait_online(fp: FlowerProcesses, node_ids: list[int], nodes: list[Proc], timeout: float = 90.0) -> None:
    """Wait until ``flwr supernode ls`` shows every registered node online (it connected and authenticated)."""
    deadline = time.monotonic() + timeout
    status: dict[int, str] = {}
    while time.monotonic() < deadline:
        dead = [p.name for p in nodes if not p.alive()]
        assert not dead, f"SuperNode(s) exited: {dead}\n{fp.tails()}"
        nodes_ls = _json_out(_flwr(fp, "supernode", "ls", FEDERATION, "--format", "json"))["nodes"]
        status = {int(n["node-id"]): str(n["status"]) for n in nodes_ls}
        if all(status.get(n) == "online" for n in node_ids):
            return
        time.sleep(1.0)
    raise AssertionError(f"SuperNodes not all online after {timeout:.0f}s: {status}\n{fp.tails()}")


def start_devices(
    fp: FlowerProcesses,
    link: Proc,
    tls_files: tls.TlsFiles,
    auth_keys: list[tuple[Path, Path]],
    node_configs: list[dict[str, str]] | None = None,
) -> tuple[list[int], list[Proc]]:
    """Sections 4-6 of docs/deployment.md; the registered node ids and the SuperNodes, once all are online.

    The federation in the temp FLWR_HOME (TLS: root-certificates), every SuperNode public key registered,
    and one SuperNode per "device": its own port, FLWR_HOME, authentication key and node config (its own
    data file, ``device='cpu'``, plus ``node_configs[i]``).
    """
    write_flwr_home(fp.tmp_path, FEDERATION, link.address, insecure=False, root_certificates=tls_files.ca_cert)
    node_ids = _register(fp, [public for _, public in auth_keys])
    assert len(set(node_ids)) == len(auth_keys), node_ids
    nodes = []
    for i, (auth_private, _) in enumerate(auth_keys):
        device = fp.tmp_path / f"device-{i}"
        # A real device trains on its own files (prepared beforehand), not on a partition id.
        config = device_node_config(fp.tmp_path, i, write=True)
        config.update(node_configs[i] if node_configs else {})
        nodes.append(
            fp.start_supernode(
                superlink=link.address,
                root_certificates=tls_files.ca_cert,
                auth_private_key=auth_private,
                node_config=config,
                flwr_home=device / "flwr_home",
                name=f"supernode-{i}",
                wait=False,  # start all at once; _wait_online checks them
            )
        )
    _wait_online(fp, node_ids, nodes)
    return node_ids, nodes


def _run_statuses(fp: FlowerProcesses, run_ids: list[int]) -> list[str]:
    """The runs' statuses as ``flwr ls --format json`` reports them (e.g. ``finished:completed``), once
    all are finished or after 30 s; one ``flwr ls`` per try (each costs ~4 s of CLI start-up here)."""
    deadline = time.monotonic() + 30.0
    while True:
        runs = _json_out(_flwr(fp, "ls", FEDERATION, "--format", "json"))["runs"]
        by_id = {int(run["run-id"]): str(run["status"]) for run in runs}
        statuses = [by_id.get(run_id, "unknown") for run_id in run_ids]
        if all(s.startswith("finished") for s in statuses) or time.monotonic() > deadline:
            return statuses
        time.sleep(1.0)


def _run_status(fp: FlowerProcesses, run_id: int) -> str:
    """The run's status as ``flwr ls --format json`` reports it (e.g. ``finished:completed``)."""
    return _run_statuses(fp, [run_id])[0]


def _start_run(fp: FlowerProcesses, app: Path, run_config: str, log_path: Path) -> subprocess.Popen[str]:
    """``flwr run <app> <federation> --stream --run-config ...``, its output into ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log_file:
        return subprocess.Popen(
            [executable("flwr"), "run", str(app), FEDERATION, "--stream", "--run-config", run_config],
            cwd=REPO, env=fp.env(), stdout=log_file, stderr=subprocess.STDOUT, text=True,
        )


def _finish_run(fp: FlowerProcesses, flwr_run: subprocess.Popen[str], log_path: Path) -> str:
    """Check that a finished ``flwr run`` completed on the SuperLink; its streamed output."""
    output = log_path.read_text(errors="replace")
    report = f"flwr run output:\n{output}\n{fp.tails()}"
    assert flwr_run.poll() is not None, f"flwr run did not finish in {RUN_TIMEOUT:.0f}s\n{report}"
    assert flwr_run.returncode == 0, report
    # `flwr run --stream` exits 0 even when the ServerApp raised: ask the SuperLink.
    match = re.search(r"Successfully started run (\d+)", output)
    assert match, report
    status = _run_status(fp, int(match.group(1)))
    assert status == "finished:completed", f"run status {status!r}\n{report}"
    return output


def _rows(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    # A row is complete once its newline is written.
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n") and line.strip()]


def _alive(pid: int, start_time: int) -> bool:
    """``pid`` is still the process first seen with ``start_time``, and not a zombie."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = raw[raw.rfind(")") + 2 :].split()
    return fields[0] != "Z" and int(fields[19]) == start_time


class _ProcessCensus:
    """Every descendant of the started Flower processes, sampled while the run goes on.

    ClientApp processes live for one message; sampling twice a second records them, so that the end
    of the test can check that nothing any started process spawned is left running.
    """

    def __init__(self, fp: FlowerProcesses) -> None:
        self.fp = fp
        self.seen: dict[int, tuple[int, str]] = {}  # pid -> (start time, name of the root it belongs to)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def sample(self) -> None:
        for proc in list(self.fp.started):
            for pid, start in descendants(proc.pid) if proc.alive() else []:
                self.seen.setdefault(pid, (start, proc.name))

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            self.sample()

    def __enter__(self) -> _ProcessCensus:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def left_running(self) -> list[str]:
        return [f"{pid} (under {root})" for pid, (start, root) in sorted(self.seen.items()) if _alive(pid, start)]


def _kill_device(proc: Proc) -> None:
    """SIGKILL a SuperNode and everything it started, as when its device loses power."""
    tree = descendants(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    for pid, start in tree:
        if _alive(pid, start):
            os.kill(pid, signal.SIGKILL)
    proc.popen.wait(timeout=10.0)


@pytest.mark.slow(seconds=100)
@pytest.mark.timeout(900)
def test_deployment_signed_drill_with_forger_byzantine_and_killed_node(tmp_path: Path) -> None:
    started = time.monotonic()
    # 1. Certificates and keys.
    certs = tmp_path / "certs"
    tls_files = tls.generate_tls_certificates(certs)
    auth_keys = tls.generate_supernode_keys(certs, NUM_NODES)
    keys = tmp_path / "keys"
    keygen.generate(keys, NUM_NODES)
    trust_dir = keys / keygen.TRUST_DIR
    rogue_private, rogue_public = signing.generate_keypair()  # outside the trust store
    (tmp_path / "rogue").mkdir()
    rogue_key = signing.write_private_key(tmp_path / "rogue" / "client-4.key", rogue_private)
    signing_keys = [keys / f"client-{i}.key" for i in range(NUM_NODES)]
    signing_keys[FORGER] = rogue_key
    trust = signing.TrustStore.load(trust_dir)
    assert trust.lookup(signing.key_id(rogue_public)) is None
    assert all(
        trust.lookup(signing.key_id(signing.load_private_key(k).public_key())) is not None
        for i, k in enumerate(signing_keys) if i != FORGER
    )
    # Absolute: the ServerApp runs in the SuperLink's working directory.
    out = tmp_path / "out"
    run_log = tmp_path / "logs" / "flwr-run.log"

    with FlowerProcesses(tmp_path) as fp, _ProcessCensus(fp) as census:
        flwr_run: subprocess.Popen[str] | None = None
        try:
            # 2. SuperLink: TLS, SuperNode authentication, deployment runtime.
            link = fp.start_superlink(
                simulation=False,
                tls=(tls_files.ca_cert, tls_files.server_cert, tls_files.server_key),
                enable_supernode_auth=True,
            )
            # 3.-4. The federation, the SuperNodes' keys registered, one SuperNode per "device".
            node_configs = [{"signing-key": str(key)} for key in signing_keys]
            node_configs[BYZANTINE]["attack"] = ATTACK
            node_ids, nodes = start_devices(fp, link, tls_files, auth_keys, node_configs)
            census.sample()
            setup_seconds = time.monotonic() - started

            # 5. Signing on, the drill app; partition 2's device dies once round 1 is written.
            run_started = time.monotonic()
            flwr_run = _start_run(fp, DRILL_APP, _run_config(out, num_rounds=NUM_ROUNDS, trust_dir=trust_dir), run_log)
            killed_after_rows = None
            deadline = time.monotonic() + RUN_TIMEOUT
            while flwr_run.poll() is None and time.monotonic() < deadline:
                if killed_after_rows is None and (rows_now := _rows(out / "metrics.jsonl")):
                    _kill_device(nodes[KILLED])
                    killed_after_rows = len(rows_now)
                time.sleep(0.2)
            output = _finish_run(fp, flwr_run, run_log)
            run_seconds = time.monotonic() - run_started
        except BaseException:
            print(f"{run_log.name}:\n{run_log.read_text(errors='replace') if run_log.exists() else '-'}")
            print(fp.tails(80))
            raise
        finally:
            if flwr_run is not None and flwr_run.poll() is None:
                flwr_run.kill()
                flwr_run.wait(timeout=10.0)
            census.sample()
            fp.stop_all()

    # Everything the test started is gone: the roots, and every process they spawned.
    assert all(not p.alive() for p in fp.started)
    # Processes in other sessions (SuperExec, ClientApps) exit on their own once their parent is gone.
    deadline = time.monotonic() + 10.0
    while (left := census.left_running()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes still running after stop: {left}"

    rows = _rows(out / "metrics.jsonl")
    report = f"metrics rows:\n{json.dumps(rows, indent=1)}\nflwr run output:\n{output}"
    assert [r["round"] for r in rows] == list(range(1, NUM_ROUNDS + 1)), report
    assert killed_after_rows == 1, report  # the kill came after round 1 and before round 2 was written
    for row in rows:
        # The forger is sampled every round (no quarantine) and every reply of it is refused for its key;
        # node 3's replies carry valid signatures (a trusted key) and the NaN update is refused by
        # validation: the drill app played the attack. Honest replies pass.
        assert row["rejected"] == {signing.REASON_UNKNOWN_KEY: 1, NON_FINITE: 1}, report
        rejected = {e["node"]: e["reason"] for e in row["rejected_nodes"]}
        assert rejected == {node_ids[FORGER]: signing.REASON_UNKNOWN_KEY, node_ids[BYZANTINE]: NON_FINITE}, report
        assert row["aggregated"] and row["attempts"] == 1, report
    honest = NUM_NODES - 2  # all but the forger and node 3
    first, after_kill = rows[0], rows[1]
    assert (first["sampled"], first["accepted"], first["dropped"]) == (NUM_NODES, honest, 0), report
    # Round 2: the killed node was still online for the SuperLink (60 s without heartbeats), was sampled
    # and never answered: missed the grace after quorum or NODE_UNAVAILABLE error reply, a dropout either way.
    assert (after_kill["sampled"], after_kill["accepted"], after_kill["dropped"]) == (NUM_NODES, honest - 1, 1), report
    assert after_kill["liveness"]["dead"] == 1, report
    for row in rows[2:]:
        # liveness.dead_after=1: one missed deadline made it dead, so it is not sampled (backoff) and
        # the round does not wait for it.
        assert (row["sampled"], row["accepted"], row["dropped"]) == (NUM_NODES - 1, honest - 1, 0), report
        assert row["liveness"]["dead"] == 1, report
    # The run-level count: rejections are exactly the forger's and node 3's replies.
    assert sum(sum(r["rejected"].values()) for r in rows) == 2 * NUM_ROUNDS, report
    # Tolerated: the model aggregated from the honest replies learns (10 classes: chance is 0.1).
    assert rows[-1]["accuracy"] > 0.5, report
    assert "unknown_key=1" in output and "dropped  1" in output, report  # the progress lines show both
    # ... and name the nodes: the forger and node 3 with their reasons, the killed device as dropped.
    assert f"rejected: node {node_ids[FORGER]}: {signing.REASON_UNKNOWN_KEY}" in output, report
    assert f"rejected: node {node_ids[BYZANTINE]}: {NON_FINITE}" in output, report
    # The drill's device says in its own log that it plays the attack (the honest app says it ignores one).
    assert f"attack '{ATTACK}' played: this node" in nodes[BYZANTINE].log_path.read_text(errors="replace")
    assert f"dropped: node {node_ids[KILLED]}" in output, report
    assert (out / "final_model.safetensors").stat().st_size > 0
    assert (out / "rounds.png").read_bytes().startswith(b"\x89PNG")  # the run's picture, drawn by the ServerApp
    rounds = ", ".join(f"round {r['round']} {r['seconds_train']:.1f}s" for r in rows)
    print(
        f"deployment test: setup {setup_seconds:.1f}s, signed drill flwr run {run_seconds:.1f}s ({rounds}), "
        f"total {time.monotonic() - started:.1f}s; {len(census.seen)} processes spawned and stopped"
    )


def test_server_verification_with_a_keygen_trust_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The deployed verification path without processes: keys from ``fedrobust.keygen``, the trust
    store loaded from ``signing.trust_dir``, replies signed by the ClientApp's signer with the key its
    node config names. Every signature reason the server can give a deployed node, and no false one."""
    # A Message can only be made inside a Flower task (1.41); be the ServerApp's task of run 7.
    for name, value in (("_task_id", 1), ("_run_id", 7), ("_node_id", SUPERLINK_NODE_ID)):
        monkeypatch.setattr(TaskIdentity, name, value)
    keygen.generate(tmp_path / "keys", 3)
    rogue = signing.write_private_key(tmp_path / "rogue.key", signing.generate_keypair()[0])
    cfg = from_flat({
        "num_clients": 3, "signing.require": True, "signing.trust_dir": str(tmp_path / "keys" / "trust"),
    })
    partitions = {101: 0, 102: 1, 103: 2}  # node id -> partition id, as the hello query learns them
    check = SignatureCheck(trust_store_for(cfg), require=cfg.signing.require)
    update = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.zeros(3)}

    def reply(node_id: int, key_file: Path | None, server_round: int = 1) -> ConfigRecord | None:
        """The signature record node ``node_id``'s signing mod adds to its reply in ``server_round``."""
        nonce = check.nonce(node_id, server_round)
        msg = Message(
            RecordDict({protocol.CONFIG: ConfigRecord({protocol.SERVER_ROUND: server_round, protocol.NONCE: nonce})}),
            dst_node_id=node_id, message_type=MessageType.TRAIN,
        )
        node_config = {protocol.PARTITION_ID: partitions[node_id], "num-partitions": 3}
        if key_file is not None:
            node_config["signing-key"] = str(key_file)
        context = Context(run_id=7, node_id=node_id, node_config=node_config, state=RecordDict(), run_config={})
        answer = Message(
            RecordDict({
                protocol.UPDATE: ArrayRecord(update),
                protocol.METRICS: MetricRecord({protocol.NUM_EXAMPLES: 40}),
            }),
            reply_to=msg,
        )
        key = node_config_key(context)
        return sign_reply(key, msg, answer, context) if key is not None else None

    def verify(
        node_id: int, record: ConfigRecord | None, server_round: int = 1, arrays: dict | None = None
    ) -> str | None:
        return check.verify(
            run_id=7, node_id=node_id, server_round=server_round, record=record,
            arrays=update if arrays is None else arrays, num_examples=40, partitions=partitions,
        )

    keys = tmp_path / "keys"
    honest = reply(101, keys / "client-0.key")
    assert verify(101, honest) is None
    assert verify(101, honest) == signing.REASON_DUPLICATE_REPLY  # delivered twice
    assert verify(102, reply(102, keys / "client-1.key", server_round=1), server_round=2) == (
        signing.REASON_WRONG_ROUND_OR_NONCE  # a round-1 reply presented in round 2
    )
    assert verify(102, reply(102, rogue)) == signing.REASON_UNKNOWN_KEY  # the forger of the process test
    assert verify(102, reply(102, None)) == signing.REASON_MISSING_SIGNATURE  # no signing-key: unsigned
    # Partition 1's key on the device that said it holds partition 2: a copied key is refused.
    assert verify(103, reply(103, keys / "client-1.key")) == signing.REASON_KEY_BOUND_TO_OTHER_NODE
    assert verify(103, None) == signing.REASON_MISSING_SIGNATURE
    signed = reply(103, keys / "client-2.key")
    tampered = {k: v + 1 for k, v in update.items()}
    assert verify(103, signed, arrays=tampered) == signing.REASON_BAD_SIGNATURE  # changed after signing
    assert verify(103, signed) is None  # the tampered copy did not use up the honest reply's nonce
