"""Simulation only: a node's ``Context.state`` travels with its replies, so that round checkpoints hold it.

The simulation engine keeps each node's context in the simulation process; a crash or a preemption
of that process loses it, and a resumed run of a stateful client (the ``stale`` attack's memory, a
user's control variates or local optimizer state) would differ from an uninterrupted one.
:func:`with_client_state` wraps a ClientApp with a mod that attaches the node's state to every train
and evaluate reply and, when the server sends a state back after a resume, puts it into the node's
fresh context before the ClientApp runs; the server side is ``fedrobust.strategies.client_state``.

Deployment does not use it: a SuperNode keeps its own context for as long as it runs, and a
client's state stays on the device.
"""

from __future__ import annotations

from flwr.app import Context, Message, MessageType
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable

from fedrobust.strategies.client_state import put_state, take_state

_CARRIED = (MessageType.TRAIN, MessageType.EVALUATE)


def carry_state_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Load a state the server sent back; attach the node's state to train and evaluate replies."""
    restored = take_state(msg.content)
    if restored is not None:
        for name in list(context.state):
            del context.state[name]
        for name, record in restored.items():
            context.state[name] = record
    reply = call_next(msg, context)
    if msg.metadata.message_type.split(".")[0] in _CARRIED and not reply.has_error():
        put_state(reply.content, context.state)
    return reply


def with_client_state(app: ClientApp) -> ClientApp:
    """``app`` behind :func:`carry_state_mod` (query, train and evaluate messages)."""
    wrapped = ClientApp(mods=[carry_state_mod])

    @wrapped.query()
    def query(msg: Message, context: Context) -> Message:
        return app(msg, context)

    @wrapped.train()
    def train(msg: Message, context: Context) -> Message:
        return app(msg, context)

    @wrapped.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return app(msg, context)

    return wrapped
