"""Build a :class:`RobustStrategy` from a :class:`~fedrobust.config.RunConfig` (Hydra and ``flwr run`` paths).

The experiments and the shipped ServerApp describe a run with one RunConfig; this is the only
place that turns it into the library's keyword arguments, so both paths run the same strategy a
user would build by hand.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedrobust import plot, server_optim, signing
from fedrobust.config import RunConfig
from fedrobust.strategies.checkpointing import RUN_SETTINGS_KEY
from fedrobust.strategies.evaluation import server_update_fn
from fedrobust.strategies.robust_strategy import RobustStrategy, UpdateHook

logger = logging.getLogger(__name__)


def resolved_json(cfg: RunConfig) -> str:
    """The run's config as it ran, for ``resolved_config.json``: where a ``_target_`` picks a user component,
    the built-in ``name`` it stands in for is null, so that the file does not read as if the built-in ran."""
    values = dataclasses.asdict(cfg)
    for section in ("aggregator", "dataset", "model", "attack"):
        if values[section]["_target_"]:
            values[section]["name"] = None
    return json.dumps(values, sort_keys=True)


def run_settings(cfg: RunConfig) -> dict[str, Any]:
    """The settings a checkpoint must agree with to be resumed.

    Settings that do not change what is computed (where checkpoints and outputs go, deadlines,
    simulation resources) and the number of rounds (a run with a constant server lr may be extended;
    under a schedule the round loop records it) are left out.
    """
    values = dataclasses.asdict(cfg)
    for key in ("checkpoint", "output_dir", "num_rounds", "fault", "simulation"):
        values.pop(key)
    return values


RESULT_FILES = ("final_model.safetensors", "metrics.jsonl")  # a run's results
RESOLVED_CONFIG = "resolved_config.json"
RUN_FILES = (*RESULT_FILES, RESOLVED_CONFIG, plot.PICTURE_FILE, "final.json")  # and what goes with them


def set_earlier_results_aside(out_dir: Path, first_round: int) -> Path | None:
    """Before a fresh run (``first_round`` 1) writes into ``out_dir``: move an earlier run's files there into
    ``aside-<time>/`` and return that folder, so that nothing of that run is lost (its metrics would be started
    over, its final model replaced, and until then one run's model would sit beside another's config) and
    nothing of it passes for this run's (a final model says that a run finished: docs/flwr_run.md). A resume
    continues its own run's files."""
    held = [name for name in RESULT_FILES if (out_dir / name).is_file() and (out_dir / name).stat().st_size > 0]
    if first_round > 1 or not held:
        return None
    stamp = time.strftime("aside-%Y%m%d-%H%M%S")
    aside, count = out_dir / stamp, 1
    while aside.exists():  # two fresh starts within a second
        count += 1
        aside = out_dir / f"{stamp}-{count}"
    aside.mkdir()
    moved = [name for name in RUN_FILES if (out_dir / name).is_file()]
    for name in moved:
        os.replace(out_dir / name, aside / name)
    logger.warning(
        "starting fresh in %s, which held an earlier run's results: moved %s to %s", out_dir, ", ".join(moved), aside
    )
    return aside


def _start_in(out_dir: Path, cfg: RunConfig) -> Callable[[int], None]:
    """The strategy's ``on_start`` for a run that writes into ``out_dir``."""

    def on_start(first_round: int) -> None:
        set_earlier_results_aside(out_dir, first_round)
        # An earlier picture must not pass for this run's (a resume draws its own at the end).
        (out_dir / plot.PICTURE_FILE).unlink(missing_ok=True)
        # Once the run goes ahead: a refused resume leaves the record of the earlier run's settings alone.
        (out_dir / RESOLVED_CONFIG).write_text(resolved_json(cfg))

    return on_start


