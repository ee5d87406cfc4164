"""Atomic, checksummed round checkpoints, and finding the latest valid one.

A checkpoint is one directory per round under the store's root::

    round-000012/
        tensors.safetensors   every tensor (model, optimizer state, aggregator state, RNG)
        meta.json             everything else, JSON only (round, liveness state, metrics, config hash)
        manifest.json         written last: size and sha256 of every file, format version, round

The manifest is the commit marker: a directory without a manifest whose checksums all match is not a
checkpoint. Nothing is ever loaded with pickle, so a checkpoint from an untrusted place cannot run code.

On the local filesystem a checkpoint is first built in a hidden temporary directory
(``.tmp-round-000012-<pid>``), every file fsynced and atomically renamed into place, and only then is the
directory renamed to ``round-000012`` and the parent directory fsynced: a crash at any moment leaves either
the previous checkpoints or the new complete one. Other fsspec filesystems (``memory://``, ``s3://``,
``gs://``) have no atomic directory rename; there files are written directly and the manifest last, and
:meth:`CheckpointStore.latest_valid` verifies every checksum before trusting a checkpoint.

The store keeps one linear history: saving round ``r`` first discards any checkpoint of round ``r`` or
later (left over from a rollback or an earlier run), then commits the new one, then prunes older rounds
down to the ``keep`` newest. One writer per store directory is supported.

Incremental mode (``full_every=K > 1``) writes a full checkpoint every K saves and *deltas* in between::

    round-000013/
        delta.safetensors     per tensor: nothing (unchanged), its raw bytes, or the zlib-compressed XOR of its
                              bytes with the previous checkpoint's (byte planes shuffled); all as uint8
        delta.json            how each tensor is encoded, with its dtype, shape and size
        meta.json             the full JSON metadata, as in a full checkpoint
        manifest.json         format version 2, ``"kind": "delta"`` and the parent's round and manifest sha256

A delta restores its tensors bit for bit from its parent chain; if any link fails verification, the delta
is invalid and :meth:`CheckpointStore.latest_valid` falls back to the newest checkpoint whose chain verifies
(the last full one plus the valid deltas before the broken link). Pruning keeps the ancestors of every kept
checkpoint and, with ``keep`` > 1, a chain that does not rest on the newest full checkpoint: a corrupt full
checkpoint still leaves one to fall back to.

:class:`fedrobust.checkpoint_mirror.MirroredStore` writes locally first and uploads every committed
checkpoint's files, unchanged, to a remote store on a background thread, retrying with bounded backoff; the
caller never waits on the network. The delta encoding is :mod:`fedrobust.checkpoint_delta`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import hashlib
import itertools
import json
import logging
import os
import random
import re
import shutil
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from fedrobust.checkpoint_delta import Raw, apply_delta, build_safetensors, encode_delta, parse_safetensors
from fedrobust.dir_lock import pid_alive

logger = logging.getLogger(__name__)

FORMAT = "fedrobust.checkpoint"
FORMAT_VERSION = 1
# Delta checkpoints get their own version, so a reader that predates them rejects them by name.
DELTA_FORMAT_VERSION = 2
TENSORS_FILE = "tensors.safetensors"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
DELTA_FILE = "delta.safetensors"
DELTA_INDEX_FILE = "delta.json"
# A chain longer than this is a corrupted parent link (a cycle cannot occur: parents are strictly older).
_MAX_CHAIN = 10_000
# The meta key whose value latest_valid() compares with the expected config hash.
CONFIG_HASH_KEY = "config_hash"

_ROUND_DIR = re.compile(r"^round-(\d+)$")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
_ASIDE_PREFIX = "aside-"  # checkpoints set aside by a fresh start: kept, never listed as rounds
_LEFTOVER = re.compile(r"^\.(?:tmp|trash)-round-\d+-(\d+)$")
_GROUP_SEP = "/"


class CheckpointMismatchError(ValueError):
    """The latest valid checkpoint was written by a run with a different configuration."""


class _InvalidCheckpoint(Exception):
    """A checkpoint directory failed verification; the message says why."""


@dataclass
class Checkpoint:
    """One verified checkpoint as loaded from a store.

    Attributes
    ----------
    round : int
        The round the checkpoint was saved after.
    tensors : dict[str, torch.Tensor]
        Every tensor, on the CPU, under the flat keys it was saved with (e.g. ``"model/fc1.weight"``).
    meta : dict[str, Any]
        The JSON metadata exactly as saved (after a JSON round trip: tuples become lists and mapping
        keys become strings).
    path : str
        Where the checkpoint lives: a plain path on the local filesystem, a URL otherwise.
    """

    round: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    path: str


@dataclass(frozen=True)
class _Payload:
    """A checkpoint serialized to bytes on the caller's thread, ready for the writer."""

    round: int
    tensors: bytes
    meta: bytes


