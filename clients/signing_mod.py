"""Signing as a Flower client mod: ``ClientApp(mods=[signing_mod("keys/client-3.key")])``.

The mod signs the train reply of any ClientApp, whichever convention it replies in (``arrays``
with local weights, or fedrobust's ``update``): Ed25519 over the canonical digest of the reply's
arrays and num-examples, bound to the run, the round, the node and the server's nonce for this
message (see :mod:`fedrobust.signing`). A node without a key, or a message without a nonce, gets
its reply through unsigned (with a warning for the nonce): signing never breaks a run; the
server's ``require_signatures`` decides whether unsigned replies count.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

from flwr.app import ConfigRecord, Context, Message, MessageType
from flwr.clientapp.typing import ClientAppCallable, Mod

from fedrobust import protocol, signing

log = logging.getLogger(__name__)

# Node config key of the private key file on a SuperNode (deployment).
NODE_CONFIG_KEY = "signing-key"

KeySource = str | os.PathLike[str] | signing.Ed25519PrivateKey | Callable[[Context], signing.Ed25519PrivateKey | None]


@functools.lru_cache(maxsize=8)
def _key_from_file(path: str) -> signing.Ed25519PrivateKey:
    return signing.load_private_key(path)


def node_config_key(context: Context) -> signing.Ed25519PrivateKey | None:
    """The key named by the node config's ``signing-key`` (a PEM file), or None.

    Raises
    ------
    ValueError
        Naming the node config entry, when its file cannot be read as a private key.
    """
    path = context.node_config.get(NODE_CONFIG_KEY)
    if not path:
        return None
    try:
        return _key_from_file(str(path))
    except (OSError, ValueError) as err:
        raise ValueError(f"node config {NODE_CONFIG_KEY}={str(path)!r}: {err}") from None  # no key bytes in a chain


def signing_mod(private_key: KeySource | None = None) -> Mod:
    """A client mod that signs every successful train reply.

    Parameters
    ----------
    private_key : path, Ed25519PrivateKey or callable, optional
        The node's key: a PEM file, a loaded key, or ``key_for(context)`` returning one (or None
        to leave the reply unsigned). Default: the file named by the node config's
        ``signing-key`` (``flower-supernode --node-config "signing-key='...'"``).

    Examples
    --------
    >>> from flwr.clientapp import ClientApp
    >>> from fedrobust import signing_mod
    >>> app = ClientApp(mods=[signing_mod()])  # key from each SuperNode's node config
    """
    if private_key is None:
        key_for: Callable[[Context], signing.Ed25519PrivateKey | None] = node_config_key
    elif isinstance(private_key, signing.Ed25519PrivateKey):
        key_for = lambda _context: private_key  # noqa: E731 - a constant key
    elif callable(private_key):
        key_for = private_key
    elif isinstance(private_key, str | os.PathLike):
        path = os.fspath(private_key)
        try:  # a missing or malformed key fails when the app is built, not per message
            _key_from_file(path)
        except OSError as err:
            raise ValueError(f"signing_mod: the private key {path!r} cannot be read: {err.strerror or err}") from None
        key_for = lambda _context: _key_from_file(path)  # noqa: E731
    else:
        raise TypeError(
            "signing_mod takes the node's Ed25519 private key as a PEM file path, a loaded Ed25519PrivateKey, a "
            f"function key_for(context), or None (the node config's signing-key), got {type(private_key).__name__}"
        )

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        reply = call_next(msg, context)
        if msg.metadata.message_type != MessageType.TRAIN or reply.has_error():
            return reply
        key = key_for(context)
        if key is None:
            return reply
        record = sign_reply(key, msg, reply, context)
        if record is not None:
            reply.content[protocol.SIGNATURE] = record
        return reply

    return mod


def sign_reply(
    key: signing.Ed25519PrivateKey, msg: Message, reply: Message, context: Context
) -> ConfigRecord | None:
    """The signature record of ``reply`` to ``msg``, or None when the server sent no nonce."""
    config = next((c for c in msg.content.config_records.values() if protocol.NONCE in c), None)
    nonce = config.get(protocol.NONCE) if config is not None else None
    if config is None or not isinstance(nonce, bytes):
        log.warning("the server sent no nonce: reply left unsigned")
        return None
    # The strategy's weighted_by_key and arrayrecord_key, which it sends where they are not the defaults.
    count_key = str(config.get(protocol.NUM_EXAMPLES_KEY, protocol.NUM_EXAMPLES))
    arrays_key = str(config.get(protocol.ARRAYS_KEY, protocol.ARRAYS))
    content = reply.content
    arrays = content.array_records.get(protocol.UPDATE) or content.array_records.get(arrays_key)
    if arrays is None and len(content.array_records) == 1:
        arrays = next(iter(content.array_records.values()))
    metrics = content.metric_records.get(protocol.METRICS)
    if metrics is None and len(content.metric_records) == 1:
        metrics = next(iter(content.metric_records.values()))
    if arrays is None or metrics is None:
        log.warning("train reply has no arrays or metrics to sign: left unsigned")
        return None
    num_examples = metrics.get(count_key)
    # A whole float (96.0) is signed as the integer, as the server verifies it; anything else goes unsigned
    # (the server rejects a count that is not a number, or an unsigned reply when it requires signatures).
    if isinstance(num_examples, float) and num_examples.is_integer():
        num_examples = int(num_examples)
    if isinstance(num_examples, bool) or not isinstance(num_examples, int):
        log.warning("train reply's %r is %r, not a whole number: left unsigned", count_key, num_examples)
        return None
    sig = signing.sign_update(
        key,
        run_id=str(context.run_id),
        round=protocol.record_int(config[protocol.SERVER_ROUND], protocol.SERVER_ROUND),
        node_id=context.node_id,
        nonce=nonce,
        num_examples=num_examples,
        arrays=dict(arrays.to_torch_state_dict()),
    )
    return ConfigRecord({protocol.KEY_ID: signing.key_id(key.public_key()), protocol.NONCE: nonce, protocol.SIG: sig})
