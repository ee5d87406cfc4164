"""A user's own torch Dataset and model: random transforms, integer inputs, dict items, batch norm.

The loaders and models named by ``_target_`` below live in this module (``tests.unit.test_user_datasets``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from fedrobust import components, data, training
from fedrobust.config import from_flat
from fedrobust.run_setup import validate

HERE = "tests.unit.test_user_datasets"
VOCAB, LENGTH = 50, 6


class Items(Dataset):
    """A Dataset returning ``make(i)`` for item i."""

    def __init__(self, n: int, make) -> None:  # type: ignore[no-untyped-def]
        self.n, self.make = n, make

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.make(i)


def _tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, LENGTH), generator=g), torch.randint(0, 3, (n,), generator=g)


def load_tokens(seed: int = 0) -> tuple[Dataset, Dataset]:
    """Token ids (LongTensor) and labels, as an NLP user's Dataset yields them."""
    (x, y), (tx, ty) = _tokens(40, seed), _tokens(10, seed + 1)
    return Items(40, lambda i: (x[i], int(y[i]))), Items(10, lambda i: (tx[i], int(ty[i])))


class TokenNet(nn.Module):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, 8)
        self.out = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.bag(x))


def _tokens_cfg(**extra: object):  # type: ignore[no-untyped-def]
    return from_flat(
        {
            "num_clients": 2,
            "clients_per_round": 2,
            "num_byzantine": 0,
            "model._target_": f"{HERE}.TokenNet",
            "dataset._target_": f"{HERE}.load_tokens",
            **extra,
        }
    )


# ------------------------------------------------------------------------ random transforms (1)
def test_a_random_transform_in_getitem_is_reported_once(caplog: pytest.LogCaptureFixture) -> None:
    noisy = Items(8, lambda i: (torch.full((3,), float(i)) + torch.rand(3), i % 2))
    with caplog.at_level(logging.WARNING, logger="fedrobust.components"):
        components._as_tensors(noisy, "training")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "read once into tensors" in warnings[0] and "random transforms in __getitem__" in warnings[0]


def test_a_fixed_dataset_gives_no_warning_and_the_check_leaves_the_rng_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    plain = Items(8, lambda i: (torch.tensor([float(i), float("nan")]), i % 2))
    with caplog.at_level(logging.WARNING, logger="fedrobust.components"):
        components._as_tensors(plain, "training")
    assert not caplog.records  # NaN where both reads have NaN is the same input

    noisy = Items(8, lambda i: (torch.rand(3), i % 2))
    torch.manual_seed(3)
    [noisy[i] for i in range(8)]
    expected = torch.get_rng_state()
    torch.manual_seed(3)
    components._as_tensors(noisy, "training")  # the second read of item 0 draws from a forked generator
    assert torch.equal(torch.get_rng_state(), expected)


# ------------------------------------------------------------------------ integer inputs (2)
@pytest.mark.parametrize(
    "dtype,expected",
    [
        (torch.int64, torch.int64),
        (torch.int32, torch.int32),
        (torch.float64, torch.float32),
        (torch.float16, torch.float32),
        (torch.uint8, torch.float32),  # pixels and masks feed Linear/Conv layers, as before
        (torch.bool, torch.float32),
    ],
)
def test_input_dtypes_as_a_model_gets_them(dtype: torch.dtype, expected: torch.dtype) -> None:
    x = torch.arange(12).reshape(4, 3).to(dtype)
    y = torch.tensor([0, 1, 0, 1])
    for split in (TensorDataset(x, y), Items(4, lambda i: (x[i], int(y[i])))):
        got = components._as_tensors(split, "training").tensors[0]
        assert got.dtype == expected
        assert torch.equal(got, x.to(expected))


def test_an_embedding_model_on_token_ids_validates_and_trains() -> None:
    cfg = validate(_tokens_cfg())
    spec = components.dataset_spec(cfg)
    assert spec.input_shape == (LENGTH,) and getattr(spec, "input_dtype", None) == torch.int64
    part = components.load_partition(cfg, 0, 2)
    assert part.tensors[0].dtype == torch.int64
    torch.manual_seed(0)
    net = components.build_model(cfg.model, spec)
    metrics = training.train(net, part, epochs=1, batch_size=8, lr=0.1, device="cpu", seed=0)
    assert metrics["num_examples"] == len(part)


class PickyNet(TokenNet):
    def __init__(self, num_classes: int, width: int = 8) -> None:
        if not isinstance(width, int):
            raise TypeError("width must be an int")
        super().__init__(num_classes)


def test_a_model_whose_constructor_raises_is_named_with_the_call_and_the_error_type() -> None:
    cfg = _tokens_cfg(**{"model._target_": f"{HERE}.PickyNet", "model.params": '{"width": "abc"}'})
    with pytest.raises(ValueError, match=r"PickyNet\(width='abc', num_classes=3\) raised TypeError: width must be "
                                         r"an int \(dataset: "):
        validate(cfg)


