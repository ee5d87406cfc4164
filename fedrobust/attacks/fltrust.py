"""The adaptive attack of the FLTrust paper: rows the server trusts, turned as far from its direction as pays.

FLTrust scores a row by ``ReLU(cos(x, g0))`` against the server's own update ``g0`` and rescales it to
``||g0||``, so the attacks that reverse the update (sign flip, Fang's, ALIE with a large ``z``) get trust
0 and change nothing. Cao et al. attack it with Fang et al.'s framework: an attacker who knows ``g0``
sends ``||g0|| * e`` for unit vectors ``e`` chosen to maximize ``s . (g - g')``, the move of the
aggregate against its changing direction ``s``, where ``g`` is FLTrust's output on the honest rows and
``g'`` its output with the crafted rows.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from fedrobust.attacks.base import Attack, check_choice, check_int, missing_server_update, server_update_of
from fedrobust.attacks.omniscient import _check_input, _repeat

__all__ = ["FLTrustAdaptive"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FLTrustAdaptive(Attack):
    """Cao et al.'s adaptive attack on FLTrust, solved exactly for identical Byzantine rows.

    With ``u = g0 / ||g0||``, ``T`` the honest rows' total trust and ``A`` the sum of their trusted,
    rescaled rows (FLTrust's output ``g = A / T``), ``f`` rows ``||g0|| * e`` with ``cos(e, u) = rho``
    give ``g' = (A + f rho ||g0|| e) / (T + f rho)``. For a given ``rho`` the ``e`` that lowers
    ``s . g'`` most lies in the plane of ``u`` and ``s``: ``e = rho u + sqrt(1 - rho^2) w``, with ``w``
    the unit vector opposite to the part of ``s`` orthogonal to ``u``. That leaves one number, ``rho``,
    searched on ``steps`` points of ``(0, 1]``: a small ``rho`` turns the rows far but earns them
    little trust, ``rho = 1`` earns full trust for the server's own direction. The paper solves the
    same objective by gradient ascent over each row's ``e``; identical rows lose nothing, as the
    objective is a ratio of sums over the rows with one term per row (each row's best ``rho`` solves
    the same one-dimensional problem).

    ``s = sign(g)`` (``direction="sign"``, the paper's; the sign of the honest rows' mean where no honest
    row is trusted), or ``s = g`` itself (``direction="update"``): the first weighs every coordinate
    alike, the second by how far the honest aggregate moves it, which is what costs the model progress. The attack needs
    ``g0``: :meth:`craft_round` takes it as ``server_update`` (the simulation's adversary passes the one
    the server computed for the round), and :meth:`craft`, without it, raises.

    Parameters
    ----------
    steps : int, default 1000
        Points of the search over ``rho``.
    direction : {"sign", "update"}, default "sign"
        The changing direction ``s`` the rows move the aggregate against.

    References
    ----------
    Cao, Fang, Liu, Gong. "FLTrust: Byzantine-robust Federated Learning via Trust Bootstrapping." NDSS 2021
    (Section "Adaptive attack"). Fang, Cao, Jia, Gong. "Local Model Poisoning Attacks to Byzantine-Robust
    Federated Learning." USENIX Security 2020.
    """

    name: ClassVar[str] = "fltrust_adaptive"
    omniscient: ClassVar[bool] = True
    needs_server_update: ClassVar[bool] = True
    steps: int = 1000
    direction: str = "sign"

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", check_int(self.name, "steps", self.steps, low=1))
        check_choice(self.name, "direction", self.direction, ("sign", "update"))

    def craft(self, honest: Tensor, *, f: int, generator: torch.Generator) -> Tensor:
        raise missing_server_update(self.name)

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
        g0 = server_update_of(self.name, server_update, rows.shape[-1])
        return self.against(rows[~byzantine], g0, f=int(byzantine.sum()))

    def against(self, honest: Tensor, server_update: Tensor, *, f: int) -> Tensor:
        """The ``f`` rows against FLTrust with server update ``server_update`` (``[d]``) and ``honest`` rows."""
        _check_input(self.name, honest, f, min_h=1)
        h, d = honest.shape
        server_update_of(self.name, server_update, d)
        x, g0 = honest.to(torch.float64), server_update.to(device=honest.device, dtype=torch.float64)
        g0_norm = float(g0.norm())
        if f == 0 or g0_norm == 0.0:  # FLTrust trusts no row when g0 = 0: nothing to gain
            return honest.new_zeros((f, d))
        u = g0 / g0_norm
        norms = x.norm(dim=1)
        safe_norms = norms.clamp_min(torch.finfo(torch.float64).tiny)  # zero rows get trust 0 below
        trust = torch.where(norms > 0, (x @ u) / safe_norms, 0.0).clamp(0, 1)
        total = float(trust.sum())
        trusted = (trust * g0_norm / safe_norms) @ x  # A: the honest rows, rescaled and weighted by trust
        before = trusted / total if total > 0 else torch.zeros_like(u)  # FLTrust's output on the honest rows
        changing = before if total > 0 else x.mean(dim=0)
        s = torch.sign(changing) if self.direction == "sign" else changing
        along = float(s @ u)
        across = s - along * u
        across_norm = float(across.norm())
        w = -across / across_norm if across_norm > 0 else torch.zeros_like(u)
        rho = torch.arange(1, self.steps + 1, dtype=torch.float64) / self.steps
        sine = (1.0 - rho * rho).clamp_min(0.0).sqrt()
        # s . g'(rho), with s . e = rho (s . u) - sqrt(1 - rho^2) |s across u|
        s_dot_after = (float(s @ trusted) + f * rho * g0_norm * (rho * along - sine * across_norm)) / (total + f * rho)
        best = int(torch.argmin(s_dot_after))
        chosen = float(rho[best])
        e = chosen * u + math.sqrt(max(0.0, 1.0 - chosen * chosen)) * w
        logger.debug(
            "fltrust_adaptive: h=%d f=%d honest trust %.4g, rho=%.4g moves s.g by %.6g",
            h, f, total, chosen, float(s @ before) - float(s_dot_after[best]),
        )
        return _repeat((g0_norm * e).to(honest.dtype), f)
