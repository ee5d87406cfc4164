"""The worst-case scoring that chooses the default configuration (experiments/worst_case.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from experiments import worst_case
from tests.support.study_results import study_run as _run
from tests.support.study_results import write_sweep as _write


def _study(tmp_path: Path) -> list[Path]:
    runs = []
    for p in ("iid", "dirichlet"):
        runs += [_run(p, "mean", "none", s, 0.96) for s in (0, 1)]
        # "steady": small gaps everywhere; "spiky": best on average but one attack costs 10 points.
        runs += [_run(p, "steady", a, s, acc) for s in (0, 1)
                 for a, acc in (("none", 0.958), ("min_max", 0.955), ("mimic", 0.952))]
        runs += [_run(p, "spiky", a, s, acc) for s in (0, 1)
                 for a, acc in (("none", 0.962), ("min_max", 0.961), ("mimic", 0.86))]
        runs += [_run(p, "mean", "min_max", s, 0.50) for s in (0, 1)]
        # One seed stopped (no quorum): it counts as accuracy 0, so this rule's worst case is that attack.
        runs += [_run(p, "fragile", a, 0, 0.96) for a in ("none", "min_max")]
        runs += [_run(p, "fragile", "mimic", 0, 0.96), _run(p, "fragile", "mimic", 1, 0.0, status="quorum_error")]
        runs += [_run(p, r, "backdoor", s, 0.954, asr=0.02) for r in ("steady", "spiky", "fragile") for s in (0, 1)]
        runs += [_run(p, "partial", "none", s, 0.96) for s in (0, 1)]
    main = _write(tmp_path / "main", runs)
    accuracies = (("steady", 0.953), ("spiky", 0.957), ("fragile", 0.96), ("mean", 0.2))
    scaled = _write(tmp_path / "scaled", [_run(p, r, "sign_flip", 0, acc) for p in ("iid", "dirichlet")
                                          for r, acc in accuracies], extra=["attack.params.scale=4.0"])
    return [main, scaled]


def test_rules_rank_by_their_worst_attack_not_their_average(tmp_path: Path) -> None:
    table = worst_case.cells(worst_case.labelled_results(_study(tmp_path)))
    cases = {c.rule: c for c in worst_case.worst_cases(table)}
    ranked = [c.rule for c in worst_case.worst_cases(table)]

    assert ranked[0] == "steady"
    assert cases["steady"].gap["iid"] == (pytest.approx(0.96 - 0.952), "mimic")
    assert cases["spiky"].gap["dirichlet"] == (pytest.approx(0.10), "mimic")
    # A stopped seed scores 0: mean of 0.96 and 0 over the two seeds.
    assert cases["fragile"].gap["iid"] == (pytest.approx(0.96 - 0.48), "mimic")
    # Score: the worst gap over its goal (1 point IID, 2 points Dirichlet), the larger of the two.
    assert cases["steady"].score == pytest.approx(max(0.008 / 0.01, 0.008 / 0.02))
    assert cases["steady"].asr == {"iid": pytest.approx(0.02), "dirichlet": pytest.approx(0.02)}
    # Run under fewer attacks: listed, and ranked after every complete rule whatever its score.
    assert ranked == ["steady", "spiky", "fragile", "partial"]
    assert "mimic" in cases["partial"].missing["iid"] and not cases["fragile"].missing["iid"]
    assert math.isnan(cases["partial"].asr["iid"])
    assert "mean" not in cases


def test_a_sweep_with_extra_settings_is_its_own_attack(tmp_path: Path) -> None:
    results = worst_case.labelled_results(_study(tmp_path))
    assert "sign_flip (scale=4.0)" in {r["attack"] for r in results}
    assert "sign_flip" not in {r["attack"] for r in results}


def test_section_names_the_default_and_the_broken_mean(tmp_path: Path) -> None:
    figure = tmp_path / "figures" / "default_choice.png"
    text = "\n".join(worst_case.section(_study(tmp_path), figure, commands=["python -m experiments.study X"]))

    assert "**steady** (chosen)" in text
    assert "Chosen default: **steady** (score 0.80; the lowest score); goals met." in text
    assert "iid, sign_flip (scale=4.0): 76.0 pts below clean - broken" in text
    assert "dirichlet, min_max: 46.0 pts below clean - broken" in text
    assert figure.stat().st_size > 0


def test_an_attack_on_the_server_update_is_not_applicable_to_rules_without_one(tmp_path: Path) -> None:
    runs = []
    for p in ("iid", "dirichlet"):
        runs += [_run(p, "mean", "none", s, 0.96) for s in (0, 1)]
        runs += [_run(p, r, a, s, 0.95) for r in ("trimmed_mean", "fltrust") for a in ("none", "min_max")
                 for s in (0, 1)]
        runs += [_run(p, "fltrust", "fltrust_adaptive", s, 0.90) for s in (0, 1)]
    dirs = [_write(tmp_path / "d", runs)]
    cases = {c.rule: c for c in worst_case.worst_cases(worst_case.cells(worst_case.labelled_results(dirs)))}
    assert cases["trimmed_mean"].missing == {"iid": [], "dirichlet": []}  # nothing to attack there
    assert cases["fltrust"].gap["iid"] == (pytest.approx(0.06), "fltrust_adaptive")
    text = "\n".join(worst_case.section(dirs))
    assert "| trimmed_mean | n/a | 1.0 | 1.0 |" in text and "not run under" not in text
    assert worst_case.applies("winsorize+fltrust", "fltrust_adaptive (direction=update)")
    assert worst_case.applies("median", "min_max") and not worst_case.applies("nnm+median", "fltrust_adaptive")


def test_no_clean_fedavg_is_an_error_that_says_which(tmp_path: Path) -> None:
    directory = _write(tmp_path / "d", [_run("iid", "steady", "none", 0, 0.9)])
    table = worst_case.cells(worst_case.labelled_results([directory]))
    with pytest.raises(ValueError, match="no clean FedAvg run .* partition 'iid'"):
        worst_case.worst_cases(table)


def test_a_backdoor_that_succeeds_outweighs_small_accuracy_gaps(tmp_path: Path) -> None:
    runs = [_run(p, "mean", "none", 0, 0.96) for p in ("iid", "dirichlet")]
    for p in ("iid", "dirichlet"):
        # "mixing": loses nothing in accuracy, but the backdoor takes hold (ASR 0.6 against a 0.05 goal).
        runs += [_run(p, "mixing", "none", 0, 0.96), _run(p, "mixing", "backdoor", 0, 0.96, asr=0.6)]
        # "trimming": 3 points down under the backdoor's presence, and the backdoor fails.
        runs += [_run(p, "trimming", "none", 0, 0.96), _run(p, "trimming", "backdoor", 0, 0.93, asr=0.01)]
    table = worst_case.cells(worst_case.labelled_results([_write(tmp_path / "d", runs)]))
    cases = worst_case.worst_cases(table)
    assert [c.rule for c in cases] == ["trimming", "mixing"]
    assert cases[1].score == pytest.approx(0.6 / 0.05)
    assert cases[0].score == pytest.approx(0.03 / 0.01)
    text = "\n".join(worst_case.section([tmp_path / "d"]))
    assert "Chosen default: **trimming** (score 3.00; the lowest score); goals **not met**: iid: worst gap 3.0" in text


def _noisy_study(tmp_path: Path, challenger: tuple[float, float]) -> list[worst_case.WorstCase]:
    """Clean 0.96 on both seeds; the incumbent loses 2 points steadily, the challenger by seed as given."""
    runs = [_run("iid", "mean", "none", s, 0.96) for s in (0, 1)]
    runs += [_run("iid", "incumbent", "min_max", s, 0.94) for s in (0, 1)]
    runs += [_run("iid", "challenger", "min_max", s, acc) for s, acc in enumerate(challenger)]
    table = worst_case.cells(worst_case.labelled_results([_write(tmp_path / "d", runs)]))
    return worst_case.worst_cases(table)


def test_the_default_changes_only_when_the_challenger_wins_beyond_the_seeds_noise(tmp_path: Path) -> None:
    # Challenger: 1.5 points on average, but 0.96 and 0.93 by seed: s.e. 1.5 points, score 1.5 ± 1.5.
    cases = _noisy_study(tmp_path / "a", (0.96, 0.93))
    assert [c.rule for c in cases] == ["challenger", "incumbent"]
    assert cases[0].score_sem == pytest.approx(0.015 / 0.01)
    chosen, why = worst_case.choose(cases, "incumbent")
    assert chosen.rule == "incumbent" and why.startswith("kept: challenger's lower score (1.50 ± 1.50)")
    # A steady challenger (0.5 points on both seeds) wins.
    cases = _noisy_study(tmp_path / "b", (0.955, 0.955))
    chosen, why = worst_case.choose(cases, "incumbent")
    assert chosen.rule == "challenger" and why.startswith("the lowest score, 1.50 below incumbent's")


def _paired_study(tmp_path: Path, challenger_gaps: tuple[float, ...]) -> list[dict]:
    """Seven seeds whose clean FedAvg ends far apart (0.90-0.99); on each, the incumbent loses 3 points under
    min-max and the challenger as given: the seeds' spread hides a steady difference from standard errors."""
    runs = []
    for s, gap in enumerate(challenger_gaps):
        clean = 0.90 + 0.015 * s
        runs += [_run("iid", "mean", "none", s, clean), _run("iid", "incumbent", "min_max", s, clean - 0.03)]
        runs.append(_run("iid", "challenger", "min_max", s, clean - gap))
    return worst_case.labelled_results([_write(tmp_path / "d", runs)])


