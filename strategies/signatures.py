"""Server side of signed updates: a fresh nonce in every message, and each reply's signature checked.

The cryptography lives in :mod:`fedrobust.signing`; here the Flower records are taken apart. The
server always issues nonces, so a client that holds a key can always sign; whether an unsigned
reply is refused is the only thing ``require`` decides. A signed reply whose key, key binding,
round, nonce or signature is wrong is rejected with that reason before anything else looks at it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord

from fedrobust import protocol, signing

log = logging.getLogger(__name__)


class SignatureCheck:
    """Issues nonces and verifies reply signatures against a trust store.

    Parameters
    ----------
    trust : TrustStore or None
        Trusted client keys; None: signatures are not checked (nonces are still issued and a
        repeated delivery of one reply is still refused).
    require : bool
        Refuse unsigned replies (only with a trust store).
    """

    def __init__(self, trust: signing.TrustStore | None, *, require: bool = True) -> None:
        self.trust = trust
        self.require = require and trust is not None
        self.guard = signing.ReplayGuard(keep_rounds=2)
        self._message_numbers = itertools.count()
        # The key the last verified reply pinned on its first use, until the next reply is verified.
        self._pinned_by_last: str | None = None

    def nonce(self, node_id: int, server_round: int) -> bytes:
        """A fresh nonce for the message to ``node_id`` in ``server_round``."""
        return self.guard.issue(next(self._message_numbers), node_id, server_round)

    def verify(
        self,
        *,
        run_id: int | str,
        node_id: int,
        server_round: int,
        record: ConfigRecord | None,
        arrays: Mapping[str, np.ndarray | torch.Tensor],
        num_examples: float,
        partitions: Mapping[int, int],
    ) -> str | None:
        """None when the reply may go on to validation, else the rejection reason.

        ``arrays`` may be the read-only NumPy views on the reply's bytes: the canonical digest hashes
        a C-contiguous little-endian array in place, and names dtypes as torch does (``float32``,
        ``int64``, ``bool``), so a signature a client made over its torch tensors verifies here
        without a copy.
        """
        nonce = record.get(protocol.NONCE) if record is not None else None
        self._pinned_by_last = None
        if self.trust is None:
            return self.guard.consume(nonce, node_id, server_round) if nonce is not None else None
        key_id = record.get(protocol.KEY_ID) if record is not None else None
        # A key registered for one partition (simulation, or a trust store written with partition
        # ids) must not sign for a node that holds another one.
        claimed = self.trust.partition_id(key_id) if isinstance(key_id, str) else None
        if claimed is not None and node_id in partitions and claimed != partitions[node_id]:
            return signing.REASON_KEY_BOUND_TO_OTHER_NODE
        unbound = isinstance(key_id, str) and self.trust.bound_node(key_id) is None
        reason = signing.verify_reply(
            self.trust,
            self.guard,
            key_id=key_id if isinstance(key_id, str) else None,
            signature=record.get(protocol.SIG) if record is not None else None,
            run_id=run_id,
            round=server_round,
            node_id=node_id,
            nonce=nonce,
            num_examples=int(num_examples) if float(num_examples).is_integer() else num_examples,
            arrays=dict(arrays),
            require_signature=self.require,
        )
        if reason is None and unbound and isinstance(key_id, str) and self.trust.bound_node(key_id) == node_id:
            self._pinned_by_last = key_id
        return reason

    def unpin_last(self) -> None:
        """The reply just verified failed validation: a key it pinned on first use is free again, so that a
        node whose garbage came first (a stolen key, a broken device) does not lock the key's own node out."""
        if self.trust is not None and self._pinned_by_last is not None:
            self.trust.unpin(self._pinned_by_last)
            self._pinned_by_last = None

    def release_gone(self, listed: set[int]) -> None:
        """Free the first-use pins of nodes Flower does not list, so their keys can sign again.

        For the first round of a run: a restart gives nodes new ids (every simulation start; a SuperLink
        without ``--database``), and without this the pins restored from the checkpoint keep every key
        bound to an id that is gone: every device would be refused with ``key_bound_to_other_node``.
        Not for later rounds: Flower lists online nodes only, and a device that is merely offline keeps
        its key (another node taking it meanwhile would lock the device out). Released before any reply
        is verified, so one key never speaks for two nodes in a round.
        """
        if self.trust is None:
            return
        gone = sorted(self.trust.pinned_nodes() - listed)
        released = [key for node_id in gone for key in self.trust.release_node(node_id)]
        if released:
            log.info("%d signing keys pinned to nodes Flower no longer lists are free again", len(released))
            log.debug("keys freed: %s (nodes %s)", released, gone)

    def state_dict(self) -> dict[str, Any]:
        """Key pins (which node first used which key), so a resumed server keeps them."""
        return {"trust": self.trust.state_dict()} if self.trust is not None else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.trust is not None and "trust" in state:
            self.trust.load_state_dict(state["trust"])
