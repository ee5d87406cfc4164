"""The omniscient, colluding adversary of simulation (ALIE, IPM, mimic, min-max, min-sum).

It sees every honest update of the round, which no real attacker on a device
can, so it lives here and is installed only by the simulation entry point as
the strategy's ``update_hook``. The Byzantine clients mark their replies
(``sim-byzantine``); the hook replaces those rows with crafted ones before the
server validates and aggregates them, as if the clients had sent them.
"""

from __future__ import annotations

import torch

from fedrobust import attacks
from fedrobust.config import RunConfig
from fedrobust.tensors import flatten, float_keys, unflatten
from fedrobust.training import derive_seed
from fedrobust.strategies.robust_strategy import ClientUpdate, UpdateHook


def omniscient_hook(cfg: RunConfig) -> UpdateHook | None:
    """The hook for ``cfg.attack`` when it is omniscient, else None."""
    if cfg.attack.name not in attacks.omniscient_names() or cfg.num_byzantine == 0:
        return None
    attack = attacks.build(cfg.attack.name, **cfg.attack.params)

    def craft(server_round: int, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        honest = [u for u in updates if not u.sim_byzantine]
        byzantine = [u for u in updates if u.sim_byzantine]
        if not honest or not byzantine:
            return updates
        keys = float_keys(honest[0].update)
        generator = torch.Generator().manual_seed(derive_seed(cfg.seed, server_round, -1))
        rows = attack.craft(flatten([u.update for u in honest], keys), f=len(byzantine), generator=generator)
        for update, row in zip(byzantine, rows):
            update.update = {**update.update, **unflatten(row, update.update, keys)}
        return updates

    return craft
