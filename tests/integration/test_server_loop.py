"""The round loop without Flower's engine start-up: divergence rollback, checkpoint refusal and resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from experiments.inprocess import run_inprocess
from fedrobust.checkpoint import CheckpointMismatchError
from fedrobust.run_setup import byzantine_partitions
from fedrobust.strategies.errors import QuorumError
from tests.support.simulation import replace_update, small_config, tampering_client


def test_exploding_round_is_rolled_back_and_retried_with_lower_lr(tmp_path: Path) -> None:
    cfg = small_config(
        tmp_path,
        num_rounds=4,
        num_byzantine=0,
        **{"aggregator.name": "mean", "validation.max_update_norm": 0.0, "guard.lr_decay": 0.5},
    )
    poisoned: list[int] = []

    def tamper(partition: int, server_round: int, reply) -> None:
        # Round 3's first attempt only: every client sends a huge, finite update. No reply is
        # invalid on its own (the norm bound is off), but the averaged model blows up.
        if server_round == 3 and len(poisoned) < cfg.num_clients:
            poisoned.append(partition)
            replace_update(reply, lambda u: {k: v * 1e4 if v.is_floating_point() else v for k, v in u.items()})

    rows = run_inprocess(cfg, Path(cfg.output_dir), client_app=tampering_client(cfg, tamper))
    final = safetensors.torch.load_file(str(Path(cfg.output_dir) / "final_model.safetensors"))

    assert [r["round"] for r in rows] == [1, 2, 3, 4]  # the diverged attempt left no row
    assert [r["rollbacks"] for r in rows] == [0, 0, 1, 1]
    assert rows[2]["loss"] < 10 * min(r["loss"] for r in rows[:2])
    assert all(bool(torch.isfinite(v).all()) for v in final.values() if v.is_floating_point())
    assert len(poisoned) == cfg.num_clients


def test_checkpoint_of_another_configuration_is_refused_unless_forced(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    first = small_config(tmp_path / "a", num_rounds=2, **{"checkpoint.dir": ckpt})
    run_inprocess(first, Path(first.output_dir))

    changed = small_config(tmp_path / "b", num_rounds=3, **{"checkpoint.dir": ckpt, "aggregator.name": "median"})
    with pytest.raises(CheckpointMismatchError, match="force"):
        run_inprocess(changed, Path(changed.output_dir))

    forced = small_config(
        tmp_path / "c",
        num_rounds=3,
        **{"checkpoint.dir": ckpt, "aggregator.name": "median", "checkpoint.force_resume": True},
    )
    rows = run_inprocess(forced, Path(forced.output_dir))
    assert [r["round"] for r in rows] == [1, 2, 3]  # rounds 1-2 restored from the checkpoint, 3 trained

    more_rounds = small_config(
        tmp_path / "d", num_rounds=4, **{"checkpoint.dir": ckpt, "checkpoint.force_resume": True}
    )
    assert [r["round"] for r in run_inprocess(more_rounds, Path(more_rounds.output_dir))] == [1, 2, 3, 4]


def test_a_refused_resume_leaves_the_earlier_run_s_files_alone(tmp_path: Path) -> None:
    """The same output and checkpoint directories, another setting: the resume is refused, and the metrics,
    resolved config and final model there still describe the earlier run."""
    shared = {"checkpoint.dir": str(tmp_path / "ckpt"), "output_dir": str(tmp_path / "out")}
    first = small_config(tmp_path, num_rounds=2, **shared)
    run_inprocess(first, Path(first.output_dir))
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    assert set(before) == {"metrics.jsonl", "resolved_config.json", "final_model.safetensors"}  # no .partial
    mode = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()}
    assert mode["final_model.safetensors"] == mode["metrics.jsonl"], mode  # the umask's, as the other outputs

    changed = small_config(tmp_path, num_rounds=3, **shared, **{"client.lr": 0.2})
    with pytest.raises(CheckpointMismatchError, match=r"client.lr: 0.3 -> 0.2"):
        run_inprocess(changed, Path(changed.output_dir))
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before

    fresh = small_config(tmp_path, num_rounds=1, **shared, **{"checkpoint.resume": "never"})
    rows = run_inprocess(fresh, Path(fresh.output_dir))
    assert [r["round"] for r in rows] == [1]  # a fresh run's metrics start over, without the earlier rows
    # ... and the earlier run's files are set aside whole, not overwritten.
    (aside,) = (tmp_path / "out").glob("aside-*")
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == before
    assert (tmp_path / "out" / "final_model.safetensors").read_bytes() != before["final_model.safetensors"]


def test_a_fresh_run_that_fails_before_training_leaves_an_earlier_run_s_results_whole(tmp_path: Path) -> None:
    """A reused output directory and a run that cannot train (too few nodes answer): the earlier run's
    results are set aside before the failing run writes anything, and no final model is left to say that
    the failed run finished."""
    out = tmp_path / "out"
    first = small_config(tmp_path, num_rounds=1, output_dir=str(out))
    run_inprocess(first, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    failing = small_config(tmp_path, num_rounds=1, output_dir=str(out), **{"fault.wait_for_nodes": 0.5})
    with pytest.raises(QuorumError):
        run_inprocess(failing, out, nodes={0: {"partition-id": 0, "num-partitions": 4}})
    (aside,) = out.glob("aside-*")
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == before
    assert not (out / "final_model.safetensors").exists()


def test_same_config_and_seed_give_the_same_final_model_bytes(tmp_path: Path) -> None:
    # Across Flower's Ray engine and process restarts, see tests/process/test_fault_processes.py.
    outputs = []
    for name in ("a", "b"):
        cfg = small_config(tmp_path / name, num_rounds=3, **{"aggregator.name": "multikrum", "num_byzantine": 0})
        run_inprocess(cfg, Path(cfg.output_dir))
        outputs.append((Path(cfg.output_dir) / "final_model.safetensors").read_bytes())
    assert outputs[0] == outputs[1]
    other = small_config(tmp_path / "c", num_rounds=3, seed=1, **{"aggregator.name": "multikrum", "num_byzantine": 0})
    run_inprocess(other, Path(other.output_dir))
    assert (Path(other.output_dir) / "final_model.safetensors").read_bytes() != outputs[0]


def test_the_run_s_picture_replaces_an_earlier_one_and_a_failure_to_draw_only_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from fedrobust.strategies.server_app import _draw_rounds

    cfg = small_config(tmp_path, num_rounds=2)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True)
    (out / "rounds.png").write_bytes(b"an earlier run's picture")
    run_inprocess(cfg, out, picture=True)
    assert (out / "rounds.png").read_bytes().startswith(b"\x89PNG")

    # Rows the plot cannot read (here: rejected counts that are no mapping) cost a warning, not the run.
    (out / "metrics.jsonl").write_text('{"round": 1, "accepted": 3, "rejected": [1]}\n')
    with caplog.at_level("WARNING"):
        _draw_rounds(out)
    assert "no rounds.png:" in caplog.text


def test_more_nodes_than_num_clients_are_named_before_the_first_round(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A simulation's num-supernodes raised and num_clients left: Flower's fraction_train samples every
    # connected node, and the data is cut by the node count. Said once, before any training.
    from experiments.inprocess import node_ids_for

    cfg = small_config(tmp_path, num_rounds=1, num_clients=4, clients_per_round=4, **{"signing.require": True})
    out = Path(cfg.output_dir)
    six = {node: {"partition-id": i, "num-partitions": 6} for i, node in enumerate(node_ids_for(cfg.seed, 6))}
    with caplog.at_level("WARNING", logger="fedrobust.strategies.server_app"):
        run_inprocess(cfg, out, nodes=six)
    said = [r.getMessage() for r in caplog.records if r.name == "fedrobust.strategies.server_app"]
    assert said == [
        "6 nodes are connected, num_clients=4: each round trains 6 of them (clients_per_round / num_clients of the "
        "connected nodes), not clients_per_round=4, and the simulation cuts the data into 6 shares; signing.require "
        "without a trust_dir has keys for partitions 0-3 only, so the other nodes' replies are refused "
        "(unknown_key). Set num_clients=6 (and clients_per_round), or run 4 nodes"
    ]
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["sampled"] == 6 and row["rejected"] == {"unknown_key": 2}  # what the warning says, as it happens

    caplog.clear()
    with caplog.at_level("WARNING", logger="fedrobust.strategies.server_app"):
        run_inprocess(cfg, tmp_path / "as_many")  # as many nodes as num_clients: nothing to say
    assert not [r for r in caplog.records if r.name == "fedrobust.strategies.server_app"]


def test_the_rows_name_nodes_in_partition_order_whatever_ids_the_nodes_have(tmp_path: Path) -> None:
    # Flower draws node ids anew in each simulation: the rows' lists of nodes follow the partitions (as the
    # update rows do), so two runs of one config write the same lists, partition for partition.
    from experiments.inprocess import node_ids_for

    cfg = small_config(tmp_path, num_rounds=2, num_clients=6, clients_per_round=6, **{"aggregator.name": "krum"})
    ids = node_ids_for(cfg.seed, 6)
    runs = []
    for name, order in (("ascending", sorted(ids)), ("descending", sorted(ids, reverse=True))):
        nodes = {node: {"partition-id": i, "num-partitions": 6} for i, node in enumerate(order)}
        rows = run_inprocess(cfg, tmp_path / name, nodes=nodes)
        runs.append([[e["partition"] for e in row["excluded_nodes"]] for row in rows])
    assert runs[0] == runs[1]
    assert all(len(excluded) == 5 and excluded == sorted(excluded) for excluded in runs[0])  # krum keeps one


def test_a_run_that_ends_at_chance_without_an_attack_is_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A model that does not learn (here: a learning rate that moves nothing) ends at a finite, steady loss of
    # about ln(10), which the divergence guard leaves alone: the end of the run says it.
    cfg = small_config(tmp_path, num_rounds=3, **{"client.lr": 1e-12, "server_optimizer.lr": 1e-12})
    with caplog.at_level("WARNING", logger="fedrobust.strategies.server_app"):
        rows = run_inprocess(cfg, tmp_path / "still")
    said = [m for m in caplog.messages if "chance level" in m]
    assert rows[-1]["accuracy"] <= 0.15 and said == [
        f"final accuracy {rows[-1]['accuracy']:.4f} is chance level for 10 classes after 3 rounds, with no attack: "
        "the model did not learn. Usual causes: training settings too strong or too weak for this model "
        "(client.lr=1e-12, client.momentum=0.9, client.local_epochs=3), or labels that do not match the inputs"]

    caplog.clear()
    with caplog.at_level("WARNING", logger="fedrobust.strategies.server_app"):
        trained = run_inprocess(small_config(tmp_path, num_rounds=3), tmp_path / "trained")
    assert trained[-1]["accuracy"] > 0.5 and not [m for m in caplog.messages if "chance level" in m]


@pytest.mark.parametrize(("clients", "warned"), [(3, True), (4, False)])
def test_rounds_that_sample_exactly_what_the_rule_needs_are_said_before_training(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, clients: int, warned: bool
) -> None:
    """3 nodes with f=1 and the trimmed mean (2f + 1 = 3): a rejected reply lowers f, a dropout does not, so
    one node that drops out leaves the round short; with a fourth node there is a spare."""
    cfg = small_config(tmp_path, num_clients=clients, clients_per_round=clients, num_rounds=1)
    with caplog.at_level("WARNING", logger="fedrobust.strategies.round_loop"):
        run_inprocess(cfg, Path(cfg.output_dir))
    said = [m for m in caplog.messages if "exactly the" in m]
    if warned:
        assert said == [
            "each round samples 3 of the 3 connected nodes, exactly the 3 valid replies trimmed_mean with f=1 "
            "needs: one node that drops out or misses the deadline leaves a round short (rejected replies lower "
            "f, dropouts do not), and it is retried (max_round_retries=2) or stops the run; connect more nodes, "
            "raise fraction_train, or sample spare nodes with over_select"
        ]
    else:
        assert said == []


def test_a_simulation_refuses_a_resume_before_ray_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Other settings than the checkpoint's: the Hydra run's simulation says so in seconds, not after Ray's
    start-up and the nodes' (the server's own check, once they are up, is the same one)."""
    from experiments import simulate as simulation

    def ray_starts(verbose: bool) -> None:
        raise AssertionError("Ray started before the resume was refused")

    monkeypatch.setattr(simulation, "_start_ray", ray_starts)
    ckpt = str(tmp_path / "ckpt")
    first = small_config(tmp_path / "a", **{"checkpoint.dir": ckpt})
    run_inprocess(first, Path(first.output_dir))
    changed = small_config(tmp_path / "b", **{"checkpoint.dir": ckpt, "seed": 3})
    with pytest.raises(CheckpointMismatchError, match=r"round-000002 \(round 2\) was saved with other settings: "
                                                      r"run.seed: 0 -> 3\. Resume with"):
        simulation.simulate(changed, Path(changed.output_dir))


