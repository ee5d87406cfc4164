"""Backdoor (trigger-patch) data poisoning and the attack success rate that measures it.

A backdoor attacker wants a model that is accurate on clean inputs (so nobody notices) but predicts its
``target`` class for any input that carries a trigger. Like label flipping, the attack acts on the client's
training data: it stamps a small bright patch on a fraction of its inputs and relabels them to the target;
the update is then honest training on that data, optionally boosted (model replacement, Bagdasaryan et al.:
scaling the update by about n / (number of attackers) so that it survives averaging).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from fedrobust.attacks.base import Attack, check_int, check_real, map_floating

__all__ = ["Backdoor", "stamp_trigger", "triggered_test_set"]


def stamp_trigger(x: Tensor, *, size: int = 2, value: float | None = None) -> Tensor:
    """A copy of the inputs ``x`` with a ``size`` x ``size`` patch set to ``value`` in each image's
    bottom-right corner.

    Where the patch goes, by the inputs' shape ``[b, ...]``:

    - ``[b, ..., H, W]`` (images, e.g. ``[b, C, H, W]`` or ``[b, H, W]``): the last ``size`` rows and
      columns, in every channel;
    - ``[b, D]`` with ``D`` a perfect square (digits' 8x8 pixels flattened to 64): the same corner of the
      ``sqrt(D)`` x ``sqrt(D)`` image;
    - ``[b, D]`` otherwise: the last ``size * size`` features (all of them when ``D`` is smaller).

    Parameters
    ----------
    x : Tensor
        Float inputs, batch first.
    size : int
        Side of the square patch, in pixels.
    value : float, optional
        Pixel value of the patch; ``None`` takes the largest value in ``x`` (a full-bright pixel whatever
        the normalisation).

    Raises
    ------
    ValueError
        For non-float inputs, inputs without a feature dimension, or a patch larger than the images.
    """
    if not x.is_floating_point() or x.dim() < 2:
        raise ValueError(f"stamp_trigger: inputs must be a float tensor [batch, ...], got {x.dtype} {tuple(x.shape)}")
    fill = float(x.max()) if value is None and x.numel() else float(value or 0.0)
    out = x.clone()
    if x.dim() >= 3:
        view = out
    else:
        side = math.isqrt(x.shape[1])
        if side * side == x.shape[1]:
            view = out.view(x.shape[0], side, side)
        else:
            out[:, -size * size :] = fill  # all features when there are fewer
            return out
    if size > view.shape[-1] or size > view.shape[-2]:
        raise ValueError(f"stamp_trigger: a {size}x{size} patch does not fit images of {tuple(view.shape[-2:])}")
    view[..., -size:, -size:] = fill
    return out


def triggered_test_set(x: Tensor, y: Tensor, *, target: int, size: int = 2, value: float | None = None) -> tuple[
    Tensor, Tensor
]:
    """The inputs of ``(x, y)`` whose true label is not ``target``, stamped, all labelled ``target``.

    A model's accuracy on this set is the backdoor's **attack success rate**: the fraction of triggered
    inputs of other classes that it classifies as the target. Inputs already of the target class are left
    out, as they would count as successes without any backdoor. With ``value=None`` the patch takes the
    largest value of all of ``x`` (the same for every input).
    """
    keep = y != target
    fill = float(x.max()) if value is None and x.numel() else value
    stamped = stamp_trigger(x[keep], size=size, value=fill)
    return stamped, torch.full((stamped.shape[0],), target, dtype=y.dtype)


@dataclass(frozen=True)
class Backdoor(Attack):
    """Trigger-patch backdoor: stamp a patch on ``fraction`` of the training inputs and relabel them ``target``.

    The poisoned samples are drawn from the generator, so each round's choice depends on the seed only. The
    client keeps the clean copies of the others, so its model stays accurate on clean data. With ``boost``
    above 1 the update is multiplied by it before it is sent (model replacement); the server's norm bound
    (``validation.max_update_norm``) and norm-aware rules are then what stands in the way.

    Parameters
    ----------
    target : int, default 0
        The class triggered inputs should be classified as.
    fraction : float, default 0.5
        Share of the client's training inputs that are stamped and relabelled, in ``(0, 1]``.
    size : int, default 2
        Side of the square patch in pixels (see :func:`stamp_trigger`).
    value : float or None, default None
        Pixel value of the patch; ``None`` is the largest input value (a full-bright pixel).
    boost : float, default 1.0
        Factor applied to the update (model-replacement boosting); 1 sends the trained update as it is.

    References
    ----------
    Gu, Dolan-Gavitt, Garg. "BadNets: Identifying Vulnerabilities in the Machine Learning Model Supply Chain."
    2017 (trigger patches). Bagdasaryan, Veit, Hua, Estrin, Shmatikov. "How To Backdoor Federated Learning."
    AISTATS 2020 (model replacement).
    """

    name: ClassVar[str] = "backdoor"
    target: int = 0
    fraction: float = 0.5
    size: int = 2
    value: float | None = None
    boost: float = 1.0

    def __post_init__(self) -> None:
        check_int(self.name, "target", self.target, low=0)
        object.__setattr__(self, "fraction", check_real(self.name, "fraction", self.fraction, low=0.0, high=1.0))
        check_int(self.name, "size", self.size, low=1)
        if self.value is not None:
            object.__setattr__(self, "value", check_real(self.name, "value", self.value))
        object.__setattr__(self, "boost", check_real(self.name, "boost", self.boost, low=0.0))

    def poison_data(
        self, x: Tensor, y: Tensor, *, num_classes: int, generator: torch.Generator
    ) -> tuple[Tensor, Tensor]:
        check_int(self.name, "num_classes", num_classes, low=1)
        if self.target >= num_classes:
            raise ValueError(
                f"attack {self.name!r}: parameter 'target' must be a class in [0, {num_classes}), got {self.target}"
            )
        if y.is_floating_point() or y.is_complex():
            raise ValueError(f"attack {self.name!r}: labels must be an integer tensor, got dtype {y.dtype}")
        count = math.ceil(self.fraction * x.shape[0])
        chosen = torch.randperm(x.shape[0], generator=generator, device=generator.device)[:count].to(x.device)
        x, y = x.clone(), y.clone()
        fill = self.value if self.value is not None or not x.numel() else float(x.max())
        x[chosen] = stamp_trigger(x[chosen], size=self.size, value=fill)
        y[chosen] = self.target
        return x, y

    def poison_update(
        self, update: dict[str, Tensor], *, round: int, generator: torch.Generator
    ) -> dict[str, Tensor]:
        if self.boost == 1.0:
            return update
        return map_floating(update, lambda t: t * self.boost)

    def triggered_test_set(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """:func:`triggered_test_set` with this attack's trigger: the set its success rate is measured on."""
        return triggered_test_set(x, y, target=self.target, size=self.size, value=self.value)
