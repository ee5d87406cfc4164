"""Tables and figures of the robustness study (``experiments/study.py``).

    python -m experiments.report --results outputs/study [--pilot outputs/pilot]   # -> outputs/study/report/
    python -m experiments.report --results docs/results --docs docs ...            # the shipped docs/results.md

Writes ``<docs>/results.md`` and ``<docs>/figures/*.png`` from the run results in
``--results``; without ``--docs``, ``<docs>`` is ``<results>/report``, so that a report of one's
own study never overwrites the shipped docs. ``--pilot`` adds the pilot that chose the rule
behind NNM; ``<docs>/results/notes.md``, when present, is included as the discussion.
``--default-choice`` puts first the worst case of each fixed configuration over the sweeps given
(:mod:`experiments.worst_case`), followed by ``<docs>/results/default_choice.md`` when present.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib import colors
from matplotlib.ticker import MaxNLocator

from experiments import worst_case
from experiments.study import ATTACKS, OK, PARTITIONS, QUORUM, RULES, load_results
from experiments.worst_case import CLEAN_ATTACK, CLEAN_RULE

# Accuracy-point gaps allowed between the best robust configuration and clean FedAvg.
TARGET_GAP = {"iid": 0.02, "dirichlet": 0.05}
# "Visibly hurt": the plain mean under attack loses at least this much final accuracy.
HURT_GAP = 0.05
MUST_HURT_MEAN = ("sign_flip", "alie", "nan")
PARTITION_TITLES = {"iid": "IID", "dirichlet": "Dirichlet", "pathological": "Pathological (2 classes per client)"}


@dataclass
class Cell:
    """The runs of one (partition, rule, attack) over seeds."""

    runs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> list[dict[str, Any]]:
        return [r for r in self.runs if r["status"] == OK and r["rows"]]

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.runs if r not in self.ok]

    @property
    def finals(self) -> list[float]:
        return [_acc(r["rows"][-1]) for r in self.ok]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.finals) if self.finals else math.nan

    @property
    def std(self) -> float:
        return statistics.pstdev(self.finals) if len(self.finals) > 1 else 0.0

    @property
    def worst(self) -> float:
        """Lowest accuracy in the second half of the rounds, over every seed (dips and oscillations)."""
        late = [_acc(row) for r in self.ok for row in _late_rows(r)]
        return min(late) if late else math.nan

    def rejected_per_round(self) -> dict[str, float]:
        counts: Counter[str] = Counter()
        rounds = 0
        for r in self.runs:
            for row in r["rows"]:
                rounds += 1
                counts.update(row.get("rejected", {}))
        return {k: v / rounds for k, v in sorted(counts.items())} if rounds else {}

    def rollbacks(self) -> int:
        return sum(r["rows"][-1].get("rollbacks", 0) for r in self.runs if r["rows"])


def _acc(row: dict[str, Any]) -> float:
    value = row.get("accuracy", math.nan)
    return float(value) if value is not None else math.nan


def _late_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    first = late_from(result["num_rounds"])
    return [row for row in result["rows"] if row["round"] >= first]


def late_from(num_rounds: int) -> int:
    """First round of the "second half" that the worst-round accuracy looks at."""
    return num_rounds // 2 + 1


def cells_of(results: list[dict[str, Any]]) -> dict[tuple[str, str, str], Cell]:
    cells: dict[tuple[str, str, str], Cell] = defaultdict(Cell)
    for r in results:
        cells[(r["partition"], r["rule"], r["attack"])].runs.append(r)
    return dict(cells)


def _ordered(values: set[str], preferred: Sequence[str]) -> list[str]:
    return [v for v in preferred if v in values] + sorted(values - set(preferred))


def _pts(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:+.1f}"


def _count(n: int, word: str) -> str:
    """``1 seed``, ``3 seeds``."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def _on_two_cores(cpu_seconds: float) -> str:
    """How long the runs' CPU time takes on the 2 idle cores the figures were taken on."""
    wall = cpu_seconds / 2
    return f"{wall / 60:.0f} min on 2 idle cores" if wall >= 60 else f"{wall:.0f} s on 2 idle cores"


