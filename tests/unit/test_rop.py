"""ROP, the relocated orthogonal perturbation: where its rows start, where they go, and whose history it uses."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from fedrobust import aggregators, attacks

H, F, D = 16, 4, 40
RULE = "centered_clipping"
PARAMS = {"tau": "auto"}


def honest_rows(round_: int) -> Tensor:
    """Honest float64 rows around a common direction that drifts a little from round to round."""
    g = torch.Generator().manual_seed(round_)
    direction = torch.linspace(-1.0, 2.0, D, dtype=torch.float64) + 0.1 * round_
    return direction + 0.5 * torch.randn(H, D, generator=g, dtype=torch.float64)


def craft(attack: attacks.Attack, honest: Tensor, round_: int) -> tuple[Tensor, Tensor]:
    """``(crafted rows, the round's rows with them in the Byzantine places)``."""
    rows, byzantine = torch.cat([honest, honest[:F]]), torch.arange(H + F) >= H
    crafted = attack.craft_round(rows, byzantine, list(range(H + F)), generator=torch.Generator().manual_seed(round_))
    rows[byzantine] = crafted
    return crafted, rows


def cosine(a: Tensor, b: Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def test_first_round_starts_at_centered_clipping_s_center_and_moves_orthogonally_to_the_mean() -> None:
    honest = honest_rows(1)
    crafted, _ = craft(attacks.build("rop", rule=RULE, rule_params=PARAMS), honest, 1)
    assert bool((crafted == crafted[0]).all())
    # No aggregate yet: the start is the clipping center (zeros), the reference the honest mean.
    assert cosine(crafted[0], honest.mean(0)) == pytest.approx(0.0, abs=1e-9)
    assert float(crafted[0].norm()) > 0
    # In the plane of the reference and the all-ones vector.
    mu = honest.mean(0) / honest.mean(0).norm()
    across = torch.ones(D, dtype=torch.float64) - (torch.ones(D, dtype=torch.float64) @ mu) * mu
    assert cosine(crafted[0], across) == pytest.approx(1.0, abs=1e-9)


def test_it_learns_from_the_server_s_history_round_by_round() -> None:
    server = aggregators.build(RULE, f=F, **PARAMS)
    attack = attacks.build("rop", rule=RULE, rule_params=PARAMS, reference=0.9, location=1.0)
    last = None
    for round_ in range(1, 5):
        honest = honest_rows(round_)
        crafted, rows = craft(attack, honest, round_)
        if last is not None:
            # The rows start at the server's last aggregate and leave it orthogonally to the reference.
            reference = 0.9 * last + 0.1 * honest.mean(0)
            assert cosine(crafted[0] - last, reference) == pytest.approx(0.0, abs=1e-9)
        last = server(rows)
        torch.testing.assert_close(attack._memory["aggregate"], last, rtol=0, atol=0)  # the server's own aggregate


@pytest.mark.parametrize("angle", [0.0, 45.0, 135.0])
def test_the_angle_turns_the_move_from_the_reference(angle: float) -> None:
    honest = honest_rows(1)
    attack = attacks.build("rop", rule=RULE, rule_params=PARAMS, angle=angle, location=0.0, max_scale=2.0)
    crafted, _ = craft(attack, honest, 1)
    mu = honest.mean(0)
    move = crafted[0] - mu  # location 0: the rows start at the honest mean
    assert float(move.norm()) > 0
    assert cosine(move, mu) == pytest.approx(math.cos(math.radians(angle)), abs=1e-9)


def test_the_move_is_searched_against_the_rule() -> None:
    # Against the real centered clipping, the chosen rows move it at least as far as rows at every
    # other scale on the grid of the line.
    honest = honest_rows(1)
    attack = attacks.build("rop", rule=RULE, rule_params=PARAMS, grid=6, refine=3, max_scale=5.0)
    crafted, _ = craft(attack, honest, 1)
    mu = honest.mean(0)
    unit = crafted[0] / crafted[0].norm()  # start 0: the row is t * s * u
    spread = torch.linalg.vector_norm(honest, dim=1).median()

    def shift(row: Tensor) -> float:
        rule = aggregators.build(RULE, f=F, **PARAMS)
        return float((rule(torch.cat([honest, row.expand(F, -1)])) - mu).norm())

    best = max(shift(t * spread * unit) for t in (0.0, 1.0, 2.0, 3.0, 4.0, 5.0))
    assert shift(crafted[0]) >= best * (1 - 1e-9)
    assert shift(crafted[0]) > shift(mu) * 1.5  # it does move centered clipping


def test_without_memory_every_round_is_its_first() -> None:
    attack = attacks.build("rop", rule=RULE, rule_params=PARAMS, memory=False)
    for round_ in (1, 2):
        crafted, _ = craft(attack, honest_rows(round_), round_)
        assert cosine(crafted[0], honest_rows(round_).mean(0)) == pytest.approx(0.0, abs=1e-9)
    assert attack._memory == {}
