#!/usr/bin/env bash
# Sets up .venv on first use, then checks and tests the project.
#   bash tests/run.sh            lint (ruff, mypy), the fast tier (stops at its first failure), then
#                                the slow tier (real simulations, processes, deployment)
#   bash tests/run.sh ARGS...    pytest ARGS only, e.g. -m "not slow", or a test file
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/setup.sh"
cd "$FEDROBUST_ROOT"
py="$FEDROBUST_VENV/bin/python"
if [ "$#" -gt 0 ]; then
  exec "$py" -m pytest "$@"
fi
echo "== lint: ruff, mypy"
"$py" -m ruff check .
bash scripts/typecheck.sh
echo "== fast tier"
# On every core: unit tests are CPU-bound and independent (59 s instead of 81-101 s on 2 cores).
# The slow tier stays serial: its real processes and Ray clusters compete for the CPU, and side by side
# they ran 2-3x slower each and one missed its 30 s wait for Ray's nodes.
"$py" -m pytest -q -x -m "not slow" -n auto
echo "== slow tier"
"$py" -m pytest -q -m slow --durations=10
