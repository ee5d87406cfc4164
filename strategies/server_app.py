"""fedrobust's own ServerApp: ``flwr run .`` and the deployment engine start here.

It is the first user of the library API: the run config (``[tool.flwr.app.config]`` plus
``--run-config`` overrides) becomes a :class:`~fedrobust.config.RunConfig`, then a
:class:`RobustStrategy` (:func:`strategy_from_config`), whose ``start()`` runs the rounds. Hydra
experiments build the same app with :func:`make_server_app` from their own config.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result
from safetensors.torch import save_file

from fedrobust import attacks
from fedrobust.config import ConfigError, RunConfig, from_flat
from fedrobust.run_setup import config_problems, validate
from fedrobust.strategies.evaluation import central_evaluate_fn, initial_arrays
from fedrobust.strategies.from_config import strategy_from_config
from fedrobust.strategies.robust_strategy import RobustStrategy, UpdateHook

log = logging.getLogger(__name__)


def install_stop_handlers(request_stop: Callable[[], None]) -> bool:
    """Make SIGTERM and SIGINT ask the round loop to checkpoint and stop.

    Returns False where signals cannot be handled (not the main thread); the process then keeps
    Python's default behaviour.
    """
    if threading.current_thread() is not threading.main_thread():
        return False

    def on_signal(signum: int, _frame: object) -> None:
        log.warning("received %s: finishing up, writing a checkpoint", signal.Signals(signum).name)
        request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return True


def checked_run_config(run_config: Mapping[str, Any]) -> RunConfig:
    """The :class:`RunConfig` of Flower's run config, with every problem logged on its own line.

    Parameters
    ----------
    run_config : Mapping[str, Any]
        ``context.run_config``: ``[tool.flwr.app.config]`` with the ``--run-config`` overrides.

    Returns
    -------
    RunConfig
        The checked config.

    Raises
    ------
    ConfigError
        After logging ``fedrobust: invalid configuration:`` and one line per problem, so that the run
        fails before its first round and ``flwr log`` shows why.
    """
    try:
        run_cfg = from_flat(run_config)
    except ConfigError as err:
        problems = err.problems
    else:
        problems = config_problems(run_cfg)
        if run_cfg.attack.name in attacks.omniscient_names():
            # They need every honest update of a round, which only the Hydra simulation's hook hands
            # them (experiments.adversary); here they would silently do nothing.
            problems.append(
                f"attack.name={run_cfg.attack.name}: omniscient attacks run only in Hydra simulation "
                f"(python -m experiments.run); under flwr run use a client-side attack "
                f"({', '.join(attacks.client_names())})"
            )
    if problems:
        log.error("fedrobust: invalid configuration:")
        for line in problems:
            log.error("  %s", line)
        raise ConfigError(problems)
    return run_cfg


def run_experiment(
    grid: Grid,
    cfg: RunConfig,
    out_dir: Path,
    *,
    update_hook: UpdateHook | None = None,
    on_strategy: Callable[[RobustStrategy], None] | None = None,
    progress: bool = True,
) -> Result:
    """Train ``cfg`` on ``grid`` with its strategy; write metrics, the final model and the summary to ``out_dir``.

    ``on_strategy`` sees the strategy before it starts (e.g. to wire a stop request to it).
    """
    validate(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "resolved_config.json").write_text(cfg.to_json())
    strategy = strategy_from_config(cfg, out_dir=out_dir, update_hook=update_hook, progress=progress)
    if on_strategy is not None:
        on_strategy(strategy)
    result = strategy.start(
        grid=grid,
        initial_arrays=initial_arrays(cfg),
        num_rounds=cfg.num_rounds,
        timeout=cfg.fault.round_timeout,
        evaluate_fn=central_evaluate_fn(cfg),
    )
    state = {k: v.contiguous() for k, v in result.arrays.to_torch_state_dict().items()}
    save_file(state, str(out_dir / "final_model.safetensors"))
    return result


def make_server_app(
    cfg: RunConfig | None = None,
    *,
    out_dir: Path | None = None,
    update_hook: UpdateHook | None = None,
    on_strategy: Callable[[RobustStrategy], None] | None = None,
) -> ServerApp:
    """A ServerApp running ``cfg`` (or, when None, the run config Flower passes in).

    When ``on_strategy`` is None the app installs SIGTERM/SIGINT handlers that checkpoint and stop.
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run_cfg = cfg if cfg is not None else checked_run_config(context.run_config)
        target = out_dir if out_dir is not None else Path(run_cfg.output_dir or f"outputs/run-{grid.run.run_id}")
        hook = on_strategy
        if hook is None:
            def hook(strategy: RobustStrategy) -> None:
                install_stop_handlers(strategy.request_stop)
        run_experiment(grid, run_cfg, target, update_hook=update_hook, on_strategy=hook)

    return app


app = make_server_app()
