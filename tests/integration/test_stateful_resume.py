"""Simulated clients' Context.state is saved with the round checkpoints and given back on resume.

The ``stale`` attack keeps the update it captured in round 1 in its node's context and replays it
in every later round; a resumed run that lost that memory captures anew and ends with other bytes.
In-process: a stop after round 2 and a resume. With real processes, these clients go through
tests/process/test_fault_processes.py's sequence (SIGTERM, SIGKILL of the whole process group at a
random moment, a corrupted newest checkpoint) and end with the uninterrupted run's bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from experiments.inprocess import run_inprocess
from fedrobust import Preempted
from fedrobust.clients.client_app import make_client_app
from fedrobust.strategies import client_state
from tests.support.simulation import small_config

STALE = {"attack.name": "stale", "num_byzantine": 2, "aggregator.name": "mean", "num_rounds": 4}


def _client(cfg, at_round: int, before_train) -> ClientApp:
    """The real ClientApp; ``before_train(context)`` runs when round ``at_round`` trains."""
    honest = make_client_app(cfg)
    app = ClientApp()
    app.query()(honest)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        if int(msg.content["config"]["server-round"]) == at_round:
            before_train(context)
        return honest(msg, context)

    return app


def _stopping_client(cfg, strategies, at_round: int) -> ClientApp:
    """The server is asked to stop while ``at_round`` trains."""
    return _client(cfg, at_round, lambda _context: strategies[0].request_stop())


def _forget(context: Context) -> None:
    for name in list(context.state):
        del context.state[name]


def _final(out: Path) -> bytes:
    return (out / "final_model.safetensors").read_bytes()


def test_client_state_codec_round_trips_every_record_kind() -> None:
    state = RecordDict(
        {
            "attack-state": ArrayRecord({"update.w": torch.arange(6.0).reshape(2, 3), "round": torch.tensor(3)}),
            "cfg": ConfigRecord({"b": b"\x00\xff", "n": [1, 2], "s": "x", "f": 1.5, "t": True}),
            "m": MetricRecord({"loss": 0.25, "steps": [1, 2]}),
        }
    )
    tensors, meta = client_state.encode({"3": state})
    back = client_state.decode(tensors, json.loads(json.dumps(meta)))["3"]
    assert list(back.keys()) == list(state.keys())
    arrays = back["attack-state"].to_torch_state_dict()
    assert torch.equal(arrays["update.w"], torch.arange(6.0).reshape(2, 3)) and int(arrays["round"]) == 3
    assert dict(back["cfg"]) == dict(state["cfg"]) and dict(back["m"]) == dict(state["m"])
    content = RecordDict({"config": ConfigRecord({"a": 1})})
    client_state.put_state(content, back)
    taken = client_state.take_state(content)
    assert list(content.keys()) == ["config"] and taken is not None and list(taken.keys()) == list(state.keys())


def test_stateful_clients_resume_in_process_to_identical_bytes(tmp_path: Path) -> None:
    reference = small_config(tmp_path, output_dir=str(tmp_path / "ref"), **STALE)
    run_inprocess(reference, tmp_path / "ref")
    expected = _final(tmp_path / "ref")

    cfg = small_config(
        tmp_path, output_dir=str(tmp_path / "run"), **STALE, **{"checkpoint.dir": str(tmp_path / "ckpt")}
    )
    strategies: list = []
    with pytest.raises(Preempted) as stopped:
        run_inprocess(
            cfg, tmp_path / "run", client_app=_stopping_client(cfg, strategies, 2), on_strategy=strategies.append
        )
    assert stopped.value.checkpointed
    saved = json.loads((tmp_path / "ckpt" / "round-000002" / "meta.json").read_text())["meta"]["clients"]
    assert sorted(saved) == ["0", "1", "2", "3", "4"]  # by partition: node ids change when a simulation restarts
    assert sorted(len(records) for records in saved.values()) == [0, 0, 0, 1, 1]  # the two stale clients' memory

    rows = run_inprocess(cfg, tmp_path / "run")
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert _final(tmp_path / "run") == expected

    # The property is not vacuous: a resume whose clients forget what they were given ends elsewhere.
    lost = small_config(
        tmp_path, output_dir=str(tmp_path / "lost"), **STALE, **{"checkpoint.dir": str(tmp_path / "ckpt2")}
    )
    strategies = []
    with pytest.raises(Preempted):
        run_inprocess(
            lost, tmp_path / "lost", client_app=_stopping_client(lost, strategies, 2), on_strategy=strategies.append
        )
    run_inprocess(lost, tmp_path / "lost", client_app=_client(lost, 3, _forget))  # as a restarted simulation's nodes
    assert _final(tmp_path / "lost") != expected


def test_a_cosine_server_lr_falls_every_round_and_a_stopped_run_resumes_on_its_schedule(tmp_path: Path) -> None:
    """The schedule is a function of the round and the run's length: a run stopped after round 2 and
    resumed takes the uninterrupted run's lr in rounds 3 and 4, and ends with its bytes."""
    schedule = {"server_optimizer.schedule": "cosine", "server_optimizer.min_lr_ratio": 0.5, "num_rounds": 4}
    whole = small_config(tmp_path, output_dir=str(tmp_path / "whole"), **schedule)
    rows = run_inprocess(whole, tmp_path / "whole")
    assert [r["server_lr"] for r in rows] == pytest.approx(
        [1.0, 0.5 + 0.25 * (1 + 2**-0.5), 0.75, 0.5 + 0.25 * (1 - 2**-0.5)]
    )
    stored = {"checkpoint.dir": str(tmp_path / "c")}
    cfg = small_config(tmp_path, output_dir=str(tmp_path / "run"), **schedule, **stored)
    strategies: list = []
    with pytest.raises(Preempted):
        run_inprocess(
            cfg, tmp_path / "run", client_app=_stopping_client(cfg, strategies, 2), on_strategy=strategies.append
        )
    resumed = run_inprocess(cfg, tmp_path / "run")
    assert [r["server_lr"] for r in resumed] == pytest.approx([r["server_lr"] for r in rows])
    assert _final(tmp_path / "run") == _final(tmp_path / "whole")