def test_the_model_check_names_the_dtype_it_fed() -> None:
    float_spec = data.DatasetSpec(input_shape=(LENGTH,), num_classes=3)
    with pytest.raises(ValueError, match=r"shape \[2, 6\] and dtype torch\.float32"):
        components.check_model(TokenNet(3), float_spec)
    components.check_model(TokenNet(3), components.UserSpec((LENGTH,), 3, torch.int64))


def test_a_device_file_of_token_ids_keeps_them(tmp_path: Path) -> None:
    cfg = _tokens_cfg()
    x, y = _tokens(5, 9)
    np.savez(tmp_path / "ids.npz", x=x.numpy().astype(np.int32), y=y.numpy())
    local = components.load_local(str(tmp_path / "ids.npz"), cfg)
    assert local.tensors[0].dtype == torch.int64 and torch.equal(local.tensors[0], x)
    for small in (np.uint16, np.uint8, np.int16):  # ids stored small to save space are ids too
        np.savez(tmp_path / "small.npz", x=x.numpy().astype(small), y=y.numpy())
        local = components.load_local(str(tmp_path / "small.npz"), cfg)
        assert local.tensors[0].dtype == torch.int64 and torch.equal(local.tensors[0], x), small
    np.savez(tmp_path / "floats.npz", x=x.numpy().astype(np.float32), y=y.numpy())
    with pytest.raises(ValueError, match="float inputs.*torch.int64"):
        components.load_local(str(tmp_path / "floats.npz"), cfg)


def load_floats(seed: int = 0) -> tuple[Dataset, Dataset]:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.rand(20, 3, generator=g), torch.arange(20) % 2), TensorDataset(
        torch.rand(4, 3, generator=g), torch.arange(4) % 2
    )


def test_a_float_data_set_reads_integer_device_files_as_float(tmp_path: Path) -> None:
    spec = data.DatasetSpec(input_shape=(3,), num_classes=2)
    np.savez(tmp_path / "d.npz", x=np.ones((4, 3), dtype=np.int64), y=np.zeros(4, dtype=np.int64))
    assert data.load_local(tmp_path / "d.npz", spec).tensors[0].dtype == torch.int64  # the caller decides
    cfg = from_flat({"dataset._target_": f"{HERE}.load_floats"})
    assert components.load_local(str(tmp_path / "d.npz"), cfg).tensors[0].dtype == torch.float32
    np.savez(tmp_path / "f.npz", x=np.ones((4, 3)), y=np.zeros(4, dtype=np.int64))
    assert data.load_local(tmp_path / "f.npz", spec).tensors[0].dtype == torch.float32


# ------------------------------------------------------------------------ dict and longer items (3)
def test_dict_items_with_the_hugging_face_column_names_are_read() -> None:
    x = torch.randn(5, 4)
    for x_key, y_key in (("x", "label"), ("image", "y"), ("features", "labels")):
        split = Items(5, lambda i, xk=x_key, yk=y_key: {xk: x[i], yk: i % 2, "id": i})
        got_x, got_y = components._as_tensors(split, "training").tensors
        assert torch.equal(got_x, x) and got_y.tolist() == [0, 1, 0, 1, 0]


def test_dict_items_without_those_names_are_refused_naming_the_keys() -> None:
    split = Items(3, lambda i: {"input_ids": torch.zeros(2), "target": 0})
    with pytest.raises(ValueError) as err:
        components._as_tensors(split, "training")
    message = str(err.value)
    assert "dicts with keys ['input_ids', 'target']" in message
    assert "(x or image or img or features)" in message and "(label or y or labels)" in message


def test_items_of_three_elements_are_refused() -> None:
    split = Items(3, lambda i: (torch.zeros(2), 0, 0.5))
    with pytest.raises(ValueError, match="tuples of 3 elements.*sample weights are not used"):
        components._as_tensors(split, "training")


def test_a_dict_for_a_split_is_refused_as_such() -> None:
    with pytest.raises(ValueError, match="the training set is a dict"):
        components._as_tensors({"x": torch.zeros(3, 2), "y": torch.zeros(3)}, "training")


def test_a_bad_item_is_reported_with_its_error_type() -> None:
    with pytest.raises(ValueError, match="the training set's items are not .*TypeError"):
        components._as_tensors(Items(2, lambda i: (torch.zeros(2), "cat")), "training")


@pytest.mark.parametrize("label", [lambda i: i + 0.5, lambda i: np.float32(i + 0.5), lambda i: torch.tensor(i + 0.5)])
def test_labels_that_are_not_whole_numbers_are_refused_not_truncated(label) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="the training set's labels are not integers"):
        components._as_tensors(Items(4, lambda i: (torch.zeros(2), label(i))), "training")


