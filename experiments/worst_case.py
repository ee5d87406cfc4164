"""Which fixed configuration holds under every attack: the worst case of each rule, over sweeps.

    python -m experiments.report ... --default-choice docs/results/default_choice/main \\
        docs/results/default_choice/sign_flip_scale4

A user who does not know the attack in advance gets one configuration; it is worth its largest
accuracy loss over the attacks, not its loss under the attack it happens to suit. This module scores
each rule of one or more study sweeps (``experiments/study.py --out DIR``) by that worst case and
writes the section that leads ``docs/results.md``. A sweep run with ``--set`` (e.g. a stronger
``attack.params.scale``) contributes its attacks under their own label, ``sign_flip (scale=4.0)``; one
run with settings of the rule (``+aggregator.pre_params.direction.margin=0.5``) is a configuration of its
own, ``RULE @ pre_params.direction.margin=0.5``. A setting clean FedAvg itself ran with
(``client.local_epochs=3`` on the mean and the defenses alike) is the experiment's: it labels nothing, and
sweeps run without it are refused. Sweeps on the validation hold-out compare among themselves.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments.study import OK, PARTITIONS, load_results
from fedrobust import aggregators
from fedrobust import attacks as attack_registry
from fedrobust.config import AggregatorConfig

CLEAN_RULE, CLEAN_ATTACK = "mean", "none"
VALIDATION_KEY = "dataset.validation_fraction"
BACKDOOR = "backdoor"
# The goals of a default (accuracy points below clean FedAvg, worst attack) and of its backdoor success rate.
GOAL_GAP = {"iid": 0.01, "dirichlet": 0.02}
GOAL_ASR = 0.05
# The default rule (RunConfig's, which conf/config.yaml and RobustStrategy share): a challenger must beat it
# beyond the noise.
DEFAULT = AggregatorConfig().name
# The fewest seeds two configurations must share for the paired test of choose(); fewer are too few to resample.
MIN_PAIRED_SEEDS = 5
# "Visibly broken": the plain mean loses at least this much under the attacks that should break it.
BROKEN_GAP = 0.20
MUST_BREAK_MEAN = (
    "sign_flip (scale=4.0)", "min_max", "fang_krum", "fang_trimmed_mean", "fang_trimmed_mean (space=model)",
    "fang_trimmed_mean (b=10.0)",
)


def label(attack: str, extra: Sequence[str]) -> str:
    """``sign_flip`` run with ``--set attack.params.scale=4.0`` -> ``sign_flip (scale=4.0)``."""
    settings = [e.removeprefix("+").removeprefix("attack.params.") for e in extra]
    return f"{attack} ({', '.join(settings)})" if settings else attack


def rule_label(rule: str, extra: Sequence[str]) -> str:
    """A rule run with settings of its own (``--set +aggregator.pre_params.direction.margin=0.5``, a server
    optimizer) is a configuration of its own: ``RULE @ pre_params.direction.margin=0.5``, as tune writes it."""
    settings = [e.removeprefix("+").removeprefix("aggregator.") for e in extra]
    return f"{rule} @ {', '.join(settings)}" if settings else rule


def _ran_with(result: dict[str, Any], settings: Sequence[str]) -> list[str]:
    """The sweep's ``settings`` that this run's overrides hold (all of them for a result without overrides)."""
    own = result.get("overrides")
    return list(settings) if own is None else [e for e in settings if e in own]


def experiment_settings(sweeps: Sequence[tuple[Path, list[str], list[str], list[dict[str, Any]]]]) -> list[str]:
    """The settings of the whole experiment: those clean FedAvg itself ran with (``--set
    client.local_epochs=3`` on a sweep of the mean and the defenses), so they label no rule.

    ``sweeps``: (directory, its settings other than the attack's, the attack's, its results). Settings of
    the rule (``aggregator.*``) never count: the plain mean has none. Every sweep must have run with the
    experiment's settings, else its runs are of another experiment and comparing them is refused.
    """
    found = sorted({e for _, of_rule, _, loaded in sweeps for r in loaded
                    if (r["rule"], r["attack"]) == (CLEAN_RULE, CLEAN_ATTACK)
                    for e in _ran_with(r, of_rule) if not e.removeprefix("+").startswith("aggregator.")})
    for directory, of_rule, _, _ in sweeps:
        lacking = [e for e in found if e not in of_rule]
        if lacking:
            raise ValueError(
                f"the sweeps ran in different settings: clean FedAvg ran with {' '.join(found)}, "
                f"{directory} without {' '.join(lacking)}; compare sweeps of one setting"
            )
    return found


def labelled_results(
    dirs: Sequence[Path], rules: Sequence[str] = (), seeds: Sequence[int] = ()
) -> list[dict[str, Any]]:
    """The results of every sweep in ``dirs``, each labelled with its sweep's extra settings: those of the
    attack (``attack.params.*``) label the attack, every other one labels the rule (:func:`rule_label`).

    A run found in more than one sweep (same partition, labelled rule, labelled attack and seed) counts
    once, from the first sweep that has it, so sweeps that overlap can be combined. With ``rules``, only
    those rules (with any settings) and clean FedAvg are kept. Sweeps evaluated on the validation
    hold-out (``experiments/tune.py``'s, ``dataset.validation_fraction`` > 0) compare among themselves,
    clean FedAvg on the same hold-out being their reference; mixing them with sweeps evaluated on the
    test set is refused.
    """
    results, seen = [], set()
    held_out: dict[bool, list[str]] = {True: [], False: []}
    sweeps = []
    for directory in dirs:
        try:
            extra = json.loads((directory / "study.json").read_text()).get("settings", {}).get("extra", [])
        except (OSError, ValueError):
            extra = []
        # The hold-out is where every run of a sweep is evaluated, clean FedAvg's too, not an attack setting.
        evaluation = [e for e in extra if e.removeprefix("+").startswith(VALIDATION_KEY + "=")]
        extra = [e for e in extra if e not in evaluation]
        held_out[any(float(e.partition("=")[2]) > 0 for e in evaluation)].append(str(directory))
        of_attack = [e for e in extra if e.removeprefix("+").startswith("attack.params.")]
        sweeps.append((directory, [e for e in extra if e not in of_attack], of_attack, load_results(directory)))
    experiment = experiment_settings(sweeps)
    for _, of_rule, of_attack, loaded in sweeps:
        of_rule = [e for e in of_rule if e not in experiment]
        for r in loaded:
            if seeds and r["seed"] not in seeds:
                continue
            keep = not rules or r["rule"] in rules
            # A run is labelled with the settings it ran with: tune runs clean FedAvg in the same sweep
            # without the rule's own settings (the plain mean has none), so it stays clean FedAvg.
            rule_settings, attack_settings = _ran_with(r, of_rule), _ran_with(r, of_attack)
            r = r | {"rule": rule_label(r["rule"], rule_settings), "attack": label(r["attack"], attack_settings),
                     "experiment_settings": experiment}
            key = (r["partition"], r["rule"], r["attack"], r["seed"])
            keep = keep or (r["rule"], r["attack"]) == (CLEAN_RULE, CLEAN_ATTACK)
            if keep and key not in seen:
                seen.add(key)
                results.append(r)
    if held_out[True] and held_out[False]:
        raise ValueError(
            f"the sweeps are evaluated on different data: on the validation hold-out ({', '.join(held_out[True])}) "
            f"and on the test set ({', '.join(held_out[False])}); compare sweeps of one kind"
        )
    return results


def _final(result: dict[str, Any], key: str = "accuracy") -> float:
    """The last round's metric; a run that stopped (no quorum, error) scores accuracy 0."""
    if result["status"] != OK or not result["rows"]:
        return 0.0 if key == "accuracy" else math.nan
    value = result["rows"][-1].get(key)
    return float(value) if value is not None else math.nan


def _sem(values: list[float]) -> float:
    """Standard error of the mean over seeds (0 for one seed)."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


@dataclass(frozen=True)
class Cell:
    """Mean over seeds of one (partition, rule, attack), with its standard error."""

    accuracy: float
    asr: float  # backdoor success rate; nan unless the attack is a backdoor
    seeds: int
    accuracy_sem: float = 0.0
    asr_sem: float = math.nan


def cells(results: list[dict[str, Any]]) -> dict[tuple[str, str, str], Cell]:
    grouped: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in results:
        grouped.setdefault((r["partition"], r["rule"], r["attack"]), []).append(r)
    out = {}
    for key, runs in grouped.items():
        acc, asr = [_final(r) for r in runs], [_final(r, "backdoor_asr") for r in runs]
        has_asr = not any(math.isnan(a) for a in asr)
        out[key] = Cell(
            accuracy=statistics.fmean(acc),
            asr=statistics.fmean(asr) if has_asr else math.nan,
            seeds=len(runs),
            accuracy_sem=_sem(acc),
            asr_sem=_sem(asr) if has_asr else math.nan,
        )
    return out


@dataclass(frozen=True)
class WorstCase:
    """One rule's worst accuracy gap to clean FedAvg over the attacks, per partition."""

    rule: str
    gap: dict[str, tuple[float, str]]  # partition -> (largest gap, the attack that causes it)
    asr: dict[str, float]  # partition -> backdoor success rate (nan when not run)
    missing: dict[str, list[str]]  # partition -> attacks this rule was not run under
    # Each measure over its goal, with the standard error of that ratio over the seeds.
    terms: list[tuple[float, float]] = field(default_factory=list)

    @property
    def score(self) -> float:
        """The worst of every measure relative to its goal: <= 1 meets every goal; lower is better.

        The gaps (untargeted damage) and the backdoor success rate (a silent, targeted takeover that
        clean accuracy does not show) count alike, each against its own goal.
        """
        return max(value for value, _ in self.terms)

    @property
    def score_sem(self) -> float:
        """The seeds' standard error of the measure that sets the score."""
        return max(self.terms)[1]


def applies(rule: str, attack: str) -> bool:
    """Whether ``attack`` (a label, ``name (param=value, ...)``) can be run against ``rule`` at all.

    An attack written against the server's own update (FLTrust's adaptive attack) has nothing to attack in
    a rule that computes none: such a cell is not applicable, not missing. (The tuned attacks apply to
    every rule: they are tuned to the rule they run against, FLTrust with its update included.)
    """
    name, last = attack.split(" (")[0], rule.split("+")[-1]
    if name not in attack_registry.names() or not attack_registry.build(name).needs_server_update:
        return True
    return last not in aggregators.names() or aggregators.build(last, f=0).needs_server_update


def worst_cases(table: dict[tuple[str, str, str], Cell], *, include_mean: bool = False) -> list[WorstCase]:
    """Every rule's worst case, best (lowest score) first. Needs clean FedAvg (mean, none) per partition.

    A rule must have been run under every attack of its partition to be scored fairly, so the attacks it
    misses are listed (and it is ranked after the complete ones).
    """
    partitions = [p for p in PARTITIONS if any(k[0] == p for k in table)]
    rules = sorted({k[1] for k in table if include_mean or k[1] != CLEAN_RULE})
    cases = []
    for rule in rules:
        gap, asr, missing, terms = {}, {}, {}, []
        for p in partitions:
            clean = table.get((p, CLEAN_RULE, CLEAN_ATTACK))
            if clean is None:
                raise ValueError(f"no clean FedAvg run (rule mean, attack none) for partition {p!r}")
            attacks = sorted({k[2] for k in table if k[0] == p})
            ran = {a: table[(p, rule, a)] for a in attacks if (p, rule, a) in table}
            if not ran:
                continue
            missing[p] = [a for a in attacks if a not in ran and a != CLEAN_ATTACK and applies(rule, a)]
            worst = max(ran, key=lambda a: clean.accuracy - ran[a].accuracy)
            gap[p] = (clean.accuracy - ran[worst].accuracy, worst)
            goal = GOAL_GAP.get(p, GOAL_GAP["dirichlet"])
            terms.append((gap[p][0] / goal, math.hypot(clean.accuracy_sem, ran[worst].accuracy_sem) / goal))
            asr[p] = ran[BACKDOOR].asr if BACKDOOR in ran else math.nan
            if not math.isnan(asr[p]):
                terms.append((asr[p] / GOAL_ASR, ran[BACKDOOR].asr_sem / GOAL_ASR))
        if gap:
            cases.append(WorstCase(rule, gap, asr, missing, terms))
    return sorted(cases, key=lambda c: (any(c.missing.values()), c.score))


def paired_difference(
    results: Sequence[dict[str, Any]], incumbent: str, challenger: str, *, resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """The 95% interval of the incumbent's score minus the challenger's, bootstrapping the seeds they share
    (nan when they share fewer than ``MIN_PAIRED_SEEDS``).

    Both configurations and clean FedAvg ran on the same seeds, so a seed that is hard for one (its clean
    FedAvg ends low, its clients' data are far apart) tends to be hard for the other: resampling whole
    seeds, the same ones for both, keeps that pairing, which the standard errors of :func:`choose`'s
    fallback ignore. Each resample scores both as :func:`worst_cases` does.
    """
    mine = [r for r in results if r["rule"] in (incumbent, challenger, CLEAN_RULE)]
    mine = [r for r in mine if r["rule"] != CLEAN_RULE or r["attack"] == CLEAN_ATTACK]
    groups: dict[tuple[str, str, str], set[int]] = {}
    for r in mine:
        groups.setdefault((r["partition"], r["rule"], r["attack"]), set()).add(r["seed"])
    seeds = sorted(set.intersection(*groups.values())) if groups else []
    if len(seeds) < MIN_PAIRED_SEEDS:
        return math.nan, math.nan
    by_seed: dict[int, list[dict[str, Any]]] = {s: [] for s in seeds}
    for r in mine:
        if r["seed"] in by_seed:
            by_seed[r["seed"]].append(r)
    rng = random.Random(seed)
    differences = []
    for _ in range(resamples):
        drawn = [r for s in rng.choices(seeds, k=len(seeds)) for r in by_seed[s]]
        score = {c.rule: c.score for c in worst_cases(cells(drawn))}
        differences.append(score[incumbent] - score[challenger])
    differences.sort()
    return differences[int(0.025 * resamples)], differences[int(0.975 * resamples) - 1]


def choose(
    cases: list[WorstCase], incumbent: str, results: Sequence[dict[str, Any]] | None = None
) -> tuple[WorstCase, str]:
    """The default and why: the lowest score, unless the incumbent's may be as low within the seeds' noise.

    Changing a default changes every user's runs, so a challenger must beat the incumbent beyond the
    noise. With the ``results`` the scores come from, the test is paired: the challenger wins when the
    95% interval of the score difference over bootstrapped seeds (:func:`paired_difference`) lies above
    zero. Without them, or on fewer than ``MIN_PAIRED_SEEDS`` shared seeds (too few to resample), by more
    than one combined standard error of the two scores.
    """
    best = cases[0]
    current = next((c for c in cases if c.rule == incumbent and not any(c.missing.values())), None)
    if current is None or current is best:
        return best, "the lowest score"
    low, high = paired_difference(results, incumbent, best.rule) if results is not None else (math.nan, math.nan)
    if not math.isnan(low):
        interval = f"paired over the seeds, 95% interval of the difference [{low:.2f}, {high:.2f}]"
        if not low > 0:
            return current, (
                f"kept: {best.rule}'s lower score ({best.score:.2f}) is within the seeds' noise of the current "
                f"default's {current.score:.2f} ({interval})"
            )
        return best, f"the lowest score, {current.score - best.score:.2f} below {incumbent}'s ({interval})"
    noise = math.hypot(best.score_sem, current.score_sem)
    if current.score - best.score <= noise:
        return current, (
            f"kept: {best.rule}'s lower score ({best.score:.2f} ± {best.score_sem:.2f}) is within the seeds' "
            f"noise (± {noise:.2f}) of the current default's {current.score:.2f} ± {current.score_sem:.2f}"
        )
    return best, f"the lowest score, {current.score - best.score:.2f} below {incumbent}'s (noise ± {noise:.2f})"


def _pts(x: float) -> str:
    return f"{100 * x:.1f}"


def _asr(x: float) -> str:
    return "–" if math.isnan(x) else f"{x:.3f}"


def section(
    dirs: Sequence[Path],
    figure: Path | None = None,
    *,
    commands: Sequence[str] = (),
    incumbent: str = DEFAULT,
    rules: Sequence[str] = (),
    seeds: Sequence[int] = (),
) -> list[str]:
    """The report section: each fixed configuration's worst case, the chosen default, then per attack."""
    results = labelled_results(dirs, rules, seeds)
    if not results:
        return []
    table = cells(results)
    cases = worst_cases(table)
    chosen, why = choose(cases, incumbent, results) if cases else (None, "")
    mean_case = next(iter(c for c in worst_cases(table, include_mean=True) if c.rule == CLEAN_RULE), None)
    if not any(k[1] == CLEAN_RULE and k[2] != CLEAN_ATTACK for k in table):
        mean_case = None  # only the clean reference ran: the mean was not measured under attack
    partitions = [p for p in PARTITIONS if any(k[0] == p for k in table)]
    attacks = {p: sorted({k[2] for k in table if k[0] == p}) for p in partitions}
    seeds = sorted({r["seed"] for r in results})
    goal = " and ".join(f"{_pts(GOAL_GAP[p])} pts {p}" for p in partitions)
    lines = [
        "## Robust by default: the worst case of each fixed configuration",
        "",
        *(["```", *commands, "```", ""] if commands else []),
        f"{len(results)} runs. Digits, MLP, {results[0]['num_clients']} clients, f = {results[0]['num_byzantine']}, "
        f"{results[0]['num_rounds']} rounds, seeds {', '.join(map(str, seeds))}"
        + "".join(f", {e.removeprefix('+')}" for e in results[0].get("experiment_settings", []))
        + "; each cell is the final accuracy "
        "averaged over the seeds (a run that stopped counts as 0). The gap is clean FedAvg's accuracy (mean, "
        "no attack) minus the configuration's under an attack, in points; a configuration is worth its "
        "**largest** gap over the attack set, since a user does not know the attack in advance. Score: the "
        f"largest gap divided by its goal ({goal}) or the backdoor's attack success rate on triggered "
        f"test images divided by its goal ({GOAL_ASR:.2f}), whichever is larger: a score <= 1 meets every "
        "goal. The lowest score is the default, unless the current default's score is within the seeds' "
        "noise of it: the 95% interval of the difference of the two scores, bootstrapping the seeds they "
        f"share (the same seeds for both; {MIN_PAIRED_SEEDS} or more, else one combined standard error), must "
        "lie above zero.",
        "",
        "| configuration | " + " | ".join(f"worst gap, {p} (attack)" for p in partitions)
        + " | score ± s.e. | " + " | ".join(f"backdoor ASR, {p}" for p in partitions) + " |",
        "|---|" + "---|" * (2 * len(partitions) + 1),
    ]
    for case in [*cases, *([mean_case] if mean_case else [])]:
        name = f"**{case.rule}** (chosen)" if case is chosen else case.rule
        if case.rule == CLEAN_RULE:
            name = "mean (no defense)"
        gaps = [f"{_pts(case.gap[p][0])} ({case.gap[p][1]})" if p in case.gap else "–" for p in partitions]
        asr = [_asr(case.asr.get(p, math.nan)) for p in partitions]
        lacking = sorted({a for m in case.missing.values() for a in m})
        suffix = f" (not run under {', '.join(lacking)})" if lacking else ""
        score = f"{case.score:.2f} ± {case.score_sem:.2f}"
        lines.append(f"| {name}{suffix} | " + " | ".join(gaps) + f" | {score} | " + " | ".join(asr) + " |")
    lines.append("")
    if chosen is not None:
        best = chosen
        # Two decimals: a gap just above its goal would read as the goal itself with one (1.02 as 1.0).
        missed = [f"{p}: worst gap {100 * g:.2f} pts ({a}), goal {_pts(GOAL_GAP[p])}"
                  for p, (g, a) in best.gap.items() if g > GOAL_GAP[p]]
        missed += [f"{p}: backdoor ASR {asr:.3f}, goal {GOAL_ASR:.2f}"
                   for p, asr in best.asr.items() if asr > GOAL_ASR]
        lines += [
            f"Chosen default: **{best.rule}** (score {best.score:.2f}; {why}); goals "
            + ("met." if not missed else "**not met**: " + "; ".join(missed) + "."),
            "",
        ]
    if mean_case is not None:
        broken = []
        for p in partitions:
            clean = table[(p, CLEAN_RULE, CLEAN_ATTACK)].accuracy
            for attack in MUST_BREAK_MEAN:
                cell = table.get((p, CLEAN_RULE, attack))
                if cell is not None:
                    gap = clean - cell.accuracy
                    verdict = "broken" if gap >= BROKEN_GAP else f"**not broken** (< {_pts(BROKEN_GAP)} pts)"
                    broken.append(f"  * {p}, {attack}: {_pts(gap)} pts below clean - {verdict}")
        if broken:
            lines += [f"The plain mean under the attacks that should break it (>= {_pts(BROKEN_GAP)} points):",
                      "", *broken, ""]
    if figure is not None:
        plot(cases + ([mean_case] if mean_case else []), partitions, figure)
        lines += [f"![worst gap and backdoor success rate of each configuration](figures/{figure.name})", ""]
    for p in partitions:
        clean = table[(p, CLEAN_RULE, CLEAN_ATTACK)].accuracy
        lines += [
            f"**{p}**: gap to clean FedAvg ({clean:.3f}) per attack, points (negative: above clean)",
            "",
            "| configuration | " + " | ".join(attacks[p]) + " |",
            "|---|" + "---|" * len(attacks[p]),
        ]
        for case in cases:
            row = [
                _pts(clean - table[(p, case.rule, a)].accuracy) if (p, case.rule, a) in table
                else "–" if applies(case.rule, a) else "n/a"
                for a in attacks[p]
            ]
            lines.append(f"| {case.rule} | " + " | ".join(row) + " |")
        lines.append("")
    return lines


def plot(cases: list[WorstCase], partitions: list[str], path: Path) -> None:
    """Both halves of the trade-off, per configuration: the worst accuracy gap and the backdoor ASR.

    Goals as dashed lines. The plain mean is left out: its 70-point gaps would flatten every other bar.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in cases if c.rule != CLEAN_RULE]
    # Horizontal bars: the pipelines' names are long, and read best as row labels, in the table's order.
    fig, axes = plt.subplots(
        1, 2, figsize=(12.0, 1.2 + 0.3 * len(cases) * max(1, len(partitions))), sharey=True,
        gridspec_kw={"width_ratios": [3, 2]},
    )
    height = 0.8 / max(1, len(partitions))
    panels = (
        (axes[0], lambda c, p: 100 * c.gap[p][0] if p in c.gap else 0.0, lambda p: 100 * GOAL_GAP[p],
         "worst gap to clean FedAvg (points)"),
        (axes[1], lambda c, p: c.asr.get(p, 0.0), lambda p: GOAL_ASR, "backdoor attack success rate"),
    )
    for ax, value, goal, label in panels:
        for j, p in enumerate(partitions):
            ys = [i + (j - (len(partitions) - 1) / 2) * height for i in range(len(cases))]
            ax.barh(ys, [value(c, p) for c in cases], height, label=p, color=f"C{j}")
            ax.axvline(goal(p), color=f"C{j}", linestyle="--", linewidth=1)
        ax.set_xlabel(label)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(cases)), [c.rule for c in cases])
    axes[0].invert_yaxis()  # the first configuration of the table on top
    axes[0].legend(title="partition (dashed: goal)", loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    """Print the section for sweeps given on the command line (overlapping sweeps count each run once)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m experiments.worst_case", description=main.__doc__)
    parser.add_argument("dirs", type=Path, nargs="+", help="study result directories")
    parser.add_argument("--rules", nargs="+", default=[], help="only these configurations (and clean FedAvg)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[], help="only these seeds (default: all)")
    parser.add_argument("--incumbent", default=DEFAULT, help=f"the current default (default: {DEFAULT})")
    args = parser.parse_args(argv)
    missing = [str(d) for d in args.dirs if not d.is_dir()]
    if missing:
        parser.error(f"no such results directory: {', '.join(missing)}")
    ran = sorted({r["rule"].split(" @ ")[0] for r in labelled_results(args.dirs)})
    named = [*args.rules, *([args.incumbent] if args.incumbent != DEFAULT else [])]  # the default: where it ran
    unknown = [rule for rule in named if rule not in ran]
    if unknown and ran:  # a typo would give an empty table, or a default compared with nothing
        parser.error(f"no results of {', '.join(unknown)} in these directories; they hold: {', '.join(ran)}")
    try:
        lines = section(args.dirs, rules=args.rules, incumbent=args.incumbent, seeds=args.seeds)
    except ValueError as err:  # sweeps that cannot be compared (no clean FedAvg, hold-out beside test set)
        parser.error(str(err))
    if not lines:
        parser.error(f"no study results in {', '.join(map(str, args.dirs))}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
