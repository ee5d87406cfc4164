"""Server-side Flower glue (``fedrobust.strategies``).

The public names are ``fedrobust``'s (``from fedrobust import RobustStrategy``); the strategy and its
errors can also be imported from here, as Flower's are from ``flwr.serverapp.strategy``. Resolved
lazily, so that importing one submodule (``fedrobust.strategies.errors``) does not import them all.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "RobustStrategy": "robust_strategy",
    "RoundOutcome": "robust_strategy",
    "RoundIntake": "robust_strategy",
    "strategy_from_config": "from_config",
    "QuorumError": "errors",
    "AggregationError": "errors",
    "CheckpointStorageError": "errors",
    "ClientFailureError": "errors",
    "NoNodesError": "errors",
    "Preempted": "errors",
    "EXIT_PREEMPTED": "errors",
}

__all__ = [
    "EXIT_PREEMPTED",
    "AggregationError",
    "CheckpointStorageError",
    "ClientFailureError",
    "NoNodesError",
    "Preempted",
    "QuorumError",
    "RobustStrategy",
    "RoundIntake",
    "RoundOutcome",
    "strategy_from_config",
]

if TYPE_CHECKING:
    from fedrobust.strategies.errors import (
        EXIT_PREEMPTED,
        AggregationError,
        CheckpointStorageError,
        ClientFailureError,
        NoNodesError,
        Preempted,
        QuorumError,
    )
    from fedrobust.strategies.from_config import strategy_from_config
    from fedrobust.strategies.robust_strategy import RobustStrategy, RoundIntake, RoundOutcome


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fedrobust.strategies' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
