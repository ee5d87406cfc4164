"""Hyper-parameters of one fixed configuration, picked on the validation hold-out by its worst case.

    python -m experiments.tune --out DIR --setting base= --setting "client_lr_0.1=client.lr=0.1" \\
        --setting "server_lr_1.5=server_optimizer.lr=1.5" [--rule winsorize+nnm+trimmed_mean] [--seeds 0 1]

Each setting (a name and Hydra overrides) runs, through the study (``experiments/study.py``, resumable:
results already in DIR are kept), clean FedAvg and the rule under the whole attack set, on the same
clients as the study, with ``dataset.validation_fraction`` (default 0.2): every client trains without the
held-out samples and the server evaluates on them, so the test set is never seen while choosing. A setting
that only changes the rule (``aggregator.*``) shares the clean FedAvg of the setting before it.

The choice uses the same measure as the default's (:mod:`experiments.worst_case`): each setting is scored as
a rule, ``RULE @ setting``, by its worst gap over the attacks and its backdoor success rate, each against its
goal. The gaps are taken to one reference, clean FedAvg at its best validation accuracy over the settings
(FedAvg is tuned too, as in ByzFL's protocol), so a setting that only slows clean training down does not
look robust. The base setting is kept unless another beats it beyond the seeds' noise
(:func:`experiments.worst_case.choose`). The chosen setting's test figures come from a plain study run with
its overrides.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments import study, worst_case
from fedrobust.config import AggregatorConfig

# Everything built that validation alone cannot reject (as the default was chosen, docs/results.md), plus
# attacks at settings of their own, each run as a sweep of its own: sign flip at scale 4, mimic with its
# copies spread apart (hidden from the duplicate filter) by half, one and one and a half typical honest
# distances (the widest the test set's sweeps use, docs/results/default_choice/adaptive3), a
# sleeper that flips signs only from round 10 on (after the direction filter's memory trusts it), and one
# that turns slowly.
ATTACKS = (
    "label_flip", "backdoor", "sign_flip", "mimic", "min_max", "min_sum", "fang_krum", "fang_trimmed_mean",
    "optimal_alie", "optimal_ipm", "optimal_fang", "optimal_mix", "rop",
)
# (sweep name, attack, overrides separated by spaces); the attack files declare no such params: "+" adds
# them. The last three are sleepers that turn, by 30 degrees a round from round 4, by 15 from round 2
# and by 6 from round 2 (the consistency filter's adaptive attacks: against its fast direction, against
# a slow one, and against how long the slow one remembers; the last completes its turn in round 31).
VARIANTS = (
    ("sign_flip_x4", "sign_flip", "+attack.params.scale=4.0"),
    ("mimic_noise_0.5", "mimic", "+attack.params.noise=0.5"),
    ("mimic_noise_1", "mimic", "+attack.params.noise=1.0"),
    ("mimic_noise_1.5", "mimic", "+attack.params.noise=1.5"),
    ("sign_flip_start_10", "sign_flip", "+attack.params.start_round=10"),
    ("sign_flip_turn_6", "sign_flip", "+attack.params.start_round=4 +attack.params.turn_rounds=6"),
    ("sign_flip_turn_12", "sign_flip", "+attack.params.start_round=2 +attack.params.turn_rounds=12"),
    ("sign_flip_turn_30", "sign_flip", "+attack.params.start_round=2 +attack.params.turn_rounds=30"),
)
BASE = "base"


def parse_setting(text: str) -> tuple[str, list[str]]:
    """``name=key=value key=value`` -> (name, overrides); ``base=`` is the configuration as it is."""
    name, sep, overrides = text.partition("=")
    # Every override is KEY=VALUE: "client.lr=0.1" alone (no name) leaves "0.1" and is refused.
    if not sep or not name or "/" in name or "__" in name or any("=" not in o for o in overrides.split()):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected NAME=OVERRIDES, each override KEY=VALUE, e.g. 'client_lr_0.1=client.lr=0.1' or "
            "'base=' (a NAME without '/' or '__')"
        )
    return name, overrides.split()


def sweep_dirs(out: Path, name: str) -> tuple[Path, dict[str, Path]]:
    """Where one setting's results go: its main sweep, and each variant's sweep by variant name."""
    return out / name, {variant: out / f"{name}__{variant}" for variant, _, _ in VARIANTS}


def split_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(shared, rule_only)``: overrides of ``aggregator.*`` set the tuned rule's own hyper-parameters.

    Clean FedAvg, the reference, runs the plain mean, which has no such parameters (a pre-aggregator's
    ``pre_params`` would be refused there), so it gets only the shared ones.
    """
    shared: list[str] = []
    rule_only: list[str] = []
    for override in overrides:
        key = override.partition("=")[0].lstrip("+~")
        (rule_only if key == "aggregator" or key.startswith("aggregator.") else shared).append(override)
    return shared, rule_only


