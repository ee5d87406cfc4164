"""Omniscient colluding attacks: simulation-only models of an adversary that sees every honest update of the
round and controls the ``f`` Byzantine clients together.

Each attack maps the honest flattened updates ``[h, d]`` to the Byzantine ones ``[f, d]`` (``n = h + f``
clients in the round). The Byzantine rows are identical, as in the papers: colluders gain nothing from
spreading out, and a single point is what the constraints below are stated for. The attacks are
deterministic functions of their input; the generator is accepted for the interface's sake.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist
from typing import ClassVar

import torch
from torch import Tensor

from fedrobust.attacks.base import Attack, check_choice, check_int, check_real

__all__ = ["ALIE", "IPM", "MinMax", "MinSum", "Mimic", "alie_z"]

logger = logging.getLogger(__name__)

# Columns per block when forming Gram matrices in float64: bounds the float64 copy to h * 2**20 * 8 bytes
# however large the model is.
_GRAM_CHUNK = 1 << 20

_PERTURBATIONS = ("std", "unit_vec", "sign")


def _check_input(attack: str, honest: Tensor, f: int, min_h: int) -> None:
    check_int(attack, "f", f, low=0)
    if honest.ndim != 2 or not honest.is_floating_point():
        raise ValueError(
            f"attack {attack!r}: honest updates must be a floating tensor of shape [h, d], "
            f"got shape {tuple(honest.shape)} and dtype {honest.dtype}"
        )
    if honest.shape[0] < min_h:
        raise ValueError(
            f"attack {attack!r}: needs h >= {min_h} honest updates, got h={honest.shape[0]}, f={f}"
        )


def _repeat(row: Tensor, f: int) -> Tensor:
    return row.unsqueeze(0).repeat(f, 1)


def _centre(honest: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Mean, centred rows and unbiased per-coordinate standard deviation of ``honest``.

    The deviation is taken from the centred rows, which are needed anyway: several times faster on CPU than
    ``torch.std`` over the row dimension of a wide ``[h, d]`` tensor.
    """
    mu = honest.mean(dim=0)
    centred = honest - mu
    std = (centred.square().sum(dim=0) / (honest.shape[0] - 1)).sqrt()
    return mu, centred, std


def _gram64(rows: Tensor) -> Tensor:
    """Return ``rows @ rows.T`` in float64, accumulated over column blocks to bound the float64 copy."""
    gram = rows.new_zeros((rows.shape[0], rows.shape[0]), dtype=torch.float64)
    for start in range(0, rows.shape[1], _GRAM_CHUNK):
        block = rows[:, start : start + _GRAM_CHUNK].to(torch.float64)
        gram += block @ block.T
    return gram


def _sq_dists(gram: Tensor) -> Tensor:
    """Pairwise squared Euclidean distances from a Gram matrix (clamped: rounding can go below zero)."""
    diag = gram.diagonal()
    return (diag[:, None] + diag[None, :] - 2.0 * gram).clamp_min(0.0)


def alie_z(n: int, f: int) -> float:
    """The ALIE deviation ``z`` for ``n`` clients of which ``f`` are Byzantine (Baruch et al. 2019).

    ``s = floor(n / 2 + 1) - f`` honest clients must be won over for a majority, and ``z`` is the largest
    deviation that still leaves ``s`` honest updates farther from the mean: ``z = Phi^{-1}((n - s) / n)``.

    Raises
    ------
    ValueError
        When ``s < 1``: the Byzantine clients already hold a majority and the formula has no finite ``z``.
    """
    s = math.floor(n / 2 + 1) - f
    if s < 1:
        raise ValueError(
            f"attack 'alie': z from n={n}, f={f} needs floor(n/2 + 1) - f >= 1 (a Byzantine minority); "
            "pass z explicitly otherwise"
        )
    return NormalDist().inv_cdf((n - s) / n)


@dataclass(frozen=True)
class ALIE(Attack):
    """A Little Is Enough: every Byzantine row is ``mu - z * sigma``, coordinate-wise.

    ``mu`` and ``sigma`` are the honest mean and (unbiased) standard deviation per coordinate. The shift is
    small enough to stay inside the honest spread, so distance- and rank-based rules keep the rows, yet
    consistent across coordinates and rounds, so it steers training.

    Parameters
    ----------
    z : float or None, default None
        Deviation in standard deviations; ``None`` derives it from ``n = h + f`` and ``f`` (:func:`alie_z`).

    References
    ----------
    Baruch, Baruch, Goldberg. "A Little Is Enough: Circumventing Defenses For Distributed Learning."
    NeurIPS 2019.
    """

    name: ClassVar[str] = "alie"
    omniscient: ClassVar[bool] = True
    z: float | None = None

    def __post_init__(self) -> None:
        if self.z is not None:
            object.__setattr__(self, "z", check_real(self.name, "z", self.z))

    def craft(self, honest: Tensor, *, f: int, generator: torch.Generator) -> Tensor:
        _check_input(self.name, honest, f, min_h=2)
        z = self.z if self.z is not None else alie_z(honest.shape[0] + f, f)
        mu, _, sigma = _centre(honest)
        logger.debug("alie: h=%d f=%d z=%.4f", honest.shape[0], f, z)
        return _repeat(mu - z * sigma, f)


