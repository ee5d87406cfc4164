"""Byzantine behaviours, built by name.

>>> from fedrobust import attacks
>>> attacks.build("sign_flip", scale=2.0)
SignFlip(scale=2.0)

Client-side attacks (:func:`client_names`) run inside a client, in simulation and in deployment; omniscient
ones (:func:`omniscient_names`) craft the Byzantine updates from all honest ones and exist only in
simulation. See :class:`Attack` for the hooks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fedrobust.attacks.backdoor import Backdoor
from fedrobust.attacks.base import Attack
from fedrobust.attacks.client import (
    Gaussian,
    InfFill,
    LabelFlip,
    LyingWeight,
    Malformed,
    NaNFill,
    RandomUniform,
    Scaled,
    SignFlip,
    Stale,
    Zero,
)
from fedrobust.attacks.fang import FangKrum, FangTrimmedMean
from fedrobust.attacks.fltrust import FLTrustAdaptive
from fedrobust.attacks.omniscient import ALIE, IPM, Mimic, MinMax, MinSum, alie_z
from fedrobust.attacks.optimal import OptimalALIE, OptimalFang, OptimalIPM, OptimalMix, OptimalSearch
from fedrobust.attacks.rop import ROP
from fedrobust.text import did_you_mean

__all__ = ["Attack", "alie_z", "build", "client_names", "names", "omniscient_names"]

_REGISTRY: dict[str, type[Attack]] = {
    cls.name: cls
    for cls in (
        SignFlip, Scaled, Gaussian, Zero, NaNFill, InfFill, LabelFlip, RandomUniform, Malformed, Stale,
        LyingWeight, ALIE, IPM, Mimic, MinMax, MinSum, FangKrum, FangTrimmedMean, OptimalALIE, OptimalIPM,
        OptimalFang, OptimalMix, OptimalSearch, ROP, FLTrustAdaptive, Backdoor,
    )
}


def names() -> list[str]:
    """Every registered attack name, sorted."""
    return sorted(_REGISTRY)


def client_names() -> list[str]:
    """Attacks that run inside a client (also in deployment), sorted."""
    return [name for name in names() if not _REGISTRY[name].omniscient]


def omniscient_names() -> list[str]:
    """Attacks that need every honest update of the round (simulation hook only), sorted."""
    return [name for name in names() if _REGISTRY[name].omniscient]


def build(name: str, **params: Any) -> Attack:
    """Build the attack registered as ``name``.

    Parameters
    ----------
    name : str
        One of :func:`names`.
    **params
        The attack's parameters (see each attack's docstring); omitted ones take their defaults.

    Returns
    -------
    Attack
        A fresh instance; stateful attacks (``stale``) need one instance per client.

    Raises
    ------
    ValueError
        For an unknown name (listing the valid ones), an unknown parameter (listing the attack's parameters)
        or an invalid value (naming the attack, the parameter and what is allowed).
    """
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown attack {name!r}{did_you_mean(name, names())}; valid attacks: {', '.join(names())}")
    assert dataclasses.is_dataclass(cls), cls  # every registered attack is a dataclass
    allowed = [fld.name for fld in dataclasses.fields(cls) if fld.init]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(
            f"attack {name!r}: unknown parameter(s) {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(allowed) if allowed else 'none'}"
        )
    return cls(**params)
