"""Data sets and their federated partitions.

Three data sets are known (:data:`DATASETS`):

``digits``
    scikit-learn's 8x8 handwritten digits (1,797 samples, shipped inside the scikit-learn wheel), the offline
    default. Features are the 64 pixel intensities scaled to [0, 1]; a stratified 80/20 train/test split is drawn
    from ``seed``.
``mnist``, ``cifar10``
    The Hugging Face Hub data sets ``ylecun/mnist`` and ``uoft-cs/cifar10``, loaded through flwr-datasets'
    :class:`~flwr_datasets.FederatedDataset`. They need the Hub, or a local copy: set ``data_dir`` (or the
    ``FEDROBUST_DATA_DIR`` environment variable) to a folder that holds ``<hub id>/`` (``ylecun/mnist/``,
    ``uoft-cs/cifar10/``) in a layout that :func:`datasets.load_dataset` reads, e.g. what
    ``huggingface-cli download ylecun/mnist --repo-type dataset --local-dir <data_dir>/ylecun/mnist`` writes
    (parquet files named ``train-*`` and ``test-*``). The test set is the Hub's ``test`` split. Offline, also set
    ``HF_DATASETS_OFFLINE=1``; flwr-datasets sends usage telemetry unless ``FLWR_TELEMETRY_ENABLED=0``.

A *validation hold-out* (``validation_fraction`` > 0, digits only) takes a stratified share of the training
split out of every partition, drawn from ``seed`` (:func:`holdout_split`): hyper-parameters are then picked on
:func:`load_validation_set` while the test set stays unseen. With the default 0 nothing is held out.

Partitions of the training split are made by flwr-datasets partitioners (:data:`PARTITIONERS`): ``iid``
(:class:`~flwr_datasets.partitioner.IidPartitioner`), ``dirichlet`` (label skew,
:class:`~flwr_datasets.partitioner.DirichletPartitioner`) and ``pathological`` (a fixed number of classes per
partition, :class:`~flwr_datasets.partitioner.PathologicalPartitioner`). Every simulated client calls
:func:`load_partition` each round, so the partitioner for one configuration is built once per process and
cached; the assignment of samples to partitions depends only on the arguments, never on call order. Digits
partitions and the digits test split are also kept on disk (:mod:`fedrobust.array_cache`, keyed by the
arguments, this module's source and the library versions): every later process, such as each Ray actor of a
simulation, reads them without importing scikit-learn, ``datasets`` and flwr-datasets (about 3.5 s of CPU).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import TensorDataset

from fedrobust import array_cache

if TYPE_CHECKING:
    import datasets
    from flwr_datasets import FederatedDataset
    from flwr_datasets.partitioner import Partitioner

# Hugging Face datasets, flwr-datasets and scikit-learn are imported by the functions that use them, not
# here: together they cost about 2.3 s of CPU to import (flwr-datasets pulls in seaborn, pandas and
# scipy.stats), and a SuperNode starts a fresh ClientApp process for every message, where a device
# reading its own .npz or .safetensors file (load_local) needs none of them.

__all__ = [
    "DataUnavailableError",
    "DATASETS",
    "DATA_DIR_ENV",
    "PARTITIONERS",
    "DatasetSpec",
    "dataset_spec",
    "load_local",
    "load_partition",
    "holdout_split",
    "load_test_set",
    "load_validation_set",
    "partition_indices",
]

logger = logging.getLogger(__name__)

DATASETS: tuple[str, ...] = ("digits", "mnist", "cifar10")
PARTITIONERS: tuple[str, ...] = ("iid", "dirichlet", "pathological")
DATA_DIR_ENV = "FEDROBUST_DATA_DIR"


class DataUnavailableError(RuntimeError):
    """A Hub data set could not be read: no network (or Hugging Face's offline mode) and no local copy."""


@contextlib.contextmanager
def _from_hub(name: str) -> Iterator[None]:
    """Turn the Hub's network errors into one that says what to do offline."""
    try:
        yield
    except OSError as err:  # datasets raises ConnectionError("Couldn't reach ... on the Hub")
        hub_id = _HUB_SOURCES[name].hub_id
        raise DataUnavailableError(
            f"dataset {name}: could not read {hub_id} from the Hugging Face Hub ({err}); offline, set "
            f"{DATA_DIR_ENV} (or data_dir) to a folder holding a copy in {hub_id}/, or use the digits data "
            f"set, which ships with scikit-learn"
        ) from err

_LABEL = "label"
_DIGITS_FEATURE = "x"
_DIGITS_TEST_FRACTION = 0.2
_DIGITS_EXAMPLES = 1797  # scikit-learn's load_digits: 8x8 images of 10 digits
# DirichletPartitioner re-draws (at most 10 times) until every partition has this many samples. A fixed 10 fails
# often for many small partitions or a small alpha (digits, 20 partitions, alpha 0.1: about one seed in four), so
# the bound is a tenth of the mean partition size, between 2 and 10 (10 for digits split 20 ways or fewer).
_DIRICHLET_MIN_SIZE_CAP = 10


@dataclass(frozen=True)
class DatasetSpec:
    """Shape of one sample and the number of classes of a data set.

    Attributes
    ----------
    input_shape : tuple[int, ...]
        Shape of one input tensor, without the batch dimension: ``(64,)`` for digits, ``(1, 28, 28)`` for MNIST,
        ``(3, 32, 32)`` for CIFAR-10.
    num_classes : int
        Number of labels; labels are ``0 .. num_classes - 1``.
    """

    input_shape: tuple[int, ...]
    num_classes: int


@dataclass(frozen=True)
class _HubSource:
    """Where a Hub data set lives and how its images become normalized tensors."""

    hub_id: str
    image_key: str
    mean: tuple[float, ...]
    std: tuple[float, ...]


_SPECS: dict[str, DatasetSpec] = {
    "digits": DatasetSpec(input_shape=(64,), num_classes=10),
    "mnist": DatasetSpec(input_shape=(1, 28, 28), num_classes=10),
    "cifar10": DatasetSpec(input_shape=(3, 32, 32), num_classes=10),
}

# Per-channel statistics of the training splits, as commonly used for these data sets.
_HUB_SOURCES: dict[str, _HubSource] = {
    "mnist": _HubSource(hub_id="ylecun/mnist", image_key="image", mean=(0.1307,), std=(0.3081,)),
    "cifar10": _HubSource(
        hub_id="uoft-cs/cifar10",
        image_key="img",
        mean=(0.4914, 0.4822, 0.4465),
        std=(0.2470, 0.2435, 0.2616),
    ),
}


def _check_dataset(name: str) -> None:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid datasets: {', '.join(DATASETS)}")


def dataset_spec(name: str) -> DatasetSpec:
    """Return the input shape and number of classes of a data set.

    Parameters
    ----------
    name : str
        One of :data:`DATASETS`.

    Returns
    -------
    DatasetSpec
        The shape of one sample (without batch dimension) and the number of classes.

    Raises
    ------
    ValueError
        If ``name`` is not a known data set; the message lists the valid ones.
    """
    _check_dataset(name)
    return _SPECS[name]


def load_partition(
    name: str,
    partition_id: int,
    num_partitions: int,
    *,
    partitioner: str = "iid",
    alpha: float = 0.5,
    classes_per_partition: int = 2,
    seed: int = 0,
    data_dir: str | os.PathLike[str] | None = None,
    validation_fraction: float = 0.0,
) -> TensorDataset:
    """Load one client's partition of a data set's training split.

    Parameters
    ----------
    name : str
        One of :data:`DATASETS`.
    partition_id : int
        The partition to load, ``0 <= partition_id < num_partitions``.
    num_partitions : int
        Number of partitions the training split is divided into.
    partitioner : str, default "iid"
        One of :data:`PARTITIONERS`: ``"iid"`` (equal random shares), ``"dirichlet"`` (per-class shares drawn
        from Dirichlet(``alpha``); smaller alpha, more skew) or ``"pathological"`` (every partition holds exactly
        ``classes_per_partition`` classes: class ``partition_id % num_classes`` and others drawn at random).
    alpha : float, default 0.5
        Dirichlet concentration; used by ``"dirichlet"`` only. Dirichlet draws are repeated until every partition
        has at least a tenth of the mean partition size (between 2 and 10 samples).
    classes_per_partition : int, default 2
        Classes per partition; used by ``"pathological"`` only.
    seed : int, default 0
        Seeds the partitioning (and, for digits, the train/test split; pass the same seed to
        :func:`load_test_set` so that the test set is disjoint from every partition; for the Hub data sets it seeds
        the shuffle of the training split).
    data_dir : str or os.PathLike, optional
        Root folder of local copies of Hub data sets (see the module docstring); defaults to the
        ``FEDROBUST_DATA_DIR`` environment variable, and when that is unset the Hub is used. Ignored for digits.
    validation_fraction : float, default 0.0
        Share of the training split held out for validation (:func:`load_validation_set`) before it is
        partitioned; 0 holds out nothing. Digits only.

    Returns
    -------
    TensorDataset
        ``(x, y)`` with ``x`` float32 of shape ``[n, *dataset_spec(name).input_shape]`` and ``y`` int64 of shape
        ``[n]``. The tensors are fresh copies; modifying them does not affect later calls.

    Raises
    ------
    ValueError
        For an unknown data set or partitioner (the message lists the valid ones), an out-of-range
        ``partition_id``, ``num_partitions``, ``alpha``, ``classes_per_partition`` or ``validation_fraction``, or
        when the Dirichlet partitioner cannot give every partition its minimum size.
    FileNotFoundError
        If ``data_dir`` is set but holds no copy of the requested Hub data set.
    """
    _check_dataset(name)
    _check_validation_fraction(name, validation_fraction)
    params = _partitioner_params(
        name, _SPECS[name].num_classes, partition_id, num_partitions, partitioner, alpha, classes_per_partition
    )
    # Digits ship with scikit-learn, so the arguments alone fix a partition: it is made once, then read from disk.
    key = None
    if name == "digits":
        key = _digits_key(
            "partition", seed, partition_id, num_partitions, partitioner, list(params), validation_fraction
        )
    if key is not None and (hit := array_cache.load(key)) is not None:
        return TensorDataset(torch.from_numpy(hit["x"]), torch.from_numpy(hit["y"]))
    load = _partition_loader(
        name, num_partitions, partitioner, params, seed, _resolve_data_dir(name, data_dir), validation_fraction
    )
    partition = _to_tensors(name, load(partition_id))
    if key is not None:
        array_cache.store(key, {"x": partition.tensors[0].numpy(), "y": partition.tensors[1].numpy()})
    return partition


def _partitioner_params(
    name: str,
    num_classes: int,
    partition_id: int,
    num_partitions: int,
    partitioner: str,
    alpha: float,
    classes_per_partition: int,
) -> tuple[float | int, ...]:
    """Check the partitioning arguments; the parameters the chosen partitioner uses (its cache key)."""
    if partitioner not in PARTITIONERS:
        raise ValueError(f"unknown partitioner {partitioner!r}; valid partitioners: {', '.join(PARTITIONERS)}")
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition_id must be in [0, {num_partitions}), got {partition_id}")
    # Only the parameters the chosen partitioner uses go into the cache key, so that e.g. two iid requests that
    # differ in the unused alpha share one partitioner.
    if partitioner == "dirichlet":
        if not alpha > 0:
            raise ValueError(f"alpha must be > 0 for the dirichlet partitioner, got {alpha}")
        return (float(alpha),)
    if partitioner == "pathological":
        if not 1 <= classes_per_partition <= num_classes:
            raise ValueError(
                f"classes_per_partition must be in [1, {num_classes}] for {name}, got {classes_per_partition}"
            )
        return (int(classes_per_partition),)
    return ()


# Index partitioners of user data sets, by (labels digest, num_partitions, partitioner, params, seed).
_INDEX_LOADERS: dict[tuple[object, ...], Callable[[int], datasets.Dataset]] = {}
_INDEX_LOADERS_MAX = 16


def partition_indices(
    labels: np.ndarray,
    partition_id: int,
    num_partitions: int,
    *,
    partitioner: str = "iid",
    alpha: float = 0.5,
    classes_per_partition: int = 2,
    seed: int = 0,
) -> np.ndarray:
    """Indices of partition ``partition_id`` of a data set given by its labels (e.g. a user's data set).

    The same flwr-datasets partitioners as :func:`load_partition` split a table of (index, label)
    rows, so any data set with integer labels is partitioned as the built-in ones are.

    Parameters
    ----------
    labels : numpy.ndarray
        ``[n]`` integer labels of the training set, ``0 .. num_classes - 1``.
    partition_id, num_partitions, partitioner, alpha, classes_per_partition, seed
        As in :func:`load_partition`.

    Returns
    -------
    numpy.ndarray
        int64 indices into ``labels``, in ascending order.
    """
    y = np.ascontiguousarray(labels, dtype=np.int64)
    params = _partitioner_params(
        "this data set", int(y.max()) + 1 if len(y) else 0, partition_id, num_partitions, partitioner, alpha,
        classes_per_partition,
    )
    key = (hashlib.sha256(y.tobytes()).hexdigest(), num_partitions, partitioner, params, seed)
    load = _INDEX_LOADERS.get(key)
    if load is None:
        import datasets

        table = datasets.Dataset.from_dict({"index": np.arange(len(y), dtype=np.int64), _LABEL: y})
        part = _make_partitioner(partitioner, num_partitions, params, len(y), seed)
        part.dataset = table
        load = part.load_partition
        load(0)  # assign now, so that a failing Dirichlet draw is never cached
        if len(_INDEX_LOADERS) >= _INDEX_LOADERS_MAX:
            _INDEX_LOADERS.clear()
        _INDEX_LOADERS[key] = load
    return np.sort(np.asarray(load(partition_id)["index"], dtype=np.int64))


def load_test_set(
    name: str,
    *,
    seed: int = 0,
    data_dir: str | os.PathLike[str] | None = None,
) -> TensorDataset:
    """Load the held-out test set of a data set, for centralized evaluation.

    Parameters
    ----------
    name : str
        One of :data:`DATASETS`.
    seed : int, default 0
        For digits, the seed of the train/test split: use the seed given to :func:`load_partition`. The Hub data
        sets have a fixed ``test`` split and ignore it.
    data_dir : str or os.PathLike, optional
        As in :func:`load_partition`.

    Returns
    -------
    TensorDataset
        ``(x, y)`` as in :func:`load_partition`. The test set is cached per process and the returned tensors are
        shared between calls: do not modify them in place.

    Raises
    ------
    ValueError
        If ``name`` is not a known data set.
    FileNotFoundError
        If ``data_dir`` is set but holds no copy of the requested Hub data set.
    """
    _check_dataset(name)
    resolved = _resolve_data_dir(name, data_dir)
    # The Hub test split does not depend on the seed; keying on it would only load the same split again.
    x, y = _test_tensors(name, seed if name == "digits" else 0, resolved)
    return TensorDataset(x, y)


def _resolve_data_dir(name: str, data_dir: str | os.PathLike[str] | None) -> str | None:
    """Return the local folder of a Hub data set, or None to use the Hub (and always for digits)."""
    if name not in _HUB_SOURCES:
        return None
    root = data_dir if data_dir is not None else os.environ.get(DATA_DIR_ENV) or None
    if root is None:
        return None
    path = Path(root) / _HUB_SOURCES[name].hub_id
    if not path.is_dir():
        raise FileNotFoundError(
            f"no local copy of {name} at {path}: put the {_HUB_SOURCES[name].hub_id} files (train-* and test-* "
            f"parquet) there, or unset {DATA_DIR_ENV} / data_dir to download from the Hugging Face Hub"
        )
    return str(path)


_Arrays = tuple[np.ndarray, np.ndarray]


def training_size(name: str, *, seed: int, validation_fraction: float = 0.0) -> int | None:
    """Examples in data set ``name``'s training split (minus the validation hold-out), where known without
    reading files that may live on the clients only (digits); None otherwise."""
    if name != "digits":
        return None
    if validation_fraction == 0:  # the split's size alone: no seed changes it, and no import of the splitters
        return _DIGITS_EXAMPLES - math.ceil(_DIGITS_TEST_FRACTION * _DIGITS_EXAMPLES)  # as train_test_split cuts
    return len(_digits_splits(seed, validation_fraction)[0])


@functools.lru_cache(maxsize=8)
def _digits_splits(seed: int, validation_fraction: float = 0.0) -> tuple[datasets.Dataset, _Arrays, _Arrays]:
    """The digits training split (minus the validation hold-out) as a Hugging Face dataset; the test split and
    the validation hold-out (empty when ``validation_fraction`` is 0) as arrays."""
    import datasets
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    # Pixel intensities are integers in 0..16.
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=_DIGITS_TEST_FRACTION, stratify=y, random_state=seed
    )
    keep, held = holdout_split(y_train, validation_fraction, seed)
    features = datasets.Features(
        {
            _DIGITS_FEATURE: datasets.Sequence(datasets.Value("float32"), length=x.shape[1]),
            _LABEL: datasets.ClassLabel(num_classes=_SPECS["digits"].num_classes),
        }
    )
    # Nothing held out: keep is 0 .. n-1, so the split is the one from before hold-outs existed.
    x_train, y_train, validation = x_train[keep], y_train[keep], (x_train[held], y_train[held])
    train = datasets.Dataset.from_dict({_DIGITS_FEATURE: x_train, _LABEL: y_train}, features=features)
    return train, (x_test, y_test), validation


