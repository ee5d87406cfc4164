"""The report: the clients' training its runs recorded, a rule's worst attack, the heatmap's labels."""

from __future__ import annotations

import warnings
from pathlib import Path

from experiments import report

CLIENT = {"local_epochs": 3, "lr": 0.3, "momentum": 0.9, "batch_size": 16, "weight_decay": 0.0}


def test_recorded_training_is_described_as_recorded() -> None:
    assert report._clients([{"client": CLIENT}, {"client": CLIENT}]) == (
        "3 local epochs of SGD (lr 0.3, momentum 0.9, batch 16)")


def test_runs_from_before_the_record_say_how_to_rerun_them() -> None:
    line = report._clients([{}, {}])
    assert line.startswith("2 local epochs of SGD") and "--set client.local_epochs=2" in line


def test_runs_that_trained_differently_are_not_described_as_one() -> None:
    for mixed in ([{"client": CLIENT}, {}], [{"client": CLIENT}, {"client": CLIENT | {"local_epochs": 5}}]):
        assert "differs between runs" in report._clients(mixed)


def _cell(*finals: float) -> report.Cell:
    return report.Cell([{"status": report.OK, "rows": [{"round": 1, "accuracy": acc}], "num_rounds": 1}
                        for acc in finals])


def test_the_worst_attack_of_a_rule_is_an_attack_not_the_baseline() -> None:
    # Noise that acts as a regulariser raises accuracy above the run without an attack.
    cells = {("iid", "mean", "none"): _cell(0.90, 0.92), ("iid", "mean", "noise"): _cell(0.95, 0.95),
             ("iid", "mean", "sign_flip"): _cell(0.99, 0.97)}
    row = report._table_lines(cells, "iid", ["mean"], ["none", "noise", "sign_flip"])[-1]
    assert row.endswith("| 0.950 (noise) |"), row


def test_the_heatmap_has_room_for_the_dotted_names_of_a_users_components(tmp_path: Path) -> None:
    rules = ["consistency+direction+dedup+winsorize+nnm+trimmed_mean", "my_pkg.rules.MyMedian"]
    attacks = ["none", "examples.user-components.my_attacks.ScaledReverse"]
    cells = {("iid", rule, attack): _cell(0.9) for rule in rules for attack in attacks}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # tight_layout warns, and leaves the labels cut, when they do not fit
        report.plot_heatmap(cells, "iid", rules, attacks, tmp_path / "heatmap.png")
    assert (tmp_path / "heatmap.png").stat().st_size > 0
