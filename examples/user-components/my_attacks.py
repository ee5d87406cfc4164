"""A user's own attacks for fedrobust, named in a config by attack._target_.

An attack subclasses fedrobust.attacks.Attack and overrides only the hooks it uses; every other hook
stays honest. A client-side attack runs inside each Byzantine client (simulation, `flwr run` drills);
an omniscient one (omniscient = True) sees every honest update of the round and runs on the server
in Hydra simulation only.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch

from fedrobust.attacks import Attack
from fedrobust.attacks.base import map_floating


@dataclass(frozen=True)
class ScaledReverse(Attack):
    """Client-side: send the honest update reversed and scaled, ``factor`` times it (factor < 0)."""

    name: ClassVar[str] = "scaled_reverse"
    factor: float = -4.0

    def __post_init__(self) -> None:
        if not self.factor < 0:
            raise ValueError(f"factor must be negative (a reversed update), got {self.factor}")

    def poison_update(self, update: dict[str, torch.Tensor], *, round: int, generator: torch.Generator):
        # map_floating leaves integer arrays (BatchNorm's counters) as they are.
        return map_floating(update, lambda t: self.factor * t)


@dataclass(frozen=True)
class AgainstTheMean(Attack):
    """Omniscient: every Byzantine row is ``-scale`` times the mean of the honest rows of the round."""

    name: ClassVar[str] = "against_the_mean"
    omniscient: ClassVar[bool] = True
    scale: float = 3.0

    def craft(self, honest: torch.Tensor, *, f: int, generator: torch.Generator) -> torch.Tensor:
        return (-self.scale * honest.mean(dim=0)).expand(f, -1).clone()
