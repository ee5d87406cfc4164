"""Clients' failures reach the server's report: counted per round, and a stop that names the error."""

from __future__ import annotations

from pathlib import Path

import pytest
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from experiments.inprocess import run_inprocess
from fedrobust import ClientFailureError
from fedrobust.clients.client_app import make_client_app
from tests.support.simulation import small_config


def _failing_client(cfg, fails) -> ClientApp:
    honest = make_client_app(cfg)
    app = ClientApp()
    app.query()(honest)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        if fails(int(context.node_config["partition-id"])):
            raise ValueError("lr must be > 0, got -0.1")
        return honest(msg, context)

    return app


def test_every_client_failing_the_same_way_stops_at_once_with_the_error(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, num_rounds=2, **{"fault.max_round_retries": 5})
    with pytest.raises(ClientFailureError, match=r"all 5 replies failed on the clients: .*lr must be > 0, got -0.1"):
        run_inprocess(cfg, tmp_path / "out", client_app=_failing_client(cfg, lambda partition: True))


def test_some_clients_failing_are_counted_and_the_round_completes(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, num_rounds=2, num_byzantine=0, **{"aggregator.name": "median"})
    rows = run_inprocess(cfg, tmp_path / "out", client_app=_failing_client(cfg, lambda partition: partition < 2))
    assert [r["round"] for r in rows] == [1, 2]
    for row in rows:
        assert row["aggregated"] and row["accepted"] == 3 and row["dropped"] == 2
        ((message, count),) = row["client_errors"].items()
        assert count == 2 and "lr must be > 0" in message
