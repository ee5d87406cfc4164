"""Hydra entry point: one experiment on Flower's simulation engine, in this process.

    python -m experiments.run                                  # the default experiment
    python -m experiments.run aggregator=krum num_rounds=10    # override anything
    python -m experiments.run -m aggregator=median,krum seed=0,1   # a sweep

Metrics (metrics.jsonl), the resolved config, the final model and the rounds' picture (rounds.png) land
in Hydra's run directory.

Exit codes: 0 done; 1 the run could not train (no nodes, no quorum, every client failing) or
refused to resume from its checkpoints (other settings, none valid), with a one-line reason; 2 an
invalid configuration, every problem on its own line, before Ray or Flower starts; 75 run the same command
again later: stopped by SIGTERM/SIGINT (with checkpoint.dir set it resumes), or not started because another
run holds checkpoint.dir. ``HYDRA_FULL_ERROR=1``
raises instead of exiting 1 or 2, with the traceback.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import sys
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, get_type_hints

os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

# Only the config module here (no torch): a mistyped override fails in well under a second.
from fedrobust.config import ConfigError, RunConfig, coerce, format_value, from_nested, storage_place
from fedrobust.text import did_you_mean

if TYPE_CHECKING:
    from fedrobust.strategies.errors import Preempted

log = logging.getLogger(__name__)

EXIT_FAILED = 1
EXIT_INVALID_CONFIG = 2
# An absolute path: Hydra finds it also when main() is called from an import, not only from `python -m`.
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

ConfigStore.instance().store(name="run_schema", node=RunConfig)


def to_run_config(cfg: DictConfig) -> RunConfig:
    """The typed run config of a composed Hydra config (the hydra node itself dropped)."""
    values: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    values.pop("hydra", None)
    return from_nested(values)


def _full_error() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def _exit_invalid(problems: Sequence[str]) -> NoReturn:
    print("fedrobust: invalid configuration:", file=sys.stderr)
    for line in problems:
        print(f"  {line}", file=sys.stderr)
    sys.exit(EXIT_INVALID_CONFIG)


def _exit_failed(error: Exception) -> NoReturn:
    from fedrobust.strategies.errors import AggregationError  # imported by the run already

    # A rule that raised: the bug is in its code, and the traceback shows where.
    where = " (HYDRA_FULL_ERROR=1 shows the traceback)" if isinstance(error, AggregationError) else ""
    print(f"fedrobust: run failed: {' '.join(str(error).split())}{where}", file=sys.stderr)
    sys.exit(EXIT_FAILED)


# Jobs of a multirun sweep that failed (a round with no quorum, a resume refused, ...), as "job N (overrides):
# reason": the sweep runs its other jobs, and the command then exits 1 naming these.
FAILED_JOBS: list[str] = []
# Jobs of a sweep that finished, as "job N (overrides): accuracy ..., loss ... after R rounds (folder)": said
# together once the sweep ends.
JOB_RESULTS: list[str] = []


def _say_failed_job(error: Exception) -> None:
    job = HydraConfig.get().job
    line = f"job {job.num} ({job.override_dirname or 'no overrides'}): {' '.join(str(error).split())}"
    FAILED_JOBS.append(line)
    print(f"fedrobust: {line}; the sweep goes on", file=sys.stderr)


def _field_hint(key: str) -> tuple[Any, list[str], str] | None:
    """The type of RunConfig setting ``key``, the valid keys of its section and the section's name (KeyError
    for the type where a part of ``key`` is unknown: the section is then the one that has no such key); None
    inside a parameter table."""
    node: Any = RunConfig
    parts = key.split(".")
    for depth, part in enumerate(parts):
        if not dataclasses.is_dataclass(node):
            return None  # aggregator.params.x and the like: free-form tables
        hints = get_type_hints(node)
        section = ".".join(parts[:depth]) or "run config"
        if part not in hints:
            return KeyError, sorted(hints), section
        node = hints[part]
        if depth == len(parts) - 1:
            return node, sorted(hints), section
    return None


def _in_parameter_table(key: str) -> bool:
    """Whether RunConfig setting ``key`` is a parameter table (``aggregator.params``) or a key inside one."""
    node: Any = RunConfig
    for part in key.split("."):
        if not dataclasses.is_dataclass(node):
            return True
        hints = get_type_hints(node)
        if part not in hints:
            return False
        node = hints[part]
    return not dataclasses.is_dataclass(node) and getattr(node, "__origin__", None) is dict


def with_parameter_tables(args: Sequence[str]) -> list[str]:
    """``args`` with overrides of parameter tables made Hydra's add-or-override (``++``).

    The tables are empty in the group files, so Hydra would refuse ``aggregator.params.tau=5`` (a
    new key) and ask for ``+``, which in turn fails for a key a group file does set. Any parameter
    is the user's to set, either way.
    """
    parser = OverridesParser.create()
    out = []
    for arg in args:
        if "=" in arg and not arg.startswith(("+", "~", "-")):
            try:
                override = parser.parse_override(arg)
            except HydraException:
                override = None  # a syntax error: Hydra reports it, with the position
            if override is not None and override.package is None and _in_parameter_table(override.key_or_group):
                arg = "++" + arg
        out.append(arg)
    return out


def _syntax_problem(arg: str) -> str:
    """What is wrong with the syntax of one override, in one line; empty when Hydra parses it."""
    try:
        OverridesParser.create().parse_override(arg)
    except HydraException as err:
        message = " ".join(str(err).split()).split(" See https", 1)[0]
        return f"{arg}: {message} (Hydra's override grammar: https://hydra.cc/docs/advanced/override_grammar/basic)"
    return ""


def config_dirs(args: Sequence[str]) -> list[Path]:
    """The folders Hydra reads config groups from for ``args``: the package's ``conf/``, then a user's own
    (``--config-dir``/``-cd`` and ``hydra.searchpath``'s folders); empty where a ``pkg://`` entry names one
    that cannot be listed here (Hydra then answers for unknown choices itself)."""
    dirs = [CONF_DIR]
    for i, arg in enumerate(args):
        if arg in ("--config-dir", "-cd") and i + 1 < len(args):
            dirs.append(Path(args[i + 1]).expanduser().absolute())
        elif arg.startswith("--config-dir="):
            dirs.append(Path(arg.split("=", 1)[1]).expanduser().absolute())
    overrides = [a for a in args if a.startswith("hydra.searchpath=")]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return dirs  # Hydra says what is wrong with it
    for override in parsed:
        entries = override.value()
        for entry in entries if isinstance(entries, list) else [entries]:
            scheme, _, where = str(entry).rpartition("://")
            if scheme not in ("", "file"):
                return []
            dirs.append(Path(where).expanduser().absolute())
    return dirs


def _group_choices(key: str, dirs: Sequence[Path]) -> list[str] | None:
    """The names of config group ``key`` in ``dirs``; None when the folders are not all known (``dirs``
    empty)."""
    if not dirs:
        return None
    return sorted({p.stem for folder in dirs for p in (folder / key).glob("*.yaml")})


def _search_path_override(dirs: Sequence[Path]) -> list[str]:
    """The user's config folders (``--config-dir``'s and ``hydra.searchpath``'s) as one ``hydra.searchpath``
    override, for a compose() of the package's config that should see them too."""
    extra = list(dirs)[1:]
    return [f"hydra.searchpath=[{','.join(f'file://{folder}' for folder in extra)}]"] if extra else []


def override_problems(args: Sequence[str], dirs: Sequence[Path] | None = None) -> list[str]:
    """Problems of command-line overrides of RunConfig settings, found before Hydra composes the config.

    Hydra's own messages for a value of the wrong type or an unknown key span several lines and
    exit with 1; checking the overrides first gives them the same one-line form as every other
    config problem. Group choices are checked against the config folders ``dirs`` (default: those
    ``args`` name, see :func:`config_dirs`); sweeps and ``hydra.*`` are left to Hydra.
    """
    if dirs is None:
        dirs = config_dirs(args)
    overrides = [arg for arg in args if "=" in arg and not arg.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:  # a syntax error; Hydra's own report of it exits 1 with a traceback hint
        return [_syntax_problem(arg) for arg in overrides if _syntax_problem(arg)]
    problems: list[str] = []
    for override in parsed:
        key = override.key_or_group
        if override.is_sweep_override() and not _is_multirun(args):
            listed = ""
            if key == "aggregator.pre":  # a list of stages, which Hydra reads as a sweep unless quoted
                stages = ",".join(str(v) for v in override.sweep_iterator())
                listed = f"; for a list of pre-aggregators quote it: \"aggregator.pre='{stages}'\""
            problems.append(f"{override.input_line}: a sweep over values runs with -m (--multirun){listed}")
            continue
        if override.package is not None or override.is_delete() or override.is_sweep_override():
            continue
        if key == "hydra" or key.startswith("hydra."):
            continue
        if key == "output_dir":  # read by fedrobust's ServerApp under flwr run; Hydra picks the folder here
            problems.append(
                f"{override.input_line}: experiments.run writes its outputs to Hydra's run folder: set "
                f"hydra.run.dir={format_value(override.value())} (hydra.sweep.dir with -m); output_dir is for "
                "flwr run"
            )
            continue
        found = _field_hint(key)
        if found is None:
            continue
        hint, valid, section = found
        value = override.value()
        if hint is KeyError:
            if not override.is_add():
                typed = key.split(".")[0 if section == "run config" else section.count(".") + 1]
                problems.append(
                    f"{key}={format_value(value)}: unknown key{did_you_mean(typed, valid)}; valid keys in {section}: "
                    f"{valid}"
                )
            continue
        is_group = dataclasses.is_dataclass(hint) and (CONF_DIR / key).is_dir()
        names = _group_choices(key, dirs) if is_group else None
        if is_group and not isinstance(value, str):
            # Hydra's grammar reads a bare nan, inf, 1 or true as a number or a bool, and then fails
            # with a traceback on a group choice, which must be a name.
            kind = "boolean" if isinstance(value, bool) else "number"
            listed = f"; valid choices in {key}: {', '.join(names)}" if names is not None else ""
            problems.append(f"{key}={format_value(value)}: Hydra reads this value as a {kind}, not a name{listed}")
            continue
        if is_group and isinstance(value, str):
            if names is not None and value not in names and "${" not in value:  # Hydra's answer: some 30 lines
                problems.append(f"{key}={format_value(value)}: unknown choice{did_you_mean(value, names)}; "
                                f"valid choices in {key}: "
                                f"{', '.join(names)}")
            continue
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            # fault={round_timeout:30}: Hydra merges it into the table; each entry is checked as fault.<k>=<v>.
            problems += _entry_problems(key, value)
            continue
        if dataclasses.is_dataclass(hint) and not (CONF_DIR / key).is_dir():
            # A table of settings (client, fault, ...), not a group: Hydra's answer is a type error.
            keys = sorted(get_type_hints(hint))
            problems.append(f"{key}={format_value(value)}: {key} is a table of settings, not a choice: set "
                            f"its keys, e.g. {key}.{keys[0]}=...; valid keys in {key}: {keys}")
            continue
        if hint is str and value is None:
            problems.append(f"{key}=null: must be a string")
            continue
        if dataclasses.is_dataclass(hint) or hint is str:
            continue  # a group choice, or a string: Hydra turns any scalar into one
        if override.is_add():
            problems.append(f"+{key}={format_value(value)}: {key} is a setting already: drop the '+'")
            continue
        if hint is int and isinstance(value, float):  # OmegaConf takes no 2.0 for an integer setting
            problems.append(f"{key}={format_value(value)}: must be an integer")
            continue
        if isinstance(value, str):
            if "${" in value:
                continue  # an interpolation, resolved by Hydra
            # OmegaConf converts quoted numbers ('5') for numeric settings; so do we.
            for convert in (int, float):
                try:
                    value = convert(value)
                    break
                except ValueError:
                    pass
        try:
            coerce(hint, value, key)
        except ValueError as err:
            problems.append(str(err))
    return problems


def _entry_problems(table: str, entries: dict[str, Any]) -> list[str]:
    """Problems of the entries of a table given whole (``fault={round_timeout:30}``): unknown keys and
    values of the wrong type, as for ``fault.round_timeout=30``."""
    problems = []
    for name, value in entries.items():
        found = _field_hint(f"{table}.{name}")
        if found is None:
            continue  # a parameter table's own entries
        hint, valid, section = found
        if hint is KeyError:
            problems.append(f"{table}.{name}={format_value(value)}: unknown key; valid keys in {section}: {valid}")
        elif not dataclasses.is_dataclass(hint) and not (isinstance(value, str) and "${" in value):
            try:
                coerce(hint, value, f"{table}.{name}")
            except ValueError as err:
                problems.append(str(err))
    return problems


def unused_settings(jobs: Sequence[Sequence[str]]) -> list[str]:
    """Settings that no job reads with its group choice: server_optimizer.momentum with fedavg,
    partition.alpha with iid. The run would go on as if they were not given. ``jobs``: the overrides of
    each run (one for a single run, one per job of a sweep, see :func:`jobs_of`); a setting some job reads
    is not refused (partition=iid,dirichlet with partition.alpha)."""
    flagged = [dict(_unused_in(job)) for job in jobs]
    if not flagged:
        return []
    return [line for key, line in flagged[0].items() if all(key in f for f in flagged)]


def jobs_of(args: Sequence[str]) -> list[list[str]]:
    """The overrides of each run ``args`` start: one list for a single run, one per job of a sweep (as
    Hydra's basic sweeper expands it); empty where Hydra's parser refuses them (it says why)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        if not any(o.is_sweep_override() for o in parsed):
            return [overrides]
        return [list(job) for job in BasicSweeper.split_arguments(parsed, None)[0]]
    except HydraException:
        return []


def _unused_in(job: Sequence[str]) -> list[tuple[str, str]]:
    """(key, problem line) for each setting of one run's overrides that its group choice does not read."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(job))
    except HydraException:
        return []
    chosen: dict[str, str | None] = {
        "server_optimizer": RunConfig().server_optimizer.name, "partition": RunConfig().partition.name,
        "aggregator": RunConfig().aggregator.name,
    }
    given: list[tuple[str, Any]] = []
    for override in parsed:
        if override.package is not None or override.is_delete():
            continue
        key = override.key_or_group
        group = key.removesuffix(".name")
        if key == "aggregator._target_":  # a user's rule may read any setting
            chosen["aggregator"] = None
        elif group in chosen:
            value = override.value()
            # An interpolation (${oc.env:OPT}) is resolved by Hydra: its choice is not known here.
            chosen[group] = value if isinstance(value, str) and "${" not in value else None
        else:
            given.append((key, override.value()))
    readers: dict[str, tuple[str, list[str]]] = {
        "partition.alpha": ("partition", ["dirichlet"]),
        "partition.classes_per_partition": ("partition", ["pathological"]),
        "aggregator.root_size": ("aggregator", ["fltrust"]),  # the server's root set: FLTrust's alone
    }
    if chosen["aggregator"] is not None:  # a pipeline is read by its rule, the last stage
        chosen["aggregator"] = chosen["aggregator"].split("+")[-1].strip()
    if any(key.startswith("server_optimizer.") for key, _ in given):
        # Imported only then: it imports torch, which a command refused for a type error never needs.
        from fedrobust.server_optim import PARAMS as OPTIMIZER_PARAMS

        readers |= {
            f"server_optimizer.{name}": ("server_optimizer", [o for o, ps in OPTIMIZER_PARAMS.items() if name in ps])
            for name in ("momentum", "beta_1", "beta_2", "tau")
        }
    problems = []
    for key, value in given:
        if key in readers and chosen[readers[key][0]] not in (None, *readers[key][1]):
            group, users = readers[key]
            problems.append((key, f"{key}={format_value(value)}: {group}={chosen[group]} does not use it (only "
                                  f"{', '.join(users)}); choose one of those, or leave the setting out"))
    return problems


def checked_run_config(cfg: DictConfig) -> RunConfig:
    """The valid run config of a composed Hydra config; exits 2 with every problem, one line each, otherwise.

    Under ``HYDRA_FULL_ERROR=1`` the :class:`ConfigError` is raised instead (with its traceback).
    """
    from fedrobust.run_setup import validate  # torch: imported once the overrides' types are known good

    try:
        return validate(to_run_config(cfg), local_devices=True)
    except ConfigError as err:
        if _full_error():
            raise
        _drop_unused_run_dir()
        _exit_invalid(err.problems)


def _drop_unused_run_dir() -> None:
    """Remove the run folder Hydra made for a refused config when it holds nothing else than Hydra's
    record and an empty log, so that outputs/ lists runs only. A folder with anything more (a resumed
    run's checkpoints, a log with lines) is left as it is. (Two commands started in the same second share
    Hydra's default folder; a valid one that has logged nothing yet would lose its .hydra/ and log there.)"""
    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    log_file = out_dir / f"{hydra_cfg.job.name}.log"
    if not out_dir.is_dir() or {p.name for p in out_dir.iterdir()} - {".hydra", log_file.name}:
        return
    if log_file.exists() and log_file.stat().st_size > 0:
        return
    shutil.rmtree(out_dir, ignore_errors=True)
    day = out_dir.parent
    if day.parent.name == "outputs" and re.fullmatch(r"\d{4}-\d{2}-\d{2}", day.name):  # Hydra's default layout
        with contextlib.suppress(OSError):  # not empty: other runs of the day
            day.rmdir()


def _say_preempted(stopped: Preempted, run_cfg: RunConfig) -> None:
    """Tell the user what a stopped run left behind and what the same command does next."""
    if stopped.checkpointed:
        print(f"{stopped}; checkpoint written, run the same command again to resume", flush=True)
    elif not run_cfg.checkpoint.dir:
        print(f"{stopped}; no checkpoint (checkpoint.dir is empty): the same command starts over", flush=True)
    else:
        print(f"{stopped}; no checkpoint (no round had completed): the same command starts over", flush=True)


def _refuse_if_in_use(checkpoint_dir: str) -> None:
    """Raise DirectoryInUseError before Ray starts (a minute on a loaded machine) when another run holds the
    local checkpoint directory, as taking its lock at the start of training would; the lock is given back
    at once (a run that takes it in between is refused there)."""
    from fedrobust.dir_lock import DirectoryLock

    place = storage_place(checkpoint_dir) if checkpoint_dir else ""
    if not place or "://" in place:  # no checkpoints, or an object store (no lock there)
        return
    lock = DirectoryLock(place)
    try:
        lock.acquire()
    except OSError:
        return  # the checkpointer says what is wrong with the place, naming it
    lock.release()


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    run_cfg = checked_run_config(cfg)
    # Imported once the config is known to be good: Ray and Flower take seconds to import.
    from flwr.common.logger import FLOWER_LOGGER, console_handler

    from experiments.simulate import simulate
    from fedrobust.checkpoint import CheckpointMismatchError
    from fedrobust.data import DataUnavailableError
    from fedrobust.dir_lock import DirectoryInUseError
    from fedrobust.strategies.checkpointing import NoValidCheckpointError
    from fedrobust.strategies.errors import (
        EXIT_PREEMPTED,
        AggregationError,
        CheckpointStorageError,
        NodesBusyError,
        Preempted,
        QuorumError,
    )

    # Flower's logger has a console handler of its own and also passes its records on to Hydra's: each
    # Flower line would show twice. Hydra's handlers (the console and the run's log file) show it once.
    FLOWER_LOGGER.removeHandler(console_handler)
    out_dir = Path(HydraConfig.get().runtime.output_dir)

    def exit_preempted_now(stopped: Preempted | None) -> None:
        # From the watchdog thread, while the engine's shutdown hangs: only os._exit ends the process.
        if stopped is None:  # the stop came after the last round: the run is done
            print(f"the run is complete and its outputs are in {out_dir}; a stop came while the simulation "
                  "engine shut down", flush=True)
            logging.shutdown()
            os._exit(0)
        _say_preempted(stopped, run_cfg)
        logging.shutdown()
        os._exit(EXIT_PREEMPTED)

    try:
        _refuse_if_in_use(run_cfg.checkpoint.dir)
        rows = simulate(run_cfg, out_dir, on_stuck_stop=exit_preempted_now, early_signals=EARLY_SIGNALS)
    except Preempted as stopped:
        _say_preempted(stopped, run_cfg)
        sys.exit(EXIT_PREEMPTED)
    # Temporary: the same command works once the other run has ended, or once the simulation's nodes (Ray's
    # workers, slow to start on a loaded machine) answer in time.
    except (DirectoryInUseError, NodesBusyError) as busy:
        if _full_error():
            raise
        if HydraConfig.get().mode == RunMode.MULTIRUN and isinstance(busy, NodesBusyError):
            _say_failed_job(busy)  # the sweep goes on with its next job
            return float("nan")
        print(f"fedrobust: not started: {' '.join(str(busy).split())}", file=sys.stderr)
        sys.exit(EXIT_PREEMPTED)
    # QuorumError: also NoNodesError and ClientFailureError, nothing (more) could be trained. The
    # checkpoint errors: a resume refused (other settings; none of the checkpoints verifies). A Hub data set
    # that could not be read (offline, no local copy). A rule that raised on a round's replies. A checkpoint
    # storage that cannot be used (not writable, no credentials).
    except (
        QuorumError, AggregationError, CheckpointMismatchError, NoValidCheckpointError, DataUnavailableError,
        CheckpointStorageError,
    ) as failed:
        if _full_error():
            raise
        if HydraConfig.get().mode == RunMode.MULTIRUN:  # the sweep goes on with its next job; cli() exits 1
            _say_failed_job(failed)
            return float("nan")
        _exit_failed(failed)
    final = rows[-1]["accuracy"] if rows else float("nan")
    loss = rows[-1].get("loss", float("nan")) if rows else float("nan")
    (out_dir / "final.json").write_text(json.dumps({"accuracy": final, "loss": loss, "rounds": len(rows)}))
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        job = HydraConfig.get().job
        JOB_RESULTS.append(f"job {job.num} ({job.override_dirname or 'no overrides'}): accuracy {final:.4f}, "
                           f"loss {loss:.4f} after {len(rows)} rounds ({out_dir})")
    else:  # Hydra picks the folder (outputs/<date>/<time>): say where it is
        written = ", ".join(sorted(p.name for p in out_dir.iterdir() if p.is_file()))
        print(f"fedrobust: outputs in {out_dir}: {written}", flush=True)
    return final


# SIGTERM and SIGINT that came before the run's own handlers went in (while Python imports torch, Hydra
# composes, Ray starts: seconds): the run stops at its first chance, with exit 75, as for a later signal.
EARLY_SIGNALS: list[int] = []


def _remember_early_signal(signum: int, _frame: object) -> None:
    EARLY_SIGNALS.append(signum)


def sweep_problems(args: Sequence[str]) -> list[str]:
    """Every job of a multirun sweep, composed and checked before the first one starts: a job refused at
    its start would stop Hydra's launcher there (exit 2), after running those before it.

    One line per problem, led by the job's number and swept values; empty when every job is valid.
    """
    from hydra import compose, initialize_config_dir
    from omegaconf.errors import OmegaConfBaseException

    from fedrobust.run_setup import config_problems

    try:
        parsed = OverridesParser.create().parse_overrides([a for a in args if "=" in a and not a.startswith("-")])
    except HydraException:
        return []  # a syntax error: Hydra says so
    jobs = jobs_of(args)
    swept = {o.get_key_element() for o in parsed if o.is_sweep_override()}
    problems: list[str] = []
    labels: list[str] = []
    # a resolved checkpoint place -> (job, "dir" or "mirror") of each job that writes it there (a mirror is
    # read on resume too, so one job's mirror must not be another's dir either)
    checkpoint_places: dict[str, list[tuple[int, str]]] = {}
    hydra_config = HydraConfig.instance().cfg  # set for each job's resolution below, and put back after
    dirs = config_dirs(args)
    # --config-dir is a flag, not in the jobs' overrides: compose() gets every user folder as one search path.
    search_path = _search_path_override(dirs)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for number, job in enumerate(jobs):
            values = " ".join(o for o in job if o.partition("=")[0] in swept)
            labels.append(f"job {number}" + (f" ({values})" if values else ""))
            found = override_problems(job, dirs)
            if not found:
                try:
                    own = [o for o in with_parameter_tables(job)
                           if not (search_path and o.startswith("hydra.searchpath="))]
                    job_cfg, cwd = _as_job(compose(config_name="config", overrides=search_path + own,
                                                   return_hydra_config=True), number)
                    run_cfg = to_run_config(job_cfg)
                    found = config_problems(run_cfg, local_devices=True)
                    for key, where in (("dir", run_cfg.checkpoint.dir), ("mirror", run_cfg.checkpoint.mirror)):
                        if where:
                            checkpoint_places.setdefault(storage_place(where, cwd), []).append((number, key))
                except ConfigError as err:
                    found = list(err.problems)
                except (HydraException, OmegaConfBaseException) as err:
                    found = [" ".join(str(err).split())]
                finally:
                    HydraConfig.instance().cfg = hydra_config
            problems += [f"{labels[number]}: {line}" for line in found]
    return problems + shared_checkpoint_places(checkpoint_places, labels)


def shared_checkpoint_places(places: dict[str, list[tuple[int, str]]], labels: Sequence[str]) -> list[str]:
    """One line for each checkpoint place (resolved) that more than one job of a sweep writes, as its
    ``checkpoint.dir`` or ``checkpoint.mirror`` (``places``: place -> (job number, "dir" or "mirror")):
    a later job would resume an earlier one's run."""
    problems = []
    for where, uses in places.items():
        numbers = sorted({number for number, _ in uses})
        if len(numbers) < 2:
            continue
        keys = sorted({key for _, key in uses})
        shared = (f"checkpoint.{keys[0]}={where}" if len(keys) == 1 else f"{where} as checkpoint.dir or "
                  f"checkpoint.mirror ({', '.join(f'job {n}: {key}' for n, key in sorted(set(uses)))})")
        problems.append(
            f"{', '.join(labels[n] for n in numbers)} share {shared}: each job after the first would resume "
            f"the first one's checkpoint; give each job its own, e.g. "
            f"checkpoint.{keys[0]}='<{keys[0]}>/${{hydra:job.num}}' or '<{keys[0]}>/${{seed}}'"
        )
    return problems


def _as_job(cfg: DictConfig, number: int) -> tuple[DictConfig, Path | None]:
    """``cfg`` (composed with its hydra node) as Hydra's launcher hands job ``number`` to it, without the
    hydra node: ``${hydra:job.num}`` and ``${hydra:runtime.output_dir}`` in a setting resolve as in the job.
    Also the job's working directory where Hydra changes to it (``hydra.job.chdir=true``), else None."""
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.hydra.job.num = number
        cfg.hydra.job.id = number  # as Hydra's basic launcher sets both
        cfg.hydra.runtime.output_dir = str(Path(cfg.hydra.sweep.dir) / str(cfg.hydra.sweep.subdir))
    cwd = Path(cfg.hydra.runtime.output_dir).resolve() if cfg.hydra.job.chdir else None
    # A copy, as Hydra's run_job keeps one: set_config takes the hydra node over, and a hydra: value that
    # refers to another hydra key resolves there once the node is gone from cfg.
    HydraConfig.instance().set_config(copy.deepcopy(cfg))
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, cwd


def _is_multirun(args: Sequence[str]) -> bool:
    return any(a in ("-m", "--multirun") or a.lstrip("+") == "hydra.mode=MULTIRUN" for a in args)


def range_problems(args: Sequence[str], refused: Collection[str]) -> list[str]:
    """What validation finds wrong with the config the command composes without its ``refused`` overrides,
    so that a command refused for a type problem names the other problems too rather than after the fix:
    a value out of range (``num_rounds=0``), and a problem of the groups it picks (``aggregator=krum`` with
    too few clients for its f). Empty when that config does not compose (Hydra then says why)."""
    try:
        parsed = OverridesParser.create().parse_overrides([a for a in args if "=" in a and not a.startswith("-")])
    except HydraException:
        return []
    kept = [o.input_line for o in parsed
            if o.input_line is not None and o.key_or_group.lstrip("+") not in refused and not o.is_sweep_override()]
    if not [line for line in kept if not line.lstrip("+~").startswith("hydra.")]:
        return []  # the defaults are valid: the refusal stays quick, without torch
    from hydra import compose, initialize_config_dir
    from omegaconf.errors import OmegaConfBaseException

    from fedrobust.run_setup import config_problems  # torch: only where there is more to check
    dirs = config_dirs(args)
    search_path = _search_path_override(dirs)
    hydra_config = HydraConfig.instance().cfg
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            own = [o for o in with_parameter_tables(kept) if not (search_path and o.startswith("hydra.searchpath="))]
            job_cfg, _ = _as_job(compose(config_name="config", overrides=search_path + own,
                                         return_hydra_config=True), 0)
        problems = config_problems(to_run_config(job_cfg), local_devices=True)
    except ConfigError as err:
        problems = list(err.problems)
    except (HydraException, OmegaConfBaseException):
        return []
    finally:
        HydraConfig.instance().cfg = hydra_config
    return [line for line in problems if line.split("=", 1)[0] not in refused]


def cli() -> None:
    """``python -m experiments.run``: check the overrides' types (every job's, for a sweep), then let Hydra
    compose and run."""
    signal.signal(signal.SIGTERM, _remember_early_signal)
    signal.signal(signal.SIGINT, _remember_early_signal)
    FAILED_JOBS.clear()
    JOB_RESULTS.clear()
    # A setting unused by every job is refused: a sweep over a group (partition=iid,dirichlet) with a
    # setting for some of its choices (partition.alpha) is not.
    problems = override_problems(sys.argv[1:])
    wrong = {line.split("=", 1)[0] for line in problems}  # a value wrong already is said once
    problems += [line for line in unused_settings(jobs_of(sys.argv[1:])) if line.split("=", 1)[0] not in wrong]
    if not problems and _is_multirun(sys.argv[1:]):
        problems = sweep_problems(sys.argv[1:])
        if problems:
            problems.append("no job of the sweep was started")
    elif problems and not _is_multirun(sys.argv[1:]):
        problems += range_problems(sys.argv[1:], {line.split("=", 1)[0].lstrip("+") for line in problems})
    if problems and not _full_error():
        _exit_invalid(problems)
    sys.argv[1:] = with_parameter_tables(sys.argv[1:])
    main()
    if JOB_RESULTS:  # a sweep: every job's result together, after the last job's own summary
        print(f"fedrobust: the sweep's {len(JOB_RESULTS)} finished job{'s' if len(JOB_RESULTS) > 1 else ''}:")
        for line in JOB_RESULTS:
            print(f"  {line}")
    if FAILED_JOBS:
        print(f"fedrobust: {len(FAILED_JOBS)} job{'s' if len(FAILED_JOBS) > 1 else ''} of the sweep failed:",
              file=sys.stderr)
        for line in FAILED_JOBS:
            print(f"  {line}", file=sys.stderr)
        sys.exit(EXIT_FAILED)


if __name__ == "__main__":
    cli()
