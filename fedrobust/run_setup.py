"""Checks of a whole run configuration before anything starts, and the parts built from it.

A typo or an impossible value (unknown rule, negative f, f too large for the
rule at the configured clients per round) fails here, naming the valid choices,
instead of minutes into a run.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedrobust import aggregators, attacks, components, data, models, signing
from fedrobust.config import (
    CHECKPOINT_INTERVAL_AUTO,
    MIRROR_OVERLAP_TEXT,
    RESUME_MODES,
    CheckpointConfig,
    ConfigError,
    LivenessConfig,
    RunConfig,
    format_value,
    mirror_overlap,
)
from fedrobust.server_optim import NAMES as SERVER_OPTIMIZERS
from fedrobust.server_optim import SCHEDULES as SERVER_LR_SCHEDULES
from fedrobust.server_optim import ServerOptimizer
from fedrobust.text import did_you_mean
from fedrobust.training import AMP_MODES, pick_device


def _problem(problems: list[str], key: str, value: Any, allowed: str) -> None:
    problems.append(f"{key}={format_value(value)}: {allowed}")


def _at_least(problems: list[str], key: str, value: float, low: float, note: str = "") -> None:
    if not value >= low:  # also catches NaN
        _problem(problems, key, value, f"must be >= {low}{note}")


def _positive(problems: list[str], key: str, value: float) -> None:
    if not 0 < value < math.inf:  # also catches NaN; an infinite lr or timeout is a typo, never a setting
        _problem(problems, key, value, "must be > 0 and finite")


def _in_unit(problems: list[str], key: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        _problem(problems, key, value, "must be in [0, 1)")


def _local_dir(problems: list[str], key: str, value: str, what: str) -> None:
    """A local directory that exists or can be made: no file on its path, the nearest existing one writable."""
    path = Path(value).expanduser()
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None:
        return
    if not existing.is_dir():
        where = "a file of that name exists" if existing == path else f"{existing} is a file"
        _problem(problems, key, value, f"must be {what} ({where})")
    elif not os.access(existing, os.W_OK | os.X_OK):
        _problem(problems, key, value, f"must be {what} this process can write ({existing} is not writable)")


def _choice(problems: list[str], key: str, value: str, valid: Sequence[str]) -> bool:
    if value in valid:
        return True
    meant = did_you_mean(value, valid)
    _problem(problems, key, value, f"unknown choice{meant}; valid choices: {', '.join(sorted(valid))}")
    return False


def _check_pipeline(cfg: RunConfig, problems: list[str]) -> tuple[bool, bool]:
    """Whether the rule's name and the pre-aggregators' names are valid, each reported when not."""
    named_pre = cfg.named_stages()[:-1]
    unknown = [f"pre-aggregator {pre!r}{did_you_mean(pre, aggregators.pre_names())}" for pre in named_pre
               if pre not in aggregators.pre_names()]
    if not cfg.aggregator._target_ and cfg.rule() not in aggregators.names():
        unknown.append(f"rule {cfg.rule()!r}{did_you_mean(cfg.rule(), aggregators.names())}")
    rule_ok = not unknown
    order = aggregators.pipeline_order_hint(cfg.aggregator.name) if not cfg.aggregator._target_ else None
    if order is not None:
        _problem(problems, "aggregator.name", cfg.aggregator.name, order)
    elif unknown:
        _problem(
            problems, "aggregator.name", cfg.aggregator.name,
            f"unknown {' and '.join(unknown)}; valid choices: a rule ({', '.join(sorted(aggregators.names()))}), "
            f"or pre-aggregators ({', '.join(sorted(aggregators.pre_names()))}) and then a rule, joined with "
            "'+' (e.g. 'winsorize+nnm+trimmed_mean')",
        )
    listed = cfg.listed_pre_aggregators()
    joined = [pre for pre in listed if aggregators.PIPELINE_SEPARATOR in pre]
    for pre in joined:  # a pipeline's '+' in the list of pre-aggregators
        whole = None if cfg.aggregator._target_ else _whole_pipeline(pre.split("+"), cfg.aggregator.name)
        other = f", or name the whole pipeline: aggregator.name={whole}" if whole else ""
        _problem(problems, "aggregator.pre", pre,
                 f"aggregator.pre separates its names with commas: aggregator.pre='{','.join(pre.split('+'))}' "
                 f"(quoted for Hydra){other}")
    valid = [pre not in joined and _choice(problems, "aggregator.pre", pre, aggregators.pre_names()) for pre in listed]
    pre_ok = all(valid)
    twice = sorted({pre for pre in listed if listed.count(pre) > 1})
    if twice:  # its parameters are set by its name (aggregator.pre_params.<name>): a second one is a typo
        _problem(problems, "aggregator.pre", cfg.aggregator.pre,
                 f"names {', '.join(map(repr, twice))} more than once; each stage once, e.g. "
                 f"aggregator.pre='{','.join(dict.fromkeys(listed))}'")
        pre_ok = False
    if listed and named_pre:
        whole = _whole_pipeline([p for pre in listed for p in pre.split("+")], cfg.aggregator.name)
        _problem(
            problems, "aggregator.pre", cfg.aggregator.pre,
            f"aggregator.name={cfg.aggregator.name!r} already names its pre-aggregators; name the whole "
            "pipeline in aggregator.name" + (f" (e.g. {whole!r})" if whole else ", each stage once")
            + ", or set aggregator.name to a bare rule",
        )
        pre_ok = False
    return rule_ok, pre_ok and order is None  # a stage out of order or twice is said once, by the hint


def _whole_pipeline(stages: list[str], name: str) -> str | None:
    """``stages`` in front of the pipeline ``name``, as one aggregator.name; None where a stage would be named
    twice (refused: the name would be no fix)."""
    names = [*stages, *name.split(aggregators.PIPELINE_SEPARATOR)]
    return aggregators.PIPELINE_SEPARATOR.join(names) if len(set(names)) == len(names) else None


def build_aggregator(cfg: RunConfig) -> aggregators.Aggregator:
    """The configured pre-aggregators and rule (built-in name or ``_target_``), with f = num_byzantine."""
    return aggregators.build(
        cfg.rule(),
        f=cfg.num_byzantine,
        pre=[{"name": p, **cfg.aggregator.pre_params.get(p, {})} for p in cfg.pre_aggregators()],
        **cfg.aggregator.params,
    )


SEED_MAX = 2**32 - 1


def _check_counts(cfg: RunConfig, problems: list[str]) -> None:
    _at_least(problems, "num_clients", cfg.num_clients, 1)
    _at_least(problems, "num_rounds", cfg.num_rounds, 1)
    _at_least(problems, "num_byzantine", cfg.num_byzantine, 0)
    # NumPy's seed sequences (byzantine_partitions, data partitions) take non-negative seeds only, and
    # scikit-learn's random_state (the digits split) 32-bit ones.
    _at_least(problems, "seed", cfg.seed, 0)
    if cfg.seed > SEED_MAX:
        _problem(problems, "seed", cfg.seed, f"must be <= {SEED_MAX} (2**32 - 1)")
    if cfg.num_clients >= 1 and cfg.num_byzantine >= cfg.num_clients:
        _problem(problems, "num_byzantine", cfg.num_byzantine, f"must be < num_clients ({cfg.num_clients})")
    if cfg.num_clients >= 1 and not 1 <= cfg.clients_per_round <= cfg.num_clients:
        _problem(problems, "clients_per_round", cfg.clients_per_round, f"must be in [1, num_clients={cfg.num_clients}]")
    elif cfg.clients_per_round < 1 and cfg.clients_per_round != cfg.num_clients:
        # Equal to a bad num_clients: Hydra's clients_per_round follows it, one problem is reported.
        _problem(problems, "clients_per_round", cfg.clients_per_round, "must be >= 1")
    if cfg.output_dir:
        _local_dir(problems, "output_dir", cfg.output_dir, "a directory")


def _check_components(cfg: RunConfig, problems: list[str]) -> None:
    """Names of the rule, data, model, optimizer and attack, and the parameters they take."""
    target = cfg.aggregator._target_
    rule_key, rule_label = ("aggregator._target_", target) if target else ("aggregator.name", cfg.aggregator.name)
    rule_ok, pre_ok = _check_pipeline(cfg, problems)
    _at_least(problems, "aggregator.root_size", cfg.aggregator.root_size, 1)
    try:  # the rule runs on the server, where this check runs
        pick_device(cfg.aggregator.device)
    except ValueError as err:
        _problem(problems, "aggregator.device", cfg.aggregator.device, str(err))
    stray = sorted(set(cfg.aggregator.pre_params) - set(cfg.pre_aggregators()))
    if stray:
        _problem(problems, "aggregator.pre_params", cfg.aggregator.pre_params,
                 f"has parameters for {stray}, which the pipeline {cfg.pre_aggregators() + [cfg.rule()]} "
                 "does not run")
        pre_ok = False
    spec = _check_dataset(cfg, problems)
    _choice(problems, "partition.name", cfg.partition.name, data.PARTITIONERS)
    _check_model(cfg, spec, problems)
    _choice(problems, "server_optimizer.name", cfg.server_optimizer.name, SERVER_OPTIMIZERS)
    attack_ok = _choice(problems, "attack.name", cfg.attack.name, ["none", *attacks.names()])
    attack_key = "attack._target_" if cfg.attack._target_ else "attack.name"
    if cfg.attack._target_ and cfg.attack.name != "none":
        _problem(problems, "attack.name", cfg.attack.name,
                 f"and attack._target_={cfg.attack._target_} both pick an attack: keep one (attack=none with a "
                 "_target_)")
        attack_ok = False
    if cfg.attack.active and cfg.num_byzantine == 0:
        _problem(problems, attack_key, cfg.attack.label, "needs num_byzantine > 0 (or attack=none)")
    attack = None
    if attack_ok and cfg.attack.active:
        try:
            attack = components.build_attack(cfg)
        except (TypeError, ValueError) as err:
            if cfg.attack._target_:  # import, signature or hooks: the message says which
                _problem(problems, attack_key, cfg.attack._target_, " ".join(str(err).split()))
            else:
                _problem(problems, "attack.params", cfg.attack.params, str(err))
    elif cfg.attack.name == "none" and cfg.attack.params:
        _problem(problems, "attack.params", cfg.attack.params, "attack=none takes no parameters")
    aim = getattr(attack, "target", None)  # a backdoor's label, or the row mimic copies
    if cfg.attack.name == "backdoor" and spec is not None and isinstance(aim, int) \
            and not 0 <= aim < spec.num_classes:
        _problem(problems, "attack.params.target", aim,
                 f"must be a label in [0, {spec.num_classes - 1}] ({components.dataset_label(cfg.dataset)} has "
                 f"{spec.num_classes} classes)")
    honest = cfg.clients_per_round - cfg.num_byzantine
    if cfg.attack.name == "mimic" and isinstance(aim, int) and honest >= 1 and not 0 <= aim < honest:
        _problem(problems, "attack.params.target", aim,  # the honest reply it copies, by its row
                 f"must be the row of an honest reply, in [0, {honest - 1}] (clients_per_round - num_byzantine)")
    if not rule_ok or cfg.num_byzantine < 0:
        return
    try:
        rule = aggregators.build(cfg.rule(), f=cfg.num_byzantine, **cfg.aggregator.params)
    except (TypeError, ValueError) as err:
        if target:  # import, signature or contract: the message says which
            _problem(problems, rule_key, target, " ".join(str(err).split()))
        else:
            _problem(problems, "aggregator.params", cfg.aggregator.params, str(err))
        return
    if rule.needs_server_update and cfg.aggregator.root_size >= 1 and spec is not None \
            and 0 <= cfg.dataset.validation_fraction < 1 and 0 <= cfg.seed <= SEED_MAX:
        try:
            size = components.training_size(cfg)
        except Exception:  # a user loader that fails is reported by _check_dataset
            size = None
        if size is not None and cfg.aggregator.root_size > size:  # the root set is drawn from the training split
            _problem(problems, "aggregator.root_size", cfg.aggregator.root_size,
                     f"must be <= {size}, the training examples of {components.dataset_label(cfg.dataset)} (the "
                     "root set is a small clean sample of them: Cao et al. use 100)")
    if attack is not None and attack.needs_server_update and not rule.needs_server_update:
        _problem(problems, attack_key, cfg.attack.label,
                 f"needs the server's own update of each round, which {rule_label} does not compute: "
                 "use it with aggregator=fltrust")
    if not pre_ok:
        return
    try:
        rule = build_aggregator(cfg)
    except (TypeError, ValueError) as err:
        _problem(problems, "aggregator.pre_params", cfg.aggregator.pre_params, str(err))
        return
    # The rule's min_n checks f, and the rule's own parameters (trimmed_mean's trim), against the round size.
    need = rule.min_n()
    if 1 <= cfg.clients_per_round < need:
        f = cfg.num_byzantine
        key, what = "num_byzantine", f"f={f} is too large"
        value: Any = f
        fits = ""
        if cfg.aggregator.params and aggregators.build(cfg.rule(), f=f).min_n() <= cfg.clients_per_round:
            key, value, what = "aggregator.params", cfg.aggregator.params, f"with f={f} these are too large"
        elif (largest := _largest_f(cfg)) is not None:
            fits = f" (num_byzantine={largest} fits)"
        _problem(
            problems, key, value,
            f"{what} for {rule_label}: it needs at least {need} replies per round, but "
            f"clients_per_round={cfg.clients_per_round}{fits}",
        )


def _largest_f(cfg: RunConfig) -> int | None:
    """The largest f below ``num_byzantine`` that the configured rule takes with ``clients_per_round`` replies."""
    for f in range(cfg.num_byzantine - 1, -1, -1):
        try:
            if build_aggregator(dataclasses.replace(cfg, num_byzantine=f)).min_n() <= cfg.clients_per_round:
                return f
        except (TypeError, ValueError):  # parameters that need a larger f
            continue
    return None


def _check_dataset(cfg: RunConfig, problems: list[str]) -> data.DatasetSpec | None:
    """The configured data set's spec, or None (with its problem) when it cannot be had."""
    target = cfg.dataset._target_
    fraction = cfg.dataset.validation_fraction
    if not 0 <= fraction < 1:  # also catches NaN
        _problem(problems, "dataset.validation_fraction", fraction,
                 "must be in [0, 1): the share of the training set held out for validation (0: none)")
    elif fraction > 0 and not target and cfg.dataset.name in data.DATASETS and cfg.dataset.name != "digits":
        _problem(problems, "dataset.validation_fraction", fraction,
                 f"a validation hold-out is built for dataset.name=digits and dataset._target_ loaders, not for "
                 f"dataset.name={cfg.dataset.name}; set it to 0")
    if not target:
        if cfg.dataset.params:  # built-in data sets take none: they would be ignored
            _problem(problems, "dataset.params", cfg.dataset.params,
                     f"dataset.name={cfg.dataset.name} takes no parameters (they go to a dataset._target_ loader)")
        if _choice(problems, "dataset.name", cfg.dataset.name, data.DATASETS):
            return data.dataset_spec(cfg.dataset.name)
        return None
    try:
        return components.dataset_spec(cfg)  # loads it (once per process): the server evaluates on it anyway
    except Exception as err:
        _problem(problems, "dataset._target_", target, " ".join(str(err).split()) or type(err).__name__)
        return None


