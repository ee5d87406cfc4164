"""Divide-and-Conquer (Shejwalkar & Houmansadr, NDSS 2021): spectral outlier removal on random coordinates."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import torch
from torch import Tensor

from fedrobust.aggregators._registry import register_rule
from fedrobust.aggregators.base import Rule, check_float, check_int
from fedrobust.aggregators.rows import Rows

__all__ = ["DivideAndConquer"]

logger = logging.getLogger(__name__)


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

    def aggregate(self, rows: Rows, weights: Tensor | None) -> Tensor:
        m, d = rows.m, rows.d
        basis = rows.basis
        coef = rows.coefficients()
        dropped = torch.zeros(m, dtype=torch.int64, device=rows.device)
        for _ in range(self.niters):
            if self.sub_dim >= d:
                columns = torch.arange(d)
            else:
                columns = torch.randperm(d, generator=self.generator)[: self.sub_dim].sort().values
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
        survivors = dropped == 0
        if not bool(survivors.any()):
            survivors = dropped == dropped.min()
        logger.debug("dnc: kept %d of %d rows", int(survivors.sum()), m)
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
