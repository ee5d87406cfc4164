"""Faults of real processes: the server's (signals, kill -9, corrupted checkpoints) and a client's.

The reference is the same experiment run uninterrupted in the test's own process (the same ServerApp
loop and ClientApp, without Ray: tests/support/hydra_runs.py), while a run of it is stopped with
SIGTERM (it must checkpoint and exit 75), resumed and then killed with SIGKILL at a random
moment (possibly while a checkpoint is being written); its newest checkpoint is then
corrupted, and a last resume must fall back to the previous checkpoint and still end
with final model bytes identical to the reference run's. The run carries state beyond the model in
both places: the server's FedAdam moments, and its clients' own memory (the ``stale`` attack keeps the
update it captured in round 1 in its node's ``Context.state`` and replays it; a resume that lost it
would capture anew and end with other bytes: tests/integration/test_stateful_resume.py). A simulated
client whose process dies inside its ClientApp (os._exit) is a dropped reply; the round completes.

The helpers (the Hydra command, starting it in a session of its own, waiting for a log line,
checking the checkpoints on disk) are in tests/support/hydra_runs.py.
"""

from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from flwr.app import Message
from flwr.simulation import run_simulation

from experiments.simulate import backend_config
from fedrobust.strategies.errors import EXIT_PREEMPTED
from fedrobust.strategies.server_app import make_server_app
from tests.support.hydra_runs import (
    ROUNDS,
    committed,
    finish,
    hydra_command,
    kill_tree,
    rounds_on_disk,
    start,
    uninterrupted_final_bytes,
    wait_for,
)
from tests.support.simulation import read_rows, small_config, tampering_client

pytestmark = pytest.mark.slow

# Stateful clients (the stale attack's memory) and a stateful server optimizer.
STATEFUL = ("attack=stale", "num_byzantine=2", "aggregator=mean", "server_optimizer=fedadam")


def test_sigterm_then_kill9_then_corruption_still_resume_to_identical_bytes(tmp_path: Path) -> None:
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    with ThreadPoolExecutor(1) as pool:  # the reference trains in this process while the first run starts Ray
        reference = pool.submit(uninterrupted_final_bytes, tmp_path / "ref", *STATEFUL)
        # 1. Preemption: SIGTERM after round 2 -> checkpoint written, exit code 75.
        first = start(hydra_command(run_dir, ckpt, *STATEFUL), tmp_path / "first.log")
        wait_for(first, "[round   2/")
        first.popen.send_signal(signal.SIGTERM)
        assert finish(first) == EXIT_PREEMPTED, first.tail()
        assert "checkpoint written" in first.log_path.read_text()
        stopped_at = committed(ckpt)
        assert stopped_at >= 2

        # 2. Resume, then kill -9 the whole process tree at a random moment after round 4 began.
        second = start(hydra_command(run_dir, ckpt, *STATEFUL), tmp_path / "second.log")
        wait_for(second, f"resumed after round {stopped_at}")
        wait_for(second, f"[round   {stopped_at + 1}/")
        time.sleep(random.uniform(0.0, 1.5))
        kill_tree(second)
        assert finish(second) == -signal.SIGKILL
        kept = rounds_on_disk(ckpt)
        assert kept and max(kept) > stopped_at

        # 3. Corrupt the newest checkpoint: the resume must detect it and use the one before.
        newest = ckpt / f"round-{max(kept):06d}" / "tensors.safetensors"
        data = bytearray(newest.read_bytes())
        data[len(data) // 2] ^= 0xFF
        newest.write_bytes(bytes(data))
        third = start(hydra_command(run_dir, ckpt, *STATEFUL), tmp_path / "third.log")
        assert finish(third) == 0, third.tail()
        log = third.log_path.read_text()
        assert "resumed after round" in log and f"resumed after round {max(kept)}" not in log
        assert (run_dir / "final_model.safetensors").read_bytes() == reference.result()
        assert committed(ckpt) == ROUNDS  # the killed writer's leftovers were cleaned up


def test_a_client_process_dying_inside_the_clientapp_counts_as_dropped_and_the_run_completes(tmp_path: Path) -> None:
    """os._exit in one node's ClientApp kills its simulation worker (a Ray actor process) in round 2.

    Only that reply is lost: the worker comes back for round 3 (without max_restarts, Flower's pool
    keeps the dead actor and later rounds lose every message it is given).
    """
    cfg = small_config(tmp_path, num_rounds=3, **{"aggregator.name": "median", "fault.round_timeout": 120.0})

    def die(partition: int, server_round: int, _reply: Message) -> None:
        if partition == 0 and server_round == 2:
            os._exit(3)

    run_simulation(
        server_app=make_server_app(cfg, out_dir=Path(cfg.output_dir)),
        client_app=tampering_client(cfg, die),
        num_supernodes=cfg.num_clients,
        backend_config=backend_config(cfg),  # as python -m experiments.run runs it
    )
    rows = read_rows(Path(cfg.output_dir))
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert [(r["accepted"], r["dropped"]) for r in rows] == [(5, 0), (4, 1), (5, 0)]
    assert rows[1]["dropped_nodes"][0]["partition"] == 0 and all(r["aggregated"] for r in rows)
    assert (Path(cfg.output_dir) / "final_model.safetensors").exists()