def test_the_paired_test_finds_a_steady_win_that_standard_errors_call_noise(tmp_path: Path) -> None:
    results = _paired_study(tmp_path, (0.02, 0.021, 0.019, 0.02, 0.022, 0.018, 0.02))
    cases = worst_case.worst_cases(worst_case.cells(results))
    assert [c.rule for c in cases] == ["challenger", "incumbent"]
    unpaired, why = worst_case.choose(cases, "incumbent")
    assert unpaired.rule == "incumbent" and why.startswith("kept:")
    low, high = worst_case.paired_difference(results, "incumbent", "challenger")
    assert 0.8 <= low <= high <= 1.2  # a point better on every seed, against a goal of 1 point
    paired, why = worst_case.choose(cases, "incumbent", results)
    assert paired.rule == "challenger" and "paired over the seeds" in why


def test_a_challenger_that_loses_on_some_seeds_is_kept_out(tmp_path: Path) -> None:
    # Better by 0.6 points on average: 3 points better on four seeds, 2-3 points worse on the other three.
    results = _paired_study(tmp_path, (0.0, 0.06, 0.0, 0.06, 0.0, 0.05, 0.0))
    cases = worst_case.worst_cases(worst_case.cells(results))
    low, _ = worst_case.paired_difference(results, "incumbent", "challenger")
    assert low < 0
    chosen, why = worst_case.choose(cases, "incumbent", results)
    assert chosen.rule == "incumbent" and why.startswith("kept:") and "paired over the seeds" in why


