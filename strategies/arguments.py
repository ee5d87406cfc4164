"""RobustStrategy's arguments, checked before anything is built.

Each wrong argument raises one ValueError that names it, the value given and what is valid, so that a
string from a config file never fails deep inside a comparison or a round, and nothing is half built.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ParamSpec, TypeGuard

import numpy as np

from fedrobust.config import (
    CHECKPOINT_INTERVAL_AUTO,
    MIRROR_OVERLAP_TEXT,
    RESUME_MODES,
    LivenessConfig,
    mirror_overlap,
)
from fedrobust.run_setup import checkpoint_place_problems, liveness_problems
from fedrobust.server_optim import NAMES as SERVER_OPTIMIZERS
from fedrobust.server_optim import PARAMS as SERVER_OPTIMIZER_PARAMS
from fedrobust.server_optim import SCHEDULES as LR_SCHEDULES
from fedrobust.signing import TrustStore
from fedrobust.text import did_you_mean

P = ParamSpec("P")

# Numbers, each optional (None allowed) or not.
_NUMBERS = (
    "fraction_train", "fraction_evaluate", "server_lr", "server_lr_min_ratio", "wait_for_nodes",
    "grace_after_quorum", "divergence_factor", "lr_decay", "checkpoint_every_seconds",
)
_OPTIONAL_NUMBERS = ("max_update_norm", "round_deadline", "checkpoint_mtbf")
_FLAGS = (
    "weight_by_num_examples", "require_signatures", "force_resume", "discover_partitions", "progress",
    "return_freed_memory",
)
_RECORD_KEYS = ("weighted_by_key", "arrayrecord_key", "configrecord_key")
_FUNCTIONS = ("train_metrics_aggr_fn", "evaluate_metrics_aggr_fn", "on_start", "update_hook", "server_update_fn")
_PATHS = ("metrics_path", "checkpoint_dir")
_TABLES = ("aggregator_params", "server_optimizer_params", "settings", "checkpoint_storage_options")
_AT_LEAST_ONE = (
    "min_train_nodes", "min_available_nodes", "checkpoint_keep", "checkpoint_full_every", "max_num_examples",
)
_AT_LEAST_ZERO = ("num_byzantine", "min_evaluate_nodes", "max_round_retries", "over_select", "seed")


def names_misspelt_keywords(init: Callable[P, None]) -> Callable[P, None]:
    """``init`` refusing an unknown keyword argument with the argument it likely meant: Python's own
    TypeError names none, where every other wrong argument gets a "did you mean"."""
    names = [name for name in inspect.signature(init).parameters if name != "self"]

    @functools.wraps(init)
    def checked_init(*args: P.args, **kwargs: P.kwargs) -> None:
        for name in kwargs:
            if name not in names:
                owner = type(args[0]).__name__ if args else init.__qualname__
                raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}{did_you_mean(name, names)}")
        init(*args, **kwargs)

    return checked_init


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def plain(mapping: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of ``mapping`` whose NumPy scalars are Python ones (rules and configs check for int and float)."""
    return {k: v.item() if isinstance(v, np.generic) else v for k, v in (mapping or {}).items()}


def check_keys(name: str, given: Mapping[str, Any] | None, valid: Sequence[str]) -> None:
    """ValueError naming the keys of ``given`` that are not ``valid``, and the valid ones."""
    unknown = sorted(set(given or {}) - set(valid))
    meant = did_you_mean(unknown[0], valid) if len(unknown) == 1 else ""
    check(not unknown, f"{name}: unknown key(s) {unknown}{meant}; valid keys: {list(valid)}")


