"""The robustness study: robust rules x attacks x data partitions x seeds, in parallel, resumable.

    python -m experiments.study --jobs 2 --out outputs/study          # the full study
    python -m experiments.study --rules mean median --attacks none sign_flip --seeds 0 --rounds 3 --out /tmp/s

Every run is composed from the Hydra configs in ``conf/`` exactly as
``python -m experiments.run`` composes it (``aggregator=<rule> attack=<attack>
partition=<partition> ...``), so any cell of the study can be re-run on Flower's
simulation engine with the overrides stored in its result file. The runs
themselves use the in-process transport of :mod:`experiments.inprocess` (same
server and ClientApp code, no Ray start-up per run).

Settings shared by every run, and why:

* ``num_byzantine=f`` also for ``attack=none``: every rule is then configured
  identically (same f, same trimming) with and without an attack; with
  ``attack=none`` the f clients simply behave honestly.
* ``liveness.quarantine_after=0``: no client is ever quarantined, so every round
  samples all clients. Quarantine would take Byzantine clients out after a few
  rejected replies, which (a) changes the attack while the run goes on and (b)
  shrinks the round below what Bulyan needs (n >= 4f+3 = 19 with f=4); the study
  measures the aggregation rules, so it keeps the population fixed.
* Rule names are the registered aggregators, or pipelines as ``aggregator.name`` takes
  them: ``nnm+<rule>`` puts nearest-neighbour mixing in front of ``<rule>``. Not in the default sweep
  but available as options: ``--rules fltrust`` (the server trains on a root data set
  of ``aggregator.root_size`` training examples each round) and ``--attacks backdoor``
  (trigger-patch poisoning; each round's row then has ``backdoor_asr``, the attack
  success rate, next to the clean ``accuracy``; docs/results.md, "Backdoor and FLTrust").

One JSON file per run lands in ``--out`` (the per-round rows included); runs whose
file exists with the same overrides and the same clients' training are skipped, so an interrupted study
continues where it stopped (a result made with other settings is run again).
``--out/study.json`` records the command line and wall time of each invocation.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import dataclasses
import functools
import hashlib
import json
import logging
import multiprocessing
import os
import shlex
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from experiments.source_digest import source_digest
from fedrobust.config import ConfigError, RunConfig
from fedrobust.text import did_you_mean

log = logging.getLogger(__name__)

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"

BASE_RULES = (
    "mean",
    "median",
    "trimmed_mean",
    "krum",
    "multikrum",
    "geometric_median",
    "centered_clipping",
    "bulyan",
)
# NNM in front of the rule with the best worst case in the pilot
# (docs/results.md, "How the rule behind NNM was chosen").
NNM_RULE = "nnm+multikrum"
RULES = (*BASE_RULES, NNM_RULE)
ATTACKS = ("none", "sign_flip", "gaussian", "label_flip", "alie", "ipm", "mimic", "min_max", "nan")
PARTITIONS = ("iid", "dirichlet", "pathological")  # conf/partition: pathological gives each client 2 classes
DEFAULT_PARTITIONS = ("iid", "dirichlet")  # the settings, which the study reports

DEFAULT_ROUNDS = 15
DEFAULT_CLIENTS = 20
DEFAULT_BYZANTINE = 4
DEFAULT_ALPHA = 0.5
DEFAULT_SEEDS = (0, 1, 2)

# Statuses of a finished run. A run that ended in "error" (a bug, not a property of the
# configuration) is run again by the next invocation; the others are kept.
OK = "ok"
QUORUM = "quorum_error"
ERROR = "error"


@dataclass(frozen=True, order=True)
class RunSpec:
    """One cell of the study for one seed."""

    partition: str
    rule: str
    attack: str
    seed: int

    @property
    def key(self) -> str:
        """File name stem of the run's result."""
        return f"{self.partition}__{self.rule}__{self.attack}__s{self.seed}"


@functools.cache
def _attack_files() -> dict[str, str]:
    """Attack name -> its file in ``conf/attack``.

    ``nan`` lives in ``nan_fill.yaml``: Hydra reads a bare ``nan`` as a float.
    """
    import yaml

    files: dict[str, str] = {}
    for path in sorted((CONF_DIR / "attack").glob("*.yaml")):
        name = (yaml.safe_load(path.read_text()) or {}).get("name", path.stem)
        files.setdefault(str(name), path.stem)
    return files


