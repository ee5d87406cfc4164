"""fedrobust's own ServerApp: ``flwr run .`` and the deployment engine start here.

It is the first user of the library API: the run config (``[tool.flwr.app.config]`` plus
``--run-config`` overrides) becomes a :class:`~fedrobust.config.RunConfig`, then a
:class:`RobustStrategy` (:func:`strategy_from_config`), whose ``start()`` runs the rounds. Hydra
experiments build the same app with :func:`make_server_app` from their own config.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result
from safetensors.torch import save as safetensors_bytes

from fedrobust import attacks
from fedrobust.checkpoint import CheckpointMismatchError
from fedrobust.config import ConfigError, RunConfig, from_flat
from fedrobust.data import DataUnavailableError
from fedrobust.dir_lock import DirectoryInUseError
from fedrobust.run_setup import byzantine_partitions, config_problems, validate
from fedrobust.strategies.checkpointing import NoValidCheckpointError
from fedrobust.strategies.errors import CheckpointStorageError, QuorumError
from fedrobust.strategies.evaluation import central_evaluate_fn, initial_arrays
from fedrobust.strategies.from_config import strategy_from_config
from fedrobust.strategies.robust_strategy import RobustStrategy, UpdateHook

log = logging.getLogger(__name__)

# Ray's C++ failure-signal handler would turn SIGTERM into an abort ~3 s after it. Under `flwr run` this
# module is imported in flwr-simulation before its simulation engine starts Ray (see _chain_ray_sigterm_handler).
os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")


# Errors whose message says in one line what went wrong and what to do (as experiments.run prints them):
# a refused config (checked_run_config logs it line by line), a resume refused, a checkpoint directory in
# use or not writable, data that cannot be read, nothing (more) trainable. Not AggregationError: its
# traceback shows where in the user's rule the error is.
ONE_LINE_ERRORS = (
    ConfigError, CheckpointMismatchError, NoValidCheckpointError, DirectoryInUseError, CheckpointStorageError,
    DataUnavailableError, QuorumError,
)
_SAID = "_fedrobust_said"  # set on such an error once its line is logged


class _SaidWithoutTraceback(logging.Filter):
    """On Flower's logger: Flower logs a ServerApp's exception with its traceback, some fifteen lines of
    Flower's own frames under the one line fedrobust already logged. For an error of
    :data:`ONE_LINE_ERRORS` that line is the message; Flower's record keeps its text, without the frames."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and getattr(error, _SAID, False):
            record.exc_info = record.exc_text = None
        return True


def _say_in_one_line(error: BaseException) -> None:
    if not isinstance(error, ConfigError):  # checked_run_config has logged its lines
        log.error("fedrobust: run failed: %s", " ".join(str(error).split()))
    setattr(error, _SAID, True)


class StopSignals:
    """The SIGTERM/SIGINT handler that asks the round loop to checkpoint and stop; it counts the signals.

    Only the first is logged. Schedulers repeat their signal, some every few milliseconds, and a
    handler runs in the main thread between any two of its bytecodes, also inside a log call that
    holds the log handler's lock: logging every signal of such a storm kept that lock held, so the
    thread writing the stop's checkpoint waited on its own log line (no checkpoint in 60 s under a
    SIGTERM every 2 ms). The count is for the caller to report once the run has stopped.
    """

    def __init__(self, request_stop: Callable[[], None]) -> None:
        self.request_stop = request_stop
        self.count = 0

    def __call__(self, signum: int, _frame: object) -> None:
        self.count += 1
        if self.count == 1:
            log.warning("received %s: stopping; the last completed round is checkpointed where checkpoints are on",
                        signal.Signals(signum).name)
        self.request_stop()