@dataclass(frozen=True)
class IPM(Attack):
    """Inner Product Manipulation: every Byzantine row is ``-epsilon * mean(honest)``.

    A small ``epsilon`` (0.1) keeps the rows close to the honest ones and defeats median-like rules; a large
    one (e.g. 100) makes the inner product of the aggregate with the true gradient negative for a mean.

    Parameters
    ----------
    epsilon : float, default 0.1
        Positive scale.

    References
    ----------
    Xie, Koyejo, Gupta. "Fall of Empires: Breaking Byzantine-tolerant SGD by Inner Product Manipulation."
    UAI 2020.
    """

    name: ClassVar[str] = "ipm"
    omniscient: ClassVar[bool] = True
    epsilon: float = 0.1

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon", check_real(self.name, "epsilon", self.epsilon, low=0.0))

    def craft(self, honest: Tensor, *, f: int, generator: torch.Generator) -> Tensor:
        _check_input(self.name, honest, f, min_h=1)
        return _repeat(-self.epsilon * honest.mean(dim=0), f)


@dataclass(frozen=True)
class Mimic(Attack):
    """Mimic: every Byzantine client copies one honest client's update.

    Under heterogeneous data this over-represents one client's distribution. The copied client is the one
    that lies farthest along the top principal direction of the centred honest updates, i.e. the one
    maximizing ``|<v, x_i - mu>|`` for the top eigenvector ``v`` of their covariance. This is the paper's
    target computed exactly on the round's updates rather than by its online power iteration; it is read off
    the ``h x h`` Gram matrix: for the top eigenvector ``u`` of ``X_c X_c^T``, ``<v, x_i - mu>`` is
    proportional to ``u_i``.

    With ``noise > 0`` each copy is moved by its own random vector: an attacker who hides the copies from
    a filter of duplicates (``dedup``), which then has to tell them from honest clients with similar data.

    Parameters
    ----------
    target : int or None, default None
        Index of the honest row to copy instead of the principal-direction choice.
    noise : float, default 0.0
        Norm of each copy's random displacement (isotropic Gaussian direction, drawn from the generator), as
        a fraction of the median distance from an honest update to its nearest honest neighbour: 0 sends
        exact copies; near 1 the copies lie as far from each other as honest clients do.

    References
    ----------
    Karimireddy, He, Jaggi. "Byzantine-Robust Learning on Heterogeneous Datasets via Bucketing." ICLR 2022.
    """

    name: ClassVar[str] = "mimic"
    omniscient: ClassVar[bool] = True
    target: int | None = None
    noise: float = 0.0

    def __post_init__(self) -> None:
        if self.target is not None:
            check_int(self.name, "target", self.target, low=0)
        object.__setattr__(self, "noise", check_real(self.name, "noise", self.noise, low=0.0, low_open=False))

    def craft(self, honest: Tensor, *, f: int, generator: torch.Generator) -> Tensor:
        _check_input(self.name, honest, f, min_h=1)
        h = honest.shape[0]
        if self.target is not None:
            if self.target >= h:
                raise ValueError(f"attack {self.name!r}: target={self.target} must be < h={h}, f={f}")
            index = self.target
        else:
            _, eigvecs = torch.linalg.eigh(_gram64(honest - honest.mean(dim=0)))
            index = int(eigvecs[:, -1].abs().argmax())
        logger.debug("mimic: copying honest row %d of %d", index, h)
        copies = _repeat(honest[index], f)
        if self.noise == 0 or h < 2:
            return copies
        gram = _gram64(honest)
        nearest = _sq_dists(gram).fill_diagonal_(math.inf).min(dim=1).values.sqrt()
        radius = self.noise * float(nearest.median())
        step = torch.randn(copies.shape, generator=generator, dtype=torch.float64).to(copies.device)
        step *= radius / torch.linalg.vector_norm(step, dim=1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
        return (copies.to(torch.float64) + step).to(copies.dtype)


def _perturbation(kind: str, mu: Tensor, std: Tensor) -> Tensor:
    """The direction ``p`` the malicious update moves along from the honest mean (Shejwalkar & Houmansadr)."""
    if kind == "std":
        return -std
    if kind == "sign":
        return -torch.sign(mu)
    norm_mu = torch.linalg.vector_norm(mu)
    return -mu / norm_mu if norm_mu > 0 else torch.zeros_like(mu)


def _min_max_gamma(a: Tensor, b: Tensor, c: Tensor, sq_dists: Tensor) -> Tensor:
    """Largest ``gamma`` with ``max_i |mu + gamma p - x_i|^2 <= max_{j,k} |x_j - x_k|^2``."""
    # Per honest row, the larger root of a g^2 + 2 b g - (T - c) = 0; the tightest row binds.
    slack = (sq_dists.max() - c).clamp_min(0.0)
    return ((torch.sqrt(b * b + a * slack) - b) / a).min()


def _min_sum_gamma(a: Tensor, b: Tensor, c: Tensor, sq_dists: Tensor) -> Tensor:
    """Largest ``gamma`` with ``sum_i |mu + gamma p - x_i|^2 <= max_j sum_k |x_j - x_k|^2``."""
    # sum_i b_i = <p, h mu - sum_i x_i> = 0, so the linear term drops out of the summed quadratic.
    slack = (sq_dists.sum(dim=1).max() - c.sum()).clamp_min(0.0)
    return torch.sqrt(slack / (c.numel() * a))


def _shejwalkar_craft(
    attack: str,
    perturbation: str,
    gamma_fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor],
    honest: Tensor,
    f: int,
) -> Tensor:
    """``malicious = mu + gamma * p`` with the largest ``gamma`` that ``gamma_fn``'s constraint allows.

    The paper finds ``gamma`` by binary search. The squared distance from ``mu + gamma * p`` to honest row
    ``x_i`` is the quadratic ``c_i + 2 gamma b_i + gamma^2 a`` (``a = |p|^2``, ``b_i = <p, mu - x_i>``,
    ``c_i = |mu - x_i|^2``); both constraints hold at ``gamma = 0`` and, being convex in ``gamma``, on an
    interval from there, so the supremum that the search converges to is a root computed exactly here from
    one float64 Gram matrix of ``[x_i - mu; p]``. No search tolerance or initial ``gamma`` is needed, and the
    result is the strongest update the constraint allows (up to float rounding).
    """
    _check_input(attack, honest, f, min_h=2)
    h = honest.shape[0]
    mu, centred, std = _centre(honest)
    p = _perturbation(perturbation, mu, std)
    gram = _gram64(torch.cat([centred, p.unsqueeze(0)]))
    a = gram[h, h]
    if a <= 0:
        # No direction to move along (identical honest updates, or a zero mean for unit_vec/sign).
        return _repeat(mu, f)
    gamma = float(gamma_fn(a, -gram[:h, h], gram.diagonal()[:h], _sq_dists(gram[:h, :h])))
    logger.debug("%s: h=%d f=%d gamma=%.6g", attack, h, f, gamma)
    return _repeat(mu + gamma * p, f)


