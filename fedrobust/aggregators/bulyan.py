"""Bulyan (El Mhamdi et al., ICML 2018): Krum-based selection, then a coordinate-wise trimmed average."""

from __future__ import annotations

import torch
from torch import Tensor

from fedrobust.aggregators._order import closest_mean
from fedrobust.aggregators._registry import register_rule
from fedrobust.aggregators.base import Rule
from fedrobust.aggregators.distance import krum_order
from fedrobust.aggregators.rows import Rows

__all__ = ["Bulyan"]


@register_rule
class Bulyan(Rule):
    """Bulyan over Krum.

    1. Select ``theta = n - 2f`` rows by applying Krum repeatedly to the rows not yet selected.
    2. Per coordinate, average the ``beta = theta - 2f`` selected values closest to their median.

    Needs ``n >= 4f + 3``.
    """

    name = "bulyan"

    def requirement(self) -> tuple[int, str]:
        return 4 * self.f + 3, "n >= 4f+3"

    def aggregate(self, rows: Rows, weights: Tensor | None) -> Tensor:
        theta = rows.m - 2 * self.f
        dist = rows.sq_distances()
        remaining = list(range(rows.m))
        selected: list[int] = []
        for _ in range(theta):
            index = torch.tensor(remaining, device=dist.device)
            best = int(krum_order(dist[index][:, index], self.f)[0])
            selected.append(remaining.pop(best))
        chosen = torch.tensor(sorted(selected), dtype=torch.int64, device=rows.device)
        self.last_excluded = tuple(remaining)
        return closest_mean(rows.select(chosen), theta - 2 * self.f)
