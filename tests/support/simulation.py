"""Small configurations and misbehaving ClientApps for tests on the real simulation engine."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp import ClientApp

from fedrobust import protocol, signing
from fedrobust.clients.client_app import make_client_app
from fedrobust.clients.signing_mod import sign_reply
from fedrobust.config import RunConfig, from_flat

# One ClientApp actor per Ray simulation, unless a test needs more at once. Starting an actor costs about
# 6 CPU-s (it imports flwr and torch), more than a second actor saves on these runs of a few seconds of
# training: a 2-round, 4-client Hydra run used 26.4 CPU-s with two actors and 18.8 with one, and ended
# sooner (17.8 s against 19.4 s on 2 cores). Ray gives an actor OMP_NUM_THREADS = its CPUs (1), so the
# clients train on one thread, as the in-process references do.
ONE_CLIENT_CPU = {"num_cpus": 1, "num_gpus": 0.0}


def ray_backend(actors: int = 1, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``run_simulation``'s backend config with room for exactly ``actors`` ClientApp actors.

    ``base`` (e.g. ``experiments.simulate.backend_config(cfg)``) gives the client resources; by default
    one CPU per client. Ray is given ``actors`` times that many CPUs.
    """
    backend = dict(base) if base is not None else {"client_resources": dict(ONE_CLIENT_CPU)}
    backend["init_args"] = {
        **backend.get("init_args", {}),
        "num_cpus": actors * backend["client_resources"]["num_cpus"],
    }
    return backend


def federation_options(num_supernodes: int, actors: int = 1) -> dict[str, Any]:
    """A simulation federation's options (``flwr run``) with room for exactly ``actors`` ClientApp actors."""
    return {
        "num-supernodes": num_supernodes,
        "backend": {"client-resources": {"num-cpus": 1}, "init-args": {"num-cpus": actors}},
    }


# (partition id, round, reply) -> None; changes the reply in place.
Tamper = Callable[[int, int, Message], None]


def small_config(tmp_path: Path, **overrides: Any) -> RunConfig:
    """5 clients, 2 rounds on digits: a few seconds of real simulation."""
    flat: dict[str, Any] = {
        "num_clients": 5,
        "clients_per_round": 5,
        "num_rounds": 2,
        "num_byzantine": 1,
        "aggregator.name": "trimmed_mean",
        "fault.round_timeout": 60.0,
        "output_dir": str(tmp_path / "out"),
    }
    flat.update(overrides)
    return from_flat(flat)


def tampering_client(cfg: RunConfig, tamper: Tamper, *, resign: set[int] = frozenset()) -> ClientApp:
    """The real ClientApp, whose train replies ``tamper`` may change before they are sent.

    Partitions in ``resign`` sign the tampered reply again with their own key, as a
    Byzantine client that holds a valid key would.
    """
    honest = make_client_app(cfg)
    app = ClientApp()

    @app.query()
    def hello(msg: Message, context: Context) -> Message:
        return honest(msg, context)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        reply = honest(msg, context)
        partition = int(context.node_config[protocol.PARTITION_ID])
        tamper(partition, int(msg.content[protocol.CONFIG][protocol.SERVER_ROUND]), reply)
        if partition in resign:
            key = signing.derive_keypair(cfg.seed, partition)[0]
            record = sign_reply(key, msg, reply, context)
            assert record is not None
            reply.content[protocol.SIGNATURE] = record
        return reply

    return app


def replace_update(reply: Message, change: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    update = dict(reply.content[protocol.UPDATE].to_torch_state_dict())
    reply.content[protocol.UPDATE] = ArrayRecord(change(update))


def read_rows(out_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
