"""A local checkpoint directory mirrored to a remote store (S3 or any fsspec URL), and :func:`open_store`.

The local store is written first, as without a mirror; a background thread then copies each committed
checkpoint's files, unchanged and manifest last, to a :class:`fedrobust.checkpoint.CheckpointStore` on the
remote URL. It drives the two stores through their commit, listing and loading steps, so it lives beside
them in the package.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import torch

from fedrobust.checkpoint import Checkpoint, CheckpointStore, CommittedFiles, check_config_hash

logger = logging.getLogger("fedrobust.checkpoint")  # one logger for the store and its mirror, as before

class MirroredStore:
    """Checkpoints written to a local store first, then uploaded to a remote one in the background.

    A save costs what a local save costs: once the local checkpoint is committed, its files are queued
    for upload and a background thread copies them, unchanged (manifest last), to the remote store. A failed
    upload is logged and retried with exponential backoff (bounded by ``max_backoff``) until it succeeds, a
    newer checkpoint supersedes it, or the store is closed; it never raises into the caller. When uploads
    fall behind, only the newest checkpoint (and, for a delta, the chain it needs) is uploaded.

    Parameters
    ----------
    local : str
        Local directory (or any fsspec URL) written first.
    remote : str
        fsspec URL of the mirror, e.g. ``s3://bucket/run``.
    keep : int, default 3
        Retention of both stores (see :class:`CheckpointStore`).
    full_every : int, default 1
        Incremental mode of the local store; the remote receives the same full and delta checkpoints.
    storage_options : Mapping[str, Any], optional
        fsspec options of the remote store (endpoint, credentials).
    initial_backoff, max_backoff : float, default 0.5 and 30.0
        Seconds before the first retry of a failed upload, and the cap of the doubling delay.

    Notes
    -----
    :meth:`latest_valid` loads the newest checkpoint that verifies in either place (the local one on a tie),
    so a run resumes from the remote copy when the local disk was lost.
    """

    def __init__(
        self,
        local: str,
        remote: str,
        *,
        keep: int = 3,
        full_every: int = 1,
        storage_options: Mapping[str, Any] | None = None,
        initial_backoff: float = 0.5,
        max_backoff: float = 30.0,
    ) -> None:
        if not 0 < initial_backoff <= max_backoff:
            raise ValueError(
                f"need 0 < initial_backoff <= max_backoff, got {initial_backoff!r} and {max_backoff!r}"
            )
        self.local = CheckpointStore(local, keep=keep, full_every=full_every)
        # No network at construction (an unreachable mirror must not stop the run): the bucket must exist.
        self.remote = CheckpointStore(remote, keep=keep, storage_options=storage_options, _create=False)
        self.initial_backoff = initial_backoff
        self.max_backoff = max_backoff
        self._cond = threading.Condition()
        self._queue: dict[int, CommittedFiles] = {}
        self._busy = False
        self._closing = False
        self._failures = 0
        self._thread: threading.Thread | None = None
        self.local._on_commit = self._enqueue

    @property
    def local_dir(self) -> str | None:
        """The local store's directory (see :attr:`CheckpointStore.local_dir`)."""
        return self.local.local_dir

    def __repr__(self) -> str:
        return f"MirroredStore({self.local.url!r}, {self.remote.url!r}, keep={self.local.keep})"

    def __enter__(self) -> MirroredStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def keep(self) -> int:
        return self.local.keep

    # ----------------------------------------------------------------------------------------- writing
    def save(self, round: int, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> str:
        """Commit locally (see :meth:`CheckpointStore.save`) and queue the upload; returns the local path."""
        return self.local.save(round, tensors, meta)

    def save_async(
        self, round: int, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]
    ) -> Future[str]:
        """Like :meth:`CheckpointStore.save_async` on the local store; the upload follows the local commit."""
        return self.local.save_async(round, tensors, meta)

    def wait(self) -> str | None:
        """Block until the pending local write is committed (uploads are not waited for: see :meth:`flush`)."""
        return self.local.wait()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the local write and then for the upload queue to drain.

        Returns
        -------
        bool
            True if every committed checkpoint was uploaded (or superseded) within ``timeout`` seconds.
        """
        self.local.wait()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def close(self, upload_timeout: float | None = 60.0) -> list[int]:
        """Flush the local write, give uploads up to ``upload_timeout`` seconds, stop the upload thread.

        Returns the rounds whose checkpoints were still not uploaded then (also logged at WARNING); they
        remain in the local store.
        """
        left: list[int] = []
        try:
            self.local.close()
        finally:
            if not self.flush(upload_timeout):
                with self._cond:
                    left = sorted(self._queue)
                logger.warning(
                    "closing the mirror with checkpoint(s) of round(s) %s not uploaded to %s", left, self.remote.url
                )
            with self._cond:
                self._closing = True
                self._queue.clear()
                self._cond.notify_all()
                thread, self._thread = self._thread, None
            if thread is not None:
                thread.join()
            with self._cond:
                self._closing = False
        return left

    def _enqueue(self, committed: CommittedFiles) -> None:
        with self._cond:
            # A save of round r discarded every local checkpoint >= r: their uploads are void.
            for round_ in [r for r in self._queue if r >= committed.round]:
                del self._queue[round_]
            self._queue[committed.round] = committed
            # Only the newest checkpoint and the chain of deltas it is built on are worth uploading.
            needed: set[int] = set()
            item: CommittedFiles | None = committed
            while item is not None:
                needed.add(item.round)
                item = self._queue.get(item.parent) if item.parent is not None else None
            for round_ in [r for r in self._queue if r not in needed]:
                logger.debug("upload of round %d superseded by round %d", round_, committed.round)
                del self._queue[round_]
            if self._thread is None:
                self._thread = threading.Thread(target=self._upload_loop, name="fedrobust-mirror", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _upload_loop(self) -> None:
        attempts: dict[int, int] = {}
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                round_ = min(self._queue)  # oldest first: a delta's parent goes up before the delta
                item = self._queue[round_]
                self._busy = True
            try:
                self.remote._commit_files(item.round, item.files)
                error: Exception | None = None
            except Exception as exc:
                error = exc
            with self._cond:
                self._busy = False
                if error is None:
                    attempts.pop(round_, None)
                    if self._queue.get(round_) is item:
                        del self._queue[round_]
                    logger.debug("uploaded checkpoint of round %d to %s", round_, self.remote.url)
                else:
                    self._failures += 1
                    attempts[round_] = attempts.get(round_, 0) + 1
                    delay = min(self.initial_backoff * 2 ** (attempts[round_] - 1), self.max_backoff)
                    logger.warning(
                        "upload of checkpoint round %d to %s failed (attempt %d): %s; retrying in %.3g s",
                        round_,
                        self.remote.url,
                        attempts[round_],
                        error,
                        delay,
                    )
                    # Woken early by close() or by a newer checkpoint (which may supersede this one).
                    self._cond.wait(delay)
                self._cond.notify_all()

    @property
    def upload_failures(self) -> int:
        """How many upload attempts have failed so far (each was logged and retried)."""
        with self._cond:
            return self._failures

    # ----------------------------------------------------------------------------------------- reading
    def rounds(self) -> list[int]:
        """Rounds committed in either place, oldest first (checksums are not verified here)."""
        return sorted(set(self.local.rounds()) | set(self._remote_rounds()))

    def _remote_rounds(self) -> list[int]:
        try:
            return self.remote.rounds()
        except Exception as exc:
            logger.warning("cannot list the mirror %s: %s", self.remote.url, exc)
            return []

    def latest_valid(
        self, config_hash: str | None = None, *, force: bool = False, say: bool = True
    ) -> Checkpoint | None:
        """Load the newest checkpoint that verifies in either store (see :meth:`CheckpointStore.latest_valid`).

        An unreachable remote is logged at WARNING (with ``say``) and only the local store is searched.
        """
        candidates: list[tuple[int, int, CheckpointStore, str]] = []
        self.local.skipped, self.remote.skipped = [], []
        self.local.failed, self.remote.failed = [], []
        for preference, store in ((1, self.local), (0, self.remote)):
            try:
                listed = store._list_round_dirs()
            except Exception as exc:
                if say:
                    logger.warning("cannot list %s: %s", store.url, exc)
                continue
            candidates += [(round_, preference, store, name) for round_, name in listed]
        for round_, _, store, name in sorted(candidates, key=lambda c: (c[0], c[1]), reverse=True):
            try:
                checkpoint = store._try_load(round_, name, say=say)
            except Exception as exc:
                logger.warning("cannot load %s from %s: %s", name, store.url, exc)
                continue
            if checkpoint is not None:
                return check_config_hash(checkpoint, config_hash, force)
        return None

    @property
    def skipped(self) -> list[str]:
        """Why each checkpoint the last :meth:`latest_valid` passed over failed, in either place."""
        return [*self.local.skipped, *self.remote.skipped]

    def set_aside(self) -> list[str]:
        """:meth:`CheckpointStore.set_aside` in both places (an unreachable mirror is logged and left)."""
        return self._in_both(lambda store: store.set_aside())

    def set_aside_failed(self) -> list[str]:
        """:meth:`CheckpointStore.set_aside_failed` in both places."""
        return self._in_both(lambda store: store.set_aside_failed())

    def _in_both(self, move: Callable[[CheckpointStore], list[str]]) -> list[str]:
        moved = move(self.local)
        try:
            moved += move(self.remote)
        except Exception as exc:
            logger.warning("cannot set aside the checkpoints of the mirror %s: %s", self.remote.url, exc)
        return moved


def open_store(
    url: str,
    *,
    keep: int = 3,
    full_every: int = 1,
    storage_options: Mapping[str, Any] | None = None,
    mirror: str | None = None,
    mirror_storage_options: Mapping[str, Any] | None = None,
) -> CheckpointStore | MirroredStore:
    """Build the checkpoint store a run configuration asks for.

    Parameters
    ----------
    url : str
        Where checkpoints are written first (a local directory, or any fsspec URL).
    keep, full_every, storage_options
        See :class:`CheckpointStore` (``storage_options`` apply to ``url``).
    mirror : str, optional
        fsspec URL uploaded to in the background (see :class:`MirroredStore`); ``url`` must then be local.
    mirror_storage_options : Mapping[str, Any], optional
        fsspec options of the mirror.

    Returns
    -------
    CheckpointStore or MirroredStore
        Both offer ``save``, ``save_async``, ``wait``, ``close``, ``rounds`` and ``latest_valid``.
    """
    if mirror is None:
        return CheckpointStore(url, keep=keep, full_every=full_every, storage_options=storage_options)
    if storage_options:
        raise ValueError("with a mirror, the first store is local: pass the remote's options as mirror_storage_options")
    return MirroredStore(url, mirror, keep=keep, full_every=full_every, storage_options=mirror_storage_options)
