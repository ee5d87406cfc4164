"""The operator's progress lines: each shown once on the console, whichever way the process logs."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

import pytest

from fedrobust.strategies.reporting import MetricsLog


@contextlib.contextmanager
def root_console(level: int) -> Iterator[None]:
    """A console handler on the root logger, as Hydra's job logging installs one. Made inside the test,
    where ``sys.stdout`` is capsys's stream for the test's call."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setLevel(level)
    root = logging.getLogger()
    before = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(before)


def test_a_line_is_printed_when_no_log_handler_shows_it(capsys: pytest.CaptureFixture[str]) -> None:
    MetricsLog(None, 3).say("finished 3 rounds in 4.6 s")
    assert capsys.readouterr().out.splitlines() == ["finished 3 rounds in 4.6 s"]


def test_a_line_the_log_shows_on_the_console_is_not_printed_again(capsys: pytest.CaptureFixture[str]) -> None:
    with root_console(logging.INFO):
        MetricsLog(None, 3).say("finished 3 rounds in 4.6 s")
    assert capsys.readouterr().out.splitlines() == ["finished 3 rounds in 4.6 s"]  # the handler's line only


def test_a_console_handler_above_info_does_not_show_it(capsys: pytest.CaptureFixture[str]) -> None:
    with root_console(logging.WARNING):
        MetricsLog(None, 3).say("finished")
    assert capsys.readouterr().out.splitlines() == ["finished"]


def test_echo_off_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    MetricsLog(None, 3, echo=False).say("finished")
    assert capsys.readouterr().out == ""


def test_the_progress_line_and_summary_name_the_replies_the_pipeline_filtered() -> None:
    from fedrobust.strategies.reporting import node_lines, progress_line, summary_text

    row = {
        "round": 2, "accepted": 20, "rejected": {}, "dropped": 0, "filtered": 2, "seconds_train": 0.5,
        "seconds_aggregate": 0.01,
        "filtered_nodes": [{"node": 7, "partition": 3, "by": "consistency"}, {"node": 9, "partition": None}],
    }
    assert "dropped  0  filtered  2  train" in progress_line(row, 5)
    assert node_lines(row) == ["    filtered: node 7 (partition 3) by consistency", "    filtered: node 9"]
    assert "dropped 0, filtered 2" in summary_text([row], 1.0)
    quiet = {**row, "filtered": 0, "filtered_nodes": []}
    assert "filtered" not in progress_line(quiet, 5) and "filtered" not in summary_text([quiet], 1.0)


def test_the_progress_line_and_summary_name_the_replies_the_rule_gave_no_weight() -> None:
    from fedrobust.strategies.reporting import node_lines, progress_line, summary_text

    row = {
        "round": 2, "accepted": 20, "rejected": {}, "dropped": 0, "filtered": 1, "excluded": 2,
        "seconds_train": 0.5, "seconds_aggregate": 0.01, "filtered_nodes": [{"node": 4, "partition": 0}],
        "excluded_nodes": [{"node": 7, "partition": 3}, {"node": 9, "partition": None}],
    }
    assert "filtered  1  excluded  2  train" in progress_line(row, 5)
    assert node_lines(row) == [
        "    filtered: node 4 (partition 0)", "    excluded by the rule: node 7 (partition 3), node 9",
    ]
    assert "filtered 1, excluded by the rule 2" in summary_text([row], 1.0)
    quiet = {**row, "excluded": 0, "excluded_nodes": []}
    assert "excluded" not in progress_line(quiet, 5) + "".join(node_lines(quiet)) + summary_text([quiet], 1.0)