def install_stop_handlers(request_stop: Callable[[], None]) -> StopSignals | None:
    """Make SIGTERM and SIGINT ask the round loop to checkpoint and stop.

    Returns the installed handler (its ``count`` says how many signals came), or None where signals
    cannot be handled (not the main thread); the process then keeps Python's default behaviour.
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    handler = StopSignals(request_stop)
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return handler


# How long Flower's exit path waits for the round loop to abandon its round and commit the checkpoint.
# The loop stops waiting for replies at once; this bounds a checkpoint write to slow storage.
FLOWER_EXIT_WAIT = 300.0

_set_handler = signal.signal  # the real one, also after _chain_ray_sigterm_handler wraps signal.signal


class FlowerExitWatch:
    """Under ``flwr run``: turn the ways Flower ends ``flwr-simulation`` into a stop request of the round loop.

    There the ServerApp runs in a thread of ``flwr-simulation`` and cannot install signal handlers;
    the main thread holds Flower's handlers, and every way Flower ends the process goes through its
    ``flwr_exit`` and exit handlers: SIGINT/SIGTERM/SIGQUIT, and ``flwr stop`` or its parent going
    away, on which Flower has the process signal itself. The handler registered here runs first, before
    Flower's force-exit timer: it requests the stop, makes further SIGTERM/SIGINT only log, and waits
    (at most ``wait`` s) until the round loop has committed the checkpoint of the last completed
    round and ended. Flower then reports the run to the SuperLink and ends the process.
    """

    def __init__(self, request_stop: Callable[[], None], *, wait: float = FLOWER_EXIT_WAIT) -> None:
        self.request_stop = request_stop
        self.wait = wait
        self.finished = threading.Event()  # the round loop has ended

    def start(self) -> bool:
        """Register with Flower's exit path; False where this Flower lacks the hook."""
        try:
            from flwr.supercore.exit import add_exit_handler
        except ImportError:
            return False
        try:
            add_exit_handler(self.stop_and_wait, run_before_force_exit=True)
        except TypeError:  # a Flower without the phase: its 5 s force-exit timer then bounds the wait
            add_exit_handler(self.stop_and_wait)
        return True

    def stop_and_wait(self) -> None:
        """Request the stop and wait until the round loop has ended (runs in the main thread)."""
        if self.finished.is_set():
            return
        log.warning("Flower is ending this process: finishing up, writing a checkpoint")
        _log_further_signals()
        self.request_stop()
        if not self.finished.wait(self.wait):
            log.error("the round loop did not end within %.0f s of the stop request", self.wait)

    def finish(self) -> None:
        """The round loop has ended."""
        self.finished.set()


def _log_further_signals() -> None:
    """While the checkpoint is written, SIGTERM/SIGINT are logged and change nothing (main thread only).

    Flower's handler restores the default action before it calls the exit handlers, so without
    this a second signal (schedulers repeat theirs) would kill the process in the middle of it.
    """
    if threading.current_thread() is not threading.main_thread():
        return

    logged = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        if not logged.is_set():  # once: see StopSignals for what logging every one of a storm does
            logged.set()
            log.warning("received %s: already stopping, the checkpoint is being written", signal.Signals(signum).name)

    _set_handler(signal.SIGTERM, on_signal)
    _set_handler(signal.SIGINT, on_signal)


def _on_sigterm_under_flwr_simulation(signum: int, _frame: object) -> None:
    """SIGTERM in ``flwr-simulation`` once Ray runs: what Flower does for SIGINT, instead of Ray's ``sys.exit``.

    Ray's ``init`` replaces Flower's SIGTERM handler with one that only raises ``SystemExit`` in the
    main thread: the ServerApp thread would go on training with a stopped engine, and the SuperLink
    would learn of the end only when the task's heartbeats stop.
    """
    from flwr.supercore.exit import ExitCode, flwr_exit

    _log_further_signals()
    log.warning("received %s", signal.Signals(signum).name)
    flwr_exit(ExitCode.GRACEFUL_EXIT_SIGTERM, "Task stopped by SIGTERM.")  # runs FlowerExitWatch.stop_and_wait


def _chain_ray_sigterm_handler() -> None:
    """In ``flwr-simulation``, make the SIGTERM handler that Ray's ``init`` installs ours (see above).

    This module is imported by the ServerApp thread while the main thread loads the ClientApp,
    before the simulation engine starts Ray; Ray installs its handler with ``signal.signal``.
    """
    if os.path.basename(sys.argv[0]) != "flwr-simulation" or signal.signal is not _set_handler:
        return

    def set_handler(signum: int, handler: Any) -> Any:
        if signum == signal.SIGTERM and callable(handler) and getattr(handler, "__module__", "").startswith("ray."):
            handler = _on_sigterm_under_flwr_simulation
        return _set_handler(signum, handler)

    signal.signal = set_handler  # type: ignore[assignment]


_chain_ray_sigterm_handler()


