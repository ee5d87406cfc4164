"""Relocated orthogonal perturbation (ROP): the adaptive attack on centered clipping, which learns from history.

Centered clipping clips each row to a ball of radius ``tau`` around its previous output, the server's
last aggregate, so a row far out counts only as far as ``tau``. Ozfatura et al. attack it with the same
history the defense uses: they place the Byzantine rows at a point between that last aggregate and the
honest mean, and move them from there along a direction turned ``angle`` degrees (90: orthogonal) from a
reference point between the same two, so that every round the clipped rows pull the aggregate off the
course the honest clients set, by as much as the ball allows. Here the length of the move is searched
against the rule, as the tuned attacks search their scale (:mod:`fedrobust.attacks.optimal`), and the
last aggregate is the server's own: the attacker follows the server's pipeline round by round
(``memory``, on by default), so it knows the aggregate each round produced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from fedrobust.attacks.base import check_real
from fedrobust.attacks.optimal import _Optimal

__all__ = ["ROP"]


@dataclass(frozen=True)
class ROP(_Optimal):
    """Relocated orthogonal perturbation: rows ``p + t * s * u`` with ``t`` tuned against ``rule``.

    With ``g`` the server's last aggregate (zeros before the first, as centered clipping's center) and
    ``mu`` the honest mean: the rows start at ``p = location * g + (1 - location) * mu``; ``u`` is the
    all-ones direction with its part along the reference ``r = reference * g + (1 - reference) * mu``
    removed (``r = mu`` in the first round), made unit and turned towards ``r`` by ``90 - angle``
    degrees; ``s`` is the median distance of the honest rows to ``p``, so ``t = 1`` puts the rows as far
    from ``p`` as the median honest row. ``t`` in ``[0, max_scale]`` is searched on a grid and refined
    (``t = 1`` always a candidate), for the rows that move ``rule``'s output farthest from the honest
    mean. Without ``memory`` the attacker does not see the aggregates: every round is its first.

    Parameters
    ----------
    rule : str, default "consistency+direction+dedup+winsorize+nnm+trimmed_mean"
        Registered aggregation rule, or ``+``-joined pipeline, the server is assumed to run.
    rule_f : int or None, default None
        The rule's ``f``; ``None`` means the number of Byzantine rows of the round.
    rule_params : dict, default {}
        The rule's parameters.
    rule_pre_params : dict, default {}
        Parameters of the pipeline's pre-aggregators, by stage name (as ``aggregator.pre_params``);
        the simulation fills them from the server's configuration.
    max_scale : float, default 10.0
        Largest ``t`` searched.
    grid : int, default 11
        Evenly spaced ``t`` values evaluated on ``[0, max_scale]`` (at least 2).
    refine : int, default 8
        Golden-section steps around the best grid value.
    memory : bool, default True
        Follow the server's pipeline round by round (its state, and the aggregate each round produced).
    location : float, default 1.0
        Weight in ``[0, 1]`` of the last aggregate in the point the rows start from (``pi`` in the
        paper's code): 1 starts at centered clipping's center, 0 at the honest mean.
    reference : float, default 0.9
        Weight in ``[0, 1]`` of the last aggregate in the reference the direction is turned from
        (``lambda`` in the paper's code).
    angle : float, default 90.0
        Angle in ``[0, 180]`` degrees between the direction and the reference: 90 is orthogonal to it.

    References
    ----------
    Ozfatura, Ozfatura, Kupcu, Gunduz. "Byzantines Can Also Learn From History: Fall of Centered Clipping
    in Federated Learning." IEEE Transactions on Information Forensics and Security, 2024.
    """

    name: ClassVar[str] = "rop"
    memory: bool = True
    location: float = 1.0
    reference: float = 0.9
    angle: float = 90.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for param in ("location", "reference"):
            value = check_real(self.name, param, getattr(self, param), low=0.0, high=1.0, low_open=False)
            object.__setattr__(self, param, value)
        angle = check_real(self.name, "angle", self.angle, low=0.0, high=180.0, low_open=False)
        object.__setattr__(self, "angle", angle)

    def _lines(self, honest: Tensor, f: int) -> list[tuple[Tensor, Tensor, float]]:
        mu = honest.mean(dim=0)
        last = self._memory.get("aggregate")
        if last is None:  # the first round, or no history without memory
            last, reference = torch.zeros_like(mu), mu
        else:
            last = last.to(device=mu.device, dtype=mu.dtype)
            reference = self.reference * last + (1.0 - self.reference) * mu
        start = self.location * last + (1.0 - self.location) * mu
        direction = self._direction(reference)
        spread = torch.linalg.vector_norm(honest - start, dim=1).median()
        return [(start, direction * spread, 1.0)]

    def _direction(self, reference: Tensor) -> Tensor:
        """The unit direction ``angle`` degrees from ``reference``, in the plane of it and the all-ones vector."""
        r = reference.double()
        r_norm = torch.linalg.vector_norm(r)
        ones = torch.ones_like(r)
        if r_norm == 0:
            return (ones / math.sqrt(r.numel())).to(reference.dtype)
        along = r / r_norm
        across = ones - (ones @ along) * along
        across_norm = torch.linalg.vector_norm(across)
        if across_norm <= 1e-12 * math.sqrt(r.numel()):  # the reference is along the all-ones vector
            return (along * math.cos(math.radians(self.angle))).to(reference.dtype)
        turn = math.radians(self.angle)
        return (across / across_norm * math.sin(turn) + along * math.cos(turn)).to(reference.dtype)
