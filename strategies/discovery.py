"""Which partition each node holds, learned through a query the node answers once (simulation convenience).

Node ids are random per run; ordering nodes by the partition they hold makes sampling and
aggregation order, and so the final model bytes, the same in every run of one config. Only
ClientApps with a query handler that answers ``partition-id`` (fedrobust's own) take part; a
strategy without ``discover_partitions`` never sends the query.
"""

from __future__ import annotations

import logging
import time

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from fedrobust import protocol
from fedrobust.strategies.collect import POLL_SECONDS, push
from fedrobust.strategies.replies import error_reason

log = logging.getLogger(__name__)

# Error answers that say nothing about the node's ClientApp: the node or the message was gone.
_TRANSIENT = (ErrorCode.NODE_UNAVAILABLE, ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE)


class Discovery:
    """Asks each new node once for its partition id; answers may come in any later call.

    A question stays pending until its node answers, so a node is never asked twice while a
    question is open (on a SuperNode every message starts a ClientApp process). Error answers
    (e.g. NODE_UNAVAILABLE) close the question, so the node is asked again once it is back.
    """

    def __init__(
        self, grid: Grid, partitions: dict[int, int], answered: set[int], num_partitions: dict[int, int]
    ) -> None:
        self.grid = grid
        self.partitions = partitions
        self.answered = answered
        self.num_partitions = num_partitions  # node id -> the num-partitions its data share is cut by
        self.pending: dict[str, int] = {}  # query message id -> node id
        # node id -> why its ClientApp failed the last query (no query handler, a crash at start), until
        # it answers: a run whose nodes all fail it stops at once instead of asking until the wait ends.
        self.failed: dict[int, str] = {}
        self._said_shares = False

    def poll(self, *, needed: int = 0, wait: float = 0.0) -> None:
        """Ask new nodes, take answers in; wait at most ``wait`` s until ``needed`` partitions are known."""
        deadline = time.monotonic() + wait
        refused: set[int] = set()  # asked in this poll and refused by the grid: asked again at the next poll
        while True:
            asked = set(self.pending.values()) | refused
            unknown = [n for n in sorted(self.grid.get_node_ids()) if n not in self.answered and n not in asked]
            if unknown:
                queries = [
                    Message(
                        RecordDict({protocol.CONFIG: ConfigRecord({})}), message_type=MessageType.QUERY, dst_node_id=n
                    )
                    for n in unknown
                ]
                taken = push(self.grid, queries)
                self.pending.update(taken)
                refused.update(set(unknown) - set(taken.values()))
            if self.pending:
                for reply in self.grid.pull_messages(list(self.pending)):
                    node = self.pending.pop(reply.metadata.reply_to_message_id, None)
                    if node is not None and reply.has_error() and reply.error.code not in _TRANSIENT:
                        self.failed[node] = error_reason(reply.error.reason)
                    if node is None or reply.has_error() or protocol.INFO not in reply.content.config_records:
                        continue
                    self.failed.pop(node, None)
                    self.answered.add(node)
                    partition = reply.content[protocol.INFO].get(protocol.PARTITION_ID)
                    if isinstance(partition, int):
                        self._say_if_shared(node, partition)
                        self.partitions[node] = partition
                    shares = reply.content[protocol.INFO].get(protocol.NUM_PARTITIONS)
                    if isinstance(shares, int):
                        self._say_if_other_shares(node, shares)
            if len(self.answered) >= needed or time.monotonic() >= deadline:
                return
            time.sleep(POLL_SECONDS)

    def failed_now(self) -> dict[int, str]:
        """The connected nodes whose ClientApp failed its last query, and why."""
        if not self.failed:
            return {}
        connected = set(self.grid.get_node_ids())
        return {node: why for node, why in self.failed.items() if node in connected}

    def say_if_other_shares_than(self, checkpointed: list[int]) -> None:
        """Warn when a resumed run's connected nodes cut the data by other num-partitions than the nodes of
        the run that wrote its checkpoint: each partition-id now names another share of the data."""
        connected = set(self.grid.get_node_ids())
        now = sorted({count for node, count in self.num_partitions.items() if node in connected})
        if checkpointed and now and now != checkpointed:
            log.warning(
                "the nodes cut the data by num-partitions=%s, the run that wrote the checkpoint by %s: each "
                "partition-id now names another share of the data, so the resumed run does not continue the "
                "same federation (the filters remember clients by partition); start it in a new checkpoint "
                "directory unless that is what you want",
                "/".join(map(str, now)), "/".join(map(str, checkpointed)),
            )

    def _say_if_shared(self, node: int, partition: int) -> None:
        """Warn when two connected nodes say they hold the same partition: they train on the same data (a
        node config copied from another device), so the run has fewer distinct clients than it counts. A
        node that left (a SuperNode restarted under a new id) does not count."""
        others = [other for other, held in self.partitions.items() if held == partition and other != node]
        if others:  # the grid is asked only then, not once per answering node
            connected = set(self.grid.get_node_ids())
            others = [other for other in others if other in connected]
        if others:
            log.warning(
                "nodes %s and %d both hold partition-id=%d: they train on the same data; give each node its own "
                "partition-id in its node config (flower-supernode --node-config)",
                ", ".join(map(str, others)), node, partition,
            )

    def _say_if_other_shares(self, node: int, shares: int) -> None:
        """Warn once when connected nodes cut their share of the data by different ``num-partitions``
        (a device added with a new count while the others kept theirs): their shares overlap."""
        self.num_partitions[node] = shares
        if self._said_shares or len(set(self.num_partitions.values())) < 2:
            return
        connected = set(self.grid.get_node_ids())
        counts: dict[int, list[int]] = {}
        for other, count in self.num_partitions.items():
            if other in connected:
                counts.setdefault(count, []).append(other)
        if len(counts) > 1:
            self._said_shares = True
            log.warning(
                "the nodes cut their data shares by different num-partitions (%s): their shares overlap; give "
                "every node the same num-partitions in its node config (flower-supernode --node-config)",
                "; ".join(f"{count}: node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, sorted(nodes)))}"
                          for count, nodes in sorted(counts.items())),
            )