def test_too_few_shared_seeds_fall_back_to_standard_errors(tmp_path: Path) -> None:
    results = [r for r in _paired_study(tmp_path, (0.02,) * 7) if r["seed"] < worst_case.MIN_PAIRED_SEEDS - 1]
    assert all(math.isnan(x) for x in worst_case.paired_difference(results, "incumbent", "challenger"))
    _, why = worst_case.choose(worst_case.worst_cases(worst_case.cells(results)), "incumbent", results)
    assert "paired" not in why


def test_a_run_in_two_overlapping_sweeps_counts_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Ten seeds gathered from a three-seed sweep and a later ten-seed one: seeds 0-2 are in both."""
    clean = [_run("iid", "mean", "none", s, 0.96) for s in range(4)]
    early = _write(tmp_path / "early", clean[:2] + [_run("iid", "r", "mimic", s, 0.90) for s in (0, 1)]
                   + [_run("iid", "other", "mimic", 0, 0.5)])
    later = _write(tmp_path / "later", clean + [_run("iid", "r", "mimic", s, 0.90 + 0.01 * s) for s in range(4)])
    results = worst_case.labelled_results([early, later], rules=["r"])
    expected = [("mean", s) for s in range(4)] + [("r", s) for s in range(4)]
    assert sorted((r["rule"], r["seed"]) for r in results) == expected
    # The first sweep that has a run gives it: seed 1 is early's 0.90, not later's 0.91.
    assert {r["seed"]: r["rows"][-1]["accuracy"] for r in results if r["rule"] == "r"} == {
        0: 0.90, 1: 0.90, 2: 0.92, 3: 0.93}
    worst_case.main([str(early), str(later), "--rules", "r", "--incumbent", "r"])
    printed = capsys.readouterr().out
    assert "| **r** (chosen) | 4.7 (mimic) |" in printed and "other" not in printed


def test_sweeps_on_the_validation_hold_out_compare_among_themselves(tmp_path: Path) -> None:
    """tune's sweeps carry dataset.validation_fraction: clean FedAvg on the hold-out is their reference,
    and the setting is no part of an attack's label; a test-set sweep beside them is refused."""
    held_out = ["dataset.validation_fraction=0.2"]
    main = _write(tmp_path / "base", [_run("iid", r, a, 0, acc) for r, a, acc in (
        ("mean", "none", 0.96), ("r", "none", 0.955), ("r", "mimic", 0.95))], extra=held_out)
    spread = _write(tmp_path / "base__spread", [_run("iid", "r", "mimic", 0, 0.93)],
                    extra=[*held_out, "+attack.params.noise=0.5"])
    table = worst_case.cells(worst_case.labelled_results([main, spread]))
    case = {c.rule: c for c in worst_case.worst_cases(table)}["r"]
    assert case.gap["iid"] == (pytest.approx(0.03), "mimic (noise=0.5)")
    on_test = _write(tmp_path / "test", [_run("iid", "r", "mimic", 0, 0.9)])
    with pytest.raises(ValueError, match="validation hold-out .*base.* and on the test set .*test"):
        worst_case.labelled_results([main, on_test])