def _check_model(cfg: RunConfig, spec: data.DatasetSpec | None, problems: list[str]) -> None:
    """The model is known (or importable) and takes the data set's inputs."""
    target = cfg.model._target_
    if not target and not _choice(problems, "model.name", cfg.model.name, models.names()):
        return
    if spec is None:
        return
    try:
        # Forked so that checking does not move the global RNG the initial weights are drawn from.
        with torch.random.fork_rng(devices=[]):
            net = components.build_model(cfg.model, spec)
            if target:
                components.check_model(net, spec)
    except Exception as err:
        message = " ".join(str(err).split()) or type(err).__name__
        if target:
            _problem(
                problems, "model._target_", target, f"{message} (dataset: {components.dataset_label(cfg.dataset)})"
            )
        elif cfg.model.params and "no option" in message:
            _problem(problems, "model.params", cfg.model.params, message)
        elif cfg.model.params and _builds_plain(cfg.model.name, spec):  # the values of the options are at fault
            _problem(
                problems, "model.params", cfg.model.params, f"{cfg.model.name} cannot be built with them: {message}"
            )
        else:  # the model cannot take the data set's inputs (e.g. a CNN on flat digits)
            _problem(problems, "model.name", cfg.model.name, f"{message} (dataset.name={cfg.dataset.name})")


