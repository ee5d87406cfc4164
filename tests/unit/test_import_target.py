"""A dotted path that does not import names what is missing: the module, or the attribute, with a guess."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedrobust.components import import_target


@pytest.fixture()
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    (tmp_path / "fri_app").mkdir()
    (tmp_path / "fri_app" / "__init__.py").write_text("")
    (tmp_path / "fri_app" / "rules.py").write_text("class MyRule:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("fri_app")]:
        del sys.modules[name]


@pytest.mark.parametrize(("path", "problem"), [
    # A misspelt module of the package: not "'fri_app' has no attribute 'rulez'".
    ("fri_app.rulez.MyRule", "cannot import 'fri_app.rulez.MyRule': no module 'fri_app.rulez' (did you mean 'rules'?)"),
    ("fri_app.rules.MyRul", "cannot import 'fri_app.rules.MyRul': 'fri_app.rules' has no attribute 'MyRul' "
                            "(did you mean 'MyRule'?)"),
    ("fri_nothing.rules.MyRule", "cannot import 'fri_nothing.rules.MyRule': No module named 'fri_nothing' "
                                 "(is its package installed, or on PYTHONPATH?)"),
])
def test_what_is_missing_is_named(package: Path, path: str, problem: str) -> None:
    with pytest.raises(ValueError) as raised:
        import_target(path)
    assert str(raised.value) == problem
    assert import_target("fri_app.rules.MyRule").__name__ == "MyRule"
