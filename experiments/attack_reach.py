"""How far an omniscient attack moves the plain mean, round by round.

    python -m experiments.attack_reach --attack min_max [--set +attack.params.perturbation=unit_vec] \\
        [--partitions iid dirichlet] [--seed 0] [--rounds 15]

Runs the plain mean under the attack on the study's setting (digits, 20 clients, f = 4; Dirichlet
alpha 0.5) and prints, per round, what bounds the attack:

* ``|mu|``: the norm of the honest updates' mean, the step the model would take without the attack;
* ``spread``: the largest distance between two honest updates, over ``|mu|`` (what min-max may use);
* ``crafted``: the farthest crafted row from ``mu``, over ``|mu|``;
* ``step``: the plain mean's step along ``mu``, over ``|mu|``: 1 is the step without the attack, 0 a
  stalled round, below 0 a reversed one.

An attack whose rows stay within the honest spread moves the mean by at most ``f / n`` of it per round:
whether that breaks the plain mean depends on how large the spread is against ``|mu|``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from experiments import study
from fedrobust.config import RunConfig


@dataclass(frozen=True)
class Reach:
    """One round: the honest mean's norm, and the spread, crafted distance and mean's step over it."""

    round: int
    mu_norm: float
    spread: float
    crafted: float
    step: float


def reach(server_round: int, honest: Tensor, crafted: Tensor) -> Reach:
    """The figures of one round from its honest rows ``[h, d]`` and crafted rows ``[f, d]``."""
    honest, crafted = honest.double(), crafted.double()
    mu = honest.mean(dim=0)
    norm = float(torch.linalg.vector_norm(mu))
    mean = torch.cat([honest, crafted]).mean(dim=0)
    return Reach(
        round=server_round,
        mu_norm=norm,
        spread=float(torch.cdist(honest, honest).max()) / norm,
        crafted=float(torch.linalg.vector_norm(crafted - mu, dim=1).max()) / norm,
        step=float(mean @ mu) / norm**2,
    )


def measure(cfg: RunConfig) -> tuple[list[Reach], float]:
    """Run ``cfg`` in-process; every round's :class:`Reach` and the final test accuracy."""
    from experiments.inprocess import run_inprocess

    rounds: list[Reach] = []
    rows = run_inprocess(cfg, on_craft=lambda r, honest, crafted: rounds.append(reach(r, honest, crafted)))
    return rounds, float(rows[-1]["accuracy"])


def config(attack: str, partition: str, seed: int, rounds: int, extra: Sequence[str] = ()) -> RunConfig:
    """The study's run of the plain mean under ``attack`` (as ``experiments.study`` composes it)."""
    spec = study.RunSpec(partition=partition, rule="mean", attack=attack, seed=seed)
    overrides = study.overrides_for(spec, rounds=rounds, extra=extra)
    return study.compose({spec.key: overrides})[spec.key]


def table(rounds: Sequence[Reach]) -> list[str]:
    lines = ["| round | \\|mu\\| | spread / \\|mu\\| | crafted / \\|mu\\| | step of the mean along mu |",
             "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.round} | {r.mu_norm:.3f} | {r.spread:.2f} | {r.crafted:.2f} | {r.step:.2f} |" for r in rounds]
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.attack_reach", description=__doc__.splitlines()[0])
    parser.add_argument("--attack", required=True,
                        help="an omniscient attack (conf/attack/*.yaml, or your own by its dotted path)")
    parser.add_argument("--partitions", nargs="+", default=list(study.DEFAULT_PARTITIONS), choices=study.PARTITIONS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=study.DEFAULT_ROUNDS)
    parser.add_argument("--set", dest="extra", nargs="+", default=[], metavar="KEY=VALUE",
                        help="extra Hydra overrides, e.g. +attack.params.perturbation=unit_vec")
    args = parser.parse_args(argv)
    try:
        study.attack_overrides(args.attack)
    except ValueError as err:
        parser.error(str(err))
    study._worker_init()
    for partition in args.partitions:
        rounds, accuracy = measure(config(args.attack, partition, args.seed, args.rounds, args.extra))
        if not rounds:
            parser.error(f"{args.attack!r} crafted nothing: it is not an omniscient attack")
        print(f"\n{partition}, {args.attack} {' '.join(args.extra)}, seed {args.seed}: "
              f"final accuracy of the plain mean {accuracy:.3f}")
        print("\n".join(table(rounds)))


if __name__ == "__main__":
    main()
