"""Every Hydra group and choice composes into a valid RunConfig; bad values fail before a run."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from experiments.run import to_run_config
from fedrobust.config import ConfigError, RunConfig, from_flat
from fedrobust.run_setup import build_aggregator, byzantine_partitions, validate

CONF = Path(__file__).resolve().parents[2] / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())


def _compose(*overrides: str) -> RunConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=list(overrides)))


def test_default_config_is_valid() -> None:
    cfg = validate(_compose())
    assert cfg.num_clients == 20 and cfg.num_rounds == 20


def test_clients_per_round_follows_num_clients_unless_set() -> None:
    assert _compose("num_clients=6").clients_per_round == 6
    assert _compose("num_clients=6", "clients_per_round=4").clients_per_round == 4


@pytest.mark.parametrize(
    "group,choice",
    [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))],
)
def test_every_group_choice_composes_and_validates(group: str, choice: str) -> None:
    overrides = [f"{group}={choice}"]
    if group == "attack" and choice != "none":
        overrides.append("num_byzantine=4")
    if group == "attack" and choice == "fltrust_adaptive":
        overrides.append("aggregator=fltrust")  # it attacks FLTrust's server update (refused elsewhere)
    if group == "aggregator" and choice in ("bulyan",):
        overrides.append("num_byzantine=4")
    if group == "model" and choice in ("cnn", "resnet"):
        overrides.append("dataset=mnist")  # image models cannot take digits' flat 64-feature inputs
    cfg = validate(_compose(*overrides))
    picked = getattr(cfg, group)
    assert picked.name  # the group's file really landed in the typed config


def test_unknown_aggregator_names_valid_choices() -> None:
    with pytest.raises(ValueError, match=r"aggregator\.name=kurm: unknown rule 'kurm' \(did you mean 'krum'\?\); "
                                         r"valid choices: .*\bkrum\b"):
        validate(_compose("aggregator.name=kurm"))


def test_default_aggregator_is_the_pipeline_in_one_field() -> None:
    cfg = validate(_compose())
    assert cfg.aggregator.name == "consistency+direction+dedup+winsorize+nnm+trimmed_mean" and cfg.aggregator.pre == ""
    pre = ["consistency", "direction", "dedup", "winsorize", "nnm"]
    assert (cfg.pre_aggregators(), cfg.rule()) == (pre, "trimmed_mean")
    assert build_aggregator(cfg).label == "trimmed_mean (after consistency, direction, dedup, winsorize, nnm)"


def test_picking_a_rule_by_name_drops_the_default_pre_aggregators() -> None:
    cfg = validate(_compose("aggregator.name=krum"))
    assert build_aggregator(cfg).label == "krum"
    cfg = validate(_compose("aggregator.name=krum", "aggregator.pre=nnm"))  # the two-field form still works
    assert build_aggregator(cfg).label == "krum (after nnm)"


def test_pipeline_stage_parameters_come_from_pre_params() -> None:
    cfg = validate(_compose("aggregator.name=bucketing+median", "+aggregator.pre_params.bucketing.s=2"))
    assert build_aggregator(cfg).pre[0].s == 2


def test_unknown_pipeline_stage_is_named() -> None:
    with pytest.raises(ValueError, match=r"unknown pre-aggregator 'winsorise' \(did you mean 'winsorize'\?\); "
                                         r"valid choices: .*\bwinsorize\b"):
        validate(_compose("aggregator.name=winsorise+nnm+trimmed_mean"))


def test_pre_aggregators_in_both_fields_are_refused_with_the_one_field_form() -> None:
    one_field = r"'clipping\+consistency\+direction\+dedup\+winsorize\+nnm\+trimmed_mean'"
    with pytest.raises(ValueError, match=r"aggregator\.pre=clipping: .*" + one_field):
        validate(_compose("aggregator.pre=clipping"))


def test_unknown_group_choice_fails_in_hydra() -> None:
    with pytest.raises(Exception, match="kurm"):
        _compose("aggregator=kurm")


def test_negative_f_is_rejected() -> None:
    with pytest.raises(ValueError, match="num_byzantine=-1: must be >= 0"):
        validate(_compose("num_byzantine=-1"))


def test_f_too_large_for_rule_names_requirement() -> None:
    # krum needs n >= 2f + 3: 8 clients per round cannot hold f = 4.
    with pytest.raises(ValueError, match=r"too large for krum.*clients_per_round=8"):
        validate(_compose("aggregator=krum", "num_byzantine=4", "clients_per_round=8"))


def test_a_parameter_too_large_for_the_round_is_named_not_f() -> None:
    # trimmed_mean with f=4 needs 9 of 20 replies; trim=12 needs 25: the parameter is at fault, not f.
    with pytest.raises(ValueError, match=r'aggregator.params=\{"trim": 12\}: with f=4 these are too large for '
                                         r"trimmed_mean: it needs at least 25 replies per round"):
        validate(_compose("aggregator=trimmed_mean", "+aggregator.params.trim=12"))
    with pytest.raises(ValueError, match=r"num_byzantine=10: f=10 is too large for trimmed_mean"):
        validate(_compose("aggregator=trimmed_mean", "num_byzantine=10", "+aggregator.params.trim=1"))


def test_type_error_fails_before_run() -> None:
    with pytest.raises(Exception, match="num_rounds"):
        _compose("num_rounds=many")


def test_unknown_key_in_flat_config_lists_valid_keys() -> None:
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['lr_typo'\].*'lr'"):
        from_flat({"client.lr_typo": 0.1})


@pytest.mark.parametrize("section", ["model", "dataset", "aggregator"])
def test_a_components_argument_beside_its_target_points_at_its_params_table(section: str) -> None:
    """Hydra's instantiate reads arguments beside _target_ (``+model.channels=4``); here they go in params."""
    expected = (rf"{section}: unknown key\(s\) \['channels'\]; valid keys: .* \(arguments of the {section} go in "
                rf"{section}.params: e.g. \+{section}.params.channels=")
    with pytest.raises(ValueError, match=expected):
        from_flat({f"{section}.channels": 4})
    with pytest.raises(ValueError) as err:
        from_flat({"client.channels": 4})
    assert "params" not in str(err.value)  # the client's settings have no params table


