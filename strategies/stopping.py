"""How a run stops cleanly: a stop request makes the round loop checkpoint the last completed round and end.

A scheduler, a Ctrl-C or ``flwr stop`` reaches the process that runs the ServerApp in one of two ways:

- as SIGTERM/SIGINT to the main thread that runs the round loop: handlers of our own,
  :func:`install_stop_handlers` (``experiments.run``) or, where Flower's are
  installed there (``flwr-serverapp`` on a deployment), :class:`StopSignals` in their place for the run
  (:func:`on_flower_exit`);
- through Flower's exit path (``flwr_exit`` and its exit handlers), when Flower runs the ServerApp in
  a thread (``flwr-simulation``) or ends the process for ``flwr stop``: :class:`FlowerExitWatch`.

:meth:`RobustStrategy.start` takes both for every run (:func:`on_flower_exit`), so a user's own
ServerApp stops as cleanly as fedrobust's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)


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
        # The round loop's thread: Flower's exit path run on it (a signal handler of Flower's in the thread
        # that runs the loop) cannot wait for the loop, which could only go on once the handler returned.
        self.loop_thread = threading.get_ident()

    def start(self) -> bool:
        """Register with Flower's exit path (from the round loop's thread); False where Flower lacks the hook."""
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
        if threading.get_ident() == self.loop_thread:
            self.request_stop()  # on_flower_exit swaps Flower's signal handlers there; another exit path
            return
        log.warning("Flower is ending this process: finishing up, writing a checkpoint")
        _log_further_signals()
        self.request_stop()
        if not self.finished.wait(self.wait):
            log.error("the round loop did not end within %.0f s of the stop request", self.wait)

    def finish(self) -> None:
        """The round loop has ended: later exits of the process need nothing from this run.

        The registration is taken back (it holds the strategy, and a process runs many: a study,
        a test session); where this Flower offers no way to, the finished watch returns at once.
        """
        self.finished.set()
        with contextlib.suppress(ImportError, AttributeError):
            from flwr.supercore.exit import exit_handler

            with exit_handler._lock_handlers:
                exit_handler.registered_exit_handlers[:] = [
                    registered for registered in exit_handler.registered_exit_handlers
                    if registered.exit_handler != self.stop_and_wait
                ]


# The signals Flower's register_signal_handlers takes (SIGQUIT where the platform has it).
_FLOWERS_SIGNALS = (signal.SIGTERM, signal.SIGINT) + ((signal.SIGQUIT,) if hasattr(signal, "SIGQUIT") else ())


def _is_flowers(handler: object) -> bool:
    module = getattr(handler, "__module__", None)
    return isinstance(module, str) and module.startswith("flwr.")


@contextlib.contextmanager
def on_flower_exit(request_stop: Callable[[], None]) -> Iterator[None]:
    """While the round loop runs in the block, the ways Flower ends the process ask for the stop instead.

    Flower's exit path (a signal under ``flwr run``, where the loop runs in a thread of flwr-simulation;
    ``flwr stop``) waits for the loop to end, as :class:`FlowerExitWatch` says. Where the loop runs in the
    main thread and Flower's signal handlers are installed there (``flwr-serverapp`` on a deployment),
    their exit path would run in the loop's own thread, which cannot wait for itself: for the block,
    the signals Flower handles (SIGTERM, SIGINT, SIGQUIT) go to one :class:`StopSignals` instead, and
    Flower's handlers come back after it. A handler that is not Flower's (a caller's own, Python's
    default, ``experiments.run``'s) is left as it is.
    """
    watch = FlowerExitWatch(request_stop)
    watch.start()
    replaced: dict[signal.Signals, Any] = {}
    try:
        if threading.current_thread() is threading.main_thread():
            stop = StopSignals(request_stop)
            for signum in _FLOWERS_SIGNALS:
                if _is_flowers(signal.getsignal(signum)):
                    replaced[signum] = _set_handler(signum, stop)
        yield
    finally:
        for signum, handler in replaced.items():
            _set_handler(signum, handler)
        watch.finish()


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
    # Ray's C++ failure-signal handler would turn SIGTERM into an abort ~3 s after it (read when Ray is
    # imported; experiments/simulate.py sets it for the Hydra runs). Only here: elsewhere Ray keeps its
    # crash reports.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")

    def set_handler(signum: int, handler: Any) -> Any:
        module = getattr(handler, "__module__", None)
        if signum == signal.SIGTERM and callable(handler) and isinstance(module, str) and module.startswith("ray."):
            handler = _on_sigterm_under_flwr_simulation
        return _set_handler(signum, handler)

    signal.signal = set_handler  # type: ignore[assignment]


_chain_ray_sigterm_handler()