def test_a_sweep_with_settings_of_the_rule_is_a_configuration_of_its_own(tmp_path: Path) -> None:
    """A probe of a rule's parameter (or of the server optimizer) ranks beside the rule as it ships; the
    attack keeps its own label, and a clean run with other settings is no clean FedAvg."""
    base = _write(tmp_path / "base", [_run("iid", r, a, 0, acc) for r, a, acc in (
        ("mean", "none", 0.96), ("r", "none", 0.955), ("r", "mimic", 0.90))])
    probe = _write(tmp_path / "probe", [_run("iid", r, a, 0, acc) for r, a, acc in (
        ("mean", "none", 0.99), ("r", "none", 0.955), ("r", "mimic", 0.94))],
        extra=["+aggregator.pre_params.direction.margin=0.5", "+attack.params.noise=0.0"])
    results = worst_case.labelled_results([base, probe], rules=["r"])
    assert {(r["rule"], r["attack"]) for r in results} == {
        ("mean", "none"), ("r", "none"), ("r", "mimic"),
        ("r @ pre_params.direction.margin=0.5", "none (noise=0.0)"),
        ("r @ pre_params.direction.margin=0.5", "mimic (noise=0.0)")}
    cases = {c.rule: c for c in worst_case.worst_cases(worst_case.cells(results))}
    assert cases["r @ pre_params.direction.margin=0.5"].gap["iid"] == (pytest.approx(0.02), "mimic (noise=0.0)")


def test_the_command_line_names_sweeps_it_cannot_compare_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    without_clean = _write(tmp_path / "d", [_run("iid", "r", "mimic", 0, 0.9)])
    with pytest.raises(SystemExit) as stopped:
        worst_case.main([str(without_clean)])
    assert stopped.value.code == 2
    assert "no clean FedAvg run (rule mean, attack none) for partition 'iid'" in capsys.readouterr().err


