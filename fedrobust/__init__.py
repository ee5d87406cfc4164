"""fedrobust: Byzantine-robust, fault-tolerant federated learning on Flower and PyTorch.

What a Flower user imports::

    from fedrobust import RobustStrategy, signing_mod

    strategy = RobustStrategy(aggregator="trimmed_mean", num_byzantine=2, checkpoint_dir="ckpt/")
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()), num_rounds=10)
    app = ClientApp(mods=[signing_mod("keys/client-3.key")])

The core (``fedrobust.aggregators``, ``attacks``, ``checkpoint``, ``signing``, ...) is pure
PyTorch/NumPy and never imports Flower. The Flower glue lives in ``fedrobust.strategies`` (server)
and ``fedrobust.clients`` (client); the names below that need Flower are imported on first use, so
``import fedrobust.aggregators`` stays free of it.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

# The repository keeps the Flower glue in the top-level folders strategies/ and clients/; an
# installed wheel maps them to fedrobust/strategies and fedrobust/clients (package-dir in
# pyproject.toml). In a source checkout, and in the app bundle that `flwr run .` ships, the folders
# sit beside this package: searching the parent folder too makes `fedrobust.strategies` resolve
# there. Only when the mapped folders are absent, so an installed package never looks outside.
_here = Path(__file__).resolve().parent
if not (_here / "strategies").is_dir() and (_here.parent / "strategies" / "__init__.py").is_file():
    __path__.append(str(_here.parent))

# Public name -> the module that defines it.
_EXPORTS = {
    "RobustStrategy": "fedrobust.strategies.robust_strategy",
    "RoundOutcome": "fedrobust.strategies.robust_strategy",
    "RoundIntake": "fedrobust.strategies.robust_strategy",
    "QuorumError": "fedrobust.strategies.errors",
    "AggregationError": "fedrobust.strategies.errors",
    "CheckpointStorageError": "fedrobust.strategies.errors",
    "ClientFailureError": "fedrobust.strategies.errors",
    "NoNodesError": "fedrobust.strategies.errors",
    "NodesBusyError": "fedrobust.strategies.errors",
    "Preempted": "fedrobust.strategies.errors",
    "EXIT_PREEMPTED": "fedrobust.strategies.errors",
    "strategy_from_config": "fedrobust.strategies.from_config",
    "signing_mod": "fedrobust.clients.signing_mod",
    "partition_query": "fedrobust.clients.partition_query",
    "CheckpointStore": "fedrobust.checkpoint",
    "CheckpointMismatchError": "fedrobust.checkpoint",
    "NoValidCheckpointError": "fedrobust.strategies.checkpointing",
    "TrustStore": "fedrobust.signing",
    "RunConfig": "fedrobust.config",
}

__all__ = [
    "AggregationError",
    "CheckpointMismatchError",
    "CheckpointStorageError",
    "CheckpointStore",
    "ClientFailureError",
    "EXIT_PREEMPTED",
    "NoNodesError",
    "NoValidCheckpointError",
    "NodesBusyError",
    "Preempted",
    "QuorumError",
    "RobustStrategy",
    "RoundIntake",
    "RoundOutcome",
    "RunConfig",
    "TrustStore",
    "aggregators",
    "attacks",
    "partition_query",
    "plot",
    "signing_mod",
    "strategy_from_config",
]

if TYPE_CHECKING:
    from fedrobust import aggregators, attacks, plot
    from fedrobust.checkpoint import CheckpointMismatchError, CheckpointStore
    from fedrobust.clients.partition_query import partition_query
    from fedrobust.clients.signing_mod import signing_mod
    from fedrobust.config import RunConfig
    from fedrobust.signing import TrustStore
    from fedrobust.strategies.checkpointing import NoValidCheckpointError
    from fedrobust.strategies.errors import (
        EXIT_PREEMPTED,
        AggregationError,
        CheckpointStorageError,
        ClientFailureError,
        NodesBusyError,
        NoNodesError,
        Preempted,
        QuorumError,
    )
    from fedrobust.strategies.from_config import strategy_from_config
    from fedrobust.strategies.robust_strategy import RobustStrategy, RoundIntake, RoundOutcome


def __getattr__(name: str) -> Any:
    if name in ("aggregators", "attacks", "plot"):
        return importlib.import_module(f"fedrobust.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fedrobust' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
