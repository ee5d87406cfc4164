"""The model of an experiment, its central evaluation and the server's own update (FLTrust), in the shapes
``strategy.start()`` and ``RobustStrategy`` take.

Model and test set are components (:mod:`fedrobust.components`): built-ins by name, a user's by ``_target_``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord, MetricRecord
from torch.utils.data import TensorDataset

from fedrobust import attacks, components, training
from fedrobust.attacks.backdoor import Backdoor
from fedrobust.config import PartitionConfig, RunConfig
from fedrobust.strategies.robust_strategy import ServerUpdateFn

logger = logging.getLogger(__name__)


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
    """``evaluate_fn(server_round, arrays)`` for ``strategy.start()``: loss and accuracy on the test set (on
    the validation hold-out instead when ``dataset.validation_fraction`` > 0).

    Under the ``backdoor`` attack also ``backdoor_asr``, the attack success rate: the accuracy on the
    test inputs of the other classes, stamped with the attack's trigger and labelled with its target
    (:meth:`fedrobust.attacks.backdoor.Backdoor.triggered_test_set`), i.e. the fraction of them the model
    classifies as the target. Clean ``accuracy`` is measured on the unchanged test set as always.
    """
    test_set = components.load_evaluation_set(cfg)
    if cfg.dataset.validation_fraction > 0:
        logger.info(
            "central evaluation on the validation hold-out: %d samples (dataset.validation_fraction=%s), "
            "which no client trains on; the test set is not used",
            len(test_set),
            cfg.dataset.validation_fraction,
        )
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


# The server's work on its root data set is seeded like a client's work, under a partition id no client has.
_SERVER_PARTITION = -2


def root_data_set(cfg: RunConfig) -> TensorDataset:
    """The server's root data set (FLTrust): ``aggregator.root_size`` examples of the training split.

    As in Cao et al. (2021), the root data is a small clean sample of the training distribution: the
    examples are drawn uniformly, from the seed, out of the whole training split (the union of the
    clients' data), so it may share examples with clients; the test set stays the evaluation set,
    untouched. Built-in data sets and ``dataset._target_`` loaders alike (the split is loaded as one
    IID partition).
    """
    whole = components.load_partition(dataclasses.replace(cfg, partition=PartitionConfig(name="iid")), 0, 1)
    x, y = whole.tensors
    size = min(cfg.aggregator.root_size, len(y))
    rng = np.random.default_rng([cfg.seed, 0xF17, 0x7057])
    chosen = torch.from_numpy(np.sort(rng.choice(len(y), size=size, replace=False)))
    return TensorDataset(x.index_select(0, chosen), y.index_select(0, chosen))


def server_update_fn(cfg: RunConfig) -> ServerUpdateFn:
    """``fn(server_round, global_state)`` for ``RobustStrategy(server_update_fn=...)``: the server's own update.

    The server trains from the round's global model on its :func:`root_data_set` exactly as a client
    trains on its partition (``client.*`` settings), seeded from (seed, round, -2), and returns trained
    minus global weights. The root data is loaded on the first call, so runs whose rule needs no
    server update never load it.
    """
    state: dict[str, object] = {}

    def update(server_round: int, global_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not state:
            state["root"] = root_data_set(cfg)
            state["model"] = build_global_model(cfg)
        root, model = state["root"], state["model"]
        assert isinstance(root, TensorDataset) and isinstance(model, torch.nn.Module)
        model.load_state_dict(global_state)
        c = cfg.client
        training.train(
            model,
            root,
            epochs=c.local_epochs,
            batch_size=c.batch_size,
            lr=c.lr,
            momentum=c.momentum,
            weight_decay=c.weight_decay,
            device=training.pick_device(c.device),
            amp=c.amp,
        deterministic=c.deterministic,
            seed=training.derive_seed(cfg.seed, server_round, _SERVER_PARTITION),
        )
        trained = model.state_dict()
        return {k: trained[k].detach().cpu() - global_state[k] for k in global_state}

    return update
