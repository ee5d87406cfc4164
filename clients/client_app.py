"""fedrobust's own ClientApp: local training on the node's partition, replying with the update.

Node config (``--node-config`` on a SuperNode; set by the simulation engine):
``partition-id``, ``num-partitions``, optionally ``data-path`` (the device's own data),
``device`` (``auto``/``cpu``/``cuda``) and ``signing-key`` (deployment).
Replies are signed by the same :func:`fedrobust.signing_mod` any ClientApp can use.

``app`` (``fedrobust.clients.client_app:app``, the component ``flwr run .`` ships) is honest:
it never runs an attack, whatever the run config or node config say. Attacks run only in
the Byzantine ClientApp, ``fedrobust.clients.byzantine_app:app`` (deployment drills), and in
simulations built from a :class:`RunConfig` (``make_client_app(cfg)``: Hydra experiments,
the study, tests), where ``attack`` picks ``num_byzantine`` seed-chosen Byzantine partitions.
Model and data are components (:mod:`fedrobust.components`): built-ins by name, a user's by
``_target_``.

On a SuperNode every message starts a fresh ClientApp process that imports this
module. The hello query goes to every node at once and needs nothing but the node
config, so torch, the data stack (flwr-datasets, datasets, scikit-learn) and the
training code are imported by the handlers that use them, not here: a hello then
costs about a second of CPU instead of five.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedrobust import protocol, signing
from fedrobust.clients.partition_query import partition_reply
from fedrobust.clients.signing_mod import node_config_key, signing_mod
from fedrobust.config import RunConfig, from_flat

if TYPE_CHECKING:
    import torch

    from fedrobust.clients.byzantine import Adversary
    from fedrobust.data import DatasetSpec

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def _model(model_json: str, spec: DatasetSpec) -> torch.nn.Module:
    """One model object per process, reused across rounds (weights are overwritten every round)."""
    from fedrobust import components
    from fedrobust.config import ModelConfig

    return components.build_model(ModelConfig(**json.loads(model_json)), spec)


def _load_model(cfg: RunConfig, state: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    from fedrobust import components

    model = _model(json.dumps(dataclasses.asdict(cfg.model), sort_keys=True), components.dataset_spec(cfg))
    model.load_state_dict(state)
    return model


DATA_PATH = "data-path"  # node config: the device's own data (deployment); see fedrobust.data.load_local


def _partition(cfg: RunConfig, context: Context) -> tuple[int, int]:
    """(partition id, number of partitions); a device with its own data and no partition id uses its node id."""
    if protocol.PARTITION_ID not in context.node_config:
        return context.node_id % (2**31), cfg.num_clients
    pid = int(context.node_config[protocol.PARTITION_ID])
    num = int(context.node_config.get(protocol.NUM_PARTITIONS, cfg.num_clients))
    return pid, num


def _dataset(cfg: RunConfig, context: Context) -> torch.utils.data.TensorDataset:
    """The device's own data (node config ``data-path``), else its partition of the central data set (simulation)."""
    from fedrobust import components

    local = context.node_config.get(DATA_PATH)
    if local:
        return components.load_local(str(local), cfg)
    pid, num = _partition(cfg, context)
    return components.load_partition(cfg, pid, num)


def local_update(
    cfg: RunConfig, context: Context, global_state: Mapping[str, torch.Tensor], server_round: int,
    adversary: Adversary | None = None,
) -> tuple[dict[str, torch.Tensor], int, dict[str, float]]:
    """Train from the global model on this node's partition; return (update, num-examples, metrics)."""
    from fedrobust import training

    pid, _ = _partition(cfg, context)
    dataset = _dataset(cfg, context)
    seed = training.derive_seed(cfg.seed, server_round, pid)
    if adversary is not None:
        dataset = adversary.poison_data(dataset, seed=seed)
    model = _load_model(cfg, global_state)
    device = training.pick_device(str(context.node_config.get("device", cfg.client.device)))
    c = cfg.client
    result = training.train(
        model,
        dataset,
        epochs=c.local_epochs,
        batch_size=c.batch_size,
        lr=c.lr,
        momentum=c.momentum,
        weight_decay=c.weight_decay,
        device=device,
        amp=c.amp,
        deterministic=c.deterministic,
        seed=seed,
    )
    local = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    update = {k: local[k] - global_state[k] for k in global_state}
    metrics = {"train_loss": float(result["loss"]), "train_accuracy": float(result["accuracy"])}
    return update, len(dataset), metrics


BYZANTINE_APP = "fedrobust.clients.byzantine_app:app"
_warned: set[str] = set()


def _node_attack_label(context: Context) -> str:
    """The attack a device's node config names (a drill), as messages name it; empty when none."""
    config = context.node_config
    return str(config.get("attack._target_") or config.get("attack") or config.get("attack.name") or "")


