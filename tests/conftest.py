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