def is_number(value: object) -> TypeGuard[numbers.Real]:
    """A real number, and not a bool (``True`` is an int to Python, never a setting's value here)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def as_integer(name: str, value: object) -> int:
    """``value`` as an ``int`` (NumPy's integers too), or ValueError naming ``name``."""
    check(isinstance(value, numbers.Integral) and not isinstance(value, bool),
          f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    return int(value)  # type: ignore[call-overload]


def checked(given: Mapping[str, Any]) -> SimpleNamespace:
    """RobustStrategy's arguments (``given``, by parameter name), checked; numbers come back as plain
    ``float`` and ``int`` and flags as ``bool``: NumPy scalars would reach a checkpoint's JSON metadata and
    fail there. Raises ValueError naming the first wrong argument."""
    a = SimpleNamespace(**given)
    _check_types(a)
    _check_ranges(a)
    _check_choices(a)
    return a


def _check_types(a: SimpleNamespace) -> None:
    """Types first, each named, so that the range checks compare numbers."""
    for name in _NUMBERS + _OPTIONAL_NUMBERS:
        value, optional = getattr(a, name), name in _OPTIONAL_NUMBERS
        check(is_number(value) or (optional and value is None),
              f"{name} must be a number{' or None' if optional else ''}, got {value!r} ({type(value).__name__})")
        setattr(a, name, None if value is None else float(value))
    for name in _FLAGS:
        flag = getattr(a, name)
        # A string "false" from a config file would read as True: weighting by claimed counts, for one.
        check(isinstance(flag, bool | np.bool_), f"{name} must be True or False, got {flag!r} ({type(flag).__name__})")
        setattr(a, name, bool(flag))
    for name in _RECORD_KEYS:
        key = getattr(a, name)
        check(isinstance(key, str) and key != "", f"{name} must be a record or metric name, got {key!r}")
    for name in _FUNCTIONS:
        function = getattr(a, name)
        check(function is None or callable(function), f"{name} must be a function or None, got {function!r}")
    for name in _PATHS:
        path = getattr(a, name)
        check(path is None or isinstance(path, str | os.PathLike),
              f"{name} must be a path or None, got {path!r} ({type(path).__name__})")
    for name in ("checkpoint_dir", "checkpoint_mirror"):
        where = getattr(a, name)
        if where:
            problems = checkpoint_place_problems(name, os.fspath(where))
            check(not problems, "; ".join(problems))
    check(a.metrics_path is None or not Path(a.metrics_path).is_dir(),
          f"metrics_path must be a file (one JSON line per round), got the directory {a.metrics_path!r}")
    if a.metrics_path:
        problem = _unwritable(Path(a.metrics_path))
        check(problem is None, f"metrics_path {str(a.metrics_path)!r} cannot be written: {problem}")
    check(a.signing is None or isinstance(a.signing, TrustStore | str | os.PathLike),
          f"signing must be a TrustStore, the path of one, or None, got {a.signing!r} ({type(a.signing).__name__})")
    for name in _TABLES:
        table = getattr(a, name)
        check(table is None or isinstance(table, Mapping),
              f"{name} must be a mapping of names to values, got {table!r} ({type(table).__name__})")
    check(a.liveness is None or isinstance(a.liveness, LivenessConfig | Mapping),
          f"liveness must be a LivenessConfig, a mapping of its fields or None, got {a.liveness!r}")
    if a.liveness is not None:
        given = dataclasses.asdict(a.liveness) if isinstance(a.liveness, LivenessConfig) else a.liveness
        check_keys("liveness", given, [f.name for f in dataclasses.fields(LivenessConfig)])
        live = LivenessConfig(**{k: as_integer(f"liveness {k!r}", v) for k, v in given.items()})
        problems = liveness_problems(live)
        check(not problems, "; ".join(problems))
    for name in _AT_LEAST_ONE + _AT_LEAST_ZERO:
        setattr(a, name, as_integer(name, getattr(a, name)))


def _unwritable(path: Path) -> str | None:
    """Why ``path`` cannot be created or appended to, or None. Looked up without writing anything: the
    strategy is built before the run, and a wrong path should fail there rather than once round 1 ends."""
    if path.exists():
        return None if os.access(path, os.W_OK) else "the file is not writable"
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{str(parent)!r} is a file, not a directory"
    return None if os.access(parent, os.W_OK) else f"the directory {str(parent)!r} is not writable"


def _check_ranges(a: SimpleNamespace) -> None:
    for name in _AT_LEAST_ONE:
        check(getattr(a, name) >= 1, f"{name} must be an integer >= 1, got {getattr(a, name)!r}")
    for name in _AT_LEAST_ZERO:
        check(getattr(a, name) >= 0, f"{name} must be an integer >= 0, got {getattr(a, name)!r}")
    check(math.isfinite(a.server_lr), f"server_lr must be finite, got {a.server_lr!r}")
    check(0.0 < a.fraction_train <= 1.0,
          f"fraction_train must be in (0, 1], got {a.fraction_train!r}: RobustStrategy trains in every round "
          "(Flower's FedAvg takes 0 for evaluation only)")
    check(0.0 <= a.fraction_evaluate <= 1.0, f"fraction_evaluate must be in [0, 1], got {a.fraction_evaluate!r}")
    check(0 <= a.server_lr_min_ratio <= 1, f"server_lr_min_ratio must be in [0, 1], got {a.server_lr_min_ratio!r}")
    check(a.max_update_norm is None or a.max_update_norm >= 0,
          f"max_update_norm must be >= 0 (0 or None: no bound), got {a.max_update_norm!r}")
    a.max_update_norm = a.max_update_norm or None  # 0 is off, as validation.max_update_norm=0 in a run config
    check(a.round_deadline is None or a.round_deadline > 0, f"round_deadline must be > 0 s, got {a.round_deadline!r}")
    check(a.wait_for_nodes >= 0, f"wait_for_nodes must be >= 0 s, got {a.wait_for_nodes!r}")
    check(a.grace_after_quorum >= 0, f"grace_after_quorum must be >= 0 s (0: off), got {a.grace_after_quorum!r}")
    check(a.divergence_factor == 0 or a.divergence_factor > 1,
          f"divergence_factor must be > 1 (0: off), got {a.divergence_factor!r}")
    check(0 < a.lr_decay <= 1, f"lr_decay must be in (0, 1], got {a.lr_decay!r}")
    check(a.checkpoint_every_seconds >= 0, f"checkpoint_every_seconds must be >= 0, got {a.checkpoint_every_seconds!r}")
    check(a.checkpoint_mtbf is None or a.checkpoint_mtbf > 0,
          f"checkpoint_mtbf must be > 0 seconds (None: estimated from restarts), got {a.checkpoint_mtbf!r}")
    every = a.checkpoint_every
    check(every == CHECKPOINT_INTERVAL_AUTO or isinstance(every, int) and not isinstance(every, bool) and every >= 0,
          f"checkpoint_every must be an integer >= 0 (0: only by time and after the last round) or "
          f"{CHECKPOINT_INTERVAL_AUTO!r} (Young/Daly interval), got {every!r}")


def _check_choices(a: SimpleNamespace) -> None:
    check(a.server_optimizer in SERVER_OPTIMIZERS,
          f"unknown server_optimizer {a.server_optimizer!r}; valid choices: {list(SERVER_OPTIMIZERS)}")
    a.server_optimizer_params = plain(a.server_optimizer_params)
    check_keys(f"server_optimizer_params of {a.server_optimizer}", a.server_optimizer_params,
               SERVER_OPTIMIZER_PARAMS[a.server_optimizer])
    for name, value in a.server_optimizer_params.items():
        check(is_number(value), f"server_optimizer_params[{name!r}] must be a number, got {value!r}")
    check(callable(a.server_lr_schedule) or a.server_lr_schedule in LR_SCHEDULES,
          f"unknown server_lr_schedule {a.server_lr_schedule!r}; valid choices: {list(LR_SCHEDULES)} "
          "or a function (server_round, num_rounds) -> factor")
    check(not a.checkpoint_mirror or a.checkpoint_dir not in (None, ""),
          f"checkpoint_mirror={a.checkpoint_mirror!r} needs checkpoint_dir, the local directory written first")
    overlap = mirror_overlap(os.fspath(a.checkpoint_mirror), os.fspath(a.checkpoint_dir)) if a.checkpoint_mirror \
        and a.checkpoint_dir not in (None, "") else ""
    check(not overlap, f"checkpoint_mirror={a.checkpoint_mirror!r} "
          f"{MIRROR_OVERLAP_TEXT.get(overlap, '').format(dir_key='checkpoint_dir')}; a mirror is a second place (a "
          "share, s3://...) that keeps the checkpoints when the first one is lost")
    check(a.resume in RESUME_MODES, f"unknown resume {a.resume!r}; valid choices: {list(RESUME_MODES)}")
    check(not a.force_resume or a.checkpoint_dir not in (None, ""),
          "force_resume=True needs checkpoint_dir: without checkpoints there is nothing to resume")
