"""The model of an experiment and its central evaluation, in the shapes ``strategy.start()`` takes.

Model and test set are components (:mod:`fedrobust.components`): built-ins by name, a user's by ``_target_``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from flwr.app import ArrayRecord, MetricRecord

from fedrobust import components, training
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
    """``evaluate_fn(server_round, arrays)`` for ``strategy.start()``: loss and accuracy on the test set."""
    test_set = components.load_test_set(cfg)
    model = build_global_model(cfg)
    device = training.pick_device("auto")

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        result = training.evaluate(model, test_set, device=device)
        return MetricRecord({"loss": float(result["loss"]), "accuracy": float(result["accuracy"])})

    return evaluate
