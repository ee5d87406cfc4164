"""Pre-aggregators that map rows to rows: NNM, bucketing, static clipping, ARC and winsorizing.

The stages that drop rows are in :mod:`fedrobust.aggregators.filters`.

All but winsorizing return new rows as a linear map of their input rows (see
:mod:`fedrobust.aggregators.rows`), so a chain of them costs no pass over the ``[n, d]`` data beyond the
Gram matrix it needs. Winsorizing clamps values, which no linear map does: it writes its rows out, one
``[n, d]`` copy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from fedrobust.aggregators._order import window_bounds
from fedrobust.aggregators._registry import register_pre
from fedrobust.aggregators.base import PreAggregator, check_float, check_int
from fedrobust.aggregators.rows import Basis, Rows

__all__ = [
    "AdaptiveRobustClipping",
    "Bucketing",
    "Clipping",
    "CoordinateWinsorizing",
    "NearestNeighborMixing",
]


def _scale_rows(rows: Rows, scale: Tensor) -> Rows:
    return rows.transform(torch.diag(scale), affine=False)


@register_pre
class NearestNeighborMixing(PreAggregator):
    """NNM (Allouah et al., AISTATS 2023): each row becomes the mean of its ``n - f`` nearest rows.

    The row itself counts as one of them (ties in distance go to the lower index after it).
    Needs ``n >= 2f + 1``.
    """

    name = "nnm"

    def requirement(self) -> tuple[int, str]:
        return 2 * self.f + 1, "n >= 2f+1"

    def apply(self, rows: Rows) -> Rows:
        m, k = rows.m, rows.m - self.f
        dist = rows.sq_distances()
        dist.fill_diagonal_(-1.0)  # the row itself first, even when another row coincides with it
        nearest = torch.sort(dist, dim=1, stable=True).indices[:, :k]
        mix = torch.zeros(m, m, dtype=torch.float64, device=rows.device)
        mix.scatter_(1, nearest, 1.0 / k)
        return rows.transform(mix, affine=True)


@register_pre
class Bucketing(PreAggregator):
    """Bucketing (Karimireddy et al., ICLR 2022): shuffle, split into buckets of ``s`` rows, average each.

    ``ceil(n / s)`` rows come out (the last bucket may be smaller). The shuffle draws from a
    generator seeded with ``seed`` once; it advances with every call and its state is part of
    :meth:`state_dict`, so a run replays the same shuffles, also across a restart.

    Parameters
    ----------
    f : int
        Number of Byzantine rows (the rule after bucketing still uses ``f``).
    s : int
        Bucket size.
    seed : int
        Seed of the shuffling generator.
    """

    name = "bucketing"
    keeps_rows = False

    def __init__(self, f: int = 0, *, s: int = 2, seed: int = 0) -> None:
        super().__init__(f)
        self.s = check_int(self.name, "s", s, minimum=1)
        self.seed = check_int(self.name, "seed", seed, minimum=0)
        self.generator = torch.Generator(device="cpu").manual_seed(self.seed)

    def out_rows(self, n: int) -> int:
        return math.ceil(n / self.s)

    def apply(self, rows: Rows) -> Rows:
        m = rows.m
        order = torch.randperm(m, generator=self.generator)
        bucket = torch.arange(m) // self.s
        sizes = torch.bincount(bucket).to(torch.float64)
        mix = torch.zeros(self.out_rows(m), m, dtype=torch.float64)
        mix[bucket, order] = 1.0 / sizes[bucket]
        return rows.transform(mix.to(rows.device), affine=True)

    def state_dict(self) -> dict[str, Tensor]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        unknown = sorted(set(state) - {"generator"})
        if unknown:
            raise ValueError(f"{self.name}: unknown state keys {unknown}; valid keys: generator")
        if "generator" in state:
            self.generator.set_state(state["generator"].to(device="cpu", dtype=torch.uint8))


@register_pre
class Clipping(PreAggregator):
    """Static clipping: rows with a norm above ``threshold`` are scaled down to norm ``threshold``.

    Parameters
    ----------
    f : int
        Unused by the map itself; kept for the pipeline.
    threshold : float
        Largest allowed L2 norm of a row.
    """

    name = "clipping"
    affine = False

    def __init__(self, f: int = 0, *, threshold: float) -> None:
        super().__init__(f)
        self.threshold = check_float(self.name, "threshold", threshold)

    def apply(self, rows: Rows) -> Rows:
        norms = rows.sq_norms().sqrt()
        return _scale_rows(rows, (self.threshold / norms).clamp(max=1.0))


@register_pre
class AdaptiveRobustClipping(PreAggregator):
    """ARC (Allouah et al., 2024, "The Vital Role of Gradient Clipping in Byzantine-Resilient ...").

    With ``k = floor(2 (f / n) (n - f))``, the ``k`` rows of largest norm are clipped to the norm
    of the ``(k+1)``-th largest. Needs ``n >= 2f + 1``.
    """

    name = "arc"
    affine = False

    def requirement(self) -> tuple[int, str]:
        return 2 * self.f + 1, "n >= 2f+1"

    def apply(self, rows: Rows) -> Rows:
        m = rows.m
        k = (2 * self.f * (m - self.f)) // m  # integer arithmetic: the floor is exact
        if k == 0:
            return rows
        norms = rows.sq_norms().sqrt()
        threshold = torch.sort(norms, descending=True).values[k]
        return _scale_rows(rows, (threshold / norms).clamp(max=1.0))


@register_pre
class CoordinateWinsorizing(PreAggregator):
    """Per coordinate, values beyond the ``f+1``-th smallest or largest are clamped to them.

    The values a coordinate-wise trimmed mean would drop are pulled in to the edge of what it keeps,
    in every row, before a stage that mixes rows (NNM, bucketing) can spread them: a few replies that
    alone move some coordinates far (a backdoor's trigger weights, which honest clients leave near
    zero) no longer pass them on. Rows keep their place and their other coordinates. Needs ``n >= 2f + 1``;
    with ``f = 0`` the rows pass unchanged.

    Both bounds come from one order-statistic pass. On the input rows (in front of the pipeline, as in
    ``winsorize+nnm+trimmed_mean``) or a subset of them (after the filters, as in the default) nothing
    is written: later stages read the input through the bounds. After a stage that mixes rows, the
    clamped rows are written once, as an ``[n, d]`` copy.
    """

    name = "winsorize"
    affine = False

    def requirement(self) -> tuple[int, str]:
        return 2 * self.f + 1, "n >= 2f+1"

    def apply(self, rows: Rows) -> Rows:
        if self.f == 0:
            return rows
        m = rows.m
        bounds = window_bounds(rows, self.f, m - self.f)  # [2, d]: the f+1-th smallest and largest
        base = rows.basis
        if rows.mix is None:
            # The input rows themselves, or a subset of them: every later read clamps them on the fly, so no
            # [n, d] copy is written. Bounds already there are replaced, not stacked: these ones lie inside them.
            clamped = Basis(base.x, extras=base.extras, augmented=base.augmented, chunk_size=base.chunk_size,
                            bounds=bounds, owner=base.owner, f=base.f)
            clamped.validated = base.validated  # set once a pass (the bounds' own, over all rows) saw every value
            return Rows(clamped, index=rows.index)
        out = torch.empty((m, rows.d), dtype=rows.dtype, device=rows.device)
        for start, stop, chunk in rows.chunks(reuse=True):
            torch.clamp(chunk, bounds[0, start:stop], bounds[1, start:stop], out=out[:, start:stop])
        clamped = Basis(out, extras=base.extras, augmented=base.augmented, chunk_size=base.chunk_size,
                        owner=base.owner, f=base.f)
        clamped.validated = True  # the order statistics above passed over every value
        return Rows(clamped)
