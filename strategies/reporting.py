"""What the operator sees: one metrics row per round (JSONL), progress lines, a final summary.

Progress goes to standard output (what ``flwr run --stream`` and ``flwr log`` show of a ServerApp)
and to this module's logger; each round's line names the nodes whose replies were rejected (with
the reason), dropped, filtered out by the pipeline, given no weight by the rule or quarantined, so an
operator can act without reading the server's logs.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedrobust.text import first_and_more

log = logging.getLogger(__name__)


class MetricsLog:
    """Appends one JSON object per round to ``path`` and prints progress when ``echo``.

    ``f`` is the configured number of Byzantine clients: a round whose rule ran with fewer (``f_used``,
    after validation rejected provably faulty replies or ``dedup`` took copies out) says so.
    """

    def __init__(self, path: Path | None, num_rounds: int, *, echo: bool = True, f: int | None = None) -> None:
        self.path = path
        self.num_rounds = num_rounds
        self.echo = echo
        self.f = f
        self.rows: list[dict[str, Any]] = []
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def restore(self, rows: list[dict[str, Any]]) -> None:
        """Continue after a resume: keep the earlier rows and rewrite the file with them only."""
        self.rows = list(rows)
        if self.path is not None:
            self.path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self.path is not None:
            with self.path.open("a") as fh:
                fh.write(json.dumps(row, sort_keys=True) + "\n")
        self.say(progress_line(row, self.num_rounds, f=self.f))
        for line in node_lines(row):
            self.say(line)

    def say(self, line: str) -> None:
        """One line for the operator (:func:`say`), printed when echoing."""
        say(line, echo=self.echo)

    def finish(self, seconds: float, first_round: int = 1, notes: Sequence[str] = ()) -> None:
        """The run's summary; ``first_round`` > 1: this process resumed and trained from that round; ``notes``:
        lines it ends with (what went wrong beside the rounds, e.g. checkpoints that could not be written)."""
        for line in summary_text(self.rows, seconds, first_round, notes).splitlines():
            self.say(line)


def say(line: str, *, echo: bool = True) -> None:
    """One line for the operator: logged, and printed when ``echo`` unless the log already shows it on the
    console (Hydra's job logging does: the line would appear twice; under ``flwr run`` it does not)."""
    log.info("%s", line)
    if echo and not _logged_to_console(log):
        print(line, flush=True)


def _logged_to_console(logger: logging.Logger) -> bool:
    """Whether an INFO record of ``logger`` reaches a handler that writes to standard output or error."""
    if not logger.isEnabledFor(logging.INFO):
        return False
    current: logging.Logger | None = logger
    while current is not None:
        for handler in current.handlers:
            stream = getattr(handler, "stream", None)
            if handler.level <= logging.INFO and stream is not None and stream in (sys.stdout, sys.stderr):
                return True
        current = current.parent if current.propagate else None
    return False


def progress_line(row: dict[str, Any], num_rounds: int, *, f: int | None = None) -> str:
    f_used = row.get("f_used")
    lowered = f is not None and isinstance(f_used, int) and f_used < f
    rejected = row.get("rejected", {})
    why = " ".join(f"{k}={v}" for k, v in sorted(rejected.items()))
    evaluation = "".join(
        f"{name} {row[name]:.4f}  "
        for name in ("accuracy", "loss", "backdoor_asr")
        if isinstance(row.get(name), int | float)
    )
    if federated := _federated_text(row):
        evaluation += f"federated {federated}  "
    errors = row.get("client_errors", {})
    return (
        f"[round {row['round']:>3}/{num_rounds}] {evaluation}"
        f"accepted {row['accepted']:>3}  rejected {sum(rejected.values()):>2}{(' (' + why + ')') if why else ''}  "
        f"dropped {row['dropped']:>2}{f' (client errors {sum(errors.values())})' if errors else ''}  "
        + (f"filtered {row['filtered']:>2}  " if row.get("filtered") else "")
        + (f"excluded {row['excluded']:>2}  " if row.get("excluded") else "")
        + (f"dead {len(row['dead_nodes'])}  " if row.get("dead_nodes") else "")
        + (f"f {f_used} of {f}  " if lowered else "")
        + f"train {row['seconds_train']:.2f}s agg {row['seconds_aggregate']:.3f}s "
        f"eval {row.get('seconds_evaluate', 0.0):.2f}s"
        + (f" (evaluate replies failed {failed})" if (failed := _evaluate_failed(row)) else "")
    )


def _federated_text(row: dict[str, Any]) -> str:
    """``loss 0.3100 accuracy 0.9200``: the clients' own evaluation of the round's model (fraction_evaluate > 0),
    each metric trimmed and weighted by the server; empty without one."""
    metrics = sorted((row.get("federated_evaluate") or {}).items())
    return " ".join(f"{k} {v:.4f}" for k, v in metrics if isinstance(v, int | float))


def _evaluate_failed(row: dict[str, Any]) -> int:
    """The round's federated evaluation messages that came back as errors or not at all."""
    return sum(row.get("evaluate_errors", {}).values()) + row.get("evaluate_missing", 0)


def _node(entry: dict[str, Any]) -> str:
    partition = entry.get("partition")
    return f"node {entry['node']}" + (f" (partition {partition})" if partition is not None else "")


def node_lines(row: dict[str, Any]) -> list[str]:
    """Which nodes were rejected (and why), dropped, filtered out by the pipeline, given no weight by the rule
    (one line: a rule that selects one row excludes all others), or are quarantined or dead (left out of
    sampling) after this round."""
    lines = [
        f"    rejected: {_node(e)}: {e['reason']} ({e.get('detail', '')})" for e in row.get("rejected_nodes", [])
    ]
    lines += [f"    dropped: {_node(e)}" for e in row.get("dropped_nodes", [])]
    lines += [
        f"    filtered: {_node(e)}" + (f" by {e['by']}" if e.get("by") else "") for e in row.get("filtered_nodes", [])
    ]
    if row.get("excluded_nodes"):
        lines.append(f"    excluded by the rule: {', '.join(_node(e) for e in row['excluded_nodes'])}")
    failed: dict[str, list[str]] = {}  # error message -> the nodes that replied with it
    for entry in row.get("dropped_nodes", []):
        if entry.get("error"):
            failed.setdefault(entry["error"], []).append(_node(entry))
    lines += [
        f"    client error x{n}" + (f" ({first_and_more(failed[message])})" if failed.get(message) else "")
        + f": {message}"
        for message, n in row.get("client_errors", {}).items()
    ]
    lines += [f"    evaluate error x{n}: {message}" for message, n in row.get("evaluate_errors", {}).items()]
    if row.get("quarantined"):
        lines.append(f"    quarantined: nodes {', '.join(str(n) for n in row['quarantined'])}")
    lines += [
        f"    dead: {_node(e)}, not sampled "
        + (f"until its probe in round {e['probe']}" if e.get("probe") is not None else "while Flower lists it offline")
        for e in row.get("dead_nodes", [])
    ]
    return lines


def left_out_most(rows: list[dict[str, Any]], *, listed: int = 8) -> str:
    """The nodes the pipeline filtered or the rule excluded in more than half of the rounds, most often first.

    A client that attacks every round and is caught shows up here with all its rounds; an honest client
    left out now and then does not. Empty when there is none.
    """
    counts: Counter[tuple[int, Any]] = Counter()
    for row in rows:
        entries = (*row.get("filtered_nodes", []), *row.get("excluded_nodes", []))
        counts.update({(e["node"], e.get("partition")) for e in entries})
    # Ties by partition where known (node ids are drawn anew each run), then by node id.
    often = sorted(((c, node) for node, c in counts.items() if 2 * c > len(rows)),
                   key=lambda t: (-t[0], t[1][1] if isinstance(t[1][1], int) else -1, t[1][0]))
    if not often:
        return ""
    names = [f"{_node({'node': node, 'partition': partition})} {c}/{len(rows)}" for c, (node, partition) in often]
    sampled = max((row.get("sampled") or row.get("accepted", 0) for row in rows), default=0)
    # Krum keeps one row a round: then most nodes are left out, and the list says nothing about them.
    # More than half: more than any f a rule may assume, so not the attackers alone (Multi-Krum's f are not).
    by_design = (" (more than half of the sampled nodes: a rule that keeps few rows, as krum keeps one, leaves "
                 "most out by design)") if sampled and 2 * len(often) > sampled else ""
    return "left out in most rounds: " + first_and_more(names, listed) + by_design


def summary_text(rows: list[dict[str, Any]], seconds: float, first_round: int = 1, notes: Sequence[str] = ()) -> str:
    """The summary of the whole run (rows restored by a resume included); ``seconds`` is this start()'s."""
    if not rows:
        return "no round completed"
    last = rows[-1]
    rejected: dict[str, int] = {}
    for r in rows:
        for k, v in r.get("rejected", {}).items():
            rejected[k] = rejected.get(k, 0) + v
    if first_round > 1:  # a resume: the totals below are the whole run's, the time this start()'s
        trained = max(0, last["round"] - first_round + 1)
        before = "round 1" if first_round == 2 else f"rounds 1-{first_round - 1}"
        head = (
            f"finished {last['round']} rounds: {before} before the resume, {trained} after it "
            f"in {seconds:.1f} s"
        )
    else:
        head = f"finished {last['round']} rounds in {seconds:.1f} s"
    lines = ["=" * 72, head]
    if isinstance(last.get("accuracy"), int | float):
        scored = [r for r in rows if isinstance(r.get("accuracy"), int | float) and math.isfinite(r["accuracy"])]
        best = max(scored, key=lambda r: r["accuracy"]) if scored else last
        lines.append(
            f"final accuracy {last['accuracy']:.4f}"
            + (f"  loss {last['loss']:.4f}" if isinstance(last.get("loss"), int | float) else "")
            + f"  (best {best['accuracy']:.4f} in round {best['round']}, "
            f"worst {min(r['accuracy'] for r in scored) if scored else float('nan'):.4f})"
        )
    if isinstance(last.get("backdoor_asr"), int | float):
        lines.append(f"final backdoor attack success rate {last['backdoor_asr']:.4f} (triggered test inputs of other "
                     "classes classified as the target)")
    lines += [
        f"replies accepted {sum(r['accepted'] for r in rows)}, rejected {sum(rejected.values())}"
        + (f" {dict(sorted(rejected.items()))}" if rejected else "")
        + f", dropped {sum(r['dropped'] for r in rows)}"
        + (f", filtered {filtered}" if (filtered := sum(r.get("filtered", 0) for r in rows)) else "")
        + (f", excluded by the rule {excluded}" if (excluded := sum(r.get("excluded", 0) for r in rows)) else ""),
        f"rollbacks {last.get('rollbacks', 0)}, retried rounds {sum(1 for r in rows if r.get('attempts', 1) > 1)}",
    ]
    if federated := _federated_text(last):
        lines.append(f"final federated evaluation {federated}")
    if failed := sum(_evaluate_failed(r) for r in rows):
        lines.append(f"federated evaluation: {failed} evaluate replies failed or missed the deadline (see the rounds)")
    if often := left_out_most(rows):
        lines.append(often)
    lines += notes
    lines.append("=" * 72)
    return "\n".join(lines)