def study_attack(given: str) -> str:
    """The study's name of an attack given as its name or as its file in ``conf/attack`` (``nan_fill``, as
    Hydra's ``attack=nan_fill`` names it, is the study's ``nan``)."""
    files = _attack_files()
    if given in files:
        return given
    return next((name for name, stem in files.items() if stem == given), given)


@functools.cache
def _aggregator_files() -> dict[str, str]:
    """File stem in ``conf/aggregator`` -> the ``aggregator.name`` it sets."""
    import yaml

    return {
        path.stem: str((yaml.safe_load(path.read_text()) or {}).get("name", path.stem))
        for path in sorted((CONF_DIR / "aggregator").glob("*.yaml"))
    }


def is_user_rule(stage: str) -> bool:
    """A rule (or an attack) of the user's own, given as its dotted path (``my_pkg.rules.MyRule`` or
    ``my_pkg.rules:MyRule``)."""
    return "." in stage or ":" in stage


def pipeline_of(rule: str) -> str:
    """``aggregator.name`` for the study's ``rule``: pre-aggregators joined by ``+`` with a rule's file.

    The last stage names a file of ``conf/aggregator`` (its parameters); where that file's rule is named
    otherwise (``centered_clipping_auto`` sets ``centered_clipping`` with ``tau=auto``, ``nnm_krum`` the
    pipeline ``nnm+krum``), its name stands in for the stage.
    """
    *pre, last = rule.split("+")
    if is_user_rule(last):
        return rule  # its import and contract are checked when the runs' configs are composed
    files = _aggregator_files()
    if last not in files:
        raise ValueError(
            f"rule {rule!r}: its last stage {last!r}{did_you_mean(last, files)} names no file of conf/aggregator "
            f"(or a rule of your own by its dotted path, my_pkg.rules.MyRule); choices: {', '.join(files)}"
        )
    return "+".join([*pre, files[last]])


def attack_choice(attack: str) -> str:
    """The Hydra choice (``attack=<this>``) that selects the attack registered as ``attack``."""
    files = _attack_files()
    if attack not in files:
        raise ValueError(f"no config in conf/attack for attack {attack!r}{did_you_mean(attack, files)} (or an "
                         f"attack of your own by its dotted path, my_pkg.attacks.MyAttack); configured attacks: "
                         f"{sorted(files)}")
    return files[attack]


def attack_overrides(attack: str) -> list[str]:
    """The Hydra overrides that select ``attack``: its group file, or a user attack by its ``_target_``."""
    if is_user_rule(attack):  # its import and hooks are checked when the runs' configs are composed
        return ["attack=none", f"attack._target_={attack}"]
    return [f"attack={attack_choice(attack)}"]


def overrides_for(
    spec: RunSpec,
    *,
    rounds: int,
    num_clients: int = DEFAULT_CLIENTS,
    num_byzantine: int = DEFAULT_BYZANTINE,
    alpha: float = DEFAULT_ALPHA,
    extra: Sequence[str] = (),
) -> list[str]:
    """The Hydra overrides of ``spec``: ``python -m experiments.run <these>`` runs it on Flower's engine.

    ``extra`` overrides (e.g. ``attack.params.scale=4``) come last and so win.
    """
    *pre, last = spec.rule.split("+")
    if is_user_rule(last):  # the user's rule by its _target_, its pre-aggregators listed in aggregator.pre
        rule = ["aggregator=mean", f"aggregator._target_={last}"]
        rule += [f"aggregator.pre={','.join(pre)!r}"] if pre else []
    else:
        rule = [
            f"aggregator={last}",  # the rule's group file: its parameters
            f"aggregator.name={pipeline_of(spec.rule)!r}",  # the whole pipeline, which tuned attacks then see
        ]
    overrides = [
        *rule,
        *attack_overrides(spec.attack),
        f"partition={spec.partition}",
    ]
    if spec.partition == "dirichlet":
        overrides.append(f"partition.alpha={alpha}")
    overrides += [
        "dataset=digits",
        "model=mlp",
        f"num_clients={num_clients}",
        f"clients_per_round={num_clients}",
        f"num_byzantine={num_byzantine}",
        f"num_rounds={rounds}",
        f"seed={spec.seed}",
        "liveness.quarantine_after=0",
        # The honest baseline takes no attack parameters: those of --set are for the study's attacks.
        *(e for e in extra if spec.attack != "none" or not e.lstrip("+").startswith("attack.params")),
    ]
    return overrides


