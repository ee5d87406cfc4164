"""A disk cache for small NumPy arrays that every process would otherwise compute again.

A simulated client (a Ray actor, a SuperNode's ClientApp process) builds its digits partition on its first
message, and for that imports scikit-learn, Hugging Face ``datasets`` and flwr-datasets: about 3.5 s of CPU
in each process, against some 30 ms for a round of local training on it. The partition depends only on its
arguments and the code and library versions that make it, so :mod:`fedrobust.data` keeps it here once made.

Entries live in ``$FEDROBUST_CACHE_DIR`` (``off`` or empty: no cache), else
``$XDG_CACHE_HOME/fedrobust/arrays`` (``~/.cache/fedrobust/arrays``, next to the numba kernels' cache), one
``.npz`` file per key (a SHA-256 of the key's canonical JSON). A file is written under a temporary name and
renamed into place, so readers see it whole or not at all, and concurrent writers of one key (two actors of
a run) both leave the same bytes. A file that cannot be read (truncated, corrupted: ``.npz`` members carry
CRC-32 checksums) is a miss and is written again. A cache that cannot be written (a read-only home) only
costs the time it would have saved.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["CACHE_DIR_ENV", "cache_dir", "load", "store"]

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "FEDROBUST_CACHE_DIR"
_OFF = ("", "off", "0", "none", "false")


def cache_dir() -> Path | None:
    """Where entries live, or None when the cache is off (``FEDROBUST_CACHE_DIR=off``)."""
    value = os.environ.get(CACHE_DIR_ENV)
    if value is not None:
        return None if value.strip().lower() in _OFF else Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fedrobust" / "arrays"


def _path(key: Mapping[str, Any]) -> Path | None:
    root = cache_dir()
    if root is None:
        return None
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return root / f"{key.get('kind', 'entry')}-{digest[:32]}.npz"


def load(key: Mapping[str, Any]) -> dict[str, np.ndarray] | None:
    """The arrays stored under ``key`` (JSON-serializable), or None when there is no readable entry."""
    path = _path(key)
    if path is None or not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as entry:
            return {name: entry[name] for name in entry.files}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        logger.warning("cache entry %s unreadable (%s: %s); computing it again", path, type(exc).__name__, exc)
        return None


def store(key: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
    """Keep ``arrays`` under ``key``; a failure to write is logged and otherwise ignored."""
    path = _path(key)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as sink:
                np.savez(sink, allow_pickle=False, **arrays)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        logger.debug("cache entry %s not written: %s", path, exc)
