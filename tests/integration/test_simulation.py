"""The robust server and clients on Flower's real simulation engine (small: 5 clients, 2-3 rounds)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from flwr.simulation import run_simulation

from fedrobust import protocol
from fedrobust.config import RunConfig
from fedrobust.strategies.errors import QuorumError
from fedrobust.strategies.server_app import make_server_app
from tests.support.simulation import ray_backend, read_rows, replace_update, small_config, tampering_client

pytestmark = pytest.mark.slow


def _run(cfg: RunConfig, client_app, actors: int = 1) -> None:
    run_simulation(
        server_app=make_server_app(cfg, out_dir=Path(cfg.output_dir)),
        client_app=client_app,
        num_supernodes=cfg.num_clients,
        backend_config=ray_backend(actors),
    )


def test_each_bad_reply_is_rejected_with_its_reason_and_the_round_completes(tmp_path: Path) -> None:
    """Signed run, 7 clients: wrong shape, NaN, forged signature, tampered-after-signing, 3 honest."""
    cfg = small_config(
        tmp_path,
        num_clients=7,
        clients_per_round=7,
        num_rounds=2,
        **{"signing.require": True, "liveness.quarantine_after": 0},
    )

    def tamper(partition: int, server_round: int, reply) -> None:
        if partition == 0:  # wrong shape: drop a column of the first weight matrix
            replace_update(reply, lambda u: {**u, next(iter(u)): next(iter(u.values()))[:, :-1].clone()})
        elif partition == 1:  # NaN in every weight
            replace_update(
                reply,
                lambda u: {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in u.items()},
            )
        elif partition == 2:  # forged: flip one byte of the signature
            record = reply.content[protocol.SIGNATURE]
            sig = bytearray(record[protocol.SIG])
            sig[0] ^= 0xFF
            record[protocol.SIG] = bytes(sig)
        elif partition == 3:  # tampered after signing: the arrays no longer match the signature
            replace_update(reply, lambda u: {k: v + 1e-3 if v.is_floating_point() else v for k, v in u.items()})

    # Partitions 0 and 1 sign what they send (a Byzantine client holds a valid key), so their
    # replies pass the signature check and must be caught by validation.
    _run(cfg, tampering_client(cfg, tamper, resign={0, 1}))
    rows = read_rows(Path(cfg.output_dir))
    assert [r["round"] for r in rows] == [1, 2]
    for row in rows:
        assert row["rejected"] == {"bad_signature": 2, "non_finite": 1, "wrong_shape": 1}
        assert row["accepted"] == 3  # every honest, correctly signed reply: no false rejection
        assert row["aggregated"] is True
    assert (Path(cfg.output_dir) / "final_model.safetensors").exists()


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
    assert "client crashed" in error and count == 1
    assert rows[2]["dropped"] == 1 and rows[2]["accepted"] == 4 and rows[2]["aggregated"] is True
    assert rows[2]["dropped_nodes"][0]["partition"] == 1
    # The deadline, not the straggler, ended round 3.
    assert 19 < rows[2]["seconds_train"] < 27


def test_too_few_valid_replies_never_aggregates_and_stops_with_a_checkpoint(tmp_path: Path) -> None:
    # From round 2 on only 2 of 5 replies are valid: the 3 rejected ones lower f to 0, and krum
    # with f=0 still needs n >= 2f+3 = 3.
    cfg = small_config(
        tmp_path,
        num_rounds=3,
        **{
            "aggregator.name": "krum",
            "fault.max_round_retries": 1,
            "checkpoint.dir": str(tmp_path / "ckpt"),
            "liveness.quarantine_after": 0,
        },
    )

    def tamper(partition: int, server_round: int, reply) -> None:
        if server_round >= 2 and partition < 3:
            replace_update(reply, lambda u: {k: v * float("inf") if v.is_floating_point() else v for k, v in u.items()})

    with pytest.raises(
        QuorumError,
        match=r"round 2: not aggregated after 2 attempts \(2 valid replies, krum with f=0 needs at least 3\)",
    ):
        _run(cfg, tampering_client(cfg, tamper))
    rows = read_rows(Path(cfg.output_dir))
    assert [r["round"] for r in rows] == [1]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("round-")) == ["round-000001"]