def test_the_progress_line_says_when_the_rule_tolerated_fewer_byzantine_clients_than_configured() -> None:
    from fedrobust.strategies.reporting import progress_line

    row = {
        "round": 3, "accepted": 16, "rejected": {"non_finite": 4}, "dropped": 0, "f_used": 0,
        "seconds_train": 0.5, "seconds_aggregate": 0.01,
    }
    assert "rejected  4 (non_finite=4)  dropped  0  f 0 of 4  train" in progress_line(row, 5, f=4)
    assert " f " not in progress_line({**row, "f_used": 4}, 5, f=4)
    assert " f " not in progress_line(row, 5)  # the configured f unknown: nothing to compare with


def test_the_summary_names_the_nodes_left_out_in_most_rounds() -> None:
    from fedrobust.strategies.reporting import left_out_most, summary_text

    def row(r: int, filtered: list[int], excluded: list[int]) -> dict:
        return {
            "round": r, "accepted": 10, "rejected": {}, "dropped": 0, "filtered": len(filtered),
            "excluded": len(excluded), "seconds_train": 0.1, "seconds_aggregate": 0.01,
            "filtered_nodes": [{"node": n, "partition": n - 100} for n in filtered],
            "excluded_nodes": [{"node": n, "partition": n - 100} for n in excluded],
        }

    # Node 107 is left out every round (by either stage), node 102 in 2 of 3, node 105 once.
    rows = [row(1, [107], [102]), row(2, [], [107, 102]), row(3, [105, 107], [])]
    assert left_out_most(rows) == "left out in most rounds: node 107 (partition 7) 3/3, node 102 (partition 2) 2/3"
    assert left_out_most(rows) in summary_text(rows, 1.0)
    assert left_out_most(rows, listed=1).endswith("3/3 and 1 more")
    assert left_out_most(rows[2:] + [row(4, [], [])]) == ""  # once in two rounds is not most
    assert "left out" not in summary_text([row(1, [], [])], 1.0)
    # Krum keeps one of 4 sampled rows: 3 nodes left out every round, by design.
    krum = [{**row(r, [], [101, 102, 103]), "sampled": 4} for r in (1, 2)]
    assert left_out_most(krum) == (
        "left out in most rounds: node 101 (partition 1) 2/2, node 102 (partition 2) 2/2, node 103 (partition 3) "
        "2/2 (more than half of the sampled nodes: a rule that keeps few rows, as krum keeps one, leaves most out "
        "by design)"
    )
    # Multi-Krum leaving out f = 2 of 4 (the attackers, as it should): no such note.
    multikrum = [{**row(r, [], [101, 102]), "sampled": 4} for r in (1, 2)]
    assert left_out_most(multikrum).endswith("node 102 (partition 2) 2/2")


def test_the_progress_line_and_summary_show_the_federated_evaluation_and_the_dead_nodes() -> None:
    from fedrobust.strategies.reporting import node_lines, progress_line, summary_text

    row = {
        "round": 3, "accuracy": 0.9, "loss": 0.4, "accepted": 3, "rejected": {}, "dropped": 1,
        "seconds_train": 0.5, "seconds_aggregate": 0.01, "federated_evaluate": {"loss": 0.31, "accuracy": 0.92},
        "dead_nodes": [{"node": 7, "partition": 0, "probe": 6}, {"node": 9, "partition": None, "probe": None}],
    }
    line = progress_line(row, 5)
    assert line.startswith("[round   3/5] accuracy 0.9000  loss 0.4000  federated accuracy 0.9200 loss 0.3100  "
                           "accepted   3")
    assert "dropped  1  dead 2  train" in line
    assert node_lines(row) == [
        "    dead: node 7 (partition 0), not sampled until its probe in round 6",
        "    dead: node 9, not sampled while Flower lists it offline",
    ]
    assert "final federated evaluation accuracy 0.9200 loss 0.3100" in summary_text([row], 1.0).splitlines()
    plain = {k: v for k, v in row.items() if k not in ("federated_evaluate", "dead_nodes")}
    assert "federated" not in progress_line(plain, 5) + summary_text([plain], 1.0)
    assert "dead" not in progress_line(plain, 5) and node_lines(plain) == []
