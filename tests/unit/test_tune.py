"""experiments.tune: settings parsed as the user types them; the choice made on one clean reference."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from experiments import tune
from tests.support.study_results import study_run, write_sweep

RULE = "winsorize+nnm+trimmed_mean"


def _setting(out: Path, name: str, clean: float, attacked: dict[str, float], variants: float) -> None:
    """One setting's sweeps: clean FedAvg and the rule under attack (two seeds, +-0.002 around each value),
    and each variant sweep (sign flip x4, spread mimic) at ``variants``."""
    main, variant_dirs = tune.sweep_dirs(out, name)
    runs = []
    for p in ("iid", "dirichlet"):
        for seed, wobble in enumerate((-0.002, 0.002)):
            runs.append(study_run(p, "mean", "none", seed, clean + wobble))
            runs += [study_run(p, RULE, a, seed, acc + wobble) for a, acc in attacked.items()]
    write_sweep(main, runs)
    for variant, attack, _ in tune.VARIANTS:
        runs = [study_run(p, RULE, attack, s, variants) for p in ("iid", "dirichlet") for s in (0, 1)]
        write_sweep(variant_dirs[variant], runs)


def test_settings_are_scored_against_the_best_clean_fedavg_and_the_base_loses_only_beyond_noise(
    tmp_path: Path,
) -> None:
    # "slow" trains worse clean and loses little to its attacks, so against its own FedAvg it would look best;
    # against the best FedAvg (base's, 0.96) its worst case is 0.96 - 0.90 = 6 points.
    _setting(tmp_path, "base", 0.96, {"optimal_ipm": 0.93, "mimic": 0.95}, 0.94)
    _setting(tmp_path, "slow", 0.91, {"optimal_ipm": 0.90, "mimic": 0.905}, 0.905)
    _setting(tmp_path, "better", 0.955, {"optimal_ipm": 0.95, "mimic": 0.952}, 0.953)
    settings = {"base": [], "slow": ["client.lr=0.01"], "better": ["server_optimizer.lr=1.5"]}
    table, reference = tune.selection_table(tmp_path, list(settings), RULE)
    assert reference == {"iid": "base", "dirichlet": "base"}
    text = tune.report(tmp_path, settings, RULE)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "@" not in line][1:]
    assert [row.split(" | ")[0] for row in rows] == ["| better", "| base", "| slow"]
    assert "| slow | `client.lr=0.01` | 6.0 (optimal_ipm)" in text
    assert "| base | `-` | 3.0 (optimal_ipm)" in text
    assert "Chosen: **better** (the lowest score" in text


def test_a_setting_within_the_noise_of_base_does_not_replace_it(tmp_path: Path) -> None:
    _setting(tmp_path, "base", 0.96, {"optimal_ipm": 0.95}, 0.955)
    _setting(tmp_path, "close", 0.96, {"optimal_ipm": 0.951}, 0.955)
    assert "Chosen: **base** (kept:" in tune.report(tmp_path, {"base": [], "close": ["client.lr=0.4"]}, RULE)


def test_only_the_selected_seeds_count(tmp_path: Path) -> None:
    _setting(tmp_path, "base", 0.96, {"optimal_ipm": 0.95}, 0.955)
    main, _ = tune.sweep_dirs(tmp_path, "base")
    # A third seed from another selection, in which the attack broke the run: it must not count for seeds 0 1.
    (main / "iid__mean__none__s2.json").write_text(json.dumps(study_run("iid", "mean", "none", 2, 0.96)))
    (main / f"iid__{RULE}__optimal_ipm__s2.json").write_text(json.dumps(study_run("iid", RULE, "optimal_ipm", 2, 0.1)))
    assert "| base | `-` | 1.0 (optimal_ipm)" in tune.report(tmp_path, {"base": []}, RULE, seeds=[0, 1])
    assert "| base | `-` | 1.0 (optimal_ipm)" not in tune.report(tmp_path, {"base": []}, RULE)


@pytest.mark.parametrize(
    "text", ["client.lr=0.1", "=client.lr=0.1", "a/b=client.lr=0.1", "a__b=x=1", "fast=0.5", "base"]
)
def test_a_setting_without_a_plain_name_is_refused_with_the_expected_form(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected NAME=OVERRIDES"):
        tune.parse_setting(text)


def test_parse_setting_splits_name_and_overrides() -> None:
    assert tune.parse_setting("base=") == ("base", [])
    assert tune.parse_setting("lr_0.1=client.lr=0.1") == ("lr_0.1", ["client.lr=0.1"])
    assert tune.parse_setting("fast=client.lr=0.5 server_optimizer.lr=1.5") == (
        "fast", ["client.lr=0.5", "server_optimizer.lr=1.5"]
    )


def test_the_rules_own_overrides_do_not_reach_clean_fedavg() -> None:
    """A pre-aggregator's parameter tunes the rule; FedAvg, the reference, runs the plain mean, which refuses it."""
    shared, rule_only = tune.split_overrides(
        ["dataset.validation_fraction=0.2", "+aggregator.pre_params.direction.z=1.5", "client.lr=0.1",
         "aggregator.params.tau=2", "++aggregator=krum", "aggregator_extra=1"]
    )
    assert shared == ["dataset.validation_fraction=0.2", "client.lr=0.1", "aggregator_extra=1"]
    assert rule_only == ["+aggregator.pre_params.direction.z=1.5", "aggregator.params.tau=2", "++aggregator=krum"]


def test_each_variant_sweep_counts_as_an_attack_of_its_own(tmp_path: Path) -> None:
    _setting(tmp_path, "base", 0.96, {"optimal_ipm": 0.95}, 0.955)
    _, variant_dirs = tune.sweep_dirs(tmp_path, "base")
    for path in variant_dirs["mimic_noise_1"].glob("*__mimic__*.json"):  # the spread copies: the worst attack
        path.write_text(path.read_text().replace('"accuracy": 0.955', '"accuracy": 0.9'))
    assert "| base | `-` | 6.0 (mimic (noise=1.0))" in tune.report(tmp_path, {"base": []}, RULE)


def test_a_setting_that_only_changes_the_rule_runs_no_clean_fedavg_of_its_own() -> None:
    settings = {
        "base": [],
        "previous": ["+aggregator.pre_params.direction.previous=true"],
        "lr_0.1": ["client.lr=0.1"],
        "lr_0.1_margin": ["client.lr=0.1", "+aggregator.pre_params.direction.margin=0.5"],
    }
    assert tune.settings_with_clean_runs(settings) == {"base", "lr_0.1"}