def _builds_plain(name: str, spec: data.DatasetSpec) -> bool:
    """Whether built-in model ``name`` takes the data set with its default options."""
    try:
        with torch.random.fork_rng(devices=[]):
            models.build_model(name, input_shape=spec.input_shape, num_classes=spec.num_classes)
    except (TypeError, ValueError, RuntimeError):
        return False
    return True


def _check_partition(cfg: RunConfig, problems: list[str]) -> None:
    _positive(problems, "partition.alpha", cfg.partition.alpha)
    spec = None
    if cfg.dataset._target_:
        try:
            spec = components.dataset_spec(cfg)  # cached: a failing loader is reported by _check_dataset
        except Exception:
            spec = None
    elif cfg.dataset.name in data.DATASETS:
        spec = data.dataset_spec(cfg.dataset.name)
    if spec is not None and 0 <= cfg.seed <= SEED_MAX and 0 <= cfg.dataset.validation_fraction < 1:
        size = components.training_size(cfg)
        if size is not None and cfg.num_clients > size:
            _problem(problems, "num_clients", cfg.num_clients,
                     f"{components.dataset_label(cfg.dataset)} has {size} training examples to partition "
                     f"(after dataset.validation_fraction={cfg.dataset.validation_fraction:g}): at most {size} clients")
    if spec is not None:
        num_classes = spec.num_classes
        if not 1 <= cfg.partition.classes_per_partition <= num_classes:
            name = components.dataset_label(cfg.dataset)
            _problem(
                problems,
                "partition.classes_per_partition",
                cfg.partition.classes_per_partition,
                f"must be in [1, {num_classes}] ({name} has {num_classes} classes)",
            )


