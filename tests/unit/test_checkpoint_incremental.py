"""Incremental checkpoints: a full checkpoint every K saves, exact deltas in between, fallback past bad deltas."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator

import fsspec
import pytest
import torch

from fedrobust.checkpoint import DELTA_FILE, DELTA_INDEX_FILE, MANIFEST_FILE, TENSORS_FILE, CheckpointStore


@pytest.fixture(params=["local", "memory"])
def url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path / "ckpt")
        return
    location = f"memory://fedrobust-incr-{uuid.uuid4().hex}"
    yield location
    fs, root = fsspec.core.url_to_fs(location)
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _bits(tensor: torch.Tensor) -> bytes:
    # Bit-for-bit: torch.equal would call -0.0 equal to 0.0 and a NaN unequal to itself.
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _assert_bit_identical(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for key, tensor in expected.items():
        assert actual[key].dtype == tensor.dtype and actual[key].shape == tensor.shape, key
        assert _bits(actual[key]) == _bits(tensor), key


def _state(round_: int) -> dict[str, torch.Tensor]:
    """A server state where some tensors change every round, some now and then, some never."""
    gen = torch.Generator().manual_seed(1000 + round_)
    weights = torch.linspace(-2, 2, 4096).reshape(64, 64)
    weights = weights + 1e-3 * round_ * torch.randn(64, 64, generator=torch.Generator().manual_seed(7))
    special = torch.tensor([float("nan"), -0.0, 0.0, float("inf"), -float("inf"), 1e-45, round_])
    state = {
        "model/w": weights,  # small changes every round: the XOR encoding
        "model/b": torch.randn(64, generator=gen).to(torch.bfloat16),  # random every round: stored raw
        "model/frozen": torch.linspace(0, 1, 2048),  # never changes
        "model/special": special,
        "model/steps": torch.tensor(round_, dtype=torch.int64),
        "model/mask": torch.arange(10) % (2 + round_ % 3) == 0,
        "optimizer/v": torch.full((256,), 0.5) * (0.999 ** (round_ // 3)),  # changes every third round
        "model/empty": torch.zeros(0, 3),
    }
    if round_ % 5 == 4:
        state["aggregator/extra"] = torch.ones(3, round_)  # comes and goes, with a changing shape
    return state


def _kinds(store: CheckpointStore) -> dict[int, str]:
    kinds = {}
    for round_ in store.rounds():
        raw = store._fs.cat_file(store._join(f"round-{round_:06d}", MANIFEST_FILE))
        kinds[round_] = json.loads(raw).get("kind", "full")
    return kinds


def test_deltas_restore_bit_identical_tensors_every_round(url: str) -> None:
    store = CheckpointStore(url, keep=20, full_every=4)
    for round_ in range(12):
        store.save(round_, _state(round_), {"round": round_})
        checkpoint = CheckpointStore(url).latest_valid()  # a fresh reader: nothing comes from the writer's memory
        assert checkpoint is not None and checkpoint.round == round_
        assert checkpoint.meta == {"round": round_}
        _assert_bit_identical(checkpoint.tensors, _state(round_))
    kinds = _kinds(store)
    assert [r for r, k in kinds.items() if k == "full"] == [0, 4, 8]
    assert [r for r, k in kinds.items() if k == "delta"] == [1, 2, 3, 5, 6, 7, 9, 10, 11]


def test_deltas_store_only_what_changed(url: str) -> None:
    store = CheckpointStore(url, keep=5, full_every=10)
    store.save(0, _state(0), {})
    store.save(1, _state(1), {})
    index = json.loads(store._fs.cat_file(store._join("round-000001", DELTA_INDEX_FILE)))["tensors"]
    ops = {key: entry["op"] for key, entry in index.items()}
    assert ops["model/frozen"] == "same" and ops["model/empty"] == "same"
    assert ops["optimizer/v"] == "same"  # unchanged between rounds 0 and 1
    assert ops["model/w"] == "xor"  # close floats: the compressed XOR beats the raw bytes
    assert ops["model/b"] == "full"  # fresh random values: XOR would not be smaller
    delta_size = len(store._fs.cat_file(store._join("round-000001", DELTA_FILE)))
    full_size = len(store._fs.cat_file(store._join("round-000000", TENSORS_FILE)))
    assert delta_size < 0.5 * full_size, (delta_size, full_size)


def test_corrupted_delta_falls_back_to_the_last_full_plus_the_valid_deltas_before_it(url: str) -> None:
    store = CheckpointStore(url, keep=10, full_every=10)
    for round_ in range(6):
        store.save(round_, _state(round_), {"round": round_})
    # Round 3's delta is damaged in a way its own checksum catches; 4 and 5 are built on it.
    path = store._join("round-000003", DELTA_FILE)
    data = bytearray(store._fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    store._fs.pipe_file(path, bytes(data))
    checkpoint = CheckpointStore(url).latest_valid()
    assert checkpoint is not None and checkpoint.round == 2
    _assert_bit_identical(checkpoint.tensors, _state(2))

    # With the full checkpoint itself gone, no delta is loadable at all.
    store._fs.rm_file(store._join("round-000000", TENSORS_FILE))
    assert CheckpointStore(url).latest_valid() is None


def test_a_delta_of_a_replaced_parent_is_refused(url: str, caplog: pytest.LogCaptureFixture) -> None:
    store = CheckpointStore(url, keep=10, full_every=10)
    for round_ in range(3):
        store.save(round_, _state(round_), {"round": round_})
    # Rewrite round 1's manifest into a different, still self-consistent one: round 2 no longer matches it.
    path = store._join("round-000001", MANIFEST_FILE)
    manifest = json.loads(store._fs.cat_file(path))
    manifest["created"] = "1999-01-01T00:00:00+00:00"
    store._fs.pipe_file(path, json.dumps(manifest).encode())
    checkpoint = CheckpointStore(url).latest_valid()
    assert checkpoint is not None and checkpoint.round == 1
    assert any("replaced" in r.getMessage() for r in caplog.records)


def test_pruning_keeps_the_chain_of_every_kept_checkpoint(url: str) -> None:
    store = CheckpointStore(url, keep=1, full_every=4)
    for round_ in range(3):
        store.save(round_, _state(round_), {})
    assert store.rounds() == [0, 1, 2]  # keep=1, but round 2 needs 1 and 0
    store.save(3, _state(3), {})
    store.save(4, _state(4), {})  # full: nothing older is needed now
    assert store.rounds() == [4]
    fs, root = fsspec.core.url_to_fs(url)
    assert [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)] == ["round-000004"]
    checkpoint = store.latest_valid()
    assert checkpoint is not None
    _assert_bit_identical(checkpoint.tensors, _state(4))


def test_new_writer_and_rollback_start_with_a_full_checkpoint(url: str) -> None:
    store = CheckpointStore(url, keep=10, full_every=5)
    for round_ in range(3):
        store.save(round_, _state(round_), {})
    resumed = CheckpointStore(url, keep=10, full_every=5)  # a restarted server has no base in memory
    resumed.save(3, _state(3), {})
    resumed.save(4, _state(4), {})
    resumed.save(2, _state(20), {"after": "rollback"})  # discards 2, 3, 4; 2 is rewritten in full
    assert _kinds(resumed) == {0: "full", 1: "delta", 2: "full"}
    resumed.save(3, _state(3), {})
    assert _kinds(resumed)[3] == "delta"
    checkpoint = CheckpointStore(url).latest_valid()
    assert checkpoint is not None and checkpoint.round == 3
    _assert_bit_identical(checkpoint.tensors, _state(3))


def test_save_async_deltas_snapshot_their_inputs(url: str) -> None:
    with CheckpointStore(url, keep=10, full_every=3) as store:
        tensors = _state(0)
        futures = []
        for round_ in range(5):
            futures.append(store.save_async(round_, tensors, {"round": round_}))
            # The next round mutates the same tensors in place while the write may still run.
            for key, tensor in _state(round_ + 1).items():
                if key in tensors and tensors[key].shape == tensor.shape:
                    tensors[key].copy_(tensor)
                else:
                    tensors[key] = tensor.clone()
            tensors = {k: v for k, v in tensors.items() if k in _state(round_ + 1)}
        assert all(f.result(timeout=60) for f in futures)
    checkpoint = CheckpointStore(url).latest_valid()
    assert checkpoint is not None and checkpoint.round == 4
    _assert_bit_identical(checkpoint.tensors, _state(4))


def test_full_every_is_validated(tmp_path) -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="full_every"):
            CheckpointStore(str(tmp_path), full_every=bad)  # type: ignore[arg-type]


def test_full_mode_writes_no_delta_files(tmp_path) -> None:
    store = CheckpointStore(str(tmp_path / "c"), keep=5)
    for round_ in range(3):
        store.save(round_, _state(round_), {})
    names = {name for _, _, files in os.walk(tmp_path / "c") for name in files}
    assert names == {TENSORS_FILE, "meta.json", MANIFEST_FILE}


def test_a_corrupt_full_checkpoint_leaves_a_chain_to_fall_back_to(url: str) -> None:
    """keep=2 with deltas: the two newest (a full one and its delta) rest on one full checkpoint, so the
    chain before it is kept too; corrupting that full checkpoint falls back to the newest round before it."""
    store = CheckpointStore(url, keep=2, full_every=3)
    for round_ in range(1, 6):  # full 1, deltas 2 and 3, full 4, delta 5
        store.save(round_, _state(round_), {})
    assert _kinds(store) == {1: "full", 2: "delta", 3: "delta", 4: "full", 5: "delta"}
    fs, root = fsspec.core.url_to_fs(url)
    tensors = f"{root}/round-000004/{TENSORS_FILE}"
    data = bytearray(fs.cat_file(tensors))
    data[-1] ^= 0xFF
    fs.pipe_file(tensors, bytes(data))
    checkpoint = CheckpointStore(url).latest_valid()
    assert checkpoint is not None and checkpoint.round == 3
    _assert_bit_identical(checkpoint.tensors, _state(3))
    for round_ in range(6, 9):  # full 7 makes 4's chain the fallback, and 1-3 go
        store.save(round_, _state(round_), {})
    assert store.rounds() == [4, 5, 6, 7, 8]
    one = CheckpointStore(url + "-one", keep=1, full_every=3)  # keep=1 asks for no fallback
    for round_ in range(1, 6):
        one.save(round_, _state(round_), {})
    assert one.rounds() == [4, 5]
