"""The backdoor attack: where the trigger goes, which samples are poisoned, and the attack success rate.

The end-to-end check (a short simulation in which the plain mean learns the backdoor and a robust rule learns
less of it) is in tests/integration/test_backdoor_run.py, in the slow tier.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fedrobust import attacks, training
from fedrobust.attacks.backdoor import stamp_trigger, triggered_test_set


def test_trigger_goes_in_the_bottom_right_corner_of_each_image_shape() -> None:
    images = torch.zeros(2, 3, 5, 6)  # [b, C, H, W]
    out = stamp_trigger(images, size=2, value=7.0)
    expected = torch.zeros_like(images)
    expected[:, :, 3:, 4:] = 7.0
    assert torch.equal(out, expected) and not images.any()  # a copy: the input is untouched

    flat = torch.zeros(3, 64)  # digits: 8x8 flattened
    out = stamp_trigger(flat, size=2, value=1.0).view(3, 8, 8)
    assert out[:, 6:, 6:].eq(1.0).all() and out.sum() == 3 * 4
    assert torch.nonzero(stamp_trigger(flat, size=2, value=1.0)[0]).flatten().tolist() == [54, 55, 62, 63]

    odd = torch.zeros(1, 10)  # not a square: the last size*size features
    assert stamp_trigger(odd, size=2, value=1.0)[0].tolist() == [0.0] * 6 + [1.0] * 4
    assert stamp_trigger(torch.zeros(1, 3), size=2, value=1.0).eq(1.0).all()


def test_trigger_value_defaults_to_the_brightest_input_value() -> None:
    x = torch.rand(4, 16) * 0.5
    x[2, 0] = 2.5
    assert stamp_trigger(x, size=1)[:, -1].eq(2.5).all()


def test_trigger_rejects_what_it_cannot_stamp() -> None:
    with pytest.raises(ValueError, match="float tensor"):
        stamp_trigger(torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="does not fit"):
        stamp_trigger(torch.zeros(1, 1, 3, 3), size=4)


def test_poison_data_stamps_and_relabels_the_chosen_fraction_only() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(40, 64) * 0.9
    y = torch.arange(40) % 10
    attack = attacks.build("backdoor", target=3, fraction=0.25)
    px, py = attack.poison_data(x, y, num_classes=10, generator=g)
    corner = [54, 55, 62, 63]
    poisoned = px[:, corner].eq(float(x.max())).all(dim=1)
    assert int(poisoned.sum()) == 10  # ceil(0.25 * 40)
    assert py[poisoned].eq(3).all()
    assert torch.equal(px[~poisoned], x[~poisoned]) and torch.equal(py[~poisoned], y[~poisoned])
    assert torch.equal(px[poisoned][:, [i for i in range(64) if i not in corner]],
                       x[poisoned][:, [i for i in range(64) if i not in corner]])
    # The choice is drawn from the generator: another seed poisons other samples.
    other, _ = attack.poison_data(x, y, num_classes=10, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(other, px)
    with pytest.raises(ValueError, match=r"'target' must be a class in \[0, 3\)"):
        attack.poison_data(x, y % 3, num_classes=3, generator=g)


def test_boost_scales_the_update_and_the_default_sends_it_as_trained() -> None:
    update = {"w": torch.ones(3), "n": torch.tensor(4)}
    g = torch.Generator()
    assert attacks.build("backdoor").poison_update(update, round=1, generator=g) is update
    boosted = attacks.build("backdoor", boost=5.0).poison_update(update, round=1, generator=g)
    assert boosted["w"].tolist() == [5.0] * 3 and int(boosted["n"]) == 4


class CornerDetector(nn.Module):
    """Predicts class ``target`` when the last feature is bright, class ``other`` otherwise."""

    def __init__(self, target: int, other: int, num_classes: int = 10) -> None:
        super().__init__()
        self.target, self.other, self.num_classes = target, other, num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(x.shape[0], self.num_classes)
        bright = x[:, -1] > 0.99
        logits[bright, self.target] = 1.0
        logits[~bright, self.other] = 1.0
        return logits


def test_attack_success_rate_counts_triggered_inputs_of_other_classes_classified_as_the_target() -> None:
    x = torch.rand(50, 64) * 0.9
    x[0, 0] = 1.0  # the brightest value, used by the trigger
    y = torch.arange(50) % 5
    tx, ty = triggered_test_set(x, y, target=2)
    assert tx.shape == (40, 64) and ty.eq(2).all()  # the 10 inputs of class 2 are left out
    assert torch.equal(tx[:, :54], x[y != 2][:, :54])
    # A model that learned the trigger: every triggered input goes to the target (ASR 1); on clean inputs
    # it predicts class 0 (so its clean accuracy is the share of class 0).
    backdoored = CornerDetector(target=2, other=0)
    asr = training.evaluate(backdoored, TensorDataset(tx, ty), device="cpu")["accuracy"]
    assert asr == 1.0
    assert training.evaluate(backdoored, TensorDataset(x, y), device="cpu")["accuracy"] == pytest.approx(0.2)
    # A model that ignores the trigger and predicts class 0 everywhere: ASR 0.
    clean = CornerDetector(target=0, other=0)
    assert training.evaluate(clean, TensorDataset(tx, ty), device="cpu")["accuracy"] == 0.0
    # The attack's own set uses its trigger settings.
    attack = attacks.build("backdoor", target=2, size=1, value=5.0)
    ax, ay = attack.triggered_test_set(x, y)
    assert ax[:, -1].eq(5.0).all() and ax[:, 54].ne(5.0).all() and ay.eq(2).all()


def test_central_evaluation_reports_the_attack_success_rate_under_backdoor_only() -> None:
    from flwr.app import ArrayRecord

    from fedrobust.config import from_flat
    from fedrobust.strategies.evaluation import build_global_model, central_evaluate_fn

    plain = from_flat({"attack.name": "none"})
    arrays = ArrayRecord(build_global_model(plain).state_dict())
    assert set(central_evaluate_fn(plain)(0, arrays)) == {"loss", "accuracy"}
    backdoor = from_flat({"attack.name": "backdoor", "attack.params": {"target": 1}})
    metrics = central_evaluate_fn(backdoor)(0, arrays)
    assert set(metrics) == {"loss", "accuracy", "backdoor_asr"}
    assert 0.0 <= float(metrics["backdoor_asr"]) <= 1.0
