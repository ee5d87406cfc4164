"""The Byzantine side of a client: an honest client whose data or reply an attack poisons.

Only a ClientApp that plays attacks consults it: the Byzantine ClientApp
(``fedrobust.clients.byzantine_app:app``, robustness drills) and simulations
built from a RunConfig (``make_client_app(cfg)``); the honest app that
``flwr run .`` ships never does. There, a node is Byzantine when its own node
config says ``attack=...`` (a drill on real devices), or when ``cfg.attack`` is
set and its partition is one of the ``num_byzantine`` partitions drawn from the
seed (simulation). Omniscient attacks need
every honest update of the round, so the client only marks its reply and the
simulation-only hook (experiments/adversary.py) crafts the update on the server.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from flwr.app import ArrayRecord, Context
from torch.utils.data import TensorDataset

from fedrobust import attacks, components, protocol
from fedrobust.config import RunConfig
from fedrobust.run_setup import byzantine_partitions

ATTACK_STATE = "attack-state"


@dataclass
class Adversary:
    attack: attacks.Attack
    num_classes: int

    def save_state(self, context: Context) -> None:
        """Keep a stateful attack's memory (e.g. ``stale``'s captured update) in the node's context.

        A simulated node's ClientApp object does not survive between rounds; its
        ``context.state`` does.
        """
        state = self.attack.state_dict()
        if state:
            context.state[ATTACK_STATE] = ArrayRecord({k: v.contiguous() for k, v in state.items()})

    def poison_data(self, dataset: TensorDataset, *, seed: int) -> TensorDataset:
        x, y = dataset.tensors
        x, y = self.attack.poison_data(x, y, num_classes=self.num_classes, generator=_generator(seed))
        return TensorDataset(x, y)

    def poison_reply(
        self, update: Mapping[str, torch.Tensor], num_examples: int, server_round: int, *, seed: int = 0
    ) -> tuple[dict[str, torch.Tensor], int, dict[str, float]]:
        """The reply this client sends instead of its honest one, and flags for the server."""
        if self.attack.omniscient:
            return dict(update), num_examples, {protocol.SIM_BYZANTINE: 1}
        poisoned = self.attack.poison_update(dict(update), round=server_round, generator=_generator(seed))
        return poisoned, self.attack.poison_num_examples(num_examples), {}


def _generator(seed: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


def adversary_for(cfg: RunConfig, context: Context, partition_id: int) -> Adversary | None:
    """The adversary this node plays, or None for an honest node."""
    name = context.node_config.get("attack")  # a deployment drill's device: a built-in, by name
    if name:
        attack = attacks.build(str(name)) if name != "none" else None
    elif partition_id in byzantine_partitions(cfg):
        attack = components.build_attack(cfg)
    else:
        attack = None
    if attack is None:
        return None
    saved = context.state.array_records.get(ATTACK_STATE)
    if saved is not None:
        attack.load_state_dict(dict(saved.to_torch_state_dict()))
    return Adversary(attack, components.dataset_spec(cfg).num_classes)