def config_hash(config: Any) -> str:
    """Hash a run configuration so a resume can tell whether the config changed.

    Parameters
    ----------
    config : Mapping or dataclass instance
        The configuration. Nested mappings (including OmegaConf's ``DictConfig``), sequences and
        dataclass instances are converted to plain JSON values first.

    Returns
    -------
    str
        Hex sha256 of the canonical JSON (sorted keys, no whitespace).

    Raises
    ------
    TypeError
        If a value cannot be represented in JSON.
    """
    canonical = json.dumps(_to_plain(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _to_plain(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(k): _to_plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_to_plain(v) for v in value]
    return value


def join_groups(groups: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Flatten named tensor groups into one mapping with ``"group/key"`` keys.

    Parameters
    ----------
    groups : Mapping[str, Mapping[str, torch.Tensor]]
        E.g. ``{"model": model.state_dict(), "optimizer": opt_tensors, "rng": rng_tensors}``.

    Returns
    -------
    dict[str, torch.Tensor]
        ``{"model/fc1.weight": ..., "optimizer/exp_avg/fc1.weight": ..., ...}``.

    Raises
    ------
    ValueError
        If a group name is empty or contains ``"/"`` (it could not be split back unambiguously).
    """
    flat: dict[str, torch.Tensor] = {}
    for group, tensors in groups.items():
        if not group or _GROUP_SEP in group:
            raise ValueError(f"tensor group name must be non-empty and contain no '/', got {group!r}")
        for key, tensor in tensors.items():
            flat[f"{group}{_GROUP_SEP}{key}"] = tensor
    return flat


def split_groups(tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Inverse of :func:`join_groups`: split ``"group/key"`` keys at the first ``"/"``.

    Raises
    ------
    ValueError
        If a key has no group prefix.
    """
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for flat_key, tensor in tensors.items():
        group, sep, key = flat_key.partition(_GROUP_SEP)
        if not sep or not group:
            raise ValueError(f"tensor key {flat_key!r} has no 'group/' prefix")
        groups.setdefault(group, {})[key] = tensor
    return groups


def capture_rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Capture the global random number generators for an exact resume.

    Covers Python's ``random``, NumPy's global (legacy) generator, torch's CPU generator and, when CUDA
    is available, every CUDA device's generator.

    Returns
    -------
    tensors : dict[str, torch.Tensor]
        ``"torch_cpu"`` and ``"cuda/<i>"`` (uint8 state tensors); store them as a tensor group.
    meta : dict[str, Any]
        JSON-able states of ``random`` and NumPy, and the number of CUDA devices captured.
    """
    version, internal, gauss_next = random.getstate()
    np_state = np.random.get_state(legacy=True)
    if not isinstance(np_state, tuple):  # a dict: np.random.set_bit_generator replaced MT19937
        raise ValueError("the global NumPy random state is not MT19937, so it has no legacy state to capture")
    name, key, pos, has_gauss, cached_gaussian = np_state
    tensors = {"torch_cpu": torch.get_rng_state()}
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    for index, state in enumerate(cuda_states):
        tensors[f"cuda/{index}"] = state
    meta = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "bit_generator": name,
            "key": key.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "cuda_devices": len(cuda_states),
    }
    return tensors, meta


def restore_rng_state(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
    """Restore the generators captured by :func:`capture_rng_state`.

    CUDA states are restored for the devices present; resuming a GPU run on a machine with fewer (or no)
    CUDA devices logs a warning, since those draws cannot be reproduced there.

    Raises
    ------
    ValueError
        If the Python, NumPy or torch CPU state is missing.
    """
    missing = [k for k in ("python", "numpy") if k not in meta]
    missing += [k for k in ("torch_cpu",) if k not in tensors]
    if missing:
        raise ValueError(f"RNG state is incomplete: missing {missing}")
    py = meta["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npy = meta["numpy"]
    np.random.set_state(
        (
            npy["bit_generator"],
            np.asarray(npy["key"], dtype=np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached_gaussian"],
        )
    )
    torch.set_rng_state(tensors["torch_cpu"].to(device="cpu", dtype=torch.uint8))
    saved = int(meta.get("cuda_devices", 0))
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if saved > available:
        logger.warning(
            "checkpoint holds RNG states of %d CUDA device(s) but %d are available; "
            "GPU random draws will differ from the original run",
            saved,
            available,
        )
    for index in range(min(saved, available)):
        torch.cuda.set_rng_state(tensors[f"cuda/{index}"].cpu(), device=index)


@dataclass(frozen=True)
class _Base:
    """What the writer remembers of its last commit, to encode the next checkpoint as a delta of it."""

    round: int
    manifest_sha256: str
    tensors: dict[str, Raw]
    deltas_since_full: int


@dataclass(frozen=True)
class CommittedFiles:
    """The exact files of one committed checkpoint, as handed to a :class:`MirroredStore` uploader.

    Attributes
    ----------
    round : int
        The checkpoint's round.
    files : tuple[tuple[str, bytes], ...]
        ``(file name, content)`` pairs, the manifest last.
    parent : int or None
        For a delta, the round it is a delta of; None for a full checkpoint.
    """

    round: int
    files: tuple[tuple[str, bytes], ...]
    parent: int | None


class CheckpointStore:
    """Round checkpoints in a directory given as a path or fsspec URL.

    Parameters
    ----------
    url : str
        A local path, or an fsspec URL (``memory://runs/a``, ``s3://bucket/run`` with ``s3fs`` installed).
        Created if missing.
    keep : int, default 3
        How many of the newest checkpoints to keep; older ones are deleted after a new one is committed,
        except the checkpoints a kept delta is built on and, when ``keep`` > 1 and every kept checkpoint
        rests on one full checkpoint, the newest one before it with its chain (a fallback that does not
        depend on that full checkpoint).
    storage_options : Mapping[str, Any], optional
        Passed to the fsspec filesystem, e.g. for S3 ``{"key": ..., "secret": ...,
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}``. Credentials and endpoint may also
        come from the usual environment (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ...).
    full_every : int, default 1
        Incremental mode when > 1: every ``full_every``-th save (and the first save of this store object)
        is a full checkpoint, the saves in between are deltas of the previous checkpoint. 1 writes only
        full checkpoints.

    Notes
    -----
    Use as a context manager (or call :meth:`close`) when writing with :meth:`save_async`, so pending
    writes are flushed.
    """

    def __init__(
        self,
        url: str,
        *,
        keep: int = 3,
        storage_options: Mapping[str, Any] | None = None,
        full_every: int = 1,
        _create: bool = True,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an integer >= 1, got {keep!r}")
        if isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 1:
            raise ValueError(f"full_every must be an integer >= 1 (1 = no deltas), got {full_every!r}")
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(f"storage_options must be a mapping, got {type(storage_options).__name__}")
        self.url = url
        self.keep = keep
        # Why each checkpoint the last latest_valid() passed over failed verification ("<path>: <reason>").
        self.skipped: list[str] = []
        # The committed round-* directories (with a manifest) the last latest_valid() found not to verify.
        self.failed: list[str] = []
        self.full_every = full_every
        # A fresh filesystem object: fsspec's instance cache is keyed on the arguments only, so a
        # cached one would keep an endpoint or credentials read from an environment since changed.
        self._fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, **dict(storage_options or {}))
        self._root = root.rstrip("/") or "/"
        self._local = isinstance(self._fs, LocalFileSystem)
        if _create:
            # Object stores have no directories; for them this only checks (or creates) the bucket.
            self._fs.makedirs(self._root, exist_ok=True)
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[str] | None = None
        self._base: _Base | None = None
        # Called on the writing thread after every commit; MirroredStore queues the upload here.
        self._on_commit: Callable[[CommittedFiles], None] | None = None

    @property
    def local_dir(self) -> str | None:
        """The directory on this machine that holds the checkpoints, resolved as the store writes it (``~``,
        ``file://`` and relative paths), or None for a remote store."""
        return self._root if self._local else None

    def __repr__(self) -> str:
        extra = f", full_every={self.full_every}" if self.full_every > 1 else ""
        return f"CheckpointStore({self.url!r}, keep={self.keep}{extra})"

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------------------- writing
    def save(self, round: int, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> str:
        """Write a checkpoint and return once it is committed (durable on the local filesystem).

        Parameters
        ----------
        round : int
            Round number (>= 0). Any checkpoint of this round or a later one is replaced.
        tensors : Mapping[str, torch.Tensor]
            Flat keys (see :func:`join_groups`); any dtype safetensors supports, any device (copied to
            the CPU). Tensors sharing memory are stored as separate copies.
        meta : Mapping[str, Any]
            JSON-serializable metadata. Its ``"config_hash"`` entry is what :meth:`latest_valid` checks.

        Returns
        -------
        str
            Path (local) or URL of the committed checkpoint directory.

        Raises
        ------
        TypeError
            If a tensor is not a ``torch.Tensor`` or ``meta`` is not JSON-serializable.
        ValueError
            If ``round`` is negative or a tensor is sparse.
        """
        payload = _serialize(round, tensors, meta)
        with self._lock:
            self._wait_pending()
            return self._write(payload)

    def save_async(
        self, round: int, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]
    ) -> Future[str]:
        """Like :meth:`save`, but hashing, delta encoding and file I/O run on a background thread.

        The tensors and meta are serialized on the caller's thread before this returns, so later in-place
        changes to them do not reach the checkpoint. Writes are committed in call order; at most one is in
        flight, so a second call waits for the first write to finish.

        Returns
        -------
        concurrent.futures.Future[str]
            Resolves to the checkpoint's path or URL, or raises the write's error.
        """
        payload = _serialize(round, tensors, meta)
        with self._lock:
            self._wait_pending()
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedrobust-checkpoint")
            future = self._executor.submit(self._write, payload)
            # Nobody may ever look at the future: make a failed background write visible in the log.
            future.add_done_callback(functools.partial(_log_failure, round))
            self._pending = future
            return future

    def wait(self) -> str | None:
        """Block until the pending background write (if any) is committed.

        Returns
        -------
        str or None
            Path of the last background write, or None if there was none pending.

        Raises
        ------
        Exception
            Whatever the pending write raised.
        """
        with self._lock:
            pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def close(self) -> None:
        """Flush pending writes and stop the background thread (a later save_async starts a new one)."""
        try:
            self.wait()
        finally:
            with self._lock:
                executor, self._executor = self._executor, None
            if executor is not None:
                executor.shutdown(wait=True)

    def _wait_pending(self) -> None:
        # Called with the lock held. The error of a failed earlier write belongs to its own future (and
        # the log), not to this unrelated save.
        if self._pending is not None:
            self._pending.exception()
            self._pending = None

    def _write(self, payload: _Payload) -> str:
        base = self._base
        # Forget the base until this write commits: after a failed write the next one is a full checkpoint.
        self._base = None
        as_delta = (
            self.full_every > 1
            and base is not None
            and base.round < payload.round
            and base.deltas_since_full < self.full_every - 1
        )
        new_tensors = parse_safetensors(payload.tensors) if self.full_every > 1 else {}
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "round": payload.round,
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        if as_delta:
            assert base is not None
            delta_bytes, index = encode_delta(new_tensors, base.tensors)
            files = [
                (DELTA_FILE, delta_bytes),
                (DELTA_INDEX_FILE, json.dumps(index, sort_keys=True).encode("utf-8")),
                (META_FILE, payload.meta),
            ]
            manifest |= {
                "format_version": DELTA_FORMAT_VERSION,
                "kind": "delta",
                "parent": {"round": base.round, "manifest_sha256": base.manifest_sha256},
            }
        else:
            files = [(TENSORS_FILE, payload.tensors), (META_FILE, payload.meta)]
            manifest["format_version"] = FORMAT_VERSION
        manifest["files"] = {fname: {"size": len(data), "sha256": _sha256(data)} for fname, data in files}
        manifest_bytes = json.dumps(manifest, indent=1, sort_keys=True).encode("utf-8")
        files.append((MANIFEST_FILE, manifest_bytes))

        location = self._commit_files(payload.round, files)
        if self.full_every > 1:
            self._base = _Base(
                round=payload.round,
                manifest_sha256=_sha256(manifest_bytes),
                tensors=new_tensors,
                deltas_since_full=base.deltas_since_full + 1 if as_delta and base is not None else 0,
            )
        if self._on_commit is not None:
            parent = base.round if as_delta and base is not None else None
            self._on_commit(CommittedFiles(round=payload.round, files=tuple(files), parent=parent))
        return location

    def _commit_files(self, round_: int, files: Sequence[tuple[str, bytes]]) -> str:
        """Discard rounds >= ``round_``, commit ``files`` (manifest last) as its checkpoint, prune."""
        name = _round_name(round_)
        if self._local:
            self._remove_leftovers()
        for old_round, old_name in self._list_round_dirs():
            if old_round >= round_:
                logger.info("discarding checkpoint of round %d (saving round %d)", old_round, round_)
                self._remove(old_name)

        final = self._join(name)
        if self._local:
            self._commit_local(name, files)
        else:
            # No atomic rename on an object store: every object PUT is atomic on its own, and the manifest,
            # written last, is the commit marker; readers verify every checksum before trusting it.
            self._fs.makedirs(final, exist_ok=True)
            ordered = sorted(files, key=lambda item: item[0] == MANIFEST_FILE)
            for fname, data in ordered:
                self._fs.pipe_file(self._join(name, fname), data)
        location = self._display(final)
        logger.debug("committed checkpoint of round %d at %s", round_, location)
        self._prune(round_)
        return location

    def _commit_local(self, name: str, files: Sequence[tuple[str, bytes]]) -> None:
        tmp = self._join(f"{_TMP_PREFIX}{name}-{os.getpid()}")
        if os.path.lexists(tmp):
            shutil.rmtree(tmp)
        os.mkdir(tmp)
        try:
            for fname, data in files:
                part = os.path.join(tmp, f".{fname}.part")
                with open(part, "wb") as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(part, os.path.join(tmp, fname))
            _fsync_dir(tmp)
            os.replace(tmp, self._join(name))
        except BaseException:
            # A full disk: the half-written files would keep it full for every later write (the leftover
            # sweep spares the directories of a live process). Nothing of this write is kept.
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync_dir(self._root)

    def _prune(self, newest: int) -> None:
        listed = self._list_round_dirs()
        older = [(r, name) for r, name in listed if r < newest]
        committed = [(r, name) for r, name in older if self._fs.exists(self._join(name, MANIFEST_FILE))]
        # Uncommitted directories (interrupted writes on non-local filesystems) never count as kept.
        kept = [r for r, _ in sorted(committed, reverse=True)[: self.keep - 1]] + [newest]
        existing = {r for r, _ in committed}
        needed = self._with_ancestors(kept, existing)
        if self.keep > 1 and sum(self._parent_of(r) is None for r in needed) < 2:
            # Every kept checkpoint rests on one full checkpoint: were it corrupt, nothing would restore.
            # The newest chain before it stays too, so that keep > 1 leaves a checkpoint to fall back to.
            before = [r for r in existing if r < min(needed)]
            if before:
                needed |= self._with_ancestors([max(before)], existing)
        for old_round, old_name in older:
            if old_round not in needed:
                logger.debug("pruning checkpoint of round %d", old_round)
                self._remove(old_name)

    def _with_ancestors(self, rounds: Sequence[int], existing: set[int]) -> set[int]:
        """``rounds`` plus every existing checkpoint a delta among them is (transitively) built on."""
        needed: set[int] = set()
        todo = list(rounds)
        while todo:
            round_ = todo.pop()
            if round_ in needed:
                continue
            needed.add(round_)
            parent_round = self._parent_of(round_)
            if parent_round is not None and parent_round < round_ and parent_round in existing:
                todo.append(parent_round)
        return needed

    def _parent_of(self, round_: int) -> int | None:
        """The round a delta checkpoint is built on; None for a full one (or an unreadable manifest: it is
        no valid delta, so it needs no parent)."""
        try:
            manifest = json.loads(self._fs.cat_file(self._join(_round_name(round_), MANIFEST_FILE)))
            parent = manifest.get("parent") if manifest.get("kind") == "delta" else None
        except (OSError, ValueError, AttributeError):
            return None
        parent_round = parent.get("round") if isinstance(parent, dict) else None
        return parent_round if isinstance(parent_round, int) else None

    def _remove(self, name: str) -> None:
        path = self._join(name)
        if self._local:
            # Rename first so a crash mid-delete never leaves a half-deleted round-* directory.
            trash = self._join(f"{_TRASH_PREFIX}{name}-{os.getpid()}")
            if os.path.lexists(trash):
                shutil.rmtree(trash)
            os.replace(path, trash)
            _fsync_dir(self._root)
            shutil.rmtree(trash)
        else:
            # Drop the commit marker first so a partial delete is an invalid checkpoint, not a wrong one.
            manifest = self._join(name, MANIFEST_FILE)
            if self._fs.exists(manifest):
                self._fs.rm_file(manifest)
            with contextlib.suppress(FileNotFoundError):
                self._fs.rm(path, recursive=True)

    def _remove_leftovers(self) -> None:
        """Delete temp/trash directories of writers that no longer run (crashed mid-write)."""
        for entry in os.scandir(self._root):
            match = _LEFTOVER.match(entry.name)
            if match and entry.is_dir(follow_symlinks=False) and not pid_alive(int(match.group(1))):
                logger.info("removing leftover %s", entry.path)
                shutil.rmtree(entry.path, ignore_errors=True)

    # ----------------------------------------------------------------------------------------- reading
    def rounds(self) -> list[int]:
        """Rounds that have a committed manifest, oldest first (checksums are not verified here)."""
        return sorted(
            r for r, name in self._list_round_dirs() if self._fs.exists(self._join(name, MANIFEST_FILE))
        )

    def latest_valid(
        self, config_hash: str | None = None, *, force: bool = False, say: bool = True
    ) -> Checkpoint | None:
        """Load the newest checkpoint that passes verification.

        Checkpoints are tried newest first. One without a manifest (a write that never finished), with a
        file whose size or sha256 differs from the manifest, whose JSON or safetensors fail to parse, or
        (a delta) whose chain of parents back to a full checkpoint does not verify is logged at WARNING
        with the reason and skipped in favour of the previous one.

        Parameters
        ----------
        config_hash : str, optional
            The current run's :func:`config_hash`. If given, the newest valid checkpoint must have been
            saved with the same ``meta["config_hash"]``.
        force : bool, default False
            Load the checkpoint even if its config hash differs (a warning is logged).
        say : bool, default True
            Log each checkpoint skipped (``False``: a check ahead of the load that will say it; the reasons
            are in :attr:`skipped` either way).

        Returns
        -------
        Checkpoint or None
            None if the store holds no valid checkpoint.

        Raises
        ------
        CheckpointMismatchError
            If the newest valid checkpoint's config hash differs from ``config_hash`` and not ``force``.
            Older checkpoints are not searched for a matching hash: they belong to the same history.
        """
        self.skipped, self.failed = [], []
        for round_, name in sorted(self._list_round_dirs(), reverse=True):
            checkpoint = self._try_load(round_, name, say=say)
            if checkpoint is not None:
                return check_config_hash(checkpoint, config_hash, force)
        return None

    def _try_load(self, round_: int, name: str, *, say: bool = True) -> Checkpoint | None:
        try:
            return self._load_verified(round_, name)
        except (_InvalidCheckpoint, OSError, ValueError, SafetensorError) as exc:
            where = self._display(self._join(name))
            if say:
                logger.warning("skipping checkpoint %s: %s", where, exc)
            self.skipped.append(f"{where}: {exc}")
            with contextlib.suppress(Exception):  # a write that never finished (no manifest) is no evidence
                if self._fs.exists(self._join(name, MANIFEST_FILE)):
                    self.failed.append(name)
            return None

    def set_aside(self, names: Sequence[str] | None = None) -> list[str]:
        """Move every ``round-*`` directory (or those of ``names``) to ``aside-<time>-round-*`` (never
        deleted); their new names.

        For a fresh start over checkpoints that are corrupt or belong to another run, or for the newer
        checkpoints a resume found not to verify (:attr:`failed`): they stay for inspection, and no longer
        count as this store's checkpoints (the next save of their round would delete them).
        """
        listed = [name for _, name in self._list_round_dirs()]
        names = listed if names is None else [name for name in listed if name in set(names)]
        taken = set(self._fs.ls(self._root, detail=False)) if names else set()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for count in itertools.count(1):  # a second fresh start within the same second: -2, -3, ...
            if not any(self._join(f"{_ASIDE_PREFIX}{stamp}-{name}") in taken for name in names):
                break
            stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{count + 1}"
        moved = []
        for name in names:
            target = f"{_ASIDE_PREFIX}{stamp}-{name}"
            if self._local:
                os.replace(self._join(name), self._join(target))
            else:
                self._fs.mv(self._join(name), self._join(target), recursive=True)
            moved.append(self._display(self._join(target)))
        if moved and self._local:
            _fsync_dir(self._root)
        return moved

    def set_aside_failed(self) -> list[str]:
        """Set aside the checkpoints the last :meth:`latest_valid` found not to verify; their new names."""
        return self.set_aside(self.failed) if self.failed else []

    def _load_verified(self, round_: int, name: str) -> Checkpoint:
        manifest, _, contents = self._read_verified(round_, name)
        try:
            meta_doc = json.loads(contents[META_FILE])
        except ValueError as exc:  # checksummed, so written so: still named, should it ever be
            raise _InvalidCheckpoint(f"meta.json is not valid JSON: {exc}") from None
        if not isinstance(meta_doc, dict) or not isinstance(meta_doc.get("meta"), dict):
            raise _InvalidCheckpoint("meta.json has no 'meta' object")
        if manifest.get("kind", "full") == "full":
            tensors = load_safetensors(contents[TENSORS_FILE])
        else:
            tensors = load_safetensors(build_safetensors(self._delta_state(round_, manifest, contents)))
        path = self._display(self._join(name))
        return Checkpoint(round=round_, tensors=tensors, meta=meta_doc["meta"], path=path)

    def _state(self, round_: int, depth: int) -> tuple[dict[str, Raw], str]:
        """Raw tensors of a checkpoint (following a delta's chain) and the sha256 of its manifest."""
        manifest, manifest_sha, contents = self._read_verified(round_, _round_name(round_))
        if manifest.get("kind", "full") == "full":
            return parse_safetensors(contents[TENSORS_FILE]), manifest_sha
        return self._delta_state(round_, manifest, contents, depth), manifest_sha

    def _delta_state(
        self, round_: int, manifest: dict[str, Any], contents: dict[str, bytes], depth: int = 0
    ) -> dict[str, Raw]:
        parent = manifest.get("parent")
        parent_round = parent.get("round") if isinstance(parent, dict) else None
        if (
            not isinstance(parent, dict)
            or not isinstance(parent_round, int)
            or isinstance(parent_round, bool)
            or not parent_round < round_
        ):
            raise _InvalidCheckpoint(f"delta has no valid parent round (got {parent!r})")
        if depth > _MAX_CHAIN:
            raise _InvalidCheckpoint("delta chain is too long")
        try:
            base, base_sha = self._state(parent_round, depth + 1)
        except (_InvalidCheckpoint, OSError, ValueError, SafetensorError) as exc:
            raise _InvalidCheckpoint(f"delta of round {parent_round}, which is not loadable ({exc})") from None
        if base_sha != parent.get("manifest_sha256"):
            raise _InvalidCheckpoint(
                f"delta of round {parent_round}, but that checkpoint was replaced after this delta was written"
            )
        try:
            index = json.loads(contents[DELTA_INDEX_FILE])
            return apply_delta(base, parse_safetensors(contents[DELTA_FILE]), index)
        except (KeyError, TypeError, AttributeError, zlib.error) as exc:
            raise _InvalidCheckpoint(f"delta does not apply to round {parent_round}: {exc!r}") from None

    def _read_verified(self, round_: int, name: str) -> tuple[dict[str, Any], str, dict[str, bytes]]:
        """Manifest, its sha256, and the content of every file it lists, all sizes and checksums checked."""
        try:
            raw_manifest = self._fs.cat_file(self._join(name, MANIFEST_FILE))
        except FileNotFoundError:
            raise _InvalidCheckpoint("no manifest.json (the write did not finish)") from None
        try:
            manifest = json.loads(raw_manifest)
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise _InvalidCheckpoint(f"manifest.json is not valid JSON: {exc}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise _InvalidCheckpoint("manifest.json is not a fedrobust checkpoint manifest")
        version = manifest.get("format_version")
        kind = manifest.get("kind", "full")
        # Keyed by (format version, kind); the manifest's values may be anything JSON holds.
        files_by_format: dict[tuple[object, object], set[str]] = {
            (FORMAT_VERSION, "full"): {TENSORS_FILE, META_FILE},
            (DELTA_FORMAT_VERSION, "delta"): {DELTA_FILE, DELTA_INDEX_FILE, META_FILE},
        }
        expected_files = files_by_format.get((version, kind))
        if expected_files is None:
            raise _InvalidCheckpoint(
                f"format version {version!r} of kind {kind!r} is not supported "
                f"(this version reads {FORMAT_VERSION} (full) and {DELTA_FORMAT_VERSION} (delta))"
            )
        if manifest.get("round") != round_:
            raise _InvalidCheckpoint(
                f"manifest says round {manifest.get('round')!r}, directory says {round_}"
            )
        entries = manifest.get("files")
        if not isinstance(entries, dict) or set(entries) != expected_files:
            raise _InvalidCheckpoint(f"manifest must list exactly {sorted(expected_files)}")

        contents: dict[str, bytes] = {}
        for fname, entry in entries.items():
            if not isinstance(entry, dict):
                raise _InvalidCheckpoint(f"manifest entry of {fname} is not an object")
            try:
                data = self._fs.cat_file(self._join(name, fname))
            except FileNotFoundError:
                raise _InvalidCheckpoint(f"{fname} is missing") from None
            if len(data) != entry.get("size"):
                raise _InvalidCheckpoint(
                    f"{fname} has {len(data)} bytes, manifest says {entry.get('size')} (truncated?)"
                )
            if _sha256(data) != entry.get("sha256"):
                raise _InvalidCheckpoint(f"{fname} sha256 differs from the manifest (corrupted)")
            contents[fname] = data
        return manifest, _sha256(raw_manifest), contents

    # ----------------------------------------------------------------------------------------- paths
    def _list_round_dirs(self) -> list[tuple[int, str]]:
        """(round, directory name) of every ``round-*`` directory, committed or not."""
        if not self._local:
            # Object-store listings are cached by fsspec; another process (or a crashed one) may have
            # changed the store since.
            self._fs.invalidate_cache(self._root)
        try:
            listing = self._fs.ls(self._root, detail=True)
        except FileNotFoundError:
            return []  # an object-store prefix with no objects under it yet
        found = []
        for info in listing:
            name = info["name"].rstrip("/").rsplit("/", 1)[-1]
            match = _ROUND_DIR.match(name)
            if match and info.get("type") == "directory":
                found.append((int(match.group(1)), name))
        return found

    def _join(self, *parts: str) -> str:
        if self._local:
            return os.path.join(self._root, *parts)
        return "/".join((self._root.rstrip("/"), *parts))

    def _display(self, path: str) -> str:
        return path if self._local else self._fs.unstrip_protocol(path)


def check_config_hash(checkpoint: Checkpoint, config_hash: str | None, force: bool) -> Checkpoint:
    """``checkpoint`` when it was saved with ``config_hash`` (or ``force``), else CheckpointMismatchError."""
    if config_hash is None:
        return checkpoint
    saved_hash = checkpoint.meta.get(CONFIG_HASH_KEY)
    if saved_hash != config_hash:
        message = (
            f"checkpoint {checkpoint.path} (round {checkpoint.round}) was saved with config hash "
            f"{saved_hash!r}, but the current config hashes to {config_hash!r}"
        )
        if not force:
            raise CheckpointMismatchError(
                f"{message}. Resume with the original config, point the checkpoint directory "
                "elsewhere, or force the resume (latest_valid(..., force=True); "
                "checkpoint.force_resume=true in the run config)."
            )
        logger.warning("%s; loading it anyway (force=True)", message)
    return checkpoint


def _serialize(round: int, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> _Payload:
    """Snapshot a checkpoint into bytes (the only part of a save that runs on the caller's thread)."""
    if isinstance(round, bool) or not isinstance(round, int) or round < 0:
        raise ValueError(f"round must be an integer >= 0, got {round!r}")
    if not isinstance(meta, Mapping):
        raise TypeError(f"meta must be a mapping, got {type(meta).__name__}")
    prepared: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for key, tensor in tensors.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"tensor keys must be non-empty strings, got {key!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensors[{key!r}] must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.layout != torch.strided:
            raise ValueError(f"tensors[{key!r}] is sparse ({tensor.layout}); convert it with .to_dense()")
        tensor = tensor.detach().to("cpu").contiguous()
        # safetensors refuses tensors that share a storage (tied weights, views of one buffer).
        storage = tensor.untyped_storage().data_ptr()
        if tensor.numel() and storage in storages:
            tensor = tensor.clone()
        storages.add(tensor.untyped_storage().data_ptr())
        prepared[key] = tensor
    try:
        meta_bytes = json.dumps(
            {"format_version": FORMAT_VERSION, "round": round, "meta": dict(meta)}, sort_keys=True
        ).encode("utf-8")
    except TypeError as exc:
        raise TypeError(f"checkpoint meta must be JSON-serializable: {exc}") from exc
    return _Payload(round=round, tensors=save_safetensors(prepared), meta=meta_bytes)


def _round_name(round: int) -> str:
    return f"round-{round:06d}"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fsync_dir(path: str) -> None:
    # Makes a rename inside `path` durable. Windows cannot open a directory; there the rename is all we get.
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _log_failure(round: int, future: Future[str]) -> None:
    exc = future.exception()
    if isinstance(exc, OSError):  # the disk's or the store's answer (full, gone, refused): the reason is enough
        logger.error("background write of the checkpoint of round %d failed: %s", round, exc)
    elif exc is not None:
        logger.error("background write of the checkpoint of round %d failed", round, exc_info=exc)