@dataclass(frozen=True)
class MinMax(Attack):
    """Min-Max: ``mu + gamma * p`` whose largest distance to an honest update is at most the largest distance
    between two honest updates, so it never looks like the outlier.

    ``gamma`` is the largest value that satisfies the constraint, computed in closed form (see
    :func:`_shejwalkar_craft`).

    Parameters
    ----------
    perturbation : {"std", "unit_vec", "sign"}, default "std"
        ``p = -std(honest)`` (unbiased, per coordinate), ``-mean / |mean|`` or ``-sign(mean)``.

    References
    ----------
    Shejwalkar, Houmansadr. "Manipulating the Byzantine: Optimizing Model Poisoning Attacks and Defenses for
    Federated Learning." NDSS 2021.
    """

    name: ClassVar[str] = "min_max"
    omniscient: ClassVar[bool] = True
    perturbation: str = "std"

    def __post_init__(self) -> None:
        check_choice(self.name, "perturbation", self.perturbation, _PERTURBATIONS)

    def craft(self, honest: Tensor, *, f: int, generator: torch.Generator) -> Tensor:
        return _shejwalkar_craft(self.name, self.perturbation, _min_max_gamma, honest, f)


@dataclass(frozen=True)
class MinSum(Attack):
    """Min-Sum: ``mu + gamma * p`` whose sum of squared distances to the honest updates is at most the largest
    such sum of one honest update to the others.

    ``gamma`` is the largest value that satisfies the constraint, computed in closed form (see
    :func:`_shejwalkar_craft`).

    Parameters
    ----------
    perturbation : {"std", "unit_vec", "sign"}, default "std"
        ``p = -std(honest)`` (unbiased, per coordinate), ``-mean / |mean|`` or ``-sign(mean)``.

    References
    ----------
    Shejwalkar, Houmansadr. "Manipulating the Byzantine: Optimizing Model Poisoning Attacks and Defenses for
    Federated Learning." NDSS 2021.
    """

    name: ClassVar[str] = "min_sum"
    omniscient: ClassVar[bool] = True
    perturbation: str = "std"

    def __post_init__(self) -> None:
        check_choice(self.name, "perturbation", self.perturbation, _PERTURBATIONS)

    def craft(self, honest: Tensor, *, f: int, generator: torch.Generator) -> Tensor:
        return _shejwalkar_craft(self.name, self.perturbation, _min_sum_gamma, honest, f)
