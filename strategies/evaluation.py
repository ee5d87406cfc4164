"""The model of an experiment and its central evaluation, in the shapes ``strategy.start()`` takes."""

from __future__ import annotations

from collections.abc import Callable

import torch
from flwr.app import ArrayRecord, MetricRecord

from fedrobust import data, models, training
from fedrobust.config import RunConfig


def build_global_model(cfg: RunConfig) -> torch.nn.Module:
    """The model of the run, initialised from the run's seed (the global RNG is left as it was)."""
    spec = data.dataset_spec(cfg.dataset.name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return models.build_model(
            cfg.model.name, input_shape=spec.input_shape, num_classes=spec.num_classes, **cfg.model.params
        )


def initial_arrays(cfg: RunConfig) -> ArrayRecord:
    """The initial global model of the run as Flower's ArrayRecord."""
    return ArrayRecord(build_global_model(cfg).state_dict())


def central_evaluate_fn(cfg: RunConfig) -> Callable[[int, ArrayRecord], MetricRecord]:
    """``evaluate_fn(server_round, arrays)`` for ``strategy.start()``: loss and accuracy on the test set."""
    test_set = data.load_test_set(cfg.dataset.name, seed=cfg.seed)
    model = build_global_model(cfg)
    device = training.pick_device("auto")

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        result = training.evaluate(model, test_set, device=device)
        return MetricRecord({"loss": float(result["loss"]), "accuracy": float(result["accuracy"])})

    return evaluate