def test_flat_round_trip_matches_hydra() -> None:
    cfg = _compose("aggregator=krum", "num_byzantine=2", "partition=dirichlet")
    assert from_flat(cfg.to_flat()) == cfg


def test_byzantine_partitions_are_seeded() -> None:
    cfg = _compose("attack=sign_flip", "num_byzantine=4")
    first = byzantine_partitions(cfg)
    assert len(first) == 4 and first <= set(range(cfg.num_clients))
    assert first == byzantine_partitions(cfg)
    seeds = {byzantine_partitions(from_flat({**cfg.to_flat(), "seed": s})) for s in range(5)}
    assert len(seeds) > 1  # the seed, not a fixed list, picks them
    assert byzantine_partitions(from_flat({**cfg.to_flat(), "attack.name": "none"})) == frozenset()


def test_pyproject_run_config_is_the_hydra_default_experiment() -> None:
    import tomllib

    from flwr.common.config import flatten_dict

    project = tomllib.loads((CONF.parent / "pyproject.toml").read_text())
    flat = flatten_dict(project["tool"]["flwr"]["app"]["config"])
    assert from_flat(flat) == _compose()


def test_flwr_run_config_sets_parameter_tables_as_json_objects() -> None:
    from fedrobust.config import ConfigError, from_flat, run_config_toml

    # Declared in the app's run config, so `flwr run --run-config` may override them.
    assert '"aggregator.params" = "{}"' in run_config_toml()
    cfg = from_flat({"aggregator.name": "centered_clipping", "aggregator.params": '{"tau": 5, "iters": 2}'})
    assert cfg.aggregator.params == {"tau": 5, "iters": 2}
    with pytest.raises(ConfigError, match=r"model\.params=\[1\]: must be a table of parameters"):
        from_flat({"model.params": "[1]"})
    with pytest.raises(ConfigError, match=r"attack\.params=\{oops: must be a JSON object of parameters"):
        from_flat({"attack.params": "{oops"})


def test_a_quoted_number_in_a_flat_config_is_the_number() -> None:
    """``--run-config "num_byzantine='2'"`` or ``"client.lr" = "0.2"`` in a TOML file: a string that spells a
    number is taken as it, as OmegaConf takes a quoted number in Hydra; one that does not is refused."""
    cfg = from_flat({"num_byzantine": "2", "client.lr": " 0.2", "fault.round_timeout": "60"})
    assert (cfg.num_byzantine, cfg.client.lr, cfg.fault.round_timeout) == (2, 0.2, 60.0)
    assert type(cfg.num_byzantine) is int and type(cfg.fault.round_timeout) is float
    for flat, problem in (
        ({"num_byzantine": "two"}, "num_byzantine=two: must be an integer"),
        ({"num_byzantine": "1.5"}, "num_byzantine=1.5: must be an integer"),
        ({"client.lr": "inf"}, "client.lr=inf: must be a number"),
    ):
        with pytest.raises(ConfigError) as info:
            from_flat(flat)
        assert info.value.problems == [problem]


def test_an_infinite_learning_rate_or_timeout_is_refused() -> None:
    """client.lr=inf passed as > 0, and then every reply of every round was rejected as non-finite."""
    from fedrobust.run_setup import config_problems

    problems = config_problems(from_flat({"client.lr": float("inf"), "fault.round_timeout": float("inf")}))
    assert "client.lr=inf: must be > 0 and finite" in problems
    assert "fault.round_timeout=inf: must be > 0 and finite" in problems


def test_a_local_checkpoint_mirror_is_checked_as_the_directory_is(tmp_path: Path) -> None:
    """It failed with a traceback after the engine had started."""
    from fedrobust.run_setup import config_problems

    (tmp_path / "a_file").write_text("")
    cfg = from_flat({"checkpoint.dir": str(tmp_path / "ckpt"), "checkpoint.mirror": str(tmp_path / "a_file" / "m")})
    assert config_problems(cfg) == [
        f"checkpoint.mirror={tmp_path / 'a_file' / 'm'}: must be a directory or URL ({tmp_path / 'a_file'} is a file)"
    ]


def test_did_you_mean_names_the_closest_valid_name_or_nothing() -> None:
    from fedrobust.text import did_you_mean

    rules = ["mean", "median", "trimmed_mean", "krum", "multikrum"]
    assert did_you_mean("Krum", rules) == " (did you mean 'krum'?)"  # case
    assert did_you_mean("trimmed-mean", rules) == " (did you mean 'trimmed_mean'?)"  # dash for underscore
    assert did_you_mean("trimed_mean", rules) == " (did you mean 'trimmed_mean'?)"  # a letter missing
    assert did_you_mean("xyz", rules) == ""  # nothing close: no guess
    longer = [*rules, "geometric_median", "centered_clipping"]
    assert did_you_mean("geomedian", longer) == " (did you mean 'geometric_median'?)"  # shortened, not 'median'
    assert did_you_mean("tmean", longer) == " (did you mean 'trimmed_mean'?)"
    assert did_you_mean("cclip", longer) == " (did you mean 'centered_clipping'?)"
    assert did_you_mean("m", longer) == ""  # a prefix of several names: no guess
    assert did_you_mean("krum", rules) == ""  # valid already
    assert did_you_mean(0.5, rules) == ""  # not a name
