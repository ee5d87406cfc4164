"""Components by ``_target_``: a user's model, data set and rule from a module outside the package.

The module is examples/user-components/my_components.py (the documented example) copied into a
temporary directory under another name, plus a few broken components. Fast tests check building,
partitioning and that bad targets fail in validation with a message naming what is wrong; the slow
ones train with them in a Hydra-composed experiment and under ``flwr run``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fedrobust import aggregators, components
from fedrobust.config import (
    APP_PYPROJECTS,
    ConfigError,
    RunConfig,
    from_flat,
    replace_run_config_block,
)
from fedrobust.run_setup import byzantine_partitions, validate
from tests.support.user_code import copy_example

REPO = Path(__file__).resolve().parents[2]
MODULE = "fr_user_components"  # not a name of anything installed
BROKEN = '''

class WrongLogits(Net):
    """Builds, but returns 3 logits whatever the data set has."""

    def forward(self, x):
        return super().forward(x)[:, :3]


def only_train(seed=0):
    return load(seed)[0]


class WrongShape(CoordinateMedian):
    def __call__(self, updates):
        return updates[:2]


class KeepsClosest(CoordinateMedian):
    """Averages the n - f rows closest to the median and names the others."""

    def __call__(self, updates):
        distance = (updates - super().__call__(updates)).norm(dim=1)
        keep = distance.argsort()[: updates.shape[0] - self.f]
        self.last_excluded = sorted(set(range(updates.shape[0])) - set(keep.tolist()))
        return updates[keep].mean(0)


class NamesNonsense(CoordinateMedian):
    last_excluded = ["first"]


class Raises(CoordinateMedian):
    def __call__(self, updates):
        raise RuntimeError("boom")


class Counted(CoordinateMedian):
    calls = 0

    def __call__(self, updates):
        type(self).calls += 1
        return super().__call__(updates)


def hf_load(seed=0):
    import datasets

    train, test = load(seed)
    table = lambda ds: datasets.Dataset.from_dict({"x": ds.tensors[0].numpy(), "label": ds.tensors[1].numpy()})
    return table(train), table(test)
'''


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_example(tmp_path_factory.mktemp("user_code"), "my_components.py", MODULE, BROKEN)


@pytest.fixture()
def on_path(user_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(user_dir))
    return user_dir


def _targets(**extra: object) -> dict[str, object]:
    return {
        "num_clients": 5,
        "clients_per_round": 5,
        "num_byzantine": 1,
        "model._target_": f"{MODULE}.Net",
        "dataset._target_": f"{MODULE}.load",
        "aggregator._target_": f"{MODULE}.CoordinateMedian",
        **extra,
    }


def test_user_components_validate_build_and_partition(on_path: Path) -> None:
    cfg = validate(from_flat(_targets(**{"partition.name": "dirichlet", "model.params": {"hidden": 8}})))
    spec = components.dataset_spec(cfg)
    assert spec.input_shape == (64,) and spec.num_classes == 10
    net = components.build_model(cfg.model, spec)
    assert net(torch.zeros(3, 64)).shape == (3, 10) and net.body[1].out_features == 8  # params reached it
    train = components.user_data(cfg).train
    parts = [components.load_partition(cfg, i, 5) for i in range(5)]
    assert sum(len(p) for p in parts) == len(train)  # flwr-datasets' partitioner split it all
    assert len({len(p) for p in parts}) > 1  # dirichlet: unequal shares
    again = components.load_partition(cfg, 2, 5)
    assert torch.equal(again.tensors[0], parts[2].tensors[0])  # the same partition every round
    agg = aggregators.build(cfg.aggregator._target_, f=1, pre=["nnm"])
    assert agg.min_n() == 3 and agg(torch.randn(5, 7)).shape == (7,)


def test_a_user_rule_is_contract_checked_once_per_process_not_at_each_build(on_path: Path) -> None:
    """A run validates its config at the command line, in the simulation and in the ServerApp, then builds
    its strategy: a slow rule pays its check once. What differs, or was reloaded, is checked again."""
    import importlib

    from fedrobust import RobustStrategy

    module = importlib.import_module(MODULE)
    module.Counted.calls = 0
    cfg = from_flat(_targets(**{"aggregator._target_": f"{MODULE}.Counted"}))
    validate(cfg)
    validate(cfg)
    RobustStrategy(aggregator=f"{MODULE}.Counted", num_byzantine=1, progress=False)
    assert module.Counted.calls == 1
    aggregators.build(f"{MODULE}.Counted", f=2)  # another f: another check
    assert module.Counted.calls == 2
    reloaded = importlib.reload(module)  # the user edited the rule: a new class, checked again
    reloaded.Counted.calls = 0
    aggregators.build(f"{MODULE}.Counted", f=1)
    assert reloaded.Counted.calls == 1
    for _ in range(2):  # a failed check is not remembered
        with pytest.raises(ValueError, match="boom"):
            aggregators.build(f"{MODULE}.Raises", f=1)


def _row_set(ds: torch.utils.data.TensorDataset) -> set[tuple[float, ...]]:
    x, y = ds.tensors
    return {(*row, float(label)) for row, label in zip(x.tolist(), y.tolist(), strict=True)}


@pytest.mark.parametrize("dataset", [{}, {"dataset._target_": ""}], ids=["user loader", "digits"])
def test_validation_hold_out_is_what_the_server_evaluates_on_and_no_client_holds(
    on_path: Path, dataset: dict[str, str]
) -> None:
    cfg = validate(from_flat(_targets(**{"dataset.validation_fraction": 0.25, "partition.name": "dirichlet"},
                                      **dataset)))
    held = components.load_validation_set(cfg)
    parts = [components.load_partition(cfg, i, 5) for i in range(5)]
    whole = components.load_partition(from_flat(_targets(**dataset)), 0, 1)  # no hold-out: the training set
    assert abs(len(held) - 0.25 * len(whole)) <= 10  # per class round(0.25 * count)
    assert sum(len(p) for p in parts) + len(held) == len(whole)
    union = set().union(*(_row_set(p) for p in parts))
    assert not union & _row_set(held) and union | _row_set(held) == _row_set(whole)
    # The server evaluates on the hold-out; the test set is used only without one.
    assert torch.equal(components.load_evaluation_set(cfg).tensors[1], held.tensors[1])
    no_holdout = from_flat(_targets(**dataset))
    assert torch.equal(components.load_evaluation_set(no_holdout).tensors[1],
                       components.load_test_set(no_holdout).tensors[1])


def test_hugging_face_dataset_protocol(on_path: Path) -> None:
    cfg = validate(from_flat(_targets(**{"dataset._target_": f"{MODULE}.hf_load", "seed": 3})))
    torch_cfg = from_flat(_targets(seed=3))
    assert torch.equal(components.load_test_set(cfg).tensors[1], components.load_test_set(torch_cfg).tensors[1])


def test_library_api_takes_a_dotted_path_or_a_callable(on_path: Path) -> None:
    from fedrobust import RobustStrategy

    module = __import__(MODULE)
    for rule in (f"{MODULE}.CoordinateMedian", module.CoordinateMedian):
        strategy = RobustStrategy(aggregator=rule, num_byzantine=1)
        rows = torch.tensor([[0.0, 1.0], [1.0, 2.0], [2.0, 3.0], [3.0, 4.0], [100.0, -100.0]])
        assert torch.equal(strategy.aggregator(rows), torch.tensor([2.0, 2.0]))
    with pytest.raises(ValueError, match="contract check.*returned shape"):
        RobustStrategy(aggregator=module.WrongShape, num_byzantine=1)


def test_a_rule_whose_state_holds_other_than_tensors_is_refused_before_any_round() -> None:
    """state_dict() is read before every round (a rollback's snapshot): a plain number in it failed at the
    start of round 1 with an AttributeError; the contract check names it."""
    from fedrobust import RobustStrategy

    class CountsCalls:
        def __init__(self) -> None:
            self.calls = 0

        def __call__(self, updates: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return updates.median(dim=0).values

        def state_dict(self) -> dict[str, object]:
            return {"calls": self.calls}

        def load_state_dict(self, state: dict[str, object]) -> None:
            self.calls = int(state["calls"])  # type: ignore[call-overload]

    with pytest.raises(ValueError, match=r"contract check: state_dict\(\) must map names to torch tensors "
                                         r"\(checkpoints and rollbacks keep them\); 'calls' is of type int"):
        RobustStrategy(aggregator=CountsCalls(), num_byzantine=1, progress=False)

    class CountsCallsInATensor(CountsCalls):
        def state_dict(self) -> dict[str, object]:
            return {"calls": torch.tensor(self.calls)}

    RobustStrategy(aggregator=CountsCallsInATensor(), num_byzantine=1, progress=False)  # as the contract says


def test_a_user_rule_names_the_rows_it_gave_no_weight(on_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    module = __import__(MODULE)
    rows = torch.tensor([[0.0, 1.0], [1.0, 2.0], [2.0, 3.0], [3.0, 4.0], [100.0, -100.0]])
    rule = aggregators.build(f"{MODULE}.KeepsClosest", f=1)
    torch.testing.assert_close(rule(rows), rows[:4].mean(0))
    assert rule.last_excluded == (4,)
    after_direction = aggregators.build(f"{MODULE}.KeepsClosest", f=1, pre=["direction"])
    after_direction(torch.cat([rows[:4], -rows[3:4], rows[4:]]))  # row 4 reverses the others: filtered
    assert (after_direction.last_filtered, after_direction.last_excluded) == ((4,), (5,))
    nonsense = aggregators.build(module.NamesNonsense, f=1)
    with caplog.at_level("WARNING"):
        torch.testing.assert_close(nonsense(rows), rows.median(0).values)  # the round goes on
    assert nonsense.last_excluded == () and "last_excluded=['first'] is not a collection of row indices" in caplog.text


@pytest.mark.parametrize(
    "overrides,problem",
    [
        (
            {"model._target_": "fr_no_such_pkg.models.Net"},
            r"model\._target_=fr_no_such_pkg\.models\.Net: cannot import .*No module named 'fr_no_such_pkg'",
        ),
        (
            {"model._target_": f"{MODULE}.Nett"},
            rf"model\._target_={MODULE}\.Nett: .*'{MODULE}' has no attribute 'Nett'",
        ),
        (
            {"model.params": {"hiddn": 8}},
            r"model\._target_=.*Net\(input_shape, num_classes, hidden=32\) cannot be called with .*hiddn",
        ),
        ({"model._target_": f"{MODULE}.WrongLogits"}, r"model\._target_=.*WrongLogits: .*expected logits \[2, 10\]"),
        ({"dataset._target_": f"{MODULE}.only_train"}, r"dataset\._target_=.*only_train: .*expected \(train, test\)"),
        (
            {"dataset._target_": f"{MODULE}.load", "dataset.params": {"fraction": 0.5}},
            r"dataset\._target_=.*load: load\(seed=0, test_fraction=0\.2\) cannot be called with .*fraction",
        ),
        (
            {"aggregator._target_": f"{MODULE}.WrongShape"},
            r"aggregator\._target_=.*WrongShape: .*contract check.*returned shape \(2, 5\)"
            r".*must return a floating-point \[d\]",
        ),
        ({"aggregator._target_": f"{MODULE}.Raises"}, r"aggregator\._target_=.*Raises: .*raised RuntimeError: boom"),
        (
            {"aggregator.params": {"tau": 1.0}},
            r"aggregator\._target_=.*CoordinateMedian: CoordinateMedian\(f=0\) cannot be called with .*tau",
        ),
        ({"aggregator._target_": "torch.nn"}, r"aggregator\._target_=torch\.nn: .*not callable"),
    ],
)
def test_bad_target_fails_in_validation_naming_it(on_path: Path, overrides: dict, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(from_flat(_targets(**overrides)))
    assert any(re.search(problem, line) for line in err.value.problems), err.value.problems


def test_builtins_keep_their_short_names() -> None:
    cfg = validate(from_flat({"model.name": "mlp", "aggregator.name": "krum", "num_byzantine": 1}))
    assert components.dataset_spec(cfg).num_classes == 10
    assert aggregators.build(cfg.aggregator.name, f=1).name == "krum"


# ------------------------------------------------------------------ one source of truth, safe defaults
def test_pyproject_run_config_is_generated_from_run_config() -> None:
    """Both apps' [tool.flwr.app.config] are what `python -m fedrobust.config --pyproject` writes."""
    from flwr.common.config import flatten_dict

    for name in APP_PYPROJECTS:
        text = (REPO / name).read_text()
        assert replace_run_config_block(text) == text, f"{name}: run `python -m fedrobust.config --pyproject`"
        flat = flatten_dict(tomllib.loads(text)["tool"]["flwr"]["app"]["config"])
        assert from_flat(flat) == RunConfig(), name


def test_config_check_alone_checks_the_apps_files_and_names_a_stale_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedrobust.config import _main

    monkeypatch.chdir(REPO)
    assert _main(["--check"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{name}: up to date" for name in APP_PYPROJECTS]
    stale = tmp_path / "pyproject.toml"
    stale.write_text((REPO / APP_PYPROJECTS[0]).read_text().replace("\"num_rounds\" = 20", "\"num_rounds\" = 21", 1))
    assert _main(["--check", "--pyproject", str(stale)]) == 1
    assert "run config differs from RunConfig's defaults" in capsys.readouterr().out


def test_hydra_default_experiment_is_run_config_defaults() -> None:
    from tests.unit.test_config import _compose

    assert _compose() == RunConfig()


def test_shipped_flwr_app_has_no_byzantine_clients() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    app = project["tool"]["flwr"]["app"]
    cfg = from_flat(app["config"])
    assert cfg.attack.name == "none" and byzantine_partitions(cfg) == frozenset()
    assert cfg.num_byzantine > 0  # a tolerance, not attackers
    assert app["components"]["clientapp"] == "fedrobust.clients.client_app:app"  # the honest app
    drill = tomllib.loads((REPO / "examples" / "byzantine-drill" / "pyproject.toml").read_text())
    assert drill["tool"]["flwr"]["app"]["components"]["clientapp"] == "fedrobust.clients.byzantine_app:app"


def test_fab_ships_only_what_runs(tmp_path: Path) -> None:
    import io
    import zipfile

    from flwr.cli.build import build_fab_from_disk

    from tests.support.flower_processes import app_copy

    fab = build_fab_from_disk(REPO)
    # The slow tests run `flwr run` on such a copy: the same FAB, without walking .venv.
    assert build_fab_from_disk(app_copy(REPO, tmp_path / "app")) == fab
    names = zipfile.ZipFile(io.BytesIO(fab)).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"pyproject.toml", ".info", "fedrobust", "strategies", "clients"}, tops
    assert "clients/byzantine_app.py" in names and len(fab) < 1_500_000, len(fab)


# ------------------------------------------------------------------ slow: real runs
@pytest.mark.slow
def test_honest_app_ignores_attack_config(tmp_path: Path) -> None:
    """The shipped ClientApp with attack=sign_flip in run and node config trains as attack=none does."""
    from experiments.inprocess import run_inprocess
    from fedrobust.clients.client_app import make_client_app
    from tests.support.simulation import small_config

    attacked = small_config(tmp_path / "a", **{"attack.name": "sign_flip", "aggregator.name": "mean"})
    honest = small_config(tmp_path / "b", **{"attack.name": "none", "aggregator.name": "mean"})
    run_inprocess(attacked, Path(attacked.output_dir), client_app=make_client_app(attacked, byzantine=False))
    run_inprocess(honest, Path(honest.output_dir))
    played = small_config(tmp_path / "c", **{"attack.name": "sign_flip", "aggregator.name": "mean"})
    run_inprocess(played, Path(played.output_dir))  # make_client_app(cfg): a simulation plays the attack
    model = lambda c: (Path(c.output_dir) / "final_model.safetensors").read_bytes()  # noqa: E731
    assert model(attacked) == model(honest) != model(played)


@pytest.mark.slow
def test_user_components_train_in_a_hydra_experiment(on_path: Path, tmp_path: Path) -> None:
    from experiments.inprocess import run_inprocess
    from tests.unit.test_config import _compose

    cfg = validate(
        _compose(
            "num_clients=5",
            "clients_per_round=5",
            "num_rounds=3",
            "num_byzantine=1",
            "attack=sign_flip",
            f"model._target_={MODULE}.Net",
            f"dataset._target_={MODULE}.load",
            f"aggregator._target_={MODULE}.CoordinateMedian",
            "+model.params.hidden=32",
            f"output_dir={tmp_path / 'out'}",
        )
    )
    assert cfg.model.params == {"hidden": 32}
    rows = run_inprocess(cfg, tmp_path / "out")
    assert len(rows) == 3 and rows[-1]["accuracy"] > 0.5, rows  # chance: 0.1; 0.71 with this seed
    resolved = json.loads((tmp_path / "out" / "resolved_config.json").read_text())
    assert resolved["aggregator"]["_target_"].endswith("CoordinateMedian")
    # The built-in names the targets stand in for are not recorded as if they had run.
    assert [resolved[s]["name"] for s in ("aggregator", "dataset", "model")] == [None, None, None]


def _experiment_command(
    run_dir: Path, *overrides: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m experiments.run overrides`` as a user types it, its output captured."""
    command = [sys.executable, "-m", "experiments.run", *overrides, f"hydra.run.dir={run_dir}"]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.slow
def test_bad_target_exits_before_the_run_on_the_command_line(tmp_path: Path) -> None:
    res = _experiment_command(tmp_path, "model._target_=fr_no_such_pkg.Net")
    assert res.returncode == 2, res.stderr
    assert "model._target_=fr_no_such_pkg.Net: cannot import" in res.stderr


@pytest.mark.slow(seconds=45)
def test_a_sweep_job_that_fails_leaves_the_others_to_run_and_the_sweep_exits_1(tmp_path: Path) -> None:
    """Job 0's clients diverge at lr=50 (every reply non-finite: no round aggregates), job 1 trains: the
    sweep runs both, then names the failed job and exits 1 (Hydra's launcher would stop at job 0)."""
    command = [sys.executable, "-m", "experiments.run", "-m", "num_rounds=2", "num_clients=6", "num_byzantine=1",
               "fault.max_round_retries=0", "client.lr=50,0.3", f"hydra.sweep.dir={tmp_path}"]
    res = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stdout + res.stderr
    failed = [line.strip() for line in res.stderr.splitlines() if line.startswith("  job ")]
    assert len(failed) == 1 and failed[0].startswith("job 0 (client.lr=50,"), res.stderr
    assert "fedrobust: 1 job of the sweep failed:" in res.stderr
    assert not (tmp_path / "0" / "final.json").exists()
    final = json.loads((tmp_path / "1" / "final.json").read_text())
    assert final["rounds"] == 2 and 0 < final["accuracy"] <= 1 and final["loss"] > 0, final
    # The finished jobs together at the end, with the final figures of job 1's final.json.
    summary = res.stdout.split("fedrobust: the sweep's 1 finished job:\n", 1)[1].splitlines()[0].strip()
    assert summary.startswith("job 1 (client.lr=0.3,") and f"accuracy {final['accuracy']:.4f}, loss " \
        f"{final['loss']:.4f} after 2 rounds ({tmp_path / '1'})" in summary, summary
    assert (tmp_path / "1" / "rounds.png").read_bytes().startswith(b"\x89PNG")  # the run's picture
    assert not (tmp_path / "0" / "rounds.png").exists()


@pytest.mark.slow
def test_a_dataset_that_cannot_be_read_fails_before_the_engine_starts(tmp_path: Path) -> None:
    """Offline without a local copy of MNIST: one line that says what to do, before Ray is started."""
    import os

    from fedrobust import data

    env = {k: v for k, v in os.environ.items() if k != data.DATA_DIR_ENV}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    res = _experiment_command(tmp_path / "run", "dataset=mnist", env=env)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert "fedrobust: run failed: dataset mnist: could not read ylecun/mnist" in out and data.DATA_DIR_ENV in out
    assert "Ray instance" not in out, out  # Ray logs "Started a local Ray instance." when it starts


@pytest.mark.slow(seconds=30)
@pytest.mark.timeout(360)
def test_user_components_train_under_flwr_run(user_dir: Path, tmp_path: Path) -> None:
    """The project's app under `flwr run` (on app_copy: the FAB of `flwr run .`) on a local simulation
    SuperLink, the user's module on the nodes' PYTHONPATH; stopping the SuperLink ends all it started."""
    import os

    from tests.process.test_flwr_run import FEDERATION, _run_status, _state
    from tests.support.flower_processes import FlowerProcesses, app_copy, descendants, executable, write_flwr_home
    from tests.support.simulation import federation_options

    out = tmp_path / "out"
    with FlowerProcesses(tmp_path) as fp:
        path = os.pathsep.join(p for p in (str(user_dir), os.environ.get("PYTHONPATH", "")) if p)
        link = fp.start_superlink(simulation=True, env=fp.env({"PYTHONPATH": path}))
        write_flwr_home(
            tmp_path,
            FEDERATION,
            link.address,
            options=federation_options(5),
        )
        run_config = (
            f"num_rounds=3 num_clients=5 clients_per_round=5 num_byzantine=1 output_dir='{out}' "
            f"model._target_='{MODULE}.Net' dataset._target_='{MODULE}.load' "
            f"aggregator._target_='{MODULE}.CoordinateMedian'"
        )
        started = time.monotonic()
        res = subprocess.run(
            [executable("flwr"), "run", str(app_copy(REPO, tmp_path / "app")), FEDERATION, "--stream",
             "--run-config", run_config],
            cwd=REPO,
            env=fp.env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        report = f"flwr run ({time.monotonic() - started:.0f}s):\n{res.stdout}\n{res.stderr}\n{fp.tails()}"
        assert res.returncode == 0, report
        match = re.search(r"Successfully started run (\d+)", res.stdout)
        assert match, report
        assert _run_status(fp, int(match.group(1))).endswith("completed"), report
        tree = {link.pid} | {pid for pid, _ in descendants(link.pid)}
        fp.stop(link)
    # Stopping the SuperLink ends everything it started (SuperExec, flwr-simulation, Ray's processes).
    left = [pid for pid in tree if Path(f"/proc/{pid}").exists() and _state(pid) != "Z"]
    assert not left, f"processes of the SuperLink still running: {left}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["round"] for r in rows] == [1, 2, 3] and rows[-1]["accuracy"] > 0.5, rows  # chance: 0.1
    resolved = json.loads((out / "resolved_config.json").read_text())
    assert resolved["model"]["_target_"] == f"{MODULE}.Net"


def test_a_rule_built_already_takes_no_parameters_and_its_own_f_is_said(caplog: pytest.LogCaptureFixture) -> None:
    from fedrobust import RobustStrategy

    class TrimByNorm:
        def __init__(self, f: int = 0, keep: float = 0.5) -> None:
            self.f, self.keep = f, keep

        def __call__(self, updates: torch.Tensor) -> torch.Tensor:
            order = updates.norm(dim=1).argsort()
            return updates[order[: max(1, int(len(updates) * self.keep))]].mean(0)

    def median(updates: torch.Tensor) -> torch.Tensor:
        return updates.median(dim=0).values

    for built in (TrimByNorm(f=1), median):  # a message that named a missing 'updates' argument before
        with pytest.raises(ValueError, match=r"is called with the updates, not built: aggregator parameters "
                                             r"\['keep'\] apply to a class or a factory"):
            RobustStrategy(aggregator=built, aggregator_params={"keep": 0.1}, num_byzantine=1)
    RobustStrategy(aggregator=TrimByNorm, aggregator_params={"keep": 0.4}, num_byzantine=2)  # the class takes them

    def make_clipped_mean(clip: float) -> Callable[[torch.Tensor], torch.Tensor]:  # a factory of one setting
        return lambda rows: rows.clamp(-clip, clip).mean(0)

    RobustStrategy(aggregator=make_clipped_mean, aggregator_params={"clip": 0.5}, num_byzantine=1)
    RobustStrategy(aggregator=TrimByNorm(f=0), num_byzantine=3)
    said = [r.getMessage() for r in caplog.records if "was built with f=" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith("was built with f=0, but num_byzantine=3: the rule tolerates 0 "
                                               "faulty rows; build it with f=3 or give its class")
