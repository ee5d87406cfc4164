"""Shared by every test: Flower stays offline.

Tiers: tests/unit (one module, no engine), tests/integration (the real simulation engine or the
in-process runner), tests/process (real processes and signals). The ``slow`` marker, not the
directory, splits the fast tier from the slow one (``tests/run.sh``); helpers are in tests/support.
"""

from __future__ import annotations

import os

import pytest

from tests.support.ordering import balanced_order

# No update check and no dependency installation from any Flower process a test starts (no network here).
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")


# ------------------------------------------------------------------ the slow tier's order
# The slow tier runs two tests at a time (tests/run.sh, --dist worksteal), each worker starting on a
# contiguous part of the collection. In collection order the longest tests (100-120 s each) could sit in
# one part, or start last and run alone while the other core idles: the same tests took 352 s and 411 s
# in two CI runs. Each slow test's `slow(seconds=...)`, about its time in the tier, orders them longest
# first into parts of about equal time (tests/support/ordering.py); tests without one count as 0 s.


def _estimated_seconds(item: pytest.Item) -> float:
    marker = item.get_closest_marker("slow")
    return float(marker.kwargs.get("seconds", 0.0)) if marker is not None else 0.0


@pytest.hookimpl(trylast=True)  # after -m has deselected: order only what runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))  # set in each xdist worker
    if workers >= 2 and any(_estimated_seconds(item) for item in items):
        items[:] = balanced_order(items, _estimated_seconds, workers)
