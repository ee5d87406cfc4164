"""An in-process transport for sweeps: the production server and ClientApp, without Ray.

**What runs where.** Integration tests, ``python -m experiments.run`` (Hydra),
``flwr run .`` and deployments all run on Flower's engines (the Ray simulation
engine or SuperLink + SuperNodes). This module is only for sweeps of hundreds of
small runs (``experiments/study.py``), where Flower's simulation start-up
(~20 s per run) would cost more than the training itself.

**What is the same.** :func:`run_inprocess` calls the same
:func:`fedrobust.strategies.server_app.run_experiment` as the ServerApp (the same
``RobustStrategy.start()`` loop: validation, robust rule, liveness, guard,
signatures and the omniscient ``update_hook`` of ``experiments/simulate.py``),
and every message is handled by the real ``ClientApp`` object from
:func:`fedrobust.clients.client_app.make_client_app`. Only the
transport differs: :class:`InProcessGrid` is a :class:`flwr.serverapp.Grid`
that hands each pushed message to the ClientApp directly and keeps the reply
until it is pulled.

**How faithful the transport is.** As on the wire, each message and each reply
is serialised with Flower's own object format (``deflate``) and rebuilt
(``inflate``), so the ClientApp never shares tensors with the server; message
ids are the content-addressed object ids that a SuperLink assigns; a ClientApp
that raises produces an error reply with ``CLIENT_APP_RAISED_EXCEPTION``, as
Flower's simulation engine does; each node keeps one :class:`flwr.app.Context`
(``partition-id``, ``num-partitions`` and a persistent ``state``) for the whole
run. Node ids and the run id are drawn from the seed, so two runs of one config
are identical bit for bit.

**What it does not model.** Delivery is synchronous (a client runs inside
``push_messages``), so there are no stragglers, no dropouts and no deadlines;
there are no heartbeats, TTLs or node registrations. Fault tolerance is tested
on Flower's engines (tests/), not here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.proto.node_pb2 import NodeInfo  # pylint: disable=E0611
from flwr.serverapp import Grid
from flwr.supercore.constant import NodeStatus
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from experiments.adversary import CraftObserver, omniscient_hook
from experiments.client_state import with_client_state
from fedrobust.clients.client_app import make_client_app
from fedrobust.config import RunConfig
from fedrobust.run_setup import validate
from fedrobust.strategies.robust_strategy import RobustStrategy
from fedrobust.strategies.server_app import run_experiment

log = logging.getLogger(__name__)

__all__ = ["InProcessGrid", "node_ids_for", "run_inprocess"]

PULL_INTERVAL = 0.01


def node_ids_for(seed: int, num_nodes: int) -> list[int]:
    """``num_nodes`` distinct node ids drawn from ``seed`` (node ``i`` holds partition ``i``).

    Like a SuperLink's ids they are large random integers unrelated to the
    partition, so the strategy must learn the partitions from the hello query.
    """
    rng = np.random.default_rng([seed, 0x0DE1D5])
    ids: list[int] = []
    while len(ids) < num_nodes:
        candidate = int(rng.integers(2, 2**63 - 1))
        if candidate != SUPERLINK_NODE_ID and candidate not in ids:
            ids.append(candidate)
    return ids


def _run_id_for(seed: int) -> int:
    return int(np.random.default_rng([seed, 0x4A11]).integers(1, 2**63 - 1))


def _over_the_wire(message: Message) -> Message:
    """A copy of ``message`` rebuilt from Flower's serialised objects, with the same metadata."""
    contents = {object_id: obj.deflate() for object_id, obj in get_all_nested_objects(message).items()}
    copy = cast(Message, inflate_object_from_contents(message.object_id, contents))
    # deflate() leaves the message id out (it is the object id); put it back.
    copy.metadata.__dict__["_message_id"] = message.metadata.message_id
    return copy


