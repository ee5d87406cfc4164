"""Checkpoints on a real S3 API (moto's server on loopback) and the local-first mirror that uploads to it."""

from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
from collections.abc import Iterator

import fsspec
import pytest
import torch

from fedrobust.checkpoint import (
    DELTA_FILE,
    MANIFEST_FILE,
    TENSORS_FILE,
    CheckpointStore,
)
from fedrobust.checkpoint_mirror import MirroredStore, open_store

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from experiments.local_s3 import LocalS3, local_s3


@pytest.fixture(scope="module")
def s3() -> Iterator[LocalS3]:
    with local_s3(bucket="ckpt") as server:
        yield server


@pytest.fixture
def s3_url(s3: LocalS3) -> str:
    return f"s3://{s3.bucket}/run-{uuid.uuid4().hex[:12]}"


def _tensors(value: float) -> dict[str, torch.Tensor]:
    return {
        "model/w": torch.linspace(-1, 1, 3000).reshape(30, 100) * value,
        "model/b": torch.full((7,), value, dtype=torch.bfloat16),
        "model/step": torch.tensor(int(value), dtype=torch.int64),
        "optimizer/m/w": torch.full((30, 100), value / 3),
    }


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for key, tensor in expected.items():
        assert actual[key].dtype == tensor.dtype, key
        assert torch.equal(actual[key], tensor), key


def _fs(s3: LocalS3) -> fsspec.AbstractFileSystem:
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options)
    return fs


def _objects(s3: LocalS3, url: str) -> list[str]:
    fs = _fs(s3)
    root = url.removeprefix("s3://")
    return sorted(p.removeprefix(root + "/") for p in fs.find(root))


def test_round_trip_and_retention_on_s3(s3: LocalS3, s3_url: str) -> None:
    store = CheckpointStore(s3_url, keep=2, storage_options=s3.storage_options)
    for round_ in range(1, 5):
        path = store.save(round_, _tensors(round_), {"round": round_, "config_hash": "h"})
    assert path == f"{s3_url}/round-000004"
    assert store.rounds() == [3, 4]
    # Retention deletes the objects, not only the manifests.
    assert [o.split("/")[0] for o in _objects(s3, s3_url)] == ["round-000003"] * 3 + ["round-000004"] * 3

    # A fresh store (a new process after a crash) sees exactly what the writer committed.
    checkpoint = CheckpointStore(s3_url, storage_options=s3.storage_options).latest_valid("h")
    assert checkpoint is not None and checkpoint.round == 4 and checkpoint.path == path
    assert checkpoint.meta == {"round": 4, "config_hash": "h"}
    _assert_same(checkpoint.tensors, _tensors(4))


