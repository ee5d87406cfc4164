"""Coordinate-wise rules: median and trimmed mean."""

from __future__ import annotations

from torch import Tensor

from fedrobust.aggregators._order import window_mean
from fedrobust.aggregators._registry import register_rule
from fedrobust.aggregators.base import Rule, check_optional_int
from fedrobust.aggregators.rows import Rows

__all__ = ["Median", "TrimmedMean"]


@register_rule
class Median(Rule):
    """Coordinate-wise median (the mean of the two middle values for an even number of rows).

    Stays within the range of the honest values of every coordinate while ``n >= 2f + 1``.
    """

    name = "median"

    def requirement(self) -> tuple[int, str]:
        return 2 * self.f + 1, "n >= 2f+1"

    def aggregate(self, rows: Rows, weights: Tensor | None) -> Tensor:
        mid = rows.m // 2
        lo, hi = (mid, mid + 1) if rows.m % 2 else (mid - 1, mid + 1)
        return window_mean(rows, lo, hi)


@register_rule
class TrimmedMean(Rule):
    """Coordinate-wise trimmed mean: drop the ``trim`` largest and ``trim`` smallest values, average the rest.

    The kept values are summed directly (not as the total minus the extremes), so huge Byzantine
    values cannot cancel the honest ones in floating point.

    Parameters
    ----------
    f : int
        Number of Byzantine rows.
    trim : int or None
        Values cut at each end of every coordinate; ``None`` means ``f``. Cutting fewer than ``f`` keeps
        more honest values but lets up to ``f - trim`` Byzantine values per coordinate into the mean, so
        the rule alone is then no longer bounded by the honest range: use it behind a stage that bounds
        the values (``winsorize``).
    chunk_size : int or None
        Coordinates per pass.
    """

    name = "trimmed_mean"

    def __init__(self, f: int = 0, *, trim: int | None = None, chunk_size: int | None = None) -> None:
        super().__init__(f, chunk_size=chunk_size)
        self.trim = check_optional_int(self.name, "trim", trim, minimum=0)

    def requirement(self) -> tuple[int, str]:
        if self.trim is None:
            return 2 * self.f + 1, "n >= 2f+1"
        return max(2 * self.f + 1, 2 * self.trim + 1), f"n >= 2f+1 and n >= 2 trim + 1 = {2 * self.trim + 1}"

    def aggregate(self, rows: Rows, weights: Tensor | None) -> Tensor:
        cut = self.f if self.trim is None else self.trim
        return window_mean(rows, cut, rows.m - cut)
