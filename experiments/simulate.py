"""Run one configuration on Flower's simulation engine in this process."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")

import ray  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402

from experiments.adversary import omniscient_hook  # noqa: E402
from fedrobust.clients.client_app import make_client_app  # noqa: E402
from fedrobust.config import RunConfig  # noqa: E402
from fedrobust.run_setup import validate  # noqa: E402
from fedrobust.strategies.robust_strategy import RobustStrategy  # noqa: E402
from fedrobust.strategies.server_app import install_stop_handlers, make_server_app  # noqa: E402

log = logging.getLogger(__name__)


def _start_ray(verbose: bool) -> None:
    """Start Ray here rather than inside Flower, so that our signal handlers can go in after it.

    Flower's Ray backend reuses an initialised Ray. Ray's C++ failure-signal handler
    would turn SIGTERM into an abort before Python sees it, so it is switched off.
    """
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # no GPU-env warning on CPU runs
    ray.init(
        # What Flower's backend passes: workers need this process's import path.
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}},
        num_cpus=os.cpu_count() or 1,
        include_dashboard=False,
        log_to_driver=verbose,
    )


def simulate(cfg: RunConfig, out_dir: Path, *, verbose: bool = False) -> list[dict[str, Any]]:
    """Run ``cfg`` with ``cfg.num_clients`` simulated SuperNodes; return the metrics rows.

    SIGTERM and SIGINT make the server checkpoint and stop (``Preempted``).

    Raises
    ------
    ValueError
        Before anything starts, when the config is invalid.
    fedrobust.Preempted, fedrobust.QuorumError
        As the server raised them (a checkpoint was written where one is configured).
    RuntimeError
        When the server did not finish all rounds for another reason.
    """
    validate(cfg)
    if not verbose:  # Flower logs every actor and backend step at DEBUG
        logging.getLogger("flwr").setLevel(logging.INFO)
    _start_ray(verbose)
    # After ray.init, which replaces the SIGTERM handler with its own sys.exit. The strategy is
    # built inside the ServerApp, so a signal that comes first is remembered and passed on.
    stop = threading.Event()
    strategies: list[RobustStrategy] = []

    def request_stop() -> None:
        stop.set()
        for strategy in strategies:
            strategy.request_stop()

    def on_strategy(strategy: RobustStrategy) -> None:
        strategies.append(strategy)
        if stop.is_set():
            strategy.request_stop()

    install_stop_handlers(request_stop)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = out_dir / "metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    backend_config = {
        "client_resources": {"num_cpus": cfg.simulation.client_cpus, "num_gpus": cfg.simulation.client_gpus},
    }
    run_simulation(
        server_app=make_server_app(cfg, out_dir=out_dir, update_hook=omniscient_hook(cfg), on_strategy=on_strategy),
        client_app=make_client_app(cfg),
        num_supernodes=cfg.num_clients,
        backend_config=backend_config,
        verbose_logging=verbose,
    )
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
    if len(rows) < cfg.num_rounds:
        raise RuntimeError(f"the server stopped after {len(rows)} of {cfg.num_rounds} rounds; see the log above")
    return rows
