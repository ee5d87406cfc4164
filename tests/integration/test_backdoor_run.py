"""End to end: a backdoor planted by 2 of 10 clients on digits, measured by the server's attack success rate.

Runs the production server loop and ClientApp on the in-process transport of experiments/inprocess.py (the one the
study uses; no Ray start-up), about 15 s for both rules on 2 cores.
"""

from __future__ import annotations

import json
from pathlib import Path

from experiments.inprocess import run_inprocess
from fedrobust.config import from_flat


def backdoor_run(rule: str, out: Path) -> list[dict]:
    cfg = from_flat({
        "num_clients": 10, "clients_per_round": 10, "num_byzantine": 2, "num_rounds": 6, "seed": 0,
        "aggregator.name": rule, "attack.name": "backdoor", "liveness.quarantine_after": 0,
    })
    return run_inprocess(cfg, out, echo=False)


def test_the_plain_mean_learns_the_backdoor_and_the_trimmed_mean_does_not(tmp_path: Path) -> None:
    mean = backdoor_run("mean", tmp_path / "mean")
    trimmed = backdoor_run("trimmed_mean", tmp_path / "trimmed")
    # Both models are accurate on clean inputs: the attack is stealthy there.
    assert mean[-1]["accuracy"] > 0.85 and trimmed[-1]["accuracy"] > 0.85
    # The plain mean classifies most triggered inputs of other classes as the target (0.93 when written);
    # the trimmed mean trims the poisoned clients' extreme coordinates and stays near zero (0.00).
    assert mean[-1]["backdoor_asr"] >= 0.5, [r["backdoor_asr"] for r in mean]
    assert trimmed[-1]["backdoor_asr"] < mean[-1]["backdoor_asr"] - 0.3, [r["backdoor_asr"] for r in trimmed]
    # The attack success rate is in every round's metrics row, next to the clean accuracy.
    rows = [json.loads(line) for line in (tmp_path / "mean" / "metrics.jsonl").read_text().splitlines()]
    assert [r["backdoor_asr"] for r in rows] == [r["backdoor_asr"] for r in mean]