def _check_server_optimizer(cfg: RunConfig, problems: list[str]) -> None:
    opt = cfg.server_optimizer
    before = len(problems)
    _positive(problems, "server_optimizer.lr", opt.lr)
    for name in ("momentum", "beta_1", "beta_2"):
        _in_unit(problems, f"server_optimizer.{name}", getattr(opt, name))
    _positive(problems, "server_optimizer.tau", opt.tau)
    _choice(problems, "server_optimizer.schedule", opt.schedule, SERVER_LR_SCHEDULES)
    if not 0.0 <= opt.min_lr_ratio <= 1.0:
        _problem(problems, "server_optimizer.min_lr_ratio", opt.min_lr_ratio, "must be in [0, 1]")
    if len(problems) == before and opt.name in SERVER_OPTIMIZERS:
        # Whatever else the optimizer itself refuses.
        try:
            ServerOptimizer(
                name=opt.name, lr=opt.lr, momentum=opt.momentum, beta_1=opt.beta_1, beta_2=opt.beta_2, tau=opt.tau
            )
        except ValueError as err:
            _problem(problems, "server_optimizer", opt.name, str(err))


def _check_client(cfg: RunConfig, problems: list[str], local_devices: bool) -> None:
    client = cfg.client
    _at_least(problems, "client.local_epochs", client.local_epochs, 1)
    _at_least(problems, "client.batch_size", client.batch_size, 1)
    _positive(problems, "client.lr", client.lr)
    _in_unit(problems, "client.momentum", client.momentum)
    _at_least(problems, "client.weight_decay", client.weight_decay, 0)
    device = client.device.strip().lower()
    cuda = device == "cuda" or re.fullmatch(r"cuda:\d+", device) is not None
    if device not in ("auto", "cpu") and not cuda:
        _problem(problems, "client.device", client.device, "must be auto, cpu, cuda or cuda:N")
    elif cuda and local_devices and not torch.cuda.is_available():
        _problem(problems, "client.device", client.device, "no CUDA device here; use auto or cpu")
    elif cuda and local_devices and ":" in device and int(device.split(":")[1]) >= torch.cuda.device_count():
        _problem(
            problems,
            "client.device",
            client.device,
            f"only {torch.cuda.device_count()} CUDA device(s) here (cuda:0 .. cuda:{torch.cuda.device_count() - 1})",
        )
    if _choice(problems, "client.amp", client.amp, AMP_MODES) and client.amp == "fp16":
        # float16 training needs CUDA's GradScaler (fedrobust.training refuses it elsewhere).
        if device == "cpu":
            _problem(
                problems, "client.amp", client.amp, "fp16 needs a CUDA device but client.device=cpu; use bf16 or none"
            )
        elif device == "auto" and local_devices and not torch.cuda.is_available():
            _problem(
                problems,
                "client.amp",
                client.amp,
                "fp16 needs a CUDA device and client.device=auto is the CPU here (no CUDA); use bf16 or none",
            )


