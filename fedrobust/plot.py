"""One run's rounds as a picture: the model's accuracy above, what became of each round's replies below.

    python -m fedrobust.plot outputs/2026-11-27/10-00-00            # writes rounds.png beside it
    python -m fedrobust.plot path/to/metrics.jsonl --out rounds.png

Reads the metrics rows a run writes (``RobustStrategy(metrics_path=...)``; a Hydra run's folder, the
``output_dir`` of ``flwr run``). fedrobust's own ServerApp draws it at the end of a run as ``rounds.png``.
The lower panel stacks, per round, the replies the rule used, those a filter dropped or the rule gave no
weight, those validation rejected and the sampled nodes that sent no reply (a time-out, a client error):
an attack shows as a band of filtered or excluded replies, a failing device as rejected or dropped ones,
where the accuracy curve alone shows only the result. A round that took more than one attempt (too few
valid replies) is marked above its bands, which count its last attempt's replies; a rollback is a dotted
line across the accuracy panel.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PICTURE_FILE = "rounds.png"
MARKED_ROUNDS = 60  # runs up to this long get a marker per round on their curves

# (row key or derived count, label, colour), bottom to top of the stacked bands.
REPLY_KINDS = (
    ("used", "used by the rule", "#4c9f50"),
    ("filtered", "dropped by a filter", "#f0a030"),
    ("excluded", "given no weight by the rule", "#8e63b5"),
    ("rejected", "rejected by validation", "#d0453a"),
    ("dropped", "no reply (time-out, client error)", "#9a9a9a"),
)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of ``path`` (a metrics.jsonl, or a folder holding one), one per round in round order; should a
    round appear twice (files put together by hand), its last row counts."""
    if path.is_dir():
        path = path / METRICS_FILE
    by_round: dict[int, dict[str, Any]] = {}
    text = path.read_text()
    lines = text.splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as bad:
            if number == len(lines) and not text.endswith("\n"):  # a process killed while appending its row
                logger.warning("%s:%d: the last row is cut off (the run was killed while writing it): left out",
                               path, number)
                continue
            raise ValueError(f"{path}:{number}: not a JSON metrics row ({bad.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("round"), int):
            raise ValueError(f"{path}:{number}: not a metrics row (no integer 'round')")
        problem = _count_problem(row)
        if problem:
            raise ValueError(f"{path}:{number}: not a metrics row ({problem})")
        by_round[row["round"]] = row
    if not by_round:
        raise ValueError(f"{path}: no metrics rows (did the run finish a round?)")
    return [by_round[r] for r in sorted(by_round)]


COUNT_KEYS = ("accepted", "filtered", "excluded", "dropped", "attempts")


def _count_problem(row: dict[str, Any]) -> str | None:
    """Why the counts drawn from ``row`` cannot be read (a hand-edited or foreign file), or None."""
    for key in COUNT_KEYS:
        value = row.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"{key!r} is {value!r}, not a count"
    rejected = row.get("rejected", {})
    if not isinstance(rejected, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in rejected.values()
    ):
        return f"'rejected' is {rejected!r}, not a count per reason"
    return None


def reply_counts(row: dict[str, Any]) -> dict[str, int]:
    """What became of one round's replies, by :data:`REPLY_KINDS` key."""
    filtered, excluded = int(row.get("filtered", 0)), int(row.get("excluded", 0))
    return {
        "used": max(0, int(row.get("accepted", 0)) - filtered - excluded),
        "filtered": filtered,
        "excluded": excluded,
        "rejected": sum(int(v) for v in row.get("rejected", {}).values()),
        "dropped": int(row.get("dropped", 0)),
    }


def _series(rows: Sequence[dict[str, Any]], key: str) -> list[float]:
    values = [row.get(key) for row in rows]
    return [float(v) if isinstance(v, int | float) else math.nan for v in values]


def plot_rounds(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Draw ``rows`` (as :func:`read_rows` returns them) into the PNG ``path``."""
    rounds_figure(rows).savefig(path, dpi=110)


def rounds_figure(rows: Sequence[dict[str, Any]]) -> Figure:
    """The picture of ``rows``: accuracy curves above, the reply counts stacked below."""
    # A Figure of its own, without pyplot: no backend switched and no global figure state touched in the
    # caller's process (a notebook, a ServerApp).
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    rounds = [row["round"] for row in rows]
    fig = Figure(figsize=(10, 6), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    curves = 0
    for key, label, style in (
        ("accuracy", "test accuracy", "-o"),
        ("train_accuracy", "clients' training accuracy", "--"),
        ("backdoor_asr", "backdoor success rate", "-x"),
    ):
        values = _series(rows, key)
        if any(math.isfinite(v) for v in values):
            # Markers only while they stay apart; a long run's curve is a line.
            top.plot(rounds, values, style if len(rows) <= MARKED_ROUNDS else style.strip("ox"), label=label,
                     markersize=3)
            curves += 1
    rollbacks = _series(rows, "rollbacks")
    for i, count in enumerate(rollbacks):  # the run's count so far: a rise is a rollback in that round
        if count > (rollbacks[i - 1] if i else 0):
            top.axvline(rounds[i], color="#d0453a", linestyle=":", linewidth=1)
    top.set_ylabel("accuracy")
    top.set_ylim(0.0, 1.02)
    top.grid(alpha=0.3)
    if curves:
        top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    else:  # e.g. a ServerApp without evaluate_fn: say so rather than leave an empty panel unexplained
        top.text(0.5, 0.5, "no accuracy in the metrics rows (evaluate_fn)", ha="center", transform=top.transAxes)
    final = rows[-1].get("accuracy")
    top.set_title(f"{len(rows)} round{'s' if len(rows) != 1 else ''}"
                  + (f", final accuracy {final:.4f}" if isinstance(final, int | float) else ""))

    # One filled step curve per kind over every round from the first to the last (a round without a row,
    # 0): one artist however long the run, where a bar per round and kind takes a minute at 10,000 rounds.
    span = range(rounds[0], rounds[-1] + 1)
    edges = [r - 0.5 for r in span] + [rounds[-1] + 0.5]
    rows_by_round = {row["round"]: row for row in rows}
    counts = {r: reply_counts(row) for r, row in rows_by_round.items()}
    base = [0] * len(span)
    kinds = 0
    for key, label, colour in REPLY_KINDS:
        heights = [counts[r][key] if r in counts else 0 for r in span]
        if any(heights):
            stacked = [b + h for b, h in zip(base, heights, strict=True)]
            bottom.stairs(stacked, edges, baseline=base, fill=True, color=colour, label=label)
            base = stacked
            kinds += 1
    bottom.set_ylabel("replies")
    bottom.set_xlabel("round")
    bottom.set_xlim(edges[0], edges[-1])
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # no 0.1 steps for one round
    bottom.yaxis.set_major_locator(MaxNLocator(integer=True))
    retried = [(r, counts[r]) for r in rounds if rows_by_round[r].get("attempts", 1) > 1]
    if retried:  # the bands count the last attempt; say that the round needed more than one
        bottom.scatter([r for r, _ in retried], [sum(c.values()) + 0.5 for _, c in retried], marker="v", color="black",
                       s=14, zorder=3, label="retried (bands: last attempt)")
        kinds += 1
    if kinds:
        bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)  # beside the bands, not on them
    return fig


def draw(metrics: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Draw the run whose ``metrics`` (its metrics.jsonl, or the folder holding it) into ``out`` (default:
    ``rounds.png`` beside the metrics); returns the picture's path. Raises ValueError for a file that holds
    no metrics rows, OSError for one that cannot be read or written."""
    metrics = Path(metrics)
    target = Path(out) if out is not None else (metrics if metrics.is_dir() else metrics.parent) / PICTURE_FILE
    if out is not None and (target.is_dir() or os.fspath(out).endswith(("/", os.sep))):  # a folder: the file in it
        target.mkdir(parents=True, exist_ok=True)
        target = target / PICTURE_FILE
    elif not target.suffix:  # matplotlib would add .png: the path said is the one written
        target = target.with_name(target.name + ".png")
    plot_rounds(read_rows(metrics), target)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedrobust.plot", description=__doc__.split("\n")[0])
    parser.add_argument("metrics", type=Path, help=f"a run's {METRICS_FILE}, or the folder that holds it")
    parser.add_argument("--out", help=f"the PNG to write, or a folder (ending in /) to write {PICTURE_FILE} in "
                                      f"(default: {PICTURE_FILE} beside the metrics)")
    args = parser.parse_args(argv)
    try:
        out = draw(args.metrics, args.out)
    except (OSError, ValueError) as problem:
        parser.exit(2, f"fedrobust.plot: {problem}\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
