"""Clipped clustering (Li et al., Blades): clip to the median norm, keep the larger cosine cluster."""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import Tensor

from fedrobust.aggregators._registry import register_rule
from fedrobust.aggregators._similarity import ZeroExtra, clip_scales, cosine_similarity, inner_products, majority
from fedrobust.aggregators.base import Rule
from fedrobust.aggregators.rows import Rows

__all__ = ["ClippedClustering", "average_linkage_two_clusters"]

logger = logging.getLogger(__name__)


def average_linkage_two_clusters(distance: Tensor) -> Tensor:
    """Labels 0/1 of the two clusters that average-linkage agglomeration of ``[m, m]`` distances leaves.

    SciPy's hierarchical clustering merges the closest clusters until two remain (``m >= 2``); with
    ``m < 2`` every label is 0.
    """
    # Imported here: scipy.cluster costs about 0.35 s of CPU in every process that imports the rules (each
    # simulated client, each ServerApp), and only this rule uses it.
    from scipy.cluster.hierarchy import fcluster, linkage
    from scipy.spatial.distance import squareform

    m = distance.shape[0]
    if m < 2:
        return torch.zeros(m, dtype=torch.int64, device=distance.device)
    matrix = distance.detach().cpu().numpy().astype(np.float64, copy=True)
    np.fill_diagonal(matrix, 0.0)
    tree = linkage(squareform(matrix, checks=False), method="average")
    labels = fcluster(tree, t=2, criterion="maxclust") - 1
    return torch.as_tensor(labels, dtype=torch.int64, device=distance.device)


@register_rule
class ClippedClustering(ZeroExtra, Rule):
    """Clipped clustering: clip every row to the median norm, split the rows in two by cosine distance, and
    average the larger cluster.

    The clustering is average-linkage agglomeration on ``1 - cos(x_i, x_j)`` stopped at two clusters,
    as in Blades. Clipping by a positive factor leaves the cosines unchanged, so they are computed
    once from the rows' Gram matrix. Blades takes the median over the norms of every round so far; this
    rule takes the median of the current round, so it keeps no state across calls. Equal-sized
    clusters keep every row (with fewer than half of the rows Byzantine, a split between them and the
    honest rows cannot be even). A zero row has cosine 0 with every row.

    Parameters
    ----------
    f : int
        Number of Byzantine rows (the larger cluster is honest only for ``n >= 2f + 1``).
    chunk_size : int or None
        Coordinates per pass.

    References
    ----------
    Li, Ai, Li, Li, Tang, Wang. "An Experimental Study of Byzantine-Robust Aggregation Schemes in
    Federated Learning." IEEE Transactions on Big Data, 2023.
    """

    name = "clipped_clustering"

    def requirement(self) -> tuple[int, str]:
        return 2 * self.f + 1, "n >= 2f+1"

    def aggregate(self, rows: Rows, weights: Tensor | None) -> Tensor:
        inner = inner_products(rows)
        norms = inner.diagonal().clamp(min=0).sqrt()
        threshold = torch.quantile(norms, 0.5)
        labels = average_linkage_two_clusters(1.0 - cosine_similarity(inner))
        kept = majority(labels)
        logger.debug("clipped_clustering: kept %d of %d rows", int(kept.sum()), rows.m)
        share = torch.where(kept, clip_scales(norms, threshold), 0.0) / int(kept.sum())
        return self.combine_kept(rows, share)
