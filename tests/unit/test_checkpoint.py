"""Checkpoint store: round trips, pruning, corruption handling, config hashes, RNG state, crashes."""

from __future__ import annotations

import dataclasses
import logging
import random
import subprocess
import sys
import uuid
from collections.abc import Iterator

import fsspec
import numpy as np
import pytest
import torch
from safetensors.torch import load as load_safetensors

from fedrobust.checkpoint import (
    MANIFEST_FILE,
    TENSORS_FILE,
    CheckpointMismatchError,
    CheckpointStore,
    capture_rng_state,
    config_hash,
    join_groups,
    restore_rng_state,
    split_groups,
)


@pytest.fixture(params=["local", "memory"])
def url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path / "ckpt")
        return
    location = f"memory://fedrobust-test-{uuid.uuid4().hex}"
    yield location
    fs, root = fsspec.core.url_to_fs(location)
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _tensors(value: float) -> dict[str, torch.Tensor]:
    return {
        "model/fc1.weight": torch.full((4, 3), value),
        "model/fc1.bias": torch.full((4,), value, dtype=torch.bfloat16),
        "model/bn.num_batches_tracked": torch.tensor(int(value), dtype=torch.int64),
        "optimizer/exp_avg/fc1.weight": torch.full((4, 3), value) / 3,
        "aggregator/center": torch.arange(5, dtype=torch.int64) * int(value),
    }


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for key, tensor in expected.items():
        assert actual[key].dtype == tensor.dtype, key
        assert torch.equal(actual[key], tensor), key


def _file(checkpoint_path: str, name: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(checkpoint_path)
    return fs, f"{path}/{name}"


def test_round_trip_tensors_and_meta(url: str) -> None:
    store = CheckpointStore(url)
    tensors = _tensors(2.0)
    tensors["model/empty"] = torch.zeros(0, 7)
    tensors["model/mask"] = torch.tensor([True, False])
    meta = {"config_hash": "abc", "history": [{"round": 1, "accuracy": 0.5}], "liveness": {"nodes": {"7": {}}}}
    path = store.save(12, tensors, meta)
    assert path.rstrip("/").endswith("round-000012")

    checkpoint = store.latest_valid("abc")
    assert checkpoint is not None
    assert checkpoint.round == 12
    assert checkpoint.path == path
    assert checkpoint.meta == meta
    _assert_same(checkpoint.tensors, tensors)


def test_gpu_like_inputs_are_copied_to_contiguous_cpu(url: str) -> None:
    store = CheckpointStore(url)
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    # A transposed view and two tensors sharing one storage (tied weights) are what safetensors refuses.
    tensors = {"model/t": base.t(), "model/a": base, "model/tied": base}
    store.save(1, tensors, {})
    checkpoint = store.latest_valid()
    assert checkpoint is not None
    _assert_same(checkpoint.tensors, {k: v.contiguous() for k, v in tensors.items()})


def test_keep_prunes_old_checkpoints_after_commit(url: str) -> None:
    store = CheckpointStore(url, keep=2)
    for round_ in range(1, 6):
        store.save(round_, _tensors(round_), {"round": round_})
    assert store.rounds() == [4, 5]
    fs, root = fsspec.core.url_to_fs(url)
    assert sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)) == [
        "round-000004",
        "round-000005",
    ]


def test_saving_an_earlier_round_discards_later_ones(url: str) -> None:
    # After a rollback the run continues from an earlier round; the abandoned future must not resume.
    store = CheckpointStore(url, keep=5)
    for round_ in range(1, 5):
        store.save(round_, _tensors(round_), {"round": round_})
    store.save(3, _tensors(30.0), {"round": 3, "after": "rollback"})
    assert store.rounds() == [1, 2, 3]
    checkpoint = store.latest_valid()
    assert checkpoint is not None and checkpoint.meta["after"] == "rollback"
    _assert_same(checkpoint.tensors, _tensors(30.0))


def test_truncated_latest_falls_back_with_warning(url: str, caplog: pytest.LogCaptureFixture) -> None:
    store = CheckpointStore(url)
    store.save(1, _tensors(1.0), {"round": 1})
    latest = store.save(2, _tensors(2.0), {"round": 2})
    fs, path = _file(latest, TENSORS_FILE)
    fs.pipe_file(path, fs.cat_file(path)[:-50])

    with caplog.at_level(logging.WARNING, logger="fedrobust.checkpoint"):
        checkpoint = store.latest_valid()
    assert checkpoint is not None and checkpoint.round == 1
    _assert_same(checkpoint.tensors, _tensors(1.0))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("round-000002" in m and "truncated" in m for m in warnings), warnings


