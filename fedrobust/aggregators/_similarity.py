"""Inner products, norms, cosine similarities and small clusterings of :class:`Rows`.

The similarity-based rules (SignGuard, clipped clustering, FoolsGold) need norms and inner products
of the rows themselves, not only distances between them. Each of them registers the zero vector as
the basis' one extra vector (see :meth:`~fedrobust.aggregators.base.Rule.extra_vectors`); a row is
then ``sum_k a_k (x_k - r) - (sum_k a_k) (0 - r)`` in the centered vectors of the Gram matrix, so
every inner product comes from that ``n x n`` matrix and no extra pass over the data is needed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fedrobust.aggregators.base import compute_dtype
from fedrobust.aggregators.rows import Rows

__all__ = ["ZeroExtra", "clip_scales", "cosine_similarity", "inner_products", "majority", "two_means"]


class ZeroExtra:
    """Mixin for rules: the zero vector as the basis' one extra vector, so that row norms are known."""

    def extra_vectors(self, like: Tensor) -> list[Tensor]:
        return [torch.zeros(like.shape[1], dtype=compute_dtype(like.dtype), device=like.device)]


def inner_products(rows: Rows) -> Tensor:
    """``[m, m]`` float64 matrix of ``<row_i, row_j>`` for rows whose basis has the zero vector as its extra."""
    basis = rows.basis
    n, size = basis.n, basis.size
    if size != n + 1:
        raise RuntimeError("inner products need the zero vector as the basis' only extra vector")
    coef = torch.zeros(rows.m, size, dtype=torch.float64, device=rows.device)
    a = rows.coefficients()
    coef[:, :n] = a
    coef[:, n] = -a.sum(dim=1)
    inner = coef @ basis.gram()[:size, :size] @ coef.T
    return 0.5 * (inner + inner.T)  # exactly symmetric, so that the clusterings see one distance per pair


def cosine_similarity(inner: Tensor) -> Tensor:
    """Cosine similarities from inner products; a zero row has similarity 0 with every row (itself too)."""
    norms = inner.diagonal().clamp(min=0).sqrt()
    denominator = norms[:, None] * norms[None, :]
    cos = torch.where(denominator > 0, inner / denominator.clamp(min=torch.finfo(torch.float64).tiny), 0.0)
    return cos.clamp(-1.0, 1.0)


def clip_scales(norms: Tensor, threshold: Tensor | float) -> Tensor:
    """Factors ``min(1, threshold / norm)`` that clip rows to norm ``threshold`` (1 for zero rows)."""
    threshold = torch.as_tensor(threshold, dtype=norms.dtype, device=norms.device)
    return torch.where(norms > threshold, threshold / norms.clamp(min=torch.finfo(norms.dtype).tiny), 1.0)


def two_means(features: Tensor, *, iterations: int = 100) -> Tensor:
    """Deterministic 2-means (Lloyd) on ``[m, k]`` float64 features; returns ``[m]`` labels 0/1.

    The two starting centers are the two rows farthest apart (lowest indices on ties), so no random
    restart is needed and the labels do not depend on the row order beyond exact ties. When every row
    has the same features, all labels are 0.
    """
    m = features.shape[0]
    labels = torch.zeros(m, dtype=torch.int64, device=features.device)
    if m < 2:
        return labels
    dist = torch.cdist(features, features)
    flat = int(torch.argmax(dist))
    first, second = divmod(flat, m)
    if not bool(dist[first, second] > 0):
        return labels
    centers = features[[first, second]]
    for step in range(iterations):
        to_centers = torch.cdist(features, centers)
        new = (to_centers[:, 1] < to_centers[:, 0]).to(torch.int64)
        if step > 0 and bool((new == labels).all()):
            break
        labels = new
        for k in (0, 1):
            members = labels == k
            if bool(members.any()):
                centers[k] = features[members].mean(dim=0)
    return labels


def majority(labels: Tensor) -> Tensor:
    """Boolean mask of the larger of two clusters; on equal sizes every row (no majority to trust).

    With fewer than half of the rows Byzantine, a split that separates them from the honest rows
    always leaves the honest side strictly larger; equal halves mean the split is not that one.
    """
    ones = int(labels.sum())
    zeros = labels.numel() - ones
    if ones == zeros:
        return torch.ones_like(labels, dtype=torch.bool)
    return labels == (1 if ones > zeros else 0)
