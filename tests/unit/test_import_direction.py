"""Imports point downward only (docs/architecture.md): experiments -> strategies/clients -> fedrobust.

Checked on what Python really loads, in a fresh process per layer, so imports inside modules and
functions called at import time count too. ``fedrobust/__init__.py``'s lazy exports (the strategy and
the signing mod) are the one sanctioned bridge and are not touched by importing the core modules.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _modules(package_dir: Path, package: str) -> list[str]:
    names = []
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join((package, *parts)))
    return names


CORE = [m for m in _modules(ROOT / "fedrobust", "fedrobust") if m != "fedrobust"]
STRATEGIES = _modules(ROOT / "strategies", "fedrobust.strategies")
CLIENTS = _modules(ROOT / "clients", "fedrobust.clients")


def _loaded_after_importing(modules: list[str]) -> set[str]:
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def _top_and_glue(loaded: set[str]) -> set[str]:
    """The top-level packages and fedrobust's glue packages among ``loaded``."""
    glue_packages = ("fedrobust.strategies", "fedrobust.clients")
    glue = {".".join(m.split(".")[:2]) for m in loaded if m.startswith(glue_packages)}
    return {m.split(".")[0] for m in loaded} | glue


def test_the_core_modules_are_found() -> None:
    # Not vacuous: the lists hold the modules the layers are made of.
    assert {"fedrobust.checkpoint", "fedrobust.aggregators.pipeline", "fedrobust.signing"} <= set(CORE)
    assert "fedrobust.strategies.robust_strategy" in STRATEGIES and "fedrobust.clients.client_app" in CLIENTS


def test_the_core_imports_neither_flower_nor_hydra_nor_the_glue() -> None:
    seen = _top_and_glue(_loaded_after_importing(CORE))
    assert "fedrobust" in seen
    assert not seen & {"flwr", "ray", "hydra", "omegaconf", "experiments", "fedrobust.strategies", "fedrobust.clients"}


@pytest.mark.parametrize(
    "layer,forbidden",
    [
        (STRATEGIES, {"experiments", "fedrobust.clients", "hydra"}),
        (CLIENTS, {"experiments", "fedrobust.strategies", "hydra"}),
    ],
    ids=["strategies", "clients"],
)
def test_strategies_and_clients_import_neither_each_other_nor_the_experiments(
    layer: list[str], forbidden: set[str]
) -> None:
    seen = _top_and_glue(_loaded_after_importing(layer))
    assert "flwr" in seen  # the glue is Flower's: the import really happened
    assert not seen & forbidden, seen & forbidden


EXPERIMENTS = _modules(ROOT / "experiments", "experiments")


def test_the_experiments_reach_the_glue_only_through_fedrobust() -> None:
    # A bare ``import strategies...`` from the repository root loads a second copy of the module beside
    # ``fedrobust.strategies...`` (docs/architecture.md: every import uses the fedrobust names), so an
    # isinstance check or a module-level registry would see two different classes.
    seen = _top_and_glue(_loaded_after_importing(EXPERIMENTS))
    assert "fedrobust.strategies" in seen  # the experiments do use the glue
    assert not seen & {"strategies", "clients"}, seen & {"strategies", "clients"}
