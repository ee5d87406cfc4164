"""Tests for fedrobust.data: digits partitions through flwr-datasets partitioners and the Hub loading path on a
local copy (no network)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import datasets
import flwr_datasets.common.telemetry
import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from fedrobust import array_cache, data

NUM_DIGITS = 1797
NUM_DIGITS_TRAIN = 1437  # 80 % of 1,797, stratified


def _rows(*parts: torch.utils.data.TensorDataset) -> np.ndarray:
    """Concatenate (x, y) of datasets into one array of rows, sorted, for multiset comparison."""
    x = np.concatenate([p.tensors[0].numpy() for p in parts])
    y = np.concatenate([p.tensors[1].numpy() for p in parts])
    rows = np.concatenate([x, y[:, None].astype(np.float32)], axis=1)
    return rows[np.lexsort(rows.T[::-1])]


def _label_histogram(dataset: torch.utils.data.TensorDataset, num_classes: int = 10) -> np.ndarray:
    return np.bincount(dataset.tensors[1].numpy(), minlength=num_classes) / len(dataset)


def test_dataset_specs() -> None:
    assert data.DATASETS == ("digits", "mnist", "cifar10")
    assert data.dataset_spec("digits") == data.DatasetSpec(input_shape=(64,), num_classes=10)
    assert data.dataset_spec("mnist").input_shape == (1, 28, 28)
    assert data.dataset_spec("cifar10").input_shape == (3, 32, 32)


@pytest.mark.parametrize(
    "call",
    [
        lambda: data.dataset_spec("imagenet"),
        lambda: data.load_partition("imagenet", 0, 2),
        lambda: data.load_test_set("imagenet"),
    ],
)
def test_unknown_dataset_names_valid_choices(call) -> None:
    with pytest.raises(ValueError, match="'imagenet'.*digits, mnist, cifar10"):
        call()


def test_unknown_partitioner_names_valid_choices() -> None:
    with pytest.raises(ValueError, match="'shard'.*iid, dirichlet, pathological"):
        data.load_partition("digits", 0, 4, partitioner="shard")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"partition_id": 4, "num_partitions": 4}, r"partition_id must be in \[0, 4\)"),
        ({"partition_id": 0, "num_partitions": 0}, "num_partitions must be >= 1"),
        ({"partition_id": 0, "num_partitions": 4, "partitioner": "dirichlet", "alpha": 0.0}, "alpha must be > 0"),
        (
            {"partition_id": 0, "num_partitions": 4, "partitioner": "pathological", "classes_per_partition": 11},
            r"classes_per_partition must be in \[1, 10\]",
        ),
    ],
)
def test_invalid_partition_arguments(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        data.load_partition("digits", **kwargs)


def test_digits_partition_dtypes_and_range() -> None:
    part = data.load_partition("digits", 0, 20)
    x, y = part.tensors
    assert x.dtype == torch.float32 and x.shape[1:] == (64,)
    assert y.dtype == torch.int64 and y.shape == (x.shape[0],)
    assert x.min() >= 0.0 and x.max() <= 1.0
    assert len(part) in (71, 72)  # 1,437 / 20


def test_iid_partitions_and_test_set_cover_digits_without_overlap() -> None:
    parts = [data.load_partition("digits", i, 20, partitioner="iid", seed=3) for i in range(20)]
    test = data.load_test_set("digits", seed=3)
    assert sum(len(p) for p in parts) == NUM_DIGITS_TRAIN
    assert len(test) == NUM_DIGITS - NUM_DIGITS_TRAIN
    x, y = load_digits(return_X_y=True)
    full = torch.utils.data.TensorDataset(torch.from_numpy((x / 16).astype(np.float32)), torch.from_numpy(y))
    # As multisets of (features, label) rows: every sample is in exactly one partition or the test set.
    np.testing.assert_array_equal(_rows(*parts, test), _rows(full))


def test_validation_hold_out_is_a_stratified_share_of_the_training_split_no_partition_holds() -> None:
    parts = [data.load_partition("digits", i, 20, partitioner="dirichlet", seed=3, validation_fraction=0.2)
             for i in range(20)]
    validation = data.load_validation_set("digits", fraction=0.2, seed=3)
    whole_train = data.load_partition("digits", 0, 1, seed=3)
    assert len(whole_train) == NUM_DIGITS_TRAIN
    # round(0.2 * count) of every class: 287 of the 1,437 training samples.
    counts = np.bincount(whole_train.tensors[1].numpy(), minlength=10)
    np.testing.assert_array_equal(
        np.bincount(validation.tensors[1].numpy(), minlength=10), np.round(0.2 * counts).astype(int)
    )
    # Every training sample is in exactly one partition or the hold-out.
    np.testing.assert_array_equal(_rows(*parts, validation), _rows(whole_train))
    assert not np.array_equal(_rows(validation), _rows(data.load_validation_set("digits", fraction=0.2, seed=4)))


def test_holdout_split_is_seeded_stratified_and_complete() -> None:
    labels = np.repeat(np.arange(3), [10, 20, 31])
    kept, held = data.holdout_split(labels, 0.3, seed=7)
    np.testing.assert_array_equal(np.sort(np.concatenate([kept, held])), np.arange(len(labels)))
    np.testing.assert_array_equal(np.bincount(labels[held]), [3, 6, 9])
    again = data.holdout_split(labels, 0.3, seed=7)
    np.testing.assert_array_equal(held, again[1])
    assert not np.array_equal(held, data.holdout_split(labels, 0.3, seed=8)[1])
    kept, held = data.holdout_split(labels, 0.0, seed=7)
    assert len(held) == 0 and len(kept) == len(labels)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: data.holdout_split(np.zeros(4, dtype=int), 1.0, seed=0), r"must be in \[0, 1\), got 1.0"),
        (lambda: data.load_partition("digits", 0, 2, validation_fraction=-0.1), r"must be in \[0, 1\)"),
        (lambda: data.load_partition("mnist", 0, 2, validation_fraction=0.1), "built for digits"),
        (lambda: data.load_validation_set("digits", fraction=0.0), "nothing is held out"),
    ],
)
def test_invalid_validation_fraction_is_explained(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_test_set_is_stratified() -> None:
    hist = _label_histogram(data.load_test_set("digits", seed=0))
    np.testing.assert_allclose(hist, 0.1, atol=0.01)


@pytest.mark.parametrize("partitioner", data.PARTITIONERS)
def test_partitions_are_deterministic_for_a_seed(partitioner: str) -> None:
    first = data.load_partition("digits", 5, 10, partitioner=partitioner, seed=11)
    # A fresh build (empty cache) must give the same partition as the cached one.
    data._partition_loader.cache_clear()
    data._digits_splits.cache_clear()
    again = data.load_partition("digits", 5, 10, partitioner=partitioner, seed=11)
    other = data.load_partition("digits", 5, 10, partitioner=partitioner, seed=12)
    for a, b in zip(first.tensors, again.tensors, strict=True):
        assert torch.equal(a, b)
    assert first.tensors[0].shape != other.tensors[0].shape or not torch.equal(first.tensors[0], other.tensors[0])


def test_partitioner_is_built_once_per_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    # The in-memory layer; the disk cache (tests/unit/test_array_cache.py) would answer before it.
    monkeypatch.setenv(array_cache.CACHE_DIR_ENV, "off")
    data.load_partition("digits", 0, 7, seed=5)
    before = data._partition_loader.cache_info()
    for i in range(7):
        # alpha is unused by iid, so it must not create another partitioner.
        data.load_partition("digits", i, 7, seed=5, alpha=0.1 * (i + 1))
    after = data._partition_loader.cache_info()
    assert after.misses == before.misses
    assert after.hits == before.hits + 7


def test_returned_tensors_are_copies() -> None:
    part = data.load_partition("digits", 1, 20, seed=0)
    part.tensors[0].zero_()
    part.tensors[1].fill_(-1)
    again = data.load_partition("digits", 1, 20, seed=0)
    assert again.tensors[0].abs().sum() > 0
    assert (again.tensors[1] >= 0).all()


def test_dirichlet_partitions_are_label_skewed() -> None:
    parts = [data.load_partition("digits", i, 20, partitioner="dirichlet", alpha=0.5, seed=0) for i in range(20)]
    iid = [data.load_partition("digits", i, 20, partitioner="iid", seed=0) for i in range(20)]
    assert sum(len(p) for p in parts) == NUM_DIGITS_TRAIN
    assert min(len(p) for p in parts) >= 7  # the minimum partition size for 1,437 samples over 20 partitions

    def mean_total_variation(partition_list) -> float:
        hists = np.stack([_label_histogram(p) for p in partition_list])
        return float(np.mean(0.5 * np.abs(hists - 0.1).sum(axis=1)))

    # Dirichlet(0.5) partitions are far from the uniform label distribution; iid ones are close to it.
    assert mean_total_variation(parts) > 0.4
    assert mean_total_variation(iid) < 0.2


def test_dirichlet_many_partitions_small_alpha_terminates() -> None:
    parts = [data.load_partition("digits", i, 50, partitioner="dirichlet", alpha=0.3, seed=1) for i in range(50)]
    assert sum(len(p) for p in parts) == NUM_DIGITS_TRAIN
    assert min(len(p) for p in parts) >= 2


@pytest.mark.filterwarnings("ignore:The specified min_partition_size:UserWarning")
def test_dirichlet_failure_is_explained() -> None:
    with pytest.raises(ValueError, match="use a larger alpha or fewer partitions"):
        data.load_partition("digits", 0, 200, partitioner="dirichlet", alpha=0.01, seed=0)


@pytest.mark.parametrize("classes", [1, 2, 3])
def test_pathological_classes_per_partition(classes: int) -> None:
    parts = [
        data.load_partition("digits", i, 10, partitioner="pathological", classes_per_partition=classes, seed=2)
        for i in range(10)
    ]
    for i, part in enumerate(parts):
        labels = torch.unique(part.tensors[1])
        assert len(labels) == classes
        assert i % 10 in labels
    # With as many partitions as classes, every class (hence every sample) goes to some partition.
    assert sum(len(p) for p in parts) == NUM_DIGITS_TRAIN


# ---------------------------------------------------------------------------------------------------------------
# Hub data sets on a local copy: the FederatedDataset path with a fake, tiny data set in the Hub's file layout.
# ---------------------------------------------------------------------------------------------------------------

_FAKE_HUB = {
    # name: (hub id, image column, image shape as stored, number of train rows, number of test rows)
    "mnist": ("ylecun/mnist", "image", (28, 28), 200, 40),
    "cifar10": ("uoft-cs/cifar10", "img", (32, 32, 3), 120, 30),
}


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keep datasets and flwr-datasets off the network and their caches inside tmp_path."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # datasets reads these settings when it is imported, so the module attributes are what counts now.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setattr(flwr_datasets.common.telemetry, "FLWR_TELEMETRY_ENABLED", "0")
    root = tmp_path / "data"
    rng = np.random.default_rng(0)
    for hub_id, image_key, shape, num_train, num_test in _FAKE_HUB.values():
        folder = root / hub_id / "plain_text"
        folder.mkdir(parents=True)
        features = datasets.Features({image_key: datasets.Image(), "label": datasets.ClassLabel(num_classes=10)})
        for split, rows in (("train", num_train), ("test", num_test)):
            split_data = datasets.Dataset.from_dict(
                {
                    image_key: [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(rows)],
                    "label": rng.integers(0, 10, rows),
                },
                features=features,
            )
            split_data.to_parquet(str(folder / f"{split}-00000-of-00001.parquet"))
    return root


@pytest.mark.parametrize("name", list(_FAKE_HUB))
def test_hub_dataset_from_local_copy(name: str, offline_hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(data.DATA_DIR_ENV, str(offline_hub))
    _, _, _, num_train, num_test = _FAKE_HUB[name]
    spec = data.dataset_spec(name)

    parts = [data.load_partition(name, i, 4, partitioner="dirichlet", alpha=1.0, seed=0) for i in range(4)]
    assert sum(len(p) for p in parts) == num_train
    for part in parts:
        x, y = part.tensors
        assert x.dtype == torch.float32 and tuple(x.shape[1:]) == spec.input_shape
        assert y.dtype == torch.int64 and ((y >= 0) & (y < spec.num_classes)).all()
    again = data.load_partition(name, 2, 4, partitioner="dirichlet", alpha=1.0, seed=0)
    assert torch.equal(again.tensors[0], parts[2].tensors[0])

    test = data.load_test_set(name)
    assert len(test) == num_test and tuple(test.tensors[0].shape[1:]) == spec.input_shape
    # Normalized per channel: undoing the normalization gives back the stored 8-bit pixel values.
    source = data._HUB_SOURCES[name]
    mean = torch.tensor(source.mean).view(1, -1, 1, 1)
    std = torch.tensor(source.std).view(1, -1, 1, 1)
    pixels = (test.tensors[0] * std + mean) * 255
    assert torch.allclose(pixels, pixels.round(), atol=1e-3)
    assert pixels.min() > -0.01 and pixels.max() < 255.01 and pixels.max() > 200


def test_hub_dataset_data_dir_argument(offline_hub: Path) -> None:
    part = data.load_partition(
        "mnist", 4, 10, partitioner="pathological", classes_per_partition=3, data_dir=offline_hub
    )
    assert len(torch.unique(part.tensors[1])) == 3


def test_hub_dataset_missing_local_copy(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="ylecun/mnist"):
        data.load_partition("mnist", 0, 2, data_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="uoft-cs/cifar10"):
        data.load_test_set("cifar10", data_dir=tmp_path)


@pytest.mark.parametrize("load", ["load_test_set('mnist')", "load_partition('cifar10', 0, 2)"])
def test_hub_dataset_offline_without_a_copy_says_what_to_do(load: str, tmp_path: Path) -> None:
    """No network (Hugging Face's offline mode stands for it) and no local copy: one error that names the
    environment variable and the offline data set, not the Hub's bare ConnectionError."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != data.DATA_DIR_ENV}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    code = (
        "from fedrobust import data\n"
        "try:\n"
        f"    data.{load}\n"
        "except data.DataUnavailableError as err:\n"
        "    print(err)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "from the Hugging Face Hub" in done.stdout and data.DATA_DIR_ENV in done.stdout, done.stdout
    assert "digits" in done.stdout, done.stdout


def test_a_device_reading_its_own_file_imports_no_dataset_library(tmp_path: Path) -> None:
    """A SuperNode starts a ClientApp process per message: reading a device's .npz must not pay for
    Hugging Face datasets, flwr-datasets or scikit-learn (about 2.3 s of CPU to import)."""
    import subprocess
    import sys

    x, y = load_digits(return_X_y=True)
    np.savez(tmp_path / "device.npz", x=(x[:50] / 16.0).astype(np.float32), y=y[:50])
    code = (
        "import sys\n"
        "from fedrobust import components\n"
        "from fedrobust.config import RunConfig\n"
        f"ds = components.load_local({str(tmp_path / 'device.npz')!r}, RunConfig())\n"
        "assert len(ds) == 50, len(ds)\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'datasets', 'flwr_datasets', 'sklearn'}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


@pytest.mark.parametrize("seed", [0, 7])
def test_digits_training_size_without_the_split_agrees_with_the_split(seed: int) -> None:
    """The config check counts the clients against the training split without importing the splitters."""
    assert data.training_size("digits", seed=seed) == len(data._digits_splits(seed)[0]) == 1437
    held_out = data.training_size("digits", seed=seed, validation_fraction=0.1)
    assert held_out == len(data._digits_splits(seed, 0.1)[0]) < 1437
    fresh = subprocess.run([sys.executable, "-c", "import sys; from fedrobust import data; "
                            f"n = data.training_size('digits', seed={seed}); "
                            "print(n, 'sklearn' in sys.modules, 'datasets' in sys.modules)"],
                           capture_output=True, text=True, timeout=120)
    assert fresh.stdout.split() == ["1437", "False", "False"], fresh