def liveness_problems(live: LivenessConfig) -> list[str]:
    """One ``liveness.<field>=<value>: <reason>`` line for each liveness setting out of its range."""
    problems: list[str] = []
    _at_least(problems, "liveness.suspect_after", live.suspect_after, 1)
    if live.suspect_after >= 1 and live.dead_after < live.suspect_after:
        _problem(problems, "liveness.dead_after", live.dead_after,
                 f"must be >= liveness.suspect_after ({live.suspect_after})")
    _at_least(problems, "liveness.backoff_rounds", live.backoff_rounds, 1)
    if live.backoff_rounds >= 1 and live.max_backoff < live.backoff_rounds:
        _problem(problems, "liveness.max_backoff", live.max_backoff,
                 f"must be >= liveness.backoff_rounds ({live.backoff_rounds})")
    _at_least(problems, "liveness.quarantine_after", live.quarantine_after, 0, " (0: never quarantine)")
    _at_least(problems, "liveness.quarantine_rounds", live.quarantine_rounds, 1)
    return problems


def _check_rounds(cfg: RunConfig, problems: list[str]) -> None:
    """Reply validation, deadlines and retries, liveness and the divergence guard."""
    _at_least(problems, "validation.max_update_norm", cfg.validation.max_update_norm, 0, " (0: no bound)")
    _at_least(problems, "validation.max_num_examples", cfg.validation.max_num_examples, 1)
    _positive(problems, "fault.round_timeout", cfg.fault.round_timeout)
    _at_least(problems, "fault.over_select", cfg.fault.over_select, 0)
    _at_least(problems, "fault.grace_after_quorum", cfg.fault.grace_after_quorum, 0, " (0: off)")
    _at_least(problems, "fault.max_round_retries", cfg.fault.max_round_retries, 0)
    if not cfg.fault.wait_for_nodes > 0:  # on Flower's engines the nodes' answers to the partition query take time
        _problem(problems, "fault.wait_for_nodes", cfg.fault.wait_for_nodes,
                 "must be > 0 (seconds for the nodes to connect and answer the partition query; inf: no limit)")
    problems += liveness_problems(cfg.liveness)
    factor = cfg.guard.divergence_factor
    if not (factor == 0 or factor > 1):
        _problem(problems, "guard.divergence_factor", factor, "must be > 1, or 0 to switch the loss check off")
    if not 0 < cfg.guard.lr_decay <= 1:
        _problem(problems, "guard.lr_decay", cfg.guard.lr_decay, "must be in (0, 1]")