class InProcessGrid(Grid):
    """A :class:`flwr.serverapp.Grid` whose nodes are ClientApp calls in this process.

    Parameters
    ----------
    client_app : ClientApp
        The ClientApp every node runs (e.g. ``make_client_app(cfg)``).
    num_nodes : int
        Number of nodes; node ``i`` gets ``node_config={"partition-id": i, "num-partitions": num_nodes}``.
    seed : int
        Draws the node ids and the run id.
    run_config : dict, optional
        The run config the nodes' contexts carry (``Context.run_config``).
    nodes : mapping, optional
        Node id -> node config, instead of ``num_nodes`` partitions: the nodes of a deployment
        (``flower-supernode --node-config``, e.g. a ``data-path`` each), to replay its runs here.
    """

    def __init__(
        self,
        client_app: ClientApp,
        num_nodes: int,
        *,
        seed: int = 0,
        run_config: dict[str, Any] | None = None,
        nodes: Mapping[int, Mapping[str, Any]] | None = None,
    ) -> None:
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        if nodes is None:
            ids = node_ids_for(seed, num_nodes)
            nodes = {node_id: {"partition-id": i, "num-partitions": num_nodes} for i, node_id in enumerate(ids)}
        elif len(nodes) != num_nodes:
            raise ValueError(f"{len(nodes)} node configs for {num_nodes} nodes")
        self.client_app = client_app
        run = Run.create_empty(run_id=_run_id_for(seed))
        run.override_config = dict(run_config or {})
        self._run: Run | None = run
        self._node_ids = list(nodes)
        self._contexts = {
            node_id: Context(
                run_id=run.run_id,
                node_id=node_id,
                node_config=dict(node_config),
                state=RecordDict(),
                run_config=dict(run.override_config),
            )
            for node_id, node_config in nodes.items()
        }
        # Replies waiting to be pulled, by the id of the message they answer.
        self._replies: dict[str, Message] = {}

    # ------------------------------------------------------------------ run
    def set_run(self, run: Run) -> None:
        """Use ``run`` (its id goes into the messages and the nodes' contexts)."""
        if not isinstance(run, Run):
            raise TypeError(f"`run` must be an instance of Run, got {type(run).__name__}")
        self._run = run
        for context in self._contexts.values():
            context.run_id = run.run_id

    @property
    def run(self) -> Run:
        """A copy of the run's information."""
        return Run(**vars(cast(Run, self._run)))

    # ------------------------------------------------------------------ nodes
    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """A new message (deprecated in Flower: prefer the ``Message`` constructor)."""
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        """The ids of every node (all of them are always connected)."""
        return list(self._node_ids)

    def get_nodes(self) -> Iterable[NodeInfo]:
        """Every node, reported online."""
        return [NodeInfo(node_id=node_id, status=NodeStatus.ONLINE) for node_id in self._node_ids]

    # ------------------------------------------------------------------ messages
    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Deliver each message to its node's ClientApp now; return the ids of the delivered ones.

        A message to an unknown node, or one that is not a fresh instruction, is
        not delivered and gets no id (as the SuperLink's state refuses to store it).
        """
        ids: list[str] = []
        for message in messages:
            meta = message.metadata
            if meta.reply_to_message_id or meta.ttl <= 0 or meta.dst_node_id not in self._contexts:
                log.error("not delivering invalid message to node %s: %s", meta.dst_node_id, meta)
                continue
            meta.__dict__["_message_id"] = message.object_id  # content-addressed, as a SuperLink does
            self._replies[meta.message_id] = self._deliver(message)
            ids.append(meta.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies to ``message_ids`` that have not been pulled yet (each is returned once)."""
        return [self._replies.pop(mid) for mid in message_ids if mid in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Push ``messages`` and pull their replies (delivery is synchronous: all are in at once)."""
        pending = set(self.push_messages(messages))
        end = time.monotonic() + (timeout if timeout is not None else 0.0)
        replies: list[Message] = []
        while pending:
            got = list(self.pull_messages(pending))
            replies.extend(got)
            pending.difference_update(r.metadata.reply_to_message_id for r in got)
            if not pending or (timeout is not None and time.monotonic() >= end):
                break
            time.sleep(PULL_INTERVAL)
        return replies

    def _deliver(self, message: Message) -> Message:
        """Run the node's ClientApp on a wire copy of ``message``; the reply as the server receives it."""
        context = self._contexts[message.metadata.dst_node_id]
        received = _over_the_wire(message)
        try:
            reply = self.client_app(received, context)
        except Exception as err:  # any ClientApp failure becomes an error reply, as in Flower
            log.warning(
                "ClientApp of node %d raised on %s:\n%s",
                message.metadata.dst_node_id,
                message.metadata.message_type,
                traceback.format_exc(),
            )
            reason = f"{type(err)}:<'{err}'>"
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=received)
        reply.metadata.__dict__["_message_id"] = reply.object_id
        return _over_the_wire(reply)


@contextlib.contextmanager
def _server_identity(run_id: int) -> Iterator[None]:
    """Act as the ServerApp task of ``run_id`` (Flower stamps new messages with it), then restore."""
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run_id, SUPERLINK_NODE_ID
    try:
        yield
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


def run_inprocess(
    cfg: RunConfig,
    out_dir: Path | None = None,
    *,
    echo: bool = False,
    client_app: ClientApp | None = None,
    on_strategy: Callable[[RobustStrategy], None] | None = None,
    nodes: Mapping[int, Mapping[str, Any]] | None = None,
    on_craft: CraftObserver | None = None,
    picture: bool = False,
) -> list[dict[str, Any]]:
    """Run ``cfg`` with ``cfg.num_clients`` in-process nodes; return the metrics rows (``picture``: and draw
    them into ``rounds.png``, as fedrobust's own ServerApp does; the study's thousands of runs do not).

    The server side is :func:`fedrobust.strategies.server_app.run_experiment` with the
    omniscient adversary hook of :mod:`experiments.adversary`, as ``experiments/simulate.py``
    runs it on Flower's engine; the nodes run ``make_client_app(cfg)`` (or ``client_app``, e.g.
    a test's misbehaving one), whose ``Context.state`` goes into the round checkpoints as in
    ``experiments/simulate.py``. ``metrics.jsonl``, ``final_model.safetensors`` and the resolved
    config go to ``out_dir`` (a temporary directory when None). ``on_strategy`` sees the strategy
    before it starts (e.g. to request a stop). ``nodes`` (node id -> node config) replaces the
    seed's node ids and partitions, e.g. with a deployment's SuperNodes and their device data (as many
    nodes as it names, which may differ from ``num_clients``).
    ``on_craft`` sees each round's honest rows and what an omniscient attack crafted from them.

    PyTorch is limited to one thread in this process (the models are tiny; a sweep runs one
    process per core instead).

    Raises
    ------
    ValueError
        Before anything starts, when the config is invalid.
    fedrobust.QuorumError
        When a round could not be aggregated after its retries.
    """
    validate(cfg)
    torch.set_num_threads(1)
    with contextlib.ExitStack() as stack:
        if out_dir is None:
            out_dir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        out_dir.mkdir(parents=True, exist_ok=True)
        app = with_client_state(client_app if client_app is not None else make_client_app(cfg))
        num_nodes = len(nodes) if nodes is not None else cfg.num_clients
        grid = InProcessGrid(app, num_nodes, seed=cfg.seed, run_config=cfg.to_flat(), nodes=nodes)
        with _server_identity(grid.run.run_id):
            run_experiment(grid, cfg, out_dir, update_hook=omniscient_hook(cfg, on_craft), on_strategy=on_strategy,
                           progress=echo, picture=picture)
        return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
