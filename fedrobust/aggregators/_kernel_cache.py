"""Where the numba kernels keep their machine code: a user-wide directory per version of their source.

Numba's default cache lives next to the source file (``__pycache__``) and its user-wide fallback is keyed
by the file's directory. Flower installs an app bundle (FAB) as a fresh copy of the code per app version
and per ``flwr`` home (``flwr run``, the SuperLink's ServerApp, each SuperNode), so every copy compiled
the kernels again in its first aggregation: 9 s on an idle 2-core machine, 10-25 s under load. Keyed by
the source's content instead, any copy of the same code loads what any other copy compiled, and a changed
source gets a directory of its own (never a stale kernel).

The directory is ``$NUMBA_CACHE_DIR/fedrobust`` when the user set that variable, else
``$XDG_CACHE_HOME/fedrobust/numba`` (``~/.cache/fedrobust/numba``); when it cannot be written, numba's
own locators apply as before.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from numba.core import caching, config

__all__ = ["ContentKeyedLocator", "cache_root", "install"]

logger = logging.getLogger(__name__)

_MODULE = "fedrobust.aggregators._kernels"


def cache_root() -> Path:
    """The directory under which each version of the kernels' source has its own cache directory."""
    user_dir = getattr(config, "CACHE_DIR", "")  # NUMBA_CACHE_DIR, read by numba.core.config at import
    if user_dir:
        return Path(user_dir) / "fedrobust"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fedrobust" / "numba"


class ContentKeyedLocator(caching._SourceFileBackedLocatorMixin, caching._CacheLocator):
    """Numba cache locator for :mod:`fedrobust.aggregators._kernels` keyed by the source's SHA-256."""

    def __init__(self, py_func: Any, py_file: str) -> None:
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._digest = hashlib.sha256(Path(py_file).read_bytes()).hexdigest()
        self._cache_path = str(cache_root() / f"{Path(py_file).stem}-{self._digest[:20]}")

    def get_cache_path(self) -> str:
        return self._cache_path

    def get_source_stamp(self) -> str:
        # The content, not the mtime and size older numba versions stamp: a fresh copy matches.
        return self._digest

    @classmethod
    def from_function(cls, py_func: Any, py_file: str) -> ContentKeyedLocator | None:
        if getattr(py_func, "__module__", None) != _MODULE:
            return None  # other packages' functions keep numba's own locators
        try:
            return super().from_function(py_func, py_file)
        except (OSError, RuntimeError) as exc:  # unreadable source, no home directory: numba's own locators
            logger.debug("numba kernel cache not keyed by content: %s", exc)
            return None


def install() -> None:
    """Put :class:`ContentKeyedLocator` first in numba's locator list (before the kernels are decorated).

    ``NUMBA_CACHE_LOCATOR_CLASSES``, when set, still overrides the list. A numba without this list keeps
    its own caching: slower first rounds, nothing wrong.
    """
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    classes = getattr(impl, "_locator_classes", None)
    if not isinstance(classes, list):
        logger.debug("this numba has no cache locator list; its own cache locations apply")
        return
    if ContentKeyedLocator not in classes:
        classes.insert(0, ContentKeyedLocator)
