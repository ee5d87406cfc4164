"""The omniscient, colluding adversary of simulation (ALIE, IPM, mimic, min-max, min-sum, Fang's, the tuned ones).

It sees every honest update of the round, which no real attacker on a device
can, so it lives here and is installed only by the simulation entry point as
the strategy's ``update_hook``. The Byzantine clients mark their replies
(``sim-byzantine``); the hook overwrites those rows of the server's update
matrix with crafted ones before the server aggregates them, as if the clients
had sent them. The server checks the rewritten rows again (finiteness, norm
bound), as it checked what the clients sent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import torch

from fedrobust import attacks, components
from fedrobust.config import RunConfig
from fedrobust.strategies.robust_strategy import RoundUpdates, UpdateHook
from fedrobust.training import derive_seed

# Sees each round's honest rows and the crafted ones: (server round, honest [h, d], crafted [f, d]).
CraftObserver = Callable[[int, torch.Tensor, torch.Tensor], None]


def attack_for(cfg: RunConfig) -> attacks.Attack | None:
    """``cfg.attack`` built (None for ``none``); an attack that follows the server's memory gets the server's
    whole pipeline.

    Such an attacker must run the server's very pipeline: the stages ``aggregator.pre`` lists in front
    of ``aggregator.name``'s, and the parameters of ``aggregator.pre_params``, which ``conf/attack`` does
    not pass (``rule_pre_params`` given in the attack's own params take precedence). Without ``memory``
    the attack keeps its own model of the rule (a rule of the user's own is modelled with the stages
    ``aggregator.pre`` lists in front of it: :func:`fedrobust.components.tuned_rule`).
    """
    attack = components.build_attack(cfg)
    follows_server = getattr(attack, "memory", False) and getattr(attack, "rule", None) == components.tuned_rule(cfg)
    if follows_server:
        stages = cfg.pre_aggregators()
        given = {stage: dict(params) for stage, params in cfg.aggregator.pre_params.items() if stage in stages}
        own = getattr(attack, "rule_pre_params", {})
        pipeline = "+".join([*stages, cfg.rule()])
        attack = dataclasses.replace(cast(Any, attack), rule=pipeline, rule_pre_params={**given, **own})
    return attack


def omniscient_hook(cfg: RunConfig, observe: CraftObserver | None = None) -> UpdateHook | None:
    """The hook for ``cfg.attack`` when it is omniscient, else None; ``observe`` sees every round's craft."""
    attack = attack_for(cfg) if cfg.num_byzantine > 0 else None
    if attack is None or not attack.omniscient:
        return None

    def craft(updates: RoundUpdates) -> list[int]:
        """Overwrite the Byzantine rows of ``updates.rows`` in place; return their indices."""
        rows, byzantine = updates.rows, updates.byzantine
        targets = torch.nonzero(byzantine).flatten().tolist()
        if not targets or len(targets) == rows.shape[0]:
            return []
        generator = torch.Generator().manual_seed(derive_seed(cfg.seed, updates.round, -1))
        # The rows change only once the attack has returned (craft_round does not modify them).
        crafted = attack.craft_round(
            rows,
            byzantine,
            updates.clients,
            generator=generator,
            server_update=updates.server_update,
            global_model=updates.global_model,
        )
        if tuple(crafted.shape) != (len(targets), rows.shape[1]):  # else broadcast, or a torch shape error
            raise ValueError(
                f"attack {cfg.attack.label}: round {updates.round}: craft_round returned shape "
                f"{tuple(crafted.shape)} for {len(targets)} Byzantine rows of {rows.shape[1]} coordinates; "
                f"expected ({len(targets)}, {rows.shape[1]})"
            )
        if observe is not None:
            observe(updates.round, rows[~byzantine], crafted)
        rows[targets] = crafted.to(rows.dtype)
        return targets

    return craft
