"""How many rounds between checkpoints: Young/Daly's optimum from measured costs and the failure rate.

With a checkpoint costing ``C`` seconds of blocked progress and failures arriving on average every ``F``
seconds (MTBF), the interval that minimises checkpoint cost plus expected lost work is, to first order,
``T = sqrt(2 C F)`` seconds (Young 1974; Daly 2006). :class:`AdaptiveInterval` turns it into rounds: it
keeps moving averages of the measured blocking cost of a checkpoint and of the round time, takes ``F``
from the user or estimates it from the restarts recorded in its own (checkpointed) state, and asks for a
checkpoint every ``round(T / round_time)`` rounds, clamped to ``[min_interval, max_interval]``.

Use in a round loop::

    interval = AdaptiveInterval(max_interval=20, mtbf_seconds=None)   # None: estimate from restarts
    for rnd in rounds:
        ... run the round ...
        interval.observe_round(round_seconds)
        if interval.due(rnd):
            blocked = save_checkpoint(meta={"interval": interval.state_dict(), ...})
            interval.observe_checkpoint(blocked)

and on resume ``interval.load_state_dict(meta["interval"], checkpoint.round); interval.record_restart()``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)


def young_daly_interval(checkpoint_seconds: float, mtbf_seconds: float) -> float:
    """Optimal time between checkpoints, ``sqrt(2 C F)`` seconds.

    Parameters
    ----------
    checkpoint_seconds : float
        Blocking cost ``C`` of one checkpoint (>= 0).
    mtbf_seconds : float
        Mean time between failures ``F`` (> 0).

    Raises
    ------
    ValueError
        If ``C`` is negative or ``F`` is not positive (or either is not finite).
    """
    if not (math.isfinite(checkpoint_seconds) and checkpoint_seconds >= 0):
        raise ValueError(f"checkpoint cost must be a finite number >= 0 seconds, got {checkpoint_seconds!r}")
    if not (math.isfinite(mtbf_seconds) and mtbf_seconds > 0):
        raise ValueError(f"MTBF must be a finite number > 0 seconds, got {mtbf_seconds!r}")
    return math.sqrt(2.0 * checkpoint_seconds * mtbf_seconds)


def estimate_mtbf(elapsed_seconds: float, failures: int) -> float:
    """Estimate the MTBF as elapsed time over failures, counting at least one failure.

    With no failure seen yet the true MTBF is only known to exceed the elapsed time; taking the elapsed
    time itself is the cautious choice (checkpoint more often), and it grows as the run survives.
    """
    if failures < 0:
        raise ValueError(f"failures must be >= 0, got {failures}")
    return max(elapsed_seconds, 1e-9) / max(failures, 1)


class AdaptiveInterval:
    """Decides after each round whether to checkpoint, adapting the interval to measured costs.

    Parameters
    ----------
    max_interval : int
        Upper bound ``N`` on the interval in rounds (e.g. the number of rounds of the run).
    mtbf_seconds : float, optional
        Mean time between failures of the server. None estimates it from the restarts recorded with
        :meth:`record_restart` over the wall time since the run started (see :func:`estimate_mtbf`).
    min_interval : int, default 1
        Lower bound on the interval in rounds.
    smoothing : float, default 0.2
        Weight of a new measurement in the exponential moving averages of round time and checkpoint cost.
    clock : Callable[[], float], default time.time
        Wall clock used for the run's start and its restarts (a simulation passes its own).

    Notes
    -----
    Until one round and one checkpoint have been measured the interval is ``min_interval``, so the first
    rounds measure the cost. The interval is recomputed after every observation and logged at INFO when
    it changes.
    """

    def __init__(
        self,
        *,
        max_interval: int,
        mtbf_seconds: float | None = None,
        min_interval: int = 1,
        smoothing: float = 0.2,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if isinstance(min_interval, bool) or not isinstance(min_interval, int) or min_interval < 1:
            raise ValueError(f"min_interval must be an integer >= 1, got {min_interval!r}")
        if isinstance(max_interval, bool) or not isinstance(max_interval, int) or max_interval < min_interval:
            raise ValueError(f"max_interval must be an integer >= min_interval ({min_interval}), got {max_interval!r}")
        if mtbf_seconds is not None and not (math.isfinite(mtbf_seconds) and mtbf_seconds > 0):
            raise ValueError(f"mtbf_seconds must be > 0 or None (estimate it), got {mtbf_seconds!r}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing!r}")
        self.max_interval = max_interval
        self.min_interval = min_interval
        self.mtbf_seconds = mtbf_seconds
        self.smoothing = smoothing
        self._clock = clock
        self.started = clock()
        self.restarts: list[float] = []
        self.round_seconds: float | None = None
        self.checkpoint_seconds: float | None = None
        self.interval = min_interval
        self._last_checkpoint_round: int | None = None
        self._last_asked: int | None = None

    def __repr__(self) -> str:
        return (
            f"AdaptiveInterval(interval={self.interval}, round_seconds={self.round_seconds}, "
            f"checkpoint_seconds={self.checkpoint_seconds}, mtbf={self.mtbf():.4g})"
        )

    # ------------------------------------------------------------------------------------ observations
    def observe_round(self, seconds: float) -> int:
        """Record one round's wall time (seconds, >= 0); returns the (possibly new) interval."""
        self.round_seconds = self._average(self.round_seconds, seconds, "round time")
        return self._update()

    def observe_checkpoint(self, blocking_seconds: float, round: int | None = None) -> int:
        """Record the time a checkpoint blocked the loop; returns the (possibly new) interval.

        Parameters
        ----------
        blocking_seconds : float
            What the loop waited for (with background writes: the snapshot only).
        round : int, optional
            The round checkpointed; default the round last passed to :meth:`due`.
        """
        self.checkpoint_seconds = self._average(self.checkpoint_seconds, blocking_seconds, "checkpoint cost")
        self._last_checkpoint_round = self._last_asked if round is None else round
        return self._update()

    def record_restart(self, at: float | None = None) -> int:
        """Record a restart after a failure (call it on resume, after :meth:`load_state_dict`)."""
        self.restarts.append(self._clock() if at is None else at)
        return self._update()

    # ---------------------------------------------------------------------------------------- decision
    def due(self, round: int) -> bool:
        """Whether to checkpoint after ``round``: at least ``interval`` rounds since the last checkpoint."""
        self._last_asked = round
        if self._last_checkpoint_round is None or round < self._last_checkpoint_round:
            return True  # nothing saved yet in this history (or a rollback went behind it)
        return round - self._last_checkpoint_round >= self.interval

    def mtbf(self) -> float:
        """The MTBF in use: the one given, or the estimate from the recorded restarts."""
        if self.mtbf_seconds is not None:
            return self.mtbf_seconds
        return estimate_mtbf(self._clock() - self.started, len(self.restarts))

    def target_interval(self) -> int:
        """Young/Daly's interval in rounds for the current estimates, clamped to the bounds."""
        if self.round_seconds is None or self.checkpoint_seconds is None:
            return self.min_interval
        seconds = young_daly_interval(self.checkpoint_seconds, self.mtbf())
        rounds = math.floor(seconds / max(self.round_seconds, 1e-12) + 0.5)
        return min(max(rounds, self.min_interval), self.max_interval)

    def _update(self) -> int:
        new = self.target_interval()
        if new != self.interval:
            logger.info(
                "checkpoint interval %d -> %d rounds (checkpoint blocks %.3g s, round %.3g s, MTBF %.4g s%s)",
                self.interval,
                new,
                self.checkpoint_seconds or 0.0,
                self.round_seconds or 0.0,
                self.mtbf(),
                "" if self.mtbf_seconds is not None else f" estimated from {len(self.restarts)} restart(s)",
            )
            self.interval = new
        return new

    def _average(self, current: float | None, value: float, what: str) -> float:
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{what} must be a finite number >= 0 seconds, got {value!r}")
        return value if current is None else (1 - self.smoothing) * current + self.smoothing * value

    # ------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """JSON-able state to store in the checkpoint's meta (restart history and moving averages)."""
        return {
            "started": self.started,
            "restarts": list(self.restarts),
            "round_seconds": self.round_seconds,
            "checkpoint_seconds": self.checkpoint_seconds,
            "interval": self.interval,
            "last_checkpoint_round": self._last_checkpoint_round,
        }

    def load_state_dict(self, state: Mapping[str, Any], checkpoint_round: int | None = None) -> None:
        """Restore :meth:`state_dict` (e.g. from the checkpoint a run resumes from).

        Parameters
        ----------
        state : Mapping[str, Any]
            What :meth:`state_dict` returned.
        checkpoint_round : int, optional
            The round of the checkpoint resumed from; the state saved inside it predates its own
            :meth:`observe_checkpoint`, so pass it to count the next interval from there.
        """
        self.started = float(state["started"])
        self.restarts = [float(t) for t in state.get("restarts", [])]
        self.round_seconds = state.get("round_seconds")
        self.checkpoint_seconds = state.get("checkpoint_seconds")
        self.interval = int(state.get("interval", self.min_interval))
        saved_round = state.get("last_checkpoint_round")
        self._last_checkpoint_round = checkpoint_round if checkpoint_round is not None else saved_round
        self._update()
