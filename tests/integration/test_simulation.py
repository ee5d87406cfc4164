"""What only Flower's real simulation engine shows: a ClientApp that raises and one that misses the deadline.

The server's handling of bad replies, which does not depend on the transport, is tested in-process
(tests/integration/test_bad_replies.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from flwr.simulation import run_simulation

from fedrobust.config import RunConfig
from fedrobust.strategies.server_app import make_server_app
from tests.support.simulation import ray_backend, read_rows, small_config, tampering_client

pytestmark = pytest.mark.slow(seconds=45)


def _run(cfg: RunConfig, client_app, actors: int = 1) -> None:
    run_simulation(
        server_app=make_server_app(cfg, out_dir=Path(cfg.output_dir)),
        client_app=client_app,
        num_supernodes=cfg.num_clients,
        backend_config=ray_backend(actors),
    )


def test_client_exceptions_and_missed_deadlines_count_as_dropped(tmp_path: Path) -> None:
    # Round 1 warms the simulation workers up and is not checked: a worker's first training (data,
    # model, imports) took more than the 20 s deadline on a 2-core machine busy with another test.
    cfg = small_config(tmp_path, num_rounds=3, **{"fault.round_timeout": 20.0, "aggregator.name": "median"})

    def tamper(partition: int, server_round: int, reply) -> None:
        if partition == 0 and server_round == 2:
            raise RuntimeError("client crashed")
        if partition == 1 and server_round == 3:
            time.sleep(21)  # straggler: past the 20 s deadline (its sleep starts after the round did)

    # Two actors: while the straggler holds one, the other answers the other four in time.
    _run(cfg, tampering_client(cfg, tamper), actors=2)
    rows = read_rows(Path(cfg.output_dir))
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert rows[1]["dropped"] == 1 and rows[1]["accepted"] == 4 and rows[1]["aggregated"] is True
    [(error, count)] = rows[1]["client_errors"].items()
    assert error == "RuntimeError: client crashed" and count == 1  # the root cause, out of Ray's error
    assert rows[2]["dropped"] == 1 and rows[2]["accepted"] == 4 and rows[2]["aggregated"] is True
    assert rows[2]["dropped_nodes"][0]["partition"] == 1
    # The deadline, not the straggler, ended round 3.
    assert 19 < rows[2]["seconds_train"] < 27
