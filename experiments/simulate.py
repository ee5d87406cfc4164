"""Run one configuration on Flower's simulation engine in this process."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
# Before Ray is imported: ray_constants reads it then. Ray's C++ failure-signal handler would turn a
# SIGTERM that comes after ray.init and before our handlers into an abort (exit 134, no checkpoint).
os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")

import ray
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from experiments.adversary import omniscient_hook
from experiments.client_state import with_client_state
from fedrobust import components
from fedrobust.checkpoint_mirror import open_store
from fedrobust.clients.client_app import make_client_app
from fedrobust.config import RunConfig
from fedrobust.run_setup import validate
from fedrobust.strategies.errors import Preempted
from fedrobust.strategies.robust_strategy import RobustStrategy
from fedrobust.strategies.server_app import check_resume, run_experiment
from fedrobust.strategies.stopping import StopSignals, install_stop_handlers

log = logging.getLogger(__name__)

# Seconds Flower's engine gets to shut down after the server stopped on a stop request. A healthy
# shutdown takes a few seconds; Ray ends a process whose control store is gone after 60 s.
STOP_TEARDOWN_TIMEOUT = 10.0


class _WithoutRunSimulationNotice(logging.Filter):
    """Drop Flower's notice that ``run_simulation`` is deprecated in favour of ``flwr run``.

    It is addressed to whoever calls ``run_simulation``, here this module, not to the user of
    ``python -m experiments.run``, who could do nothing about it (``flwr run .`` is the project's
    other way to run, docs/flwr_run.md).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "`run_simulation` function is deprecated" not in record.getMessage()


def _start_ray(verbose: bool) -> None:
    """Start Ray here rather than inside Flower, so that our signal handlers can go in after it.

    Flower's Ray backend reuses an initialised Ray. Ray's C++ failure-signal handler, which would turn
    SIGTERM into an abort, is switched off where this module is imported, before Ray is.
    """
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # no GPU-env warning on CPU runs
    # ray.init first sets a SIGTERM handler of its own that calls sys.exit wherever the signal lands: a
    # SIGTERM while Ray started hung the process (the SystemExit raised inside logging's lock release).
    # The caller's handler stays in place instead until the run's own go in.
    ray_utils = ray._private.utils
    set_sigterm_handler = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda _handler: None
    try:
        ray.init(
            # What Flower's backend passes: workers need this process's import path.
            runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}},
            num_cpus=os.cpu_count() or 1,
            include_dashboard=False,
            log_to_driver=verbose,
        )
    finally:
        ray_utils.set_sigterm_handler = set_sigterm_handler


