"""Shared by every test: Flower stays offline.

Tiers: tests/unit (one module, no engine), tests/integration (the real simulation engine or the
in-process runner), tests/process (real processes and signals). The ``slow`` marker, not the
directory, splits the fast tier from the slow one (``tests/run.sh``); helpers are in tests/support.
"""

from __future__ import annotations

import os

# No update check and no dependency installation from any Flower process a test starts (no network here).
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")

# The slow tier runs two tests at a time (tests/run.sh). Started longest first, they keep both workers
# busy to the end; started in file order, the four longest could land on one worker's queue late
# (CI rehearsal: 467 s for 844 s of tests). Seconds each in that rehearsal, on 2 cores:
LONGEST_FIRST = (
    "tests/process/test_deployment_crash.py::",  # 148
    "tests/process/test_flwr_run_signals.py::test_signals_under",  # 132
    "tests/process/test_deployment.py::test_deployment_signed_drill",  # 116
    "tests/process/test_fault_processes.py::test_every_stop",  # 110
    "tests/integration/test_components.py::test_user_components_train_under_flwr_run",  # 51
    "tests/integration/test_library.py::test_a_flower_style_app",  # 42
    "tests/integration/test_simulation.py::test_client_exceptions",  # 41
)


def _rank(nodeid: str) -> int:
    return next((i for i, prefix in enumerate(LONGEST_FIRST) if nodeid.startswith(prefix)), len(LONGEST_FIRST))


def pytest_collection_modifyitems(items: list) -> None:
    """The tests of :data:`LONGEST_FIRST` first, in its order; the others after them, in file order."""
    items.sort(key=lambda item: _rank(item.nodeid))