def test_endpoint_and_credentials_from_the_environment(
    s3: LocalS3, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    store = CheckpointStore(s3_url)  # no storage_options: botocore reads AWS_ENDPOINT_URL and the keys
    store.save(1, _tensors(1), {})
    assert _objects(s3, s3_url) == [f"round-000001/{n}" for n in sorted(("manifest.json", "meta.json", TENSORS_FILE))]


def test_manifest_is_the_last_object_written_and_an_unfinished_write_is_ignored(
    s3: LocalS3, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(s3_url, storage_options=s3.storage_options)
    store.save(1, _tensors(1), {"round": 1})

    written: list[str] = []
    real_pipe = store._fs.pipe_file

    def crash_before_manifest(path: str, data: bytes, **kwargs: object) -> None:
        written.append(path.rsplit("/", 1)[-1])
        if path.endswith(MANIFEST_FILE):
            raise ConnectionError("network gone while committing")
        real_pipe(path, data, **kwargs)

    monkeypatch.setattr(store._fs, "pipe_file", crash_before_manifest)
    with pytest.raises(ConnectionError):
        store.save(2, _tensors(2), {"round": 2})
    assert written[-1] == MANIFEST_FILE and len(written) == 3
    # Round 2's data objects are in the bucket, but without a manifest it is no checkpoint.
    assert "round-000002/" + TENSORS_FILE in _objects(s3, s3_url)
    monkeypatch.undo()

    reader = CheckpointStore(s3_url, storage_options=s3.storage_options)
    assert reader.rounds() == [1]
    checkpoint = reader.latest_valid()
    assert checkpoint is not None and checkpoint.round == 1
    _assert_same(checkpoint.tensors, _tensors(1))
    # The next save of round 2 replaces the leftovers.
    store.save(2, _tensors(2), {"round": 2})
    checkpoint = reader.latest_valid()
    assert checkpoint is not None and checkpoint.round == 2
    _assert_same(checkpoint.tensors, _tensors(2))


@pytest.mark.parametrize("damage", ["flip", "truncate", "drop"])
def test_corrupted_remote_checkpoint_falls_back(
    s3: LocalS3, s3_url: str, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(s3_url, storage_options=s3.storage_options)
    store.save(1, _tensors(1), {"round": 1})
    store.save(2, _tensors(2), {"round": 2})
    fs = _fs(s3)
    target = f"{s3_url.removeprefix('s3://')}/round-000002/{TENSORS_FILE}"
    data = bytearray(fs.cat_file(target))
    if damage == "flip":
        data[-5] ^= 0x10
        fs.pipe_file(target, bytes(data))
    elif damage == "truncate":
        fs.pipe_file(target, bytes(data[:-100]))
    else:
        fs.rm_file(target)

    with caplog.at_level(logging.WARNING, logger="fedrobust.checkpoint"):
        checkpoint = CheckpointStore(s3_url, storage_options=s3.storage_options).latest_valid()
    assert checkpoint is not None and checkpoint.round == 1
    _assert_same(checkpoint.tensors, _tensors(1))
    reason = {"flip": "sha256", "truncate": "truncated", "drop": "missing"}[damage]
    assert any("round-000002" in r.getMessage() and reason in r.getMessage() for r in caplog.records)


def test_incremental_chain_on_s3_restores_exactly_and_skips_a_corrupted_delta(s3: LocalS3, s3_url: str) -> None:
    store = CheckpointStore(s3_url, keep=10, full_every=4, storage_options=s3.storage_options)
    states = {}
    for round_ in range(6):
        tensors = _tensors(1.0)
        tensors["model/w"] = tensors["model/w"] + round_ * 1e-3  # the only tensor that changes
        states[round_] = tensors
        store.save(round_, tensors, {"round": round_})
    fs = _fs(s3)
    root = s3_url.removeprefix("s3://")
    kinds = [any(p.endswith(DELTA_FILE) for p in fs.ls(f"{root}/round-{r:06d}", detail=False)) for r in range(6)]
    assert kinds == [False, True, True, True, False, True]

    reader = CheckpointStore(s3_url, storage_options=s3.storage_options)
    checkpoint = reader.latest_valid()
    assert checkpoint is not None and checkpoint.round == 5
    _assert_same(checkpoint.tensors, states[5])

    # Round 5's delta is gone, round 4 (full) never committed, and round 2's delta is garbage, which breaks
    # round 3 (built on it) too: the newest valid checkpoint is the full round 0 plus the delta of round 1.
    fs.rm_file(f"{root}/round-000005/{DELTA_FILE}")
    fs.pipe_file(f"{root}/round-000002/{DELTA_FILE}", b"garbage")
    fs.rm_file(f"{root}/round-000004/{MANIFEST_FILE}")  # the full checkpoint of round 4 never committed
    checkpoint = reader.latest_valid()
    assert checkpoint is not None and checkpoint.round == 1
    _assert_same(checkpoint.tensors, states[1])


# ------------------------------------------------------------------------------------------------ mirror


class _Gate:
    """Wraps the remote store's commit: can hold uploads back, fail the first few, and records them."""

    def __init__(self, store: CheckpointStore, fail_first: int = 0) -> None:
        self.open = threading.Event()
        self.open.set()
        self.fail_first = fail_first
        self.uploaded: list[int] = []
        self._real = store._commit_files
        store._commit_files = self  # type: ignore[method-assign]

    def __call__(self, round_: int, files: object) -> str:
        assert self.open.wait(30)
        if self.fail_first > 0:
            self.fail_first -= 1
            raise ConnectionError("simulated network outage")
        location = self._real(round_, files)  # type: ignore[arg-type]
        self.uploaded.append(round_)
        return location


def test_mirror_save_never_waits_on_the_network(tmp_path, s3: LocalS3, s3_url: str) -> None:
    store = MirroredStore(str(tmp_path / "local"), s3_url, keep=2, storage_options=s3.storage_options)
    gate = _Gate(store.remote)
    gate.open.clear()  # the network hangs
    for round_ in range(1, 5):
        store.save(round_, _tensors(round_), {"round": round_})
    # Every save returned with the upload of round 1 stuck: local commits only.
    assert store.local.rounds() == [3, 4]
    assert store.remote.rounds() == []
    gate.open.set()
    assert store.flush(timeout=30)
    # Round 1 was in flight; 2 and 3 were superseded by 4 while the network hung.
    assert gate.uploaded == [1, 4]
    assert store.remote.rounds() == [1, 4]
    checkpoint = CheckpointStore(s3_url, storage_options=s3.storage_options).latest_valid()
    assert checkpoint is not None and checkpoint.round == 4
    _assert_same(checkpoint.tensors, _tensors(4))
    store.close()


def test_mirror_upload_failures_are_logged_and_retried(
    tmp_path, s3: LocalS3, s3_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = MirroredStore(
        str(tmp_path / "local"), s3_url, storage_options=s3.storage_options, initial_backoff=0.01, max_backoff=0.05
    )
    _Gate(store.remote, fail_first=3)
    with caplog.at_level(logging.WARNING, logger="fedrobust.checkpoint"), store:
        future = store.save_async(7, _tensors(7), {"round": 7})
        assert future.result(timeout=30).endswith("round-000007")  # the caller never sees the outage
        assert store.flush(timeout=30)
    assert store.upload_failures == 3
    retries = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) == 3 and all("simulated network outage" in m for m in retries)
    assert store.remote.rounds() == [7]


def test_mirror_unreachable_remote_never_raises(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    options = {"key": "x", "secret": "x", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    options["config_kwargs"] = {"connect_timeout": 0.2, "retries": {"max_attempts": 1}}
    store = MirroredStore(str(tmp_path / "local"), "s3://nobucket/run", storage_options=options, initial_backoff=0.01)
    with caplog.at_level(logging.WARNING, logger="fedrobust.checkpoint"):
        store.save(1, _tensors(1), {"round": 1})
        start = time.monotonic()
        store.close(upload_timeout=0.5)
        assert time.monotonic() - start < 10
        checkpoint = store.latest_valid()  # the remote cannot even be listed: the local copy is used
    assert checkpoint is not None and checkpoint.round == 1
    assert store.upload_failures >= 1
    assert any("not uploaded" in r.getMessage() for r in caplog.records)


def test_mirror_latest_valid_takes_the_newest_of_either_place(tmp_path, s3: LocalS3, s3_url: str) -> None:
    local = tmp_path / "local"
    store = open_store(str(local), keep=3, mirror=s3_url, mirror_storage_options=s3.storage_options)
    assert isinstance(store, MirroredStore)
    for round_ in range(1, 4):
        store.save(round_, _tensors(round_), {"round": round_})
    assert store.flush(timeout=30)

    gate = _Gate(store.remote)
    gate.open.clear()
    store.save(4, _tensors(4), {"round": 4})  # committed locally, not uploaded yet
    checkpoint = store.latest_valid()
    assert checkpoint is not None and checkpoint.round == 4 and checkpoint.path == str(local / "round-000004")
    gate.open.set()
    store.close()

    # The local disk is lost: resume from the mirror.
    shutil.rmtree(local)
    restarted = MirroredStore(str(local), s3_url, keep=3, storage_options=s3.storage_options)
    checkpoint = restarted.latest_valid()
    assert checkpoint is not None and checkpoint.round == 4 and checkpoint.path.startswith("s3://")
    _assert_same(checkpoint.tensors, _tensors(4))

    # The local copy of round 5 is corrupted, the remote one is fine: the same round comes from the remote.
    restarted.save(5, _tensors(5), {"round": 5})
    assert restarted.flush(timeout=30)
    with open(local / "round-000005" / TENSORS_FILE, "r+b") as fh:
        fh.seek(-3, 2)
        fh.write(b"\x00\x01\x02")
    checkpoint = restarted.latest_valid()
    assert checkpoint is not None and checkpoint.round == 5 and checkpoint.path.startswith("s3://")
    _assert_same(checkpoint.tensors, _tensors(5))
    restarted.close()


def test_mirror_of_an_incremental_store_uploads_whole_chains(tmp_path, s3: LocalS3, s3_url: str) -> None:
    store = MirroredStore(str(tmp_path / "local"), s3_url, keep=2, full_every=3, storage_options=s3.storage_options)
    gate = _Gate(store.remote)
    gate.open.clear()
    states = {}
    for round_ in range(5):
        weights = torch.rand(30, 100, generator=torch.Generator().manual_seed(round_))
        states[round_] = _tensors(1.0) | {"model/w": weights}
        store.save(round_, states[round_], {"round": round_})
    gate.open.set()
    store.close()
    # 0 was in flight; 3 (full) and 4 (its delta) are the chain of the newest; 1 and 2 were superseded.
    assert gate.uploaded == [0, 3, 4]
    checkpoint = CheckpointStore(s3_url, storage_options=s3.storage_options).latest_valid()
    assert checkpoint is not None and checkpoint.round == 4
    _assert_same(checkpoint.tensors, states[4])


def test_a_stopping_run_waits_seconds_for_an_unreachable_mirror_and_says_what_it_left(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a scheduler's signal the grace period is short (Slurm and Kubernetes: 30 s), and Ray's driver
    fails on its own after 60 s once its control store is gone: a stop must not wait a minute for uploads."""
    from fedrobust.strategies import checkpointing
    from fedrobust.strategies.checkpointing import RoundCheckpointer

    assert checkpointing.STOP_UPLOAD_SECONDS <= 10
    monkeypatch.setattr(checkpointing, "STOP_UPLOAD_SECONDS", 1.5)  # the test's own, shorter wait

    options = {"key": "x", "secret": "x", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    options["config_kwargs"] = {"connect_timeout": 0.2, "retries": {"max_attempts": 1}}
    checkpointer = RoundCheckpointer(
        str(tmp_path / "local"), settings={"seed": 0}, mirror="s3://nobucket/run", storage_options=options
    )
    assert checkpointer.store is not None
    checkpointer.store.save(1, _tensors(1), {"round": 1})
    start = time.monotonic()
    checkpointer.close(stopping=True)
    waited = time.monotonic() - start
    assert 1.4 < waited < 10, waited  # not the minute of a run's end
    assert checkpointer.not_uploaded == [1]
    assert checkpointer.newest_round() == 1  # on the local disk, for the resume
