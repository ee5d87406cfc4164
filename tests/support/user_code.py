"""A documented example of user code (examples/user-components/) copied where a test imports it."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def copy_example(where: Path, example: str, module: str, extra: str = "") -> Path:
    """``examples/user-components/<example>`` written to ``where/<module>.py`` with ``extra`` appended (a test's
    broken components), under a name of its own so that nothing installed shadows it; returns ``where``."""
    source = (REPO / "examples" / "user-components" / example).read_text()
    (where / f"{module}.py").write_text(source + extra)
    return where


def put_on_path(where: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``where`` importable in this process and in the processes it starts (the study's workers, Ray's)."""
    monkeypatch.syspath_prepend(str(where))
    monkeypatch.setenv("PYTHONPATH", str(where))
    return where