def test_a_quarantine_survives_a_restart_that_gives_the_nodes_new_ids(tmp_path: Path) -> None:
    """A restarted simulation draws new node ids: the checkpoint's quarantine follows the partition, so the
    quarantined client stays out and is counted once in f, and the resume ends with the uninterrupted bytes."""
    faulty = {"attack.name": "nan", "num_clients": 7, "clients_per_round": 7, "num_byzantine": 2,
              "num_rounds": 4, "liveness.quarantine_after": 1, "liveness.quarantine_rounds": 10}
    reference = small_config(tmp_path, output_dir=str(tmp_path / "ref"), **faulty)
    expected_rows = run_inprocess(reference, tmp_path / "ref")
    assert [r["f_used"] for r in expected_rows] == [0, 0, 0, 0]  # both NaN clients quarantined in round 1
    assert [r["sampled"] for r in expected_rows] == [7, 5, 5, 5]

    cfg = small_config(tmp_path, output_dir=str(tmp_path / "run"), **faulty, **{"checkpoint.dir": str(tmp_path / "ck")})
    strategies: list = []
    with pytest.raises(Preempted):
        run_inprocess(cfg, tmp_path / "run", client_app=_stopping_client(cfg, strategies, 2),
                      on_strategy=strategies.append)
    new_ids = {10_000 + 7 * i: {"partition-id": i, "num-partitions": 7} for i in range(7)}  # a restart's nodes
    rows = run_inprocess(cfg, tmp_path / "run", nodes=new_ids)
    assert [(r["round"], r["sampled"], r["f_used"]) for r in rows] == [
        (r["round"], r["sampled"], r["f_used"]) for r in expected_rows]
    assert _final(tmp_path / "run") == _final(tmp_path / "ref")
