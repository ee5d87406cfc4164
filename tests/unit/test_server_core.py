"""Server-side core pieces: update validation, flatten/unflatten, server optimizers."""

from __future__ import annotations

import math

import pytest
import torch

from fedrobust.server_optim import NAMES, ServerOptimizer, lr_factor
from fedrobust.tensors import flatten, float_keys, unflatten
from fedrobust.validation import check_update


def _template() -> dict[str, torch.Tensor]:
    return {
        "w": torch.zeros(3, 2),
        "b": torch.zeros(2),
        "bn.num_batches_tracked": torch.tensor(0, dtype=torch.int64),
    }


def _check(update, **kw):
    args = {"num_examples": 10, "max_norm": 10.0, "max_num_examples": 1000, **kw}
    return check_update(update, _template(), **args)


def test_valid_update_passes() -> None:
    assert _check({"w": torch.ones(3, 2), "b": torch.ones(2), "bn.num_batches_tracked": torch.tensor(3)}) is None


@pytest.mark.parametrize(
    "mutate,reason",
    [
        (lambda u: u.pop("b"), "wrong_keys"),
        (lambda u: u.update(extra=torch.zeros(1)), "wrong_keys"),
        (lambda u: u.update(w=torch.zeros(2, 3)), "wrong_shape"),
        (lambda u: u.update(w=torch.zeros(3, 2, dtype=torch.float64)), "wrong_dtype"),
        (lambda u: u["w"].__setitem__((0, 0), float("nan")), "non_finite"),
        (lambda u: u["b"].__setitem__(1, float("inf")), "non_finite"),
        (lambda u: u.update(w=torch.full((3, 2), 100.0)), "norm_too_large"),
    ],
)
def test_each_defect_is_rejected_with_its_reason(mutate, reason) -> None:
    update = {k: v.clone() for k, v in _template().items()}
    mutate(update)
    rejection = _check(update)
    assert rejection is not None and rejection.reason == reason and rejection.detail


@pytest.mark.parametrize("n", [0, -3, 1001, 2.5, math.nan, math.inf])
def test_num_examples_outside_bounds_is_rejected(n) -> None:
    rejection = _check(_template(), num_examples=n)
    assert rejection is not None and rejection.reason == "bad_num_examples"


def test_norm_check_can_be_disabled() -> None:
    big = {**_template(), "w": torch.full((3, 2), 1e6)}
    assert _check(big) is not None and _check(big, max_norm=0) is None


def test_flatten_unflatten_round_trip_skips_integer_buffers() -> None:
    rows = [{"w": torch.randn(3, 2), "b": torch.randn(2), "bn.num_batches_tracked": torch.tensor(1)} for _ in range(4)]
    keys = float_keys(rows[0])
    assert keys == ["w", "b"]
    matrix = flatten(rows, keys)
    assert matrix.shape == (4, 8)
    back = unflatten(matrix[2], rows[0], keys)
    assert torch.equal(back["w"], rows[2]["w"]) and torch.equal(back["b"], rows[2]["b"])
    with pytest.raises(ValueError):
        unflatten(matrix[0, :5], rows[0], keys)


def test_fedavg_lr_one_adds_the_update() -> None:
    opt = ServerOptimizer("fedavg", lr=1.0)
    params = {"w": torch.ones(3)}
    new = opt.step(params, {"w": torch.tensor([1.0, -1.0, 0.5])})
    assert torch.equal(new["w"], torch.tensor([2.0, 0.0, 1.5]))


def test_fedavgm_accumulates_momentum() -> None:
    opt = ServerOptimizer("fedavgm", lr=1.0, momentum=0.5)
    p = {"w": torch.zeros(1)}
    p = opt.step(p, {"w": torch.ones(1)})
    p = opt.step(p, {"w": torch.ones(1)})
    assert torch.allclose(p["w"], torch.tensor([1.0 + 1.5]))


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_continues_exactly(name: str) -> None:
    torch.manual_seed(0)
    updates = [{"w": torch.randn(5)} for _ in range(4)]
    straight = ServerOptimizer(name, lr=0.1)
    p = {"w": torch.zeros(5)}
    for u in updates:
        p = straight.step(p, u)

    first = ServerOptimizer(name, lr=0.1)
    q = {"w": torch.zeros(5)}
    for u in updates[:2]:
        q = first.step(q, u)
    tensors, meta = first.state_dict()
    resumed = ServerOptimizer(name, lr=0.1)
    resumed.load_state_dict({k: v.clone() for k, v in tensors.items()}, meta)
    for u in updates[2:]:
        q = resumed.step(q, u)
    assert torch.equal(p["w"], q["w"])


def test_adaptive_optimizers_move_along_the_update() -> None:
    for name in ("fedadam", "fedyogi"):
        opt = ServerOptimizer(name, lr=0.1)
        new = opt.step({"w": torch.zeros(2)}, {"w": torch.tensor([1.0, -1.0])})
        assert new["w"][0] > 0 > new["w"][1]


@pytest.mark.parametrize(
    "kwargs,match", [({"name": "sgd"}, "valid choices"), ({"lr": 0}, "lr"), ({"momentum": 1.0}, "momentum")]
)
def test_bad_optimizer_settings_are_rejected(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        ServerOptimizer(**kwargs)


def test_loading_state_of_another_optimizer_is_refused() -> None:
    tensors, meta = ServerOptimizer("fedadam").state_dict()
    with pytest.raises(ValueError, match="fedadam"):
        ServerOptimizer("fedyogi").load_state_dict(tensors, meta)


def test_cosine_schedule_starts_at_the_lr_and_falls_towards_its_floor() -> None:
    factors = [lr_factor("cosine", r, 10, 0.5) for r in range(1, 11)]
    assert factors[0] == 1.0 and all(a > b for a, b in zip(factors, factors[1:], strict=False))
    assert factors[5] == pytest.approx(0.75)  # halfway through: halfway to the floor
    assert factors[-1] == pytest.approx(0.5 + 0.25 * (1 + math.cos(math.pi * 0.9)))
    assert lr_factor("constant", 7, 10, 0.5) == 1.0


@pytest.mark.parametrize(
    ("schedule", "ratio", "match"),
    [("linear", 0.0, r"unknown server lr schedule 'linear'; valid choices: \['constant', 'cosine'\]"),
     ("cosine", 1.5, r"min_ratio must be in \[0, 1\], got 1.5")],
)
def test_a_wrong_schedule_names_the_valid_ones(schedule: str, ratio: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        lr_factor(schedule, 1, 10, ratio)
