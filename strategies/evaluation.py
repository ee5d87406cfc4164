"""The model of an experiment and its central evaluation, in the shapes ``strategy.start()`` takes.

Model and test set are components (:mod:`fedrobust.components`): built-ins by name, a user's by ``_target_``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from flwr.app import ArrayRecord, MetricRecord
from torch.utils.data import TensorDataset

from fedrobust import attacks, components, training
from fedrobust.attacks.backdoor import Backdoor
from fedrobust.config import RunConfig


def build_global_model(cfg: RunConfig) -> torch.nn.Module:
    """The model of the run, initialised from the run's seed (the global RNG is left as it was)."""
    spec = components.dataset_spec(cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return components.build_model(cfg.model, spec)


def initial_arrays(cfg: RunConfig) -> ArrayRecord:
    """The initial global model of the run as Flower's ArrayRecord."""
    return ArrayRecord(build_global_model(cfg).state_dict())


def central_evaluate_fn(cfg: RunConfig) -> Callable[[int, ArrayRecord], MetricRecord]:
    """``evaluate_fn(server_round, arrays)`` for ``strategy.start()``: loss and accuracy on the test set.

    Under the ``backdoor`` attack also ``backdoor_asr``, the attack success rate: the accuracy on the
    test inputs of the other classes, stamped with the attack's trigger and labelled with its target
    (:meth:`fedrobust.attacks.backdoor.Backdoor.triggered_test_set`), i.e. the fraction of them the model
    classifies as the target. Clean ``accuracy`` is measured on the unchanged test set as always.
    """
    test_set = components.load_test_set(cfg)
    model = build_global_model(cfg)
    device = training.pick_device("auto")
    triggered = None
    if cfg.attack.name == "backdoor" and cfg.num_byzantine > 0:
        backdoor = attacks.build("backdoor", **cfg.attack.params)
        assert isinstance(backdoor, Backdoor)
        triggered = TensorDataset(*backdoor.triggered_test_set(*test_set.tensors))

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        result = training.evaluate(model, test_set, device=device)
        metrics: dict[str, int | float | list[int] | list[float]] = {
            "loss": float(result["loss"]),
            "accuracy": float(result["accuracy"]),
        }
        if triggered is not None and len(triggered):
            metrics["backdoor_asr"] = float(training.evaluate(model, triggered, device=device)["accuracy"])
        return MetricRecord(metrics)

    return evaluate
