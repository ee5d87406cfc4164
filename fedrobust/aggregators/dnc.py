"""Divide-and-Conquer (Shejwalkar & Houmansadr, NDSS 2021): spectral outlier removal on random coordinates."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import torch
from torch import Tensor

from fedrobust.aggregators._registry import register_pre, register_rule
from fedrobust.aggregators.base import RowFilter, Rule, check_float, check_int
from fedrobust.aggregators.rows import Rows

__all__ = ["DivideAndConquer", "DivideAndConquerFilter"]

logger = logging.getLogger(__name__)


def sample_columns(d: int, k: int, generator: torch.Generator) -> Tensor:
    """``min(k, d)`` distinct coordinates of ``d``, uniformly at random, ascending.

    A permutation of all ``d`` coordinates costs 0.4 s at d = 11.2M for a subset of 10,000. Where the
    subset is small against ``d``, draw coordinates with replacement and keep the distinct ones: given how
    many there are, they are a uniform subset (the procedure treats every coordinate alike), and a uniform
    ``k`` of them is a uniform ``k``-subset of ``d``. Deterministic for a generator state.
    """
    if k >= d:
        return torch.arange(d)
    if 4 * k >= d:
        return torch.randperm(d, generator=generator)[:k].sort().values
    # k^2 / 2d duplicates are expected (4.5 at k = 10,000, d = 11.2M): the margin makes one draw enough.
    distinct = torch.unique(torch.randint(d, (k + k // 8 + 16,), generator=generator))
    while distinct.numel() < k:
        distinct = torch.unique(torch.cat([distinct, torch.randint(d, (k,), generator=generator)]))
    if distinct.numel() > k:
        distinct = distinct[torch.randperm(distinct.numel(), generator=generator)[:k]].sort().values
    return distinct


@register_rule
class DivideAndConquer(Rule):
    """DnC: drop the rows that stand out along the top singular direction of random coordinate subsets.

    Each of ``niters`` iterations draws ``sub_dim`` coordinates without replacement, centres the rows
    restricted to them, and scores every row by its squared projection on the top right singular
    vector of that centred ``[m, sub_dim]`` matrix. The ``floor(c * f)`` rows with the highest scores
    are dropped; a row survives if no iteration dropped it, and the output is the mean of the
    survivors. Should the iterations together drop every row (possible only when
    ``niters * c * f >= m``), the rows dropped in the fewest iterations are averaged instead.

    The scores come from the ``m x m`` Gram matrix of the sub-matrix: with ``u`` its top eigenvector
    and ``lambda`` its eigenvalue, row ``i``'s projection on the singular vector is
    ``sqrt(lambda) * u_i``, so no ``sub_dim``-sized singular vector is formed.

    The coordinates are drawn from a CPU generator seeded with ``seed`` once; it advances with every
    call and its state is part of :meth:`state_dict`, so a run replays the same draws, also across a
    restart. The draws do not depend on the data, so the rule is translation equivariant.

    Parameters
    ----------
    f : int
        Number of Byzantine rows (needs ``n >= 2f + 1`` and more rows than are dropped).
    niters : int
        Number of random coordinate subsets.
    sub_dim : int
        Coordinates per subset; all coordinates when the updates have fewer.
    c : float
        Filtering fraction: ``floor(c * f)`` rows are dropped per iteration.
    seed : int
        Seed of the coordinate-sampling generator.
    chunk_size : int or None
        Coordinates per pass of the final mean.

    References
    ----------
    Shejwalkar, Houmansadr. "Manipulating the Byzantine: Optimizing Model Poisoning Attacks and Defenses for
    Federated Learning." NDSS 2021.
    """

    name = "dnc"

    def __init__(
        self,
        f: int = 0,
        *,
        niters: int = 5,
        sub_dim: int = 10_000,
        c: float = 1.0,
        seed: int = 0,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__(f, chunk_size=chunk_size)
        self.niters = check_int(self.name, "niters", niters, minimum=1)
        self.sub_dim = check_int(self.name, "sub_dim", sub_dim, minimum=1)
        self.c = check_float(self.name, "c", c, inclusive=True)
        self.seed = check_int(self.name, "seed", seed, minimum=0)
        self.generator = torch.Generator(device="cpu").manual_seed(self.seed)

    @property
    def removed(self) -> int:
        """Rows dropped per iteration, ``floor(c * f)``."""
        return math.floor(self.c * self.f + 1e-9)  # the tolerance absorbs c * f just below an integer

    def requirement(self) -> tuple[int, str]:
        if self.removed + 1 > 2 * self.f + 1:
            return self.removed + 1, f"n >= floor(c*f)+1 = {self.removed + 1}"
        return 2 * self.f + 1, "n >= 2f+1"

    def drop_counts(self, rows: Rows) -> tuple[Tensor, Tensor]:
        """``[m]`` int64: in how many of the ``niters`` iterations each row was among the dropped, and
        ``[m]`` float64: its scores summed over the iterations, each divided by that iteration's largest."""
        m, d = rows.m, rows.d
        basis = rows.basis
        coef = rows.coefficients()
        dropped = torch.zeros(m, dtype=torch.int64, device=rows.device)
        total = torch.zeros(m, dtype=torch.float64, device=rows.device)
        for _ in range(self.niters):
            columns = sample_columns(d, self.sub_dim, self.generator)
            sub = coef @ basis.columns(columns.to(rows.device)).to(torch.float64)
            if not bool(torch.isfinite(sub).all()):
                basis.check_finite()  # raises for non-finite input; otherwise float64 overflow of a mix
                raise basis.error("pre-aggregated rows overflow float64", "input entries must be below about 1e300")
            if self.removed == 0:
                continue
            centred = sub - sub.mean(dim=0)
            values, vectors = torch.linalg.eigh(centred @ centred.T)
            scores = values[-1].clamp(min=0) * vectors[:, -1].square()
            # Squared projections do not depend on the eigensolver's sign; stable: equal scores go by index.
            worst = torch.sort(scores, descending=True, stable=True).indices[: self.removed]
            dropped[worst] += 1
            total += scores / scores.max().clamp(min=torch.finfo(torch.float64).tiny)
        return dropped, total

    def aggregate(self, rows: Rows, weights: Tensor | None) -> Tensor:
        dropped, _ = self.drop_counts(rows)
        survivors = dropped == 0
        if not bool(survivors.any()):
            survivors = dropped == dropped.min()
        logger.debug("dnc: kept %d of %d rows", int(survivors.sum()), rows.m)
        share = survivors.to(torch.float64) / int(survivors.sum())
        return self.combine_kept(rows, share)

    def state_dict(self) -> dict[str, Tensor]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        unknown = sorted(set(state) - {"generator"})
        if unknown:
            raise ValueError(f"{self.name}: unknown state keys {unknown}; valid keys: generator")
        if "generator" in state:
            self.generator.set_state(state["generator"].to(device="cpu", dtype=torch.uint8))


