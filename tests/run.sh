#!/usr/bin/env bash
# Sets up .venv on first use, then runs the test suite. pytest options may follow.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/setup.sh"
cd "$FEDROBUST_ROOT"
exec "$FEDROBUST_VENV/bin/python" -m pytest "$@"
