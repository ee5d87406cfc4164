"""The answer to RobustStrategy's partition query, for any ClientApp: ``app.query()(partition_query)``.

With ``RobustStrategy(discover_partitions=True)`` the server asks each node once which partition it
holds and orders the round's rows by partition instead of by Flower's node ids, which are drawn anew
for every simulation and after a SuperLink restart without ``--database``. The order of the rows is
part of the aggregate's bytes: with it fixed, the same seed gives the same final model on every run
and after a resume.
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedrobust import protocol


def partition_reply(msg: Message, partition_id: int | None, num_partitions: int | None = None) -> Message:
    """The reply to the query ``msg`` saying this node holds ``partition_id`` (None: it does not know) of
    ``num_partitions`` (the server warns when nodes disagree on it: their shares of the data overlap)."""
    info = ConfigRecord({} if partition_id is None else {protocol.PARTITION_ID: int(partition_id)})
    if partition_id is not None and num_partitions is not None:
        info[protocol.NUM_PARTITIONS] = int(num_partitions)
    return Message(RecordDict({protocol.INFO: info}), reply_to=msg)


def partition_query(msg: Message, context: Context) -> Message:
    """A query handler that answers with the node config's ``partition-id`` (nothing when it has none):
    Flower's simulation engine sets it on every node; a SuperNode gets it from
    ``--node-config "partition-id=3"``.

    Register it on a ClientApp (``app.query()(partition_query)``), or call it from a query handler of
    your own for the messages RobustStrategy sends.
    """
    partition = context.node_config.get(protocol.PARTITION_ID)
    num = context.node_config.get(protocol.NUM_PARTITIONS)
    return partition_reply(msg, None if partition is None else int(partition), None if num is None else int(num))
