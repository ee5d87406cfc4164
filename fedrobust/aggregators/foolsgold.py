"""FoolsGold (Fung et al., RAID 2020): down-weight rows that are too similar to one another (sybils)."""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from fedrobust.aggregators._registry import register_rule
from fedrobust.aggregators._similarity import ZeroExtra, cosine_similarity, inner_products
from fedrobust.aggregators.base import Rule, check_float
from fedrobust.aggregators.rows import Rows

__all__ = ["FoolsGold", "foolsgold_weights"]

logger = logging.getLogger(__name__)

# The reference code caps rescaled weights at 0.99 so that the logit stays finite.
_LOGIT_CAP = 0.99


def foolsgold_weights(cos: Tensor, confidence: float = 1.0) -> Tensor:
    """FoolsGold's per-row weights in ``[0, 1]`` from the ``[m, m]`` cosine similarities.

    1. ``v_i = max_{j != i} cs_ij``.
    2. Pardoning: ``cs_ij *= max(0, v_i / v_j)`` where ``v_j > max(v_i, 0)``, so honest rows that merely
       resemble a sybil are not punished as one.
    3. ``alpha_i = 1 - max_{j != i} cs_ij``, clipped to ``[0, 1]`` and divided by its maximum.
    4. Logit: ``alpha_i = confidence * (ln(alpha_i / (1 - alpha_i)) + 0.5)`` (with ``alpha_i`` capped at
       0.99), clipped to ``[0, 1]``.

    When every weight is zero (every row has a perfect twin, e.g. all rows equal) the weights carry no
    information and all are set to 1.
    """
    m = cos.shape[0]
    if m < 2:
        return torch.ones(m, dtype=torch.float64, device=cos.device)
    eye = torch.eye(m, dtype=torch.bool, device=cos.device)
    cs = cos.masked_fill(eye, -torch.inf)
    v = cs.max(dim=1).values
    # Only rows j that resemble some row (v_j > 0) pardon; the factor is clamped at 0 so that a row
    # resembling nothing (v_i < 0) cannot turn a negative similarity into a positive one.
    pardons = (v[None, :] > v[:, None]) & (v[None, :] > 0)
    pardon = torch.where(pardons, (v[:, None] / v[None, :].clamp(min=1e-300)).clamp(min=0.0), 1.0)
    cs = cs * pardon.masked_fill(eye, 1.0)
    alpha = (1.0 - cs.max(dim=1).values).clamp(0.0, 1.0)
    top = alpha.max()
    if not bool(top > 0):
        return torch.ones(m, dtype=torch.float64, device=cos.device)
    alpha = (alpha / top).clamp(max=_LOGIT_CAP)
    logit = confidence * (torch.log(alpha / (1.0 - alpha)) + 0.5)  # log(0) = -inf clamps to 0 below
    return logit.nan_to_num(nan=0.0, posinf=1.0, neginf=0.0).clamp(0.0, 1.0)


@register_rule
class FoolsGold(ZeroExtra, Rule):
    """FoolsGold: the mean weighted by :func:`foolsgold_weights` of the rows' cosine similarities.

    Sybils that push the same poisoned direction send updates much more alike than honest clients with
    different data; their pairwise cosine similarity drives their weights to zero. The paper keeps,
    per client, the sum of its updates over all rounds and compares those histories. The rows reaching
    an aggregator carry no client identity (and their order changes between rounds), so this rule is
    the per-round, stateless version: it compares the current updates only. ``f`` does not enter the
    weights; it sets the usual requirement ``n >= 2f + 1``.

    Parameters
    ----------
    f : int
        Number of Byzantine rows.
    confidence : float
        The logit's scale (``kappa`` in the paper).
    chunk_size : int or None
        Coordinates per pass.

    References
    ----------
    Fung, Yoon, Beschastnikh. "The Limitations of Federated Learning in Sybil Settings." RAID 2020.
    """

    name = "foolsgold"

    def __init__(self, f: int = 0, *, confidence: float = 1.0, chunk_size: int | None = None) -> None:
        super().__init__(f, chunk_size=chunk_size)
        self.confidence = check_float(self.name, "confidence", confidence)

    def requirement(self) -> tuple[int, str]:
        return 2 * self.f + 1, "n >= 2f+1"

    def aggregate(self, rows: Rows, weights: Tensor | None) -> Tensor:
        alpha = foolsgold_weights(cosine_similarity(inner_products(rows)), self.confidence)
        logger.debug("foolsgold: weights %s", alpha.tolist())
        return self.combine_kept(rows, alpha / alpha.sum())