def _check_checkpoint_basics(cfg: RunConfig, problems: list[str]) -> None:
    """The checkpoint settings every run has; the interval and storage ones are in _check_checkpoint."""
    _at_least(problems, "checkpoint.keep", cfg.checkpoint.keep, 1, " (the newest checkpoints kept on disk)")
    _at_least(problems, "checkpoint.every_seconds", cfg.checkpoint.every_seconds, 0, " (0: no time-based saves)")
    _choice(problems, "checkpoint.resume", cfg.checkpoint.resume, RESUME_MODES)
    for key, where in (("checkpoint.dir", cfg.checkpoint.dir), ("checkpoint.mirror", cfg.checkpoint.mirror)):
        if where:
            problems += checkpoint_place_problems(key, where)


def checkpoint_place_problems(key: str, where: str) -> list[str]:
    """``<key>=<where>: <reason>`` when a checkpoint directory or mirror cannot be used: a URL whose file
    system fsspec does not know (or lacks its package here), a local path with a file on it or unwritable."""
    problems: list[str] = []
    if "://" in where:
        _storage_url(problems, key, where)
    else:  # a local directory (for the mirror, a mounted share)
        _local_dir(problems, key, where, "a directory or URL")
    return problems


def _storage_url(problems: list[str], key: str, url: str) -> None:
    """A URL whose file system fsspec knows and can load here (its package installed)."""
    import fsspec

    # A chained URL (simplecache::s3://...) names one file system per link.
    for link in url.split("::"):
        protocol = link.split("://", 1)[0]
        try:
            fsspec.get_filesystem_class(protocol)
        except ValueError:
            _problem(problems, key, url, f"unknown storage protocol {protocol!r}; e.g. a local path, file://, "
                                         "s3://, gs:// (fsspec's file systems)")
            return
        except ImportError as err:
            _problem(problems, key, url, f"{protocol}:// needs a package not installed here: {err}")
            return