def _spread(cell: Cell) -> str:
    """`` ± 0.004`` over the seeds; with one seed there is no spread to give, and the text says so."""
    return f" ± {cell.std:.3f}" if len(cell.finals) > 1 else " (1 seed)"


def _cell_text(cell: Cell | None) -> str:
    if cell is None or not cell.runs:
        return "–"
    if not cell.ok:
        reasons = {r["status"] for r in cell.runs}
        return "no quorum" if reasons == {QUORUM} else "failed"
    text = f"{cell.mean:.3f}{_spread(cell)} ({cell.worst:.2f})"
    if cell.failed:
        text += f" [{len(cell.failed)}/{len(cell.runs)} failed]"
    return text


def _failure_reason(cell: Cell) -> str:
    first = cell.failed[0]["error"].splitlines()[0] if cell.failed else ""
    return first[:200]


# --------------------------------------------------------------------------- figures
def _rule_style(rules: list[str]) -> dict[str, dict[str, Any]]:
    palette = plt.get_cmap("tab10")  # palette(k): the k-th of its 10 colours (RGBA)
    styles = {}
    for i, rule in enumerate(rules):
        if rule == CLEAN_RULE:
            styles[rule] = {"color": "black", "linestyle": "--", "linewidth": 2.0}
        else:
            # Pre-aggregated variants (nnm+...) dash-dotted, to tell them from their base rule.
            styles[rule] = {"color": palette(i % 10), "linestyle": "-." if "+" in rule else "-", "linewidth": 1.4}
    return styles


