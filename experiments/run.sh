#!/usr/bin/env bash
# Sets up .venv on first use, then runs an experiment (default: conf/config.yaml).
# Any Hydra override may follow: bash experiments/run.sh aggregator=krum num_rounds=5
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/setup.sh"
cd "$FEDROBUST_ROOT"
exec "$FEDROBUST_VENV/bin/python" -m experiments.run "$@"
