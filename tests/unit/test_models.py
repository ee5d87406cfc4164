"""Tests for fedrobust.models: registry, shapes, sizes, seeded initialization and errors."""

from __future__ import annotations

import pytest
import torch

from fedrobust import models
from fedrobust.data import dataset_spec

# Each model with the data set it is meant for, and bounds on its parameter count.
MODEL_CASES = [
    ("mlp", "digits", 1_000, 10_000),
    ("cnn", "mnist", 50_000, 500_000),
    ("resnet", "cifar10", 200_000, 1_000_000),
]


def test_names() -> None:
    assert models.names() == ["cnn", "mlp", "resnet"]


@pytest.mark.parametrize(("name", "dataset", "min_params", "max_params"), MODEL_CASES)
def test_output_shape_and_size(name: str, dataset: str, min_params: int, max_params: int) -> None:
    spec = dataset_spec(dataset)
    model = models.build_model(name, input_shape=spec.input_shape, num_classes=spec.num_classes)
    out = model(torch.randn(3, *spec.input_shape))
    assert out.shape == (3, spec.num_classes) and out.dtype == torch.float32
    assert min_params <= sum(p.numel() for p in model.parameters()) <= max_params


@pytest.mark.parametrize(("name", "dataset"), [(case[0], case[1]) for case in MODEL_CASES])
def test_initialization_is_seeded_by_caller(name: str, dataset: str) -> None:
    spec = dataset_spec(dataset)

    def build(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        return models.build_model(name, input_shape=spec.input_shape, num_classes=spec.num_classes).state_dict()

    first, again, other = build(0), build(0), build(1)
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert any(not torch.equal(first[k], other[k]) for k in first)


def test_resnet_state_dict_holds_batchnorm_buffers() -> None:
    model = models.build_model("resnet", input_shape=(3, 32, 32), num_classes=10)
    state = model.state_dict()
    tracked = [k for k in state if k.endswith("num_batches_tracked")]
    assert tracked and all(state[k].dtype == torch.int64 for k in tracked)
    assert any(k.endswith("running_mean") for k in state) and any(k.endswith("running_var") for k in state)


def test_model_options() -> None:
    mlp = models.build_model("mlp", input_shape=(64,), num_classes=10, hidden=(32, 16))
    assert [m.out_features for m in mlp.modules() if isinstance(m, torch.nn.Linear)] == [32, 16, 10]
    resnet = models.build_model(
        "resnet", input_shape=(1, 28, 28), num_classes=7, widths=(8, 16), blocks_per_stage=2
    )
    assert resnet(torch.randn(2, 1, 28, 28)).shape == (2, 7)
    # mlp flattens any input shape
    assert models.build_model("mlp", input_shape=(1, 8, 8), num_classes=10)(torch.randn(2, 1, 8, 8)).shape == (2, 10)


def test_unknown_model_names_valid_choices() -> None:
    with pytest.raises(ValueError, match="'vit'.*cnn, mlp, resnet"):
        models.build_model("vit", input_shape=(64,), num_classes=10)


def test_unknown_option_names_valid_options() -> None:
    with pytest.raises(ValueError, match="no option.*depth.*channels, hidden"):
        models.build_model("cnn", input_shape=(1, 28, 28), num_classes=10, depth=3)


@pytest.mark.parametrize(
    ("name", "input_shape", "num_classes"),
    [("cnn", (64,), 10), ("resnet", (3, 2, 2), 10), ("mlp", (64,), 0), ("mlp", (), 10)],
)
def test_invalid_shapes(name: str, input_shape: tuple[int, ...], num_classes: int) -> None:
    with pytest.raises(ValueError, match=repr(name)):
        models.build_model(name, input_shape=input_shape, num_classes=num_classes)
