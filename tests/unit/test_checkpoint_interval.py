"""Adaptive checkpoint interval: Young/Daly's formula, the round-loop protocol, MTBF estimation, simulation."""

from __future__ import annotations

import json
import logging
import math

import pytest

from experiments.sim_checkpoint_interval import Fixed, Scenario, simulate
from fedrobust.checkpoint_interval import AdaptiveInterval, estimate_mtbf, young_daly_interval


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_young_daly_formula_and_its_checks() -> None:
    assert young_daly_interval(2.0, 3600.0) == pytest.approx(120.0)
    assert young_daly_interval(0.0, 100.0) == 0.0
    for cost, mtbf in ((-1.0, 10.0), (1.0, 0.0), (math.nan, 1.0), (1.0, math.inf)):
        with pytest.raises(ValueError):
            young_daly_interval(cost, mtbf)
    assert estimate_mtbf(1000.0, 4) == 250.0
    assert estimate_mtbf(1000.0, 0) == 1000.0  # no failure yet: cautious, the elapsed time
    with pytest.raises(ValueError):
        estimate_mtbf(1.0, -1)


def test_interval_follows_measured_costs_and_is_clamped(caplog: pytest.LogCaptureFixture) -> None:
    interval = AdaptiveInterval(max_interval=50, mtbf_seconds=3600.0)
    assert interval.interval == 1 and interval.due(1)  # nothing measured: checkpoint to measure
    with caplog.at_level(logging.INFO, logger="fedrobust.checkpoint_interval"):
        interval.observe_round(10.0)
        assert interval.interval == 1  # no checkpoint cost yet
        interval.observe_checkpoint(2.0)  # sqrt(2 * 2 * 3600) = 120 s = 12 rounds of 10 s
    assert interval.interval == 12
    assert any("1 -> 12 rounds" in r.getMessage() for r in caplog.records)

    # The checkpoint after round 1 counts: the next one is due 12 rounds later.
    assert [r for r in range(2, 30) if interval.due(r)] == list(range(13, 30))
    assert interval.due(13)
    interval.observe_checkpoint(2.0)
    assert not interval.due(24) and interval.due(25)

    # Cheap background checkpoints: every round; a very expensive one: clamped to max_interval.
    cheap = AdaptiveInterval(max_interval=50, mtbf_seconds=3600.0, smoothing=1.0)
    cheap.observe_round(10.0)
    cheap.observe_checkpoint(0.001)
    assert cheap.interval == 1
    cheap.observe_checkpoint(500.0)  # sqrt(2 * 500 * 3600) = 1897 s = 190 rounds
    assert cheap.interval == 50
    with pytest.raises(ValueError):
        cheap.observe_round(-1.0)


def test_moving_average_damps_a_single_outlier() -> None:
    interval = AdaptiveInterval(max_interval=100, mtbf_seconds=3600.0, smoothing=0.2)
    interval.observe_round(10.0)
    for _ in range(20):
        interval.observe_checkpoint(2.0)
    assert interval.interval == 12
    interval.observe_checkpoint(200.0)  # one stalled save: the average moves to 41.6 s, not 200 s
    assert interval.checkpoint_seconds == pytest.approx(41.6)
    assert interval.interval == round(math.sqrt(2 * 41.6 * 3600) / 10)


def test_mtbf_is_estimated_from_restarts_kept_in_the_checkpointed_state() -> None:
    clock = _Clock()
    interval = AdaptiveInterval(max_interval=1000, clock=clock, smoothing=1.0)
    interval.observe_round(1.0)
    interval.observe_checkpoint(0.5)
    clock.now = 3600.0
    assert interval.mtbf() == 3600.0  # no failure in an hour: at least an hour
    state = json.loads(json.dumps(interval.state_dict()))  # it travels in the checkpoint's JSON meta

    clock.now = 4000.0  # crash, restart
    resumed = AdaptiveInterval(max_interval=1000, clock=clock, smoothing=1.0)
    resumed.load_state_dict(state, checkpoint_round=7)
    resumed.record_restart()
    clock.now = 8000.0
    resumed.record_restart()
    assert resumed.restarts == [4000.0, 8000.0]
    assert resumed.mtbf() == pytest.approx(4000.0)  # 8000 s since the start, two failures
    assert resumed.interval == round(math.sqrt(2 * 0.5 * 4000.0))
    assert not resumed.due(7 + resumed.interval - 1) and resumed.due(7 + resumed.interval)

    given = AdaptiveInterval(max_interval=1000, mtbf_seconds=50.0, clock=clock)
    given.record_restart()
    assert given.mtbf() == 50.0  # a given MTBF is not overridden by the estimate


def test_invalid_parameters_fail_early() -> None:
    with pytest.raises(ValueError, match="max_interval"):
        AdaptiveInterval(max_interval=0)
    with pytest.raises(ValueError, match="min_interval"):
        AdaptiveInterval(max_interval=5, min_interval=0)
    with pytest.raises(ValueError, match="mtbf"):
        AdaptiveInterval(max_interval=5, mtbf_seconds=-3.0)
    with pytest.raises(ValueError, match="smoothing"):
        AdaptiveInterval(max_interval=5, smoothing=0.0)


def test_simulated_crashes_adaptive_close_to_the_best_fixed_interval() -> None:
    # A small version of experiments/sim_checkpoint_interval.py: Young/Daly's optimum is 12 rounds here.
    scenario = Scenario("t", round_s=10.0, checkpoint_s=2.0, mtbf_s=3600.0, restart_s=60.0, mtbfs=8.0)
    seeds = range(12)

    def overhead(make, adaptive: bool) -> float:  # type: ignore[no-untyped-def]
        return sum(simulate(scenario, 500 + s, make, adaptive).overhead for s in seeds) / len(seeds)

    fixed = {k: overhead(lambda k=k: Fixed(k), False) for k in (1, 4, 8, 12, 16, 24, 48)}
    adaptive = overhead(lambda: AdaptiveInterval(max_interval=scenario.rounds, mtbf_seconds=3600.0), True)
    best = min(fixed.values())
    assert fixed[1] > 2 * best and fixed[48] > 1.3 * best  # the choice matters: a wrong k costs a lot
    assert adaptive <= 1.15 * best, (adaptive, fixed)
