"""The :class:`Aggregator`: input checks, pre-aggregators, then the robust rule."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from fedrobust.aggregators.base import Component, PreAggregator, RowFilter, Rule, describe_dtype
from fedrobust.aggregators.rows import Basis, Rows

__all__ = ["Aggregator"]

logger = logging.getLogger(__name__)


@contextmanager
def _tolerating(component: Component, f: int) -> Iterator[None]:
    """Run ``component`` with ``f`` for one call, then give it its own back.

    The stages read ``f`` when they run, so a pipeline whose filter took Byzantine rows out for certain
    lets the stages after it tolerate fewer, without a copy of each stage per ``f``.
    """
    own = component.f
    component.f = f
    try:
        yield
    finally:
        component.f = own


class Aggregator:
    """A robust rule with optional pre-aggregators in front, called on stacked client updates.

    Build it with :func:`fedrobust.aggregators.build`.

    Parameters
    ----------
    rule : Rule
        The robust aggregation rule.
    pre : sequence of PreAggregator
        Applied in order before the rule.

    Attributes
    ----------
    name : str
        The rule's name.
    f : int
        Number of Byzantine rows tolerated.
    supports_weights : bool
        Whether per-row weights are accepted (``mean``, with no pre-aggregator that regroups rows).
    needs_server_update : bool
        Whether each call needs :meth:`set_server_update` first (``fltrust``).
    last_filtered : tuple of int
        The input rows the pre-aggregators of the last call dropped (its filters'), ascending. Only drops
        before any stage that mixes rows count: after one, a row no longer stands for one input.
    last_filtered_by : dict of int to str
        For each row of ``last_filtered``, the name of the filter that dropped it (``consistency``,
        ``direction``, ``dedup``, ``dnc``).
    last_f : int
        The ``f`` the rule ran with in the last call: ``f`` less the Byzantine rows a filter took out for
        certain (``dedup`` with ``lower_f``).
    last_excluded : tuple of int
        The input rows the rule of the last call gave no weight (rules that select rows, such as Krum,
        Multi-Krum, Bulyan, DnC or SignGuard), ascending; disjoint from ``last_filtered``. Empty after a
        stage that mixes rows, for the same reason.
    """

    def __init__(self, rule: Rule, pre: Sequence[PreAggregator] = ()) -> None:
        self.rule = rule
        self.pre = tuple(pre)
        self.name = rule.name
        self.f = rule.f
        self.supports_weights = rule.supports_weights and all(p.keeps_rows for p in self.pre)
        self.needs_server_update = rule.needs_server_update
        self.label = rule.name if not self.pre else f"{rule.name} (after {', '.join(p.name for p in self.pre)})"
        self.last_filtered: tuple[int, ...] = ()
        self.last_filtered_by: dict[int, str] = {}
        self.last_excluded: tuple[int, ...] = ()
        self.last_f = self.f

    def __repr__(self) -> str:
        return f"Aggregator({self.label}, f={self.f})"

    def _first_failure(self, n: int) -> tuple[Component, int, str] | None:
        """The first stage whose requirement fails on ``n`` input rows, its row count and rule."""
        rows = n
        for stage in (*self.pre, self.rule):
            needed, text = stage.requirement()
            if rows < needed:
                return stage, rows, text
            if isinstance(stage, PreAggregator):
                rows = stage.out_rows(rows)
        return None

    def set_server_update(self, vector: Tensor) -> None:
        """Give the rule the server's own ``[d]`` update for the next call (rules with ``needs_server_update``).

        Raises
        ------
        ValueError
            For a rule that takes none, or a vector that is not a 1-D float tensor.
        """
        self.rule.set_server_update(vector)

    def min_n(self) -> int:
        """Smallest number of rows the whole pipeline (pre-aggregators and rule) accepts."""
        n = 1
        while self._first_failure(n) is not None:
            n += 1
        return n

    def __call__(
        self, updates: Tensor, weights: Tensor | None = None, *, clients: Sequence[int] | None = None
    ) -> Tensor:
        """Aggregate ``[n, d]`` updates into one ``[d]`` vector.

        Parameters
        ----------
        updates : Tensor
            One flattened update per row; any float dtype (half precision is reduced in float32)
            and any device. Every entry must be finite.
        weights : Tensor, optional
            ``[n]`` non-negative per-row weights, only for rules with ``supports_weights``.
        clients : sequence of int, optional
            The client each row comes from, by an id that stays the same across calls (a partition
            or node id). Stages that remember clients across rounds (the direction filter's memory)
            use it; without it each call stands alone.

        Returns
        -------
        Tensor
            ``[d]`` on the device and in the dtype of ``updates``.

        Raises
        ------
        ValueError
            For a wrong type, rank or dtype, empty or non-finite input, too few rows for ``f``, or
            unusable weights. The message names the rule, ``n``, ``f`` and the requirement.
        """
        started = time.perf_counter()
        x = self._check_updates(updates)
        n = x.shape[0]
        failure = self._first_failure(n)
        if failure is not None:
            stage, rows_left, text = failure
            seen = "" if rows_left == n else f" on the {rows_left} rows left by the pre-aggregators"
            who = stage.name if self.label == stage.name else f"{self.label}: {stage.name}"  # a bare rule once
            raise ValueError(
                f"{who} requires {text}{seen}, got n={n} with f={self.f}; this pipeline needs n >= {self.min_n()}"
            )
        row_weights = self._check_weights(weights, n, x.device)
        keys = self._check_clients(clients, n)
        basis = Basis(
            x,
            extras=self.rule.extra_vectors(x),
            augmented=any(not p.affine or p.needs_norms for p in self.pre),
            chunk_size=self.rule.chunk_size,
            owner=self.label,
            f=self.f,
        )
        rows = Rows(basis)
        self.last_filtered = ()
        self.last_filtered_by = {}
        self.last_excluded = ()
        self.rule.last_excluded = ()
        rows_are_inputs = True  # until a stage mixes rows (or writes new ones), each row is one input row
        sources: list[int] | None = list(range(n))  # the input row each row stands for, while one does
        f_left = self.f  # lowered by filters that take Byzantine rows out for certain (dedup's lower_f)
        for stage in self.pre:
            if stage.uses_clients:
                stage.set_clients(None if keys is None or sources is None else [keys[i] for i in sources])
            with _tolerating(stage, f_left):
                rows = stage.apply(rows)
            if isinstance(stage, RowFilter):
                f_left = max(0, f_left - stage.byzantine_dropped())
                if sources is not None and stage.last_kept is not None:
                    sources = [sources[i] for i in stage.last_kept.tolist()]
            elif not stage.keeps_rows:
                sources = None
            rows_are_inputs = rows_are_inputs and rows.mix is None and rows.basis.x is x
            if rows_are_inputs and rows.index is not None:
                kept = set(rows.index.tolist())
                self.last_filtered = tuple(i for i in range(n) if i not in kept)
                for i in self.last_filtered:
                    self.last_filtered_by.setdefault(i, stage.name)
        self.last_f = f_left
        with _tolerating(self.rule, f_left):
            out = self.rule.aggregate(rows, row_weights)
        for stage in self.pre:
            stage.observe(out)
        if rows_are_inputs and self.rule.last_excluded:
            inputs = range(n) if rows.index is None else rows.index.tolist()
            self.last_excluded = tuple(sorted(inputs[i] for i in self.rule.last_excluded))
        if not basis.validated:
            basis.check_finite()
        logger.debug("%s: n=%d d=%d %s in %.3f s", self.label, n, x.shape[1], x.dtype, time.perf_counter() - started)
        return out.to(x.dtype)

    def _check_updates(self, updates: object) -> Tensor:
        where = f"{self.label} (f={self.f})"
        if not isinstance(updates, Tensor):
            raise ValueError(f"{where}: expected a torch.Tensor of shape [n, d], got {type(updates).__name__}")
        if updates.dim() != 2:
            raise ValueError(
                f"{where}: expected a 2-D tensor [n, d] with one flattened update per row, got shape "
                f"{tuple(updates.shape)}"
            )
        n, d = updates.shape
        if n == 0 or d == 0:
            raise ValueError(
                f"{self.label}: empty input of shape ({n}, {d}) with f={self.f}; requires n >= {self.min_n()} "
                "rows and d >= 1 coordinates"
            )
        if not updates.is_floating_point():
            raise ValueError(
                f"{self.label}: expected a floating-point tensor, got {describe_dtype(updates)} (n={n}, f={self.f})"
            )
        return updates.detach()

    def _check_clients(self, clients: Sequence[int] | None, n: int) -> list[int] | None:
        if clients is None:
            return None
        keys = list(clients)
        if len(keys) != n or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in keys):
            raise ValueError(
                f"{self.label}: clients must be {n} non-negative integer ids, one per row, got {keys[:5]!r}"
                + (" ..." if len(keys) > 5 else "")
            )
        if len(set(keys)) != n:
            raise ValueError(f"{self.label}: clients must be distinct, one per row; got repeats in {keys!r}")
        return keys

    def _check_weights(self, weights: Tensor | None, n: int, device: torch.device) -> Tensor | None:
        if weights is None:
            return None
        if not self.supports_weights:
            raise ValueError(
                f"{self.label}: per-row weights are not supported (n={n}, f={self.f}); only mean uses them, "
                "and only without pre-aggregators that regroup rows"
            )
        w = torch.as_tensor(weights)
        if w.shape != (n,):
            raise ValueError(f"{self.label}: weights must have shape ({n},) to match n={n}, got {tuple(w.shape)}")
        w = w.to(device=device, dtype=torch.float64)
        if not bool(torch.isfinite(w).all()) or bool((w < 0).any()) or not bool(w.sum() > 0):
            raise ValueError(f"{self.label}: weights must be finite and >= 0 with a positive sum (n={n}, f={self.f})")
        return w

    def state_dict(self) -> dict[str, Tensor]:
        """State to checkpoint: the rule's keys as they are, each pre-aggregator's under ``pre.<i>.``."""
        state = dict(self.rule.state_dict())
        for i, stage in enumerate(self.pre):
            state.update({f"pre.{i}.{key}": value for key, value in stage.state_dict().items()})
        return state

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Restore a :meth:`state_dict`; unknown keys raise ``ValueError``."""
        own: dict[str, Tensor] = {}
        per_stage: list[dict[str, Tensor]] = [{} for _ in self.pre]
        for key, value in state.items():
            head, _, rest = key.partition(".")
            index, _, sub = rest.partition(".")
            if head == "pre" and index.isdigit() and int(index) < len(self.pre) and sub:
                per_stage[int(index)][sub] = value
            else:
                own[key] = value
        self.rule.load_state_dict(own)
        for stage, stage_state in zip(self.pre, per_stage, strict=True):
            stage.load_state_dict(stage_state)