def _check_resources(cfg: RunConfig, problems: list[str], local_devices: bool) -> None:
    trust_dir = cfg.signing.trust_dir
    if trust_dir and not Path(trust_dir).is_dir():
        _problem(
            problems, "signing.trust_dir", trust_dir, "no such directory (the trust store made by fedrobust.keygen)"
        )
    elif trust_dir:
        try:
            signing.TrustStore.load(trust_dir)
        except (OSError, ValueError) as err:
            _problem(problems, "signing.trust_dir", trust_dir, " ".join(str(err).split()))
    _positive(problems, "simulation.client_cpus", cfg.simulation.client_cpus)
    cores = os.cpu_count() or 1
    if local_devices and cfg.simulation.client_cpus > cores:
        # Ray could place no client, and its actor pool fails after a long wait.
        _problem(problems, "simulation.client_cpus", cfg.simulation.client_cpus,
                 f"more than the {cores} CPU cores here: no client could be placed")
    _at_least(problems, "simulation.client_gpus", cfg.simulation.client_gpus, 0)
    if cfg.simulation.client_gpus > 0 and local_devices and not torch.cuda.is_available():
        # Ray would wait forever for a GPU to schedule the clients on.
        _problem(problems, "simulation.client_gpus", cfg.simulation.client_gpus, "no CUDA device here; use 0")