def holdout_split(labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split sample indices into (kept, held out), stratified: ``round(fraction * count)`` of every class held out.

    Parameters
    ----------
    labels : numpy.ndarray
        ``[n]`` integer labels.
    fraction : float
        Share held out, in ``[0, 1)``; 0 holds out nothing.
    seed : int
        Seeds which samples of each class are held out.

    Returns
    -------
    tuple of numpy.ndarray
        Both int64 index arrays in ascending order; together they are ``0 .. n-1``.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"validation_fraction must be in [0, 1), got {fraction}")
    y = np.asarray(labels)
    held = np.zeros(len(y), dtype=bool)
    if fraction > 0:
        # Its own stream: the hold-out must not shift any other draw made from the seed.
        rng = np.random.default_rng([seed, 0x7A1])
        for label in np.unique(y):
            members = np.flatnonzero(y == label)
            held[rng.choice(members, size=int(round(fraction * len(members))), replace=False)] = True
    return np.flatnonzero(~held).astype(np.int64), np.flatnonzero(held).astype(np.int64)


def _check_validation_fraction(name: str, fraction: float) -> None:
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"validation_fraction must be in [0, 1), got {fraction}")
    if fraction > 0 and name != "digits":
        raise ValueError(
            f"a validation hold-out is built for digits and for dataset._target_ loaders, not for {name}; "
            "set validation_fraction=0"
        )