def checked_run_config(run_config: Mapping[str, Any], *, local_devices: bool = False) -> RunConfig:
    """The :class:`RunConfig` of Flower's run config, with every problem logged on its own line.

    Parameters
    ----------
    run_config : Mapping[str, Any]
        ``context.run_config``: ``[tool.flwr.app.config]`` with the ``--run-config`` overrides.
    local_devices : bool
        The clients run on this machine (a simulation): a ``client.device`` it lacks (``cuda`` without
        a GPU) is refused here, rather than failing in every ClientApp of round 1.

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
        if err.partial is not None:
            # The other settings' problems too, in the same pass; a problem that names a setting whose value
            # was refused is left out: it would be about the default put in its place.
            refused = {line.split("=", 1)[0] for line in problems}
            problems += [line for line in config_problems(err.partial) if not any(k in line for k in refused)]
    else:
        problems = config_problems(run_cfg, local_devices=local_devices)
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
    attackers = sorted(byzantine_partitions(cfg))
    if attackers:  # so that the rounds' rejected, filtered and excluded nodes can be read against them
        log.info("attack %s played by partitions %s", cfg.attack.name, ", ".join(map(str, attackers)))
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
    # Written whole, then renamed: a run is finished when the file exists (docs/flwr_run.md), so a crash
    # while writing must not leave a partial one. Mode as the other outputs (the umask's).
    final = out_dir / "final_model.safetensors"
    partial = final.with_name(final.name + ".partial")
    partial.write_bytes(safetensors_bytes(state))
    os.replace(partial, final)
    return result


def seed_keys_on_a_deployment(grid: Grid, cfg: RunConfig) -> bool:
    """Whether ``cfg`` requires signatures without a trust store on Flower's Deployment Engine (its
    ``HttpGrid``), where the seed-derived keys of a simulation (``trust_store_for``) guard nothing."""
    from flwr.superlink.grid import HttpGrid

    return isinstance(grid, HttpGrid) and cfg.signing.require and not cfg.signing.trust_dir


def make_server_app(
    cfg: RunConfig | None = None,
    *,
    out_dir: Path | None = None,
    update_hook: UpdateHook | None = None,
    on_strategy: Callable[[RobustStrategy], None] | None = None,
) -> ServerApp:
    """A ServerApp running ``cfg`` (or, when None, the run config Flower passes in).

    When ``on_strategy`` is None, a stop makes the app checkpoint the last completed round and end:
    SIGTERM/SIGINT handlers where the app runs in the main thread, otherwise (``flwr run``, where
    Flower runs it in a thread of ``flwr-simulation``) Flower's own exit path
    (:class:`FlowerExitWatch`).
    """
    app = ServerApp()
    flower_log = logging.getLogger("flwr")
    if cfg is None and not any(isinstance(f, _SaidWithoutTraceback) for f in flower_log.filters):
        flower_log.addFilter(_SaidWithoutTraceback())

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            run(grid, context)
        except ONE_LINE_ERRORS as error:
            if cfg is None:  # under flwr run; experiments.run prints its own line for these
                _say_in_one_line(error)
            raise  # the run ends failed, as Flower reports it (flwr ls: finished:failed)

    def run(grid: Grid, context: Context) -> None:
        from flwr.superlink.grid import HttpGrid

        # Flower's simulation runs the ClientApps on this machine; a deployment's run on devices of their own.
        simulated = not isinstance(grid, HttpGrid)
        run_cfg = cfg if cfg is not None else checked_run_config(context.run_config, local_devices=simulated)
        if seed_keys_on_a_deployment(grid, run_cfg):
            log.warning(
                "signing.require=true without signing.trust_dir on the Deployment Engine: replies are checked "
                "against keys derived from the run's seed, which anyone who knows the run config can derive, so "
                "a valid signature proves nothing about who sent it. Set signing.trust_dir to the trust store of "
                "python -m fedrobust.keygen (docs/deployment.md, sections 2 and 7)."
            )
        target = out_dir if out_dir is not None else Path(run_cfg.output_dir or f"outputs/run-{grid.run.run_id}")
        if on_strategy is not None:
            run_experiment(grid, run_cfg, target, update_hook=update_hook, on_strategy=on_strategy)
            return
        watch: FlowerExitWatch | None = None

        def hook(strategy: RobustStrategy) -> None:
            nonlocal watch
            if not install_stop_handlers(strategy.request_stop):
                watch = FlowerExitWatch(strategy.request_stop)
                watch.start()

        try:
            run_experiment(grid, run_cfg, target, update_hook=update_hook, on_strategy=hook)
        finally:
            if watch is not None:
                watch.finish()

    return app


app = make_server_app()
