"""experiments.attack_reach: what an omniscient attack does to the plain mean, on real in-process rounds."""

from __future__ import annotations

import pytest
import torch

from experiments import attack_reach


def test_reach_of_a_crafted_round_is_what_the_mean_does() -> None:
    honest = torch.tensor([[1.0, 0.0], [3.0, 0.0], [2.0, 1.0], [2.0, -1.0]])  # mu = (2, 0), spread 2
    crafted = torch.tensor([[-8.0, 0.0]])  # IPM with epsilon 4
    r = attack_reach.reach(3, honest, crafted)
    assert (r.round, r.mu_norm, r.spread, r.crafted) == (3, 2.0, 1.0, 5.0)
    assert r.step == pytest.approx((4 * 1 + 1 * -4) / 5)  # (h * 1 + f * -epsilon) / n along mu: stalled


@pytest.mark.parametrize(("attack", "extra", "step"), [
    ("ipm", ["+attack.params.epsilon=10"], (16 - 4 * 10) / 20),  # reversed, by an amount known exactly
    ("mimic", [], None),  # a copy of an honest update: the mean still steps forward
])
def test_every_round_of_a_real_run_is_measured(attack: str, extra: list[str], step: float | None) -> None:
    # 2 local epochs: with 3 the reversed IPM model diverges in round 2 and the guard retries it.
    config = attack_reach.config(attack, "iid", seed=0, rounds=2, extra=[*extra, "client.local_epochs=2"])
    rounds, accuracy = attack_reach.measure(config)
    assert [r.round for r in rounds] == [1, 2] and 0.0 <= accuracy <= 1.0
    for r in rounds:
        assert r.mu_norm > 0 and r.spread > 0
        if step is None:
            assert r.step > 0 and r.crafted <= r.spread  # the copy lies within the honest spread
        else:
            assert r.step == pytest.approx(step, rel=1e-4)
    lines = attack_reach.table(rounds)
    assert len(lines) == 2 + 2 and lines[2].startswith("| 1 |")