def load_validation_set(name: str, *, fraction: float, seed: int = 0) -> TensorDataset:
    """The validation hold-out of a data set's training split: the samples no partition holds.

    Parameters
    ----------
    name : str
        One of :data:`DATASETS`; the hold-out is built for ``digits``.
    fraction : float
        Share of the training split held out, in ``(0, 1)``, as given to :func:`load_partition`.
    seed : int, default 0
        As given to :func:`load_partition`.

    Returns
    -------
    TensorDataset
        ``(x, y)`` as in :func:`load_partition`, disjoint from every partition and from the test set.

    Raises
    ------
    ValueError
        For an unknown data set, a data set without a hold-out, or ``fraction`` outside ``(0, 1)``.
    """
    _check_dataset(name)
    _check_validation_fraction(name, fraction)
    if fraction == 0:
        raise ValueError("validation_fraction is 0: nothing is held out, so there is no validation set")
    key = _digits_key("validation", seed, fraction)
    hit = array_cache.load(key)
    if hit is None:
        _, _, (x, y) = _digits_splits(seed, fraction)
        hit = {"x": x, "y": y}
        array_cache.store(key, hit)
    return TensorDataset(torch.from_numpy(hit["x"].copy()), torch.from_numpy(hit["y"].copy()))


def _digits_key(what: str, seed: int, *arguments: object) -> dict[str, object]:
    """The cache key of a digits array: its arguments, this module's code and the libraries that make it."""
    return {"kind": f"digits-{what}", "seed": seed, "arguments": list(arguments), **_digits_makers()}