def _warn_attack_ignored(cfg: RunConfig, context: Context) -> None:
    """Say once per process that the honest app ignores an attack the run or node config asks for."""
    asked = _node_attack_label(context) or (cfg.attack.label if cfg.attack.active else "")
    if asked and str(asked) not in _warned:
        _warned.add(str(asked))
        log.warning(
            "attack %r ignored: this is the honest ClientApp; a Byzantine drill runs the ClientApp %s",
            asked, BYZANTINE_APP,
        )


def _say_attack_played(context: Context, pid: int, attack: object) -> None:
    """Say once per process, on a device whose node config names an attack (a deployment drill), that this
    node plays it, with the parameters it was built with: the honest app says when it ignores one, and the
    drill's device should say it does not."""
    asked = _node_attack_label(context)
    if asked and f"played {attack!r}" not in _warned:
        _warned.add(f"played {attack!r}")
        log.warning("attack %r played: this node (partition %d) sends attacked replies, a robustness drill (%r)",
                    asked, pid, attack)


def make_client_app(cfg: RunConfig | None = None, *, byzantine: bool | None = None) -> ClientApp:
    """A ClientApp for ``cfg`` (or, when None, the run config Flower passes in).

    Parameters
    ----------
    cfg : RunConfig, optional
        The run; None reads it from ``context.run_config`` (``flwr run``, deployment).
    byzantine : bool, optional
        Whether the app plays attacks: a node is Byzantine when its node config says
        ``attack=<name>``, or when its partition is one of ``num_byzantine`` seed-chosen ones
        and the run config names an attack (``attack.name`` other than ``none``, or
        ``attack._target_``). Default: True when ``cfg`` is given (a simulation
        built from a RunConfig), False otherwise (the honest app deployed to devices).
    """
    plays_attacks = cfg is not None if byzantine is None else byzantine

    def settings(context: Context) -> RunConfig:
        return cfg if cfg is not None else from_flat(context.run_config)

    def key_for(context: Context) -> signing.Ed25519PrivateKey | None:
        """The node's key file (deployment), else in simulation with signing on the per-run derived key."""
        key = node_config_key(context)
        run_cfg = settings(context)
        if key is None and run_cfg.signing.require and not run_cfg.signing.trust_dir:
            key = signing.derive_keypair(run_cfg.seed, _partition(run_cfg, context)[0])[0]
        return key

    app = ClientApp(mods=[signing_mod(key_for)])

    @app.query()
    def hello(msg: Message, context: Context) -> Message:
        """Tell the server which partition this node holds (node ids are random per run); nothing when it has none."""
        if protocol.PARTITION_ID not in context.node_config:
            return partition_reply(msg, None)
        return partition_reply(msg, *_partition(settings(context), context))

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        from fedrobust import training

        run_cfg = settings(context)
        config = msg.content.config_records[protocol.CONFIG]
        server_round = protocol.record_int(config[protocol.SERVER_ROUND], protocol.SERVER_ROUND)
        global_state = dict(msg.content.array_records[protocol.ARRAYS].to_torch_state_dict())
        pid, _ = _partition(run_cfg, context)
        adversary = None
        if plays_attacks:
            from fedrobust.clients.byzantine import adversary_for

            adversary = adversary_for(run_cfg, context, pid)
            if adversary is not None:
                _say_attack_played(context, pid, adversary.attack)
        else:
            _warn_attack_ignored(run_cfg, context)
        update, num_examples, metrics = local_update(run_cfg, context, global_state, server_round, adversary)
        if adversary is not None:
            seed = training.derive_seed(run_cfg.seed, server_round, pid)
            update, num_examples, flags = adversary.poison_reply(update, num_examples, server_round, seed=seed)
            adversary.save_state(context)
            metrics.update(flags)
        records: dict[str, ArrayRecord | MetricRecord | ConfigRecord] = {
            protocol.UPDATE: ArrayRecord(update),
            protocol.METRICS: MetricRecord({protocol.NUM_EXAMPLES: num_examples, **metrics}),
        }
        return Message(RecordDict(records), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        from fedrobust import training

        run_cfg = settings(context)
        model = _load_model(run_cfg, dict(msg.content.array_records[protocol.ARRAYS].to_torch_state_dict()))
        dataset = _dataset(run_cfg, context)
        device = training.pick_device(str(context.node_config.get("device", run_cfg.client.device)))
        result = training.evaluate(model, dataset, device=device)
        return Message(
            RecordDict(
                {
                    protocol.METRICS: MetricRecord(
                        {
                            protocol.NUM_EXAMPLES: int(result["num_examples"]),
                            "eval_loss": float(result["loss"]),
                            "eval_accuracy": float(result["accuracy"]),
                        }
                    )
                }
            ),
            reply_to=msg,
        )

    return app


app = make_client_app()
