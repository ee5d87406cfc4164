"""What a round checkpoint holds for the server, and how a run resumes from one.

The store itself (atomic, checksummed, fsspec, no pickle; optionally incremental and mirrored) is
built by :func:`fedrobust.checkpoint_mirror.open_store`; this module decides what goes in and when: the
global model, the strategy's state (server optimizer, aggregator, liveness and quarantine, key pins),
RNG states, divergence-guard state, the metrics history, the adaptive interval's state and the
settings the run was started with.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from fedrobust.checkpoint import (
    CONFIG_HASH_KEY,
    Checkpoint,
    CheckpointMismatchError,
    CheckpointStore,
    capture_rng_state,
    config_hash,
    join_groups,
    restore_rng_state,
    split_groups,
)
from fedrobust.checkpoint_interval import AdaptiveInterval
from fedrobust.checkpoint_mirror import MirroredStore, open_store
from fedrobust.components import CAPTURED_KEY
from fedrobust.config import CHECKPOINT_INTERVAL_AUTO
from fedrobust.dir_lock import DirectoryLock
from fedrobust.strategies.errors import CheckpointStorageError
from fedrobust.text import first_and_more

log = logging.getLogger(__name__)

SETTINGS_KEY = "settings"
INTERVAL_KEY = "interval"


# How long a run waits for the mirror's uploads at its end, and when it is stopping.
END_UPLOAD_SECONDS = 60.0
STOP_UPLOAD_SECONDS = 10.0


class NoValidCheckpointError(RuntimeError):
    """Checkpoints exist but none verifies; resuming silently from round 1 would lose the run."""


@dataclass
class GuardState:
    """Divergence guard bookkeeping; checkpointed so a resume keeps the same decisions."""

    best_loss: float = float("inf")
    rollbacks: int = 0
    lr_scale: float = 1.0


@dataclass
class ResumePoint:
    round: int
    global_state: dict[str, torch.Tensor]
    strategy_tensors: dict[str, torch.Tensor]
    strategy_meta: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    guard: GuardState = field(default_factory=GuardState)
    # Simulated clients' Context.state (strategies/client_state.py): its tensors and its JSON part.
    client_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    client_state: dict[str, Any] = field(default_factory=dict)
    # The central evaluation of the initial model (Result's round 0), which a resume does not repeat.
    initial_evaluation: dict[str, Any] | None = None


class RoundCheckpointer:
    """Saves the server's state every k rounds (or an adaptive interval) and/or every T seconds.

    Checkpoints are serialized on the loop's thread and written in the background; with a mirror
    they are then uploaded in the background too.

    Parameters
    ----------
    url : str or None
        Checkpoint directory (path or fsspec URL); None: no checkpoints.
    settings : mapping
        The settings of the run; a checkpoint saved with other settings is not resumed unless
        ``force``, and the refusal names the settings that differ.
    every_rounds : int or "auto"
        Rounds between checkpoints (0: only by time); ``"auto"``: an :class:`AdaptiveInterval`
        fed by :meth:`observe_round` and :meth:`observe_checkpoint`.
    every_seconds, keep, resume, force
        Checkpoint at least every T seconds; keep the newest n; ``never`` ignores existing
        checkpoints; resume from one saved with other settings.
    full_every : int
        Incremental mode: a full checkpoint every K saves, deltas in between.
    storage_options : mapping, optional
        fsspec options of the remote store (the mirror when given, else ``url``).
    mirror : str, optional
        fsspec URL each local checkpoint is uploaded to in the background.
    mtbf : float, optional
        MTBF in seconds for ``"auto"``; None: estimated from the restarts in the checkpoint history.
    num_rounds : int, optional
        Rounds of the run: the last one is always due, and the adaptive interval is at most this.
    """

    def __init__(
        self,
        url: str | None,
        *,
        settings: Mapping[str, Any],
        every_rounds: int | str = 1,
        every_seconds: float = 0.0,
        keep: int = 3,
        resume: str = "auto",
        force: bool = False,
        full_every: int = 1,
        storage_options: Mapping[str, Any] | None = None,
        mirror: str | None = None,
        mtbf: float | None = None,
        num_rounds: int | None = None,
    ) -> None:
        if mirror is not None and url is None:
            raise ValueError(f"a checkpoint mirror ({mirror!r}) needs a checkpoint directory, written first")
        for where in (url, mirror):
            if where is not None:
                _check_writable(where)
        self.store: CheckpointStore | MirroredStore | None = None
        self.not_uploaded: list[int] = []  # rounds the mirror had not uploaded when the store was closed
        if url is not None:
            remote_options = dict(storage_options) if storage_options else None
            try:
                self.store = open_store(
                    url,
                    keep=keep,
                    full_every=full_every,
                    storage_options=None if mirror is not None else remote_options,
                    mirror=mirror,
                    mirror_storage_options=remote_options if mirror is not None else None,
                )
            except (ValueError, TypeError):
                raise  # the arguments' own errors
            except Exception as err:  # the storage's: a missing package, no credentials, no such bucket
                raise CheckpointStorageError(f"checkpoint storage {url!r} cannot be used: {_reason(err)}") from err
        self.url = url
        self.mirror = mirror
        local = self.store.local_dir if self.store is not None else None
        self._lock = DirectoryLock(local) if local is not None else None
        self.settings = json.loads(json.dumps(dict(settings), sort_keys=True, default=str))
        self.fingerprint = config_hash(self.settings)
        self.every_rounds = every_rounds
        self.every_seconds = every_seconds
        self.resume = resume
        self.force = force
        self.num_rounds = num_rounds
        self.interval: AdaptiveInterval | None = None
        if every_rounds == CHECKPOINT_INTERVAL_AUTO:
            self.interval = AdaptiveInterval(max_interval=max(num_rounds or 1, 1), mtbf_seconds=mtbf)
        elif not isinstance(every_rounds, int) or every_rounds < 0:
            raise ValueError(
                f"every_rounds must be an integer >= 0 or {CHECKPOINT_INTERVAL_AUTO!r}, got {every_rounds!r}"
            )
        self._last_time = time.monotonic()
        self.last_round = 0
        self.resumed_from: str | None = None

    def claim(self) -> None:
        """Hold the local checkpoint directory for this run (:class:`fedrobust.dir_lock.DirectoryLock`).

        Raises
        ------
        fedrobust.dir_lock.DirectoryInUseError
            Another run writes there now.
        """
        if self._lock is not None:
            self._lock.acquire()

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()

    def due(self, server_round: int) -> bool:
        """Whether to checkpoint after ``server_round`` (the last round of the run always is)."""
        if self.store is None:
            return False
        if self.num_rounds is not None and server_round >= self.num_rounds:
            return True
        if self.interval is not None:
            by_rounds = self.interval.due(server_round)
        else:
            every = self.every_rounds
            by_rounds = isinstance(every, int) and every > 0 and server_round % every == 0
        by_time = self.every_seconds > 0 and time.monotonic() - self._last_time >= self.every_seconds
        return by_rounds or by_time

    def observe_round(self, seconds: float) -> None:
        """Report one round's wall time (without its checkpoint) to the adaptive interval."""
        if self.interval is not None:
            self.interval.observe_round(seconds)

    def observe_checkpoint(self, blocking_seconds: float, server_round: int) -> None:
        """Report how long the save of ``server_round`` blocked the loop to the adaptive interval."""
        if self.interval is not None:
            self.interval.observe_checkpoint(blocking_seconds, round=server_round)

    @property
    def current_interval(self) -> int | None:
        """Rounds between checkpoints the adaptive interval asks for now; None with a fixed interval."""
        return None if self.interval is None else self.interval.interval

    def save(
        self,
        server_round: int,
        global_state: Mapping[str, torch.Tensor],
        strategy_state: tuple[dict[str, torch.Tensor], dict[str, Any]],
        rows: list[dict[str, Any]],
        guard: GuardState,
        *,
        client_state: tuple[Mapping[str, torch.Tensor], Mapping[str, Any]] | None = None,
        rng_state: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None,
        initial_evaluation: Mapping[str, Any] | None = None,
        wait: bool = False,
    ) -> bool:
        """Checkpoint the state after ``server_round``: serialized now, written in the background.

        ``client_state`` is the simulated clients' state as tensors and JSON metadata
        (:func:`fedrobust.strategies.client_state.encode`); ``rng_state`` the RNG states to save
        instead of the current ones (those captured when ``server_round`` ended, when a later round
        was abandoned); ``initial_evaluation`` the metrics of the initial model's central evaluation.
        Returns whether a checkpoint of ``server_round`` exists (now or from an earlier call).
        """
        if self.store is None:
            return False
        if server_round != self.last_round:
            strategy_tensors, strategy_meta = strategy_state
            rng_tensors, rng_meta = rng_state if rng_state is not None else capture_rng_state()
            client_tensors, client_meta = client_state if client_state is not None else ({}, {})
            tensors = join_groups({"model": dict(global_state), "rng": rng_tensors, "clients": dict(client_tensors)})
            tensors.update(strategy_tensors)  # already "optimizer/..." and "aggregator/..."
            meta = {
                CONFIG_HASH_KEY: self.fingerprint,
                SETTINGS_KEY: self.settings,
                "round": server_round,
                "strategy": strategy_meta,
                "rng": rng_meta,
                "guard": dataclasses.asdict(guard),
                "rows": rows,
                "clients": dict(client_meta),
            }
            if initial_evaluation is not None:
                meta["initial_evaluation"] = dict(initial_evaluation)
            if self.interval is not None:
                # The restart history and moving averages must outlive the process: the MTBF estimate
                # is built from them.
                meta[INTERVAL_KEY] = self.interval.state_dict()
            self.store.save_async(server_round, tensors, meta)
            self._last_time = time.monotonic()
            self.last_round = server_round
        if wait:
            try:
                self.store.wait()
            except Exception as err:  # a stop must still say how far its checkpoints got
                log.error("the checkpoint of round %d could not be written: %s", server_round, _reason(err))
                return False
        return True

    def restore(self, model: Mapping[str, Any] | None = None) -> ResumePoint | None:
        """The latest valid checkpoint (``resume=auto``) of the store or its mirror, or None when there is none.

        With the adaptive interval, its saved state is restored and this resume recorded as a restart.
        ``model``, the run's initial arrays (Flower ``Array`` or tensors by key), is what the checkpoint's
        model must match, key by key, in shape and dtype.

        Raises
        ------
        CheckpointMismatchError
            The newest valid checkpoint was saved with other settings (named) and not ``force``, or holds
            another model than ``model`` (its keys, shapes or dtypes named; ``force`` does not help there:
            the clients could not load it).
        NoValidCheckpointError
            Checkpoints exist but none verifies; the message lists each one with its reason.
            ``resume='never'`` starts fresh and moves them aside (``aside-<time>-round-*``).
        """
        if self.store is None:
            return None
        if self.resume == "never":
            # A fresh start keeps what was there: earlier (or corrupt) checkpoints are moved aside, not deleted.
            moved = self.store.set_aside()
            if moved:
                log.warning("starting fresh (resume=never): moved %d earlier checkpoint(s) aside: %s",
                            len(moved), ", ".join(moved))
            return None
        checkpoint = self._resumable(model, say=True)
        if checkpoint is None:
            return None
        meta, groups = checkpoint.meta, split_groups(checkpoint.tensors)
        restore_rng_state(groups.get("rng", {}), meta["rng"])
        # The newer checkpoints that did not verify would be deleted by this run's saves of their rounds:
        # they are kept for inspection instead, as a fresh start keeps what it finds.
        try:
            moved = self.store.set_aside_failed()
        except Exception as err:  # housekeeping: the resume goes on, and a save of their round deletes them
            log.warning("the checkpoints that did not verify could not be moved aside: %s", _reason(err))
            moved = []
        if moved:
            log.warning("moved %d checkpoint(s) that did not verify aside, kept for inspection: %s", len(moved),
                        ", ".join(moved))
        self.last_round = checkpoint.round
        self.resumed_from = checkpoint.path
        if self.interval is not None:
            if isinstance(meta.get(INTERVAL_KEY), Mapping):
                self.interval.load_state_dict(meta[INTERVAL_KEY], checkpoint.round)
            self.interval.record_restart()
            log.info("checkpoint interval after resume: %r", self.interval)
        log.debug("resuming after round %d from %s", checkpoint.round, checkpoint.path)  # the report says it
        return ResumePoint(
            round=checkpoint.round,
            global_state={k: v.clone() for k, v in groups["model"].items()},
            strategy_tensors={f"{g}/{k}": v for g in ("optimizer", "aggregator") for k, v in groups.get(g, {}).items()},
            strategy_meta=meta["strategy"],
            rows=list(meta["rows"]),
            guard=GuardState(**meta["guard"]),
            client_tensors=dict(groups.get("clients", {})),
            client_state=dict(meta.get("clients", {})),
            initial_evaluation=meta.get("initial_evaluation"),
        )

    def _name(self, setting: str, value: object) -> str:
        """``resume='never'`` for a library run, ``checkpoint.resume=never`` for one of fedrobust's apps (its
        settings hold the run config): how the setting is written where the user writes it."""
        if RUN_SETTINGS_KEY in self.settings:
            return f"checkpoint.{setting}={str(value).lower() if isinstance(value, bool) else value}"
        return f"{setting}={value!r}"

    def check_resume(self, model: Mapping[str, Any] | None = None) -> int | None:
        """The round :meth:`restore` would resume after (None: a fresh start), raising as it would, but
        changing nothing: no RNG state restored, nothing moved aside, no restart recorded. For a caller that
        can refuse a run before starting its nodes."""
        if self.store is None or self.resume == "never":
            return None
        checkpoint = self._resumable(model, say=False)
        return None if checkpoint is None else checkpoint.round

    def _resumable(self, model: Mapping[str, Any] | None, *, say: bool) -> Checkpoint | None:
        """The newest checkpoint that verifies, checked against this run's settings and ``model``; None when
        there is none. ``say``: log what is not compared and a forced resume (once, by the resume itself)."""
        assert self.store is not None
        checkpoint = self.store.latest_valid(None, say=say)
        if checkpoint is None:
            if self.store.rounds():
                where = self.url if self.mirror is None else f"{self.url} or its mirror {self.mirror}"
                raise NoValidCheckpointError(
                    f"no checkpoint in {where} verifies: " + "; ".join(self.store.skipped)
                    + f". Start fresh with {self._name('resume', 'never')}: they are moved aside, not deleted."
                )
            return None
        meta = checkpoint.meta
        saved = meta.get(SETTINGS_KEY, {})
        # Settings a checkpoint of an earlier version does not record are not compared.
        unrecorded = [k for k in _RECORDED_LATER if k in self.settings and k not in saved]
        current = {k: v for k, v in self.settings.items() if k not in unrecorded}
        current, uncaptured = _without_unrecorded_captures(current, saved)
        if uncaptured and say:
            log.warning("checkpoint %s records no values captured by the function of %s (saved by an earlier "
                        "version): not compared", checkpoint.path, ", ".join(uncaptured))
        # A checkpoint that records its lr schedule records num_rounds only under a schedule, by design; and
        # where both record a whole run config (the Hydra path), the schedule and the train config follow from
        # it, so they were compared after all.
        said = [k for k in unrecorded if not (k == "num_rounds" and "server_lr_schedule" in saved)
                and not (k in _IN_RUN_CONFIG and RUN_SETTINGS_KEY in saved and RUN_SETTINGS_KEY in self.settings)]
        if said and say:
            log.warning("checkpoint %s records no %s (saved by an earlier version): not compared",
                        checkpoint.path, ", ".join(said))
        if meta.get(CONFIG_HASH_KEY) != config_hash(current):
            differ = _said_once(_differences(saved, current))
            message = (
                f"checkpoint {checkpoint.path} (round {checkpoint.round}) was saved with other settings: "
                + ("; ".join(differ) if differ else "settings hash differs")
            )
            if not self.force:
                raise CheckpointMismatchError(
                    f"{message}. Resume with the original settings, use another checkpoint directory, or force "
                    f"the resume ({self._name('force_resume', True)})."
                )
            if say:
                log.warning("%s; resuming anyway (forced)", message)
        differ = [] if model is None else model_differences(split_groups(checkpoint.tensors)["model"], model)
        if differ:
            raise CheckpointMismatchError(
                f"checkpoint {checkpoint.path} (round {checkpoint.round}) holds another model than the run's "
                f"initial arrays: {'; '.join(differ)}. Resume with the model it was saved with, or use another "
                f"checkpoint directory (or {self._name('resume', 'never')}: earlier checkpoints are moved aside, not "
                "deleted)."
            )
        return checkpoint

    def close(self, *, stopping: bool = False) -> None:
        """Flush the last write. Its failure (a full disk) is logged, not raised: the run's model is intact in
        memory, and the caller still writes it; only a resume would start from an older round.

        A mirror gets :data:`END_UPLOAD_SECONDS` (a minute) for its uploads, or :data:`STOP_UPLOAD_SECONDS`
        when the run is ``stopping`` (a scheduler's grace period after its signal is often 30 s, and the
        checkpoint is on the local disk already). The rounds it had not uploaded by then are kept in
        :attr:`not_uploaded`.
        """
        if self.store is None:
            return
        try:
            if isinstance(self.store, MirroredStore):
                self.not_uploaded = self.store.close(STOP_UPLOAD_SECONDS if stopping else END_UPLOAD_SECONDS)
            else:
                self.store.close()
        except Exception as err:
            newest = self.newest_round()
            log.error(
                "the last checkpoint could not be written (%s); a resume would start %s",
                _reason(err), "from scratch" if newest is None else f"after round {newest}",
            )

    def newest_round(self) -> int | None:
        """The newest round with a checkpoint in the store (committed; not verified here), or None."""
        if self.store is None:
            return None
        try:
            return max(self.store.rounds(), default=None)
        except Exception:  # the store may be unreadable (a full or vanished disk)
            return None


