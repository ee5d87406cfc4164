"""The study's digest of a user component's code follows the user's own imports, and only those."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from experiments.source_digest import own_source_files, source_digest

FILES = {
    # A package of the user's: the component imports a sibling relatively and another module absolutely.
    "frd_pkg/__init__.py": "",
    "frd_pkg/attacks.py": (
        "import math\nimport torch\nfrom fedrobust.attacks import Attack\n"
        "from . import helpers\nfrom frd_pkg.scale import FACTOR\nimport frd_top\n\n"
        "class Scaled(Attack):\n    pass\n"
    ),
    "frd_pkg/helpers.py": "from .deeper import depth\n",
    "frd_pkg/deeper.py": "depth = 2\n",
    "frd_pkg/scale.py": "FACTOR = -3.0\n",
    "frd_pkg/unused.py": "NOT_IMPORTED = True\n",
    "frd_top.py": "VALUE = 1\n",
    "frd_alone.py": "from fedrobust.attacks import Attack\n\nclass Alone(Attack):\n    pass\n",
    # Modules loaded by name: written out (followed), relative to the package, and computed (not followed).
    "frd_dyn/__init__.py": "",
    "frd_dyn/rule.py": (
        "import importlib\nfrom importlib import import_module\n\n"
        "WEIGHTS = importlib.import_module('frd_dyn.weights')\nNEAR = import_module('.near', package=__package__)\n"
        "OLD = __import__('frd_dyn_old')\nLATER = importlib.import_module('frd_dyn.' + 'computed')\n\n"
        "class Rule:\n    pass\n"
    ),
    "frd_dyn/weights.py": "W = 1\n",
    "frd_dyn/near.py": "N = 1\n",
    "frd_dyn/computed.py": "C = 1\n",
    "frd_dyn_old.py": "O = 1\n",
}


@pytest.fixture()
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith(("frd_pkg", "frd_top", "frd_alone", "frd_dyn"))]:
        del sys.modules[name]


def test_the_files_are_the_components_and_the_users_modules_it_imports(user_dir: Path) -> None:
    import frd_pkg.attacks

    names = sorted(str(path.relative_to(user_dir.resolve())) for path in own_source_files(frd_pkg.attacks))
    # Not math or torch (installed), not fedrobust, not the package's module that nothing imports.
    assert names == ["frd_pkg/__init__.py", "frd_pkg/attacks.py", "frd_pkg/deeper.py", "frd_pkg/helpers.py",
                     "frd_pkg/scale.py", "frd_top.py"]


@pytest.mark.parametrize("edited", ["frd_pkg/attacks.py", "frd_pkg/deeper.py", "frd_pkg/scale.py", "frd_top.py"])
def test_an_edit_to_any_of_them_changes_the_digest(user_dir: Path, edited: str) -> None:
    before = source_digest("frd_pkg.attacks.Scaled")
    (user_dir / edited).write_text((user_dir / edited).read_text() + "# edited\n")
    assert source_digest("frd_pkg.attacks.Scaled") != before


def test_an_edit_to_a_module_nothing_imports_leaves_it(user_dir: Path) -> None:
    before = source_digest("frd_pkg.attacks.Scaled")
    (user_dir / "frd_pkg/unused.py").write_text("NOT_IMPORTED = False\n")
    assert source_digest("frd_pkg.attacks.Scaled") == before


def test_a_file_that_imports_nothing_of_the_users_is_digested_alone(user_dir: Path) -> None:
    import hashlib

    assert source_digest("frd_alone.Alone") == hashlib.sha256((user_dir / "frd_alone.py").read_bytes()).hexdigest()
    assert source_digest("frd_alone.Missing") == ""


def test_an_installed_component_is_its_own_file_without_the_installed_modules_it_imports() -> None:
    import torch.nn.modules.linear

    [path] = own_source_files(torch.nn.modules.linear)
    assert path.name == "linear.py" and source_digest("torch.nn.Linear") != ""


def test_modules_loaded_by_a_name_written_out_count_too(user_dir: Path) -> None:
    import frd_dyn.rule

    names = sorted(str(path.relative_to(user_dir.resolve())) for path in own_source_files(frd_dyn.rule))
    # import_module with a literal (absolute, or relative with package=) and __import__; not a computed name.
    assert names == ["frd_dyn/__init__.py", "frd_dyn/near.py", "frd_dyn/rule.py", "frd_dyn/weights.py",
                     "frd_dyn_old.py"]
    before = source_digest("frd_dyn.rule.Rule")
    (user_dir / "frd_dyn/weights.py").write_text("W = 2\n")
    assert source_digest("frd_dyn.rule.Rule") != before
