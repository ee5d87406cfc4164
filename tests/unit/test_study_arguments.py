"""The study's --rules and --attacks: group files that name another rule, and clear errors before any run."""

from __future__ import annotations

import pytest

from experiments import study


def test_a_rule_file_that_names_another_rule_runs_that_rule() -> None:
    assert study.pipeline_of("trimmed_mean") == "trimmed_mean"
    assert study.pipeline_of("winsorize+nnm+trimmed_mean") == "winsorize+nnm+trimmed_mean"
    # conf/aggregator/centered_clipping_auto.yaml: centered_clipping with tau=auto; nnm_krum.yaml: nnm+krum.
    assert study.pipeline_of("centered_clipping_auto") == "centered_clipping"
    assert study.pipeline_of("dedup+nnm_krum") == "dedup+nnm+krum"
    spec = study.RunSpec(partition="iid", rule="centered_clipping_auto", attack="none", seed=0)
    overrides = study.overrides_for(spec, rounds=2)
    assert overrides[:2] == ["aggregator=centered_clipping_auto", "aggregator.name='centered_clipping'"]
    config = study.compose({spec.key: overrides})[spec.key]
    assert (config.aggregator.name, config.aggregator.params) == ("centered_clipping", {"tau": "auto"})


def test_unknown_rules_and_attacks_are_refused_with_the_choices(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        study.main(["--rules", "mean", "mean+krumm", "--attacks", "none", "sign_flipp",
                    "--partitions", "iid", "--seeds", "0", "--out", str(tmp_path / "out")])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "--rules: rule 'mean+krumm': its last stage 'krumm' names no file of conf/aggregator; choices:" in err
    assert "centered_clipping_auto" in err and "trimmed_mean" in err
    assert "--attacks: no config in conf/attack for attack 'sign_flipp'" in err and "'sign_flip'" in err
    assert not (tmp_path / "out").exists()  # nothing ran, nothing written


def test_an_invalid_run_configuration_exits_2_with_every_problem(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        study.main(["--rules", "nope+mean", "--attacks", "none", "--set", "client.lr=-1", "--partitions", "iid",
                    "--seeds", "0", "--rounds", "2", "--out", str(tmp_path / "out")])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("experiments.study: invalid configuration:")
    assert "client.lr=-1.0: must be > 0" in err and "aggregator.name=nope+mean" in err


def test_the_pathological_partition_runs_on_request_and_the_default_stays_the_issues_two() -> None:
    """``--partitions pathological`` (2 classes per client, conf/partition/pathological.yaml) composes to that
    partitioner; without --partitions the study runs IID and Dirichlet, the settings its report is about."""
    assert study.parse_args(["--out", "x"]).partitions == ["iid", "dirichlet"]
    assert study.parse_args(["--out", "x", "--partitions", "pathological"]).partitions == ["pathological"]
    spec = study.RunSpec(partition="pathological", rule="mean", attack="none", seed=0)
    config = study.compose({spec.key: study.overrides_for(spec, rounds=2)})[spec.key]
    assert (config.partition.name, config.partition.classes_per_partition) == ("pathological", 2)