def plot_curves(cells: dict, partition: str, rules: list[str], attacks: list[str], path: Path) -> None:
    """Accuracy per round, one subplot per attack, one line per rule (mean over seeds, band = min..max)."""
    ncols = 3 if len(attacks) > 4 else max(1, len(attacks))
    nrows = math.ceil(len(attacks) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.0 * ncols, 3.6 * nrows + 0.9), squeeze=False, sharey=True)
    styles = _rule_style(rules)
    lowest = 1.0
    for ax, attack in zip(axes.flat, attacks, strict=False):
        for rule in rules:
            cell = cells.get((partition, rule, attack))
            if cell is None or not cell.ok:
                continue
            by_round: dict[int, list[float]] = defaultdict(list)
            for run in cell.ok:
                for row in run["rows"]:
                    by_round[row["round"]].append(_acc(row))
            rounds = sorted(by_round)
            mean = [statistics.fmean(by_round[t]) for t in rounds]
            lowest = min([lowest, *(mean[2:] or mean)])  # after the first rounds, where every run starts low
            ax.plot(rounds, mean, label=rule, **styles[rule])
            if len(cell.ok) > 1:
                ax.fill_between(
                    rounds, [min(by_round[t]) for t in rounds], [max(by_round[t]) for t in rounds],
                    color=styles[rule]["color"], alpha=0.08, linewidth=0,
                )
        # A cell with runs but no usable one: every run stopped (no quorum) or failed with an error.
        missing = [r for r in rules if (c := cells.get((partition, r, attack))) is not None and not c.ok]
        title = f"attack: {attack}"
        ax.set_title(title, fontsize=12)
        if missing:
            ax.text(0.98, 0.03, "no result: " + ", ".join(missing), transform=ax.transAxes, ha="right",
                    va="bottom", fontsize=9, color="firebrick")
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=10)
    # Zoom in on where the curves are (from round 3 on); the tables hold every number.
    axes.flat[0].set_ylim(max(0.0, math.floor(lowest * 10) / 10 - 0.05), 1.0)
    for ax in axes[-1]:
        ax.set_xlabel("round", fontsize=11)
    for ax in axes.flat:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole: no 1.25, 1.5 ticks
    for ax in axes[:, 0]:
        ax.set_ylabel("test accuracy", fontsize=11)
    for ax in list(axes.flat)[len(attacks):]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    for ax in axes.flat:
        h, lab = ax.get_legend_handles_labels()
        if len(lab) > len(labels):
            handles, labels = h, lab
    if labels:  # none when no run of the partition has a result
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 9), fontsize=11, frameon=False)
    fig.suptitle(f"Test accuracy per round, {PARTITION_TITLES.get(partition, partition)} partition "
                 "(mean over seeds; band: min..max)", fontsize=14)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_heatmap(cells: dict, partition: str, rules: list[str], attacks: list[str], path: Path) -> None:
    """Final accuracy (mean over seeds) per rule and attack, annotated; grey: no quorum."""
    import numpy as np

    values = np.full((len(rules), len(attacks)), np.nan)
    for i, rule in enumerate(rules):
        for j, attack in enumerate(attacks):
            cell = cells.get((partition, rule, attack))
            if cell is not None and cell.ok:
                values[i, j] = cell.mean
    # Room for the labels: a user's dotted class names (`my_pkg.attacks.MyAttack`) run far longer than the
    # built-in names, and without it tight_layout gives up. About 0.09 in a character at 11 pt; the attack
    # labels slant at 30 degrees, so half their length goes down.
    rule_label = 0.09 * max(len(rule) for rule in rules)
    attack_label = 0.09 * max(len(attack) for attack in attacks)
    fig, ax = plt.subplots(figsize=(1.15 * len(attacks) + 3.0 + max(0.0, rule_label - 1.8),
                                    0.62 * len(rules) + 1.8 + max(0.0, attack_label / 2 - 0.9)))
    cmap = plt.get_cmap("RdYlGn").with_extremes(bad="lightgrey")
    # A power norm spreads the 0.8..1.0 range, where the robust rules differ, over most of the colours.
    norm = colors.PowerNorm(gamma=3.0, vmin=0.0, vmax=1.0)
    image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, norm=norm, aspect="auto")
    ax.set_xticks(range(len(attacks)), attacks, rotation=30, ha="right", fontsize=11)
    ax.set_yticks(range(len(rules)), rules, fontsize=11)
    for i in range(len(rules)):
        for j in range(len(attacks)):
            v = values[i, j]
            text = "no\nquorum" if math.isnan(v) and cells.get((partition, rules[i], attacks[j])) else (
                "" if math.isnan(v) else f"{v:.3f}")
            dark = not math.isnan(v) and norm(v) < 0.25
            ax.text(j, i, text, ha="center", va="center", fontsize=9.5, color="white" if dark else "black")
    bar = fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02, ticks=[0.0, 0.5, 0.7, 0.8, 0.9, 0.95, 1.0])
    bar.set_label("final test accuracy", fontsize=11)
    ax.set_title(f"Final accuracy, rule x attack, {PARTITION_TITLES.get(partition, partition)} "
                 "(mean over seeds)", fontsize=13)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- report
