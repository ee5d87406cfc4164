"""Simulated clients' ``Context.state`` carried through the server's round checkpoints.

A simulated node keeps its state (a stateful attack's memory, control variates, a local optimizer)
in the ``Context`` the simulation engine holds for it; when the simulation process dies, that state
dies with it, and a resumed run would not end with the bytes of an uninterrupted one. In simulation
the ClientApp therefore runs with a mod (``experiments/client_state.py``) that attaches its node's
state to every train and evaluate reply; the round loop keeps the newest state of each partition,
saves it with the round checkpoint, and after a resume sends it back once with the first message
to that partition, whose mod puts it into the fresh context before the ClientApp runs.

In deployment nothing of this is installed: clients keep their own state (a SuperNode's context
lives as long as the SuperNode), and it never leaves the device.

On the wire a state is a marker :class:`~flwr.app.ConfigRecord` named :data:`CLIENT_STATE` plus
one record per state record, named ``CLIENT_STATE + "/" + name``. In a checkpoint, arrays are
tensors ``clients/<i>`` and everything else is JSON (``bytes`` as base64).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

CLIENT_STATE = "fedrobust.client-state"
_PREFIX = CLIENT_STATE + "/"


def put_state(content: RecordDict, state: RecordDict) -> None:
    """Attach ``state`` (a node's ``Context.state``) to a message's ``content``."""
    content[CLIENT_STATE] = ConfigRecord({"records": len(state)})
    for name, record in state.items():
        content[_PREFIX + name] = record


def take_state(content: RecordDict) -> RecordDict | None:
    """Remove an attached state from ``content`` and return it; None when none was attached."""
    if CLIENT_STATE not in content:
        return None
    del content[CLIENT_STATE]
    state = RecordDict()
    for name in [n for n in content if n.startswith(_PREFIX)]:
        state[name[len(_PREFIX) :]] = content[name]
        del content[name]
    return state


def encode(states: Mapping[str, RecordDict]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Checkpoint form of the states by client key: tensors ``{"<i>": tensor}`` and JSON metadata."""
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {}
    for key in sorted(states):
        records: list[dict[str, Any]] = []
        for name, record in states[key].items():
            if isinstance(record, ArrayRecord):
                arrays = []
                for array_name, array in record.items():
                    index = str(len(tensors))
                    tensors[index] = torch.from_numpy(np.array(array.numpy(), copy=True))
                    arrays.append([array_name, index])
                records.append({"name": name, "kind": "array", "arrays": arrays})
            else:
                kind = "config" if isinstance(record, ConfigRecord) else "metric"
                records.append({"name": name, "kind": kind, "values": {k: _to_json(v) for k, v in record.items()}})
        meta[key] = records
    return tensors, meta


def decode(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> dict[str, RecordDict]:
    """Inverse of :func:`encode`."""
    states: dict[str, RecordDict] = {}
    for key, records in meta.items():
        state = RecordDict()
        for entry in records:
            if entry["kind"] == "array":
                state[entry["name"]] = ArrayRecord({name: tensors[index] for name, index in entry["arrays"]})
            else:
                values = {k: _from_json(v) for k, v in entry["values"].items()}
                state[entry["name"]] = ConfigRecord(values) if entry["kind"] == "config" else MetricRecord(values)
        states[key] = state
    return states


def _to_json(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"b64": base64.b64encode(value).decode("ascii")}
    if isinstance(value, list):
        return [_to_json(v) for v in value]
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        return base64.b64decode(value["b64"])
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value
