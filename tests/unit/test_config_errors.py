"""Every RunConfig setting with a wrong value ends in exit code 2 and one line, before any engine starts.

The settings are found by walking RunConfig's dataclasses, so a new setting fails here until it
has a wrong value in WRONG (or a reason in NO_WRONG_VALUE). Each case runs the entry point's own
code in this process: ``experiments.run.cli()`` with the user's overrides, down to the config
check that decides exit 2. Hydra's composition is the one part replaced: the group choices are
composed once and the value overrides applied to a copy, as Hydra applies them (composing takes
~0.3 s a case). The tests at the end run the real Hydra app, and, as processes, the real command,
and check that neither Ray nor Flower was imported.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import os
import re
import subprocess
import sys
import types
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, NamedTuple, get_type_hints

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig

import experiments.run as run
from fedrobust import aggregators
from fedrobust.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
HEADER = "fedrobust: invalid configuration:"


class Wrong(NamedTuple):
    """A wrong value as the user types it, how the problem line shows it and what it says is allowed."""

    value: str
    shown: str
    allowed: str
    context: tuple[str, ...] = ()  # other overrides the case needs


# {file}: a path where a regular file exists; {missing}: a path where nothing exists.
WRONG: dict[str, Wrong] = {
    "num_clients": Wrong("0", "0", "must be >= 1"),
    "num_byzantine": Wrong("-1", "-1", "must be >= 0"),
    "clients_per_round": Wrong("25", "25", "must be in [1, num_clients=20]"),
    "num_rounds": Wrong("0", "0", "must be >= 1"),
    "seed": Wrong("-1", "-1", "must be >= 0"),
    "aggregator.name": Wrong(
        "krun", "krun", "unknown rule 'krun' (did you mean 'krum'?); valid choices: a rule (bulyan, centered_clipping"
    ),
    "aggregator._target_": Wrong("no_such_pkg.Rule", "no_such_pkg.Rule", "cannot import 'no_such_pkg.Rule'"),
    "aggregator.pre": Wrong(
        "nmm",
        "nmm",
        "unknown choice; valid choices: arc, bucketing, clipping, consistency, dedup, direction, dnc, nnm, winsorize",
        ("aggregator.name=trimmed_mean",),
    ),
    "aggregator.params": Wrong("{bogus:1}", '{"bogus": 1}', "unknown parameter(s) bogus; valid parameters:"),
    "aggregator.pre_params": Wrong(
        "{arc:{}}",
        '{"arc": {}}',
        "which the pipeline ['consistency', 'direction', 'dedup', 'winsorize', 'nnm', 'trimmed_mean'] does not run",
    ),
    "aggregator.root_size": Wrong("0", "0", "must be >= 1", ("aggregator=fltrust",)),
    "aggregator.device": Wrong("gpu", "gpu", "invalid device 'gpu'; valid: 'auto', 'cpu', 'cuda' or"),
    "dataset.name": Wrong(
        "mnsit", "mnsit", "unknown choice (did you mean 'mnist'?); valid choices: cifar10, digits, mnist"
    ),
    "dataset._target_": Wrong("no_such_pkg.load", "no_such_pkg.load", "cannot import 'no_such_pkg.load'"),
    "dataset.params": Wrong("{fraction:0.5}", '{"fraction": 0.5}', "dataset.name=digits takes no parameters"),
    "dataset.validation_fraction": Wrong("1.0", "1.0", "must be in [0, 1): the share of the training set held out"),
    "partition.name": Wrong("dirichlett", "dirichlett",
                            "unknown choice (did you mean 'dirichlet'?); valid choices: dirichlet, iid, pathological"),
    "partition.alpha": Wrong("0.0", "0.0", "must be > 0", ("partition=dirichlet",)),
    "partition.classes_per_partition": Wrong("11", "11", "must be in [1, 10] (digits has 10 classes)",
                                             ("partition=pathological",)),
    "model.name": Wrong("resnt", "resnt", "unknown choice (did you mean 'resnet'?); valid choices: cnn, mlp, resnet"),
    "model._target_": Wrong("no_such_pkg.Net", "no_such_pkg.Net", "cannot import 'no_such_pkg.Net'"),
    "model.params": Wrong("{hidden:-1}", '{"hidden": -1}', "mlp cannot be built with them"),
    "server_optimizer.name": Wrong("sgd", "sgd", "unknown choice; valid choices: fedadam, fedavg, fedavgm, fedyogi"),
    "server_optimizer.lr": Wrong("0.0", "0.0", "must be > 0"),
    "server_optimizer.momentum": Wrong("1.0", "1.0", "must be in [0, 1)", ("server_optimizer=fedavgm",)),
    "server_optimizer.beta_1": Wrong("-0.1", "-0.1", "must be in [0, 1)", ("server_optimizer=fedadam",)),
    "server_optimizer.beta_2": Wrong("1.5", "1.5", "must be in [0, 1)", ("server_optimizer=fedadam",)),
    "server_optimizer.tau": Wrong("0.0", "0.0", "must be > 0", ("server_optimizer=fedadam",)),
    "server_optimizer.schedule": Wrong("linear", "linear", "unknown choice; valid choices: constant, cosine"),
    "server_optimizer.min_lr_ratio": Wrong("1.5", "1.5", "must be in [0, 1]"),
    "client.local_epochs": Wrong("0", "0", "must be >= 1"),
    "client.batch_size": Wrong("0", "0", "must be >= 1"),
    "client.lr": Wrong("-0.1", "-0.1", "must be > 0"),
    "client.momentum": Wrong("1.0", "1.0", "must be in [0, 1)"),
    "client.weight_decay": Wrong("-1.0", "-1.0", "must be >= 0"),
    "client.device": Wrong("gpu", "gpu", "must be auto, cpu, cuda or cuda:N"),
    "client.amp": Wrong("fp8", "fp8", "unknown choice; valid choices: bf16, fp16, none"),
    "client.deterministic": Wrong("maybe", "maybe", "must be true or false"),
    "validation.max_update_norm": Wrong("-1.0", "-1.0", "must be >= 0 (0: no bound)"),
    "validation.max_num_examples": Wrong("0", "0", "must be >= 1"),
    "validation.weight_by_num_examples": Wrong("maybe", "maybe", "must be true or false"),
    "attack.name": Wrong("sign_flp", "sign_flp", "unknown choice (did you mean 'sign_flip'?); valid choices: alie,"),
    "attack._target_": Wrong("no_such_pkg.Attack", "no_such_pkg.Attack", "cannot import 'no_such_pkg.Attack'"),
    "attack.params": Wrong("{bogus:1}", '{"bogus": 1}', "unknown parameter(s) 'bogus'; allowed: scale",
                           ("attack=sign_flip",)),
    "fault.round_timeout": Wrong("0.0", "0.0", "must be > 0"),
    "fault.over_select": Wrong("-1", "-1", "must be >= 0"),
    "fault.grace_after_quorum": Wrong("-5.0", "-5.0", "must be >= 0 (0: off)"),
    "fault.max_round_retries": Wrong("-1", "-1", "must be >= 0"),
    "fault.wait_for_nodes": Wrong("0.0", "0.0", "must be > 0 (seconds for the nodes to connect"),
    "liveness.suspect_after": Wrong("0", "0", "must be >= 1"),
    "liveness.dead_after": Wrong("0", "0", "must be >= liveness.suspect_after (1)"),
    "liveness.backoff_rounds": Wrong("0", "0", "must be >= 1"),
    "liveness.max_backoff": Wrong("1", "1", "must be >= liveness.backoff_rounds (2)"),
    "liveness.quarantine_after": Wrong("-1", "-1", "must be >= 0 (0: never quarantine)"),
    "liveness.quarantine_rounds": Wrong("0", "0", "must be >= 1"),
    "guard.divergence_factor": Wrong("-1.0", "-1.0", "must be > 1, or 0 to switch the loss check off"),
    "guard.lr_decay": Wrong("0.0", "0.0", "must be in (0, 1]"),
    "checkpoint.dir": Wrong("{file}/ckpt", "{file}/ckpt", "must be a directory or URL ({file} is a file)"),
    "checkpoint.every_rounds": Wrong("-1", "-1", "must be an integer >= 0"),
    "checkpoint.every_seconds": Wrong("-1.0", "-1.0", "must be >= 0 (0: no time-based saves)"),
    "checkpoint.keep": Wrong("0", "0", "must be >= 1 (the newest checkpoints kept on disk)"),
    "checkpoint.resume": Wrong("always", "always", "unknown choice; valid choices: auto, never"),
    "checkpoint.force_resume": Wrong("maybe", "maybe", "must be true or false"),
    "checkpoint.mirror": Wrong("s3://bucket/run", "s3://bucket/run", "needs checkpoint.dir"),
    "checkpoint.full_every": Wrong("0", "0", "must be an integer >= 1"),
    "checkpoint.mtbf": Wrong("-1.0", "-1.0", "must be >= 0 seconds"),
    "signing.require": Wrong("maybe", "maybe", "must be true or false"),
    "signing.trust_dir": Wrong("{missing}", "{missing}", "no such directory"),
    "simulation.client_cpus": Wrong("0.0", "0.0", "must be > 0"),
    "simulation.client_gpus": Wrong("-1.0", "-1.0", "must be >= 0"),
    # Any value on experiments.run's command line (Hydra picks the folder there); a file in its place is refused
    # under flwr run (test_output_dir_on_the_hydra_command_line_points_at_hydra_run_dir).
    "output_dir": Wrong("{file}", "{file}", "experiments.run writes its outputs to Hydra's run folder"),
}

# Settings that no value can make wrong, with the reason. None so far: even free strings name paths.
NO_WRONG_VALUE: dict[str, str] = {}


def setting_keys(cls: type = RunConfig, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every setting of RunConfig as (dotted key, type), sections walked recursively."""
    hints = get_type_hints(cls)
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            yield from setting_keys(hint, f"{prefix}{field.name}.")
        else:
            yield f"{prefix}{field.name}", hint