@functools.cache
def _digits_makers() -> dict[str, object]:
    """What else fixes the digits arrays: this module's source (an edit to the split or the partitioning
    must not meet arrays made before it) and the versions of the libraries that load and partition them."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "-"

    return {
        "source": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
        "versions": [installed(p) for p in ("scikit-learn", "datasets", "flwr-datasets", "numpy")],
    }


def _make_partitioner(
    partitioner: str,
    num_partitions: int,
    params: tuple[float | int, ...],
    num_rows: int | None,
    seed: int,
) -> Partitioner:
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, PathologicalPartitioner

    if partitioner == "iid":
        return IidPartitioner(num_partitions=num_partitions)
    if partitioner == "dirichlet":
        # num_rows is unknown before a Hub data set is loaded; then the cap applies (those splits are large).
        mean_size = (num_rows // num_partitions) if num_rows is not None else 10 * _DIRICHLET_MIN_SIZE_CAP
        min_size = max(2, min(_DIRICHLET_MIN_SIZE_CAP, mean_size // 10))
        return DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by=_LABEL,
            alpha=params[0],
            min_partition_size=min_size,
            seed=seed,
        )
    return PathologicalPartitioner(
        num_partitions=num_partitions,
        partition_by=_LABEL,
        num_classes_per_partition=int(params[0]),
        # Partition i always holds class i mod num_classes (the rest are drawn at random), as in Li et al. 2022,
        # so with at least as many partitions as classes no class is left out of training.
        class_assignment_mode="first-deterministic",
        seed=seed,
    )


@functools.lru_cache(maxsize=32)
def _partition_loader(
    name: str,
    num_partitions: int,
    partitioner: str,
    params: tuple[float | int, ...],
    seed: int,
    data_dir: str | None,
    validation_fraction: float = 0.0,
) -> Callable[[int], datasets.Dataset]:
    """Build (once per configuration) the function that returns one partition as a Hugging Face dataset."""
    load: Callable[[int], datasets.Dataset]
    if name == "digits":
        train, _, _ = _digits_splits(seed, validation_fraction)
        part = _make_partitioner(partitioner, num_partitions, params, train.num_rows, seed)
        part.dataset = train
        load = part.load_partition
    else:
        part = _make_partitioner(partitioner, num_partitions, params, None, seed)
        fds = _federated_dataset(name, {"train": part}, shuffle=True, seed=seed, data_dir=data_dir)
        load = functools.partial(fds.load_partition, split="train")
    # Partitioners assign samples lazily, on the first request, from an RNG they advance. Doing it here means a
    # failure (Dirichlet out of retries) is raised before anything is cached, so every later call rebuilds from
    # the seed and fails or succeeds the same way.
    try:
        with _from_hub(name) if name != "digits" and data_dir is None else contextlib.nullcontext():
            load(0)
    except ValueError as err:
        if partitioner != "dirichlet":
            raise
        raise ValueError(
            f"dirichlet partitioning of {name} into {num_partitions} partitions with alpha={params[0]} (seed "
            f"{seed}) could not give every partition its minimum size; use a larger alpha or fewer partitions "
            f"({err})"
        ) from err
    logger.info(
        "built %s partitioner for %s: %d partitions, params %s, seed %d",
        partitioner,
        name,
        num_partitions,
        params,
        seed,
    )
    return load


def _federated_dataset(
    name: str,
    partitioners: dict[str, Partitioner | int],
    *,
    shuffle: bool,
    seed: int,
    data_dir: str | None,
) -> FederatedDataset:
    """Return a FederatedDataset over the Hub data set, or over its local copy when ``data_dir`` is set."""
    from flwr_datasets import FederatedDataset

    # datasets.load_dataset takes a Hub id or a local folder in the same argument.
    source = data_dir if data_dir is not None else _HUB_SOURCES[name].hub_id
    return FederatedDataset(dataset=source, partitioners=partitioners, shuffle=shuffle, seed=seed)


@functools.lru_cache(maxsize=4)
def _test_tensors(name: str, seed: int, data_dir: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "digits":
        key = _digits_key("test", seed)
        hit = array_cache.load(key)
        if hit is None:
            _, (x, y), _ = _digits_splits(seed)
            hit = {"x": x, "y": y}
            array_cache.store(key, hit)
        return torch.from_numpy(hit["x"].copy()), torch.from_numpy(hit["y"].copy())
    # Only the test split is read; FederatedDataset requires a partitioner, and one partition of it is unused.
    fds = _federated_dataset(name, {"train": 1}, shuffle=False, seed=seed, data_dir=data_dir)
    with _from_hub(name) if data_dir is None else contextlib.nullcontext():
        test = fds.load_split("test")
    return _to_tensors(name, test).tensors  # type: ignore[return-value]


def _to_tensors(name: str, split: datasets.Dataset) -> TensorDataset:
    """Convert a Hugging Face dataset of one of our data sets to normalized ``(x, y)`` tensors."""
    spec = _SPECS[name]
    if name == "digits":
        columns = split.with_format("numpy")[:]
        x = torch.from_numpy(np.ascontiguousarray(columns[_DIGITS_FEATURE], dtype=np.float32))
    else:
        source = _HUB_SOURCES[name]
        columns = split.with_format("numpy")[:]
        images = columns[source.image_key]
        if images.dtype != np.uint8 or images.ndim not in (3, 4):
            # e.g. an object array when the images differ in size
            raise ValueError(
                f"{name}: expected equally sized uint8 images, got an array of dtype {images.dtype} and shape "
                f"{images.shape}"
            )
        x = torch.from_numpy(images).float().div_(255.0)
        # Grayscale images arrive as [n, H, W], colour ones as [n, H, W, C]; the models take [n, C, H, W].
        x = x.unsqueeze(1) if x.dim() == 3 else x.permute(0, 3, 1, 2)
        if x.shape[1:] != spec.input_shape:
            raise ValueError(f"{name}: expected images of shape {spec.input_shape}, got {tuple(x.shape[1:])}")
        mean = torch.tensor(source.mean).view(-1, 1, 1)
        std = torch.tensor(source.std).view(-1, 1, 1)
        x = ((x - mean) / std).contiguous()
    y = torch.from_numpy(np.asarray(columns[_LABEL], dtype=np.int64))
    return TensorDataset(x, y)


def _user_inputs(x: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A user data set's inputs from a device file: integers (e.g. token ids for an nn.Embedding, stored as
    uint16 to save space) as they are, anything else as float32; fedrobust.components then gives them the
    dtype of the data set's training inputs."""
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x.astype(np.float32) if x.dtype == object else x)
    return x if not x.is_floating_point() and x.dtype != torch.bool else x.float()