def _study_meta(results_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((results_dir / "study.json").read_text())
    except (OSError, ValueError):
        return {}


def _clean(cells: dict, partition: str) -> Cell | None:
    cell = cells.get((partition, CLEAN_RULE, CLEAN_ATTACK))
    return cell if cell is not None and cell.ok else None


def _best_robust(cells: dict, partition: str, attack: str, rules: list[str]) -> tuple[str, Cell] | None:
    """The robust rule (not the plain mean) with the highest mean final accuracy; failed cells never win."""
    candidates = [
        (rule, cells[(partition, rule, attack)])
        for rule in rules
        if rule != CLEAN_RULE and (partition, rule, attack) in cells
        and cells[(partition, rule, attack)].ok and not cells[(partition, rule, attack)].failed
    ]
    if not candidates:
        return None
    return max(candidates, key=lambda rc: (rc[1].mean, -rc[1].std))


def _table_lines(cells: dict, partition: str, rules: list[str], attacks: list[str]) -> list[str]:
    """The rule x attack table of one partition, with each rule's worst attack."""
    if len(attacks) == 1:
        lines = [f"| rule | {attacks[0]} |", "|---|---|"]
        return lines + [f"| {rule} | {_cell_text(cells.get((partition, rule, attacks[0])))} |" for rule in rules]
    lines = ["| rule | " + " | ".join(attacks) + " | worst attack |", "|---|" + "---|" * (len(attacks) + 1)]
    for rule in rules:
        row = [_cell_text(cells.get((partition, rule, a))) for a in attacks]
        # The worst of the attacks, not of the baseline: an attack that raises accuracy (noise that acts as
        # a regulariser) would otherwise make `none` the "worst attack".
        finals = {a: (c.mean if c.ok else -1.0) for a in attacks
                  if a != "none" and (c := cells.get((partition, rule, a)))}
        worst_attack = min(finals, key=finals.__getitem__) if finals else ""
        if not finals:
            worst_text = "–"
        elif finals[worst_attack] < 0:
            worst_text = f"no quorum ({worst_attack})"
        else:
            worst_text = f"{finals[worst_attack]:.3f} ({worst_attack})"
        lines.append(f"| {rule} | " + " | ".join(row) + f" | {worst_text} |")
    return lines


def _code_text(code: str) -> str:
    if not code:
        return "not recorded"
    return code[:10] + (" with uncommitted changes" if code.endswith("+dirty") else "")


def _set_for_every_run(results: list[dict[str, Any]]) -> list[str]:
    """A bullet naming the study's ``--set`` overrides (stored after the study's own in each run's
    overrides), which take precedence over the settings the bullet before names; none without any. The
    ``attack.params`` ones are not given to ``attack=none`` (the study leaves them out there)."""
    attacked = [r for r in results if r.get("attack") != "none"] or results
    overrides = list(attacked[0].get("overrides", []))
    own_last = "liveness.quarantine_after=0"
    extra = overrides[overrides.index(own_last) + 1:] if own_last in overrides else []
    if not extra:
        return []
    honest = any(r.get("attack") == "none" for r in results) and any(_is_attack_param(e) for e in extra)
    but = " (those of `attack.params` for every attack, `none` aside)" if honest else ""
    return [f"* Set for every run (`--set`){but}, over the settings above: {', '.join(f'`{e}`' for e in extra)}."]


def _study_commands(meta: dict[str, Any]) -> list[str]:
    """The different study commands that wrote into the results directory, in the order they first ran (one
    directory can hold the runs of several: another attack, the same settings)."""
    commands = [i.get("command") for i in meta.get("invocations", []) if i.get("command")]
    return list(dict.fromkeys(commands)) or [meta.get("command") or "python -m experiments.study ..."]


def _own_attacks(attacks: list[str]) -> str:
    """`` (..., the class's defaults)`` naming the attacks of the user's own (dotted paths) among ``attacks``."""
    own = [a for a in attacks if "." in a or ":" in a]
    return f" ({', '.join(f'`{a}`' for a in own)}: the defaults of its own class)" if own else ""


def _is_attack_param(override: str) -> bool:
    return override.lstrip("+").startswith("attack.params")


def _clients(results: list[dict[str, Any]]) -> str:
    """The clients' local training, as the results record it (``client``, since 2026-11-26)."""
    recorded = {json.dumps(r["client"], sort_keys=True) for r in results if "client" in r}
    if len(recorded) == 1 and all("client" in r for r in results):
        c = json.loads(recorded.pop())
        return (f"{c['local_epochs']} local epochs of SGD (lr {c['lr']}, momentum {c['momentum']}, "
                f"batch {c['batch_size']})")
    if recorded:
        return "local training that differs between runs (each result's `client` records its own)"
    # Results from before the record ran the defaults of their time.
    return ("2 local epochs of SGD (lr 0.3, momentum 0.9, batch 16), the defaults of `conf/config.yaml` "
            "until 2026-11-26 (3 local epochs since: run these again with `--set client.local_epochs=2`)")


def _partition_label(partition: str, alpha: float) -> str:
    title = PARTITION_TITLES.get(partition, partition)
    return f"{title} alpha={alpha}" if partition == "dirichlet" else title


def _extra_section(extra_dir: Path, main_cells: dict) -> list[str]:
    """A supplementary sweep (e.g. a stronger attack setting), next to the main study's cells."""
    results = load_results(extra_dir)
    if not results:
        return []
    cells = cells_of(results)
    meta = _study_meta(extra_dir)
    extra = ", ".join(f"`{e}`" for e in meta.get("settings", {}).get("extra", [])) or "none"
    lines = [f"### {extra}", "", f"Command: `{meta.get('command', '?')}`", ""]
    partitions = _ordered({r["partition"] for r in results}, PARTITIONS)
    rules = _ordered({r["rule"] for r in results}, RULES)
    attacks = _ordered({r["attack"] for r in results}, ATTACKS)
    for partition in partitions:
        clean = _clean(main_cells, partition)
        ref = f"; clean FedAvg of the main study: {clean.mean:.3f}{_spread(clean)}" if clean else ""
        lines += [f"**{PARTITION_TITLES.get(partition, partition)}**{ref}", "",
                  *_table_lines(cells, partition, rules, attacks), ""]
    return lines


def _pilot_section(pilot_dir: Path) -> list[str]:
    results = load_results(pilot_dir)
    if not results:
        return []
    cells = cells_of(results)
    meta = _study_meta(pilot_dir)
    partitions = _ordered({r["partition"] for r in results}, PARTITIONS)
    rules = _ordered({r["rule"] for r in results}, RULES)
    attacks = _ordered({r["attack"] for r in results}, ATTACKS)
    lines = [
        "## How the rule behind NNM was chosen (pilot)",
        "",
        f"Command: `{meta.get('command', '?')}`",
        "",
        "Final accuracy of each rule averaged over the pilot's attacks, and its worst attack "
        f"({', '.join(attacks)}; seed(s) {', '.join(str(x) for x in sorted({r['seed'] for r in results}))}); "
        "a failed run counts as accuracy 0. Sorted by the worst case, the criterion for \"strongest\": "
        "a robust rule is as good as its worst attack.",
        "",
    ]
    for partition in partitions:
        lines += [f"**{PARTITION_TITLES.get(partition, partition)}**", "",
                  "| rule | mean over attacks | worst attack |", "|---|---|---|"]
        scored = []
        for rule in rules:
            finals = {a: (cells[(partition, rule, a)].mean if cells[(partition, rule, a)].ok else 0.0)
                      for a in attacks if (partition, rule, a) in cells}
            if not finals:
                continue
            worst_attack = min(finals, key=finals.__getitem__)
            scored.append((statistics.fmean(finals.values()), finals[worst_attack], worst_attack, rule))
        for mean, worst, worst_attack, rule in sorted(scored, key=lambda x: (x[1], x[0]), reverse=True):
            lines.append(f"| {rule} | {mean:.3f} | {worst:.3f} ({worst_attack}) |")
        lines.append("")
    return lines


def write_report(
    results_dir: Path,
    docs_dir: Path,
    *,
    pilot_dir: Path | None = None,
    extra_dirs: Sequence[Path] = (),
    default_choice_dirs: Sequence[Path] = (),
    default_choice_seeds: Sequence[int] = (),
    report_command: str = "",
) -> Path:
    """Write ``docs_dir/results.md`` and ``docs_dir/figures/*.png`` from the study in ``results_dir``."""
    results = load_results(results_dir)
    if not results:
        raise ValueError(f"no study results in {results_dir}")
    cells = cells_of(results)
    meta = _study_meta(results_dir)
    partitions = _ordered({r["partition"] for r in results}, PARTITIONS)
    rules = _ordered({r["rule"] for r in results}, RULES)
    attacks = _ordered({r["attack"] for r in results}, ATTACKS)
    seeds = sorted({r["seed"] for r in results})
    first = results[0]
    num_rounds = first["num_rounds"]
    figures = docs_dir / "figures"
    figures.mkdir(parents=True, exist_ok=True)

    figure_names: dict[str, dict[str, str]] = {}
    for partition in partitions:
        curves, heatmap = f"study_curves_{partition}.png", f"study_heatmap_{partition}.png"
        plot_curves(cells, partition, rules, attacks, figures / curves)
        plot_heatmap(cells, partition, rules, attacks, figures / heatmap)
        figure_names[partition] = {"curves": curves, "heatmap": heatmap}

    invocations = meta.get("invocations", [])
    run_seconds = [r["seconds"] for r in results]
    run_cpu = [r.get("cpu_seconds", math.nan) for r in results]
    lines = [
        "# Robustness study: robust rules x Byzantine attacks",
        "",
        "Generated by `experiments/report.py` from the per-run results of `experiments/study.py`; "
        "do not edit by hand (the discussion comes from `docs/results/notes.md`).",
        "",
        "## What was run",
        "",
        "```",
        *_study_commands(meta),
        report_command or "python -m experiments.report ...",
        "```",
        "",
        f"* {_count(len(results), 'run')}: {_count(len(rules), 'rule')} x {_count(len(attacks), 'attack')} x "
        f"{_count(len(partitions), 'partition')} "
        f"({', '.join(_partition_label(p, first['alpha']) for p in partitions)}) x {_count(len(seeds), 'seed')} "
        f"({', '.join(map(str, seeds))}).",
        f"* Each run: digits (scikit-learn, 8x8), MLP 64-64-10, {first['num_clients']} clients, all of them in "
        f"every round, f = num_byzantine = {first['num_byzantine']}, {num_rounds} rounds, FedAvg server step "
        f"(lr 1.0), clients: {_clients(results)}; attacks with their `conf/attack/*.yaml` settings"
        f"{_own_attacks(attacks)}; validation on "
        "(finite, L2 norm <= 100, same shapes); divergence guard on; quarantine off "
        "(`liveness.quarantine_after=0`, so every round has all clients and Bulyan's n >= 4f+3 holds "
        "unless validation rejects replies).",
        *_set_for_every_run(results),
        f"* `attack=none` keeps `num_byzantine={first['num_byzantine']}`: the rules are configured identically "
        f"with and without an attack; the {first['num_byzantine']} \"Byzantine\" clients then behave honestly.",
        "* Invocations of the command (a later one runs only the results that are missing): "
        + "; ".join(
            f"{i.get('runs')} runs in {i.get('wall_seconds', 0):.0f} s ({i.get('wall_seconds', 0) / 60:.1f} min) "
            f"with {_count(i.get('jobs', 0), 'job')} on {i.get('cpu_count')} cores, finished "
            f"{i.get('finished_at', '?')}, "
            f"code {_code_text(i.get('code', ''))}"
            for i in invocations
        )
        + (". " if invocations else "none recorded. ")
        + f"Median run {statistics.median(run_seconds):.1f} s wall, {statistics.median(run_cpu):.1f} s CPU. "
        f"The runs' CPU time adds up to {sum(run_cpu):.0f} s ({_on_two_cores(sum(run_cpu))}); "
        "where the wall time is much longer, the machine was busy with other work. "
        "The runs use the in-process transport of "
        "`experiments/inprocess.py` (the production server and ClientApp code without Ray's start-up); each "
        "run's Hydra overrides are stored in its result file, so any cell can be re-run on Flower's "
        "simulation engine with `python -m experiments.run <overrides>`.",
        "",
        "Cells: final test accuracy, mean ± std over seeds, and in brackets the worst-round accuracy: the "
        f"lowest test accuracy in rounds {late_from(num_rounds)}-{num_rounds} over all seeds (dips and "
        "oscillations after the start). \"no quorum\": every round had fewer valid replies than the rule "
        "needs, and the run stopped (see below).",
        "",
    ]

    if default_choice_dirs:
        # The report leads with what a user gets: one fixed configuration, judged by its worst attack.
        commands = list(dict.fromkeys(  # every invocation that added results, in order, once each
            i.get("command", "?") for d in default_choice_dirs for i in _study_meta(d).get("invocations", [])
        ))
        lines += worst_case.section(default_choice_dirs, figures / "default_choice.png", commands=commands,
                                    seeds=default_choice_seeds)
        notes = docs_dir / "results" / "default_choice.md"
        if notes.exists():
            lines += [notes.read_text().strip(), ""]

    # ---------------------------------------------------------------- headline
    lines += ["## Headline: best robust configuration per attack vs clean FedAvg", ""]
    misses: list[str] = []
    for partition in partitions:
        clean = _clean(cells, partition)
        gap_allowed = TARGET_GAP.get(partition, 0.05)
        title = PARTITION_TITLES.get(partition, partition)
        if clean is None:
            lines += [f"**{title}**: no clean FedAvg run (mean, none) - no reference.", ""]
            continue
        lines += [
            f"**{title}** - clean FedAvg (mean, no attack): **{clean.mean:.3f}{_spread(clean)}**; "
            f"target: best robust configuration within {100 * gap_allowed:.0f} points.",
            "",
            "| attack | best robust rule | its final accuracy | vs clean (points; negative: below) | target "
            "| plain mean under this attack |",
            "|---|---|---|---|---|---|",
        ]
        for attack in attacks:
            best = _best_robust(cells, partition, attack, rules)
            mean_cell = cells.get((partition, CLEAN_RULE, attack))
            mean_text = _cell_text(mean_cell) if mean_cell else "–"
            if mean_cell is not None and mean_cell.ok and attack != CLEAN_ATTACK:
                mean_text += f", {_pts(mean_cell.mean - clean.mean)} pts"
            if best is None:
                lines.append(f"| {attack} | none finished | – | – | **missed** | {mean_text} |")
                misses.append(f"{title}, {attack}: no robust rule finished every seed.")
                continue
            rule, top = best
            gap = clean.mean - top.mean
            met = gap <= gap_allowed + 1e-12
            lines.append(
                f"| {attack} | {rule} | {top.mean:.3f}{_spread(top)} ({top.worst:.2f}) | {_pts(-gap)} | "
                f"{'met' if met else '**missed**'} | {mean_text} |"
            )
            if not met:
                misses.append(
                    f"{title}, {attack}: the best robust rule, {rule}, reaches {top.mean:.3f}{_spread(top)}, "
                    f"{100 * gap:.1f} points below clean FedAvg ({clean.mean:.3f}); allowed {100 * gap_allowed:.0f}."
                )
        lines.append("")
        # Plain mean must be visibly hurt by these attacks.
        hurt_lines, hurt_attacks = [], []
        for attack in MUST_HURT_MEAN:
            cell = cells.get((partition, CLEAN_RULE, attack))
            if cell is None:
                continue
            hurt_attacks.append(attack)
            if not cell.ok:
                hurt_lines.append(f"  * {attack}: plain mean did not finish ({_failure_reason(cell)}) - hurt.")
                continue
            drop = clean.mean - cell.mean
            hurt = drop >= HURT_GAP
            why = ""
            rejected = cell.rejected_per_round()
            if not hurt and rejected:
                caught = ", ".join(f"{v:.1f} replies/round as {k}" for k, v in rejected.items())
                why = f" - validation rejected {caught} before aggregation"
            hurt_lines.append(
                f"  * {attack}: {cell.mean:.3f}{_spread(cell)}, {100 * drop:.1f} points below clean - "
                + ("visibly hurt" if hurt else f"**not visibly hurt** (< {100 * HURT_GAP:.0f} points){why}")
            )
            if not hurt:
                misses.append(
                    f"{title}, plain mean under {attack}: {cell.mean:.3f}{_spread(cell)}, only {100 * drop:.1f} "
                    f"points below clean FedAvg ({clean.mean:.3f}){why}."
                )
        if hurt_lines:
            lines += [f"Plain mean under {', '.join(hurt_attacks)} (\"visibly hurt\" = at least "
                      f"{100 * HURT_GAP:.0f} points below clean):", "", *hurt_lines, ""]
    lines += ["### Targets missed", ""]
    lines += [f"* {m}" for m in misses] if misses else ["None."]
    lines.append("")

    notes = docs_dir / "results" / "notes.md"
    if notes.exists():
        lines += ["## Discussion", "", notes.read_text().strip(), ""]

    # ---------------------------------------------------------------- full tables
    for partition in partitions:
        title = PARTITION_TITLES.get(partition, partition)
        lines += [f"## {title}: final accuracy, rule x attack", "", *_table_lines(cells, partition, rules, attacks)]
        lines += [
            "",
            f"![accuracy per round, {title}](figures/{figure_names[partition]['curves']})",
            "",
            f"![final accuracy heatmap, {title}](figures/{figure_names[partition]['heatmap']})",
            "",
        ]

    # ---------------------------------------------------------------- validation, failures
    lines += ["## What validation caught, and runs that stopped", ""]
    quiet: list[str] = []
    table_rows: list[str] = []
    for partition in partitions:
        for attack in attacks:
            merged = Cell([r for (p, _, a), c in cells.items() if p == partition and a == attack for r in c.runs])
            rejected, rollbacks = merged.rejected_per_round(), merged.rollbacks()
            if not rejected and not rollbacks:
                quiet.append(f"{PARTITION_TITLES.get(partition, partition)} {attack}")
                continue
            text = ", ".join(f"{k} {v:.2f}" for k, v in rejected.items()) or "none"
            table_rows.append(f"| {PARTITION_TITLES.get(partition, partition)} | {attack} | {text} | {rollbacks} |")
    if table_rows:  # a table only where there is a row
        lines += [
            "Replies rejected per round by reason (mean over all rules, seeds and rounds) and rollbacks of the "
            "divergence guard, for the attacks that had any:",
            "",
            "| partition | attack | rejected per round | guard rollbacks (all runs) |",
            "|---|---|---|---|",
            *table_rows,
        ]
    if quiet:
        lines += ["", f"No reply rejected and no rollback: {', '.join(quiet)}."]
    failed = [(key, c) for key, c in sorted(cells.items()) if c.failed]
    lines += ["", "Runs that did not finish:", ""]
    if failed:
        for (partition, rule, attack), c in failed:
            lines.append(
                f"* {PARTITION_TITLES.get(partition, partition)}, {rule}, {attack}: {len(c.failed)}/{len(c.runs)} "
                f"seeds ({c.failed[0]['status']}): `{_failure_reason(c)}`"
            )
    else:
        lines.append("* none")
    lines.append("")

    if extra_dirs:
        lines += [
            "## Supplementary sweeps: stronger attack settings",
            "",
            "The main study uses each attack's settings in `conf/attack/*.yaml`. These sweeps change one "
            "setting (given as the heading) to show what it takes for the attack to hurt; they are not part "
            "of the headline.",
            "",
        ]
        for extra_dir in extra_dirs:
            lines += _extra_section(extra_dir, cells)
    if pilot_dir is not None:
        lines += _pilot_section(pilot_dir)

    path = docs_dir / "results.md"
    path.write_text("\n".join(lines).rstrip() + "\n")
    return path


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.report", description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, required=True, help="the study's --out directory")
    parser.add_argument("--docs", type=Path, default=None,
                        help="where results.md and figures/ go (default: <results>/report; docs: the shipped page)")
    parser.add_argument("--pilot", type=Path, default=None, help="the pilot's --out directory (optional)")
    parser.add_argument("--extra", type=Path, nargs="+", default=[],
                        help="--out directories of supplementary sweeps (run with --set ...)")
    parser.add_argument("--default-choice", type=Path, nargs="+", default=[],
                        help="--out directories of the sweeps that choose the default configuration by its worst case")
    parser.add_argument("--default-choice-seeds", type=int, nargs="+", default=[],
                        help="only these seeds of those sweeps (default: all), so every configuration has the same")
    args = parser.parse_args(argv)
    import shlex
    import sys

    command = shlex.join(["python", "-m", "experiments.report", *(sys.argv[1:] if argv is None else argv)])
    given = [("--results", args.results), ("--pilot", args.pilot), *(("--extra", d) for d in args.extra),
             *(("--default-choice", d) for d in args.default_choice)]
    missing = [f"{flag} {path}" for flag, path in given if path is not None and not path.is_dir()]
    if missing:  # a typo'd directory would be left out of the report while its command records it
        parser.error(f"no such results directory: {', '.join(missing)}")
    docs_dir = args.docs if args.docs is not None else args.results / "report"
    try:
        path = write_report(
            args.results, docs_dir, pilot_dir=args.pilot, extra_dirs=args.extra,
            default_choice_dirs=args.default_choice, default_choice_seeds=args.default_choice_seeds,
            report_command=command,
        )
    except ValueError as err:  # no results, or sweeps that cannot be compared
        parser.error(str(err))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
