"""Rules defined by an iteration in update space: geometric median and centered clipping.

Both iterates stay linear combinations of the rows (and, for centered clipping, of the previous
center), so every iteration runs on the ``n x n`` Gram matrix; the ``d``-dimensional data is read
once for the Gram matrix and once for the final combination, however many iterations are run.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import torch
from torch import Tensor

from fedrobust.aggregators._registry import register_rule
from fedrobust.aggregators.base import Rule, check_float, check_int, compute_dtype
from fedrobust.aggregators.rows import Rows

__all__ = ["CenteredClipping", "GeometricMedian"]

logger = logging.getLogger(__name__)


@register_rule
class GeometricMedian(Rule):
    """Geometric median by the smoothed Weiszfeld algorithm (Pillutla et al., RFA, 2022).

    Starting from the mean, repeat ``z <- sum_i w_i x_i / sum_i w_i`` with
    ``w_i = 1 / max(eps, ||z - x_i||)`` until the objective ``sum_i ||z - x_i||`` changes by less
    than ``tolerance`` times its value, at most ``iterations`` times.

    Parameters
    ----------
    f : int
        Number of Byzantine rows (breakdown point 1/2: needs ``n >= 2f + 1``).
    iterations : int
        Maximum number of Weiszfeld steps.
    tolerance : float
        Relative change of the objective that stops the iteration.
    eps : float
        Smoothing: distances below ``eps`` count as ``eps`` (avoids division by zero at a row).
    chunk_size : int or None
        Coordinates per pass.
    """

    name = "geometric_median"

    def __init__(
        self,
        f: int = 0,
        *,
        iterations: int = 100,
        tolerance: float = 1e-6,
        eps: float = 1e-6,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__(f, chunk_size=chunk_size)
        self.iterations = check_int(self.name, "iterations", iterations, minimum=1)
        self.tolerance = check_float(self.name, "tolerance", tolerance, inclusive=True)
        self.eps = check_float(self.name, "eps", eps)

    def requirement(self) -> tuple[int, str]:
        return 2 * self.f + 1, "n >= 2f+1"

    def aggregate(self, rows: Rows, weights: Tensor | None) -> Tensor:
        share = torch.full((rows.m,), 1.0 / rows.m, dtype=torch.float64, device=rows.device)
        previous = None
        for step in range(self.iterations):
            dist = rows.sq_distances_to(rows.basis_coefficients(share)).sqrt()
            objective = float(dist.sum())
            if previous is not None and abs(previous - objective) <= self.tolerance * objective:
                logger.debug("geometric_median converged after %d steps", step)
                break
            inverse = 1.0 / dist.clamp(min=self.eps)
            share = inverse / inverse.sum()
            previous = objective
        return rows.combine(share)


@register_rule
class CenteredClipping(Rule):
    """Centered clipping (Karimireddy et al., ICML 2021).

    ``v <- v + (1/n) sum_i (x_i - v) min(1, tau / ||x_i - v||)``, repeated ``iterations`` times,
    starting from the center ``v``. The center is state: zeros before the first call, then the
    previous output. It is exposed by :meth:`state_dict` so a restarted server resumes exactly.

    A fixed ``tau`` has to match the scale of the updates, which shrinks as training converges:
    ``tau="auto"`` picks the radius in every step from the distances of the rows to the current
    center instead, as their ``radius_quantile`` quantile (the ``ceil(q * m)``-th smallest distance).
    The default quantile ``(m - f) / m`` is the largest distance once the ``f`` farthest rows are
    set aside, so up to ``f`` outliers are clipped to the spread of the others, whatever the scale.

    Parameters
    ----------
    f : int
        Number of Byzantine rows (needs ``n >= 2f + 1``).
    tau : float or "auto"
        Clipping radius around the center, in the units of the updates, or ``"auto"``.
    iterations : int
        Clipping steps per call (``L`` in the paper).
    radius_quantile : float or None
        With ``tau="auto"``: the quantile in ``(0, 1]`` of the distances used as the radius;
        ``None`` means ``(m - f) / m``. Not allowed with a numeric ``tau``.
    chunk_size : int or None
        Coordinates per pass.
    """

    name = "centered_clipping"

    def __init__(
        self,
        f: int = 0,
        *,
        tau: float | str = 10.0,
        iterations: int = 1,
        radius_quantile: float | None = None,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__(f, chunk_size=chunk_size)
        if isinstance(tau, str) and tau != "auto":
            raise ValueError(f"{self.name}: parameter tau must be a finite number > 0 or 'auto', got {tau!r}")
        self.tau: float | str = "auto" if tau == "auto" else check_float(self.name, "tau", tau)
        self.iterations = check_int(self.name, "iterations", iterations, minimum=1)
        if radius_quantile is not None and self.tau != "auto":
            raise ValueError(
                f"{self.name}: parameter radius_quantile applies only with tau='auto', got tau={tau!r}"
            )
        self.radius_quantile = (
            None
            if radius_quantile is None
            else check_float(self.name, "radius_quantile", radius_quantile, maximum=1.0)
        )
        self.center: Tensor | None = None

    def requirement(self) -> tuple[int, str]:
        return 2 * self.f + 1, "n >= 2f+1"

    def extra_vectors(self, like: Tensor) -> list[Tensor]:
        dtype = compute_dtype(like.dtype)
        if self.center is None:
            return [torch.zeros(like.shape[1], dtype=dtype, device=like.device)]
        if self.center.shape != (like.shape[1],):
            raise ValueError(
                f"{self.name}: the center has {self.center.shape[0]} coordinates but the updates have "
                f"d={like.shape[1]} (n={like.shape[0]}, f={self.f}); requires the same model size every call"
            )
        return [self.center.to(device=like.device, dtype=dtype)]

    def aggregate(self, rows: Rows, weights: Tensor | None) -> Tensor:
        center_index = rows.basis.n  # the center is the basis' only extra vector
        share = torch.zeros(rows.m, dtype=torch.float64, device=rows.device)
        keep = 1.0  # coefficient of the starting center in the current iterate
        for _ in range(self.iterations):
            coef = rows.basis_coefficients(share)
            coef[center_index] += keep
            dist = rows.sq_distances_to(coef).sqrt()
            radius = self._radius(dist)
            # Rows within the radius count fully; this also covers dist == 0 with an automatic radius of 0.
            pull = torch.where(dist > radius, radius / dist.clamp(min=torch.finfo(dist.dtype).tiny), 1.0) / rows.m
            total = float(pull.sum())
            share = share * (1.0 - total) + pull
            keep *= 1.0 - total
        coef = rows.basis_coefficients(share)
        coef[center_index] += keep
        out = rows.basis.combine(coef)
        self.center = out.clone()
        return out

    def _radius(self, dist: Tensor) -> Tensor | float:
        """The clipping radius of one step: ``tau``, or the chosen quantile of ``dist`` with ``tau="auto"``."""
        if self.tau != "auto":
            return float(self.tau)
        m = dist.shape[0]
        if self.radius_quantile is None:
            k = m - self.f
        else:
            k = math.ceil(self.radius_quantile * m - 1e-9)  # the tolerance absorbs q * m just above an integer
        return torch.sort(dist).values[min(max(k, 1), m) - 1]

    def state_dict(self) -> dict[str, Tensor]:
        return {} if self.center is None else {"center": self.center.clone()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        unknown = sorted(set(state) - {"center"})
        if unknown:
            raise ValueError(f"{self.name}: unknown state keys {unknown}; valid keys: center")
        center = state.get("center")
        if center is not None:
            if not isinstance(center, Tensor) or center.dim() != 1 or not center.is_floating_point():
                raise ValueError(f"{self.name}: state 'center' must be a 1-D float tensor")
            if not bool(torch.isfinite(center).all()):
                raise ValueError(f"{self.name}: state 'center' contains non-finite values")
            center = center.detach().clone()
        self.center = center
