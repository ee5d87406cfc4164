#!/usr/bin/env bash
# mypy over the package as it is installed: strategies/ and clients/ are fedrobust.strategies and
# fedrobust.clients (pyproject's package-dir mapping), which mypy cannot see from the repository's
# folders (it would type every `from fedrobust.strategies ... import` as Any). A throw-away tree of
# symlinks gives it that layout; experiments/ is checked against it. Options: [tool.mypy].
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/fedrobust"
for entry in "$root"/fedrobust/*; do ln -s "$entry" "$tree/fedrobust/"; done
ln -s "$root/strategies" "$tree/fedrobust/strategies"
ln -s "$root/clients" "$tree/fedrobust/clients"
ln -s "$root/experiments" "$tree/experiments"
cd "$tree"
"${FEDROBUST_VENV:-$root/.venv}/bin/python" -m mypy --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" \
  fedrobust experiments
