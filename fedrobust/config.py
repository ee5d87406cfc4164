"""One typed description of a run, shared by every entry point.

Hydra experiments, ``flwr run .`` and deployment all end up here: the Hydra
config and Flower's run config (``[tool.flwr.app.config]``, flattened with dots)
are both turned into a :class:`RunConfig` by :func:`from_flat`. Building and
validating the run from one place is what keeps the three ways of running the
software from drifting apart.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from fedrobust.text import did_you_mean

RESUME_MODES = ("auto", "never")
# checkpoint.every_rounds takes an integer or this keyword (adaptive Young/Daly interval).
CHECKPOINT_INTERVAL_AUTO = "auto"


@dataclass
class AggregatorConfig:
    """Robust rule and the pre-aggregators run in front of it.

    ``name`` picks a built-in rule, or a whole pipeline: pre-aggregators, then the rule, joined with
    ``+`` (the default, ``consistency+direction+dedup+winsorize+nnm+trimmed_mean``, chosen by its worst case over
    the attack set: docs/results.md). ``_target_`` (a dotted path, e.g. ``my_pkg.rules.MyRule``) picks a user rule
    instead, called with ``f`` and ``params`` (see :mod:`fedrobust.components`); ``name`` is then unused.
    """

    name: str = "consistency+direction+dedup+winsorize+nnm+trimmed_mean"
    _target_: str = ""
    # Comma-separated pre-aggregator names in front of a bare rule name or a _target_ rule (e.g.
    # "clipping,nnm"); a pipeline in `name` lists its own. A string rather than a list so that Flower's
    # flat run config can carry it.
    pre: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    pre_params: dict[str, Any] = field(default_factory=dict)
    # Where the rule runs (RobustStrategy's aggregation_device): cpu, cuda, cuda:N or auto.
    device: str = "cpu"
    # Rules that need the server's own update each round (fltrust): the server trains, as a client does,
    # on this many examples drawn from the seed out of the training split (its root data set).
    root_size: int = 100


@dataclass
class DatasetConfig:
    """A built-in data set by ``name``, or a user loader by ``_target_`` called with ``params``."""

    name: str = "digits"
    _target_: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    # Share of the training set held out from every client (stratified, from the seed); when > 0 the server
    # evaluates on it instead of the test set, so that hyper-parameters are picked without seeing the test set.
    validation_fraction: float = 0.0


@dataclass
class PartitionConfig:
    name: str = "iid"
    alpha: float = 0.5
    classes_per_partition: int = 2


@dataclass
class ModelConfig:
    """A built-in model by ``name``, or a user ``torch.nn.Module`` factory by ``_target_``."""

    name: str = "mlp"
    _target_: str = ""
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class ServerOptimizerConfig:
    name: str = "fedavg"
    lr: float = 1.0
    # How the lr changes over the rounds: constant, or cosine (down towards min_lr_ratio * lr after the
    # last round; fedrobust.server_optim.lr_factor).
    schedule: str = "constant"
    min_lr_ratio: float = 0.0
    momentum: float = 0.9
    beta_1: float = 0.9
    beta_2: float = 0.99
    tau: float = 1e-3


@dataclass
class ClientConfig:
    """Local training on each client."""

    # 3, not 2: picked on the validation hold-out (experiments.tune, seeds 0-4 and again 5-9), where the
    # default rule's worst case over the attack set is lower with it (docs/results/default_choice.md).
    local_epochs: int = 3
    batch_size: int = 16
    lr: float = 0.3
    momentum: float = 0.9
    weight_decay: float = 0.0
    device: str = "auto"
    amp: str = "none"
    # Deterministic CUDA kernels, so that a GPU client's round gives the same bytes every time.
    deterministic: bool = True


@dataclass
class ValidationConfig:
    """Checks every reply must pass before it may be aggregated."""

    # L2 bound on a client's whole update; 0 disables the check.
    max_update_norm: float = 100.0
    max_num_examples: int = 1_000_000
    # num-examples comes from the client and can be a lie: weighting by it is opt-in.
    weight_by_num_examples: bool = False


@dataclass
class AttackConfig:
    """Which clients are Byzantine in simulation, and how they behave.

    ``name`` picks a built-in attack (``none``: every client honest). ``_target_`` (a dotted path, e.g.
    ``my_pkg.attacks.MyAttack``) picks a user attack instead, called with ``params``: a subclass of
    :class:`fedrobust.attacks.Attack` (see :mod:`fedrobust.components`); ``name`` then stays ``none``.
    """

    name: str = "none"
    _target_: str = ""
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        """Whether the Byzantine clients attack (a built-in other than ``none``, or a user attack)."""
        return bool(self._target_) or self.name != "none"

    @property
    def label(self) -> str:
        """How the attack is named in messages and logs: its ``_target_`` or its name."""
        return self._target_ or self.name


@dataclass
class FaultConfig:
    """Deadlines, quorum and retries of the round loop."""

    # Seconds the server waits for replies in one round.
    round_timeout: float = 120.0
    # Sample this many extra clients and stop at the first clients_per_round valid replies
    # (timing-dependent: a run with over-selection is not bit-for-bit reproducible).
    over_select: int = 0
    # Once the round's valid replies are enough for the rule, wait at most this many more seconds for
    # the rest (0: until all are in or round_timeout). A dead node then costs a round this long, not
    # the whole deadline; timing-dependent when it cuts a round, like over_select.
    grace_after_quorum: float = 0.0
    # Retries of a round that got fewer valid replies than the rule needs.
    max_round_retries: int = 2
    # Seconds to wait for enough nodes to connect before giving up.
    wait_for_nodes: float = 120.0


@dataclass
class LivenessConfig:
    """When a node counts as suspected, dead or quarantined (see fedrobust.liveness)."""

    suspect_after: int = 1
    dead_after: int = 3
    backoff_rounds: int = 2
    max_backoff: int = 16
    # Invalid replies within 10 rounds after which a node is quarantined; 0 never quarantines.
    quarantine_after: int = 3
    quarantine_rounds: int = 10


@dataclass
class GuardConfig:
    """Divergence guard: roll back a round whose model is non-finite or whose loss explodes."""

    # Roll back when the server-side evaluation loss exceeds this factor times the best so far;
    # 0 disables the loss check (a non-finite model is always rolled back).
    divergence_factor: float = 10.0
    # Server learning rate multiplier applied after each rollback.
    lr_decay: float = 0.5


def storage_place(where: str, cwd: Path | None = None) -> str:
    """A checkpoint location in one spelling, to tell two settings that name one place: a local path
    resolved (``file://`` included; a relative one against ``cwd`` when given), a URL without a trailing
    ``/``."""
    local = where.removeprefix("file://")
    if "://" in local:
        return where.rstrip("/")
    path = Path(local).expanduser()
    return str(((cwd / path) if cwd is not None and not path.is_absolute() else path).resolve())


def mirror_overlap(mirror: str, directory: str) -> str:
    """How a checkpoint mirror fails to be a second place: ``"itself"`` (the directory), ``"inside"`` (a
    folder in it), ``"around"`` (it holds the directory), else ``""``. A lost disk takes either copy with the
    other, and a resume that lists one would find the other's files in it."""
    mirror, directory = storage_place(mirror), storage_place(directory)
    if mirror == directory:
        return "itself"
    if mirror.startswith(directory.rstrip("/") + "/"):
        return "inside"
    if directory.startswith(mirror.rstrip("/") + "/"):
        return "around"
    return ""


MIRROR_OVERLAP_TEXT = {
    "itself": "is {dir_key} itself",
    "inside": "is a folder inside {dir_key}",
    "around": "holds {dir_key} inside it",
}


@dataclass
class CheckpointConfig:
    dir: str = ""  # fsspec URL or path; empty: no checkpoints
    # Rounds between checkpoints (0: only by time and after the last round), or "auto": Young/Daly's
    # interval sqrt(2 C F) from the measured checkpoint cost C and the MTBF F. One key rather than a
    # separate mode switch, so a user types `checkpoint.every_rounds=auto` (Hydra) or "auto" (flwr).
    every_rounds: int | str = 1
    every_seconds: float = 0.0
    keep: int = 3
    resume: str = "auto"
    force_resume: bool = False
    # fsspec URL (e.g. s3://bucket/run) the local checkpoints in `dir` are uploaded to in the background;
    # a resume takes the newest valid checkpoint of either place. Empty: no mirror.
    mirror: str = ""
    # Incremental checkpoints: a full one every `full_every` saves, deltas in between; 1: all full. Each kept
    # delta keeps its chain, and with keep > 1 the chain before the newest full one stays as a fallback.
    full_every: int = 1
    # Server MTBF in seconds for every_rounds=auto; 0: estimated from the restarts in the checkpoint history.
    mtbf: float = 0.0


@dataclass
class SigningConfig:
    require: bool = False
    # Directory with the server's trust store (deployment); empty in simulation, where
    # keys are derived from the seed per partition.
    trust_dir: str = ""


@dataclass
class SimulationConfig:
    """Resources of each simulated client on Flower's simulation engine (Hydra runs)."""

    client_cpus: float = 1.0
    client_gpus: float = 0.0


@dataclass
class RunConfig:
    """Everything that defines a run; same config and seed give the same final model."""

    num_clients: int = 20
    # The f the robust rule tolerates. Which clients misbehave is attack's business (simulation only).
    num_byzantine: int = 4
    clients_per_round: int = 20
    num_rounds: int = 20
    seed: int = 0
    aggregator: AggregatorConfig = field(default_factory=AggregatorConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    server_optimizer: ServerOptimizerConfig = field(default_factory=ServerOptimizerConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    attack: AttackConfig = field(default_factory=AttackConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    liveness: LivenessConfig = field(default_factory=LivenessConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    signing: SigningConfig = field(default_factory=SigningConfig)
    simulation: SimulationConfig = field(default_factory=SimulationConfig)
    # Where the server writes metrics.jsonl and the final model; empty: current directory.
    output_dir: str = ""

    def to_flat(self) -> dict[str, Any]:
        """Flatten to dotted keys with scalar values, as Flower's run config holds them."""
        return _flatten(dataclasses.asdict(self))

    def pre_aggregators(self) -> list[str]:
        """The pre-aggregators in order: ``aggregator.pre``'s, then those ``aggregator.name`` joins in front."""
        return self.listed_pre_aggregators() + self.named_stages()[:-1]

    def listed_pre_aggregators(self) -> list[str]:
        """The pre-aggregators ``aggregator.pre`` lists."""
        return [p.strip() for p in self.aggregator.pre.split(",") if p.strip()]

    def named_stages(self) -> list[str]:
        """The stages ``aggregator.name`` joins with ``+`` (as ``fedrobust.aggregators.split_pipeline``),
        the rule last; just ``aggregator._target_`` when that picks a user rule instead."""
        if self.aggregator._target_:
            return [self.aggregator._target_]
        return [stage.strip() for stage in self.aggregator.name.split("+")]

    def rule(self) -> str:
        """The rule the pre-aggregators feed: ``aggregator._target_``, or the last stage of ``aggregator.name``."""
        return self.named_stages()[-1]


def _flatten(nested: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in nested.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def _unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for dotted, value in flat.items():
        parts = str(dotted).replace("-", "_").split(".")
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"config key {dotted!r} clashes with a scalar value")
        node[parts[-1]] = value
    return nested


class ConfigError(ValueError):
    """An invalid run configuration, with every problem found (not only the first).

    A ``ValueError``, so callers that catch that keep working. ``problems`` holds one line per
    problem, each naming the setting, its value and what is allowed, e.g.
    ``"client.lr=-0.1: must be > 0"``; entry points print them one per line.

    Parameters
    ----------
    problems : Sequence[str]
        One-line descriptions of the problems, in the order they were found.
    """

    def __init__(self, problems: Sequence[str], partial: RunConfig | None = None) -> None:
        self.problems = list(problems)
        # The config with the defaults in place of the settings of ``problems``, where one could be built:
        # the other settings can still be checked, so that one pass names every problem.
        self.partial = partial
        super().__init__("invalid configuration:\n" + "\n".join(f"  {line}" for line in self.problems))


def format_value(value: Any) -> str:
    """How a setting's value is shown in a problem line: as a user would type it on the command line.

    Strings that could be misread (empty, surrounding spaces, several lines) are quoted.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        plain = value and value == value.strip() and "\n" not in value
        return value if plain else repr(value)
    if isinstance(value, Mapping):
        return json.dumps(value, sort_keys=True, default=str)
    return repr(value) if value is None else str(value)


def _build(cls: type, values: Mapping[str, Any], path: str, problems: list[str]) -> Any:
    """Build dataclass ``cls`` from a nested mapping; unknown keys and bad types go to ``problems``.

    A setting with a problem keeps its default, so that the rest can still be checked and every
    problem of the config is reported at once.
    """
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        where = path or "run config"
        # Hydra's instantiate takes a component's arguments beside _target_; here they go in its params table.
        params = (f" (arguments of the {path} go in {path}.params: e.g. +{path}.params.{unknown[0]}=...)"
                  if "params" in names and "_target_" in names else "")
        meant = did_you_mean(unknown[0], names) if len(unknown) == 1 else ""
        problems.append(f"{where}: unknown key(s) {unknown}{meant}; valid keys: {sorted(names)}{params}")
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        if name not in names:
            continue
        hint = hints[name]
        key = f"{path}.{name}" if path else name
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            if not isinstance(value, Mapping):
                problems.append(f"{key}={format_value(value)}: must be a table of settings")
                continue
            kwargs[name] = _build(hint, value, key, problems)
            continue
        try:
            kwargs[name] = _coerce(hint, value, key)
        except ValueError as err:
            problems.append(str(err))
    return cls(**kwargs)


def _number_in(text: str) -> Any:
    """The int or finite float ``text`` spells, else ``text`` itself."""
    for convert in (int, float):
        try:
            number = convert(text.strip())
        except ValueError:
            continue
        return number if math.isfinite(number) else text
    return text


def _coerce(hint: Any, value: Any, key: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ValueError(f"{key}={format_value(value)}: must be true or false")
    if hint in (int, float) and isinstance(value, str):
        # A quoted number ('2' in a --run-config or a TOML file) is the number, as OmegaConf takes it in Hydra.
        value = _number_in(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                or int(value) != value:
            raise ValueError(f"{key}={format_value(value)}: must be an integer")
        return int(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{key}={format_value(value)}: must be a number")
        return float(value)
    if hint == int | str:
        # An integer, or a keyword such as checkpoint.every_rounds=auto; "5" from a flat string config is 5.
        if isinstance(value, str):
            text = value.strip()
            return int(text) if text.lstrip("+-").isdigit() else text
        return _coerce(int, value, key)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{key}={format_value(value)}: must be a string")
        return value
    # dict[str, Any] parameter tables: keep as a plain dict. Flower's run config holds scalars only,
    # so there a table is a JSON object in a string: --run-config 'aggregator.params="{\"tau\": 5}"'.
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as err:
            raise ValueError(f"{key}={format_value(value)}: must be a JSON object of parameters ({err})") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{key}={format_value(value)}: must be a table of parameters")
    return dict(value)


def coerce(hint: Any, value: Any, key: str) -> Any:
    """``value`` as the type ``hint`` of setting ``key``, as :func:`from_nested` converts it.

    Raises
    ------
    ValueError
        One line, ``"<key>=<value>: must be ..."``, when ``value`` cannot be that type.
    """
    return _coerce(hint, value, key)


def from_nested(values: Mapping[str, Any]) -> RunConfig:
    """Build a :class:`RunConfig` from nested mappings (e.g. a resolved Hydra config).

    Raises
    ------
    ConfigError
        Listing every unknown key and every value of the wrong type.
    """
    problems: list[str] = []
    cfg = _build(RunConfig, values, "", problems)
    if problems:
        raise ConfigError(problems, partial=cfg)
    return cfg


def from_flat(flat: Mapping[str, Any]) -> RunConfig:
    """Build a :class:`RunConfig` from dotted keys (Flower's run config).

    Raises
    ------
    ConfigError
        Listing every unknown key and every value of the wrong type.
    """
    try:
        nested = _unflatten(flat)
    except ValueError as err:
        raise ConfigError([str(err)]) from None
    return from_nested(nested)


# ---------------------------------------------------------------------------------------------
# The run-config block of pyproject.toml, generated from RunConfig's defaults.
# ---------------------------------------------------------------------------------------------

PYPROJECT_TABLE = "[tool.flwr.app.config]"
_PYPROJECT_HEADER = (
    "# Generated from fedrobust.config.RunConfig by `python -m fedrobust.config --pyproject`; do not edit:\n"
    "# change RunConfig and run it again (a test fails when they differ). These are the defaults of the\n"
    "# Hydra default experiment too. `flwr run` accepts --run-config overrides only for keys declared here.\n"
)


# The Flower apps of the repository whose run config is RunConfig's defaults (paths from its root).
APP_PYPROJECTS = ("pyproject.toml", "examples/byzantine-drill/pyproject.toml")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: the same escapes as JSON
    raise TypeError(f"no TOML scalar for {value!r}")


def run_config_toml(cfg: RunConfig | None = None) -> str:
    """The ``[tool.flwr.app.config]`` table of ``cfg`` (RunConfig's defaults when None), as TOML.

    Every scalar setting is one dotted key; a parameter table (``aggregator.params`` and the like)
    is one key too, its value a JSON object in a string, since Flower's run config holds scalars only
    and refuses keys the app does not declare.
    """
    cfg = cfg or RunConfig()
    flat = {**cfg.to_flat(), **{key: json.dumps(value, sort_keys=True) for key, value in _param_tables(cfg).items()}}
    lines = [PYPROJECT_TABLE, _PYPROJECT_HEADER.rstrip("\n")]
    lines += [f"{json.dumps(key)} = {_toml_value(value)}" for key, value in sorted(flat.items(), key=_field_order(cfg))]
    return "\n".join(lines) + "\n"


def _param_tables(node: Any, prefix: str = "") -> dict[str, dict[str, Any]]:
    """The dotted keys and values of the parameter tables (``dict`` settings) of a config dataclass."""
    tables: dict[str, dict[str, Any]] = {}
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            tables.update(_param_tables(value, f"{prefix}{f.name}."))
        elif isinstance(value, dict):
            tables[f"{prefix}{f.name}"] = value
    return tables


def _field_order(cfg: RunConfig) -> Any:
    """Sort key: the declaration order of RunConfig's fields, so the table reads like the dataclass."""
    order = {key: i for i, key in enumerate(_declared_keys(cfg))}
    return lambda item: order.get(item[0], len(order))


def _declared_keys(node: Any, prefix: str = "") -> list[str]:
    keys: list[str] = []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            keys += _declared_keys(value, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def replace_run_config_block(pyproject: str, cfg: RunConfig | None = None) -> str:
    """``pyproject`` (the file's text) with its run-config table replaced by :func:`run_config_toml`.

    The table runs from its header to the next table header or the end of the file; a table that is
    missing is appended.
    """
    lines = pyproject.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip() == PYPROJECT_TABLE]
    block = run_config_toml(cfg)
    if not starts:
        return pyproject.rstrip("\n") + "\n\n" + block
    start = starts[0]
    end = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("[")), len(lines))
    # Keep blank lines and comments that introduce the next table with that table.
    while end > start + 1 and (not lines[end - 1].strip() or lines[end - 1].lstrip().startswith("#")):
        end -= 1
    head, tail = "".join(lines[:start]), "".join(lines[end:])
    return head + block + ("\n" + tail.lstrip("\n") if tail.strip() else "")


def _main(argv: Sequence[str] | None = None) -> int:
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(
        prog="python -m fedrobust.config",
        description="Write RunConfig's defaults into the [tool.flwr.app.config] table of a pyproject.toml.",
    )
    parser.add_argument("--pyproject", nargs="*", metavar="PATH", default=None,
                        help=f"pyproject.toml files to rewrite (default: {' '.join(APP_PYPROJECTS)})")
    parser.add_argument("--check", action="store_true", help="only report whether the files are up to date")
    args = parser.parse_args(argv)
    if args.pyproject is None and args.check:
        args.pyproject = []  # --check alone checks the default files rather than printing the table
    if args.pyproject is None:
        print(run_config_toml(), end="")
        return 0
    stale = 0
    for path in [Path(p) for p in (args.pyproject or [p for p in APP_PYPROJECTS if Path(p).exists()])]:
        try:
            text = path.read_text()
            tomllib.loads(text)  # a pyproject.toml, not another file a table would be appended to
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
            parser.error(f"{path}: not a readable pyproject.toml ({err})")
        new = replace_run_config_block(text)
        if new == text:
            print(f"{path}: up to date")
        elif args.check:
            print(f"{path}: run config differs from RunConfig's defaults")
            stale += 1
        else:
            path.write_text(new)
            print(f"{path}: run config rewritten from RunConfig")
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(_main())
