"""Client-side attacks: they run inside one client (simulation and deployment) and see only its own data,
its own honest update and its own example count.

Value attacks change floating arrays only; integer arrays (BatchNorm's ``num_batches_tracked``) and every
dtype, shape and key are kept, so the reply still has the structure the server expects. ``malformed`` is
the one exception: breaking that structure is its purpose.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from fedrobust.attacks.base import Attack, check_choice, check_int, check_real, map_floating

__all__ = [
    "Gaussian",
    "InfFill",
    "LabelFlip",
    "LyingWeight",
    "Malformed",
    "NaNFill",
    "RandomUniform",
    "Scaled",
    "SignFlip",
    "Stale",
    "Zero",
]

logger = logging.getLogger(__name__)


def _draw(sampler: Callable[..., Tensor], t: Tensor, generator: torch.Generator) -> Tensor:
    """Draw noise shaped like ``t`` with ``sampler`` (``torch.randn`` or ``torch.rand``) on the generator's
    device, in float32, then move it to ``t``'s device.

    Drawing on the generator's device in one fixed dtype makes the values depend on the seed only, not on
    where the update lives or whether it is float16.
    """
    return sampler(t.shape, generator=generator, device=generator.device, dtype=torch.float32).to(t.device)


@dataclass(frozen=True)
class SignFlip(Attack):
    """Send ``-scale * update``: the reversed gradient direction.

    Parameters
    ----------
    scale : float, default 1.0
        Positive factor applied after the flip.
    start_round : int, default 0
        The first round that flips (server rounds count from 1, so 0 and 1 flip from the start);
        before it the client sends its honest update: a sleeper that first builds a record of pulling
        with the others (against defenses that remember clients).
    turn_rounds : int, default 1
        Over how many rounds from ``start_round`` the reply turns from the honest update to its
        reverse, by an equal angle each round (then stays reversed): a sleeper that turns slowly, so that
        no reply points against the client's recent ones (against the ``consistency`` filter). It turns
        in the plane of the update and the update read backwards (its coordinates in reverse order, made
        orthogonal to it): a direction of the client's own that stays much the same from round to round,
        so the turn goes on in one plane. 1: the plain flip.

    References
    ----------
    Allen-Zhu, Ebrahimian, Li, Alistarh. "Byzantine-Resilient Non-Convex Stochastic Gradient Descent."
    ICLR 2021 (sign-flipping baseline).
    """

    name: ClassVar[str] = "sign_flip"
    scale: float = 1.0
    start_round: int = 0
    turn_rounds: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale", check_real(self.name, "scale", self.scale, low=0.0))
        check_int(self.name, "start_round", self.start_round, low=0)
        check_int(self.name, "turn_rounds", self.turn_rounds, low=1)

    def poison_update(
        self, update: dict[str, Tensor], *, round: int, generator: torch.Generator
    ) -> dict[str, Tensor]:
        if round < self.start_round:
            return update
        step = max(round - max(self.start_round, 1) + 1, 1)  # rounds 0 and 1 are both a run's first
        if step >= self.turn_rounds:
            return map_floating(update, lambda t: t * -self.scale)
        return _turned(update, math.pi * step / self.turn_rounds, self.scale)


def _turned(update: dict[str, Tensor], angle: float, scale: float) -> dict[str, Tensor]:
    """The update turned by ``angle`` towards its reverse, in the plane of the update and the update read
    backwards (made orthogonal to it), at ``scale`` times its norm."""
    keys = [k for k, t in update.items() if t.is_floating_point()]
    if not keys:
        return update
    flat = torch.cat([update[k].detach().reshape(-1).to(torch.float64) for k in keys])
    norm = flat.norm()
    if norm == 0:
        return update
    along = flat / norm
    across = flat.flip(0)
    across = across - (across @ along) * along
    across = across / across.norm().clamp(min=torch.finfo(torch.float64).tiny)
    turned = scale * norm * (math.cos(angle) * along + math.sin(angle) * across)
    out, start = dict(update), 0
    for k in keys:
        t = update[k]
        out[k] = turned[start : start + t.numel()].reshape(t.shape).to(t.dtype)
        start += t.numel()
    return out


@dataclass(frozen=True)
class Scaled(Attack):
    """Boosting: send ``factor * update`` so one client outweighs many in a plain mean.

    Parameters
    ----------
    factor : float, default 10.0
        Positive boosting factor.

    References
    ----------
    Bhagoji, Chakraborty, Mittal, Calo. "Analyzing Federated Learning through an Adversarial Lens." ICML 2019.
    """

    name: ClassVar[str] = "scaled"
    factor: float = 10.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "factor", check_real(self.name, "factor", self.factor, low=0.0))

    def poison_update(
        self, update: dict[str, Tensor], *, round: int, generator: torch.Generator
    ) -> dict[str, Tensor]:
        return map_floating(update, lambda t: t * self.factor)


@dataclass(frozen=True)
class Gaussian(Attack):
    """Replace the update with draws from ``N(0, std^2)``.

    Parameters
    ----------
    std : float, default 1.0
        Standard deviation of the noise. The default is large next to a typical per-coordinate update
        (lr times a gradient, ~1e-2), so the noise dominates a plain mean.

    References
    ----------
    Blanchard, El Mhamdi, Guerraoui, Stainer. "Machine Learning with Adversaries: Byzantine Tolerant
    Gradient Descent." NeurIPS 2017 (Gaussian Byzantine workers).
    """

    name: ClassVar[str] = "gaussian"
    std: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "std", check_real(self.name, "std", self.std, low=0.0))

    def poison_update(
        self, update: dict[str, Tensor], *, round: int, generator: torch.Generator
    ) -> dict[str, Tensor]:
        return map_floating(update, lambda t: _draw(torch.randn, t, generator) * self.std)


@dataclass(frozen=True)
class RandomUniform(Attack):
    """Replace the update with uniform noise in ``[-scale, scale]``.

    Parameters
    ----------
    scale : float, default 1.0
        Half-width of the interval.
    """

    name: ClassVar[str] = "random"
    scale: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale", check_real(self.name, "scale", self.scale, low=0.0))

    def poison_update(
        self, update: dict[str, Tensor], *, round: int, generator: torch.Generator
    ) -> dict[str, Tensor]:
        return map_floating(update, lambda t: (_draw(torch.rand, t, generator) * 2.0 - 1.0) * self.scale)


@dataclass(frozen=True)
class Zero(Attack):
    """Send an all-zero update (a free-rider that trains nothing but still counts in the mean)."""

    name: ClassVar[str] = "zero"

    def poison_update(
        self, update: dict[str, Tensor], *, round: int, generator: torch.Generator
    ) -> dict[str, Tensor]:
        return map_floating(update, torch.zeros_like)


@dataclass(frozen=True)
class _Fill(Attack):
    """Overwrite a fraction of each floating array's coordinates with a non-finite ``value``.

    Exactly ``ceil(fraction * numel)`` coordinates per array, chosen by the generator, so even a small
    fraction always yields non-finite values that the server's finiteness check must catch.
    """

    value: ClassVar[float]
    fraction: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "fraction", check_real(self.name, "fraction", self.fraction, low=0.0, high=1.0)
        )

    def _fill(self, t: Tensor, generator: torch.Generator) -> Tensor:
        if self.fraction == 1.0:
            return torch.full_like(t, self.value)
        out = t.clone().reshape(-1)
        k = math.ceil(self.fraction * out.numel())
        idx = torch.randperm(out.numel(), generator=generator, device=generator.device)[:k]
        out[idx.to(out.device)] = self.value
        return out.reshape(t.shape)

    def poison_update(
        self, update: dict[str, Tensor], *, round: int, generator: torch.Generator
    ) -> dict[str, Tensor]:
        return map_floating(update, lambda t: self._fill(t, generator))


@dataclass(frozen=True)
class NaNFill(_Fill):
    """Send NaN in ``fraction`` of the coordinates of every floating array (default: all of them).

    Parameters
    ----------
    fraction : float, default 1.0
        Share of coordinates per array, in ``(0, 1]``.
    """

    name: ClassVar[str] = "nan"
    value: ClassVar[float] = math.nan


@dataclass(frozen=True)
class InfFill(_Fill):
    """Send ``+inf`` in ``fraction`` of the coordinates of every floating array (default: all of them).

    Parameters
    ----------
    fraction : float, default 1.0
        Share of coordinates per array, in ``(0, 1]``.
    """

    name: ClassVar[str] = "inf"
    value: ClassVar[float] = math.inf


@dataclass(frozen=True)
class LabelFlip(Attack):
    """Data poisoning: train on labels ``y -> num_classes - 1 - y``; the update is then honest for that data.

    References
    ----------
    Tolpegin, Truex, Gursoy, Liu. "Data Poisoning Attacks Against Federated Learning Systems." ESORICS 2020.
    """

    name: ClassVar[str] = "label_flip"

    def poison_data(
        self, x: Tensor, y: Tensor, *, num_classes: int, generator: torch.Generator
    ) -> tuple[Tensor, Tensor]:
        check_int(self.name, "num_classes", num_classes, low=1)
        if y.is_floating_point() or y.is_complex():
            raise ValueError(f"attack {self.name!r}: labels must be an integer tensor, got dtype {y.dtype}")
        if y.numel() and (int(y.min()) < 0 or int(y.max()) >= num_classes):
            raise ValueError(
                f"attack {self.name!r}: labels must lie in [0, {num_classes}), "
                f"got range [{int(y.min())}, {int(y.max())}]"
            )
        return x, num_classes - 1 - y


_MALFORMED_MODES = ("shape", "dtype", "keys")


@dataclass(frozen=True)
class Malformed(Attack):
    """Send an update with the wrong structure, to exercise the server's structure validation.

    Values are left alone; exactly one structural property is broken, always on the first array in the
    update's order:

    - ``"shape"``: that array gets one extra element (flattened, a zero appended);
    - ``"dtype"``: that array is cast to float64 (float32 if it already is float64);
    - ``"keys"``: that array is sent under a renamed key, so one expected key is missing and one is extra.

    Parameters
    ----------
    mode : {"shape", "dtype", "keys"}, default "shape"
        Which property to break.
    """

    name: ClassVar[str] = "malformed"
    mode: str = "shape"

    def __post_init__(self) -> None:
        check_choice(self.name, "mode", self.mode, _MALFORMED_MODES)

    def poison_update(
        self, update: dict[str, Tensor], *, round: int, generator: torch.Generator
    ) -> dict[str, Tensor]:
        if not update:
            raise ValueError(f"attack {self.name!r}: the update has no arrays to malform")
        target = next(iter(update))
        out: dict[str, Tensor] = {}
        for key, t in update.items():
            if key != target:
                out[key] = t
            elif self.mode == "shape":
                out[key] = torch.cat([t.reshape(-1), t.new_zeros(1)])
            elif self.mode == "dtype":
                out[key] = t.to(torch.float32 if t.dtype == torch.float64 else torch.float64)
            else:
                out[f"{key}.malformed"] = t
        return out


_STATE_PREFIX, _STATE_ROUND = "update.", "captured_round"


@dataclass
class Stale(Attack):
    """Replay an old update: keep the update of one round and send it again in every later round.

    Stateful: the instance remembers the captured update, so keep one instance per client for the client's
    lifetime, or carry :meth:`state_dict` from round to round where the client process does not live that
    long. Until and including the capture round the client behaves honestly.

    Parameters
    ----------
    capture_round : int or None, default None
        Capture the update of the first round at or after this one that the client takes part in (a sampled
        client may skip rounds); ``None`` captures the first round it takes part in.
    """

    name: ClassVar[str] = "stale"
    capture_round: int | None = None
    _captured: dict[str, Tensor] | None = field(default=None, init=False, repr=False)
    _captured_at: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.capture_round is not None:
            check_int(self.name, "capture_round", self.capture_round, low=0)

    def poison_update(
        self, update: dict[str, Tensor], *, round: int, generator: torch.Generator
    ) -> dict[str, Tensor]:
        if self._captured is not None and self._captured_at is not None and round > self._captured_at:
            # Clones, so a caller that edits the reply in place cannot change what later rounds replay.
            return {key: t.clone() for key, t in self._captured.items()}
        if self._captured is None and (self.capture_round is None or round >= self.capture_round):
            self._captured = {key: t.detach().clone() for key, t in update.items()}
            self._captured_at = round
            logger.debug("stale: captured the update of round %d for replay", round)
        return update

    def state_dict(self) -> dict[str, Tensor]:
        """The captured update under ``update.<key>``, its round under ``captured_round``; ``{}`` before."""
        if self._captured is None:
            return {}
        state = {f"{_STATE_PREFIX}{key}": t.clone() for key, t in self._captured.items()}
        state[_STATE_ROUND] = torch.tensor(self._captured_at, dtype=torch.int64)
        return state

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        if not state:
            self._captured, self._captured_at = None, None
            return
        unexpected = sorted(k for k in state if k != _STATE_ROUND and not k.startswith(_STATE_PREFIX))
        if _STATE_ROUND not in state or unexpected:
            raise ValueError(
                f"attack {self.name!r}: state needs {_STATE_ROUND!r} and '{_STATE_PREFIX}<key>' entries "
                f"only, got keys {sorted(state)}"
            )
        self._captured = {
            key[len(_STATE_PREFIX) :]: t.detach().clone() for key, t in state.items() if key != _STATE_ROUND
        }
        self._captured_at = int(state[_STATE_ROUND])


@dataclass(frozen=True)
class LyingWeight(Attack):
    """Report ``factor`` times the true number of examples, inflating this client's weight in a weighted mean.

    Parameters
    ----------
    factor : float, default 100.0
        Positive multiplier; the reported count is rounded to the nearest integer.
    """

    name: ClassVar[str] = "lying_weight"
    factor: float = 100.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "factor", check_real(self.name, "factor", self.factor, low=0.0))

    def poison_num_examples(self, num_examples: int) -> int:
        return round(num_examples * self.factor)
