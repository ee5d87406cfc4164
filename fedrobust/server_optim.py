"""Server optimizers that take the robust aggregate as their step direction.

The aggregate is a client *update* (local minus global), i.e. a negative
pseudo-gradient, so every rule below moves the global model along it. The
state (momentum, Adam moments, step count) lives in the optimizer object and
round-trips through ``state_dict`` so that a resumed run continues exactly.
Formulas follow Reddi et al. 2021, "Adaptive Federated Optimization", as
Flower's FedAvgM / FedAdam / FedYogi do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

NAMES = ("fedavg", "fedavgm", "fedadam", "fedyogi")
#: The settings each optimizer reads, beside ``lr``.
PARAMS: dict[str, tuple[str, ...]] = {
    "fedavg": (),
    "fedavgm": ("momentum",),
    "fedadam": ("beta_1", "beta_2", "tau"),
    "fedyogi": ("beta_1", "beta_2", "tau"),
}
# How the server lr changes over the rounds (lr_factor).
SCHEDULES = ("constant", "cosine")


def lr_factor(schedule: str, server_round: int, num_rounds: int, min_ratio: float = 0.0) -> float:
    """The server lr's multiplier in round ``server_round`` (1-based) of ``num_rounds``.

    ``constant``: 1. ``cosine``: PyTorch's ``CosineAnnealingLR`` over the rounds, from 1 in the first round
    down towards ``min_ratio`` (its ``eta_min``, relative to the lr) after the last:
    ``min_ratio + (1 - min_ratio) * (1 + cos(pi * (round - 1) / num_rounds)) / 2``. Late rounds then move
    the model less, so what an attack (or a client's drift) puts into one late aggregate is damped.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown server lr schedule {schedule!r}; valid choices: {list(SCHEDULES)}")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"server lr min_ratio must be in [0, 1], got {min_ratio!r}")
    if schedule == "constant":
        return 1.0
    progress = (server_round - 1) / max(num_rounds, 1)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class ServerOptimizer:
    """Applies aggregated updates to the global parameters.

    Parameters
    ----------
    name : str
        One of ``fedavg``, ``fedavgm``, ``fedadam``, ``fedyogi``.
    lr : float
        Server learning rate (``fedavg`` with lr=1 is plain federated averaging).
    momentum : float
        Momentum of ``fedavgm``.
    beta_1, beta_2, tau : float
        Moment decay rates and adaptivity of ``fedadam`` / ``fedyogi``.
    """

    name: str = "fedavg"
    lr: float = 1.0
    momentum: float = 0.9
    beta_1: float = 0.9
    beta_2: float = 0.99
    tau: float = 1e-3
    # State, not settings: restored with load_state_dict, never passed to the constructor.
    steps: int = field(default=0, init=False)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.name not in NAMES:
            raise ValueError(f"unknown server optimizer {self.name!r}; valid choices: {list(NAMES)}")
        if not self.lr > 0:
            raise ValueError(f"server optimizer lr must be > 0, got {self.lr}")
        for attr in ("momentum", "beta_1", "beta_2"):
            if not 0.0 <= getattr(self, attr) < 1.0:
                raise ValueError(f"server optimizer {attr} must be in [0, 1), got {getattr(self, attr)}")
        if not self.tau > 0:
            raise ValueError(f"server optimizer tau must be > 0, got {self.tau}")
        # Flat path (step_flat): one [d] vector per buffer kind, exposed in ``buffers`` as per-key
        # views; not dataclass fields, so dataclasses.asdict and the state_dict format ignore them.
        self._flat: dict[str, torch.Tensor] = {}
        self._views: dict[str, torch.Tensor] = {}

    def step(
        self, params: Mapping[str, torch.Tensor], update: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Return new parameters ``params`` moved along the aggregated ``update``."""
        self.steps += 1
        new: dict[str, torch.Tensor] = {}
        for key, delta in update.items():
            delta = delta.to(torch.float32)
            new[key] = (params[key].to(torch.float32) + self.lr * self._direction(key, delta)).to(
                params[key].dtype
            )
        return new

    def _direction(self, key: str, delta: torch.Tensor) -> torch.Tensor:
        if self.name == "fedavg":
            return delta
        if self.name == "fedavgm":
            buf = self.buffers.get(f"momentum/{key}")
            buf = delta.clone() if buf is None else buf.mul_(self.momentum).add_(delta)
            self.buffers[f"momentum/{key}"] = buf
            return buf
        m = self.buffers.get(f"m/{key}", torch.zeros_like(delta))
        v = self.buffers.get(f"v/{key}", torch.zeros_like(delta))
        m = m.mul_(self.beta_1).add_(delta, alpha=1 - self.beta_1)
        sq = delta * delta
        if self.name == "fedadam":
            v = v.mul_(self.beta_2).add_(sq, alpha=1 - self.beta_2)
        else:  # fedyogi: additive, sign-controlled second moment
            v = v.sub_((1 - self.beta_2) * sq * torch.sign(v - sq))
        self.buffers[f"m/{key}"], self.buffers[f"v/{key}"] = m, v
        return m / (v.sqrt() + self.tau)

    def step_flat(
        self,
        params: torch.Tensor,
        update: torch.Tensor,
        layout: Sequence[tuple[str, tuple[int, ...]]],
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`step` on flat vectors: ``out = params + lr * direction(update)``, no per-key tensors.

        Parameters
        ----------
        params : torch.Tensor
            The global floating-point parameters as one ``[d]`` float32 vector (not modified).
        update : torch.Tensor
            The aggregated update, ``[d]`` (not modified: a rule may return a view on its input).
        layout : sequence of (name, shape)
            The tensors ``params`` is the concatenation of, in order: the buffers keep their
            per-key names and shapes in :attr:`buffers` (views on one vector per kind), so
            :meth:`state_dict` has the same format as after :meth:`step`.
        out : torch.Tensor, optional
            ``[d]`` float32 vector to write the new parameters into (a server reuses one across
            rounds); a new one when omitted. Must not share memory with ``params`` or ``update``.

        Returns
        -------
        torch.Tensor
            ``out``.

        Notes
        -----
        The same elementwise operations as :meth:`step`, in the same order, so the result equals
        ``flatten(step(...))`` up to float32 rounding (bit for bit for ``fedavg``; the vectorised
        kernels of the moment updates may round an element differently when the split into
        tensors moves it between a SIMD body and a scalar tail).
        """
        dim = sum(_numel(shape) for _, shape in layout)
        if params.shape != (dim,) or update.shape != (dim,):
            raise ValueError(
                f"step_flat: params {tuple(params.shape)} and update {tuple(update.shape)} must both be [{dim}]"
            )
        self.steps += 1
        delta = update.to(torch.float32)
        if out is None:
            out = torch.empty(dim, dtype=torch.float32, device=params.device)
        if self.name == "fedavg":
            direction = delta
        elif self.name == "fedavgm":
            buf = self._flat_buffer("momentum", layout, dim, delta)
            if buf is None:  # first step: the momentum starts at the update, as in step()
                buf = self._adopt("momentum", layout, delta.clone())
            else:
                buf.mul_(self.momentum).add_(delta)
            direction = buf
        else:
            m = self._flat_buffer("m", layout, dim, delta)
            m = self._adopt("m", layout, torch.zeros_like(delta)) if m is None else m
            v = self._flat_buffer("v", layout, dim, delta)
            v = self._adopt("v", layout, torch.zeros_like(delta)) if v is None else v
            m.mul_(self.beta_1).add_(delta, alpha=1 - self.beta_1)
            sq = delta * delta
            if self.name == "fedadam":
                v.mul_(self.beta_2).add_(sq, alpha=1 - self.beta_2)
            else:  # fedyogi
                v.sub_((1 - self.beta_2) * sq * torch.sign(v - sq))
            del sq
            # m / (v.sqrt() + tau), computed in ``out`` instead of two [d] temporaries.
            torch.sqrt(v, out=out)
            out.add_(self.tau)
            torch.div(m, out, out=out)
            out.mul_(self.lr)
            return out.add_(params.to(torch.float32))
        # params + lr * direction, as step() rounds it: the product first, then the sum.
        torch.mul(direction, self.lr, out=out)
        return out.add_(params.to(torch.float32))

    def _flat_buffer(
        self, kind: str, layout: Sequence[tuple[str, tuple[int, ...]]], dim: int, like: torch.Tensor
    ) -> torch.Tensor | None:
        """The ``[d]`` buffer of ``kind``, gathered from :attr:`buffers` when they are not its views.

        None when no key has a buffer of that kind yet. After :meth:`load_state_dict` (or a
        :meth:`step` that added keys) the per-key tensors are copied into a new vector once;
        keys without a buffer start at zero, which is what :meth:`step` starts them at (for
        momentum, zero times the momentum plus the update is the update).
        """
        names = [f"{kind}/{key}" for key, _ in layout]
        flat = self._flat.get(kind)
        if flat is not None and flat.numel() == dim and all(
            self.buffers.get(n) is self._views.get(n) for n in names
        ):
            return flat
        if not any(n in self.buffers for n in names):
            return None
        flat = torch.zeros(dim, dtype=torch.float32, device=like.device)
        start = 0
        for name, (_, shape) in zip(names, layout, strict=True):
            stop = start + _numel(shape)
            if name in self.buffers:
                flat[start:stop] = self.buffers[name].reshape(-1)
            start = stop
        return self._adopt(kind, layout, flat)

    def _adopt(self, kind: str, layout: Sequence[tuple[str, tuple[int, ...]]], flat: torch.Tensor) -> torch.Tensor:
        """Make ``flat`` the buffer of ``kind``; :attr:`buffers` gets per-key views on it."""
        self._flat[kind] = flat
        start = 0
        for key, shape in layout:
            stop = start + _numel(shape)
            view = flat[start:stop].view(shape)
            self.buffers[f"{kind}/{key}"] = self._views[f"{kind}/{key}"] = view
            start = stop
        return flat

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Tensors (moments) and JSON-able scalars needed to continue exactly."""
        return dict(self.buffers), {"name": self.name, "steps": self.steps}

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        if meta.get("name") != self.name:
            raise ValueError(
                f"saved server optimizer state is for {meta.get('name')!r}, this run uses {self.name!r}"
            )
        self.steps = int(meta["steps"])
        self.buffers = {k: v.clone() for k, v in tensors.items()}


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count