def load_local(path: str | os.PathLike[str], name: str | DatasetSpec) -> TensorDataset:
    """A device's own data set, prepared beforehand on the device (deployment).

    Parameters
    ----------
    path : str or PathLike
        One of:

        - a ``.npz`` file with arrays ``x`` and ``y``;
        - a ``.safetensors`` file with tensors ``x`` and ``y``;
        - a directory written by :meth:`datasets.Dataset.save_to_disk` with the columns of data set
          ``name`` (e.g. ``x`` and ``label`` for digits, as :func:`load_partition` reads them).

        ``x`` must have the input shape of data set ``name`` (e.g. 64 features for digits) and
        ``y`` integer labels in ``[0, num_classes)``; ``x`` is used as given (normalise it as the
        central data set is), as float32, except that a user data set's (a ``DatasetSpec``'s) int32 or
        int64 ``x`` (e.g. token ids) keeps its dtype.
    name : str or DatasetSpec
        The configured data set, whose input shape and classes the model was built for; a user data set
        (``dataset._target_``) is given by its spec, and its ``save_to_disk`` directory has the columns
        ``x`` and ``label`` (or ``y``).

    Raises
    ------
    ValueError
        A missing path, an unknown format, missing arrays, or shapes and labels that do not fit ``name``.
    """
    spec = name if isinstance(name, DatasetSpec) else dataset_spec(name)
    label = "the data set" if isinstance(name, DatasetSpec) else name
    where = Path(path)
    if not where.exists():
        raise ValueError(f"data-path {str(where)!r} does not exist")
    if where.is_dir() and isinstance(name, DatasetSpec):
        import datasets

        table = datasets.load_from_disk(str(where)).with_format("numpy")
        column = next((c for c in (_LABEL, "y") if c in table.column_names), None)
        if _DIGITS_FEATURE not in table.column_names or column is None:
            raise ValueError(f"{where}: a save_to_disk directory needs columns 'x' and 'label' (or 'y'), "
                             f"found {table.column_names}")
        x = _user_inputs(np.asarray(table[_DIGITS_FEATURE]))
        y = torch.from_numpy(np.asarray(table[column], dtype=np.int64))
    elif where.is_dir():
        import datasets

        assert isinstance(name, str)  # a DatasetSpec directory is read above
        x, y = _to_tensors(name, datasets.load_from_disk(str(where))).tensors
    elif where.suffix == ".npz":
        with np.load(where, allow_pickle=False) as arrays:
            if not {"x", "y"} <= set(arrays.files):
                raise ValueError(f"{where}: an .npz data file needs arrays 'x' and 'y', found {arrays.files}")
            if isinstance(name, DatasetSpec):
                x = _user_inputs(arrays["x"])
            else:
                x = torch.from_numpy(arrays["x"].astype(np.float32))
            y = torch.from_numpy(arrays["y"].astype(np.int64))
    elif where.suffix == ".safetensors":
        from safetensors.torch import load_file

        tensors = load_file(str(where))
        if not {"x", "y"} <= set(tensors):
            raise ValueError(f"{where}: a .safetensors data file needs tensors 'x' and 'y', found {sorted(tensors)}")
        x = _user_inputs(tensors["x"]) if isinstance(name, DatasetSpec) else tensors["x"].float()
        y = tensors["y"].long()
    else:
        raise ValueError(f"{where}: unknown data format; use a .npz or .safetensors file or a save_to_disk directory")
    if tuple(x.shape[1:]) != tuple(spec.input_shape) or len(x) != len(y) or len(y) == 0:
        raise ValueError(
            f"{where}: x of shape {tuple(x.shape)} and y of shape {tuple(y.shape)} do not fit {label} "
            f"(x [n, {', '.join(map(str, spec.input_shape))}], y [n], n >= 1)"
        )
    if int(y.min()) < 0 or int(y.max()) >= spec.num_classes:
        raise ValueError(f"{where}: labels must be in [0, {spec.num_classes}), got [{int(y.min())}, {int(y.max())}]")
    return TensorDataset(x.contiguous(), y.contiguous())
