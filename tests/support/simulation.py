"""Small configurations and misbehaving ClientApps for tests on the real simulation engine."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp import ClientApp

from fedrobust import protocol, signing
from fedrobust.clients.client_app import make_client_app
from fedrobust.clients.signing_mod import sign_reply
from fedrobust.config import RunConfig, from_flat

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