def settings_with_clean_runs(settings: dict[str, list[str]]) -> set[str]:
    """The settings that run clean FedAvg: the first of each group whose shared overrides are the same.

    A setting that only changes the rule (``aggregator.*``) would run the very same clean FedAvg as the
    setting before it; the selection takes the best clean FedAvg over all settings anyway.
    """
    seen: set[tuple[str, ...]] = set()
    names = set()
    for name, overrides in settings.items():
        shared = tuple(split_overrides(overrides)[0])
        if shared not in seen:
            seen.add(shared)
            names.add(name)
    return names


def run_setting(
    name: str,
    overrides: list[str],
    *,
    rule: str,
    out: Path,
    validation_fraction: float,
    clean: bool = True,
    **study_args: Any,
) -> None:
    """The study runs of one setting that are not in ``out`` yet (clean FedAvg too, with ``clean``)."""
    extra = [f"dataset.validation_fraction={validation_fraction}", *overrides]
    shared, _ = split_overrides(extra)
    main, variants = sweep_dirs(out, name)
    if clean:
        study.run_study(rules=["mean"], attacks=["none"], extra=shared, out=main, **study_args)
    study.run_study(rules=[rule], attacks=list(ATTACKS), extra=extra, out=main, **study_args)
    for variant, attack, override in VARIANTS:
        study.run_study(
            rules=[rule], attacks=[attack], extra=[*extra, *override.split()], out=variants[variant], **study_args
        )