def simulate(
    cfg: RunConfig,
    out_dir: Path,
    *,
    verbose: bool = False,
    on_stuck_stop: Callable[[Preempted | None], object] | None = None,
    early_signals: Sequence[int] = (),
) -> list[dict[str, Any]]:
    """Run ``cfg`` with ``cfg.num_clients`` simulated SuperNodes; return the metrics rows.

    SIGTERM and SIGINT, to this process alone or to its whole process group (Ray's workers
    included, as batch schedulers send them), make the server checkpoint the last completed round
    and stop (``Preempted``). The clients' ``Context.state`` is checkpointed with the rounds
    (:mod:`experiments.client_state`), so a resume continues stateful clients exactly.

    A signal to the whole group also reaches Ray's own processes, and Flower's engine can then
    wait on them until Ray gives up on its lost control store and ends the process with exit 1
    (after 60 s). ``on_stuck_stop``, where given, is called from a watchdog thread with the
    server's ``Preempted`` when the engine has not shut down ``STOP_TEARDOWN_TIMEOUT`` seconds
    after the server stopped, or with None when the stop came after the last round (the run is
    complete); a command-line caller exits the process there. The checkpoint, or the run's outputs,
    are on disk by then: nothing is lost by not waiting.

    ``early_signals``, filled by the caller's own handler until this one's go in (a list it appends
    to), are signals that came before: the run stops at once (``Preempted``) or, once Ray has started,
    before its first round.

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
    # The server's evaluation data, read before Ray starts: a data set that cannot be read (a Hub data
    # set offline, a user loader that fails) fails in seconds, and the server's own read is a cache hit.
    components.load_evaluation_set(cfg)
    # A resume the server would refuse (other settings, no checkpoint that verifies) is refused before Ray's
    # start-up too (~20 s); the server's own check, once the nodes are up, is the same one.
    resumed_after = check_resume(cfg)
    if resumed_after is not None and resumed_after >= cfg.num_rounds and not early_signals:
        # Every round is in the checkpoint: the server only writes the run's outputs from it and trains on no
        # node, so it runs on the in-process transport (the same server code) without Ray's start-up.
        from experiments.inprocess import run_inprocess

        log.info("the checkpoint in %s holds all %d rounds: nothing left to train, so Ray is not started",
                 cfg.checkpoint.dir, cfg.num_rounds)
        return run_inprocess(cfg, out_dir, echo=True, picture=True)
    flwr_logger = logging.getLogger("flwr")
    if not verbose:  # Flower logs every actor and backend step at DEBUG
        flwr_logger.setLevel(logging.INFO)
    if early_signals:
        raise Preempted(_early_stop(early_signals), checkpointed=_has_checkpoint(cfg))
    _start_ray(verbose)
    # After ray.init, which replaces the SIGTERM handler with its own sys.exit. The strategy is
    # built inside the ServerApp, so a signal that comes first is remembered and passed on.
    stop = threading.Event()
    strategies: list[RobustStrategy] = []
    finished = threading.Event()  # the server ran every round and wrote the run's outputs
    watchdog: list[threading.Timer] = []

    def watch_teardown_if_done() -> None:
        """After the last round, a stop leaves nothing to stop but the engine, whose shutdown a signal to the
        whole group can hang (Ray's processes got it too): bounded as after a stop in a round (None: the run
        is complete). Called on the stop and when the server is done, whichever comes second arms it."""
        if finished.is_set() and stop.is_set() and on_stuck_stop is not None and not watchdog:
            watchdog.append(_watch_teardown(None, signals, on_stuck_stop))

    def request_stop() -> None:
        stop.set()
        for strategy in strategies:
            strategy.request_stop()
        watch_teardown_if_done()

    def on_strategy(strategy: RobustStrategy) -> None:
        strategies.append(strategy)
        if stop.is_set():
            strategy.request_stop()

    signals = install_stop_handlers(request_stop)
    if early_signals:  # while Ray started
        log.warning("%s; stopping before the first round", _early_stop(early_signals))
        request_stop()
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = out_dir / "metrics.jsonl"  # the strategy starts it over, or rewrites it on a resume
    server_app = ServerApp()
    preempted: list[Preempted] = []

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            run_experiment(grid, cfg, out_dir, update_hook=omniscient_hook(cfg), on_strategy=on_strategy)
            finished.set()
            watch_teardown_if_done()
        except Preempted as stopped:
            preempted.append(stopped)
            if on_stuck_stop is not None:
                watchdog.append(_watch_teardown(stopped, signals, on_stuck_stop))
            raise

    notice_filter = _WithoutRunSimulationNotice()
    flwr_logger.addFilter(notice_filter)
    try:
        run_simulation(
            server_app=server_app,
            client_app=with_client_state(make_client_app(cfg)),
            num_supernodes=cfg.num_clients,
            backend_config=backend_config(cfg),
            verbose_logging=verbose,
        )
    except Exception as err:
        _report_signals(signals)
        # After a stop request, whatever else failed (the engine losing its workers to a signal
        # sent to the whole process group) is the stop; the server's own account of it comes first.
        if preempted:
            _ignore_further_signals()
            raise preempted[0] from (None if err is preempted[0] else err)
        if stop.is_set():
            _ignore_further_signals()
            raise Preempted(f"stopped ({type(err).__name__}: {err})", checkpointed=_has_checkpoint(cfg)) from err
        raise
    finally:
        flwr_logger.removeFilter(notice_filter)
        for timer in watchdog:
            timer.cancel()
    if stop.is_set():  # the run was complete when the signal came
        _ignore_further_signals()
        _report_signals(signals)
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
    if len(rows) < cfg.num_rounds:
        raise RuntimeError(f"the server stopped after {len(rows)} of {cfg.num_rounds} rounds; see the log above")
    return rows


def _early_stop(early_signals: Sequence[int]) -> str:
    return f"stopped: {signal.Signals(early_signals[0]).name} received before the run started"


def backend_config(cfg: RunConfig) -> dict[str, Any]:
    """Flower's Ray backend config for ``cfg``: each client's resources, and workers that come back.

    A ClientApp that takes its worker process down (``os._exit``, a segfault, the OOM killer) would
    otherwise leave a dead actor in Flower's pool, and every later message given to it would fail
    too. Ray restarts it and runs the message it died on once more: a ClientApp that dies again is
    one dropped reply, one that died of a passing cause (memory) answers after all.
    """
    return {
        "client_resources": {
            "num_cpus": cfg.simulation.client_cpus,
            "num_gpus": cfg.simulation.client_gpus,
            # Passed through to the actors' options: a dead worker is restarted, and a message given to
            # it while it restarts (or the one it died on) is run once more after the restart.
            "max_restarts": -1,
            "max_task_retries": 1,
        },
    }


def _watch_teardown(
    stopped: Preempted | None, signals: StopSignals | None, on_stuck_stop: Callable[[Preempted | None], object]
) -> threading.Timer:
    """A started timer that hands ``stopped`` (None: the run had completed when the stop came) to
    ``on_stuck_stop`` if the engine's shutdown hangs."""

    def stuck() -> None:
        _report_signals(signals)
        log.warning(
            "the simulation engine has not shut down %.0f s after the stop (Ray may be stuck, or gone where "
            "the signal reached its processes too); not waiting for it",
            STOP_TEARDOWN_TIMEOUT,
        )
        on_stuck_stop(stopped)

    timer = threading.Timer(STOP_TEARDOWN_TIMEOUT, stuck)
    timer.daemon = True
    timer.start()
    return timer


def _report_signals(signals: StopSignals | None) -> None:
    """Say how many stop signals came, once the run has stopped (the handler logs only the first)."""
    if signals is not None and signals.count > 1:
        log.warning("%d stop signals received in all; the first one stopped the run", signals.count)


def _ignore_further_signals() -> None:
    """The run stopped and its checkpoint is written: from now on SIGTERM and SIGINT change nothing.

    Schedulers and impatient users signal again while the process shuts Ray down; with our handler
    left in place, Python's finalization would restore the default action and such a signal would
    end the process with -15 instead of the 75 that says "resume me".
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _has_checkpoint(cfg: RunConfig) -> bool:
    """Whether ``cfg``'s checkpoint directory holds a checkpoint to resume from."""
    if not cfg.checkpoint.dir:
        return False
    try:
        return bool(open_store(cfg.checkpoint.dir).rounds())
    except (OSError, ValueError):
        return False