SETTINGS = dict(setting_keys())


class Outcome(NamedTuple):
    code: Any
    stdout: str
    stderr: str


@pytest.fixture
def engine_guard(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """experiments.simulate replaced by a stub that records any start of the engine (and starts none)."""
    started: list[Any] = []
    stub = types.ModuleType("experiments.simulate")
    stub.simulate = lambda *args, **kwargs: started.append(args) or []  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "experiments.simulate", stub)
    return started


@functools.cache
def _composed(groups: tuple[str, ...]) -> DictConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(groups))


def _compose_fast(args: list[str]) -> DictConfig:
    """The config Hydra composes for ``args``: group choices composed (cached), values applied to a copy."""
    parsed = OverridesParser.create().parse_overrides(args)
    groups = tuple(
        o.input_line for o in parsed if o.key_or_group.isidentifier() and (ROOT / "conf" / o.key_or_group).is_dir()
    )
    cfg = _composed(groups).copy()
    ConfigLoaderImpl._apply_overrides_to_config([o for o in parsed if o.input_line not in groups], cfg)
    return cfg


def _cli(args: list[str], monkeypatch: pytest.MonkeyPatch, *, real_hydra: bool = False) -> Outcome:
    """``python -m experiments.run *args`` in this process: its exit code and output."""

    def fast_main() -> None:  # what main() does up to the config check, on a fast composition
        run.checked_run_config(_compose_fast(sys.argv[1:]))
        pytest.fail(f"configuration accepted: {args}")

    if not real_hydra:
        monkeypatch.setattr(run, "main", fast_main)
    monkeypatch.setattr(sys, "argv", ["experiments/run.py", *args])
    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    level, handlers = root.level, root.handlers[:]
    with redirect_stdout(out), redirect_stderr(err):
        try:
            run.cli()
            code = 0
        except SystemExit as stop:
            code = stop.code
        finally:  # Hydra configures logging for its job: give the next tests theirs back
            root.setLevel(level)
            root.handlers[:] = handlers
    return Outcome(code, out.getvalue(), err.getvalue())


def _assert_one_problem(outcome: Outcome, line_start: str, allowed: str) -> None:
    assert outcome.code == 2, outcome
    assert "Traceback" not in outcome.stderr + outcome.stdout
    lines = outcome.stderr.splitlines()
    assert lines[0] == HEADER, outcome.stderr
    problems = [line.strip() for line in lines[1:]]
    assert len(problems) == 1, outcome.stderr
    assert problems[0].startswith(line_start), problems[0]
    assert allowed in problems[0][len(line_start) :], problems[0]


@pytest.fixture
def paths(tmp_path: Path) -> dict[str, str]:
    file = tmp_path / "a-file"
    file.write_text("")
    return {"file": str(file), "missing": str(tmp_path / "missing")}