def compose(overrides_by_key: dict[str, list[str]]) -> dict[str, RunConfig]:
    """Compose ``conf/config.yaml`` with each list of overrides into a validated :class:`RunConfig`."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from experiments.run import to_run_config  # registers the run schema with Hydra
    from fedrobust.run_setup import validate

    configs = {}
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for key, overrides in overrides_by_key.items():
            configs[key] = validate(to_run_config(hydra_compose(config_name="config", overrides=overrides)))
    return configs


def specs_for(
    rules: Iterable[str], attacks: Iterable[str], partitions: Iterable[str], seeds: Iterable[int]
) -> list[RunSpec]:
    """Every combination, in a fixed order."""
    return [
        RunSpec(partition=p, rule=r, attack=a, seed=s)
        for p in partitions
        for r in rules
        for a in attacks
        for s in seeds
    ]


def result_path(out: Path, spec: RunSpec) -> Path:
    return out / f"{spec.key}.json"


def _other_overrides(stored: dict[str, RunSpec], overrides: dict[str, list[str]], out: Path) -> list[str]:
    """``key: removed -> added`` for each finished result in ``out`` whose overrides differ from the requested."""
    lines = []
    for key, spec in stored.items():
        try:
            result = json.loads(result_path(out, spec).read_text())
        except (OSError, ValueError):
            continue  # unreadable: not a finished result, run again
        old, new = result.get("overrides"), overrides[key]
        if result.get("status") in (OK, QUORUM) and isinstance(old, list) and old != new:
            removed, added = sorted(set(old) - set(new)), sorted(set(new) - set(old))
            lines.append(f"{key}: {' '.join(removed) or '(none)'} -> {' '.join(added) or '(none)'}")
    return lines


def user_code(overrides: Sequence[str]) -> dict[str, str]:
    """For each component of the user's own that ``overrides`` name by ``_target_`` (a rule, an attack, a
    model, a data set), the digest of its code (:func:`experiments.source_digest.source_digest`: its file
    and the user's modules it imports): a stored result made with other code is run again."""
    digests = {}
    for override in overrides:
        key, _, target = override.lstrip("+").partition("=")
        if key.endswith("._target_") and target:
            digests[target] = source_digest(target)
    return digests


def _changed_code(
    stored: dict[str, RunSpec], overrides: dict[str, list[str]], out: Path, up_to_date: set[str]
) -> list[str]:
    """``N of them again: the code of my_pkg.attacks.MyAttack changed since`` for the stored results run again
    because the code of a component of the user's own changed (their overrides are the same)."""
    changed: dict[str, int] = {}
    for key, spec in stored.items():
        if key in up_to_date:
            continue
        try:
            result = json.loads(result_path(out, spec).read_text())
        except (OSError, ValueError):
            continue
        if result.get("overrides") != overrides[key]:
            continue
        now, then = user_code(overrides[key]), result.get("user_code", {})
        for target in sorted(t for t in now if then.get(t) != now[t]):
            changed[target] = changed.get(target, 0) + 1
    return [f"{count} of them again: the code of {target} changed since they ran" for target, count in changed.items()]


def _stored(path: Path, overrides: list[str]) -> dict[str, Any] | None:
    """The finished result at ``path`` if it ran with the same overrides (one from other settings is run
    again), else None."""
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if result.get("status") not in (OK, QUORUM) or result.get("overrides") != overrides:
        return None
    return result if result.get("user_code", {}) == user_code(overrides) else None


# The clients' training defaults that changed since results began to record it: a result without the
# record ran with these unless its overrides set them (client.local_epochs was 2 until 2026-11-26).
_BEFORE_THE_RECORD = {"local_epochs": 2}


def _client_of(result: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """The clients' training ``result`` ran with; ``now``: what its overrides compose to today."""
    if "client" in result:
        return dict(result["client"])
    overridden = {o.removeprefix("+").split("=", 1)[0] for o in result.get("overrides", [])}
    return now | {k: v for k, v in _BEFORE_THE_RECORD.items() if f"client.{k}" not in overridden}


def _up_to_date(stored: dict[str, RunSpec], overrides: dict[str, list[str]], out: Path) -> set[str]:
    """The runs whose stored result holds: same overrides, the same clients' training and the same code of
    the user's own components (:func:`user_code`).

    The overrides do not name what the config files set by default, so a result also records its
    clients' training (``client``); after a default there changes (``client.local_epochs``, 2 -> 3 on
    2026-11-26), a result from before it is run again, never passed off as the new setting's. The
    clients' training depends on the sweep's overrides, not on the seed or the partition, so one composed
    run per rule and attack gives it.
    """
    found = {key: result for key, spec in stored.items()
             if (result := _stored(result_path(out, spec), overrides[key])) is not None}
    representative: dict[tuple[str, str], str] = {}
    for key in found:
        representative.setdefault((stored[key].rule, stored[key].attack), key)
    composed = compose({key: overrides[key] for key in representative.values()})
    client = {group: dataclasses.asdict(composed[key].client) for group, key in representative.items()}
    return {key for key, result in found.items()
            if _client_of(result, now := client[(stored[key].rule, stored[key].attack)]) == now}


def _write_json(path: Path, value: Any) -> None:
    """Write atomically: an interrupted write never leaves a half file that looks finished."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, sort_keys=True, allow_nan=True))
    os.replace(tmp, path)


def _slim(row: dict[str, Any]) -> dict[str, Any]:
    """A round's metrics without the per-node liveness snapshot (constant here: nobody is quarantined)."""
    return {k: v for k, v in row.items() if k != "liveness"}


def run_one(spec: RunSpec, cfg: RunConfig, overrides: list[str], out: Path) -> dict[str, Any]:
    """Run one configuration in this process and write its result file; return the result."""
    from experiments.inprocess import run_inprocess
    from fedrobust.strategies.errors import QuorumError

    started, cpu_started = time.perf_counter(), time.process_time()
    status, error = OK, ""
    with tempfile.TemporaryDirectory(prefix="fedrobust-study-") as scratch:
        run_dir = Path(scratch)
        try:
            run_inprocess(cfg, run_dir)
        except QuorumError as err:
            status, error = QUORUM, str(err)
        except Exception as err:
            status, error = ERROR, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
        metrics = run_dir / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        model = run_dir / "final_model.safetensors"
        model_sha256 = hashlib.sha256(model.read_bytes()).hexdigest() if model.exists() else ""
    result = {
        **dataclasses.asdict(spec),
        "status": status,
        "error": error,
        "seconds": time.perf_counter() - started,
        # CPU time of this process: the cost of the run whatever else the machine was doing.
        "cpu_seconds": time.process_time() - cpu_started,
        "num_rounds": cfg.num_rounds,
        "num_clients": cfg.num_clients,
        "num_byzantine": cfg.num_byzantine,
        "alpha": cfg.partition.alpha,
        "overrides": overrides,
        "user_code": user_code(overrides),
        # What the overrides leave to the config files' defaults: a resumed sweep compares it (_up_to_date).
        "client": dataclasses.asdict(cfg.client),
        "final_model_sha256": model_sha256,
        "rows": [_slim(r) for r in rows],
    }
    _write_json(result_path(out, spec), result)
    return result


def _worker_init() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("strategies").setLevel(logging.ERROR)  # "round not aggregated" is in the result


def _summary(result: dict[str, Any]) -> str:
    rows = result["rows"]
    acc = f"acc {rows[-1]['accuracy']:.3f}" if rows else "no round"
    if rows and isinstance(rows[-1].get("backdoor_asr"), int | float):
        acc += f" backdoor ASR {rows[-1]['backdoor_asr']:.3f}"
    status = "" if result["status"] == OK else f"  [{result['status']}: {result['error'].splitlines()[0][:160]}]"
    return f"{acc} in {result['seconds']:.1f} s{status}"


def run_study(
    *,
    rules: Sequence[str] = RULES,
    attacks: Sequence[str] = ATTACKS,
    partitions: Sequence[str] = DEFAULT_PARTITIONS,
    seeds: Sequence[int] = DEFAULT_SEEDS,
    rounds: int = DEFAULT_ROUNDS,
    num_clients: int = DEFAULT_CLIENTS,
    num_byzantine: int = DEFAULT_BYZANTINE,
    alpha: float = DEFAULT_ALPHA,
    extra: Sequence[str] = (),
    jobs: int = 2,
    out: Path,
    command: str = "",
    echo: bool = True,
    replace: bool = False,
) -> list[dict[str, Any]]:
    """Run every combination that has no result in ``out`` yet; return the results of all of them.

    With ``jobs > 1`` the runs go to a pool of ``jobs`` processes (one PyTorch
    thread each); with ``jobs=1`` they run in this process, one after the other.

    Raises
    ------
    ValueError
        ``out`` holds finished results of these runs made with other overrides, and not ``replace``:
        they are kept, not run again over (a study is one setting per results directory).
    """
    for partition in partitions:
        if partition not in PARTITIONS:
            raise ValueError(f"unknown partition {partition!r}; valid choices: {list(PARTITIONS)}")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    out.mkdir(parents=True, exist_ok=True)
    specs = specs_for(rules, attacks, partitions, seeds)
    overrides = {
        s.key: overrides_for(
            s, rounds=rounds, num_clients=num_clients, num_byzantine=num_byzantine, alpha=alpha, extra=extra
        )
        for s in specs
    }
    stored = {s.key: s for s in specs if result_path(out, s).exists()}
    other = _other_overrides(stored, overrides, out)
    if other and not replace:
        raise ValueError(
            f"{len(other)} finished result(s) in {out} ran with other overrides, e.g. {other[0]}; they are kept: "
            "use another --out for these settings, or --replace to run them again with these"
        )
    up_to_date = _up_to_date(stored, overrides, out)
    todo = [s for s in specs if s.key not in up_to_date]
    started = time.perf_counter()
    # The code the workers import now: changes to the working tree during the sweep do not reach them.
    code = code_version()
    # Composing every config first fails on a bad rule or attack name before any run starts.
    configs = compose({s.key: overrides[s.key] for s in todo})
    if echo:
        done_before = len(specs) - len(todo)
        print(f"{len(specs)} runs, {done_before} done already, {len(todo)} to run with {jobs} job(s)", flush=True)
        for line in _changed_code(stored, overrides, out, up_to_date):
            print(line, flush=True)

    def report(done: int, spec: RunSpec, result: dict[str, Any]) -> None:
        if echo:
            elapsed = time.perf_counter() - started
            eta = elapsed / done * (len(todo) - done)
            timing = f"(elapsed {elapsed:.0f} s, eta {eta:.0f} s)"
            print(f"[{done}/{len(todo)}] {spec.key}: {_summary(result)}  {timing}", flush=True)

    if jobs == 1:
        for done, spec in enumerate(todo, 1):
            report(done, spec, run_one(spec, configs[spec.key], overrides[spec.key], out))
    elif todo:
        context = multiprocessing.get_context("spawn")
        with futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_worker_init) as pool:
            pending = {
                pool.submit(run_one, spec, configs[spec.key], overrides[spec.key], out): spec for spec in todo
            }
            for done, future in enumerate(futures.as_completed(pending), 1):
                report(done, pending[future], future.result())
    wall = time.perf_counter() - started
    _record_invocation(out, command=command, ran=len(todo), jobs=jobs, wall=wall, code=code, settings={
        "rules": list(rules), "attacks": list(attacks), "partitions": list(partitions), "seeds": list(seeds),
        "rounds": rounds, "num_clients": num_clients, "num_byzantine": num_byzantine, "alpha": alpha,
        "extra": list(extra),
    })
    if echo:
        print(f"study finished: {len(todo)} runs in {wall:.0f} s", flush=True)
    return [json.loads(result_path(out, s).read_text()) for s in specs]


def code_version() -> str:
    """The git commit of the code (``+dirty`` with uncommitted changes to tracked files), or "" outside git."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return ""
    return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _record_invocation(
    out: Path, *, command: str, ran: int, jobs: int, wall: float, settings: dict[str, Any], code: str
) -> None:
    path = out / "study.json"
    try:
        study = json.loads(path.read_text())
    except (OSError, ValueError):
        study = {"invocations": []}
    study["settings"] = settings
    study["command"] = command or study.get("command", "")
    study["invocations"].append(
        {"command": command, "runs": ran, "jobs": jobs, "wall_seconds": round(wall, 1), "cpu_count": os.cpu_count(),
         "finished_at": time.strftime("%Y-%m-%d %H:%M:%S"), "code": code}
    )
    _write_json(path, study)


def load_results(out: Path) -> list[dict[str, Any]]:
    """Every run result in ``out`` (``study.json`` and unfinished files left out)."""
    results = []
    for path in sorted(out.glob("*__*.json")):
        results.append(json.loads(path.read_text()))
    return results


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.study",
        description="Robust rules x attacks x partitions x seeds on digits, in-process, in parallel and resumable.",
    )
    parser.add_argument("--rules", nargs="+", default=list(RULES),
                        help="aggregation rules, each a conf/aggregator file (centered_clipping_auto) or a rule of "
                             "your own by its dotted path (my_pkg.rules.MyRule), with pre-aggregators in front: "
                             "'nnm+<rule>' (default: %(default)s)")
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS),
                        help="attacks: their names, their files in conf/attack (nan_fill is the study's nan), or "
                             "an attack of your own by its dotted path (my_pkg.attacks.MyAttack) (default: "
                             "%(default)s)")
    parser.add_argument("--partitions", nargs="+", default=list(DEFAULT_PARTITIONS), choices=PARTITIONS,
                        help="(default: %(default)s)")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(DEFAULT_SEEDS), help="(default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="(default: %(default)s)")
    parser.add_argument("--clients", type=int, default=DEFAULT_CLIENTS, help="clients (all of them train every round)")
    parser.add_argument("--byzantine", type=int, default=DEFAULT_BYZANTINE,
                        help="f: the number of Byzantine clients and the rules' f")
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="Dirichlet concentration")
    parser.add_argument("--set", dest="extra", nargs="+", default=[], metavar="KEY=VALUE",
                        help="extra Hydra overrides for every run (attack.params ones for every attack, none aside), "
                             "e.g. +attack.params.scale=4 (use a separate --out)")
    parser.add_argument("--jobs", type=int, default=2, help="parallel processes (default: %(default)s)")
    parser.add_argument("--out", type=Path, required=True,
                        help="results directory; its finished runs of the same settings are kept, not run again")
    parser.add_argument("--replace", action="store_true",
                        help="run again the results in --out that were made with other overrides (they are "
                             "refused otherwise)")
    return parser.parse_args(argv)


def extra_problems(extra: Sequence[str], partitions: Sequence[str] = DEFAULT_PARTITIONS) -> list[str]:
    """What is wrong with ``--set`` overrides, one line each, as ``python -m experiments.run`` checks its own
    (an unknown key, a value of the wrong type, a key that needs Hydra's ``+``, a setting that no run of the
    study reads with its partition)."""
    from experiments.run import override_problems, unused_settings

    problems = override_problems(extra)
    # --rules sets the rule of each run: the same override for all would run one rule under every name.
    taken = [e for e in extra if e.lstrip("+~").split("=", 1)[0] in _SET_BY_RULES]
    problems += [f"{e}: --rules sets the aggregator of each run; a rule of your own is one of them by its dotted "
                 "path, e.g. --rules my_pkg.rules.MyRule 'nnm+my_pkg.rules.MyRule' (its parameters: --set "
                 "+aggregator.params.<name>=...)" for e in taken]
    taken = [e for e in extra if e.lstrip("+~").split("=", 1)[0] in _SET_BY_ATTACKS]
    problems += [f"{e}: --attacks sets the attack of each run; an attack of your own is one of them by its "
                 "dotted path, e.g. --attacks none my_pkg.attacks.MyAttack (its parameters: --set "
                 "+attack.params.<name>=...)" for e in taken]
    wrong = {line.split("=", 1)[0] for line in problems}
    unused = unused_settings([[*extra, f"partition={p}"] for p in partitions])
    return [f"--set {line}" for line in problems + [u for u in unused if u.split("=", 1)[0] not in wrong]]


_SET_BY_RULES = frozenset({"aggregator", "aggregator.name", "aggregator._target_", "aggregator.pre"})
_SET_BY_ATTACKS = frozenset({"attack", "attack.name", "attack._target_"})


def argument_problems(rules: Iterable[str], attacks: Iterable[str]) -> list[str]:
    """What is wrong with ``--rules`` and ``--attacks``, one line each (empty: nothing)."""
    from fedrobust.components import import_target

    problems = []
    # Components of the user's own are imported here too, so that a misspelt one is said with the rest
    # (their contracts are checked when the runs' configs are composed).
    for rule in rules:
        try:
            pipeline_of(rule)
            if is_user_rule(last := rule.split("+")[-1]):
                import_target(last)
        except ValueError as err:
            problems.append(f"--rules: {err}")
    for attack in attacks:
        try:
            attack_overrides(attack)
            if is_user_rule(attack):
                import_target(attack)
        except ValueError as err:
            problems.append(f"--attacks: {err}")
    return problems


def main(argv: Sequence[str] | None = None) -> None:
    from hydra.errors import HydraException

    args_list = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(args_list)
    args.attacks = [study_attack(a) for a in args.attacks]  # Hydra's group choices are taken too
    problems = argument_problems(args.rules, args.attacks) + extra_problems(args.extra, args.partitions)
    if problems:
        _exit_invalid("invalid arguments", problems)
    _worker_init()
    try:
        results = run_study(
            rules=args.rules,
            attacks=args.attacks,
            partitions=args.partitions,
            seeds=args.seeds,
            rounds=args.rounds,
            num_clients=args.clients,
            num_byzantine=args.byzantine,
            alpha=args.alpha,
            extra=args.extra,
            jobs=args.jobs,
            out=args.out,
            command=shlex.join(["python", "-m", "experiments.study", *args_list]),
            replace=args.replace,
        )
    except ConfigError as err:  # a run's configuration, composed before any run starts
        _exit_invalid("invalid configuration", err.problems)
    except (ValueError, OSError) as err:  # other results in --out, arguments out of range, an --out that is a file
        _exit_invalid("invalid arguments", [str(err)])
    except HydraException as err:  # an override Hydra cannot apply, e.g. a new key without its '+'
        said = " ".join(line.strip() for line in str(err).splitlines()[:2])  # Hydra's hint is on its second line
        _exit_invalid("invalid configuration", [f"--set {' '.join(args.extra)}: {said}"])
    _exit_if_failed(results, args.out)


def _exit_if_failed(results: Sequence[dict[str, Any]], out: Path) -> None:
    """Exit 1, naming them, when runs failed with an error (a rule that raised, a bug): their results are not
    results. Runs that stopped for want of quorum are outcomes of the study and count as done."""
    failed = [r for r in results if r.get("status") == ERROR]
    if not failed:
        return
    print(f"experiments.study: {len(failed)} of {len(results)} runs failed with an error (the traceback is in "
          f"each one's result file in {out}; the same command runs them again):", file=sys.stderr)
    for result in failed[:10]:
        key = RunSpec(partition=result["partition"], rule=result["rule"], attack=result["attack"], seed=result["seed"])
        print(f"  {key.key}: {result['error'].splitlines()[0]}", file=sys.stderr)
    if len(failed) > 10:
        print(f"  and {len(failed) - 10} more", file=sys.stderr)
    sys.exit(1)


def _exit_invalid(what: str, problems: Sequence[str], prog: str = "experiments.study") -> NoReturn:
    """Print ``problems`` one per line and exit 2, as ``experiments.run`` does for a bad config."""
    print(f"{prog}: {what}:", file=sys.stderr)
    for line in problems:
        print(f"  {line}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
