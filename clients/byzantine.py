"""The Byzantine side of a client: an honest client whose data or reply an attack poisons.

Only a ClientApp that plays attacks consults it: the Byzantine ClientApp
(``fedrobust.clients.byzantine_app:app``, robustness drills) and simulations
built from a RunConfig (``make_client_app(cfg)``); the honest app that
``flwr run .`` ships never does. There, a node is Byzantine when its own node
config names an attack (``attack=...`` or ``attack._target_=...``, a drill on real devices), or when ``cfg.attack`` is
set and its partition is one of the ``num_byzantine`` partitions drawn from the
seed (simulation). Omniscient attacks need
every honest update of the round, so the client only marks its reply and the
simulation-only hook (experiments/adversary.py) crafts the update on the server.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from flwr.app import ArrayRecord, Context
from torch.utils.data import TensorDataset

from fedrobust import attacks, components, protocol
from fedrobust.config import AttackConfig, ConfigError, RunConfig, from_flat
from fedrobust.run_setup import byzantine_partitions
from fedrobust.text import did_you_mean

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


# The node config's keys of an attack: the run config's, with `attack` itself for a built-in's name.
_NODE_ATTACK_KEYS = ("attack", "attack.name", "attack._target_", "attack.params")


def node_attack_config(context: Context) -> AttackConfig | None:
    """The attack a device's node config names, or None when it names none (the run config then decides).

    The node config takes the run config's keys: ``attack='sign_flip'`` (or ``attack.name``) for a
    built-in, ``attack._target_='my_pkg.attacks.MyAttack'`` for a user's, and ``attack.params``
    (``'{"factor": 2.0}'``, or one ``attack.params.<name>`` each) for either's parameters.

    Raises
    ------
    ValueError
        Naming the node config's key and what is allowed.
    """
    flat = {key: value for key, value in context.node_config.items() if key == "attack" or key.startswith("attack.")}
    if not flat:
        return None
    for key in flat:
        if key not in _NODE_ATTACK_KEYS and not key.startswith("attack.params."):
            raise ValueError(
                f"node config key {key!r} is unknown{did_you_mean(key, _NODE_ATTACK_KEYS)}; an attack's keys are "
                + ", ".join(_NODE_ATTACK_KEYS) + " and attack.params.<name>"
            )
    if "attack" in flat:
        flat["attack.name"] = flat.pop("attack")
    try:
        return from_flat(flat).attack
    except ConfigError as err:
        raise ValueError("node config: " + "; ".join(err.problems)) from None


def _node_attack(cfg: RunConfig, attack_cfg: AttackConfig) -> attacks.Attack | None:
    """The attack of a drill device: built as the run config's would be, and client-side only."""
    client_side = ", ".join(attacks.client_names())
    if "." in attack_cfg.name:
        raise ValueError(
            f"node config attack={attack_cfg.name!r}: a built-in's name; a user attack goes in "
            f"attack._target_={attack_cfg.name!r}"
        )
    if not attack_cfg._target_ and attack_cfg.name not in ("none", *attacks.names()):
        raise ValueError(
            f"node config attack {attack_cfg.name!r} is unknown{did_you_mean(attack_cfg.name, attacks.client_names())}"
            f"; a device plays a client-side attack: {client_side}, or one of your own by attack._target_"
        )
    try:
        attack = components.build_attack(dataclasses.replace(cfg, attack=attack_cfg))
    except ValueError as err:
        raise ValueError(f"node config attack {attack_cfg.label!r}: {err}") from None
    if attack is not None and attack.omniscient:
        # The reason first: the line under the server's round shows the first 300 characters of a device's error.
        raise ValueError(
            f"node config attack {attack_cfg.label!r} is omniscient, which only the Hydra simulation runs (it "
            f"crafts from every honest update); a device plays a client-side attack: {client_side}, or your own"
        )
    return attack


def adversary_for(cfg: RunConfig, context: Context, partition_id: int) -> Adversary | None:
    """The adversary this node plays, or None for an honest node.

    Raises
    ------
    ValueError
        The node config names an attack that cannot be built, or an omniscient one (see
        :func:`node_attack_config`); the reply then carries the message to the server.
    """
    attack_cfg = node_attack_config(context)  # a deployment drill's device
    if attack_cfg is not None:
        attack = _node_attack(cfg, attack_cfg)
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