@register_pre
class DivideAndConquerFilter(RowFilter):
    """DnC's spectral outlier removal in front of another rule: drop at most ``f`` rows, keep ``2f + 1``.

    The draws and scores are :class:`DivideAndConquer`'s (``niters`` random subsets of ``sub_dim``
    coordinates, ``floor(c * f)`` rows dropped per subset). The rows dropped in at least one subset
    leave, those dropped most often first (then by their summed scores), but never more than ``f`` and never
    below ``2f + 1`` rows, so the ``f`` Byzantine rows the rule after it assumes stay a minority of what
    is left. DnC finds attacks that shift many coordinates together along one direction (min-max,
    min-sum, Fang's attack on the trimmed mean, mimic's copies), which a coordinate-wise rule after it
    would otherwise trim only one side of; it also drops honest rows when there is no attack (c * f of
    them per subset), which the rule after it then does without. Needs ``n >= 2f + 1``.

    Parameters
    ----------
    f : int
        Most rows dropped.
    niters, sub_dim, c, seed :
        As for :class:`DivideAndConquer`.
    """

    name = "dnc"

    def __init__(self, f: int = 0, *, niters: int = 5, sub_dim: int = 10_000, c: float = 1.0, seed: int = 0) -> None:
        super().__init__(f)
        self.spectral = DivideAndConquer(f, niters=niters, sub_dim=sub_dim, c=c, seed=seed)

    def requirement(self) -> tuple[int, str]:
        return self.spectral.requirement()

    def choose(self, rows: Rows, budget: int) -> Tensor:
        counts, total = self.spectral.drop_counts(rows)  # drawn every call, so the draws do not depend on m
        budget = min(budget, int((counts > 0).sum()))
        if budget <= 0:
            return torch.empty(0, dtype=torch.int64, device=counts.device)
        # Most often dropped first; among those dropped equally often, the higher summed score (not the
        # lower index, which would make the choice depend on the order the replies came in).
        by_score = torch.sort(total, descending=True, stable=True).indices
        return by_score[torch.sort(counts[by_score], descending=True, stable=True).indices][:budget]

    def state_dict(self) -> dict[str, Tensor]:
        return self.spectral.state_dict()

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        self.spectral.load_state_dict(state)
