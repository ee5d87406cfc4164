"""Simulate a round loop with random crashes: adaptive (Young/Daly) checkpoint interval vs fixed intervals.

A run of ``rounds`` rounds (each lasting ``round_s`` seconds with 20 % log-normal jitter) checkpoints after
some rounds, each checkpoint blocking the loop ``checkpoint_s`` seconds (30 % jitter). Crashes arrive as a
Poisson process in wall time with mean ``mtbf_s``; a crash loses the work since the last checkpoint (and a
checkpoint caught half-written), and the run restarts after ``restart_s`` seconds from that checkpoint. The
overhead of a policy is checkpoint time plus lost work, as a percentage of the useful work (restart downtime
is the same for every policy up to the number of crashes and is left out).

Every policy sees the same crash times, round times and checkpoint costs (common random numbers), so the
differences between policies are not sampling noise between them. Policies:

* ``fixed k``: checkpoint every k rounds, for k in 1..``--max-fixed``; the table shows the best one (chosen
  in hindsight, per scenario, which flatters the fixed policies) and a few others;
* ``adaptive (F given)``: :class:`fedrobust.checkpoint_interval.AdaptiveInterval` told the true MTBF;
* ``adaptive (F estimated)``: the same, estimating the MTBF from the restarts in its checkpointed state.

Both adaptive policies measure round time and checkpoint cost as they go, starting from an interval of 1,
and restore their state from the checkpoint a restart resumes from (as the server would).

Run::

    .venv/bin/python -m experiments.sim_checkpoint_interval [--seeds 20] [--max-fixed 24]
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedrobust.checkpoint_interval import AdaptiveInterval, young_daly_interval


@dataclass(frozen=True)
class Scenario:
    name: str
    round_s: float
    checkpoint_s: float
    mtbf_s: float
    restart_s: float
    mtbfs: float = 10.0  # run length in MTBFs of useful work

    @property
    def rounds(self) -> int:
        return math.ceil(self.mtbfs * self.mtbf_s / self.round_s)


SCENARIOS = [
    Scenario("11M model, sync save to disk", round_s=10.0, checkpoint_s=1.0, mtbf_s=3600.0, restart_s=60.0),
    Scenario("small model, fast rounds", round_s=2.0, checkpoint_s=0.25, mtbf_s=900.0, restart_s=30.0),
    Scenario("slow rounds, sync save to S3", round_s=30.0, checkpoint_s=5.0, mtbf_s=1800.0, restart_s=60.0),
    Scenario("default experiment, background save", round_s=0.5, checkpoint_s=0.003, mtbf_s=600.0, restart_s=10.0),
]


class Fixed:
    def __init__(self, every: int) -> None:
        self.every = every
        self.last = 0

    def observe_round(self, seconds: float) -> None:
        pass

    def observe_checkpoint(self, blocking_seconds: float, round: int | None = None) -> None:
        assert round is not None
        self.last = round

    def due(self, round: int) -> bool:
        return round - self.last >= self.every


@dataclass
class Outcome:
    checkpoint_s: float
    lost_s: float
    useful_s: float
    failures: int
    checkpoints: int

    @property
    def overhead(self) -> float:
        return (self.checkpoint_s + self.lost_s) / self.useful_s


def simulate(scenario: Scenario, seed: int, make: Callable[[], Any], adaptive: bool) -> Outcome:
    """One run of ``scenario`` under the policy ``make()`` with the crash times of ``seed``."""
    rng = np.random.default_rng(seed)
    n = scenario.rounds
    sigma_r, sigma_c = 0.2, 0.3
    durations = scenario.round_s * rng.lognormal(-sigma_r**2 / 2, sigma_r, n + 1)
    costs = scenario.checkpoint_s * rng.lognormal(-sigma_c**2 / 2, sigma_c, n + 1)
    gaps = iter(rng.exponential(scenario.mtbf_s, 100_000))

    clock = [0.0]
    policy = make()
    if adaptive:
        policy._clock = lambda: clock[0]
        policy.started = 0.0
    t, r, c = 0.0, 0, 0
    next_fail = next(gaps)
    ckpt_total = lost_total = since_ckpt = 0.0
    failures = checkpoints = 0
    saved_state: dict[str, Any] | None = None

    def crash(at: float) -> None:
        nonlocal t, r, since_ckpt, next_fail, failures, lost_total, policy
        lost_total += since_ckpt + (at - t)
        failures += 1
        t = at + scenario.restart_s
        clock[0] = t
        r, since_ckpt = c, 0.0
        next_fail = t + next(gaps)
        policy = make()
        if adaptive:
            policy._clock = lambda: clock[0]
            if saved_state is not None:
                policy.load_state_dict(saved_state, checkpoint_round=c)
            policy.record_restart(t)
        elif c:
            policy.observe_checkpoint(0.0, round=c)

    while r < n:
        d = durations[r]
        if t + d >= next_fail:
            crash(next_fail)
            continue
        t += d
        clock[0] = t
        r += 1
        since_ckpt += d
        policy.observe_round(d)
        if r < n and policy.due(r):
            cost = costs[r]
            if t + cost >= next_fail:
                crash(next_fail)  # a checkpoint caught half-written is lost work, not a checkpoint
                continue
            # The state saved in the checkpoint is taken before the checkpoint's own cost is known.
            state = policy.state_dict() if adaptive else None
            t += cost
            clock[0] = t
            ckpt_total += cost
            checkpoints += 1
            c, since_ckpt, saved_state = r, 0.0, state
            policy.observe_checkpoint(cost, round=r)
    return Outcome(ckpt_total, lost_total, float(durations[:n].sum()), failures, checkpoints)


def run(scenario: Scenario, seeds: int, max_fixed: int) -> list[dict[str, Any]]:
    policies: list[tuple[str, Callable[[], Any], bool]] = [
        (f"fixed {k}", functools.partial(Fixed, k), False) for k in range(1, max_fixed + 1)
    ]
    n = scenario.rounds
    given = scenario.mtbf_s
    policies.append(("adaptive (F given)", lambda: AdaptiveInterval(max_interval=n, mtbf_seconds=given), True))
    policies.append(("adaptive (F estimated)", lambda: AdaptiveInterval(max_interval=n), True))
    rows = []
    for name, make, adaptive in policies:
        outcomes = [simulate(scenario, 1000 + seed, make, adaptive) for seed in range(seeds)]
        overheads = [o.overhead for o in outcomes]
        rows.append(
            {
                "policy": name,
                "overhead": statistics.fmean(overheads),
                "sem": statistics.stdev(overheads) / math.sqrt(len(overheads)) if len(overheads) > 1 else 0.0,
                "checkpoint": statistics.fmean(o.checkpoint_s / o.useful_s for o in outcomes),
                "lost": statistics.fmean(o.lost_s / o.useful_s for o in outcomes),
                "failures": statistics.fmean(o.failures for o in outcomes),
                "interval": statistics.fmean(n / max(o.checkpoints, 1) for o in outcomes),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=20, help="simulated runs per policy and scenario")
    parser.add_argument("--max-fixed", type=int, default=24, help="fixed intervals 1..this are compared")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    start = time.perf_counter()
    print("| scenario | Young/Daly T | best fixed (hindsight) | its overhead | adaptive, F given | ratio "
          "| adaptive, F estimated | ratio | fixed 1 | fixed 10 |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for scenario in SCENARIOS:
        rows = run(scenario, args.seeds, args.max_fixed)
        by_name = {row["policy"]: row for row in rows}
        fixed = [row for row in rows if row["policy"].startswith("fixed")]
        best = min(fixed, key=lambda row: row["overhead"])
        given, estimated = by_name["adaptive (F given)"], by_name["adaptive (F estimated)"]
        t_rounds = young_daly_interval(scenario.checkpoint_s, scenario.mtbf_s) / scenario.round_s

        def pct(row: dict[str, Any]) -> str:
            return f"{100 * row['overhead']:.2f} % ± {100 * row['sem']:.2f}"

        print(
            f"| {scenario.name}: round {scenario.round_s:g} s, checkpoint {scenario.checkpoint_s:g} s, "
            f"MTBF {scenario.mtbf_s:g} s, {scenario.rounds} rounds | {t_rounds:.1f} rounds "
            f"| {best['policy']} | {pct(best)} "
            f"| {pct(given)} (every {given['interval']:.1f}) | {given['overhead'] / best['overhead']:.3f} "
            f"| {pct(estimated)} (every {estimated['interval']:.1f}) | {estimated['overhead'] / best['overhead']:.3f} "
            f"| {pct(by_name['fixed 1'])} | {pct(by_name['fixed 10'])} |"
        )
    print(f"\n{args.seeds} seeds per policy; {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
