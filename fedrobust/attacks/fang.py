"""Fang et al.'s full-knowledge local model poisoning attacks on Krum and on the trimmed mean.

The paper states both attacks on local models ``w``; here they act on updates (local minus global),
so the global model ``w_Re`` is the zero update and the "changing direction" ``s`` is the sign of the
honest mean update. The Krum attack is the same either way. The trimmed-mean attack's bound scales ``w``
itself, so it differs: ``FangTrimmedMean(space="model")`` is the paper's, on local models, and the default
``space="update"`` scales updates. As for the other omniscient attacks, the Byzantine rows are identical (the paper's
Krum attack places the other rows within ``epsilon`` of the first; ``epsilon = 0`` is its strongest form).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from fedrobust.aggregators.distance import krum_order
from fedrobust.attacks.base import Attack, check_choice, check_real
from fedrobust.attacks.omniscient import _check_input, _gram64, _repeat, _sq_dists

__all__ = ["FangKrum", "FangTrimmedMean"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FangKrum(Attack):
    """Fang's attack on Krum: the largest ``lambda`` on a halving ladder for which Krum selects ``-lambda * s``.

    ``s = sign(mean(honest))``. The ladder starts at the paper's upper bound (in update space, with
    ``h = n - f`` honest rows and ``d`` coordinates)::

        lambda_0 = min_i sum_{l in G_i} ||x_l - x_i|| / ((n - 2f - 1) sqrt(d)) + max_i ||x_i|| / sqrt(d)

    where ``G_i`` are the ``n - f - 2`` honest rows nearest to ``x_i``, and halves ``lambda`` until Krum
    (with ``f``) on the honest rows and ``f`` copies of ``-lambda * s`` picks a copy, or ``lambda``
    falls below ``threshold``; then the last ``lambda`` tried is sent. Krum's choice is evaluated
    exactly from one float64 Gram matrix of ``[honest; s]``, with the tie rules of
    :func:`fedrobust.aggregators.distance.krum_order`, so no aggregation over ``d`` is repeated.

    Parameters
    ----------
    threshold : float, default 1e-5
        Smallest ``lambda`` tried.

    References
    ----------
    Fang, Cao, Jia, Gong. "Local Model Poisoning Attacks to Byzantine-Robust Federated Learning."
    USENIX Security 2020.
    """

    name: ClassVar[str] = "fang_krum"
    omniscient: ClassVar[bool] = True
    threshold: float = 1e-5

    def __post_init__(self) -> None:
        object.__setattr__(self, "threshold", check_real(self.name, "threshold", self.threshold, low=0.0))

    def craft(self, honest: Tensor, *, f: int, generator: torch.Generator) -> Tensor:
        _check_input(self.name, honest, f, min_h=1)
        h, d = honest.shape
        if f == 0:
            return honest.new_empty((0, d))
        if h < f + 3:
            raise ValueError(
                f"attack {self.name!r}: Krum needs n >= 2f+3, i.e. h >= f+3 honest updates, got h={h}, f={f}"
            )
        s = torch.sign(honest.mean(dim=0))
        gram = _gram64(torch.cat([honest, s.unsqueeze(0)]))
        honest_dist = _sq_dists(gram[:h, :h])
        nearest = honest_dist.sqrt().sort(dim=1).values[:, 1 : h - 1]  # h - 2 = n - f - 2 nearest, not itself
        root_d = math.sqrt(d)
        lam = float(nearest.sum(dim=1).min()) / ((h - f - 1) * root_d)
        lam += float(gram.diagonal()[:h].sqrt().max()) / root_d
        # |-lambda s - x_i|^2 = lambda^2 |s|^2 + 2 lambda <s, x_i> + |x_i|^2
        s_norm, s_dot, x_norm = gram[h, h], gram[h, :h], gram.diagonal()[:h]
        dist = torch.zeros(h + f, h + f, dtype=torch.float64, device=gram.device)
        dist[:h, :h] = honest_dist
        selected = False
        while True:
            to_byz = (lam * lam * s_norm + 2.0 * lam * s_dot + x_norm).clamp_min(0.0)
            dist[:h, h:] = to_byz[:, None]
            dist[h:, :h] = to_byz[None, :]
            if int(krum_order(dist, f)[0]) >= h:
                selected = True
                break
            if lam / 2.0 < self.threshold:
                break
            lam /= 2.0
        logger.debug("fang_krum: h=%d f=%d lambda=%.6g krum selects it: %s", h, f, lam, selected)
        return _repeat((-lam * s).to(honest.dtype), f)


@dataclass(frozen=True)
class FangTrimmedMean(Attack):
    """Fang's attack on the trimmed mean (and median): push every coordinate beyond the honest extreme
    opposite to its changing direction.

    With ``s_j = sign(mean_j)`` of the honest updates and ``w_max_j``, ``w_min_j`` the largest and
    smallest honest value of coordinate ``j``: where ``s_j > 0`` the Byzantine value is ``w_min_j / b`` if
    ``w_min_j > 0`` and ``b * w_min_j`` otherwise; where ``s_j <= 0`` it is ``b * w_max_j`` if
    ``w_max_j > 0`` and ``w_max_j / b`` otherwise. The paper draws each Byzantine value uniformly between
    the extreme and that bound; here every Byzantine row takes the bound itself (the farthest allowed
    value), so the colluding rows are identical and the attack is deterministic.

    ``space`` says what ``w`` is. The paper's ``w`` are local models, so ``b`` scales weights: with
    ``b = 2`` a Byzantine weight is pulled half-way to zero or pushed to twice its size, a step of the
    order of the weight itself (``space="model"``; the sent update is that local model minus the global
    one, so it needs the round's global model, :meth:`craft_round`). In ``space="update"`` the same bound
    scales the honest updates instead, a step of the order of one round's update: a subtler attack that a
    norm or distance filter finds harder to tell from an honest reply, and weaker against a plain mean.

    Parameters
    ----------
    b : float, default 2.0
        Scale of the bound, ``> 1``.
    space : {"update", "model"}, default "update"
        What the bound scales: the honest updates, or the honest local models (the paper's statement).

    References
    ----------
    Fang, Cao, Jia, Gong. "Local Model Poisoning Attacks to Byzantine-Robust Federated Learning."
    USENIX Security 2020.
    """

    name: ClassVar[str] = "fang_trimmed_mean"
    omniscient: ClassVar[bool] = True
    b: float = 2.0
    space: str = "update"

    def __post_init__(self) -> None:
        object.__setattr__(self, "b", check_real(self.name, "b", self.b, low=1.0))
        check_choice(self.name, "space", self.space, ("update", "model"))
        object.__setattr__(self, "needs_global_model", self.space == "model")

    def craft(self, honest: Tensor, *, f: int, generator: torch.Generator) -> Tensor:
        if self.needs_global_model:
            raise ValueError(
                f"attack {self.name!r} with space='model' bounds local models, so it needs the round's global "
                "model: call craft_round(..., global_model=...)"
            )
        return self._craft(honest, f, offset=None)

    def craft_round(
        self,
        rows: Tensor,
        byzantine: Tensor,
        clients: Sequence[int],
        *,
        generator: torch.Generator,
        server_update: Tensor | None = None,
        global_model: Tensor | None = None,
    ) -> Tensor:
        honest, f = rows[~byzantine], int(byzantine.sum())
        if not self.needs_global_model:
            return self._craft(honest, f, offset=None)
        if global_model is None or global_model.shape != (rows.shape[-1],):
            shape = None if global_model is None else tuple(global_model.shape)
            raise ValueError(
                f"attack {self.name!r} with space='model' needs the round's global model of shape "
                f"({rows.shape[-1]},) in the rows' layout; got {shape}"
            )
        return self._craft(honest, f, offset=global_model.to(device=honest.device, dtype=honest.dtype))

    def _craft(self, honest: Tensor, f: int, offset: Tensor | None) -> Tensor:
        """The ``f`` rows; ``offset`` (the global model) turns updates into local models and back."""
        _check_input(self.name, honest, f, min_h=1)
        mean = honest.mean(dim=0)  # the changing direction: the same for models and updates
        local = honest if offset is None else honest + offset
        low, high = local.min(dim=0).values, local.max(dim=0).values
        below = torch.where(low > 0, low / self.b, low * self.b)  # smaller than every honest value
        above = torch.where(high > 0, high * self.b, high / self.b)  # larger than every honest value
        crafted = torch.where(mean > 0, below, above)
        return _repeat(crafted if offset is None else crafted - offset, f)
