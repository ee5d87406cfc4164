"""The numba kernels' cache is keyed by the source's content, not its path.

Flower installs an app bundle as a fresh copy of the code (per app version, per node), so a cache next
to the source compiled the kernels again in every copy's first aggregation. Each import below runs in a
process of its own, from a copy of the package at a new path, with an empty cache root of the test's own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_IMPORT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from fedrobust.aggregators import _kernels
assert _kernels.__file__.startswith(sys.argv[1]), _kernels.__file__
counts = {}
for name in ("window_mean", "closest_mean", "centered_gram"):
    stats = getattr(_kernels, name).stats
    counts[name] = [sum(stats.cache_hits.values()), sum(stats.cache_misses.values())]
print(json.dumps(counts))
"""


def _copy_of_the_package(where: Path, *, edit: str = "") -> Path:
    shutil.copytree(REPO / "fedrobust", where / "fedrobust", ignore=shutil.ignore_patterns("__pycache__"))
    if edit:
        kernels = where / "fedrobust" / "aggregators" / "_kernels.py"
        kernels.write_text(kernels.read_text() + edit)
    return where


def _hits_and_misses(root: Path, cache: Path) -> dict[str, list[int]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CACHE")}
    env |= {"XDG_CACHE_HOME": str(cache), "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, "-c", _IMPORT, str(root)], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    result: dict[str, list[int]] = json.loads(done.stdout.splitlines()[-1])
    return result


@pytest.mark.slow(seconds=20)  # compiles the kernels once with an empty cache
def test_a_copy_of_the_code_at_another_path_loads_the_kernels_compiled_by_the_first(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _hits_and_misses(_copy_of_the_package(tmp_path / "a"), cache)
    assert all(misses > 0 and hits == 0 for hits, misses in first.values()), first  # compiled, then saved
    second = _hits_and_misses(_copy_of_the_package(tmp_path / "b"), cache)
    assert all(hits > 0 and misses == 0 for hits, misses in second.values()), second
    assert [p.name for p in (cache / "fedrobust" / "numba").iterdir()][0].startswith("_kernels-")


def test_a_changed_source_gets_a_cache_directory_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fedrobust.aggregators import _kernel_cache, _kernels

    monkeypatch.setattr(_kernel_cache.config, "CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    a = _copy_of_the_package(tmp_path / "a") / "fedrobust" / "aggregators" / "_kernels.py"
    b = _copy_of_the_package(tmp_path / "b") / "fedrobust" / "aggregators" / "_kernels.py"
    c = _copy_of_the_package(tmp_path / "c", edit="\n# another version\n") / "fedrobust" / "aggregators" / "_kernels.py"
    func = _kernels.window_mean.py_func
    locators = [_kernel_cache.ContentKeyedLocator.from_function(func, str(path)) for path in (a, b, c)]
    assert all(locator is not None for locator in locators)
    paths = [locator.get_cache_path() for locator in locators if locator is not None]
    stamps = [locator.get_source_stamp() for locator in locators if locator is not None]
    assert paths[0] == paths[1] != paths[2] and stamps[0] == stamps[1] != stamps[2]
    assert Path(paths[0]).parent == tmp_path / "cache" / "fedrobust" / "numba" and Path(paths[0]).is_dir()

    # NUMBA_CACHE_DIR, when the user set it, is where the cache goes; other modules' functions are not ours.
    monkeypatch.setattr(_kernel_cache.config, "CACHE_DIR", str(tmp_path / "numba"))
    assert _kernel_cache.cache_root() == tmp_path / "numba" / "fedrobust"
    assert _kernel_cache.ContentKeyedLocator.from_function(json.dumps, str(a)) is None

    # No home directory to cache under (a service account without one): numba's own locators, no error.
    monkeypatch.setattr(_kernel_cache.config, "CACHE_DIR", "")
    monkeypatch.delenv("XDG_CACHE_HOME")

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    assert _kernel_cache.ContentKeyedLocator.from_function(func, str(a)) is None
