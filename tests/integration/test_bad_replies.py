"""Bad replies on the production server and ClientApp (in-process transport): each rejected with its
reason, and a round left with too few valid ones never aggregated.

What is tested is the server's handling of what arrives, which is the same whatever carried it:
the replies are serialised and rebuilt as on the wire (experiments/inprocess.py). The Ray engine
carries faulty replies in tests/integration/test_library.py, and signed ones from real SuperNodes
in tests/process/test_deployment.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from experiments.inprocess import run_inprocess
from fedrobust import protocol
from fedrobust.strategies.errors import QuorumError
from tests.support.simulation import read_rows, replace_update, small_config, tampering_client


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
    rows = run_inprocess(cfg, Path(cfg.output_dir), client_app=tampering_client(cfg, tamper, resign={0, 1}))
    assert [r["round"] for r in rows] == [1, 2]
    for row in rows:
        assert row["rejected"] == {"bad_signature": 2, "non_finite": 1, "wrong_shape": 1}
        assert row["accepted"] == 3  # every honest, correctly signed reply: no false rejection
        assert row["aggregated"] is True
        reasons = {r["partition"]: r["reason"] for r in row["rejected_nodes"]}
        assert reasons == {0: "wrong_shape", 1: "non_finite", 2: "bad_signature", 3: "bad_signature"}, row
    assert read_rows(Path(cfg.output_dir)) == rows
    assert (Path(cfg.output_dir) / "final_model.safetensors").exists()


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
        match=r"round 2: not aggregated after 2 attempts \(2 valid replies, krum with f=0 \(num_byzantine=1 less 3 "
        r"proven faulty\) needs at least 3; rejected 3: 3x non_finite \(.* holds NaN or infinity\) \(more than "
        r"num_byzantine=1 nodes failing alike points at the ClientApp's replies or a setting",
    ):
        run_inprocess(cfg, Path(cfg.output_dir), client_app=tampering_client(cfg, tamper))
    rows = read_rows(Path(cfg.output_dir))
    assert [r["round"] for r in rows] == [1]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("round-")) == ["round-000001"]