def selection_runs(
    out: Path, names: Sequence[str], rule: str, seeds: Sequence[int] | None = None
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every setting's runs, labelled as :func:`selection_table` scores them, and the reference per partition.

    The rule's runs are labelled ``RULE @ name``, a variant's attack with its setting; of clean FedAvg,
    only the runs of the setting with the best mean accuracy per partition are kept, as ``mean``/``none``.
    Only the runs of ``seeds`` count (all when None): a directory may hold more seeds from another selection.
    """
    runs: list[dict[str, Any]] = []
    clean: dict[str, tuple[worst_case.Cell, str]] = {}
    for name in names:
        main, variants = sweep_dirs(out, name)
        results = study.load_results(main)
        for variant, attack, override in VARIANTS:
            label = worst_case.label(attack, override.split())
            results += [r | {"attack": label} for r in study.load_results(variants[variant])]
        results = [r for r in results if seeds is None or r["seed"] in seeds]
        for (partition, r, attack), cell in worst_case.cells(results).items():
            is_clean = (r, attack) == (worst_case.CLEAN_RULE, worst_case.CLEAN_ATTACK)
            if is_clean and (partition not in clean or cell.accuracy > clean[partition][0].accuracy):
                clean[partition] = (cell, name)
        runs += [r | {"rule": f"{rule} @ {name}"} for r in results if r["rule"] == rule]
        runs += [r | {"setting": name} for r in results if r["rule"] == worst_case.CLEAN_RULE
                 and r["attack"] == worst_case.CLEAN_ATTACK]
    reference = {p: name for p, (_, name) in clean.items()}
    runs = [r for r in runs if r.get("setting", reference.get(r["partition"])) == reference.get(r["partition"])]
    return runs, reference


def selection_table(
    out: Path, names: Sequence[str], rule: str, seeds: Sequence[int] | None = None
) -> tuple[dict, dict[str, str]]:
    """One worst-case table over every setting: ``RULE @ name`` per setting, and the best clean FedAvg.

    Returns the table (:func:`experiments.worst_case.cells` keys) and, per partition, which setting's
    FedAvg is the reference (:func:`selection_runs`).
    """
    runs, reference = selection_runs(out, names, rule, seeds)
    return worst_case.cells(runs), reference


def report(out: Path, settings: dict[str, list[str]], rule: str, seeds: Sequence[int] | None = None) -> str:
    """The selection as Markdown: every setting's worst case on validation data, best first, and the choice."""
    runs, reference = selection_runs(out, list(settings), rule, seeds)
    cases = worst_case.worst_cases(worst_case.cells(runs))
    chosen, why = worst_case.choose(cases, f"{rule} @ {BASE}" if BASE in settings else cases[0].rule, runs)
    partitions = [p for p in study.PARTITIONS if p in reference]
    lines = [
        f"Validation hold-out, `{rule}`: worst gap to clean FedAvg (points; at its best setting: "
        + ", ".join(f"{p} {reference[p]}" for p in partitions) + ") and backdoor ASR.",
        "",
        "| setting | overrides | " + " | ".join(f"{p} worst gap (attack) | {p} ASR" for p in partitions)
        + " | score |",
        "|---|---|" + "---:|---:|" * len(partitions) + "---:|",
    ]
    for case in cases:
        name = case.rule.split(" @ ", 1)[1]
        cols = []
        for p in partitions:
            gap, attack = case.gap.get(p, (math.nan, "-"))
            asr = case.asr.get(p, math.nan)
            cols += [f"{100 * gap:.1f} ({attack})", "–" if math.isnan(asr) else f"{asr:.3f}"]
        missing = sum(len(m) for m in case.missing.values())
        score = f"{case.score:.2f} ± {case.score_sem:.2f}" + (f" ({missing} runs missing)" if missing else "")
        lines.append(f"| {name} | `{' '.join(settings[name]) or '-'}` | " + " | ".join(cols) + f" | {score} |")
    lines += ["", f"Chosen: **{chosen.rule.split(' @ ', 1)[1]}** ({why})."]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.tune",
        description="Pick a configuration's hyper-parameters on the validation hold-out by the worst case over "
        "the attack set.",
    )
    parser.add_argument("--setting", dest="settings", action="append", type=parse_setting, required=True,
                        metavar="NAME=OVERRIDES", help="a candidate: a name and Hydra overrides ('base=': as is)")
    parser.add_argument("--rule", default=AggregatorConfig().name, help="the configuration (default: %(default)s)")
    parser.add_argument("--validation-fraction", type=float, default=0.2,
                        help="dataset.validation_fraction of every run (default: %(default)s)")
    parser.add_argument("--partitions", nargs="+", default=list(study.DEFAULT_PARTITIONS), choices=study.PARTITIONS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--rounds", type=int, default=study.DEFAULT_ROUNDS)
    parser.add_argument("--clients", type=int, default=study.DEFAULT_CLIENTS,
                        help="clients, all in every round (default: %(default)s)")
    parser.add_argument("--byzantine", type=int, default=study.DEFAULT_BYZANTINE,
                        help="f, the Byzantine clients (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=2, help="parallel processes (default: %(default)s)")
    parser.add_argument("--out", type=Path, required=True, help="results directory (existing results are kept)")
    parser.add_argument("--report-only", action="store_true", help="run nothing; select from the results in --out")
    args = parser.parse_args(argv)
    if not 0 < args.validation_fraction < 1:
        parser.error(f"--validation-fraction must be in (0, 1), got {args.validation_fraction}")
    names = [name for name, _ in args.settings]
    if len(set(names)) != len(names):
        parser.error(f"setting names must differ: {names}")
    return args


def setting_problems(settings: dict[str, list[str]], args: argparse.Namespace) -> list[str]:
    """Each setting's config, composed and validated as its first run would be: a value that is wrong
    (client.lr=-1) fails here, not after the settings before it have run."""
    from fedrobust.config import ConfigError

    problems = []
    for name, overrides in settings.items():
        spec = study.RunSpec(partition=args.partitions[0], rule=args.rule, attack="none", seed=args.seeds[0])
        extra = [f"dataset.validation_fraction={args.validation_fraction}", *overrides]
        try:
            study.compose({name: study.overrides_for(spec, rounds=args.rounds, extra=extra)})
        except ConfigError as err:
            problems += [f"--setting {name}: {line}" for line in err.problems]
    return problems


def main(argv: Sequence[str] | None = None) -> None:
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(args_list)
    settings = dict(args.settings)
    # Checked before anything runs: a misspelled rule or override failed after clean FedAvg's runs.
    problems = [line.replace("--rules:", "--rule:", 1) for line in study.argument_problems([args.rule], [])] + [
        f"--setting {name}: {line.removeprefix('--set ')}"
        for name, overrides in settings.items()
        for line in study.extra_problems(overrides, args.partitions)
    ]
    if not problems and not args.report_only:
        problems = setting_problems(settings, args)
    if args.report_only and not any(args.out.glob("*/*.json")):
        problems.append(f"--report-only: no results in {args.out}")
    if problems:
        study._exit_invalid("invalid arguments", problems, prog="experiments.tune")
    if not args.report_only:
        study._worker_init()
        command = shlex.join(["python", "-m", "experiments.tune", *args_list])
        with_clean = settings_with_clean_runs(settings)
        for name, overrides in settings.items():
            run_setting(
                name, overrides, rule=args.rule, out=args.out, validation_fraction=args.validation_fraction,
                clean=name in with_clean, partitions=args.partitions, seeds=args.seeds, rounds=args.rounds,
                num_clients=args.clients, num_byzantine=args.byzantine, jobs=args.jobs, command=command,
            )
    text = report(args.out, settings, args.rule, args.seeds)
    (args.out / "selection.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
