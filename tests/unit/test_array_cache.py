"""fedrobust.array_cache, and the digits partitions and test split that fedrobust.data keeps in it."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from fedrobust import array_cache, data


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(array_cache.CACHE_DIR_ENV, str(root))
    return root


KEY = {"kind": "demo", "seed": 3, "arguments": [1, "iid", [0.5]]}


def test_store_then_load_gives_the_arrays_back(cache: Path) -> None:
    assert array_cache.load(KEY) is None
    x, y = np.arange(12, dtype=np.float32).reshape(3, 4), np.array([2, 0, 1], dtype=np.int64)
    array_cache.store(KEY, {"x": x, "y": y})
    [entry] = cache.iterdir()  # one file, no temporary left behind
    assert entry.name.startswith("demo-") and entry.suffix == ".npz"
    got = array_cache.load(KEY)
    assert got is not None and set(got) == {"x", "y"}
    assert got["x"].dtype == np.float32 and np.array_equal(got["x"], x)
    assert got["y"].dtype == np.int64 and np.array_equal(got["y"], y)
    assert array_cache.load({**KEY, "seed": 4}) is None  # another key, another entry


def test_default_place_and_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(array_cache.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert array_cache.cache_dir() == tmp_path / "fedrobust" / "arrays"
    for off in ("off", "", "0", "None"):
        monkeypatch.setenv(array_cache.CACHE_DIR_ENV, off)
        assert array_cache.cache_dir() is None
        array_cache.store(KEY, {"x": np.zeros(2)})
        assert array_cache.load(KEY) is None
    assert not (tmp_path / "fedrobust").exists()


def test_a_corrupted_entry_is_a_miss_with_a_warning_and_is_written_again(
    cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    x = np.random.default_rng(0).random(4096).astype(np.float32)
    array_cache.store(KEY, {"x": x})
    [entry] = cache.iterdir()
    raw = bytearray(entry.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # inside the stored array: its CRC-32 no longer matches
    entry.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="fedrobust.array_cache"):
        assert array_cache.load(KEY) is None
    assert "unreadable" in caplog.text and entry.name in caplog.text
    entry.write_bytes(b"")  # truncated to nothing
    assert array_cache.load(KEY) is None
    array_cache.store(KEY, {"x": x})
    got = array_cache.load(KEY)
    assert got is not None and np.array_equal(got["x"], x)


def test_an_unwritable_cache_only_costs_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(array_cache.CACHE_DIR_ENV, str(blocker / "cache"))
    array_cache.store(KEY, {"x": np.zeros(3)})  # no exception
    assert array_cache.load(KEY) is None


def _no_partitioner(*args: object, **kwargs: object) -> None:
    raise AssertionError("the partition was built again instead of read from the cache")


def test_digits_partition_is_made_once_then_read_back_equal(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data._partition_loader.cache_clear()
    made = data.load_partition("digits", 2, 5, partitioner="dirichlet", alpha=0.5, seed=7)
    assert len(list(cache.iterdir())) == 1
    # A fresh process (as a Ray actor is) has no partitioner in memory: the second call must not build one.
    monkeypatch.setattr(data, "_partition_loader", _no_partitioner)
    read = data.load_partition("digits", 2, 5, partitioner="dirichlet", alpha=0.5, seed=7)
    assert read.tensors[0].dtype == torch.float32 and read.tensors[1].dtype == torch.int64
    assert torch.equal(read.tensors[0], made.tensors[0]) and torch.equal(read.tensors[1], made.tensors[1])
    read.tensors[0].zero_()  # fresh tensors: changing them changes nothing stored
    assert torch.equal(data.load_partition("digits", 2, 5, partitioner="dirichlet", alpha=0.5, seed=7).tensors[0],
                       made.tensors[0])
    # Every argument is part of the key: another partition, seed or alpha is not read from this entry.
    for other in (
        {"partition_id": 3, "alpha": 0.5, "seed": 7},
        {"partition_id": 2, "alpha": 0.5, "seed": 8},
        {"partition_id": 2, "alpha": 0.3, "seed": 7},
    ):
        with pytest.raises(AssertionError, match="built again"):
            data.load_partition("digits", other["partition_id"], 5, partitioner="dirichlet", alpha=other["alpha"],
                                seed=other["seed"])


def test_digits_entries_are_keyed_by_the_code_that_makes_them(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data.load_partition("digits", 0, 4, seed=1)
    makers = data._digits_makers()
    monkeypatch.setattr(data, "_digits_makers", lambda: {**makers, "source": "an edited data.py"})
    monkeypatch.setattr(data, "_partition_loader", _no_partitioner)
    with pytest.raises(AssertionError, match="built again"):
        data.load_partition("digits", 0, 4, seed=1)


def test_digits_bad_arguments_fail_before_the_cache(cache: Path) -> None:
    with pytest.raises(ValueError, match="partition_id"):
        data.load_partition("digits", 9, 4, seed=1)
    assert not cache.exists() or not list(cache.iterdir())


def test_digits_test_split_is_kept_too(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data._test_tensors.cache_clear()
    made = data.load_test_set("digits", seed=5)
    assert [p.name.split("-")[1] for p in cache.iterdir()] == ["test"]
    data._test_tensors.cache_clear()
    monkeypatch.setattr(data, "_digits_splits", _no_partitioner)
    read = data.load_test_set("digits", seed=5)
    assert torch.equal(read.tensors[0], made.tensors[0]) and torch.equal(read.tensors[1], made.tensors[1])
    data._test_tensors.cache_clear()
