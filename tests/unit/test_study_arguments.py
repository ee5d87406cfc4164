"""The study's --rules and --attacks: group files that name another rule, and clear errors before any run."""

from __future__ import annotations

import pytest
import torch

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
    assert "--rules: rule 'mean+krumm': its last stage 'krumm' (did you mean 'krum'?) names no file of " \
           "conf/aggregator (or a rule of your own by its dotted path, my_pkg.rules.MyRule); choices:" in err
    assert "centered_clipping_auto" in err and "trimmed_mean" in err
    assert "--attacks: no config in conf/attack for attack 'sign_flipp' (did you mean 'sign_flip'?)" in err
    assert not (tmp_path / "out").exists()  # nothing ran, nothing written


def test_components_of_your_own_that_do_not_import_are_said_with_the_other_problems(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        study.main(["--rules", "median", "nnm+fr_no_such_pkg.rules.MyRule", "--attacks", "none", "sign_flp",
                    "fr_no_such_pkg.attacks.MyAttack", "--partitions", "iid", "--seeds", "0",
                    "--out", str(tmp_path / "out")])
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.splitlines()[1:]
    assert [line.split(":")[0].strip() for line in lines] == ["--rules", "--attacks", "--attacks"], lines
    assert "cannot import 'fr_no_such_pkg.rules.MyRule'" in lines[0] and "'sign_flp'" in lines[1]
    assert "cannot import 'fr_no_such_pkg.attacks.MyAttack'" in lines[2]
    assert not (tmp_path / "out").exists()


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


class CoordinateMedianOfAll:
    """A rule of the user's own for the study below: the coordinate-wise median, built with f."""

    def __init__(self, f: int = 0) -> None:
        self.f = f

    def min_n(self) -> int:
        return 2 * self.f + 1

    def __call__(self, updates: torch.Tensor) -> torch.Tensor:  # the [n, d] -> [d] contract
        return updates.median(dim=0).values * 0.5  # half a step: another model than the built-in median's


class RaisesOnRealRows:
    def __init__(self, f: int = 0) -> None:
        self.f = f

    def min_n(self) -> int:
        return 2 * self.f + 1

    def __call__(self, updates: torch.Tensor) -> torch.Tensor:
        if updates.shape[1] > 100:  # the contract check's rows are small; a round's are the model's
            raise RuntimeError("boom on a round's rows")
        return updates.mean(dim=0)


def test_a_rule_of_your_own_is_a_row_of_the_study_and_a_run_that_raised_fails_the_command(tmp_path, capsys) -> None:
    from experiments import report

    mine, raising = f"{__name__}.CoordinateMedianOfAll", f"nnm+{__name__}.RaisesOnRealRows"
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stopped:
        study.main(["--rules", "median", mine, raising, "--attacks", "sign_flip", "--partitions", "iid", "--seeds",
                    "0", "--rounds", "2", "--clients", "6", "--byzantine", "1", "--jobs", "1", "--out", str(out)])
    assert stopped.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith(f"experiments.study: 1 of 3 runs failed with an error (the traceback is in each one's "
                          f"result file in {out}; the same command runs them again):\n")
    assert f"  iid__{raising}__sign_flip__s0: AggregationError: round 1: aggregator {__name__}.RaisesOnRealRows " \
           "(after nnm) failed on 6 replies: RuntimeError: boom on a round's rows" in err
    results = {r["rule"]: r for r in study.load_results(out)}
    assert results[mine]["status"] == study.OK and results[raising]["status"] == study.ERROR
    assert results[mine]["final_model_sha256"] != results["median"]["final_model_sha256"]  # its own rule ran
    assert f"aggregator._target_={mine}" in results[mine]["overrides"]
    assert "aggregator.pre='nnm'" in results[raising]["overrides"]
    page = report.write_report(out, tmp_path / "docs").read_text()
    assert f"| {mine} | 0." in page and f"| nnm+{__name__}.RaisesOnRealRows | failed |" in page
    # A report of runs that all failed is written too, naming why.
    only_failed = tmp_path / "failed"
    only_failed.mkdir()
    for path in out.glob("*RaisesOnRealRows*"):
        path.rename(only_failed / path.name)
    (out / "study.json").rename(only_failed / "study.json")
    assert "boom on a round's rows" in report.write_report(only_failed, tmp_path / "docs2").read_text()


def test_a_set_that_would_give_every_rule_one_aggregator_is_refused(tmp_path, capsys) -> None:
    for override in ("aggregator._target_=my_pkg.rules.MyRule", "aggregator.name=krum", "aggregator=krum"):
        with pytest.raises(SystemExit) as stopped:
            study.main(["--rules", "median", "krum", "--attacks", "none", "--partitions", "iid", "--seeds", "0",
                        "--set", override, "--out", str(tmp_path / "out")])
        assert stopped.value.code == 2
        assert f"--set {override}: --rules sets the aggregator of each run; a rule of your own is one of them by " \
               "its dotted path" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
