"""Which replies each defense left out, the attacking ones and the honest ones, from the study's round rows.

    python -m experiments.left_out docs/results/default_choice/main docs/results/default_choice/sign_flip_scale4

Every run result of ``experiments/study.py`` keeps its rounds' metrics rows. ``filtered_nodes`` names the
replies a pre-aggregator dropped (the direction filter), ``excluded_nodes`` those the rule gave no weight
(Krum, Multi-Krum, Bulyan, DnC, SignGuard, ClippedClustering, ...), each with its partition. The attacking
clients are the partitions :func:`fedrobust.run_setup.byzantine_partitions` draws from the run's seed. For
each partition scheme, rule and attack this prints, over the seeds, the share of attacking replies left
out in each phase of training and the honest replies left out per round: whether a defense finds the
attackers, and what it costs the honest clients. Rules that weigh every row (the trimmed mean, the
median) and rules after a stage that mixes rows (NNM) leave no one out by name and are not listed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments import worst_case
from fedrobust.config import AttackConfig, RunConfig
from fedrobust.run_setup import byzantine_partitions

PHASES = 3  # rounds split into this many equal parts: early, middle, late training


@dataclass
class Tally:
    """Counts over the runs of one (partition, rule, attack)."""

    attacking_left: list[int]  # per phase
    attacking_sent: list[int]  # per phase
    honest_left: int = 0
    rounds: int = 0
    runs: int = 0


def attackers(result: dict[str, Any]) -> frozenset[int]:
    """The partitions that attack in this run (as the simulation drew them)."""
    attack = result["attack"].split(" (")[0]  # a sweep's label: "sign_flip (scale=4.0)"
    cfg = RunConfig(
        seed=result["seed"], num_clients=result["num_clients"], num_byzantine=result["num_byzantine"],
        attack=AttackConfig(name=attack),
    )
    return byzantine_partitions(cfg)


def tally(results: Sequence[dict[str, Any]], phases: int = PHASES) -> dict[tuple[str, str, str], Tally]:
    """Left-out counts per (partition, rule, attack); only runs whose rounds name anyone left out count."""
    out: dict[tuple[str, str, str], Tally] = {}
    for result in results:
        rows = [r for r in result["rows"] if r.get("aggregated", True)]
        if not rows or not any("excluded_nodes" in r or "filtered_nodes" in r for r in rows):
            continue  # run before the rounds recorded who was left out
        bad = attackers(result)
        key = (result["partition"], result["rule"], result["attack"])
        t = out.setdefault(key, Tally([0] * phases, [0] * phases))
        t.runs += 1
        for i, row in enumerate(rows):
            phase = i * phases // len(rows)
            left = {e["partition"] for e in (*row.get("filtered_nodes", []), *row.get("excluded_nodes", []))}
            t.attacking_left[phase] += len(left & bad)
            t.attacking_sent[phase] += len(bad)
            t.honest_left += len(left - bad)
            t.rounds += 1
    return out


def table(tallies: dict[tuple[str, str, str], Tally]) -> str:
    """A markdown table, rules that left no one out in any run omitted."""
    lines = [
        "| partition | rule | attack | attacking replies left out, by thirds of training | honest left out "
        "per round | runs |",
        "|---|---|---|---:|---:|---:|",
    ]
    named = {(p, r) for (p, r, _), t in tallies.items() if t.honest_left or any(t.attacking_left)}
    for (partition, rule, attack), t in sorted(tallies.items()):
        if (partition, rule) not in named:
            continue
        shares = " / ".join(
            f"{100 * left / sent:.0f} %" if sent else "-"
            for left, sent in zip(t.attacking_left, t.attacking_sent, strict=True)
        )
        lines.append(f"| {partition} | {rule} | {attack} | {shares} | {t.honest_left / t.rounds:.2f} | {t.runs} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.left_out", description=__doc__.splitlines()[0])
    parser.add_argument("dirs", type=Path, nargs="+", help="study output directories (experiments.study --out)")
    args = parser.parse_args(argv)
    missing = [str(d) for d in args.dirs if not d.is_dir()]
    if missing:
        parser.error(f"no such directory: {', '.join(missing)}")
    try:
        tallies = tally(worst_case.labelled_results(args.dirs))
    except ValueError as err:  # hold-out sweeps beside test-set ones
        parser.error(str(err))
    if not tallies:
        sys.exit("no run in these directories records who was left out (rows without excluded_nodes)")
    print(table(tallies))


if __name__ == "__main__":
    main()
