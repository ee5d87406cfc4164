"""FLTrust (Cao et al., NDSS 2021): trust each row by its direction's agreement with the server's own update."""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from fedrobust.aggregators._registry import register_rule
from fedrobust.aggregators.base import Rule, compute_dtype
from fedrobust.aggregators.rows import Rows

__all__ = ["FLTrust"]

logger = logging.getLogger(__name__)


@register_rule
class FLTrust(Rule):
    """FLTrust: the server trains on a small clean root data set and trusts clients that agree with it.

    Each round the server computes its own update ``g0`` from the current global model (the same local
    training as a client, on its root data set). Then, for the ``m`` rows ``x_i``:

    1. trust score ``TS_i = ReLU(cos(x_i, g0))``: a row pointing away from the server's direction
       (a sign flip, most crafted attacks) gets trust 0;
    2. each row is rescaled to the server update's norm, ``x_i * ||g0|| / ||x_i||``, so a boosted row
       gains nothing from its size;
    3. the output is ``sum_i TS_i * rescaled_i / sum_i TS_i``, and the zero vector when every score is 0.

    **Where ``g0`` comes from.** A rule sees only the ``[n, d]`` rows, never the model or any data, so
    the server update is an input given before each call: :meth:`set_server_update` (or
    :meth:`~fedrobust.aggregators.Aggregator.set_server_update` on the built pipeline) with a ``[d]``
    vector in the rows' layout. The value is used by the next call only, then forgotten, so a stale
    one can never be reused; a call without one raises ``ValueError``. :class:`RobustStrategy` does
    this for every rule with ``needs_server_update`` from its ``server_update_fn`` (the RunConfig
    path trains on ``aggregator.root_size`` examples of the training split, see
    ``fedrobust.strategies.evaluation.server_update_fn``).

    ``f`` does not enter the rule (the paper's guarantee does not bound the number of attackers); it is
    stored for the pipeline and any pre-aggregators, and the rule accepts any ``n >= 1``. Zero rows
    have trust 0. The server update and the rows' norms come from the Gram matrix of the rows with two
    extra vectors (zero and ``g0``), so the data is read twice (Gram, output) whatever ``n``.

    Parameters
    ----------
    f : int
        Number of Byzantine rows (not used by the rule itself).
    chunk_size : int or None
        Coordinates per pass.

    References
    ----------
    Cao, Fang, Liu, Gong. "FLTrust: Byzantine-robust Federated Learning via Trust Bootstrapping." NDSS 2021.
    """

    name = "fltrust"
    needs_server_update = True

    def __init__(self, f: int = 0, *, chunk_size: int | None = None) -> None:
        super().__init__(f, chunk_size=chunk_size)
        self._server_update: Tensor | None = None
        # Trust scores of the last call's rows (for logging and tests), float64.
        self.last_trust: Tensor | None = None

    def set_server_update(self, vector: Tensor) -> None:
        """Give the server's update ``g0`` (a ``[d]`` float tensor, finite) for the next call only."""
        if not isinstance(vector, Tensor) or vector.dim() != 1 or not vector.is_floating_point():
            shape = tuple(vector.shape) if isinstance(vector, Tensor) else type(vector).__name__
            raise ValueError(f"{self.name}: the server update must be a 1-D float tensor, got {shape}")
        self._server_update = vector.detach()

    def extra_vectors(self, like: Tensor) -> list[Tensor]:
        n, d = like.shape
        g0, self._server_update = self._server_update, None  # used once: the next round brings its own
        if g0 is None:
            raise ValueError(
                f"{self.name}: no server update was given for this call (n={n}, f={self.f}); requires "
                "set_server_update(g0) with the server's own update of the round before each call"
            )
        if g0.shape != (d,):
            raise ValueError(
                f"{self.name}: the server update has {g0.shape[0]} coordinates but the updates have d={d} "
                f"(n={n}, f={self.f}); requires a server update in the rows' layout"
            )
        if not bool(torch.isfinite(g0).all()):
            raise ValueError(
                f"{self.name}: the server update contains non-finite values (n={n}, f={self.f}); "
                "requires a finite server update"
            )
        dtype = compute_dtype(like.dtype)
        return [torch.zeros(d, dtype=dtype, device=like.device), g0.to(device=like.device, dtype=dtype)]

    def aggregate(self, rows: Rows, weights: Tensor | None) -> Tensor:
        basis = rows.basis
        n, size, m = basis.n, basis.size, rows.m
        # Coefficients over the centered basis [x_k - r, 0 - r, g0 - r]:
        # row_i = sum_k a_ik (x_k - r) - (sum_k a_ik)(0 - r) and g0 = (g0 - r) - (0 - r), exact for any a
        # (after clipping too). Inner products of the rows and g0 then come from the Gram matrix alone.
        coef = torch.zeros(m + 1, size, dtype=torch.float64, device=rows.device)
        a = rows.coefficients()
        coef[:m, :n] = a
        coef[:m, n] = -a.sum(dim=1)
        coef[m, n] = -1.0
        coef[m, n + 1] = 1.0
        inner = coef @ basis.gram()[:size, :size] @ coef.T
        norms = inner.diagonal().clamp(min=0).sqrt()
        row_norms, g0_norm = norms[:m], norms[m]
        denominator = row_norms * g0_norm
        tiny = torch.finfo(torch.float64).tiny
        cos = torch.where(denominator > 0, inner[:m, m] / denominator.clamp(min=tiny), 0.0).clamp(-1.0, 1.0)
        trust = cos.clamp(min=0.0)
        self.last_trust = trust
        total = float(trust.sum())
        logger.debug("fltrust: trust scores %s, server update norm %.4g", trust.tolist(), float(g0_norm))
        if not total > 0:
            # No row agrees with the server: the paper's aggregate is zero (the model does not move).
            self.last_excluded = tuple(range(m))
            return torch.zeros(rows.d, dtype=rows.dtype, device=rows.device)
        # Rows with trust 0 (zero rows among them) get share 0, never 0 * (||g0|| / 0).
        share = torch.where(trust > 0, trust * g0_norm / row_norms.clamp(min=tiny), 0.0) / total
        return self.combine_kept(rows, share)
