"""The public names: each importable from ``fedrobust``, the strategy and its errors the same objects
from ``fedrobust.strategies``, and importing ``fedrobust`` itself imports neither Flower nor Ray."""

from __future__ import annotations

import subprocess
import sys

import pytest

import fedrobust
from fedrobust import strategies


@pytest.mark.parametrize("name", fedrobust.__all__)
def test_every_public_name_resolves(name: str) -> None:
    assert getattr(fedrobust, name) is not None


def test_fedrobust_strategies_exports_what_it_lists() -> None:
    assert sorted(strategies.__all__) == sorted(strategies._EXPORTS)


@pytest.mark.parametrize("name", strategies.__all__)
def test_the_strategy_and_its_errors_are_also_importable_from_fedrobust_strategies(name: str) -> None:
    assert getattr(strategies, name) is getattr(fedrobust, name)


def test_an_unknown_name_is_an_attribute_error_naming_the_module() -> None:
    with pytest.raises(AttributeError, match="'fedrobust.strategies' has no attribute 'FedAvg'"):
        _ = strategies.FedAvg
    with pytest.raises(ImportError, match="RobustStrategyy"):
        from fedrobust.strategies import RobustStrategyy  # noqa: F401


def test_importing_fedrobust_imports_neither_flower_nor_ray() -> None:
    # Nor matplotlib: fedrobust.plot imports it only when it draws.
    code = ("import sys, fedrobust, fedrobust.plot; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'flwr', 'ray', 'matplotlib'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
