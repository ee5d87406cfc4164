"""SignGuard (Xu et al., ICDCS 2022): norm filtering and sign-statistics clustering, then a clipped mean."""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from fedrobust.aggregators._registry import register_rule
from fedrobust.aggregators._similarity import ZeroExtra, clip_scales, inner_products, majority, two_means
from fedrobust.aggregators.base import Rule, check_float
from fedrobust.aggregators.rows import Rows

__all__ = ["SignGuard"]

logger = logging.getLogger(__name__)


@register_rule
class SignGuard(ZeroExtra, Rule):
    """SignGuard: keep rows that pass a norm filter and fall in the majority sign cluster.

    1. Norm filter: with ``M`` the median row norm, keep rows with ``lower <= ||x_i|| / M <= upper``.
    2. Sign clustering: each row's features are the fractions of its positive, negative and zero
       coordinates; rows are split into two clusters and the larger one is kept.
    3. The output is the mean of the rows kept by both filters, each clipped to norm ``M``.

    The paper clusters with mean-shift on the sign fractions of a random coordinate subset. Here the
    fractions are taken over all coordinates (one extra pass over the data, no sampling noise) and
    the clustering is a deterministic 2-means (:func:`~fedrobust.aggregators._similarity.two_means`,
    farthest-pair start): no bandwidth to tune and no random draw. Unlike mean-shift, 2-means always
    splits, so the split is used only when the two cluster centers are at least ``min_gap`` apart
    (in fractions of coordinates); otherwise every row is in one cluster. Equal-sized clusters keep
    every row (no majority exists). Should the two filters leave no row in common, the norm filter's
    rows are used. ``min_gap=0`` always splits, as Blades' k-means version does.

    Parameters
    ----------
    f : int
        Number of Byzantine rows (the majority cluster is honest only for ``n >= 2f + 1``).
    lower, upper : float
        Bounds of ``||x_i|| / M`` that pass the norm filter (the paper's ``L = 0.1`` and ``R = 3``).
    min_gap : float
        Smallest distance between the two sign-cluster centers for the split to be used.
    chunk_size : int or None
        Coordinates per pass.

    References
    ----------
    Xu, Huang, Song, Lai. "SignGuard: Byzantine-robust Federated Learning through Collaborative Malicious
    Gradient Filtering." ICDCS 2022.
    """

    name = "signguard"

    def __init__(
        self,
        f: int = 0,
        *,
        lower: float = 0.1,
        upper: float = 3.0,
        min_gap: float = 0.05,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__(f, chunk_size=chunk_size)
        self.lower = check_float(self.name, "lower", lower, inclusive=True, maximum=1.0)
        self.upper = check_float(self.name, "upper", upper, minimum=1.0, inclusive=True)
        self.min_gap = check_float(self.name, "min_gap", min_gap, inclusive=True)

    def requirement(self) -> tuple[int, str]:
        return 2 * self.f + 1, "n >= 2f+1"

    def aggregate(self, rows: Rows, weights: Tensor | None) -> Tensor:
        norms = inner_products(rows).diagonal().clamp(min=0).sqrt()
        median = torch.quantile(norms, 0.5)
        if bool(median > 0):
            ratio = norms / median
            by_norm = (ratio >= self.lower) & (ratio <= self.upper)
        else:
            by_norm = norms == 0  # at least half of the rows are zero: keep those
        by_sign = majority(self._sign_labels(rows))
        kept = by_norm & by_sign
        if not bool(kept.any()):
            kept = by_norm
        logger.debug(
            "signguard: %d of %d rows pass the norm filter, %d the sign filter, %d both",
            int(by_norm.sum()), rows.m, int(by_sign.sum()), int(kept.sum()),
        )
        share = torch.where(kept, clip_scales(norms, median), 0.0) / int(kept.sum())
        return self.combine_kept(rows, share)

    def _sign_labels(self, rows: Rows) -> Tensor:
        """2-means labels of the rows' (positive, negative, zero) coordinate fractions."""
        positive = torch.zeros(rows.m, dtype=torch.int64, device=rows.device)
        negative = torch.zeros_like(positive)
        for _, _, chunk in rows.chunks(reuse=True):
            positive += (chunk > 0).sum(dim=1)
            negative += (chunk < 0).sum(dim=1)
        features = torch.stack([positive, negative, rows.d - positive - negative], dim=1).to(torch.float64) / rows.d
        labels = two_means(features)
        if bool(labels.any()) and not bool(labels.all()):
            gap = torch.linalg.vector_norm(features[labels == 0].mean(dim=0) - features[labels == 1].mean(dim=0))
            if float(gap) < self.min_gap:
                labels = torch.zeros_like(labels)
        return labels