def test_a_finished_run_run_again_writes_its_outputs_without_starting_ray(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every round in the checkpoint: the Hydra run's simulation writes the run's outputs from it on the
    in-process transport, the same server code, with no node trained and Ray not started (~20 s)."""
    from experiments import simulate as simulation

    def ray_starts(verbose: bool) -> None:
        raise AssertionError("Ray started for a run with nothing left to train")

    monkeypatch.setattr(simulation, "_start_ray", ray_starts)
    cfg = small_config(tmp_path / "a", **{"checkpoint.dir": str(tmp_path / "ckpt")})
    first = run_inprocess(cfg, Path(cfg.output_dir))
    again = small_config(tmp_path / "b", **{"checkpoint.dir": str(tmp_path / "ckpt")})
    with caplog.at_level("INFO"):
        rows = simulation.simulate(again, Path(again.output_dir))
    assert f"the checkpoint in {tmp_path / 'ckpt'} holds all 2 rounds: nothing left to train, so Ray is not " \
           "started" in caplog.messages
    assert [r["accuracy"] for r in rows] == [r["accuracy"] for r in first]
    model = "final_model.safetensors"
    assert (Path(again.output_dir) / model).read_bytes() == (Path(cfg.output_dir) / model).read_bytes()
    # One round more than the checkpoint holds still starts the nodes.
    longer = small_config(tmp_path / "c", num_rounds=3, **{"checkpoint.dir": str(tmp_path / "ckpt")})
    with pytest.raises(AssertionError, match="Ray started"):
        simulation.simulate(longer, Path(longer.output_dir))


def test_a_run_of_fedrobusts_apps_names_the_run_configs_keys_in_its_errors(tmp_path: Path) -> None:
    """The same refusal names ``max_update_norm`` to a library user (test_library) and the run config's
    ``validation.max_update_norm`` to a user of fedrobust's apps, who set it there."""
    cfg = small_config(tmp_path, num_rounds=1, **{"validation.max_update_norm": 1e-6, "fault.max_round_retries": 0})
    honest = r"\(if these nodes are honest, raise the bound: validation\.max_update_norm\)"
    with pytest.raises(QuorumError, match=honest):
        run_inprocess(cfg, Path(cfg.output_dir))


def test_the_partitions_that_play_the_attack_are_said_with_the_round_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Printed as the round lines are where the log does not reach the console (``flwr run``'s ServerApp), so
    that a drill's rejected and filtered nodes can be read against the attackers."""
    cfg = small_config(tmp_path, num_rounds=1, **{"attack.name": "sign_flip"})
    run_inprocess(cfg, Path(cfg.output_dir), echo=True)
    said = capsys.readouterr().out.splitlines()
    attackers = ", ".join(map(str, sorted(byzantine_partitions(cfg))))
    assert said.index(f"attack sign_flip played by partitions {attackers}") < next(
        i for i, line in enumerate(said) if line.startswith("[round   1/1]"))
