"""The study pipeline: in-process transport, sweep, report.

The in-process transport runs the production server and ClientApp; these tests
check that it is deterministic, that a failing ClientApp becomes an error reply
as on Flower's engine, and that a small sweep produces results, a report and a
measurable effect of an attack.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from experiments.inprocess import InProcessGrid, _server_identity, node_ids_for, run_inprocess
from experiments.report import write_report
from experiments.study import OK, RunSpec, compose, overrides_for, run_study
from fedrobust.config import from_flat

pytestmark = pytest.mark.slow


def _small_config(**overrides):
    return from_flat(
        {
            "num_clients": 6,
            "clients_per_round": 6,
            "num_byzantine": 1,
            "num_rounds": 2,
            "aggregator.name": "median",
            "attack.name": "alie",  # omniscient: exercises the server-side hook too
            "liveness.quarantine_after": 0,
            **overrides,
        }
    )


def test_two_inprocess_runs_give_identical_final_model_bytes(tmp_path: Path) -> None:
    cfg = _small_config()
    rows_a = run_inprocess(cfg, tmp_path / "a")
    rows_b = run_inprocess(cfg, tmp_path / "b")
    model_a = (tmp_path / "a" / "final_model.safetensors").read_bytes()
    model_b = (tmp_path / "b" / "final_model.safetensors").read_bytes()
    assert len(rows_a) == len(rows_b) == cfg.num_rounds
    assert model_a == model_b
    assert [r["accuracy"] for r in rows_a] == [r["accuracy"] for r in rows_b]
    # A different seed is a different run (the check above is not vacuous).
    run_inprocess(_small_config(seed=1), tmp_path / "c")
    assert (tmp_path / "c" / "final_model.safetensors").read_bytes() != model_a


def test_grid_turns_a_raising_clientapp_into_an_error_reply() -> None:
    app = ClientApp()

    @app.query()
    def hello(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"info": ConfigRecord({"partition-id": context.node_config["partition-id"]})}),
                       reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        raise RuntimeError(f"boom on partition {context.node_config['partition-id']}")

    grid = InProcessGrid(app, 3, seed=7)
    assert list(grid.get_node_ids()) == node_ids_for(7, 3)
    with _server_identity(grid.run.run_id):
        node = list(grid.get_node_ids())[1]
        query = Message(RecordDict({}), dst_node_id=node, message_type=MessageType.QUERY)
        train_msg = Message(RecordDict({}), dst_node_id=node, message_type=MessageType.TRAIN)
        ids = list(grid.push_messages([query, train_msg]))
        replies = {r.metadata.reply_to_message_id: r for r in grid.pull_messages(ids)}
    assert len(ids) == 2 and set(replies) == set(ids)
    ok, failed = replies[ids[0]], replies[ids[1]]
    assert not ok.has_error() and ok.content["info"]["partition-id"] == 1
    assert ok.metadata.src_node_id == node
    assert failed.has_error() and failed.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert "boom on partition 1" in failed.error.reason
    assert list(grid.pull_messages(ids)) == []  # a reply is handed out once


def test_grid_replays_given_nodes_with_their_node_configs() -> None:
    """A deployment's node ids and ``--node-config``s (e.g. device data files) instead of the seed's partitions."""
    app = ClientApp()

    @app.query()
    def hello(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"info": ConfigRecord(dict(context.node_config))}), reply_to=msg)

    nodes = {90210: {"data-path": "/data/a.npz"}, 31337: {"data-path": "/data/b.npz", "device": "cpu"}}
    grid = InProcessGrid(app, 2, seed=7, nodes=nodes)
    assert list(grid.get_node_ids()) == [90210, 31337]
    with _server_identity(grid.run.run_id):
        ids = list(grid.push_messages(
            [Message(RecordDict({}), dst_node_id=n, message_type=MessageType.QUERY) for n in nodes]
        ))
        replies = {r.metadata.src_node_id: dict(r.content["info"]) for r in grid.pull_messages(ids)}
    assert replies == nodes
    with pytest.raises(ValueError, match="2 node configs for 3 nodes"):
        InProcessGrid(app, 3, nodes=nodes)


def test_small_sweep_report_and_the_effect_of_sign_flip(tmp_path: Path) -> None:
    results_dir, docs = tmp_path / "results", tmp_path / "docs"
    kwargs = {
        "rules": ["mean", "median"], "attacks": ["none", "sign_flip"], "partitions": ["iid"], "seeds": [0],
        "rounds": 3, "num_clients": 10, "num_byzantine": 2, "jobs": 1, "out": results_dir, "echo": False,
    }
    results = run_study(**kwargs)
    assert len(results) == 4
    assert all(r["status"] == OK and len(r["rows"]) == 3 for r in results), [r["error"] for r in results]
    assert len(list(results_dir.glob("iid__*__s0.json"))) == 4
    # Resumable: a second invocation finds every result and runs nothing.
    again = run_study(**kwargs)
    assert [r["final_model_sha256"] for r in again] == [r["final_model_sha256"] for r in results]

    report = write_report(results_dir, docs).read_text()
    assert "clients: 3 local epochs of SGD (lr 0.3, momentum 0.9, batch 16)" in report  # as the runs recorded
    table = report.split("## IID: final accuracy, rule x attack", 1)[1].split("![", 1)[0]
    cells = {}
    for line in table.splitlines():
        parts = [p.strip() for p in line.strip().strip("|").split("|")]
        if parts[0] in ("mean", "median"):
            cells[parts[0]] = parts[1:3]
    assert set(cells) == {"mean", "median"}
    number = re.compile(r"^(\d\.\d{3}) \(1 seed\) \(\d\.\d{2}\)$")  # one seed: no spread to give
    assert all(number.match(c) for row in cells.values() for c in row), cells
    for name in ("study_curves_iid.png", "study_heatmap_iid.png"):
        assert (docs / "figures" / name).stat().st_size > 10_000

    final = {(r["rule"], r["attack"]): r["rows"][-1]["accuracy"] for r in results}
    # Two of ten clients sending the reversed update drag the mean back; the median ignores them.
    assert final[("mean", "sign_flip")] < final[("median", "sign_flip")]
    assert final[("mean", "sign_flip")] < final[("mean", "none")]

    # Other settings into the same directory: refused, the results kept; --replace runs them again.
    stored = sorted(p.read_bytes() for p in results_dir.glob("iid__*__s0.json"))
    with pytest.raises(ValueError, match=r"4 finished result\(s\) in .* ran with other overrides, e.g. "
                                         r"iid__mean__none__s0: num_rounds=3 -> num_rounds=2; they are kept"):
        run_study(**{**kwargs, "rounds": 2})
    assert sorted(p.read_bytes() for p in results_dir.glob("iid__*__s0.json")) == stored
    replaced = run_study(**{**kwargs, "rules": ["mean"], "attacks": ["none"], "rounds": 2, "replace": True})
    assert len(replaced) == 1 and len(replaced[0]["rows"]) == 2


def test_rules_with_pre_aggregators_compose_into_their_pipeline() -> None:
    """``<pre>+<pre>+<rule>`` puts the pre-aggregators in front, in order; one pre or none too."""
    specs = {
        rule: RunSpec(partition="dirichlet", rule=rule, attack="backdoor", seed=0)
        for rule in ("trimmed_mean", "nnm+trimmed_mean", "arc+nnm+trimmed_mean")
    }
    specs["optimal"] = RunSpec(partition="iid", rule="winsorize+nnm+trimmed_mean", attack="optimal_alie", seed=0)
    configs = compose({rule: overrides_for(spec, rounds=2) for rule, spec in specs.items()})
    pres = {rule: (cfg.pre_aggregators(), cfg.rule()) for rule, cfg in configs.items()}
    assert pres == {
        "trimmed_mean": ([], "trimmed_mean"),
        "nnm+trimmed_mean": (["nnm"], "trimmed_mean"),
        "arc+nnm+trimmed_mean": (["arc", "nnm"], "trimmed_mean"),
        "optimal": (["winsorize", "nnm"], "trimmed_mean"),
    }
    # An attack tuned to the server's rule is tuned to the whole pipeline.
    assert configs["optimal"].attack.params["rule"] == "winsorize+nnm+trimmed_mean"


def test_report_tools_refuse_directories_and_rules_that_are_not_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A typo'd directory or rule used to give an empty table, or a report whose command named a pilot
    it left out."""
    from experiments import report, worst_case

    shipped = Path(__file__).resolve().parents[2] / "docs" / "results" / "default_choice" / "local_epochs_3" / "main"
    for main, argv, message in (
        (worst_case.main, [str(shipped), "--rules", "krumm"], "no results of krumm in these directories"),
        (report.main, ["--results", str(shipped), "--pilot", str(tmp_path / "nope")], "--pilot"),
    ):
        with pytest.raises(SystemExit) as stopped:
            main(argv)
        assert stopped.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--set", "num_clinets=3"],
         "--set num_clinets=3: unknown key (did you mean 'num_clients'?); valid keys in run config:"),
        (["--set", "client.lr=abc"], "--set client.lr=abc: must be a number"),
        (["--set", "attack.params.scale=4"], "To append to your config use +attack.params.scale=4"),
        (["--jobs", "0"], "jobs must be >= 1, got 0"),
    ],
)
def test_study_arguments_a_user_gets_wrong_are_one_line_each(
    extra: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from experiments import study

    argv = ["--rules", "mean", "--attacks", "sign_flip", "--partitions", "iid", "--seeds", "0", "--rounds", "1",
            "--out", str(tmp_path / "out"), *extra]
    with pytest.raises(SystemExit) as stopped:
        study.main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and message in err and "Traceback" not in err, err
    assert not list((tmp_path / "out").glob("*.json"))  # nothing ran


def test_study_takes_an_attack_by_its_hydra_file_name() -> None:
    from experiments.study import study_attack

    assert study_attack("nan_fill") == "nan" and study_attack("nan") == "nan" and study_attack("mimic") == "mimic"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rule", "krumm", "--setting", "base="], "--rule: rule 'krumm'"),
        (["--setting", "x=num_clinets=3"], "--setting x: num_clinets=3: unknown key"),
        # A wrong value: found before the base setting's runs, not after them.
        (["--setting", "base=", "--setting", "x=client.lr=-1"], "--setting x: client.lr=-1.0: must be > 0"),
        # Read by no run of the tune (fedavg): it would repeat the base setting's runs.
        (["--setting", "base=", "--setting", "m=server_optimizer.momentum=0.5"],
         "--setting m: server_optimizer.momentum=0.5: server_optimizer=fedavg does not use it"),
        (["--setting", "base=", "--report-only"], "--report-only: no results in"),
    ],
)
def test_tune_checks_its_arguments_before_running_anything(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from experiments import tune

    with pytest.raises(SystemExit) as stopped:
        tune.main(["--out", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.startswith("experiments.tune: invalid arguments:") and message in err, err
    assert not list(tmp_path.rglob("*.json"))
