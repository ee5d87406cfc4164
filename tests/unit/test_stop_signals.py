"""The stop handler of Hydra runs and the ServerApp: each SIGTERM/SIGINT asks for the stop, the first is logged."""

from __future__ import annotations

import logging
import os
import signal

import pytest

from fedrobust.strategies.stopping import install_stop_handlers


def test_a_storm_of_signals_is_counted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    requests = []
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with caplog.at_level(logging.WARNING, logger="fedrobust.strategies.stopping"):
            handler = install_stop_handlers(lambda: requests.append(1))
            assert handler is not None
            for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGINT, signal.SIGTERM):
                os.kill(os.getpid(), sig)
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    assert handler.count == 4 and len(requests) == 4  # each one asks again (the request is idempotent)
    lines = [r.getMessage() for r in caplog.records if "received" in r.getMessage()]
    assert lines == ["received SIGTERM: stopping; the last completed round is checkpointed where checkpoints are on"]