# Settings recorded since a later version (the train config of start(); the server lr schedule, and
# num_rounds where the lr follows one): an earlier checkpoint lacks them.
_RECORDED_LATER = ("train_config", "num_rounds", "server_lr_schedule", "server_lr_min_ratio")
# The key under which the Hydra path records its whole run config, and the later settings that follow from it.
RUN_SETTINGS_KEY = "run"
_IN_RUN_CONFIG = ("train_config", "server_lr_schedule", "server_lr_min_ratio")


def _without_unrecorded_captures(current: Any, saved: Any, path: str = "") -> tuple[Any, list[str]]:
    """``current`` without the closure values (:data:`fedrobust.components.CAPTURED_KEY`) of a rule or lr
    schedule whose identity in ``saved`` has none (recorded since a later version); the settings' paths."""
    if not (isinstance(current, Mapping) and isinstance(saved, Mapping)):
        return current, []
    out, paths = {}, []
    for key, value in current.items():
        if key == CAPTURED_KEY and key not in saved and "code" in saved:
            paths.append(path or "the settings")
            continue
        out[key], found = _without_unrecorded_captures(value, saved.get(key), f"{path}.{key}" if path else key)
        paths += found
    return out, paths


def _reason(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if not isinstance(err, OSError) else str(err)


def _check_writable(url: str) -> None:
    """Fail before the run when a local checkpoint directory cannot be created or written."""
    if fsspec.utils.get_protocol(url) not in ("file", "local"):
        return
    fs, root = fsspec.core.url_to_fs(url)  # as the store resolves it: ~, file:// and local:// included
    if not isinstance(fs, LocalFileSystem):
        return
    path = Path(root)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise CheckpointStorageError(f"checkpoint directory {url!r} is not writable: {err.strerror or err}") from None


def _differences(saved: Mapping[str, Any], current: Mapping[str, Any], prefix: str = "") -> list[str]:
    """``key: saved -> current`` for every setting that differs (nested mappings walked)."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, "<unset>"), current.get(key, "<unset>")
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out.extend(_differences(a, b, f"{prefix}{key}."))
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


def _said_once(differ: list[str]) -> list[str]:
    """The differences, without a strategy setting's line where the run config's says the same change
    (``seed: 0 -> 1`` beside ``run.seed: 0 -> 1``): the run config's keys are the ones the user typed."""
    in_run = {line.split(": ", 1)[1] for line in differ if line.startswith(f"{RUN_SETTINGS_KEY}.")}
    return [line for line in differ
            if line.startswith(f"{RUN_SETTINGS_KEY}.") or line.split(": ", 1)[1] not in in_run]


def model_differences(saved: Mapping[str, torch.Tensor], model: Mapping[str, Any], shown: int = 4) -> list[str]:
    """What tells a checkpoint's model from ``model`` (Flower ``Array`` or tensors by key): the keys one of them
    lacks, and each shared key whose shape or dtype differs; at most ``shown`` names per kind."""

    def layout(value: Any) -> tuple[tuple[int, ...], str]:
        return tuple(value.shape), str(value.dtype).removeprefix("torch.")

    def listed(what: str, keys: list[str]) -> list[str]:
        if not keys:
            return []
        return [f"{what} {first_and_more(keys, shown)}"]

    missing = [k for k in model if k not in saved]
    extra = sorted(k for k in saved if k not in model)  # the checkpoint's order is not the model's
    changed = [
        f"{k} {layout(saved[k])[0]} {layout(saved[k])[1]} -> {layout(model[k])[0]} {layout(model[k])[1]}"
        for k in model
        if k in saved and layout(saved[k]) != layout(model[k])
    ]
    return (
        listed("not in the checkpoint:", missing)
        + listed("only in the checkpoint:", extra)
        + listed("shape or dtype differs:", changed)
    )


def model_is_finite(state: Mapping[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point())
