#!/usr/bin/env bash
# Creates .venv on first use and reinstalls the project when pyproject.toml or the torch choice
# (FEDROBUST_TORCH) changes. Sourced by experiments/run.sh and tests/run.sh; also runnable on its own
# (bash scripts/setup.sh). Safe to source: it changes no shell option of the caller and returns
# non-zero instead of exiting.
#
# torch goes first and pinned: an unpinned torch pulls a multi-GB CUDA build onto a CPU-only machine.
# GPU users: FEDROBUST_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
# FEDROBUST_EXTRAS (default test,lint) picks the optional dependencies; an edge device that only runs a
# SuperNode needs none of them: FEDROBUST_EXTRAS= bash scripts/setup.sh

_fedrobust_setup() {
  FEDROBUST_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  FEDROBUST_VENV="${FEDROBUST_VENV:-$FEDROBUST_ROOT/.venv}"
  local torch_spec="${FEDROBUST_TORCH:-torch==2.13.0}"
  local extras="${FEDROBUST_EXTRAS-test,lint}"
  local stamp="$FEDROBUST_VENV/.fedrobust-installed"
  local want
  local chosen="$torch_spec"  # what the stamp records: the default extras leave it as it always was
  [ "$extras" = "test,lint" ] || chosen="$torch_spec|extras=$extras"
  want="$(cat "$FEDROBUST_ROOT/pyproject.toml" <(printf '%s' "$chosen") | sha256sum | cut -d' ' -f1)"
  if [ -x "$FEDROBUST_VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  echo "setting up $FEDROBUST_VENV (first use, or pyproject.toml or FEDROBUST_TORCH changed; a few minutes)" >&2
  "${PYTHON:-python3}" -m venv "$FEDROBUST_VENV" || return 1
  local log="$FEDROBUST_VENV/install.log"
  # shellcheck disable=SC2086  # torch_spec may hold pip options such as --index-url
  if ! { "$FEDROBUST_VENV/bin/pip" install $torch_spec \
         && "$FEDROBUST_VENV/bin/pip" install -e "$FEDROBUST_ROOT${extras:+[$extras]}"; } > "$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "installation failed; full log: $log" >&2
    return 1
  fi
  echo "$want" > "$stamp"
}

_fedrobust_setup || { [ "${BASH_SOURCE[0]}" != "$0" ] && return 1; exit 1; }
export FEDROBUST_ROOT FEDROBUST_VENV
export FLWR_DISABLE_UPDATE_CHECK=1
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
