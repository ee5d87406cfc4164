"""The attack interface and the helpers the attacks share.

An attack is a small object that overrides only the hooks it touches; every hook defaults to honest
behaviour. Client-side attacks (``omniscient = False``) run inside one client process and see only that
client's own data and update; omniscient attacks (``omniscient = True``) are a simulation-only model of a
colluding adversary who sees every honest update of the round and crafts the Byzantine rows from them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from fedrobust.text import did_you_mean

__all__ = ["Attack", "check_choice", "check_int", "check_real", "map_floating"]


class Attack:
    """Base class of every attack; each hook is the honest identity (a plain ``Attack()`` is honest).

    Attributes
    ----------
    name : str
        Registry name of the attack.
    omniscient : bool
        ``True`` when the attack needs every honest update of the round (:meth:`craft`, simulation only);
        ``False`` when it runs inside a client (data, update and num-examples hooks, also in deployment).
    needs_server_update : bool
        ``True`` when the attack also needs the server's own update of the round, which only rules like
        FLTrust compute: it crafts in :meth:`craft_round` only, given ``server_update``. A class
        attribute for attacks written against FLTrust; the tuned attacks set it per instance, from the
        rule they are tuned to.
    needs_global_model : bool
        ``True`` when the attack crafts local models rather than updates, so it needs the round's global
        model: it crafts in :meth:`craft_round` only, given ``global_model`` (Fang's attack on the
        trimmed mean in ``space="model"`` sets it per instance).
    """

    name: ClassVar[str] = "honest"
    omniscient: ClassVar[bool] = False
    needs_server_update: ClassVar[bool] = False
    needs_global_model: ClassVar[bool] = False

    def poison_data(
        self, x: Tensor, y: Tensor, *, num_classes: int, generator: torch.Generator
    ) -> tuple[Tensor, Tensor]:
        """Transform a client's training set before local training.

        Parameters
        ----------
        x, y : Tensor
            Inputs and integer labels in ``[0, num_classes)``.
        num_classes : int
            Number of classes of the task.
        generator : torch.Generator
            Source of every random draw.

        Returns
        -------
        tuple[Tensor, Tensor]
            The (possibly poisoned) inputs and labels; the identity here.
        """
        return x, y

    def poison_update(
        self, update: dict[str, Tensor], *, round: int, generator: torch.Generator
    ) -> dict[str, Tensor]:
        """Replace or alter a client's honest update (local minus global weights).

        Parameters
        ----------
        update : dict[str, Tensor]
            The honest update, one tensor per model array. It is never modified in place.
        round : int
            The current server round.
        generator : torch.Generator
            Source of every random draw.

        Returns
        -------
        dict[str, Tensor]
            The update to send; the identity here.
        """
        return update

    def poison_num_examples(self, num_examples: int) -> int:
        """Return the number of examples the client reports (its aggregation weight); the identity here."""
        return num_examples

    def state_dict(self) -> dict[str, Tensor]:
        """State carried between rounds, as tensors, so a client can persist it where its process does not
        survive the round (e.g. in Flower's per-node context state); ``{}`` for stateless attacks."""
        return {}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises
        ------
        ValueError
            When ``state`` does not fit this attack (for a stateless attack: when it is not empty).
        """
        if state:
            raise ValueError(f"attack {self.name!r} is stateless; got state keys {sorted(state)}")

    def craft(self, honest: Tensor, *, f: int, generator: torch.Generator) -> Tensor:
        """Craft the ``f`` Byzantine rows from the ``h`` honest flattened updates (omniscient attacks only).

        Parameters
        ----------
        honest : Tensor
            Floating tensor of shape ``[h, d]``, one flattened honest update per row.
        f : int
            Number of Byzantine rows to return; the round has ``n = h + f`` clients.
        generator : torch.Generator
            Source of every random draw.

        Returns
        -------
        Tensor
            Shape ``[f, d]``, same dtype and device as ``honest``.

        Raises
        ------
        NotImplementedError
            For client-side attacks, which have no omniscient form: they act through the other hooks.
        """
        raise NotImplementedError(
            f"attack {self.name!r} is a client-side attack and cannot craft updates from the honest ones; "
            "call craft() only for attacks with omniscient=True"
        )

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
        """Craft the Byzantine rows of one round seen whole (omniscient attacks only).

        What the simulation's adversary calls each round. An attack that follows the server across rounds
        (its memory of clients) overrides it; the others craft from the honest rows alone (:meth:`craft`).

        Parameters
        ----------
        rows : Tensor
            ``[n, d]``: every accepted row of the round in the server's aggregation order, the Byzantine
            ones as their clients computed them. Not modified.
        byzantine : Tensor
            ``[n]`` bool mask of the Byzantine rows (at least one, not all).
        clients : sequence of int
            The id of each row's client that the server's aggregator remembers clients by.
        generator : torch.Generator
            Source of every random draw.
        server_update : Tensor or None
            The server's own update of the round (``[d]``) where the rule uses one (FLTrust), else None;
            an attacker with full knowledge of the server knows it.
        global_model : Tensor or None
            The global model the round's clients were sent (``[d]``, the rows' layout), for attacks stated
            on local models rather than updates (Fang's on the trimmed mean in ``space="model"``); every
            client knows it.

        Returns
        -------
        Tensor
            ``[f, d]`` for the ``f`` Byzantine rows, in their order in ``rows``.
        """
        return self.craft(rows[~byzantine], f=int(byzantine.sum()), generator=generator)


def missing_server_update(attack: str) -> ValueError:
    """The error of an attack that needs the server's own update of the round and has none."""
    return ValueError(
        f"attack {attack!r} needs the server's own update of the round (FLTrust's g0): run it against "
        "aggregator=fltrust, whose server computes one; other rules have none to give it"
    )


def server_update_of(attack: str, server_update: Tensor | None, d: int) -> Tensor:
    """``server_update`` checked for an attack that needs it: given, and ``[d]`` like the honest rows."""
    if server_update is None:
        raise missing_server_update(attack)
    if server_update.shape != (d,):
        raise ValueError(
            f"attack {attack!r}: the server update has shape {tuple(server_update.shape)}, the honest rows have d={d}"
        )
    return server_update


def map_floating(update: Mapping[str, Tensor], fn: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
    """Apply ``fn`` to every floating tensor of ``update`` and keep the others.

    Integer arrays (e.g. BatchNorm's ``num_batches_tracked``) are counters, not parameters: a value attack
    that wrote floats or NaN into them would break their dtype, so they pass through unchanged. Each result
    is cast back to its input's dtype and device so the structure the server checks is kept.
    """
    return {
        key: fn(t).to(dtype=t.dtype, device=t.device) if t.is_floating_point() else t
        for key, t in update.items()
    }


def _fail(attack: str, param: str, allowed: str, value: Any) -> ValueError:
    return ValueError(f"attack {attack!r}: parameter {param!r} must be {allowed}, got {value!r}")


def check_real(
    attack: str, param: str, value: Any, *, low: float | None = None, high: float | None = None,
    low_open: bool = True,
) -> float:
    """Validate a finite real parameter in an interval and return it as ``float``.

    ``low`` is exclusive when ``low_open`` (the default), inclusive otherwise; ``high`` is inclusive.
    Booleans are refused even though Python treats them as integers: ``scale=True`` is a config mistake.
    """
    bounds = []
    if low is not None:
        bounds.append(f"{'>' if low_open else '>='} {low}")
    if high is not None:
        bounds.append(f"<= {high}")
    allowed = "a finite real number" + (" " + " and ".join(bounds) if bounds else "")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _fail(attack, param, allowed, value)
    if low is not None and (value <= low if low_open else value < low):
        raise _fail(attack, param, allowed, value)
    if high is not None and value > high:
        raise _fail(attack, param, allowed, value)
    return float(value)


def check_int(attack: str, param: str, value: Any, *, low: int = 0) -> int:
    """Validate an integer parameter ``>= low`` and return it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _fail(attack, param, f"an integer >= {low}", value)
    return value


def check_choice(attack: str, param: str, value: Any, choices: Collection[str]) -> str:
    """Validate a string parameter against its allowed values and return it."""
    if value not in choices:
        error = _fail(attack, param, "one of " + ", ".join(repr(c) for c in choices), value)
        raise ValueError(f"{error}{did_you_mean(value, choices)}")
    return value
