"""Distance-based selection: Krum and Multi-Krum (Blanchard et al., NeurIPS 2017)."""

from __future__ import annotations

import torch
from torch import Tensor

from fedrobust.aggregators._registry import register_rule
from fedrobust.aggregators.base import Rule, check_optional_int
from fedrobust.aggregators.rows import Rows

__all__ = ["Krum", "MultiKrum", "krum_order", "krum_scores"]


def krum_scores(dist: Tensor, f: int) -> Tensor:
    """Krum score of every row: the sum of squared distances to its ``m - f - 2`` nearest other rows.

    Parameters
    ----------
    dist : Tensor
        ``[m, m]`` squared distances.
    f : int
        Number of Byzantine rows.

    Returns
    -------
    Tensor
        ``[m]`` scores; the neighbour count is clamped to ``[1, m - 1]`` so that the small sets of
        Bulyan's last selection rounds still get a score.
    """
    m = dist.shape[0]
    if m == 1:
        return torch.zeros(1, dtype=dist.dtype, device=dist.device)
    k = min(max(m - f - 2, 1), m - 1)
    others = dist + torch.diag(torch.full((m,), float("inf"), dtype=dist.dtype, device=dist.device))
    return others.sort(dim=1).values[:, :k].sum(dim=1)


def krum_order(dist: Tensor, f: int) -> Tensor:
    """Row indices from the best Krum score to the worst.

    Exact ties are systematic, not rare: with one neighbour, two mutual nearest rows share a score.
    They go to the row with the smaller total distance to all rows, and only then to the lower
    index, so the choice does not depend on the order in which clients replied.
    """
    scores = krum_scores(dist, f)
    by_total = torch.sort(dist.sum(dim=1), stable=True).indices
    return by_total[torch.sort(scores[by_total], stable=True).indices]


@register_rule
class Krum(Rule):
    """Krum: the row with the smallest sum of squared distances to its ``n - f - 2`` nearest rows.

    Distances come from a centered Gram matrix (see :mod:`fedrobust.aggregators.rows`), so the
    selection is unchanged when a constant offset is added to every row.
    """

    name = "krum"

    def requirement(self) -> tuple[int, str]:
        return 2 * self.f + 3, "n >= 2f+3"

    def aggregate(self, rows: Rows, weights: Tensor | None) -> Tensor:
        choice = torch.zeros(rows.m, dtype=torch.float64, device=rows.device)
        choice[krum_order(rows.sq_distances(), self.f)[0]] = 1.0
        return self.combine_kept(rows, choice)


@register_rule
class MultiKrum(Rule):
    """Multi-Krum: the mean of the ``m`` rows with the best Krum scores.

    Parameters
    ----------
    f : int
        Number of Byzantine rows.
    m : int or None
        Rows to average; ``None`` means ``n - f``.
    chunk_size : int or None
        Coordinates per pass.
    """

    name = "multikrum"

    def __init__(self, f: int = 0, *, m: int | None = None, chunk_size: int | None = None) -> None:
        super().__init__(f, chunk_size=chunk_size)
        self.m = check_optional_int(self.name, "m", m, minimum=1)

    def requirement(self) -> tuple[int, str]:
        if self.m is not None and self.m > 2 * self.f + 3:
            return self.m, f"n >= m = {self.m}"
        return 2 * self.f + 3, "n >= 2f+3"

    def aggregate(self, rows: Rows, weights: Tensor | None) -> Tensor:
        count = rows.m - self.f if self.m is None else self.m
        chosen = krum_order(rows.sq_distances(), self.f)[:count]
        share = torch.zeros(rows.m, dtype=torch.float64, device=rows.device)
        share[chosen] = 1.0 / count
        return self.combine_kept(rows, share)