def config_problems(cfg: RunConfig, *, local_devices: bool = False) -> list[str]:
    """Every problem of ``cfg``, one line each (``"<key>=<value>: <what is allowed>"``); empty when valid.

    Parameters
    ----------
    cfg : RunConfig
        The run to check.
    local_devices : bool, default False
        Whether the clients train on this machine (Hydra simulation): then ``client.device=cuda``,
        ``amp=fp16`` and ``simulation.client_gpus`` are also checked against the GPUs here. Off for
        the server of a deployment, whose clients may have GPUs the server lacks.
    """
    problems: list[str] = []
    checks: list[Callable[[], None]] = [
        lambda: _check_counts(cfg, problems),
        lambda: _check_components(cfg, problems),
        lambda: _check_partition(cfg, problems),
        lambda: _check_server_optimizer(cfg, problems),
        lambda: _check_client(cfg, problems, local_devices),
        lambda: _check_rounds(cfg, problems),
        lambda: _check_checkpoint_basics(cfg, problems),
        lambda: _check_checkpoint(cfg.checkpoint),
        lambda: _check_resources(cfg, problems, local_devices),
    ]
    for check in checks:
        # A check that raises (rather than appending) still reports its one problem with the others.
        try:
            check()
        except ValueError as err:
            problems.append(" ".join(str(err).split()))
    return problems


def validate(cfg: RunConfig, *, local_devices: bool = False) -> RunConfig:
    """Check every setting of ``cfg``; return ``cfg`` when valid.

    Parameters
    ----------
    cfg : RunConfig
        The run to check.
    local_devices : bool, default False
        Also check the GPU settings against this machine (see :func:`config_problems`).

    Returns
    -------
    RunConfig
        ``cfg`` itself.

    Raises
    ------
    ConfigError
        A ``ValueError`` listing every problem found, one line each.
    """
    problems = config_problems(cfg, local_devices=local_devices)
    if problems:
        raise ConfigError(problems)
    return cfg


def _check_checkpoint(ck: CheckpointConfig) -> None:
    """The interval and storage settings of checkpoints; raises on the first problem, naming the valid values."""
    every = ck.every_rounds
    if isinstance(every, bool) or not (every == CHECKPOINT_INTERVAL_AUTO or isinstance(every, int) and every >= 0):
        raise ValueError(
            f"checkpoint.every_rounds={every}: must be an integer >= 0 (0: only by time and after the last round) "
            f"or {CHECKPOINT_INTERVAL_AUTO} (Young/Daly interval from the measured checkpoint cost and the MTBF)"
        )
    if ck.full_every < 1:
        raise ValueError(
            f"checkpoint.full_every={ck.full_every}: must be an integer >= 1 (1: every checkpoint full; K: a full "
            "one every K saves, deltas in between)"
        )
    if not ck.mtbf >= 0:
        raise ValueError(f"checkpoint.mtbf={ck.mtbf}: must be >= 0 seconds (0: estimated from the restarts)")
    if ck.mirror and not ck.dir:
        raise ValueError(
            f"checkpoint.mirror={ck.mirror}: needs checkpoint.dir, the local directory written first and uploaded"
        )
    overlap = mirror_overlap(ck.mirror, ck.dir) if ck.mirror else ""
    if overlap:
        said = MIRROR_OVERLAP_TEXT[overlap].format(dir_key="checkpoint.dir")
        raise ValueError(f"checkpoint.mirror={ck.mirror}: {said}; a mirror is a second place (a share, "
                         "s3://...) that keeps the checkpoints when the first one is lost")
    if ck.force_resume and not ck.dir:
        raise ValueError("checkpoint.force_resume=true: needs checkpoint.dir; without checkpoints there is nothing "
                         "to resume")


def byzantine_partitions(cfg: RunConfig) -> frozenset[int]:
    """Which partitions behave Byzantine in simulation: ``num_byzantine`` of them, drawn from the seed."""
    if not cfg.attack.active or cfg.num_byzantine == 0:
        return frozenset()
    rng = np.random.default_rng([cfg.seed, 0xB1A5])
    return frozenset(int(p) for p in rng.choice(cfg.num_clients, size=cfg.num_byzantine, replace=False))