def test_a_clean_run_without_the_sweeps_rule_settings_stays_clean_fedavg(tmp_path: Path) -> None:
    """tune runs clean FedAvg in the setting's own sweep with the shared settings only (the plain mean has
    no pre_params): each run is labelled with the settings it ran with, so that run is the reference."""
    setting = ["dataset.validation_fraction=0.2", "+aggregator.pre_params.direction.previous=true"]
    clean = _run("iid", "mean", "none", 0, 0.96) | {"overrides": setting[:1]}
    probe = [_run("iid", "r", a, 0, acc) | {"overrides": setting} for a, acc in (("none", 0.955), ("mimic", 0.93))]
    sweep = _write(tmp_path / "previous", [clean, *probe], extra=setting)
    results = worst_case.labelled_results([sweep])
    assert {(r["rule"], r["attack"]) for r in results} == {
        ("mean", "none"), ("r @ pre_params.direction.previous=true", "none"),
        ("r @ pre_params.direction.previous=true", "mimic")}
    case = {c.rule: c for c in worst_case.worst_cases(worst_case.cells(results))}
    assert case["r @ pre_params.direction.previous=true"].gap["iid"] == (pytest.approx(0.03), "mimic")


def test_settings_clean_fedavg_ran_with_are_the_experiments_not_a_rules(tmp_path: Path) -> None:
    """A sweep of the mean and a defense with --set client.local_epochs=3 compares them in that setting:
    the setting labels no rule, a sweep of attack variants in it joins, and one without it is refused."""
    epochs = ["client.local_epochs=3"]
    main = _write(tmp_path / "main", [_run("iid", r, a, 0, acc) | {"overrides": epochs} for r, a, acc in (
        ("mean", "none", 0.97), ("mean", "min_max", 0.6), ("r", "none", 0.965), ("r", "min_max", 0.96))],
        extra=epochs)
    stronger = [*epochs, "+attack.params.scale=4.0"]
    scaled = _write(tmp_path / "scaled", [_run("iid", "r", "sign_flip", 0, 0.95) | {"overrides": stronger}],
                    extra=stronger)
    results = worst_case.labelled_results([main, scaled])
    assert {(r["rule"], r["attack"]) for r in results} == {
        ("mean", "none"), ("mean", "min_max"), ("r", "none"), ("r", "min_max"), ("r", "sign_flip (scale=4.0)")}
    case = {c.rule: c for c in worst_case.worst_cases(worst_case.cells(results))}["r"]
    assert case.gap["iid"] == (pytest.approx(0.02), "sign_flip (scale=4.0)")
    assert "seeds 0, client.local_epochs=3;" in "\n".join(worst_case.section([main, scaled]))
    two_epochs = _write(tmp_path / "two", [_run("iid", "r", "mimic", 0, 0.9)])
    with pytest.raises(ValueError, match="different settings: clean FedAvg ran with client.local_epochs=3, .*two"):
        worst_case.labelled_results([main, two_epochs])


def test_seeds_restrict_every_configuration_to_the_same_seeds(tmp_path: Path) -> None:
    """Ten seeds of the default beside three of the others: --seeds 0 1 2 compares them on the same three."""
    runs = [_run("iid", "mean", "none", s, 0.96) for s in range(10)]
    runs += [_run("iid", "default", "mimic", s, 0.95 if s < 3 else 0.90) for s in range(10)]
    runs += [_run("iid", "other", "mimic", s, 0.945) for s in range(3)]
    directory = _write(tmp_path / "d", runs)
    every = {c.rule: c for c in worst_case.worst_cases(worst_case.cells(worst_case.labelled_results([directory])))}
    assert every["default"].gap["iid"][0] == pytest.approx(0.96 - (3 * 0.95 + 7 * 0.90) / 10)
    first = worst_case.labelled_results([directory], seeds=[0, 1, 2])
    assert {r["seed"] for r in first} == {0, 1, 2}
    cases = {c.rule: c for c in worst_case.worst_cases(worst_case.cells(first))}
    assert cases["default"].gap["iid"][0] == pytest.approx(0.01)
    assert "seeds 0, 1, 2;" in "\n".join(worst_case.section([directory], seeds=[0, 1, 2]))