@pytest.mark.parametrize("label", [lambda i: i, lambda i: float(i), lambda i: np.int64(i), lambda i: torch.tensor([i])])
def test_whole_labels_of_any_type_are_read_as_integers(label) -> None:  # type: ignore[no-untyped-def]
    y = components._as_tensors(Items(4, lambda i: (torch.zeros(2), label(i))), "training").tensors[1]
    assert y.dtype == torch.int64 and y.tolist() == [0, 1, 2, 3]


def load_labels_from_one(seed: int = 0) -> tuple[Dataset, Dataset]:
    """Labels 1 .. 3, as a data set that counts classes from 1 gives them."""
    return Items(6, lambda i: (torch.full((2,), float(i)), i % 3 + 1)), Items(3, lambda i: (torch.zeros(2), i + 1))


def test_labels_that_start_at_1_are_named_in_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    components._load_user.cache_clear()
    with caplog.at_level(logging.WARNING, logger="fedrobust"):
        loaded = components._load_user(f"{HERE}.load_labels_from_one", "{}", 0)
    assert loaded.spec.num_classes == 4
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("no example of label 0 of 0 .. 3: the model gets 4 outputs" in w and "subtract 1" in w
               for w in warnings), warnings


# ------------------------------------------------------------------------ batch norm (5)
def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _blobs(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(n)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))


def test_batch_norm_with_a_last_batch_of_one_drops_that_sample(caplog: pytest.LogCaptureFixture) -> None:
    training._logged.clear()
    with caplog.at_level(logging.WARNING, logger="fedrobust.training"):
        for seed in range(2):
            metrics = training.train(_bn_net(), _blobs(17), epochs=2, batch_size=8, lr=0.1, device="cpu", seed=seed)
            assert metrics["num_examples"] == 17 and 0 <= metrics["accuracy"] <= 1
    said = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(said) == 1 and "last batch of 1" in said[0]
    # The same seed gives the same bytes.
    a, b = _bn_net(), _bn_net()
    for net in (a, b):
        training.train(net, _blobs(17), epochs=2, batch_size=8, lr=0.1, device="cpu", seed=5)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_the_drop_applies_only_to_batch_norm_and_a_last_batch_of_one() -> None:
    class Sees(nn.Module):
        """Counts the samples it is trained on."""

        def __init__(self, norm: bool) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 2), *([nn.BatchNorm1d(2)] if norm else []))
            self.seen = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen += len(x)
            return self.body(x)

    for norm, n, seen in ((True, 17, 16), (False, 17, 17), (True, 18, 18), (True, 16, 16)):
        net = Sees(norm)
        training.train(net, _blobs(n), epochs=1, batch_size=8, lr=0.1, device="cpu", seed=0)
        assert net.seen == seen, (norm, n)

    class Conv(nn.Module):
        """BatchNorm2d, as the built-in resnet: one sample has 2x2 values per channel, it trains on all 17."""

        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(8, 2))
            self.seen = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen += len(x)
            return self.body(x.reshape(-1, 1, 2, 2))

    conv = Conv()
    training.train(conv, _blobs(17), epochs=1, batch_size=8, lr=0.1, device="cpu", seed=0)
    assert conv.seen == 17


def test_the_shapes_a_batch_norm_sees_decide_the_drop_not_its_type() -> None:
    """BatchNorm2d after global pooling sees 1x1 maps (one value per channel on one sample, as a ResNet's
    head): it fails on a lone last sample, which is left out; BatchNorm1d on sequences trains on it."""

    class Net(nn.Module):
        def __init__(self, body: nn.Module, shape: tuple[int, ...]) -> None:
            super().__init__()
            self.body, self.shape, self.seen = body, shape, 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen += len(x)
            return self.body(x.reshape(-1, *self.shape))

    pooled = nn.Sequential(
        nn.Conv2d(1, 3, 1), nn.AdaptiveAvgPool2d(1), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(3, 2)
    )
    sequence = nn.Sequential(nn.Conv1d(1, 3, 1), nn.BatchNorm1d(3), nn.Flatten(), nn.Linear(12, 2))
    for body, shape, seen in ((pooled, (1, 2, 2), 16), (sequence, (1, 4), 17)):
        net = Net(body, shape)
        training.train(net, _blobs(17), epochs=1, batch_size=8, lr=0.1, device="cpu", seed=0)
        assert net.seen == seen, body
        assert not any(m._forward_pre_hooks for m in net.modules())  # the probe leaves no hook behind

    class Frozen(Net):
        """Fine-tuning with the batch norm frozen (eval mode, its running statistics): one sample is fine."""

        def train(self, mode: bool = True) -> Frozen:
            super().train(mode)
            self.body[2].eval()
            return self

    frozen = Frozen(nn.Sequential(nn.Conv2d(1, 3, 1), nn.AdaptiveAvgPool2d(1), nn.BatchNorm2d(3), nn.Flatten(),
                                  nn.Linear(3, 2)), (1, 2, 2))
    training.train(frozen, _blobs(17), epochs=1, batch_size=8, lr=0.1, device="cpu", seed=0)
    assert frozen.seen == 17