def test_flipped_byte_is_caught_by_sha256(url: str, caplog: pytest.LogCaptureFixture) -> None:
    store = CheckpointStore(url)
    store.save(1, _tensors(1.0), {"round": 1})
    latest = store.save(2, _tensors(2.0), {"round": 2})
    fs, path = _file(latest, TENSORS_FILE)
    data = bytearray(fs.cat_file(path))
    data[-3] ^= 0x01  # inside the tensor payload: the header still parses
    fs.pipe_file(path, bytes(data))
    load_safetensors(bytes(data))  # safetensors alone would accept it: only the checksum catches it

    with caplog.at_level(logging.WARNING, logger="fedrobust.checkpoint"):
        checkpoint = store.latest_valid()
    assert checkpoint is not None and checkpoint.round == 1
    assert any("sha256" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_corrupted_meta_json_is_skipped(url: str) -> None:
    store = CheckpointStore(url)
    store.save(1, _tensors(1.0), {"round": 1})
    latest = store.save(2, _tensors(2.0), {"round": 2})
    fs, path = _file(latest, "meta.json")
    fs.pipe_file(path, b"{not json")
    checkpoint = store.latest_valid()
    assert checkpoint is not None and checkpoint.round == 1


def test_a_manifest_that_is_not_json_is_skipped_naming_the_file(url: str) -> None:
    store = CheckpointStore(url)
    store.save(1, _tensors(1.0), {"round": 1})
    latest = store.save(2, _tensors(2.0), {"round": 2})
    fs, path = _file(latest, MANIFEST_FILE)
    fs.pipe_file(path, fs.cat_file(path)[:40])  # cut short, as a torn write of a non-atomic store leaves it
    checkpoint = store.latest_valid()
    assert checkpoint is not None and checkpoint.round == 1
    assert len(store.skipped) == 1 and "round-000002: manifest.json is not valid JSON:" in store.skipped[0]


def test_missing_manifest_is_an_unfinished_write(url: str) -> None:
    store = CheckpointStore(url)
    store.save(1, _tensors(1.0), {"round": 1})
    latest = store.save(2, _tensors(2.0), {"round": 2})
    fs, path = _file(latest, MANIFEST_FILE)
    fs.rm_file(path)
    assert store.rounds() == [1]
    checkpoint = store.latest_valid()
    assert checkpoint is not None and checkpoint.round == 1


def test_empty_store_has_no_checkpoint(url: str) -> None:
    assert CheckpointStore(url).latest_valid("anything") is None


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_leftover_temp_dir_is_ignored_and_cleaned(tmp_path) -> None:
    root = tmp_path / "ckpt"
    store = CheckpointStore(str(root))
    store.save(1, _tensors(1.0), {"round": 1})
    # What a writer killed mid-checkpoint leaves behind: a complete-looking temp dir, never renamed.
    leftover = root / f".tmp-round-000002-{_dead_pid()}"
    leftover.mkdir()
    (leftover / TENSORS_FILE).write_bytes(b"partial")
    (leftover / MANIFEST_FILE).write_text("{}")

    checkpoint = store.latest_valid()
    assert checkpoint is not None and checkpoint.round == 1
    store.save(2, _tensors(2.0), {"round": 2})
    assert not leftover.exists()
    assert sorted(p.name for p in root.iterdir()) == ["round-000001", "round-000002"]


def test_config_hash_mismatch_raises_unless_forced(url: str, caplog: pytest.LogCaptureFixture) -> None:
    original = config_hash({"lr": 0.1, "rule": "krum"})
    changed = config_hash({"lr": 0.2, "rule": "krum"})
    store = CheckpointStore(url)
    store.save(3, _tensors(3.0), {"config_hash": original})

    with pytest.raises(CheckpointMismatchError) as info:
        store.latest_valid(changed)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert original in message and changed in message and "force" in message

    with caplog.at_level(logging.WARNING, logger="fedrobust.checkpoint"):
        checkpoint = store.latest_valid(changed, force=True)
    assert checkpoint is not None and checkpoint.round == 3
    assert any("force" in r.getMessage() for r in caplog.records)
    assert store.latest_valid(original) is not None


def test_config_hash_is_canonical() -> None:
    @dataclasses.dataclass
    class Cfg:
        lr: float = 0.1
        rules: tuple[str, ...] = ("krum", "median")

    assert config_hash({"a": 1, "b": {"c": [1, 2]}}) == config_hash({"b": {"c": [1, 2]}, "a": 1})
    assert config_hash({"a": 1}) != config_hash({"a": 2})
    assert config_hash(Cfg()) == config_hash({"rules": ["krum", "median"], "lr": 0.1})
    assert len(config_hash({})) == 64
    with pytest.raises(TypeError):
        config_hash({"x": object()})


def test_rng_state_round_trips_through_a_checkpoint(url: str) -> None:
    def draws() -> tuple[list[float], list[float], torch.Tensor]:
        return (
            [random.random() for _ in range(5)] + [random.gauss(0, 1)],
            np.random.standard_normal(5).tolist(),
            torch.rand(5),
        )

    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    np.random.standard_normal(1)  # and one in NumPy's
    rng_tensors, rng_meta = capture_rng_state()
    expected = draws()

    store = CheckpointStore(url)
    store.save(1, join_groups({"rng": rng_tensors}), {"rng": rng_meta})
    draws()  # move every generator on
    checkpoint = store.latest_valid()
    assert checkpoint is not None
    restore_rng_state(split_groups(checkpoint.tensors)["rng"], checkpoint.meta["rng"])
    actual = draws()
    assert actual[0] == expected[0]
    assert actual[1] == expected[1]
    assert torch.equal(actual[2], expected[2])


def test_restore_rng_state_rejects_incomplete_state() -> None:
    tensors, meta = capture_rng_state()
    del meta["numpy"]
    with pytest.raises(ValueError, match="numpy"):
        restore_rng_state(tensors, meta)


def test_save_async_matches_save_and_snapshots_inputs(url: str) -> None:
    tensors = _tensors(4.0)
    expected = {k: v.clone() for k, v in tensors.items()}
    meta = {"history": [1, 2]}
    with CheckpointStore(url + "/async") as async_store:
        future = async_store.save_async(4, tensors, meta)
        # In-place updates right after the call (the next round's training) must not leak in.
        for tensor in tensors.values():
            tensor.add_(100)
        meta["history"].append(3)
        async_path = future.result(timeout=30)
    sync_path = CheckpointStore(url + "/sync").save(4, expected, {"history": [1, 2]})

    for name in (TENSORS_FILE, "meta.json"):
        fs_a, path_a = _file(async_path, name)
        fs_s, path_s = _file(sync_path, name)
        assert fs_a.cat_file(path_a) == fs_s.cat_file(path_s), name
    checkpoint = CheckpointStore(url + "/async").latest_valid()
    assert checkpoint is not None and checkpoint.meta == {"history": [1, 2]}
    _assert_same(checkpoint.tensors, expected)


def test_save_async_commits_in_order_and_wait_flushes(url: str) -> None:
    store = CheckpointStore(url, keep=2)
    futures = [store.save_async(r, _tensors(r), {"round": r}) for r in range(1, 5)]
    assert store.wait() == futures[-1].result()
    assert all(f.done() and f.exception() is None for f in futures)
    assert store.rounds() == [3, 4]
    store.close()
    store.save_async(5, _tensors(5.0), {"round": 5})  # a closed store starts a new writer
    store.close()
    assert store.rounds() == [4, 5]


def test_invalid_arguments_fail_early(tmp_path) -> None:
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(str(tmp_path), keep=0)
    store = CheckpointStore(str(tmp_path))
    with pytest.raises(ValueError, match="round"):
        store.save(-1, {}, {})
    with pytest.raises(TypeError, match="JSON"):
        store.save(1, {}, {"bad": object()})
    with pytest.raises(TypeError, match="torch.Tensor"):
        store.save(1, {"x": np.zeros(2)}, {})  # type: ignore[dict-item]
    assert store.rounds() == []


def test_split_and_join_groups() -> None:
    groups = {"model": {"fc.weight": torch.ones(1)}, "optimizer": {"exp_avg/fc.weight": torch.zeros(1)}}
    flat = join_groups(groups)
    assert sorted(flat) == ["model/fc.weight", "optimizer/exp_avg/fc.weight"]
    assert split_groups(flat) == groups
    with pytest.raises(ValueError, match="group"):
        join_groups({"a/b": {}})
    with pytest.raises(ValueError, match="prefix"):
        split_groups({"noprefix": torch.ones(1)})


def test_a_write_the_disk_refuses_leaves_nothing_behind_and_the_older_checkpoint_whole(tmp_path) -> None:
    """A file-size limit (RLIMIT_FSIZE: the kernel refuses the write with EFBIG, as a full disk refuses it
    with ENOSPC) fails the write of round 2 halfway: its temporary directory is removed, so a full disk is
    not kept full, and round 1 stays the newest valid checkpoint."""
    code = f"""
import resource, signal, torch
from fedrobust.checkpoint import CheckpointStore
store = CheckpointStore({str(tmp_path / "ck")!r})
store.save(1, {{"w": torch.zeros(10)}}, {{"round": 1}})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    store.save(2, {{"w": torch.zeros(100_000)}}, {{"round": 2}})
except OSError as err:
    print("refused:", err.errno)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused: 27"), done.stdout + done.stderr  # EFBIG
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["round-000001"]
    assert CheckpointStore(str(tmp_path / "ck")).latest_valid().round == 1


def test_two_fresh_starts_within_a_second_set_their_checkpoints_aside_under_two_names(tmp_path) -> None:
    store = CheckpointStore(str(tmp_path))
    moved = []
    for _ in range(3):
        store.save(1, {"w": torch.zeros(3)}, {"round": 1})
        moved += store.set_aside()
    assert len(set(moved)) == 3 and store.rounds() == []
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("aside-")) == sorted(
        p.rsplit("/", 1)[-1] for p in moved
    )