def trust_store_for(cfg: RunConfig) -> signing.TrustStore | None:
    """The trust store of deployment (``signing.trust_dir``), the per-run derived keys of a signed
    simulation, or None when signatures are not checked."""
    if cfg.signing.trust_dir:
        return signing.TrustStore.load(cfg.signing.trust_dir)
    if cfg.signing.require:
        return signing.TrustStore.for_simulation(cfg.seed, range(cfg.num_clients))
    return None


def strategy_from_config(
    cfg: RunConfig,
    *,
    out_dir: Path | None = None,
    update_hook: UpdateHook | None = None,
    progress: bool = True,
) -> RobustStrategy:
    """The strategy ``cfg`` describes; metrics go to ``out_dir/metrics.jsonl`` when given."""
    if not isinstance(cfg, RunConfig):
        raise TypeError(
            "strategy_from_config takes a fedrobust.config.RunConfig, e.g. from_flat(context.run_config) or "
            f"from_nested(a dict of sections), got {type(cfg).__name__}"
        )
    return RobustStrategy(
        # A built-in rule's name or a user rule's dotted path: RobustStrategy rebuilds it by name for
        # the f left after faulty nodes are excluded.
        aggregator=cfg.rule(),
        num_byzantine=cfg.num_byzantine,
        pre=[{"name": p, **cfg.aggregator.pre_params.get(p, {})} for p in cfg.pre_aggregators()],
        aggregator_params=cfg.aggregator.params,
        aggregation_device=cfg.aggregator.device,
        fraction_train=cfg.clients_per_round / cfg.num_clients,
        min_train_nodes=cfg.clients_per_round,
        min_available_nodes=cfg.clients_per_round,
        fraction_evaluate=0.0,
        weight_by_num_examples=cfg.validation.weight_by_num_examples,
        server_optimizer=cfg.server_optimizer.name,
        server_lr=cfg.server_optimizer.lr,
        server_lr_schedule=cfg.server_optimizer.schedule,
        server_lr_min_ratio=cfg.server_optimizer.min_lr_ratio,
        server_optimizer_params={
            name: getattr(cfg.server_optimizer, name) for name in server_optim.PARAMS[cfg.server_optimizer.name]
        },
        max_update_norm=cfg.validation.max_update_norm or None,
        max_num_examples=cfg.validation.max_num_examples,
        round_deadline=cfg.fault.round_timeout,
        max_round_retries=cfg.fault.max_round_retries,
        over_select=cfg.fault.over_select,
        grace_after_quorum=cfg.fault.grace_after_quorum,
        wait_for_nodes=cfg.fault.wait_for_nodes,
        liveness=cfg.liveness,
        divergence_factor=cfg.guard.divergence_factor,
        lr_decay=cfg.guard.lr_decay,
        checkpoint_dir=cfg.checkpoint.dir or None,
        checkpoint_every=cfg.checkpoint.every_rounds,
        checkpoint_every_seconds=cfg.checkpoint.every_seconds,
        checkpoint_keep=cfg.checkpoint.keep,
        # The config carries no secrets: S3 endpoint and credentials come from the environment (AWS_*).
        checkpoint_mirror=cfg.checkpoint.mirror or None,
        checkpoint_full_every=cfg.checkpoint.full_every,
        checkpoint_mtbf=cfg.checkpoint.mtbf or None,
        resume=cfg.checkpoint.resume,
        force_resume=cfg.checkpoint.force_resume,
        signing=trust_store_for(cfg),
        require_signatures=cfg.signing.require,
        seed=cfg.seed,
        discover_partitions=True,
        metrics_path=out_dir / "metrics.jsonl" if out_dir is not None else None,
        on_start=_start_in(out_dir, cfg) if out_dir is not None else None,
        progress=progress,
        update_hook=update_hook,
        # Lazy: the root data set is loaded only if the rule asks for the server's update (fltrust).
        server_update_fn=server_update_fn(cfg),
        settings={RUN_SETTINGS_KEY: run_settings(cfg)},
    )
