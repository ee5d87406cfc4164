"""experiments.left_out: attacking and honest replies a defense left out, from hand-written study results."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments import left_out, worst_case
from tests.support.study_results import study_run, write_sweep


def _run_with_rounds(rule: str, attack: str, seed: int, left: list[list[int]]) -> dict:
    """A run whose round i left out the partitions ``left[i]`` (the rule's exclusions)."""
    run = study_run("dirichlet", rule, attack, seed, 0.9)
    run["rows"] = [
        {"round": i + 1, "accuracy": 0.9, "excluded_nodes": [{"node": 100 + p, "partition": p} for p in parts]}
        for i, parts in enumerate(left)
    ]
    return run


def test_left_out_splits_attackers_from_honest_clients_by_phase(tmp_path: Path) -> None:
    bad = sorted(left_out.attackers(study_run("dirichlet", "dnc", "sign_flip", 0, 0.9)))
    assert len(bad) == 4  # the partitions the simulation makes attack for seed 0
    honest = next(p for p in range(20) if p not in bad)
    # Six rounds, thirds of two: all four attackers, then two of them and one honest client, then none.
    rounds = [bad, bad, bad[:2] + [honest], bad[:2] + [honest], [], []]
    clean = [[honest]] * 6  # with no attack every client is honest
    directory = write_sweep(tmp_path / "sweep", [
        _run_with_rounds("dnc", "sign_flip", 0, rounds), _run_with_rounds("dnc", "none", 0, clean),
        _run_with_rounds("trimmed_mean", "sign_flip", 0, [[]] * 6),  # names no one: not listed
    ])
    tallies = left_out.tally(worst_case.labelled_results([directory]))
    t = tallies[("dirichlet", "dnc", "sign_flip")]
    assert (t.attacking_left, t.attacking_sent, t.honest_left, t.rounds) == ([8, 4, 0], [8, 8, 8], 2, 6)
    assert tallies[("dirichlet", "dnc", "none")].honest_left == 6
    text = left_out.table(tallies)
    assert "| dirichlet | dnc | sign_flip | 100 % / 50 % / 0 % | 0.33 | 1 |" in text
    assert "| dirichlet | dnc | none | - / - / - | 1.00 | 1 |" in text
    assert "trimmed_mean" not in text


def test_left_out_refuses_results_that_name_no_one(tmp_path: Path) -> None:
    old = write_sweep(tmp_path / "old", [study_run("iid", "dnc", "none", 0, 0.9)])  # rows without the fields
    with pytest.raises(SystemExit, match="no run in these directories records who was left out"):
        left_out.main([str(old)])


def test_hold_out_sweeps_beside_test_set_ones_end_in_an_error_naming_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run_with_rounds("dnc", "sign_flip", 0, [[1]])
    on_test = write_sweep(tmp_path / "test", [run])
    held_out = write_sweep(tmp_path / "held_out", [run], extra=["dataset.validation_fraction=0.2"])
    with pytest.raises(SystemExit) as stopped:
        left_out.main([str(on_test), str(held_out)])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "validation hold-out (" + str(held_out) in err and "test set (" + str(on_test) in err
