"""Base classes of robust rules and pre-aggregators, and their parameter checks.

A component is configured once (``f`` and keyword parameters, validated up front as scikit-learn
estimators do) and then works on :class:`~fedrobust.aggregators.rows.Rows`, the lazy view of the
stacked client updates. Rules reduce rows to one vector; pre-aggregators map rows to new rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

if TYPE_CHECKING:
    from fedrobust.aggregators.rows import Rows

__all__ = ["Component", "PreAggregator", "Rule", "RowFilter", "check_float", "check_int", "check_optional_int"]


def check_int(owner: str, name: str, value: object, *, minimum: int) -> int:
    """Return ``value`` if it is an int ``>= minimum``, else raise ``ValueError`` naming ``owner``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: parameter {name} must be an integer >= {minimum}, got {value!r}")
    return value


def check_optional_int(owner: str, name: str, value: object, *, minimum: int) -> int | None:
    """Like :func:`check_int` but also accepts ``None``."""
    return None if value is None else check_int(owner, name, value, minimum=minimum)


def check_float(
    owner: str, name: str, value: object, *, minimum: float = 0.0, inclusive: bool = False, maximum: float | None = None
) -> float:
    """Return ``value`` as float if it is a finite real number in range, else raise ``ValueError``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    number = float(value) if ok else float("nan")  # type: ignore[arg-type]
    in_range = (number >= minimum if inclusive else number > minimum) and (maximum is None or number <= maximum)
    if not (ok and in_range and number != float("inf")):
        bound = f"{'>=' if inclusive else '>'} {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
        raise ValueError(f"{owner}: parameter {name} must be a finite number {bound}, got {value!r}")
    return number


class Component:
    """Common part of rules and pre-aggregators: the name, ``f`` and the requirement on ``n``.

    Parameters
    ----------
    f : int
        Number of Byzantine rows the component must tolerate (``>= 0``).
    """

    name: ClassVar[str]

    def __init__(self, f: int) -> None:
        if isinstance(f, bool) or not isinstance(f, int) or f < 0:
            raise ValueError(f"{self.name}: f must be an integer >= 0, got f={f!r}")
        self.f = f

    def requirement(self) -> tuple[int, str]:
        """Smallest number of input rows and the rule behind it, e.g. ``(5, "n >= 2f+3")``."""
        return 1, "n >= 1"

    def min_n(self) -> int:
        """Smallest number of input rows this component accepts for its ``f``."""
        return self.requirement()[0]

    def state_dict(self) -> dict[str, Tensor]:
        """Tensors that must survive a restart; empty for stateless components."""
        return {}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Restore what :meth:`state_dict` returned; stateless components accept only ``{}``."""
        if state:
            raise ValueError(f"{self.name}: stateless, cannot load state keys {sorted(state)}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(f={self.f})"


class Rule(Component):
    """A robust aggregation rule: ``m`` rows in, one vector out.

    Parameters
    ----------
    f : int
        Number of Byzantine rows to tolerate.
    chunk_size : int or None
        Coordinates processed per pass over the data; ``None`` picks a size that keeps temporary
        buffers at a few MiB. Results do not depend on it beyond floating-point rounding.
    """

    supports_weights: ClassVar[bool] = False
    needs_server_update: ClassVar[bool] = False
    """The rule needs the server's own update of the round before each call (FLTrust)."""
    last_excluded: tuple[int, ...] = ()
    """Rows of the last call's input that the rule gave no weight (rules that select rows: Krum, DnC,
    SignGuard, ...); ``()`` for rules that weigh every row or reduce each coordinate on its own."""

    def __init__(self, f: int, *, chunk_size: int | None = None) -> None:
        super().__init__(f)
        self.chunk_size = check_optional_int(self.name, "chunk_size", chunk_size, minimum=1)

    def set_server_update(self, vector: Tensor) -> None:
        """Give the server's own ``[d]`` update for the next call (rules with ``needs_server_update`` only)."""
        raise ValueError(f"{self.name}: this rule takes no server update")

    def extra_vectors(self, like: Tensor) -> list[Tensor]:
        """Vectors other than the rows whose distances to the rows the rule needs (e.g. a center)."""
        return []

    def aggregate(self, rows: Rows, weights: Tensor | None) -> Tensor:
        """Reduce ``rows`` to a ``[d]`` tensor in the rows' compute dtype."""
        raise NotImplementedError

    def combine_kept(self, rows: Rows, share: Tensor) -> Tensor:
        """``rows.combine(share)`` for a rule that selects rows, noting the rows of share 0 as excluded."""
        self.last_excluded = tuple(torch.nonzero(share == 0).flatten().tolist())
        return rows.combine(share)


class PreAggregator(Component):
    """A pre-aggregator: a data-dependent linear map from ``m`` rows to ``m'`` rows.

    Attributes
    ----------
    keeps_rows : bool
        Output row ``i`` still stands for input row ``i`` (so per-row weights keep their meaning).
    affine : bool
        Every output row is an affine combination (coefficients summing to one) of the inputs,
        which keeps distances translation-invariant and lets them be computed from centered data.
    needs_norms : bool
        The stage reads the rows' norms or inner products, not only distances between them.
    uses_clients : bool
        The stage keeps something per client across calls, and takes the clients of its rows through
        :meth:`set_clients` before each :meth:`apply`.
    """

    keeps_rows: ClassVar[bool] = True
    affine: ClassVar[bool] = True
    needs_norms: ClassVar[bool] = False
    uses_clients: ClassVar[bool] = False

    def set_clients(self, clients: Sequence[int] | None) -> None:
        """The client of each row of the next :meth:`apply` (stable ids), or ``None`` when unknown."""

    def out_rows(self, n: int) -> int:
        """Number of rows produced from ``n`` input rows (the fewest, for a stage that drops rows)."""
        return n

    def apply(self, rows: Rows) -> Rows:
        """Return the transformed rows (lazily; the data is not touched)."""
        raise NotImplementedError

    def observe(self, aggregate: Tensor) -> None:
        """The pipeline's output of the call that just ended (``[d]``); a stage that keeps it overrides this."""


class RowFilter(PreAggregator):
    """A pre-aggregator that drops rows: at most ``f``, and never below ``2f + 1`` rows.

    The ``f`` Byzantine rows the stages after it still assume then stay a minority of what is left. The
    rows kept pass on unchanged (a selection, no copy) and are named in ``last_kept``, so the pipeline
    can say which replies were left out and whose rows the next stages see. Subclasses implement
    :meth:`choose`.
    """

    keeps_rows = False
    last_kept: Tensor | None = None
    """The input rows the last call kept (int64, ascending); ``None`` when it kept every row."""
    last_dropped: int = 0
    """How many rows the last call dropped."""

    def requirement(self) -> tuple[int, str]:
        return 2 * self.f + 1, "n >= 2f+1"

    def out_rows(self, n: int) -> int:
        return max(n - self.f, min(n, 2 * self.f + 1))

    def choose(self, rows: Rows, budget: int) -> Tensor:
        """The rows to drop (int64 indices, at most ``budget``; ``budget`` may be 0 or less)."""
        raise NotImplementedError

    def byzantine_dropped(self) -> int:
        """How many of the rows the last call dropped are known to take a Byzantine row out.

        The stages after the filter then tolerate that many Byzantine rows fewer. 0 here: a filter that
        drops rows by suspicion cannot tell an honest row it dropped from a Byzantine one.
        """
        return 0

    def apply(self, rows: Rows) -> Rows:
        m = rows.m
        dropped = self.choose(rows, min(self.f, m - self.out_rows(m)))
        self.last_kept = None
        self.last_dropped = dropped.numel()
        if dropped.numel() == 0:
            return rows
        keep = torch.ones(m, dtype=torch.bool, device=dropped.device)
        keep[dropped] = False
        self.last_kept = torch.nonzero(keep).flatten()
        return rows.select(self.last_kept)


def describe_dtype(t: Tensor) -> str:
    """Short dtype name for messages (``float32`` rather than ``torch.float32``)."""
    return str(t.dtype).removeprefix("torch.")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Reductions run in float64 for float64 input and in float32 for every narrower float."""
    return torch.float64 if dtype == torch.float64 else torch.float32