def test_wrong_values_cover_exactly_the_settings() -> None:
    assert not set(WRONG) & set(NO_WRONG_VALUE)
    stale = sorted((set(WRONG) | set(NO_WRONG_VALUE)) - set(SETTINGS))
    assert not stale, f"not RunConfig settings (renamed or removed?): {stale}"


@pytest.mark.parametrize("key", list(SETTINGS))
def test_wrong_value_of_every_setting_exits_2_with_its_line(
    key: str, paths: dict[str, str], engine_guard: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    if key in NO_WRONG_VALUE:
        pytest.skip(f"no value of {key} is wrong: {NO_WRONG_VALUE[key]}")
    if key not in WRONG:
        pytest.fail(f"RunConfig setting {key} has no wrong value in WRONG (nor a reason in NO_WRONG_VALUE)")
    wrong = WRONG[key]

    def fill(text: str) -> str:
        for name, path in paths.items():
            text = text.replace("{" + name + "}", path)
        return text

    outcome = _cli([*wrong.context, f"{key}={fill(wrong.value)}"], monkeypatch)
    _assert_one_problem(outcome, f"{key}={fill(wrong.shown)}: ", fill(wrong.allowed))
    assert not engine_guard


def _wrong_type(hint: Any) -> tuple[str, str] | None:
    """A value of the wrong type for a setting of type ``hint``, and what the line says; None for strings."""
    if hint is bool:
        return "yes", "must be true or false"
    if hint is int or hint == int | str:
        return "1.5", "must be an integer"
    if hint is float:
        return "fast", "must be a number"
    if getattr(hint, "__origin__", None) is dict:
        return "5", "must be a table of parameters"
    return None  # a string: Hydra makes one of any value


@pytest.mark.parametrize("key", [key for key, hint in SETTINGS.items() if _wrong_type(hint)])
def test_wrong_type_of_every_setting_exits_2_before_hydra(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    value, allowed = _wrong_type(SETTINGS[key])  # type: ignore[misc]

    def composed() -> None:
        pytest.fail("Hydra was started")

    monkeypatch.setattr(run, "main", composed)
    _assert_one_problem(_cli([f"{key}={value}"], monkeypatch), f"{key}={value}: ", allowed)


@pytest.mark.parametrize(("override", "kind"), [("attack=nan", "number"), ("attack=1", "number"),
                                             ("aggregator=true", "boolean")])
def test_a_group_choice_hydra_reads_as_a_number_names_the_choices(
    override: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hydra's grammar makes ``attack=nan`` a float and then fails with a traceback: answer in one line."""

    def composed() -> None:
        pytest.fail("Hydra was started")

    monkeypatch.setattr(run, "main", composed)
    group = override.split("=")[0]
    outcome = _cli([override], monkeypatch)
    _assert_one_problem(outcome, f"{override}: ", f"Hydra reads this value as a {kind}, not a name")
    choices = outcome.stderr.split(f"valid choices in {group}: ")[1].split(", ")
    assert [c.strip() for c in choices] == sorted(p.stem for p in (run.CONF_DIR / group).glob("*.yaml"))
    assert ("nan_fill" in outcome.stderr) == (group == "attack")


def test_every_problem_is_listed_not_only_the_first(engine_guard: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    outcome = _cli(["client.lr=-0.1", "client.device=gpu", "guard.divergence_factor=0.5"], monkeypatch)
    assert outcome.code == 2
    problems = [line.strip() for line in outcome.stderr.splitlines()[1:]]
    assert [p.split("=")[0] for p in problems] == ["client.lr", "client.device", "guard.divergence_factor"]
    assert not engine_guard


def test_parameter_tables_take_a_new_key_without_plus(
    engine_guard: list[Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``aggregator.params.tau=-1`` is Hydra's ``++``: the rule's own check answers, not Hydra's struct error."""
    # A folder of its own: Hydra's default outputs/<day>/<time> is shared by tests started in the same second
    # on other workers, and a refused run removes that folder while another test's Hydra logs into it.
    outcome = _cli(["aggregator=centered_clipping", "aggregator.params.tau=-1", f"hydra.run.dir={tmp_path}"],
                   monkeypatch, real_hydra=True)
    _assert_one_problem(outcome, 'aggregator.params={"tau": -1}: ', "tau must be a finite number > 0")
    assert not engine_guard


def test_real_hydra_app_exits_2_without_starting_the_engine(
    engine_guard: list[Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    day = tmp_path / "outputs" / "2026-11-27"  # Hydra's default layout: outputs/<day>/<time>
    outcome = _cli(["client.lr=-0.1", f"hydra.run.dir={day / '10-00-00'}"], monkeypatch, real_hydra=True)
    _assert_one_problem(outcome, "client.lr=-0.1: ", "must be > 0")
    assert not engine_guard
    assert not day.exists()  # Hydra's folder for the refused run, with nothing of a run in it, and its day's
    assert (tmp_path / "outputs").exists()


def test_a_refused_config_leaves_a_run_folder_with_more_in_it(
    engine_guard: list[Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "checkpoints").mkdir()  # e.g. a fixed run folder whose checkpoints a later command resumes
    outcome = _cli(["client.lr=-0.1", f"hydra.run.dir={tmp_path}"], monkeypatch, real_hydra=True)
    assert outcome.code == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hydra", "checkpoints", "run.log"]
    # A fixed folder outside Hydra's outputs/<day>/<time> layout: its parent is the user's, never removed.
    outcome = _cli(["client.lr=-0.1", f"hydra.run.dir={tmp_path / 'mine' / 'run'}"], monkeypatch, real_hydra=True)
    assert outcome.code == 2 and (tmp_path / "mine").exists() and not (tmp_path / "mine" / "run").exists()


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("krum+nnm", "the rule goes last, after its pre-aggregators: 'nnm+krum'"),
        ("nnm+krum+median", "a pipeline is pre-aggregators and then exactly one rule; 'nnm+krum+median' names 2 rules"),
        ("winsorize+nnm", "a pipeline is pre-aggregators and then exactly one rule; 'winsorize+nnm' names no rule"),
        ("dnc+nnm", "the rule goes last, after its pre-aggregators: 'nnm+dnc'"),  # DnC: a rule where nothing else is
        ("dnc+dnc+nnm", "the rule goes last, after its pre-aggregators: 'dnc+nnm+dnc'"),  # the filter DnC stays
        ("nnm+nnm+krum", "names 'nnm' more than once; each stage once, e.g. 'nnm+krum'"),
        ("dnc+dnc+mean", "names 'dnc' more than once; each stage once, e.g. 'dnc+mean'"),  # a filter, then the rule
        ("winsorize+nnm+winsorize+trimmed_mean",
         "names 'winsorize' more than once; each stage once, e.g. 'winsorize+nnm+trimmed_mean'"),
    ],
)
def test_a_pipeline_out_of_order_says_the_order(
    name: str, says: str, engine_guard: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    outcome = _cli([f"aggregator.name={name}", "num_byzantine=1"], monkeypatch)
    _assert_one_problem(outcome, f"aggregator.name={name}: ", says)
    with pytest.raises(ValueError, match=re.escape(f"aggregator {name!r}: {says}")):
        aggregators.build(name, f=1)
    assert aggregators.pipeline_order_hint("dnc+trimmed_mean") is None  # DnC: a rule and a pre-aggregator
    assert aggregators.pipeline_order_hint("dnc+nnm+dnc") is None  # ... so both in one pipeline


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("num_rounds=2.0", "num_rounds=2.0: must be an integer"),
        ("num_rounds=nan", "num_rounds=nan: must be an integer"),
        ("client=gpu", "client=gpu: client is a table of settings, not a choice: set its keys, e.g. client.amp=...; "),
        ("aggregator.name=null", "aggregator.name=null: must be a string"),
        ("+num_rounds=3", "+num_rounds=3: num_rounds is a setting already: drop the '+'"),
        ("seed=4294967296", "seed=4294967296: must be <= 4294967295 (2**32 - 1)"),
        ("num_clients=3000", "num_clients=3000: digits has 1437 training examples to partition"),
        ("attack=backdoor", "attack.params.target=12: must be a label in [0, 9] (digits has 10 classes)"),
        ("fault=fast", "fault=fast: fault is a table of settings, not a choice: set its keys, e.g. fault."),
        ("checkpoint.dir=ftp2://x/y", "checkpoint.dir=ftp2://x/y: unknown storage protocol 'ftp2'"),
        ("aggregator.pre=nnm+bucketing", "aggregator.pre=nnm+bucketing: aggregator.pre separates its names with "
                                         "commas: aggregator.pre='nnm,bucketing'"),
        ("aggregator.pre=clipping,nnm", "aggregator.pre=clipping,nnm: a sweep over values runs with -m (--multirun); "
                                        "for a list of pre-aggregators quote it: \"aggregator.pre='clipping,nnm'\""),
        # Accepted and ignored, the run would go on as if they were not given.
        ("server_optimizer.momentum=0.5", "server_optimizer.momentum=0.5: server_optimizer=fedavg does not use it "
                                          "(only fedavgm)"),
        ("partition.alpha=0.3", "partition.alpha=0.3: partition=iid does not use it (only dirichlet)"),
        # Swept, the setting is refused when no job reads it.
        ("-m partition.alpha=0.1,0.5", "partition.alpha=0.1: partition=iid does not use it (only dirichlet)"),
        ("-m server_optimizer=fedavg,fedadam server_optimizer.momentum=0.5",
         "server_optimizer.momentum=0.5: server_optimizer=fedavg does not use it (only fedavgm)"),
        ("fault={bogus:30}", "fault.bogus=30: unknown key; valid keys in fault: "),
        # A misspelled section in the middle of a key: the section that lacks it is named, with its keys.
        ("aggregator.parms.alpha=1",
         "aggregator.parms.alpha=1: unknown key (did you mean 'params'?); valid keys in aggregator: ['_target_', "),
        ("fault={round_timeout:abc}", "fault.round_timeout=abc: must be a number"),
        ("attack=mimic +attack.params.target=20", "attack.params.target=20: must be the row of an honest reply, "
                                                  "in [0, 15]"),
        # A stage twice: refused as in a pipeline name (its parameters are set by its name).
        ("aggregator=krum aggregator.pre='nnm,clipping,nnm'",
         "aggregator.pre=nnm,clipping,nnm: names 'nnm' more than once; each stage once, e.g. "
         "aggregator.pre='nnm,clipping'"),
        # The root set: drawn from the training split, and read by FLTrust only.
        ("aggregator=fltrust aggregator.root_size=5000", "aggregator.root_size=5000: must be <= 1437, the training "
                                                         "examples of digits"),
        ("aggregator=krum aggregator.root_size=5", "aggregator.root_size=5: aggregator=krum does not use it (only "
                                                   "fltrust)"),
        # A mirror in the directory itself keeps nothing that a lost disk takes.
        ("checkpoint.dir=/tmp/fr-ck checkpoint.mirror=file:///tmp/fr-ck/",
         "checkpoint.mirror=file:///tmp/fr-ck/: is checkpoint.dir itself"),
        ("checkpoint.dir=/tmp/fr-ck checkpoint.mirror=/tmp/fr-ck/copy",
         "checkpoint.mirror=/tmp/fr-ck/copy: is a folder inside checkpoint.dir"),
        ("checkpoint.dir=/tmp/fr-ck/local checkpoint.mirror=/tmp/fr-ck",
         "checkpoint.mirror=/tmp/fr-ck: holds checkpoint.dir inside it"),
    ],
)
def test_values_hydra_or_a_later_step_refused_with_a_traceback_get_one_line(
    override: str, line: str, engine_guard: list[Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    extra = ["attack.params.target=12"] if override == "attack=backdoor" else []
    outcome = _cli([*override.split(), *extra, "hydra.sweep.dir=/nonexistent/never-made",
                    f"hydra.run.dir={tmp_path}"], monkeypatch, real_hydra=True)  # a folder of its own, as above
    assert outcome.code == 2 and "Traceback" not in outcome.stderr, outcome
    assert any(p.strip().startswith(line) for p in outcome.stderr.splitlines()[1:]), outcome.stderr
    assert not engine_guard


def test_a_sweep_over_rules_may_set_the_root_set_that_only_fltrust_reads(
    engine_guard: list[Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    outcome = _cli(["-m", "aggregator=krum,fltrust", "aggregator.root_size=50", f"hydra.sweep.dir={tmp_path}"],
                   monkeypatch, real_hydra=True)
    assert outcome.code == 0 and "does not use it" not in outcome.stderr, outcome
    assert len(engine_guard) == 2  # both jobs started


def test_settings_for_other_choices_of_a_swept_group_and_table_overrides_are_accepted(
    engine_guard: list[Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """partition.alpha next to partition=iid,dirichlet is for the dirichlet jobs; mimic's target is a row, not
    a label; fault={...} merges into the table as Hydra does; fsspec chains URLs: none of them is a problem."""
    for args in (["-m", "partition=iid,dirichlet", "partition.alpha=0.3", "server_optimizer=fedavg,fedavgm",
                  "server_optimizer.momentum=0.5", "num_rounds=0"],
                 ["attack=mimic", "+attack.params.target=12", "fault={round_timeout:30}", "num_rounds=0",
                  "checkpoint.dir=simplecache::memory://ck/x"]):  # a chained fsspec URL
        outcome = _cli([*args, f"hydra.sweep.dir={tmp_path}", f"hydra.run.dir={tmp_path}"], monkeypatch,
                       real_hydra=True)
        problems = [line.strip() for line in outcome.stderr.splitlines()[1:]]
        assert outcome.code == 2 and all(p.endswith("num_rounds=0: must be >= 1") or p.startswith("no job")
                                         for p in problems), outcome.stderr


def test_a_type_problem_comes_with_the_range_problems_of_the_other_values(
    engine_guard: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Types are checked before Hydra composes; the config the other overrides compose is checked then too,
    so that fixing ``seed=1.5`` is not followed by a refusal of ``num_rounds=0``, or of the rule the command
    picks for too few clients."""
    outcome = _cli(["seed=1.5", "fault.round_timeout=-5", "num_rounds=0", "num_clients=3", "client.lr=0.1"],
                   monkeypatch)
    assert outcome.code == 2 and not engine_guard, outcome
    assert [line.strip() for line in outcome.stderr.splitlines()[1:]] == [
        "seed=1.5: must be an integer",
        "num_rounds=0: must be >= 1",
        "num_byzantine=4: must be < num_clients (3)",
        "num_byzantine=4: f=4 is too large for consistency+direction+dedup+winsorize+nnm+trimmed_mean: it needs "
        "at least 9 replies per round, but clients_per_round=3 (num_byzantine=1 fits)",
        "fault.round_timeout=-5.0: must be > 0 and finite",
    ]
    outcome = _cli(["aggregator=krum", "num_clients=5", "seed=1.5"], monkeypatch)
    assert [line.strip() for line in outcome.stderr.splitlines()[1:]] == [
        "seed=1.5: must be an integer",
        "num_byzantine=4: f=4 is too large for krum: it needs at least 11 replies per round, but clients_per_round=5 "
        "(num_byzantine=1 fits)",
    ], outcome.stderr


def test_a_sweep_with_an_invalid_job_starts_none_and_names_each_bad_job(
    engine_guard: list[Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Hydra's launcher would run job 0, stop at job 1 and leave job 2 unrun: every job is checked first."""
    outcome = _cli(["-m", "num_rounds=1", "num_clients=6", "num_byzantine=1,-1,2", "aggregator=median,krumm",
                    f"hydra.sweep.dir={tmp_path}"], monkeypatch, real_hydra=True)
    assert outcome.code == 2 and "Traceback" not in outcome.stderr, outcome
    problems = [line.strip() for line in outcome.stderr.splitlines()[1:]]
    files = sorted(p.stem for p in (ROOT / "conf" / "aggregator").glob("*.yaml"))
    assert problems[0] == "job 1 (num_byzantine=1 aggregator=krumm): aggregator=krumm: unknown choice (did you " \
        "mean 'krum'?); valid choices in aggregator: " + ", ".join(files)
    assert [p.split(":")[0] for p in problems[1:]] == [
        "job 2 (num_byzantine=-1 aggregator=median)", "job 3 (num_byzantine=-1 aggregator=krumm)",
        "job 5 (num_byzantine=2 aggregator=krumm)", "no job of the sweep was started"]
    assert problems[1].endswith("num_byzantine=-1: must be >= 0")
    assert not engine_guard and not any(tmp_path.iterdir())


def test_config_groups_in_a_users_own_folder_are_choices_too(
    engine_guard: list[Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A user's conf/model/my_mlp.yaml, found through --config-dir or hydra.searchpath as Hydra finds it: a
    valid choice, listed among the choices of a typo, and composed into each job of a sweep before any starts."""
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "model" / "my_mlp.yaml").write_text("name: mlp\nparams:\n  hidden: 32\n")
    builtin = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))
    for flags in (["--config-dir", str(conf)], [f"--config-dir={conf}"], [f"hydra.searchpath=[file://{conf}]"]):
        assert run.override_problems([*flags, "model=my_mlp"]) == []
        assert run.override_problems(["model=my_mlp"]) != []  # without the folder it is unknown
        outcome = _cli([*flags, "model=my_mlpp"], monkeypatch)
        _assert_one_problem(outcome, "model=my_mlpp: ", "valid choices in model: " + ", ".join(sorted(
            [*builtin, "my_mlp"])))
        outcome = _cli(["-m", *flags, "model=my_mlp", "seed=0,1", "+model.params.depth=3",
                        f"hydra.sweep.dir={tmp_path / 'sweep'}"], monkeypatch, real_hydra=True)
        assert outcome.code == 2 and ("job 0 (seed=0): model.params={\"depth\": 3, \"hidden\": 32}: model 'mlp' "
                                      "has no option(s) depth") in outcome.stderr, outcome
    # A package's folder (pkg://) cannot be listed here: Hydra answers for its choices itself.
    assert run.override_problems(["hydra.searchpath=[pkg://my_project.conf]", "model=my_mlp"]) == []
    assert not engine_guard


def test_a_sweep_whose_jobs_share_a_checkpoint_dir_starts_none(
    engine_guard: list[Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Job 1 would resume job 0's checkpoint (or be refused for its other seed): refused before any job.
    A directory per job, by ``${hydra:job.num}`` as Hydra's launcher sets it or by a swept value, is not."""
    base = ["-m", "num_rounds=1", "num_clients=6", "num_byzantine=1", "seed=0,1,2", f"hydra.sweep.dir={tmp_path}"]
    outcome = _cli([*base, f"checkpoint.dir={tmp_path}/ck"], monkeypatch, real_hydra=True)
    problems = [line.strip() for line in outcome.stderr.splitlines()[1:]]
    assert outcome.code == 2 and problems == [
        f"job 0 (seed=0), job 1 (seed=1), job 2 (seed=2) share checkpoint.dir={tmp_path.resolve()}/ck: each job "
        "after the first would resume the first one's checkpoint; give each job its own, e.g. "
        "checkpoint.dir='<dir>/${hydra:job.num}' or '<dir>/${seed}'",
        "no job of the sweep was started"], outcome.stderr
    outcome = _cli([*base, f"checkpoint.dir={tmp_path}/ck/${{seed}}", f"checkpoint.mirror={tmp_path}/mirror"],
                   monkeypatch, real_hydra=True)  # a resume reads the mirror too
    assert outcome.code == 2 and f"share checkpoint.mirror={tmp_path.resolve()}/mirror" in outcome.stderr
    for per_job in ("${hydra:job.num}", "${seed}", "${hydra:sweep.subdir}"):
        outcome = _cli([*base[:1], "num_rounds=0", *base[2:], f"checkpoint.dir={tmp_path}/ck/{per_job}"], monkeypatch,
                       real_hydra=True)
        problems = [line.strip() for line in outcome.stderr.splitlines()[1:]]
        assert outcome.code == 2 and len(problems) == 4, outcome.stderr  # num_rounds=0 in each job, nothing else
        assert all(p.endswith("num_rounds=0: must be >= 1") for p in problems[:3]), outcome.stderr
    assert not engine_guard and not any(tmp_path.iterdir())


def test_one_jobs_checkpoint_dir_as_another_jobs_mirror_is_a_shared_place() -> None:
    """A resume reads the mirror too: job 1 mirroring into job 0's directory would resume job 0's run."""
    labels = ["job 0 (seed=0)", "job 1 (seed=1)"]
    places = {"/ck/0": [(0, "dir"), (1, "mirror")], "/ck/1": [(1, "dir")], "/m/0": [(0, "mirror")]}
    assert run.shared_checkpoint_places(places, labels) == [
        "job 0 (seed=0), job 1 (seed=1) share /ck/0 as checkpoint.dir or checkpoint.mirror (job 0: dir, job 1: "
        "mirror): each job after the first would resume the first one's checkpoint; give each job its own, e.g. "
        "checkpoint.dir='<dir>/${hydra:job.num}' or '<dir>/${seed}'"]
    assert run.shared_checkpoint_places({"/ck/0": [(0, "dir"), (0, "mirror")]}, labels) == []  # one job's own


def test_a_relative_checkpoint_dir_under_hydra_chdir_is_each_jobs_own(
    engine_guard: list[Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With hydra.job.chdir=true every job runs in its own output directory, so a relative checkpoint.dir is a
    different place for each job: not refused as shared. Without chdir it is one place, and refused."""
    monkeypatch.chdir(tmp_path)
    base = ["-m", "num_rounds=0", "num_clients=6", "num_byzantine=1", "seed=0,1", f"hydra.sweep.dir={tmp_path}/sw",
            "checkpoint.dir=ck"]
    outcome = _cli([*base, "hydra.job.chdir=true"], monkeypatch, real_hydra=True)
    problems = [line.strip() for line in outcome.stderr.splitlines()[1:]]
    assert outcome.code == 2 and len(problems) == 3 and "share" not in outcome.stderr, outcome.stderr
    outcome = _cli(base, monkeypatch, real_hydra=True)
    assert outcome.code == 2 and f"share checkpoint.dir={tmp_path.resolve()}/ck:" in outcome.stderr, outcome.stderr
    assert not engine_guard


def test_a_syntax_error_or_a_sweep_without_multirun_is_an_invalid_configuration(
    engine_guard: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hydra itself answers both with exit 1 and a hint about tracebacks: here they are config problems (exit
    2), one line each, naming the override."""
    outcome = _cli(["num_rounds=[1,2", "seed=1"], monkeypatch)
    assert outcome.code == 2 and outcome.stderr.splitlines()[1].strip().startswith(
        "num_rounds=[1,2: no viable alternative at input '[1,2' (Hydra's override grammar: https://"), outcome.stderr
    assert len(outcome.stderr.splitlines()) == 2
    outcome = _cli(["aggregator=krum,median", "num_rounds=1"], monkeypatch)
    assert outcome.code == 2 and outcome.stderr.splitlines()[1:] == [
        "  aggregator=krum,median: a sweep over values runs with -m (--multirun)"], outcome.stderr
    assert run.override_problems(["seed=0,1", "hydra.mode=MULTIRUN"]) == []  # Hydra's other way to say -m
    assert not engine_guard


def test_full_error_raises_with_the_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(run.ConfigError, match=r"client\.lr=-0\.1: must be > 0"):
        run.checked_run_config(_compose_fast(["client.lr=-0.1"]))


# The real command as a process: exit 2, and the engine's packages never imported.
_WRAPPER = """
import atexit, runpy, sys
atexit.register(lambda: print("imported:", sorted({m.split(".")[0] for m in sys.modules} & {"ray", "flwr", "torch"}),
                              file=sys.stderr))
sys.argv = ["experiments/run.py", *sys.argv[1:]]
runpy.run_module("experiments.run", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "line", "imported"),
    [
        ("client.lr=fast", "client.lr=fast: must be a number", "[]"),  # a type: caught before Hydra and torch
        ("client.lr=-0.1", "client.lr=-0.1: must be > 0 and finite", "['torch']"),  # a range: after Hydra
    ],
)
def test_command_exits_2_and_never_imports_ray_or_flower(
    override: str, line: str, imported: str, tmp_path: Path
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run(
        [sys.executable, "-c", _WRAPPER, override, f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [HEADER, f"  {line}", f"imported: {imported}"]
    assert proc.stdout == ""


def test_report_without_docs_writes_next_to_the_results_not_the_shipped_docs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m experiments.report --results DIR`` must not overwrite docs/results.md."""
    import experiments.report as report

    written: list[Path] = []
    monkeypatch.setattr(report, "write_report", lambda results, docs, **kwargs: written.append(docs) or docs)
    with redirect_stdout(io.StringIO()):
        report.main(["--results", str(tmp_path)])
        report.main(["--results", str(tmp_path), "--docs", "docs"])
    assert written == [tmp_path / "report", Path("docs")]


def _raising_engine(monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    def simulate(*args: Any, **kwargs: Any) -> None:
        raise error

    stub = types.ModuleType("experiments.simulate")
    stub.simulate = simulate  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "experiments.simulate", stub)


@pytest.mark.parametrize(
    "error",
    [
        "fedrobust.checkpoint.CheckpointMismatchError: checkpoint ck/round-000003 (round 3) was saved with other "
        "settings: run.client.lr: 0.3 -> 0.2.",
        "fedrobust.strategies.checkpointing.NoValidCheckpointError: no checkpoint in ck verifies (rounds [1, 2])",
        "fedrobust.strategies.errors.AggregationError: round 3: aggregator my_rules.Rule failed on 5 replies: "
        "RuntimeError: boom",
    ],
)
def test_refused_resume_or_a_failing_rule_exits_1_with_one_line(
    error: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import importlib

    where, message = error.split(": ", 1)
    module, _, name = where.rpartition(".")
    _raising_engine(monkeypatch, getattr(importlib.import_module(module), name)(message))
    outcome = _cli([f"hydra.run.dir={tmp_path}"], monkeypatch, real_hydra=True)
    assert outcome.code == 1
    # A rule that raised is a bug in its code: where it is, the traceback shows.
    where = " (HYDRA_FULL_ERROR=1 shows the traceback)" if name == "AggregationError" else ""
    assert outcome.stderr == f"fedrobust: run failed: {message}{where}\n"


@pytest.mark.parametrize(
    "error",
    [
        "fedrobust.dir_lock.DirectoryInUseError: /ck is in use by another run (pid 7 on vm, since 2026-11-26 "
        "10:00:00): two runs ...",
        "fedrobust.strategies.errors.NodesBusyError: 6 nodes connected, but only 0 of the 6 needed "
        "(min_available_nodes) answered the partition query within 120 s; nothing was trained. ...",
    ],
)
def test_a_checkpoint_directory_in_use_or_nodes_too_slow_to_answer_exit_75_with_one_line(
    error: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Temporary: the same command works once the other run has ended, or once the simulation's nodes
    (Ray's workers on a loaded machine) answer in time."""
    import importlib

    where, message = error.split(": ", 1)
    module, _, name = where.rpartition(".")
    _raising_engine(monkeypatch, getattr(importlib.import_module(module), name)(message))
    outcome = _cli([f"hydra.run.dir={tmp_path}"], monkeypatch, real_hydra=True)
    assert outcome.code == 75
    assert outcome.stderr == f"fedrobust: not started: {message}\n"


def test_a_checkpoint_directory_another_run_holds_is_refused_before_the_engine_starts(
    engine_guard: list[Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Found before Ray starts (a minute on a loaded machine), not at the start of training."""
    from fedrobust.dir_lock import DirectoryLock

    held = DirectoryLock(tmp_path / "ck")
    held.acquire()
    try:
        outcome = _cli([f"checkpoint.dir={tmp_path / 'ck'}", f"hydra.run.dir={tmp_path / 'out'}"], monkeypatch,
                       real_hydra=True)
    finally:
        held.release()
    assert outcome.code == 75 and outcome.stderr.startswith(f"fedrobust: not started: {tmp_path / 'ck'} is in use "
                                                            "by another run (another run in this process"), outcome
    assert not engine_guard
    done = _cli([f"checkpoint.dir={tmp_path / 'ck'}", f"hydra.run.dir={tmp_path / 'out2'}"], monkeypatch,
                real_hydra=True)
    assert done.code == 0 and len(engine_guard) == 1, done  # once free, the engine starts


@pytest.mark.parametrize(
    ("ckpt_dir", "says"),
    [("", "no checkpoint (checkpoint.dir is empty)"), ("ck", "no checkpoint (no round had completed)")],
)
def test_stop_before_any_checkpoint_says_so(
    ckpt_dir: str, says: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from fedrobust.strategies.errors import EXIT_PREEMPTED, Preempted

    _raising_engine(monkeypatch, Preempted("stopped while waiting for nodes", checkpointed=False))
    outcome = _cli(
        [f"checkpoint.dir={tmp_path / ckpt_dir if ckpt_dir else ''}", f"hydra.run.dir={tmp_path}"],
        monkeypatch,
        real_hydra=True,
    )
    assert outcome.code == EXIT_PREEMPTED
    assert f"stopped while waiting for nodes; {says}: the same command starts over" in outcome.stdout
    assert "resume" not in outcome.stdout


def test_a_flower_run_config_names_wrong_types_and_wrong_values_in_one_pass(caplog: pytest.LogCaptureFixture) -> None:
    """``flwr run --run-config`` with a value of the wrong type and others out of range: every problem in the
    first run, not the type errors first and the rest after they are fixed. A check that would be about the
    default put in place of a refused value (f against the rule, for a refused num_byzantine) is left out."""
    from fedrobust.config import ConfigError, RunConfig
    from fedrobust.strategies.server_app import checked_run_config

    flat = {**RunConfig().to_flat(), "signing.require": "yes", "client.lr": -0.1, "aggregator.name": "krun"}
    with pytest.raises(ConfigError) as info:
        checked_run_config(flat)
    keys = [line.split("=")[0] for line in info.value.problems]
    assert keys[0] == "signing.require" and sorted(keys[1:]) == ["aggregator.name", "client.lr"], keys
    assert "fedrobust: invalid configuration:" in caplog.text

    refused_f = {**RunConfig().to_flat(), "num_byzantine": "four", "clients_per_round": 5, "num_clients": 5}
    with pytest.raises(ConfigError) as info:
        checked_run_config(refused_f)
    assert info.value.problems == ["num_byzantine=four: must be an integer"]


@pytest.mark.parametrize("override", ["aggregator=krumm", "attack=sign_flipp", "partition=dirich", "model=cnnn"])
def test_a_misspelled_group_choice_names_the_choices(override: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hydra's own answer is some 30 lines (the search path, every option) and exit 1."""

    def composed() -> None:
        pytest.fail("Hydra was started")

    monkeypatch.setattr(run, "main", composed)
    group = override.split("=")[0]
    outcome = _cli([override], monkeypatch)
    meant = {"aggregator": "krum", "attack": "sign_flip", "partition": "dirichlet", "model": "cnn"}[group]
    _assert_one_problem(outcome, f"{override}: ",
                        f"unknown choice (did you mean {meant!r}?); valid choices in {group}: ")
    choices = outcome.stderr.split(f"valid choices in {group}: ")[1].split(", ")
    assert [c.strip() for c in choices] == sorted(p.stem for p in (run.CONF_DIR / group).glob("*.yaml"))


def test_under_flwr_run_a_refused_config_is_its_lines_without_flowers_traceback() -> None:
    """Flower logs a ServerApp's exception with its traceback under fedrobust's own lines; for the errors
    fedrobust says in one line (here a refused config) the traceback goes, for any other error it stays."""
    import io
    import logging

    from flwr.app import Context, RecordDict
    from flwr.common.logger import log as flower_log

    from fedrobust.config import ConfigError
    from fedrobust.strategies.server_app import make_server_app

    app = make_server_app()  # as pyproject.toml's serverapp: the run config comes from Flower
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={"client.lr": -0.1})
    with pytest.raises(ConfigError) as refused:
        app(None, context)  # type: ignore[arg-type]  # the config is refused before the grid is used
    seen = io.StringIO()
    handler = logging.StreamHandler(seen)
    logging.getLogger("flwr").addHandler(handler)
    try:
        flower_log(logging.ERROR, "ServerApp raised an exception", exc_info=refused.value)  # what Flower runs
        assert seen.getvalue() == "ServerApp raised an exception\n"
        try:
            raise KeyError("a bug")
        except KeyError as bug:
            flower_log(logging.ERROR, "ServerApp raised an exception", exc_info=bug)
        assert "Traceback (most recent call last)" in seen.getvalue() and "KeyError: 'a bug'" in seen.getvalue()
    finally:
        logging.getLogger("flwr").removeHandler(handler)


def test_under_flwr_run_in_simulation_a_device_this_machine_lacks_is_refused_before_round_1() -> None:
    """Flower's simulation runs the ClientApps here: client.device=cuda:99 is refused by the ServerApp, as by
    experiments.run, instead of failing in every ClientApp of round 1. (On a deployment, an HttpGrid, the
    devices are the SuperNodes' own and are not judged here.)"""
    from flwr.app import Context, RecordDict

    from fedrobust.config import ConfigError
    from fedrobust.strategies.server_app import make_server_app

    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={"client.device": "cuda:99"})
    with pytest.raises(ConfigError) as refused:
        make_server_app()(None, context)  # type: ignore[arg-type]  # no grid: an in-memory one, as in simulation
    assert [p.split(":")[0] for p in refused.value.problems] == ["client.device=cuda"]


def test_force_resume_without_a_checkpoint_dir_is_refused(
    engine_guard: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asking to force a resume with no checkpoints to resume from is a slip: said, in both entry points."""
    outcome = _cli(["checkpoint.force_resume=true", "num_rounds=1"], monkeypatch)
    _assert_one_problem(outcome, "checkpoint.force_resume=true: ", "needs checkpoint.dir; without checkpoints")
    assert not engine_guard
    from fedrobust import RobustStrategy

    with pytest.raises(ValueError, match="^force_resume=True needs checkpoint_dir: without checkpoints"):
        RobustStrategy(force_resume=True)


def test_output_dir_on_the_hydra_command_line_points_at_hydra_run_dir(
    engine_guard: list[Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """output_dir is where fedrobust's ServerApp writes under flwr run; experiments.run writes to Hydra's run
    folder, so an output_dir there would be checked and then not used: refused, naming what to set."""
    outcome = _cli([f"output_dir={tmp_path}/out", "num_rounds=1"], monkeypatch)
    _assert_one_problem(outcome, f"output_dir={tmp_path}/out: ",
                        f"experiments.run writes its outputs to Hydra's run folder: set hydra.run.dir={tmp_path}/out "
                        "(hydra.sweep.dir with -m); output_dir is for flwr run")
    assert not engine_guard and not (tmp_path / "out").exists()
    # Under flwr run fedrobust's ServerApp writes there: a file in its place is refused.
    from fedrobust.strategies.server_app import checked_run_config

    (tmp_path / "afile").write_text("")
    with pytest.raises(run.ConfigError) as refused:
        checked_run_config({**RunConfig().to_flat(), "output_dir": str(tmp_path / "afile")})
    assert refused.value.problems == [
        f"output_dir={tmp_path / 'afile'}: must be a directory (a file of that name exists)"]


@pytest.mark.parametrize(
    ("settings", "line"),
    [
        ({"aggregator.name": "median"}, "aggregator.pre=clipping+nnm: aggregator.pre separates its names with commas: "
         "aggregator.pre='clipping,nnm' (quoted for Hydra), or name the whole pipeline: "
         "aggregator.name=clipping+nnm+median"),
        # The default pipeline has an nnm already: the whole name would be refused, so it is not offered.
        ({}, "aggregator.pre=clipping+nnm: aggregator.pre separates its names with commas: "
         "aggregator.pre='clipping,nnm' (quoted for Hydra)"),
        # With _target_ the name is not read: naming the pipeline would drop the stages.
        ({"aggregator._target_": "tests.unit.test_config_errors._median_rule"},
         "aggregator.pre=clipping+nnm: aggregator.pre separates its names with commas: "
         "aggregator.pre='clipping,nnm' (quoted for Hydra)"),
    ],
    ids=["named-rule", "default-pipeline", "target"],
)
def test_a_pipeline_in_aggregator_pre_is_answered_with_a_fix_that_works(settings: dict[str, str], line: str) -> None:
    from fedrobust.config import from_flat
    from fedrobust.run_setup import config_problems

    problems = config_problems(from_flat({"aggregator.pre": "clipping+nnm", **settings}))
    assert [p for p in problems if p.startswith("aggregator.pre=clipping+nnm: aggregator.pre separates")] == [line]


def test_stages_listed_in_front_of_a_named_pipeline_get_an_example_only_where_it_is_valid() -> None:
    from fedrobust.config import from_flat
    from fedrobust.run_setup import config_problems

    def said(pre: str, name: str) -> list[str]:
        problems = config_problems(from_flat({"aggregator.pre": pre, "aggregator.name": name}))
        return [p.split(": ", 1)[1] for p in problems if "already names its pre-aggregators" in p]

    assert said("clipping", "nnm+trimmed_mean") == [
        "aggregator.name='nnm+trimmed_mean' already names its pre-aggregators; name the whole pipeline in "
        "aggregator.name (e.g. 'clipping+nnm+trimmed_mean'), or set aggregator.name to a bare rule"]
    assert said("clipping,nnm", "nnm+trimmed_mean") == [  # nnm twice would be refused: no example
        "aggregator.name='nnm+trimmed_mean' already names its pre-aggregators; name the whole pipeline in "
        "aggregator.name, each stage once, or set aggregator.name to a bare rule"]


def _median_rule(f: int) -> Any:
    return lambda updates: updates.median(dim=0).values
