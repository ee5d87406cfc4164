"""The round loop with the store's features switched on from the run config: a mirror on S3 (moto), incremental
checkpoints and the adaptive (Young/Daly) interval. Each run is the real strategy loop, in process."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from experiments.inprocess import run_inprocess
from fedrobust import RobustStrategy
from fedrobust.checkpoint import CheckpointStore
from fedrobust.clients.client_app import make_client_app
from fedrobust.config import RunConfig, from_flat
from fedrobust.run_setup import validate
from fedrobust.strategies.evaluation import build_global_model
from tests.support.simulation import small_config


def _final_bytes(cfg: RunConfig) -> bytes:
    return (Path(cfg.output_dir) / "final_model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def uninterrupted_4_rounds(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """Final model bytes of a 4-round run without checkpoints: what every resumed run must reproduce."""
    cfg = small_config(tmp_path_factory.mktemp("reference"), num_rounds=4)
    run_inprocess(cfg, Path(cfg.output_dir))
    return _final_bytes(cfg)


def _blocking_rounds(rows: list[dict]) -> list[int]:
    return [r["round"] for r in rows if "seconds_checkpoint_blocking" in r]


# ------------------------------------------------------------------------------------------------ mirror
def test_resume_from_the_mirror_after_the_local_directory_is_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, uninterrupted_4_rounds: bytes
) -> None:
    pytest.importorskip("moto")
    from experiments.local_s3 import local_s3

    local = tmp_path / "ckpt"
    with local_s3() as s3:
        # The run config carries no secrets: endpoint and credentials come from the environment, as in production.
        for name, value in s3.env().items():
            monkeypatch.setenv(name, value)
        mirror = f"s3://{s3.bucket}/run"
        overrides = {"checkpoint.dir": str(local), "checkpoint.mirror": mirror}
        first = small_config(tmp_path / "a", num_rounds=2, **overrides)
        run_inprocess(first, Path(first.output_dir))
        remote = CheckpointStore(mirror, storage_options=s3.storage_options, _create=False)
        assert remote.rounds() == [1, 2]  # uploads were flushed when the run ended

        shutil.rmtree(local)  # the server's disk is gone; only the mirror holds the run
        resumed = small_config(tmp_path / "b", num_rounds=4, **overrides)
        with caplog.at_level(logging.INFO, logger="fedrobust.strategies.reporting"):
            rows = run_inprocess(resumed, Path(resumed.output_dir))
        assert remote.rounds()[-1] == 4

    assert any("resumed after round 2" in m and s3.bucket in m for m in caplog.messages), caplog.messages
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert _blocking_rounds(rows[2:]) == [3, 4]  # rounds 1-2 came from the checkpoint's history
    assert _final_bytes(resumed) == uninterrupted_4_rounds
    assert CheckpointStore(str(local)).rounds()[-1] == 4  # local writing went on after the resume


def test_a_run_whose_mirror_never_answers_trains_and_its_summary_says_the_mirror_is_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from fedrobust.strategies import checkpointing

    monkeypatch.setattr(checkpointing, "END_UPLOAD_SECONDS", 1.0)  # the run's end waits a minute otherwise
    # An S3 endpoint where nothing listens: every upload fails at once.
    for name, value in {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "x",
                        "AWS_SECRET_ACCESS_KEY": "x", "AWS_MAX_ATTEMPTS": "1"}.items():
        monkeypatch.setenv(name, value)
    cfg = small_config(tmp_path / "a", num_rounds=2, **{"checkpoint.dir": str(tmp_path / "ckpt"),
                                                         "checkpoint.mirror": "s3://nobucket/run"})
    with caplog.at_level(logging.INFO):
        rows = run_inprocess(cfg, Path(cfg.output_dir))
    assert [r["round"] for r in rows] == [1, 2]
    assert CheckpointStore(str(tmp_path / "ckpt")).rounds() == [1, 2]
    [said] = [m for m in caplog.messages if m.startswith("MIRROR BEHIND")]
    assert "round(s) [2] were not uploaded to s3://nobucket/run" in said and "on the local disk" in said, said


# ------------------------------------------------------------------------------------------- incremental
def test_incremental_checkpoints_resume_from_a_delta_to_identical_bytes(
    tmp_path: Path, uninterrupted_4_rounds: bytes
) -> None:
    ckpt = tmp_path / "ckpt"
    overrides = {"checkpoint.dir": str(ckpt), "checkpoint.full_every": 3}
    first = small_config(tmp_path / "a", num_rounds=3, **overrides)
    run_inprocess(first, Path(first.output_dir))
    kinds = {
        p.parent.name: json.loads(p.read_text()).get("kind", "full") for p in sorted(ckpt.glob("round-*/manifest.json"))
    }
    # Round 1 is full, 2 and 3 are deltas: the resume below restores round 3 through its chain.
    assert kinds == {"round-000001": "full", "round-000002": "delta", "round-000003": "delta"}

    resumed = small_config(tmp_path / "b", num_rounds=4, **overrides)
    rows = run_inprocess(resumed, Path(resumed.output_dir))
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert _final_bytes(resumed) == uninterrupted_4_rounds


def test_strategy_refuses_an_unknown_server_lr_schedule_naming_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown server_lr_schedule 'step'; valid choices: \['constant', 'cosine'\]"):
        RobustStrategy(server_lr_schedule="step")
    with pytest.raises(ValueError, match=r"server_lr_min_ratio must be in \[0, 1\], got -0.5"):
        RobustStrategy(server_lr_schedule="cosine", server_lr_min_ratio=-0.5)
    # A function of (round, num_rounds), as LambdaLR's lr_lambda: its factor multiplies server_lr.
    assert RobustStrategy(server_lr=0.5, server_lr_schedule=lambda r, n: 1 / r).round_lr(4, 10) == 0.125
    with pytest.raises(ValueError, match="server_lr_schedule returned 0.0 for round 3: must be > 0"):
        RobustStrategy(server_lr_schedule=lambda r, n: 0.0).round_lr(3, 10)


def test_a_resumed_run_sends_the_model_in_its_own_key_order(tmp_path: Path) -> None:
    """The checkpoint gives its tensors back in safetensors' order; the key order is the layout of the
    update rows, so a resumed run in another order summed each coordinate's values at another position
    and ended with other bytes (the mean's sum over rows rounds by position)."""
    overrides = {"checkpoint.dir": str(tmp_path / "ckpt")}
    first = small_config(tmp_path / "a", num_rounds=2, **overrides)
    run_inprocess(first, Path(first.output_dir))
    resumed = small_config(tmp_path / "b", num_rounds=3, **overrides)
    honest = make_client_app(resumed)
    app = ClientApp()
    app.query()(honest)
    seen: list[tuple[int, list[str]]] = []

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        seen.append((int(msg.content["config"]["server-round"]), list(msg.content["arrays"].keys())))
        return honest(msg, context)

    run_inprocess(resumed, Path(resumed.output_dir), client_app=app)
    model_order = list(build_global_model(resumed).state_dict())
    assert model_order != sorted(model_order)  # the MLP's order is not the alphabetical one
    assert {r for r, _ in seen} == {3} and all(keys == model_order for _, keys in seen), seen


# ------------------------------------------------------------------------------------------ auto interval
def test_auto_interval_grows_to_the_run_length_and_always_saves_the_last_round(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, uninterrupted_4_rounds: bytes
) -> None:
    ckpt = tmp_path / "ckpt"
    # A long MTBF makes sqrt(2 C F) far longer than the run: after measuring round 1's checkpoint, the interval
    # is clamped to num_rounds, and only the last round (always) is checkpointed again.
    cfg = small_config(tmp_path / "a", num_rounds=4, **{
        "checkpoint.dir": str(ckpt), "checkpoint.every_rounds": "auto", "checkpoint.mtbf": 1e9,
    })
    with caplog.at_level(logging.INFO, logger="fedrobust.checkpoint_interval"):
        rows = run_inprocess(cfg, Path(cfg.output_dir))
    assert any("checkpoint interval 1 -> 4 rounds" in m for m in caplog.messages), caplog.messages
    assert [r["checkpoint_interval"] for r in rows] == [1, 4, 4, 4]
    assert _blocking_rounds(rows) == [1, 4]
    assert _final_bytes(cfg) == uninterrupted_4_rounds
    state = CheckpointStore(str(ckpt)).latest_valid().meta["interval"]
    assert state["round_seconds"] > 0 and state["checkpoint_seconds"] > 0 and state["last_checkpoint_round"] == 1


def test_auto_interval_state_and_restarts_survive_a_resume(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    overrides = {"checkpoint.dir": str(ckpt), "checkpoint.every_rounds": "auto", "checkpoint.mtbf": 1e9}
    first = small_config(tmp_path / "a", num_rounds=2, **overrides)
    run_inprocess(first, Path(first.output_dir))
    saved = CheckpointStore(str(ckpt)).latest_valid().meta["interval"]
    assert saved["restarts"] == [] and saved["interval"] == 2

    resumed = small_config(tmp_path / "b", num_rounds=5, **overrides)
    rows = run_inprocess(resumed, Path(resumed.output_dir))
    # Restored: the last checkpoint was round 2 and the interval grows to the new run length (5), so rounds 3
    # and 4 are skipped. A fresh interval would have checkpointed round 3 (nothing saved yet in its history).
    assert _blocking_rounds(rows[2:]) == [5]
    assert [r["checkpoint_interval"] for r in rows[2:]] == [5, 5, 5]
    state = CheckpointStore(str(ckpt)).latest_valid().meta["interval"]
    assert state["started"] == saved["started"]  # the MTBF estimate keeps counting from the first start
    assert len(state["restarts"]) == 1  # this resume was recorded as a restart


def test_auto_interval_estimates_the_mtbf_without_one(tmp_path: Path) -> None:
    cfg = small_config(tmp_path / "a", num_rounds=3, **{
        "checkpoint.dir": str(tmp_path / "ckpt"), "checkpoint.every_rounds": "auto",
    })
    rows = run_inprocess(cfg, Path(cfg.output_dir))
    assert all(1 <= r["checkpoint_interval"] <= 3 for r in rows)
    assert _blocking_rounds(rows)[0] == 1 and _blocking_rounds(rows)[-1] == 3


# ------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "key,value,message",
    [
        ("checkpoint.every_rounds", "sometimes", r"every_rounds=sometimes: must be an integer >= 0 .* or auto \("),
        ("checkpoint.every_rounds", -1, r"every_rounds=-1: must be an integer >= 0 .* or auto \("),
        ("checkpoint.full_every", 0, r"full_every=0: must be an integer >= 1 \(1: every checkpoint full"),
        ("checkpoint.mtbf", -5.0, r"mtbf=-5.0: must be >= 0 seconds \(0: estimated"),
        ("checkpoint.mirror", "s3://bucket/run", r"mirror=s3://bucket/run: needs checkpoint.dir"),
    ],
)
def test_bad_checkpoint_settings_fail_validation_naming_valid_values(
    tmp_path: Path, key: str, value: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        run_inprocess(small_config(tmp_path, **{key: value}), tmp_path / "out")


def test_hydra_override_every_rounds_auto_and_numbers() -> None:
    from tests.unit.test_config import _compose

    assert validate(_compose("checkpoint.every_rounds=auto")).checkpoint.every_rounds == "auto"
    assert validate(_compose("checkpoint.every_rounds=5")).checkpoint.every_rounds == 5
    with pytest.raises(ValueError, match="or auto"):
        validate(_compose("checkpoint.every_rounds=sometimes"))
    flat = _compose("checkpoint.every_rounds=auto", "checkpoint.full_every=4").to_flat()
    assert from_flat(flat).checkpoint.every_rounds == "auto" and from_flat(flat).checkpoint.full_every == 4
    assert from_flat({"checkpoint.every_rounds": "3"}).checkpoint.every_rounds == 3  # flwr --run-config strings


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"checkpoint_every": "sometimes"}, r"checkpoint_every must be an integer >= 0 .* or 'auto'"),
        ({"checkpoint_full_every": 0}, r"checkpoint_full_every must be an integer >= 1"),
        ({"checkpoint_mtbf": 0.0}, r"checkpoint_mtbf must be > 0 seconds \(None: estimated"),
        ({"checkpoint_mirror": "s3://b/run"}, r"checkpoint_mirror='s3://b/run' needs checkpoint_dir"),
        ({"checkpoint_dir": "/tmp/ck", "checkpoint_mirror": "/tmp/ck/"}, r"'/tmp/ck/' is checkpoint_dir itself"),
        ({"checkpoint_dir": "/tmp/ck", "checkpoint_mirror": "file:///tmp/ck/m"},
         r"'file:///tmp/ck/m' is a folder inside checkpoint_dir; a mirror is a second place"),
        ({"checkpoint_dir": "s3://b/run/local", "checkpoint_mirror": "s3://b/run"},
         r"'s3://b/run' holds checkpoint_dir inside it"),
        ({"checkpoint_dir": "x", "checkpoint_storage_options": ["key"]}, r"checkpoint_storage_options must be a map"),
    ],
)
def test_strategy_checks_checkpoint_arguments_up_front(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RobustStrategy("mean", **kwargs)


def test_strategy_accepts_the_store_features() -> None:
    strategy = RobustStrategy(
        "mean",
        checkpoint_dir="ckpt",
        checkpoint_every="auto",
        checkpoint_mirror="s3://bucket/run",
        checkpoint_full_every=5,
        checkpoint_storage_options={"anon": False},
        checkpoint_mtbf=3600.0,
    )
    assert (strategy.checkpoint_every, strategy.checkpoint_full_every, strategy.checkpoint_mtbf) == ("auto", 5, 3600.0)
    assert strategy.checkpoint_mirror == "s3://bucket/run" and strategy.checkpoint_storage_options == {"anon": False}


def test_a_signed_run_resumes_when_the_nodes_come_back_with_new_ids(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Keys are pinned to the node that first used them, and the pins are in the checkpoint. A restart
    gives the nodes new ids (every simulation start; a SuperLink without --database): the pins of the ids
    Flower no longer lists are freed, so the resumed run accepts every device and ends with the bytes of an
    uninterrupted run. Before, every reply was refused as key_bound_to_other_node."""
    from experiments.inprocess import node_ids_for

    signed = {"signing.require": True}
    reference = small_config(tmp_path / "reference", num_rounds=4, **signed)
    run_inprocess(reference, Path(reference.output_dir))

    overrides = {**signed, "checkpoint.dir": str(tmp_path / "ckpt")}
    first = small_config(tmp_path / "a", num_rounds=2, **overrides)
    run_inprocess(first, Path(first.output_dir))
    old_ids = node_ids_for(first.seed, first.num_clients)
    new_ids = node_ids_for(first.seed + 1, first.num_clients)
    assert not set(old_ids) & set(new_ids)
    nodes = {node_id: {"partition-id": i, "num-partitions": first.num_clients} for i, node_id in enumerate(new_ids)}
    resumed = small_config(tmp_path / "b", num_rounds=4, **overrides)
    with caplog.at_level(logging.INFO, logger="fedrobust.strategies.reporting"):
        rows = run_inprocess(resumed, Path(resumed.output_dir), nodes=nodes)
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert all(r["accepted"] == first.num_clients and not r["rejected"] for r in rows[2:]), rows[2:]
    # The summary's totals are the whole run's; it says which rounds this process trained.
    assert any(m.startswith("finished 4 rounds: rounds 1-2 before the resume, 2 after it in ")
               for m in caplog.messages), caplog.messages
    assert f"replies accepted {4 * first.num_clients}, rejected 0" in caplog.text
    assert _final_bytes(resumed) == _final_bytes(reference)
