"""fedrobust as a library in a user's own Flower app: nothing from fedrobust on the client.

The ClientApp below is written the Flower way (reply ``arrays`` = full local weights, ``metrics``
with ``num-examples``); some nodes reply malformed, NaN or adversarial weights. The ServerApp uses
only ``RobustStrategy(...)`` and ``strategy.start(...)``, on Flower's real simulation engine.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result
from flwr.simulation import run_simulation
from sklearn.datasets import load_digits
from torch import nn

from fedrobust import AggregationError, NodesBusyError, NoNodesError, QuorumError, RobustStrategy
from fedrobust.checkpoint import CheckpointMismatchError
from fedrobust.config import LivenessConfig
from tests.support.simulation import ray_backend

NUM_NODES = 8
MALFORMED, NAN, ADVERSARIAL = 0, 1, 2  # partition ids of the faulty nodes; the others are honest


# ---------------------------------------------------------------------- the user's task.py
def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def digits(partition: int | None, num_partitions: int = NUM_NODES) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = torch.tensor(x[order] / 16.0, dtype=torch.float32), torch.tensor(y[order])
    cut = int(0.8 * len(y))
    if partition is None:
        return x[cut:], y[cut:]
    return x[:cut][partition::num_partitions], y[:cut][partition::num_partitions]


def accuracy(arrays: ArrayRecord) -> float:
    net = make_net()
    net.load_state_dict(arrays.to_torch_state_dict())
    x, y = digits(None)
    with torch.no_grad():
        return float((net(x).argmax(1) == y).float().mean())


def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    net = make_net()
    net.load_state_dict(arrays.to_torch_state_dict())
    x, y = digits(None)
    with torch.no_grad():
        out = net(x)
        return MetricRecord(
            {"loss": float(nn.functional.cross_entropy(out, y)), "accuracy": float((out.argmax(1) == y).float().mean())}
        )


# ---------------------------------------------------------------------- the user's client_app.py
client = ClientApp()


@client.train()
def train(msg: Message, context: Context) -> Message:
    partition = int(context.node_config["partition-id"])
    net = make_net()
    global_state = msg.content["arrays"].to_torch_state_dict()
    net.load_state_dict(global_state)
    x, y = digits(partition, int(context.node_config["num-partitions"]))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.3)
    generator = torch.Generator().manual_seed(partition)
    for _ in range(2):
        for batch in torch.randperm(len(y), generator=generator).split(16):
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(x[batch]), y[batch]).backward()
            optimizer.step()
    local = net.state_dict()
    if partition == MALFORMED:  # a weight matrix of the wrong shape
        first = next(iter(local))
        local[first] = local[first][:, :-1].clone()
    elif partition == NAN:
        local = {k: torch.full_like(v, float("nan")) for k, v in local.items()}
    elif partition == ADVERSARIAL:  # move the model 10x the other way
        local = {k: global_state[k] - 10 * (v - global_state[k]) for k, v in local.items()}
    metrics = MetricRecord({"train_loss": 0.0, "num-examples": len(y)})
    return Message(RecordDict({"arrays": ArrayRecord(local), "metrics": metrics}), reply_to=msg)


# ---------------------------------------------------------------------- the user's server_app.py
def robust_server(checkpoint_dir: Path, results: dict[str, Result]) -> ServerApp:
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        def strategy() -> RobustStrategy:
            # f=3 faulty nodes; validation rejects the malformed and NaN ones, the rule outvotes the third.
            return RobustStrategy(
                aggregator="trimmed_mean",
                num_byzantine=3,
                min_available_nodes=NUM_NODES,
                checkpoint_dir=checkpoint_dir,
                progress=False,
            )

        initial = ArrayRecord(make_net().state_dict())
        results["first"] = strategy().start(grid=grid, initial_arrays=initial, num_rounds=3, evaluate_fn=evaluate_fn)
        # A new strategy on the same checkpoint directory continues after round 3.
        results["second"] = strategy().start(grid=grid, initial_arrays=initial, num_rounds=5, evaluate_fn=evaluate_fn)

    return server


@pytest.mark.slow(seconds=35)
@pytest.mark.timeout(300)
def test_a_flower_style_app_trains_robustly_and_resumes(tmp_path: Path) -> None:
    results: dict[str, Result] = {}
    run_simulation(
        server_app=robust_server(tmp_path / "ckpt", results),
        client_app=client,
        num_supernodes=NUM_NODES,
        backend_config=ray_backend(),
    )
    assert set(results) == {"first", "second"}, "the ServerApp did not finish; see the log above"
    first, second = results["first"], results["second"]

    assert sorted(first.train_metrics_clientapp) == [1, 2, 3]
    for metrics in first.train_metrics_clientapp.values():
        assert metrics["rejected.wrong_shape"] == 1 and metrics["rejected.non_finite"] == 1
        assert metrics["accepted"] == NUM_NODES - 2 and metrics["f_used"] == 1
    # The second start() resumed: rounds 1-3 come from the checkpoint, rounds 4-5 were trained.
    assert sorted(second.train_metrics_clientapp) == [1, 2, 3, 4, 5]
    assert second.train_metrics_clientapp[3] == first.train_metrics_clientapp[3]
    assert second.evaluate_metrics_serverapp[0] == first.evaluate_metrics_serverapp[0]  # kept in the checkpoint
    assert list(second.evaluate_metrics_serverapp) == list(range(6))  # in round order, as without the stop

    final = second.arrays.to_torch_state_dict()
    assert all(bool(torch.isfinite(v).all()) for v in final.values())
    robust_accuracy = accuracy(second.arrays)

    # Honest-only training of the same client code (faulty nodes left out) on the in-process grid.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from experiments.inprocess import InProcessGrid

    honest_nodes = ClientApp()

    @honest_nodes.train()
    def honest_train(msg: Message, context: Context) -> Message:
        context.node_config["partition-id"] = int(context.node_config["partition-id"]) + 3  # partitions 3..7
        context.node_config["num-partitions"] = NUM_NODES
        return client(msg, context)

    honest_grid = InProcessGrid(honest_nodes, NUM_NODES - 3, seed=0)
    honest = RobustStrategy(aggregator="mean", min_available_nodes=NUM_NODES - 3, progress=False).start(
        grid=honest_grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=5
    )
    honest_accuracy = accuracy(honest.arrays)
    assert honest_accuracy > 0.8, honest_accuracy  # the task trains at all
    assert robust_accuracy >= honest_accuracy - 0.05, (robust_accuracy, honest_accuracy)
    assert math.isfinite(second.evaluate_metrics_serverapp[5]["loss"])


def test_standard_replies_become_updates_against_the_model_sent() -> None:
    """aggregate_train alone, Flower's way: a reply with full weights w_i gives update w_i - global."""
    from experiments.inprocess import InProcessGrid, _server_identity

    def reply_weights(offset: float) -> ClientApp:
        app = ClientApp()

        @app.train()
        def _train(msg: Message, context: Context) -> Message:
            state = msg.content["arrays"].to_torch_state_dict()
            shift = offset * (1 + int(context.node_config["partition-id"]))
            local = {k: v + shift for k, v in state.items()}
            metrics = MetricRecord({"num-examples": 10})
            return Message(RecordDict({"arrays": ArrayRecord(local), "metrics": metrics}), reply_to=msg)

        return app

    grid = InProcessGrid(reply_weights(0.5), 3, seed=0)
    strategy = RobustStrategy(aggregator="median", num_byzantine=0, progress=False)
    initial = {"w": torch.zeros(2, 2), "b": torch.ones(2)}

    with _server_identity(grid.run.run_id):
        messages = list(strategy.configure_train(1, ArrayRecord(initial), ConfigRecord(), grid))
        assert len(messages) == 3 and all(m.content["config"]["server-round"] == 1 for m in messages)
        replies = list(grid.send_and_receive(messages))
        arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is not None and metrics is not None and metrics["accepted"] == 3
    new = arrays.to_torch_state_dict()
    # Shifts 0.5, 1.0, 1.5: the median update is 1.0, applied with server lr 1.
    assert torch.allclose(new["w"], torch.full((2, 2), 1.0)) and torch.allclose(new["b"], torch.full((2,), 2.0))
    with pytest.raises(RuntimeError, match="configure_train"):
        strategy.aggregate_train(2, replies)


def _echo_app(metrics: Callable[[int], dict[str, Any]], mods: Sequence[Any] = ()) -> ClientApp:
    """A ClientApp that trains nothing: it sends the model back with ``metrics(partition)``."""
    app = ClientApp(mods=list(mods))

    @app.train()
    def _train(msg: Message, context: Context) -> Message:
        record = MetricRecord(metrics(int(context.node_config["partition-id"])))
        return Message(RecordDict({"arrays": msg.content["arrays"], "metrics": record}), reply_to=msg)

    return app


def _start_on_honest_nodes(
    strategy: RobustStrategy, num_nodes: int, initial: nn.Module | None = None, evaluate: Callable | None = None
) -> Result:
    """One round of ``strategy`` on ``num_nodes`` honest nodes of the in-process grid (Flower's messages),
    from the weights of ``initial`` (default: the task's net), evaluated by ``evaluate`` (default: none)."""
    from experiments.inprocess import InProcessGrid, _server_identity

    honest = ClientApp()

    @honest.train()
    def _train(msg: Message, context: Context) -> Message:
        context.node_config["partition-id"] = int(context.node_config["partition-id"]) + 3  # honest partitions
        return train(msg, context)

    grid = InProcessGrid(honest, num_nodes, seed=0)
    with _server_identity(grid.run.run_id):
        model = make_net() if initial is None else initial
        return strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=1,
                              evaluate_fn=evaluate)


def test_a_round_samples_at_least_the_replies_the_rule_needs() -> None:
    """fraction_train=0.1 of 5 nodes is 0 (min_train_nodes 2); the trimmed mean with f=2 needs 5."""
    strategy = RobustStrategy(aggregator="trimmed_mean", num_byzantine=2, fraction_train=0.1, progress=False)
    assert strategy.sample_size(5) == 5 and strategy.sample_size(4) == 4  # capped at what is there
    assert RobustStrategy(aggregator="mean", fraction_train=0.1, progress=False).sample_size(5) == 2  # as FedAvg
    result = _start_on_honest_nodes(strategy, 5)
    assert result.train_metrics_clientapp[1]["accepted"] == 5


def test_too_few_nodes_for_the_rule_stops_with_what_to_do(caplog: pytest.LogCaptureFixture) -> None:
    """Two nodes (a local simulation's default) and the default pipeline with f=1, which needs 3 replies:
    both nodes were asked and replied validly, so the round is not retried (a retry would ask the same two).
    The run says so before round 1 trains."""
    strategy = RobustStrategy(num_byzantine=1, max_round_retries=2, progress=False)
    with pytest.raises(QuorumError, match=r"round 1: not aggregated after 1 attempt \(2 valid replies, .* needs at "
                                          r"least 3; only 2 nodes could be asked: connect more .*num-supernodes; a "
                                          r"deployment: see flwr supernode ls\) or lower num_byzantine \(with 2 "
                                          r"nodes, at most 0\)\)$"):
        _start_on_honest_nodes(strategy, 2)
    # The trimmed mean with f=3 needs 7 replies; with 5 nodes f=2 fits (2f+1 = 5).
    strategy = RobustStrategy(aggregator="trimmed_mean", num_byzantine=3, progress=False)
    caplog.clear()
    with caplog.at_level(logging.INFO), pytest.raises(QuorumError, match=r"at most 2\)\)$"):
        _start_on_honest_nodes(strategy, 5)
    said = [r.getMessage() for r in caplog.records]
    warned = [i for i, line in enumerate(said) if line.startswith(
        "5 nodes connected, but trimmed_mean with f=3 needs at least 7 valid replies: the first round stops the run")]
    trained = [i for i, line in enumerate(said) if "round 1" in line and "not aggregated" in line]
    assert len(warned) == 1 and said[warned[0]].endswith("(with 5 nodes, at most 2)"), said
    assert trained and warned[0] < trained[0], said  # before the round's training, not after it
    caplog.clear()
    _start_on_honest_nodes(RobustStrategy(aggregator="trimmed_mean", num_byzantine=2, progress=False), 5)
    assert not [r for r in caplog.records if "nodes connected, but" in r.getMessage()]
    # Where the rule's own parameters ask for more (trim=10 cuts 20 values), they are what to lower, not f.
    strategy = RobustStrategy(aggregator="trimmed_mean", aggregator_params={"trim": 10}, num_byzantine=1,
                              progress=False)
    advice = "lower the rule's parameters (aggregator_params={'trim': 10}: with f=1 they need more than 5)"
    caplog.clear()
    with caplog.at_level(logging.INFO), pytest.raises(QuorumError, match=re.escape(advice + ")")):
        _start_on_honest_nodes(strategy, 5)
    assert any(r.getMessage().endswith("connect more nodes or " + advice) for r in caplog.records), caplog.text


def test_partition_discovery_with_a_clientapp_that_has_no_query_handler_says_so_at_once() -> None:
    """Every node's ClientApp fails the query: the run stops on those answers, not when the wait ends."""
    import time

    strategy = RobustStrategy(num_byzantine=1, discover_partitions=True, wait_for_nodes=60, progress=False)
    started = time.monotonic()
    with pytest.raises(NoNodesError, match=r"^the ClientApp of every connected node \(5\) failed the partition "
                                           r"query, e.g. node \d+: .*query.*; nothing was trained\. .*"
                                           r"app.query\(\)\(fedrobust.partition_query\)"):
        _start_on_honest_nodes(strategy, 5)  # its ClientApp has @app.train() only
    assert time.monotonic() - started < 30


def test_nodes_that_never_answer_the_partition_query_are_said_to_be_busy_or_without_a_handler() -> None:
    """After a server crash the SuperNodes first work through the killed run's messages: connected, they do
    not answer the new run's query in time. The error says so, and what to do, before the handler advice."""
    from flwr.app import MessageType

    from experiments.inprocess import InProcessGrid, _server_identity

    class Busy(InProcessGrid):
        def push_messages(self, messages: Any) -> list[str]:
            messages = list(messages)
            ids = list(super().push_messages(messages))
            for message in messages:  # taken, never answered
                if message.metadata.message_type == MessageType.QUERY:
                    self._replies.pop(message.metadata.message_id)
            return ids

    grid = Busy(_echo_app(lambda _: {"num-examples": 10}), 3, seed=0)
    strategy = RobustStrategy(aggregator="median", discover_partitions=True, wait_for_nodes=0.5, progress=False)
    with _server_identity(grid.run.run_id), pytest.raises(NodesBusyError) as stopped:
        strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=1)
    assert str(stopped.value).startswith(  # not a deployment's grid: the simulation's reason
        "3 nodes connected, but only 0 of the 2 needed (min_available_nodes) answered the partition query within "
        f"0.5 s (silent: node {', '.join(map(str, sorted(grid.get_node_ids())))}); nothing was trained. Either the "
        "nodes are busy: a simulation's ClientApps start in Ray's workers, which take minutes on a loaded machine: "
        "run again"), stopped.value


def _discovering_run(
    node_configs: list[dict[str, int]], node_seed: int, checkpoint_dir: Path | None = None, num_rounds: int = 1
) -> list[int]:
    """``num_rounds`` rounds of a strategy with partition discovery on in-process nodes with ``node_configs``,
    whose ClientApp answers the query with ``fedrobust.partition_query``; the nodes' ids."""
    from experiments.inprocess import InProcessGrid, _server_identity, node_ids_for
    from fedrobust import partition_query

    app = ClientApp()
    app.train()(train)
    app.query()(partition_query)
    ids = node_ids_for(node_seed, len(node_configs))
    grid = InProcessGrid(app, len(ids), seed=0, nodes=dict(zip(ids, node_configs, strict=True)))
    strategy = RobustStrategy(num_byzantine=0, discover_partitions=True, min_available_nodes=len(ids),
                              checkpoint_dir=checkpoint_dir, progress=False)
    with _server_identity(grid.run.run_id):
        strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=num_rounds)
    return ids


def test_partition_discovery_says_when_two_nodes_hold_the_same_partition(caplog: pytest.LogCaptureFixture) -> None:
    """A node config copied from another device: both train on the same data, which the run should say."""
    ids = _discovering_run([{"partition-id": min(i, 2) + 3, "num-partitions": 9} for i in range(4)], node_seed=1)
    said = [r.getMessage() for r in caplog.records if "both hold partition-id" in r.getMessage()]
    assert said == [f"nodes {ids[2]} and {ids[3]} both hold partition-id=5: they train on the same data; give each "
                    "node its own partition-id in its node config (flower-supernode --node-config)"]
    assert not [r for r in caplog.records if "different num-partitions" in r.getMessage()]  # all said 9


def test_partition_discovery_says_when_nodes_cut_their_shares_differently(caplog: pytest.LogCaptureFixture) -> None:
    """A device added with num-partitions=5 while the others kept 4: the shares overlap, which the run says."""
    ids = _discovering_run([{"partition-id": i, "num-partitions": 5 if i == 4 else 4} for i in range(5)], node_seed=2)
    said = [r.getMessage() for r in caplog.records if "different num-partitions" in r.getMessage()]
    assert said == [f"the nodes cut their data shares by different num-partitions (4: nodes "
                    f"{', '.join(map(str, sorted(ids[:4])))}; 5: node {ids[4]}): their shares overlap; give every "
                    "node the same num-partitions in its node config (flower-supernode --node-config)"]


def test_a_resume_whose_nodes_cut_the_data_by_another_count_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint of a federation of 4 shares, resumed on 5 nodes that cut the data in 5: each
    partition-id now names another share, so the resumed run is not the one checkpointed; it says so."""
    warning = "the nodes cut the data by num-partitions=5, the run that wrote the checkpoint by 4"
    _discovering_run([{"partition-id": i, "num-partitions": 4} for i in range(4)], 3, tmp_path / "ckpt")
    _discovering_run([{"partition-id": i, "num-partitions": 4} for i in range(4)], 4, tmp_path / "ckpt", 2)
    assert not [r for r in caplog.records if "num-partitions=" in r.getMessage()]  # the same federation
    _discovering_run([{"partition-id": i, "num-partitions": 5} for i in range(5)], 5, tmp_path / "ckpt", 3)
    said = [r.getMessage() for r in caplog.records if "num-partitions=" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(warning), said


def test_a_rule_that_returns_nan_or_raises_is_named_not_taken_for_a_divergence() -> None:
    """A user rule that passes its contract check (5 random rows) but fails on the 4 replies of a round."""

    def nan_on_four(updates: torch.Tensor) -> torch.Tensor:
        out = updates.median(dim=0).values
        return out * float("nan") if len(updates) == 4 else out

    def raises_on_four(updates: torch.Tensor) -> torch.Tensor:
        if len(updates) == 4:
            raise IndexError("index 4 is out of bounds")
        return updates.median(dim=0).values

    strategy = RobustStrategy(aggregator=nan_on_four, num_byzantine=1, max_round_retries=1, progress=False)
    with pytest.raises(QuorumError, match=r"round 1: not aggregated after 2 attempts \(aggregator .*nan_on_four "
                                          r"returned 2410 non-finite values of 2410 from 4 finite replies\)"):
        _start_on_honest_nodes(strategy, 4)
    strategy = RobustStrategy(aggregator=raises_on_four, num_byzantine=1, progress=False)
    with pytest.raises(AggregationError, match=r"^round 1: aggregator .*raises_on_four failed on 4 replies: "
                                               r"IndexError: index 4 is out of bounds$"):
        _start_on_honest_nodes(strategy, 4)


def _batch_norm_run(client_variance: Callable[[torch.Tensor, int], torch.Tensor], **strategy_args: Any) -> list[float]:
    """Three rounds of a batch-norm model whose 3 clients reply ``client_variance(global variance,
    partition)`` as their running variance and the weights unchanged; the model's variance after each round."""
    from experiments.inprocess import InProcessGrid, _server_identity

    app = ClientApp()

    @app.train()
    def _train(msg: Message, context: Context) -> Message:
        state = msg.content["arrays"].to_torch_state_dict()
        state["1.running_var"] = client_variance(state["1.running_var"], int(context.node_config["partition-id"]))
        return Message(RecordDict({"arrays": ArrayRecord(state), "metrics": MetricRecord({"num-examples": 10})}),
                       reply_to=msg)

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    inputs, labels = torch.randn(16, 4, generator=torch.Generator().manual_seed(0)), torch.arange(16) % 3
    variances: list[float] = []

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net.load_state_dict(arrays.to_torch_state_dict())
        net.eval()
        variances.append(float(net[1].running_var[0]))
        with torch.no_grad():
            logits = net(inputs)
        return MetricRecord({"loss": float(nn.functional.cross_entropy(logits, labels)),
                             "accuracy": float((logits.argmax(1) == labels).float().mean())})

    grid = InProcessGrid(app, 3, seed=0)
    strategy = RobustStrategy(num_byzantine=0, progress=False, **strategy_args)
    with _server_identity(grid.run.run_id):
        strategy.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()), num_rounds=3, evaluate_fn=evaluate)
    return variances[1:]  # after rounds 1-3 (and any rolled-back attempt)


@pytest.mark.parametrize("optimizer", [{"server_optimizer": "fedavgm"}, {"server_lr": 1.8},
                                       {"server_optimizer": "fedadam", "server_lr": 0.5}])
def test_batch_norm_statistics_take_the_clients_aggregate_whatever_the_server_optimizer(optimizer: dict) -> None:
    """Clients whose running variance halves each round: the model's is the aggregate of theirs, 1/2, 1/4,
    1/8. Stepped as a weight, fedavgm's momentum would carry it to -0.2 in round 2 (NaN evaluations)."""
    assert _batch_norm_run(lambda v, _: v * 0.5, aggregator="mean", **optimizer) == [0.5, 0.25, 0.125]


def test_a_running_variance_below_zero_is_named_in_the_rollback_line(caplog: pytest.LogCaptureFixture) -> None:
    """One client sends a negative variance and the plain mean lets it through: every evaluation is NaN."""
    with caplog.at_level(logging.INFO, logger="fedrobust"), pytest.raises(QuorumError, match="running_var has val"):
        _batch_norm_run(lambda v, p: torch.full_like(v, -9.0) if p == 0 else v, aggregator="mean")
    rollbacks = [r.getMessage() for r in caplog.records if "diverged" in r.getMessage()]
    assert rollbacks and rollbacks[0].startswith("round 1 diverged (loss nan, best ")
    assert rollbacks[0].split("; ", 1)[1] == (
        "1.running_var has values below 0: the aggregate of the clients' batch-norm running variances, so replies "
        "with variances below 0 got through the rule): rolled back, server lr now 0.5"), rollbacks


def test_a_round_whose_replies_missed_the_deadline_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Nodes that never answer (a grid that loses their replies): the error names the deadline, not only
    '0 valid replies', and for the first round a start() trains (after a resume too), the ClientApps' start-up."""
    from experiments.inprocess import InProcessGrid, _server_identity

    class LosingGrid(InProcessGrid):
        def pull_messages(self, message_ids):  # type: ignore[no-untyped-def]
            return [r for r in super().pull_messages(message_ids) if r.metadata.src_node_id in self.answering]

    grid = LosingGrid(_echo_app(lambda _: {"num-examples": 10}), 4, seed=0)
    grid.answering = set(list(grid.get_node_ids())[:1])  # type: ignore[attr-defined]
    strategy = RobustStrategy(aggregator="median", num_byzantine=1, round_deadline=0.3, max_round_retries=0,
                              progress=False)
    with _server_identity(grid.run.run_id), pytest.raises(
        QuorumError, match=r"1 valid replies, median with f=1 needs at least 3\); 3 of 4 replies missed the "
                           r"round's deadline \(round_deadline, else start\(\)'s timeout; the first round's also "
                           r"covers the ClientApps' start-up"
    ):
        strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=1)

    # A checkpointed round 1 with every node answering, then a resumed start() whose round 2 loses them.
    grid = LosingGrid(_echo_app(lambda _: {"num-examples": 10}), 4, seed=0)
    grid.answering = set(grid.get_node_ids())  # type: ignore[attr-defined]

    def resumable() -> RobustStrategy:
        return RobustStrategy(aggregator="median", num_byzantine=1, round_deadline=0.3, max_round_retries=1,
                              checkpoint_dir=str(tmp_path / "ckpt"), progress=False)

    with _server_identity(grid.run.run_id), caplog.at_level("INFO", logger="fedrobust.strategies.reporting"):
        resumable().start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=1)
        grid.answering = set(list(grid.get_node_ids())[:1])  # type: ignore[attr-defined]
        with pytest.raises(QuorumError) as stopped:
            resumable().start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=2)
    message = str(stopped.value)
    assert message.startswith("round 2: not aggregated after 2 attempts") and "3 of 4 replies missed" in message
    assert "start-up" not in message  # its second attempt: the start-up was behind it
    (first_try,) = [m for m in caplog.messages if m.startswith("round 2 attempt 1 not aggregated")]
    assert first_try.endswith("the first round's also covers the ClientApps' start-up, e.g. a simulation's workers)")


def test_federated_evaluation_that_fails_on_every_client_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """fraction_evaluate > 0 with a ClientApp that has no evaluate function: every evaluate message comes back
    as an error. Said once as a warning with the reason, counted in every round's row, line and the summary."""
    from experiments.inprocess import InProcessGrid, _server_identity

    grid = InProcessGrid(_echo_app(lambda _: {"num-examples": 10}), 4, seed=0)
    strategy = RobustStrategy(aggregator="median", num_byzantine=1, fraction_evaluate=1.0,
                              metrics_path=tmp_path / "metrics.jsonl")
    with _server_identity(grid.run.run_id), caplog.at_level("WARNING", logger="fedrobust.strategies.round_loop"):
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=2)
    said = [r.getMessage() for r in caplog.records if "federated evaluation" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("round 1: federated evaluation got no reply of the 4 it asked for "
                                                 "(4 errors, e.g. ValueError: No evaluate function registered")
    assert "@app.evaluate()" in said[0]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [sum(r["evaluate_errors"].values()) for r in rows] == [4, 4] and rows[0]["evaluate_missing"] == 0
    assert not result.evaluate_metrics_clientapp
    assert not result.evaluate_metrics_serverapp  # no evaluate_fn: the counts are not server-side metrics

    class NoEvaluateReplies(InProcessGrid):  # evaluate replies lost on the way: none errs, all are missing
        def pull_messages(self, message_ids):  # type: ignore[no-untyped-def]
            return [r for r in super().pull_messages(message_ids) if r.metadata.message_type != "evaluate"]

    caplog.clear()
    grid = NoEvaluateReplies(_echo_app(lambda _: {"num-examples": 10}), 4, seed=0)
    strategy = RobustStrategy(aggregator="median", num_byzantine=1, fraction_evaluate=1.0, round_deadline=0.3,
                              progress=False)
    with _server_identity(grid.run.run_id), caplog.at_level("WARNING", logger="fedrobust.strategies.round_loop"):
        strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=1)
    said = [r.getMessage() for r in caplog.records if "federated evaluation" in r.getMessage()]
    assert len(said) == 1 and "(all missed the round's deadline)" in said[0] and "@app.evaluate" not in said[0]
    out = capsys.readouterr().out
    assert out.count("(evaluate replies failed 4)") == 2 and "    evaluate error x4: ValueError: No evaluate" in out
    assert "federated evaluation: 8 evaluate replies failed or missed the deadline" in out


def test_a_round_with_every_reply_rejected_says_why_and_that_f_was_lowered(caplog: pytest.LogCaptureFixture) -> None:
    """Every node replies without ``num-examples`` (the usual first mistake): the reason is in the error,
    and the lowered f is explained; more nodes proven faulty than num_byzantine is warned about once. Every
    node asked and refused alike is a setting or the ClientApp: not retried (each retry a rejection more
    towards quarantining every node); refusals for different reasons are."""
    from experiments.inprocess import InProcessGrid, _server_identity

    grid = InProcessGrid(_echo_app(lambda _: {"train_loss": 0.5}), 3, seed=0)
    strategy = RobustStrategy(aggregator="median", num_byzantine=1, max_round_retries=3, progress=False)
    with _server_identity(grid.run.run_id), pytest.raises(
        QuorumError,
        match=r"round 1: not aggregated after 1 attempt \(0 valid replies, median with f=0 \(num_byzantine=1 "
        r"less 3 proven faulty\) needs at least 1; rejected 3: 3x malformed_reply \('num-examples' \(weighted_by_key\) "
        r"missing or not a number; its metrics: 'train_loss'\) \(more than num_byzantine=1 nodes failing alike points "
        r"at the ClientApp's replies or a setting rather than at faulty nodes\); not retried: every node's reply was "
        r"refused for the same reason\)$",
    ):
        strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=1)
    warnings = [r.getMessage() for r in caplog.records if "more than num_byzantine" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("round 1: 3 nodes proven faulty"), warnings
    # Refused alike: the setting or the ClientApp comes first, num_byzantine last.
    assert "; 3 replies were rejected for the same reason (malformed_reply), which points at a setting or the " \
           "ClientApp's replies rather than at faulty nodes: fix that first" in warnings[0]
    assert warnings[0].endswith("if the nodes do misbehave, raise num_byzantine. Said once a run.")
    assert not [n for n in strategy.liveness.known_nodes() if strategy.liveness.status(n) == "quarantined"]

    # One node with a bad count, two without one: two reasons, retried as before.
    grid = InProcessGrid(_echo_app(lambda p: {"num-examples": -5} if p == 0 else {"train_loss": 0.5}), 3, seed=0)
    strategy = RobustStrategy(aggregator="median", num_byzantine=1, max_round_retries=1, progress=False)
    caplog.clear()
    with _server_identity(grid.run.run_id), pytest.raises(QuorumError, match=r"^round 1: not aggregated after 2 "
                                                                             r"attempts \(0 valid replies"):
        strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=1)
    warnings = [r.getMessage() for r in caplog.records if "more than num_byzantine" in r.getMessage()]
    assert len(warnings) == 1 and "; raise num_byzantine to the number of nodes that may misbehave, or fix the " \
                                  "rejected ones" in warnings[0], warnings


def test_a_run_stopped_by_a_round_that_failed_hands_back_the_result_of_the_rounds_before() -> None:
    """Where FedAvg goes on after a round with no result, RobustStrategy stops (QuorumError): the error
    carries Flower's Result up to the last completed round, so a ServerApp without checkpoints keeps round
    1's model when every client fails in round 2."""
    from experiments.inprocess import InProcessGrid, _server_identity
    from fedrobust import ClientFailureError

    app = ClientApp()

    @app.train()
    def _train(msg: Message, context: Context) -> Message:
        if int(msg.content["config"]["server-round"]) == 2:
            raise RuntimeError("CUDA out of memory")
        arrays = ArrayRecord({k: v + 1.0 for k, v in msg.content["arrays"].to_torch_state_dict().items()})
        return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 10})}), reply_to=msg)

    grid = InProcessGrid(app, 3, seed=0)
    initial = make_net().state_dict()
    strategy = RobustStrategy(aggregator="median", num_byzantine=1, progress=False)
    with _server_identity(grid.run.run_id), pytest.raises(ClientFailureError, match=r"^round 2: .*CUDA out of memory") \
            as stopped:
        strategy.start(grid=grid, initial_arrays=ArrayRecord(initial), num_rounds=3)
    result = stopped.value.result
    assert result is not None and sorted(result.train_metrics_clientapp) == [1]
    after_round_1 = result.arrays.to_torch_state_dict()
    assert all(torch.equal(after_round_1[k], initial[k] + 1.0) for k in initial)  # round 1's median, stepped

def test_a_node_marked_dead_is_named_in_the_rounds_it_is_not_sampled(capsys: pytest.CaptureFixture[str]) -> None:
    """A node whose ClientApp raises every round is dropped 3 rounds in a row, then dead: the rounds that
    leave it out say so (its replies are then neither dropped nor rejected), with the round of its probe."""
    from experiments.inprocess import InProcessGrid, _server_identity

    app = ClientApp()

    @app.train()
    def _train(msg: Message, context: Context) -> Message:
        if int(context.node_config["partition-id"]) == 0:
            raise RuntimeError("the device's disk is full")
        return Message(RecordDict({"arrays": msg.content["arrays"], "metrics": MetricRecord({"num-examples": 10})}),
                       reply_to=msg)

    grid = InProcessGrid(app, 5, seed=0)
    strategy = RobustStrategy(aggregator="median", num_byzantine=1, progress=True)
    with _server_identity(grid.run.run_id):
        strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=5)
    lines = capsys.readouterr().out.splitlines()
    rounds = [line for line in lines if line.startswith("[round")]
    assert [("dropped  1" in line, "dead 1" in line) for line in rounds] == [
        (True, False), (True, False), (True, True), (False, True), (False, True)
    ]
    dead = [line for line in lines if line.startswith("    dead: ")]
    assert len(dead) == 3 and len(set(dead)) == 1
    assert re.fullmatch(r"    dead: node \d+, not sampled until its probe in round 6", dead[0]), dead[0]

def test_fewer_nodes_than_min_available_stop_before_training_with_what_to_do() -> None:
    strategy = RobustStrategy(num_byzantine=1, min_available_nodes=5, wait_for_nodes=0.5, progress=False)
    with pytest.raises(NoNodesError, match=r"^2 of the 5 nodes needed \(min_available_nodes\) connected within "
                                           r"0.5 s; nothing was trained. Start more nodes \(a local simulation"):
        _start_on_honest_nodes(strategy, 2)
    # The larger of the two settings is the one to lower, and it is the one named.
    strategy = RobustStrategy(num_byzantine=1, min_train_nodes=4, wait_for_nodes=0.5, progress=False)
    with pytest.raises(NoNodesError, match=r"^2 of the 4 nodes needed \(min_train_nodes\) connected within 0.5 s; "
                                           r".* or need fewer \(min_train_nodes\)$"):
        _start_on_honest_nodes(strategy, 2)


def test_too_few_nodes_whose_partition_query_goes_unanswered_are_counted_as_connected() -> None:
    """Two nodes connected, neither answers discovery's query: the error counts the two connected nodes
    and says how many answered, instead of calling the silent ones unconnected."""
    from experiments.inprocess import InProcessGrid, _server_identity

    class SilentGrid(InProcessGrid):
        def pull_messages(self, message_ids):  # type: ignore[no-untyped-def]
            return []  # every reply lost: the nodes are listed but never answer

    grid = SilentGrid(_echo_app(lambda _: {"num-examples": 10}), 2, seed=0)
    strategy = RobustStrategy(num_byzantine=1, min_available_nodes=5, wait_for_nodes=0.5, discover_partitions=True,
                              progress=False)
    with _server_identity(grid.run.run_id), pytest.raises(
        NoNodesError, match=r"^2 of the 5 nodes needed \(min_available_nodes\) connected within 0.5 s \(0 of them "
                            r"answered the partition query\); nothing was trained"
    ):
        strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=1)


def test_a_checkpoint_of_another_model_is_refused_naming_what_differs(tmp_path: Path) -> None:
    """A second start() on the same checkpoint directory with another model: refused before any round
    (the clients could not load the checkpoint's weights), naming the keys and shapes."""
    _start_on_honest_nodes(RobustStrategy(checkpoint_dir=tmp_path, progress=False), 5)
    narrower = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
    with pytest.raises(CheckpointMismatchError, match=r"holds another model than the run's initial arrays: shape "
                                                      r"or dtype differs: 0.weight \(32, 64\) float32 -> \(16, 64\) "
                                                      r"float32, 0.bias \(32,\) float32 -> \(16,\) float32, 2.weight"):
        _start_on_honest_nodes(RobustStrategy(checkpoint_dir=tmp_path, progress=False), 5, initial=narrower)
    with_norm = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))
    missing_and_extra = r"not in the checkpoint: 1.weight, 1.bias, 1.running_mean, 1.running_var and 3 more; only in "
    with pytest.raises(CheckpointMismatchError, match=missing_and_extra + r"the checkpoint: 2.bias, 2.weight\."):
        _start_on_honest_nodes(RobustStrategy(checkpoint_dir=tmp_path, progress=False), 5, initial=with_norm)


def test_a_resume_with_another_train_config_is_refused_naming_it(tmp_path: Path) -> None:
    """``start(train_config=...)`` reaches every client's training: a checkpoint must agree with it."""
    from experiments.inprocess import InProcessGrid, _server_identity

    def start(lr: float, num_rounds: int) -> Result:
        grid = InProcessGrid(_echo_app(lambda _: {"num-examples": 10}), 3, seed=0)
        strategy = RobustStrategy(aggregator="median", checkpoint_dir=tmp_path, progress=False)
        with _server_identity(grid.run.run_id):
            return strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()),
                                  num_rounds=num_rounds, train_config=ConfigRecord({"lr": lr}))

    start(0.1, 1)
    with pytest.raises(CheckpointMismatchError, match=r"other settings: train_config.lr: 0.1 -> 0.5\."):
        start(0.5, 2)
    assert sorted(start(0.1, 2).train_metrics_clientapp) == [1, 2]  # the same train config resumes


def test_a_checkpoint_of_a_version_that_did_not_record_the_train_config_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Written as an earlier version wrote it (the strategy's settings alone), then resumed with the same
    train_config by this one: not refused for a setting the checkpoint could not record."""
    from experiments.inprocess import InProcessGrid, _server_identity
    from fedrobust.strategies import round_loop

    def start(num_rounds: int) -> Result:
        grid = InProcessGrid(_echo_app(lambda _: {"num-examples": 10}), 3, seed=0)
        strategy = RobustStrategy(aggregator="median", checkpoint_dir=tmp_path, progress=False)
        with _server_identity(grid.run.run_id):
            return strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()),
                                  num_rounds=num_rounds, train_config=ConfigRecord({"lr": 0.1}))

    current = round_loop.RoundCheckpointer
    with monkeypatch.context() as patch:
        patch.setattr(round_loop, "RoundCheckpointer", lambda url, *, settings, **kw: current(
            url, settings={k: v for k, v in settings.items() if k != "train_config"}, **kw))
        start(1)
    assert sorted(start(2).train_metrics_clientapp) == [1, 2]
    assert any("records no train_config (saved by an earlier version): not compared" in r.getMessage()
               for r in caplog.records)


def test_signing_mod_signs_a_whole_float_count_and_leaves_an_unusable_one_unsigned(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``num-examples`` as 96.0 is a count the server accepts: the mod signs it as the integer the server
    verifies. A count the server rejects anyway (2.5) goes unsigned rather than failing the ClientApp."""
    from experiments.inprocess import InProcessGrid, _server_identity
    from fedrobust import signing, signing_mod

    keys = [signing.derive_keypair(7, partition)[0] for partition in range(3)]
    trust = signing.TrustStore()
    for key in keys:
        trust.add(key.public_key())
    counts = {0: 96.0, 1: 40, 2: 2.5}
    mod = signing_mod(lambda context: keys[int(context.node_config["partition-id"])])
    grid = InProcessGrid(_echo_app(lambda partition: {"num-examples": counts[partition]}, [mod]), 3, seed=0)
    strategy = RobustStrategy(aggregator="mean", signing=trust, require_signatures=True)
    with _server_identity(grid.run.run_id):
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=1)
    metrics = result.train_metrics_clientapp[1]
    assert metrics["accepted"] == 2 and metrics["rejected.missing_signature"] == 1, dict(metrics)
    # The round's line says what an unsigned reply lacks, and where a node's key comes from.
    assert re.search(r"^    rejected: node \d+: missing_signature \(no signature: the ClientApp needs signing_mod\(\), "
                     r"and signing_mod a key for the node \(the node config's signing-key, or a key or "
                     r"key_for\(context\) passed to signing_mod\)\)$", capsys.readouterr().out, re.MULTILINE)


def test_a_stolen_key_whose_reply_fails_validation_does_not_lock_its_owner_out() -> None:
    """Partition 0's device also holds partition 1's key and replies first, with NaN. Its signature verifies,
    so the key's first-use pin would go to it and the owner be refused as key_bound_to_other_node for the
    whole run; the pin is dropped with the reply, and the owner's valid reply pins the key in its stead."""
    from experiments.inprocess import InProcessGrid, _server_identity
    from fedrobust import signing, signing_mod

    keys = [signing.derive_keypair(9, partition)[0] for partition in range(3)]
    trust = signing.TrustStore()
    for partition, key in enumerate(keys):
        trust.add(key.public_key(), partition_id=partition)
    app = ClientApp(mods=[signing_mod(lambda context: keys[max(1, int(context.node_config["partition-id"]))])])

    @app.train()
    def _train(msg: Message, context: Context) -> Message:
        local = msg.content["arrays"].to_torch_state_dict()
        if int(context.node_config["partition-id"]) == 0:
            local = {k: torch.full_like(v, float("nan")) for k, v in local.items()}
        content = RecordDict({"arrays": ArrayRecord(local), "metrics": MetricRecord({"num-examples": 10})})
        return Message(content, reply_to=msg)

    class ThiefFirst(InProcessGrid):
        """Replies handed over in node id order (a SuperLink's order is whatever the network makes it)."""

        def pull_messages(self, message_ids: Any) -> list[Message]:
            return sorted(super().pull_messages(message_ids), key=lambda reply: reply.metadata.src_node_id)

    thief, owner, other = 101, 102, 103
    nodes = {thief: {"partition-id": 0, "num-partitions": 3}, owner: {"partition-id": 1, "num-partitions": 3},
             other: {"partition-id": 2, "num-partitions": 3}}
    grid = ThiefFirst(app, 3, seed=0, nodes=nodes)
    strategy = RobustStrategy(aggregator="mean", signing=trust, require_signatures=True, progress=False)
    with _server_identity(grid.run.run_id):
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=2)
    first, second = (dict(result.train_metrics_clientapp[r]) for r in (1, 2))
    assert (first["accepted"], first["rejected.non_finite"]) == (2, 1), first
    # Round 2: the key is the owner's now; the thief's reply is refused before its NaN is looked at.
    assert (second["accepted"], second["rejected.key_bound_to_other_node"]) == (2, 1), second
    assert trust.bound_node(signing.key_id(keys[1].public_key())) == owner


def test_signing_mod_signs_the_records_a_strategy_with_other_keys_names() -> None:
    """``weighted_by_key`` and ``arrayrecord_key`` as in FedAvg: the server names them in the train config,
    and the mod signs the count and arrays under those names (a second ArrayRecord makes the name matter)."""
    from experiments.inprocess import InProcessGrid, _server_identity
    from fedrobust import signing, signing_mod

    keys = [signing.derive_keypair(5, partition)[0] for partition in range(3)]
    trust = signing.TrustStore()
    for key in keys:
        trust.add(key.public_key())
    app = ClientApp(mods=[signing_mod(lambda context: keys[int(context.node_config["partition-id"])])])

    @app.train()
    def _train(msg: Message, context: Context) -> Message:
        extra = ArrayRecord({"step": torch.zeros(1)})
        content = RecordDict({"weights": msg.content["weights"], "extra": extra, "metrics": MetricRecord({"n": 12})})
        return Message(content, reply_to=msg)

    grid = InProcessGrid(app, 3, seed=0)
    strategy = RobustStrategy(aggregator="mean", signing=trust, weighted_by_key="n", arrayrecord_key="weights",
                              progress=False)
    with _server_identity(grid.run.run_id):
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=1)
    assert result.train_metrics_clientapp[1]["accepted"] == 3, dict(result.train_metrics_clientapp[1])


def test_optional_signatures_take_a_node_without_a_key_and_still_check_a_wrong_one() -> None:
    """Keys rolled out to some devices only (require_signatures=False with a trust store): a node without a
    key replies unsigned and is taken; a node signing with a key the store does not hold is not."""
    from experiments.inprocess import InProcessGrid, _server_identity
    from fedrobust import signing, signing_mod

    keys = {0: signing.derive_keypair(3, 0)[0], 1: signing.derive_keypair(3, 1)[0], 3: signing.generate_keypair()[0]}
    trust = signing.TrustStore()
    for partition in (0, 1):
        trust.add(keys[partition].public_key())
    mod = signing_mod(lambda context: keys.get(int(context.node_config["partition-id"])))
    grid = InProcessGrid(_echo_app(lambda _: {"num-examples": 10}, [mod]), 4, seed=0)  # 2: no key; 3: untrusted
    strategy = RobustStrategy(aggregator="mean", signing=trust, require_signatures=False, progress=False)
    with _server_identity(grid.run.run_id):
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=1)
    metrics = result.train_metrics_clientapp[1]
    assert metrics["accepted"] == 3 and metrics["rejected.unknown_key"] == 1, dict(metrics)


def test_federated_evaluation_metrics_are_trimmed_so_one_client_cannot_set_them() -> None:
    """Clients report their own evaluation metrics: one that claims 900,000 examples at accuracy 0 would own
    FedAvg's weighted mean (0.0001 of the others' weight left); trimmed by f, the honest values decide."""
    from experiments.inprocess import InProcessGrid, _server_identity

    app = _echo_app(lambda _: {"num-examples": 100})

    @app.evaluate()
    def _evaluate(msg: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        if partition == 0:  # the liar
            metrics = MetricRecord({"num-examples": 900_000, "accuracy": 0.0, "loss": float("nan")})
        else:
            metrics = MetricRecord({"num-examples": 100 * partition, "accuracy": 0.8 + 0.01 * partition, "loss": 0.5})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    grid = InProcessGrid(app, 5, seed=0)
    strategy = RobustStrategy(aggregator="median", num_byzantine=1, fraction_evaluate=1.0, progress=False)
    with _server_identity(grid.run.run_id):
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=1)
    federated = result.evaluate_metrics_clientapp[1]
    # accuracy: 0.0 and 0.84 trimmed; 0.81, 0.82, 0.83 weighted by 100, 200, 300 examples.
    assert federated["accuracy"] == pytest.approx((0.81 * 100 + 0.82 * 200 + 0.83 * 300) / 600)
    # loss: the liar's NaN is skipped; of four 0.5s the trimmed mean is 0.5.
    assert federated["loss"] == pytest.approx(0.5)


def test_evaluation_replies_without_a_count_are_said_once_not_dropped_silently(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from experiments.inprocess import InProcessGrid, _server_identity

    app = _echo_app(lambda _: {"num-examples": 100})

    @app.evaluate()
    def _evaluate(msg: Message, context: Context) -> Message:  # forgot num-examples
        return Message(RecordDict({"metrics": MetricRecord({"accuracy": 0.8})}), reply_to=msg)

    grid = InProcessGrid(app, 3, seed=0)
    strategy = RobustStrategy(aggregator="median", fraction_evaluate=1.0, progress=False)
    with _server_identity(grid.run.run_id):
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=2)
    assert not result.evaluate_metrics_clientapp
    said = [r.getMessage() for r in caplog.records if "evaluation replies left out" in r.getMessage()]
    assert said == ["round 1: 3 evaluation replies left out: their 'num-examples' is missing or not in (0, "
                    "max_num_examples=1000000] (the evaluate reply's MetricRecord needs it, as the train reply's "
                    "does). Said once a run."]


def test_flower_s_metrics_aggregation_functions_are_taken_as_fedavg_takes_them() -> None:
    """``train_metrics_aggr_fn`` / ``evaluate_metrics_aggr_fn``, Flower's FedAvg arguments: the train one sees
    the accepted replies only, the evaluate one replaces the trimmed default (here letting the liar in)."""
    from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

    from experiments.inprocess import InProcessGrid, _server_identity

    app = ClientApp()

    @app.train()
    def _train(msg: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        arrays = msg.content["arrays"]
        if partition == 0:  # rejected: NaN weights
            arrays = ArrayRecord({k: torch.full_like(v, float("nan")) for k, v in arrays.to_torch_state_dict().items()})
        metrics = MetricRecord({"num-examples": 100 * (partition + 1), "loss": float(partition),
                                "train_loss": 10.0 * partition, "acc": partition / 10})
        return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)

    @app.evaluate()
    def _evaluate(msg: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        accuracy, count = (0.0, 900_000) if partition == 0 else (0.9, 100)
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": count, "accuracy": accuracy})}),
                       reply_to=msg)

    seen: list[list[float]] = []

    def train_aggr(records: list[RecordDict], key: str) -> MetricRecord:
        seen.append(sorted(float(r["metrics"][key]) for r in records))
        return aggregate_metricrecords(records, key)

    grid = InProcessGrid(app, 4, seed=0)
    strategy = RobustStrategy(aggregator="median", num_byzantine=1, fraction_evaluate=1.0, progress=False,
                              train_metrics_aggr_fn=train_aggr, evaluate_metrics_aggr_fn=aggregate_metricrecords)
    with _server_identity(grid.run.run_id):
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=1)
    assert seen == [[200.0, 300.0, 400.0]]  # partition 0's rejected reply is not among them
    train = result.train_metrics_clientapp[1]
    # FedAvg's weighted mean of every metric, named train_<key>; the client's own train_loss wins over its loss.
    assert train["train_loss"] == pytest.approx(10 * (1 * 200 + 2 * 300 + 3 * 400) / 900) and train["accepted"] == 3
    assert train["train_acc"] == pytest.approx((1 * 200 + 2 * 300 + 3 * 400) / 9000)
    # FedAvg's weighted mean, as asked: the liar's 900,000 examples at accuracy 0 outweigh the rest.
    assert result.evaluate_metrics_clientapp[1]["accuracy"] == pytest.approx(0.9 * 300 / 900_300)

    # The default: every metric, trimmed of num_byzantine values at each end, then weighted (partition 2's).
    strategy = RobustStrategy(aggregator="median", num_byzantine=1, progress=False)
    grid = InProcessGrid(app, 4, seed=0)
    with _server_identity(grid.run.run_id):
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=1,
                                evaluate_fn=lambda r, a: MetricRecord({"accuracy": 0.5, "loss": 1.0}))
    train = result.train_metrics_clientapp[1]
    assert (train["train_loss"], train["train_acc"]) == (pytest.approx(20.0), pytest.approx(0.2))
    assert "train_num-examples" not in train
    assert dict(result.evaluate_metrics_serverapp[1]) == {"accuracy": 0.5, "loss": 1.0}  # what evaluate_fn said


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"aggregator": "krun"}, r"^unknown aggregation rule 'krun' \(did you mean 'krum'\?\); valid names: mean, "),
        ({"aggregator": "Trimmed-Mean"}, r"^unknown aggregation rule 'Trimmed-Mean' \(did you mean 'trimmed_mean'\?\)"),
        ({"aggregator": "median", "pre": ["nnmm"]}, r"^unknown pre-aggregator 'nnmm' \(did you mean 'nnm'\?\)"),
        ({"aggregator": "trimmed_mean", "aggregator_params": {"trimm": 1}},
         r"^trimmed_mean: unknown parameter\(s\) trimm \(did you mean 'trim'\?\); valid parameters: trim, chunk_size$"),
        ({"aggregator": "xyz"}, r"^unknown aggregation rule 'xyz'; valid names"),  # nothing close: no guess
        # FedAvg(0.5) is fraction_train=0.5.
        ({"aggregator": 0.5}, r"^aggregator=0.5: RobustStrategy's first argument is the rule \(FedAvg's is "
                              r"fraction_train\): pass fraction_train=0.5 by name$"),
        ({"num_byzantine": -1}, "num_byzantine"),
        ({"fraction_train": 1.5}, "fraction_train"),
        ({"server_optimizer": "sgd"}, "valid choices"),
        ({"max_update_norm": -1.0}, r"^max_update_norm must be >= 0 \(0 or None: no bound\), got -1.0$"),
        ({"max_update_norm": float("nan")}, r"^max_update_norm must be >= 0 \(0 or None: no bound\), got nan$"),
        ({"divergence_factor": -1.0}, "divergence_factor"),
        ({"resume": "sometimes"}, "valid choices"),
        ({"checkpoint_keep": 0}, "checkpoint_keep"),
        ({"checkpoint_dir": "nosuchproto://runs"}, r"^checkpoint_dir=nosuchproto://runs: unknown storage protocol "
                                                   r"'nosuchproto'; e.g. a local path, file://, s3://"),
        ({"checkpoint_dir": __file__}, r"^checkpoint_dir=.*test_library.py: must be a directory or URL \(a file of "
                                       r"that name exists\)$"),
        ({"checkpoint_dir": "ck", "checkpoint_mirror": "nosuch://m"}, r"^checkpoint_mirror=nosuch://m: unknown"),
        ({"checkpoint_dir": "ck", "checkpoint_mirror": "./ck/"}, r"^checkpoint_mirror='./ck/' is checkpoint_dir"),
        # As values come from a config file: a string names the argument, its value and its type.
        ({"fraction_train": "0.5"}, r"^fraction_train must be a number, got '0.5' \(str\)$"),
        ({"max_update_norm": "10"}, r"^max_update_norm must be a number or None, got '10' \(str\)$"),
        ({"round_deadline": "60"}, r"^round_deadline must be a number or None"),
        ({"num_byzantine": "2"}, r"^num_byzantine must be an integer, got '2' \(str\)$"),
        ({"num_byzantine": True}, r"^num_byzantine must be an integer, got True \(bool\)$"),
        ({"fraction_train": 0.0}, r"fraction_train must be in \(0, 1\], got 0.0: RobustStrategy trains in every"),
        ({"server_optimizer": "fedadam", "server_optimizer_params": {"beta1": 0.9}},
         r"server_optimizer_params of fedadam: unknown key\(s\) \['beta1'\] \(did you mean 'beta_1'\?\); valid keys: "
         r"\['beta_1', 'beta_2'"),
        ({"server_optimizer_params": {"momentum": 0.9}},  # fedavg has no momentum: it would do nothing
         r"server_optimizer_params of fedavg: unknown key\(s\) \['momentum'\]; valid keys: \[\]"),
        ({"server_optimizer": "fedavgm", "server_optimizer_params": {"momentum": "0.9"}},
         r"server_optimizer_params\['momentum'\] must be a number, got '0.9'"),
        # A flag read from a config file as the string "false" would switch weighting by claimed counts on.
        ({"weight_by_num_examples": "false"}, r"^weight_by_num_examples must be True or False, got 'false' \(str\)"),
        ({"weighted_by_key": None}, r"^weighted_by_key must be a record or metric name, got None"),
        ({"train_metrics_aggr_fn": "mean"}, r"^train_metrics_aggr_fn must be a function or None, got 'mean'"),
        ({"metrics_path": 123}, r"^metrics_path must be a path or None, got 123 \(int\)"),
        ({"liveness": {"dead_afterr": 3}},
         r"liveness: unknown key\(s\) \['dead_afterr'\] \(did you mean 'dead_after'\?\); valid keys: .*'dead_after'"),
        ({"aggregator": "median", "pre": [{"threshold": 5}]}, r"pre-aggregator \{'threshold': 5\} has no 'name'"),
        ({"checkpoint_dir": 5}, r"^checkpoint_dir must be a path or None, got 5 \(int\)"),
        ({"metrics_path": "/tmp"}, r"^metrics_path must be a file \(one JSON line per round\), got the directory"),
        # Found when the strategy is built, not when round 1 has trained and its row cannot be written.
        ({"metrics_path": __file__ + "/runs/metrics.jsonl"}, r"^metrics_path .* cannot be written: .*\.py. is a file"),
        ({"server_lr": float("inf")}, r"^server_lr must be finite, got inf"),
        ({"seed": -1}, r"^seed must be an integer >= 0, got -1"),
        ({"aggregator_params": [("trim", 1)]}, r"^aggregator_params must be a mapping of names to values"),
        ({"settings": 5}, r"^settings must be a mapping of names to values, got 5"),
        ({"liveness": "fast"}, r"^liveness must be a LivenessConfig, a mapping of its fields or None, got 'fast'"),
        ({"signing": 5}, r"^signing must be a TrustStore, the path of one, or None, got 5 \(int\)"),
    ],
)
def test_constructor_refuses_bad_arguments_with_a_clear_message(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        RobustStrategy(**kwargs)


def test_a_misspelt_keyword_argument_gets_the_one_meant() -> None:
    with pytest.raises(TypeError) as raised:
        RobustStrategy("median", 1, max_update_nrom=5.0)
    assert str(raised.value) == ("RobustStrategy() got an unexpected keyword argument 'max_update_nrom' "
                                 "(did you mean 'max_update_norm'?)")


def test_constructor_takes_numpy_integers_and_warns_about_the_plain_mean_with_f(
    caplog: pytest.LogCaptureFixture,
) -> None:
    strategy = RobustStrategy(num_byzantine=np.int64(2), min_train_nodes=np.int32(3), server_lr=np.float32(0.5),
                              aggregator_params={"trim": np.int64(1)}, liveness={"dead_after": np.int64(3)},
                              aggregator="trimmed_mean", progress=False)
    assert type(strategy.num_byzantine) is int and strategy.num_byzantine == 2 and strategy.min_train_nodes == 3
    assert type(strategy.server_lr) is float and type(strategy.optimizer.lr) is float  # JSON in checkpoints
    assert strategy.liveness_config.dead_after == 3
    # 0 is "no bound", as validation.max_update_norm=0 in a run config.
    assert RobustStrategy(num_byzantine=1, max_update_norm=np.float32(0), progress=False).max_update_norm is None
    from fedrobust.strategies import robust_strategy

    robust_strategy._said["plain mean"] = False  # another test of this process may have had it said
    for _ in range(2):
        RobustStrategy(aggregator="mean", num_byzantine=2, progress=False)
    said = [r for r in caplog.records if "the plain mean tolerates no faulty reply" in r.getMessage()]
    assert len(said) == 1  # once a process
    robust_strategy._said["f=0"] = False
    RobustStrategy(progress=False)  # FedAvg swapped out, num_byzantine left at its default
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("num_byzantine=0: aggregator")]
    assert len(said) == 1 and "is configured for no faulty node (f=0; the default pipeline then averages" in said[0]
    robust_strategy._said["f=0"] = False
    caplog.clear()
    RobustStrategy(aggregator="median", progress=False)  # another rule: no word of the default pipeline
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("num_byzantine=0: aggregator")]
    assert said == ["num_byzantine=0: aggregator median is configured for no faulty node (f=0); set num_byzantine "
                    "to the number of nodes that may be faulty"]


def test_settings_a_rule_does_not_honour_are_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """weight_by_num_examples with a rule that takes no weights, and a user's function rule without min_n()
    at f > 0, are accepted as Flower users write them, and said: neither does what it looks like."""
    from fedrobust.strategies import robust_strategy

    for key in ("no weights", "no min_n"):
        monkeypatch.setitem(robust_strategy._said, key, False)

    def my_median(updates: torch.Tensor) -> torch.Tensor:
        return updates.median(dim=0).values

    class MedianNeedingThree:
        def __call__(self, updates: torch.Tensor) -> torch.Tensor:
            return updates.median(dim=0).values

        def min_n(self) -> int:
            return 3

    with caplog.at_level("WARNING", logger="fedrobust.strategies.robust_strategy"):
        RobustStrategy(aggregator="mean", num_byzantine=0, weight_by_num_examples=True, progress=False)
        RobustStrategy(aggregator=MedianNeedingThree(), num_byzantine=1, progress=False)  # declares it
        RobustStrategy(aggregator=my_median, num_byzantine=0, progress=False)  # f = 0: one reply is enough
        assert not [m for m in caplog.messages if "weight_by_num_examples" in m or "min_n" in m]
        for _ in range(2):
            RobustStrategy(num_byzantine=1, weight_by_num_examples=True, progress=False)
            RobustStrategy(aggregator=my_median, num_byzantine=1, progress=False)
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    weights = [m for m in said if m.startswith("weight_by_num_examples=True")]
    assert len(weights) == 1 and "takes no weights, so every valid reply counts once" in weights[0]
    rows = [m for m in said if "has no min_n()" in m]
    assert len(rows) == 1 and "so it runs on as few as 1 valid reply; with num_byzantine=1" in rows[0]


def test_checkpoint_settings_without_a_checkpoint_dir_are_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """checkpoint_every=5 without checkpoint_dir writes nothing: said, naming what was set, once a process."""
    from fedrobust.strategies import robust_strategy

    monkeypatch.setitem(robust_strategy._said, "no checkpoint_dir", False)
    with caplog.at_level("WARNING", logger="fedrobust.strategies.robust_strategy"):
        RobustStrategy(num_byzantine=1, progress=False)  # the defaults: nothing to say
        RobustStrategy(num_byzantine=1, checkpoint_dir="", progress=False)
        assert not [m for m in caplog.messages if "checkpoint_dir" in m]
        for _ in range(2):
            RobustStrategy(num_byzantine=1, checkpoint_every=5, checkpoint_keep=2, progress=False)
    said = [m for m in caplog.messages if "without checkpoint_dir" in m]
    assert said == ["checkpoint_every=5, checkpoint_keep=2 without checkpoint_dir: no checkpoint is written; pass "
                    "checkpoint_dir to checkpoint the rounds"]


def test_the_start_line_shows_the_server_step_and_how_checkpoints_are_kept(tmp_path: Path) -> None:
    plain_run = RobustStrategy(num_byzantine=1, progress=False).describe()
    trim = RobustStrategy(aggregator="trimmed_mean", num_byzantine=1, aggregator_params={"trim": 2}, progress=False)
    assert trim.describe().startswith("RobustStrategy: rule=trimmed_mean trim=2 f=1 ")
    assert "server-opt=fedavg(lr=1) " in plain_run and plain_run.endswith("checkpoints=off")
    adam = RobustStrategy(
        num_byzantine=1, server_optimizer="fedadam", server_lr=0.1, server_lr_schedule="cosine",
        server_lr_min_ratio=0.2, checkpoint_dir=tmp_path / "ck", checkpoint_every="auto", checkpoint_full_every=4,
        checkpoint_mirror=str(tmp_path / "mirror"), progress=False,
    ).describe()
    assert "server-opt=fedadam(lr=0.1, beta_1=0.9, beta_2=0.99, tau=0.001, cosine to 0.2 x lr) " in adam
    assert adam.endswith(f"checkpoints={tmp_path / 'ck'} (at the Young/Daly interval, keep 3, a full one every 4, "
                         f"mirror {tmp_path / 'mirror'})")
    by_time = RobustStrategy(
        num_byzantine=1, server_optimizer="fedavgm", server_lr_schedule=lambda r, n: 1.0,
        checkpoint_dir=tmp_path / "ck", checkpoint_every=0, checkpoint_every_seconds=60, progress=False,
    ).describe()
    assert "server-opt=fedavgm(lr=1, momentum=0.9, schedule test_the_start_line_shows_" in by_time
    assert by_time.endswith("(every 60 s, after the last round, keep 3)")

def test_a_rule_whose_constructor_raises_is_named_with_the_call() -> None:
    """A wrong parameter value reaches the user's own constructor: the error shows the call, f included."""

    class ClippedMean:
        def __init__(self, f: int, tau: float = 1.0) -> None:
            if tau <= 0:
                raise ValueError(f"tau must be > 0, got {tau}")
            self.f, self.tau = f, tau

        def __call__(self, updates: torch.Tensor) -> torch.Tensor:
            return updates.mean(dim=0)

    with pytest.raises(ValueError, match=r"ClippedMean\(tau='abc', f=1\) raised TypeError: '<=' not supported"):
        RobustStrategy(aggregator=ClippedMean, num_byzantine=1, aggregator_params={"tau": "abc"}, progress=False)
    with pytest.raises(ValueError, match=r"ClippedMean\(tau=-1, f=1\) raised ValueError: tau must be > 0, got -1$"):
        RobustStrategy(aggregator=ClippedMean, num_byzantine=1, aggregator_params={"tau": -1}, progress=False)

def test_a_plain_function_or_a_built_object_is_the_rule_itself() -> None:
    """What a user coming from Flower writes first: ``def rule(updates)`` or ``MyRule(f=1)``, not a factory."""

    def coordinate_median(updates: torch.Tensor) -> torch.Tensor:
        return updates.median(dim=0).values

    class TrimmedByOne:
        def __init__(self, f: int) -> None:
            self.f = f

        def __call__(self, updates: torch.Tensor) -> torch.Tensor:
            return updates.sort(dim=0).values[self.f : len(updates) - self.f].mean(dim=0)

    rows = torch.tensor([[0.0], [1.0], [2.0], [100.0], [3.0]])
    for rule, expected in ((coordinate_median, 2.0), (TrimmedByOne(f=1), 2.0), (TrimmedByOne, 2.0)):
        strategy = RobustStrategy(aggregator=rule, num_byzantine=1, progress=False)
        assert float(strategy.aggregator(rows)[0]) == expected, rule

    class WithMomentum:  # state of its own: the contract check at construction must not touch it
        def __init__(self) -> None:
            self.previous: torch.Tensor | None = None

        def __call__(self, updates: torch.Tensor) -> torch.Tensor:
            mean = updates.mean(dim=0)
            self.previous = mean if self.previous is None else 0.5 * self.previous + 0.5 * mean
            return self.previous

    stateful = WithMomentum()
    strategy = RobustStrategy(aggregator=stateful, num_byzantine=1, progress=False)
    assert stateful.previous is None  # checked on a copy
    assert float(strategy.aggregator(rows)[0]) == pytest.approx(21.2) and stateful.previous is not None


def test_a_checkpoint_tells_a_changed_user_rule_from_the_same_one() -> None:
    """A resume compares the rule's identity: name, code and an object's settings, never its address."""
    from fedrobust.components import rule_identity

    class Scaled:
        def __init__(self, scale: float) -> None:
            self.scale = scale

        def __call__(self, updates: torch.Tensor) -> torch.Tensor:
            return self.scale * updates.median(dim=0).values

    median = lambda updates: updates.median(dim=0).values  # noqa: E731 - as users write them
    mean = lambda updates: updates.mean(dim=0)  # noqa: E731
    assert rule_identity(Scaled(1.0)) == rule_identity(Scaled(1.0))  # two objects, two addresses
    assert rule_identity(Scaled(1.0)) != rule_identity(Scaled(2.0))
    assert rule_identity(median) != rule_identity(mean)  # both named <lambda>
    assert rule_identity(Scaled)["name"].endswith("Scaled") and rule_identity(Scaled)["code"]

    def clipped_mean(clip: float) -> Callable[[torch.Tensor], torch.Tensor]:
        def rule(updates: torch.Tensor) -> torch.Tensor:
            return updates.clamp(-clip, clip).mean(dim=0)
        return rule

    # Two closures of one factory share their code: the values they captured tell them apart.
    assert rule_identity(clipped_mean(1.0)) == rule_identity(clipped_mean(1.0))
    assert rule_identity(clipped_mean(1.0)) != rule_identity(clipped_mean(2.0))
    assert rule_identity(clipped_mean(1.0))["captured"] == {"clip": 1.0}
    assert "captured" not in rule_identity(median)  # a function that captures nothing records what it did


def test_a_resume_past_num_rounds_says_that_nothing_is_trained(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from experiments.inprocess import InProcessGrid, _server_identity

    results = []
    for num_rounds in (2, 1):  # a second start() on the checkpoint of round 2, asking for 1 round
        grid = InProcessGrid(_echo_app(lambda _: {"num-examples": 10}), 5, seed=0)
        with _server_identity(grid.run.run_id):
            initial = ArrayRecord(make_net().state_dict())
            results.append(RobustStrategy(checkpoint_dir=tmp_path).start(grid=grid, initial_arrays=initial,
                                                                         num_rounds=num_rounds))
    assert "the checkpoint is after round 2, past num_rounds=1: nothing to train" in capsys.readouterr().out
    assert sorted(results[1].train_metrics_clientapp) == [1, 2]


@pytest.mark.slow(seconds=20)
def test_a_run_with_a_rule_object_resumes_in_another_process(tmp_path: Path) -> None:
    """The settings a checkpoint must agree with name a user's rule by its dotted name, not by repr(),
    which holds the object's address: the same rule in a new process must resume, another must not."""
    import os
    import subprocess

    script = tmp_path / "run_once.py"
    script.write_text(
        "import sys, torch\n"
        "from tests.integration.test_library import RobustStrategy, _start_on_honest_nodes\n"
        "def coordinate_median(updates):\n"
        "    return updates.median(dim=0).values\n"
        "def coordinate_mean(updates):\n"
        "    return updates.mean(dim=0)\n"
        "rule = coordinate_median if sys.argv[2] == 'median' else coordinate_mean\n"
        "_start_on_honest_nodes(RobustStrategy(aggregator=rule, checkpoint_dir=sys.argv[1]), 5)\n"
    )
    root = Path(__file__).resolve().parents[2]

    def run(rule: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, str(script), str(tmp_path / "ckpt"), rule]
        env = {**os.environ, "PYTHONPATH": str(root)}
        return subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=120, env=env)

    assert run("median").returncode == 0
    again = run("median")
    assert again.returncode == 0 and "resumed after round 1" in again.stdout + again.stderr, again.stderr[-2000:]
    other = run("mean")
    assert other.returncode != 0 and "saved with other settings: aggregator.code:" in other.stderr, other.stderr[-2000:]


def test_installed_names_live_under_fedrobust_only(tmp_path: Path) -> None:
    """The wheel holds the fedrobust package and nothing generic (strategies, clients, experiments)."""
    import subprocess
    import zipfile

    repo = Path(__file__).resolve().parents[2]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(repo),
        ],
        check=True,
        capture_output=True,
        timeout=300,
        cwd=tmp_path,
    )
    wheel = next(tmp_path.glob("fedrobust-*.whl"))
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"fedrobust"}, tops
    names = zipfile.ZipFile(wheel).namelist()
    assert "fedrobust/strategies/robust_strategy.py" in names and "fedrobust/clients/signing_mod.py" in names


def test_a_model_that_fits_its_data_is_not_rolled_back_for_noise_but_an_explosion_is() -> None:
    """Losses of 1e-6 then 5e-5 (a model that fits its data) are no divergence, though 50 times the best;
    a loss of 5.0 after them is, and the round runs again from the state before it."""
    from experiments.inprocess import InProcessGrid, _server_identity

    losses = iter([2.0, 1e-6, 5e-5, 5.0, 4e-5])  # rounds 0, 1, 2, 3 and 3's second attempt

    def scripted_loss(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        return MetricRecord({"loss": next(losses), "accuracy": 1.0})

    honest = ClientApp()

    @honest.train()
    def _train(msg: Message, context: Context) -> Message:
        context.node_config["partition-id"] = int(context.node_config["partition-id"]) + 3
        return train(msg, context)

    grid = InProcessGrid(honest, 4, seed=0)
    strategy = RobustStrategy(aggregator="median", num_byzantine=1, progress=False)
    with _server_identity(grid.run.run_id):
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=3,
                                evaluate_fn=scripted_loss)
    rows = result.evaluate_metrics_serverapp
    # The rollback halves the server lr (lr_decay) and round 3 is the second attempt's.
    assert [result.train_metrics_clientapp[r]["server_lr"] for r in (1, 2, 3)] == [1.0, 1.0, 0.5]
    assert [rows[r]["loss"] for r in (1, 2, 3)] == [1e-6, 5e-5, 4e-5]
    assert next(losses, None) is None  # round 3 was evaluated twice


def test_a_norm_bound_too_low_for_the_model_names_the_setting_that_moves_it() -> None:
    strategy = RobustStrategy(aggregator="median", num_byzantine=1, max_update_norm=1e-6, max_round_retries=0,
                              progress=False)
    with pytest.raises(QuorumError, match=r"rejected 4: 4x norm_too_large \(L2 norm \S+ > bound 1e-06\) \(if these "
                                          r"nodes are honest, raise the bound: max_update_norm\)\)$"):
        _start_on_honest_nodes(strategy, 4)
    strategy = RobustStrategy(aggregator="median", num_byzantine=1, max_num_examples=1, max_round_retries=0,
                              progress=False)
    with pytest.raises(QuorumError, match=r"4x bad_num_examples \(\d+ not an integer in \[1, 1\]\) \(if these "
                                          r"nodes are honest, raise the bound: max_num_examples\)\)$"):
        _start_on_honest_nodes(strategy, 4)


def test_partition_query_makes_a_user_app_give_the_same_bytes_whatever_its_node_ids() -> None:
    """Rows are ordered by partition once the nodes answer the partition query, so two runs whose nodes
    have other ids (two simulations) end with the same model bytes; the user's ClientApp gets one line."""
    from experiments.inprocess import InProcessGrid, _server_identity, node_ids_for
    from fedrobust import partition_query

    app = ClientApp()
    app.train()(train)
    app.query()(partition_query)

    def final_bytes(node_seed: int) -> bytes:
        ids = node_ids_for(node_seed, 6)
        nodes = {node_id: {"partition-id": i + 3, "num-partitions": 9} for i, node_id in enumerate(ids)}
        grid = InProcessGrid(app, 6, seed=0, nodes=nodes)
        strategy = RobustStrategy(num_byzantine=1, discover_partitions=True, min_available_nodes=6, progress=False)
        with _server_identity(grid.run.run_id):
            result = strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=2)
        assert strategy.partitions == {node_id: i + 3 for i, node_id in enumerate(ids)}
        return b"".join(a.numpy().tobytes() for a in result.arrays.values())

    assert final_bytes(1) == final_bytes(2)


def test_checkpoints_that_cannot_be_written_cost_the_checkpoints_not_the_trained_model(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """From round 2 on the checkpoint directory is gone (a file stands in its place, as a disk that fails):
    every later write fails and is logged, the run trains to the end and start() returns its model."""
    import logging
    import time

    from experiments.inprocess import InProcessGrid, _server_identity

    ckpt = tmp_path / "ckpt"

    def failing_disk(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        if server_round == 2:
            deadline = time.monotonic() + 30
            while not (ckpt / "round-000001" / "manifest.json").exists() and time.monotonic() < deadline:
                time.sleep(0.01)  # round 1's checkpoint is written in the background
            ckpt.rename(tmp_path / "ckpt-before")
            ckpt.write_text("not a directory")
        return evaluate_fn(server_round, arrays)

    honest = ClientApp()
    honest.train()(train)
    grid = InProcessGrid(honest, 4, seed=0, nodes={10 + i: {"partition-id": i + 3, "num-partitions": NUM_NODES}
                                                  for i in range(4)})
    strategy = RobustStrategy(aggregator="median", num_byzantine=1, checkpoint_dir=ckpt, progress=False)
    with _server_identity(grid.run.run_id), caplog.at_level(logging.ERROR):
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=4,
                                evaluate_fn=failing_disk)
    assert sorted(result.evaluate_metrics_serverapp) == [0, 1, 2, 3, 4]
    assert result.evaluate_metrics_serverapp[4]["accuracy"] > 0.8
    said = [m for m in caplog.messages if m.startswith("background write of the checkpoint of round ")]
    assert said and said[0].startswith("background write of the checkpoint of round 2 failed: "), caplog.messages
    assert any(m.startswith("the last checkpoint could not be written") for m in caplog.messages), caplog.messages
    assert [p.name for p in (tmp_path / "ckpt-before").iterdir() if p.name.startswith("round-")] == ["round-000001"]


def test_a_run_on_a_directory_another_run_holds_stops_before_training(tmp_path: Path) -> None:
    """Two runs on one checkpoint directory would overwrite each other's checkpoints: the second stops at
    once, naming the first; once that one is gone (killed: no stale lock), the same strategy runs."""
    import os
    import signal
    import time

    from fedrobust.dir_lock import DirectoryInUseError
    from tests.unit.test_dir_lock import holding_process

    holder = holding_process(tmp_path / "ckpt")
    try:
        strategy = RobustStrategy(aggregator="median", num_byzantine=1, checkpoint_dir=tmp_path / "ckpt",
                                  progress=False)
        started = time.monotonic()
        with pytest.raises(DirectoryInUseError, match=f"pid {holder.pid}"):
            _start_on_honest_nodes(strategy, 4)
        assert time.monotonic() - started < 10
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    assert not list((tmp_path / "ckpt").glob("round-*"))  # nothing was trained or written
    result = _start_on_honest_nodes(strategy, 4)  # the same strategy object, once the other run is gone
    assert result.train_metrics_clientapp[1]["accepted"] == 4
    assert [p.name for p in (tmp_path / "ckpt").glob("round-*")] == ["round-000001"]


def test_a_model_that_keeps_diverging_names_the_cause() -> None:
    """A NaN loss is no matter of divergence_factor: the error says what the guard saw."""
    strategy = RobustStrategy(aggregator="median", num_byzantine=1, max_round_retries=1, progress=False)
    with pytest.raises(QuorumError, match=r"^round 1: the model diverged 2 times \(evaluation loss nan\); each retry "
                                          r"lowered the server lr \(by lr_decay\), to 0.25: if the replies"):
        _start_on_honest_nodes(strategy, 4, evaluate=lambda server_round, arrays: MetricRecord({"loss": float("nan")}))


def test_the_initial_model_is_the_divergence_guards_first_best(caplog: pytest.LogCaptureFixture) -> None:
    """A round 1 whose loss is 50 times the initial model's is rolled back, as a later round would be, instead
    of becoming the best that the next rounds are judged by."""
    strategy = RobustStrategy(aggregator="median", num_byzantine=1, max_round_retries=1, progress=False)
    with caplog.at_level(logging.INFO, logger="fedrobust"), pytest.raises(
        QuorumError, match=r"^round 1: the model diverged 2 times \(loss above divergence_factor=10 x the best"
    ):
        _start_on_honest_nodes(strategy, 4, evaluate=lambda server_round, arrays: MetricRecord(
            {"loss": 1.0 if server_round == 0 else 50.0}))
    rollbacks = [r.getMessage() for r in caplog.records if "diverged (" in r.getMessage()]
    assert rollbacks and rollbacks[0].startswith("round 1 diverged (loss 50, best 1)"), rollbacks


# The end of the scripts below, which stop a run in a process of their own: `strategy` on `grid`, with
# `evaluate`, until the stop; says whether a checkpoint was written.
_STARTS_UNTIL_STOPPED = """
try:
    with _server_identity(grid.run.run_id):
        strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds={rounds},
                       evaluate_fn=evaluate)
except Preempted as stopped:
    print("checkpointed:", stopped.checkpointed)
"""

def refuse_writes_once_round_1_is_on_disk(ckpt: Path) -> None:
    """In a test's subprocess: wait for round 1's checkpoint, then make the disk refuse writes of more than
    4 KiB (RLIMIT_FSIZE: EFBIG, as a full disk's ENOSPC; SIGXFSZ ignored so that the write fails instead)."""
    import resource
    import signal
    import time

    while not (ckpt / "round-000001" / "manifest.json").exists():
        time.sleep(0.01)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def test_a_stop_whose_checkpoint_the_disk_refuses_says_where_a_resume_starts(tmp_path: Path) -> None:
    """Round 1's checkpoint is written; then the disk refuses writes (RLIMIT_FSIZE: EFBIG, as a full disk's
    ENOSPC) and a stop comes in round 2. The stop's own checkpoint fails: the run says so, and that a resume
    starts after round 1 (it does not claim that no round had completed)."""
    import subprocess
    import sys

    code = f"""
import logging, resource, signal, sys, time
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from flwr.app import ArrayRecord, MetricRecord
from flwr.clientapp import ClientApp
from experiments.inprocess import InProcessGrid, _server_identity
from fedrobust import Preempted, RobustStrategy
from tests.integration.test_library import make_net, refuse_writes_once_round_1_is_on_disk, train

logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
ckpt = Path({str(tmp_path / "ckpt")!r})
strategy = RobustStrategy(aggregator="median", num_byzantine=1, checkpoint_dir=ckpt, progress=True)

def evaluate(server_round, arrays):
    if server_round == 2:
        refuse_writes_once_round_1_is_on_disk(ckpt)
        strategy.request_stop()
    return MetricRecord({{"loss": 1.0, "accuracy": 0.5}})

app = ClientApp()
app.train()(train)
grid = InProcessGrid(app, 4, seed=0, nodes={{10 + i: {{"partition-id": i + 3, "num-partitions": 8}} for i in range(4)}})
""" + _STARTS_UNTIL_STOPPED.format(rounds=4)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stopping: the checkpoint of round 2 could not be written; a resume starts after round 1" in done.stdout, (
        done.stdout + done.stderr
    )
    assert "checkpointed: True" in done.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("round-*")) == ["round-000001"]


def test_a_run_whose_checkpoints_fail_finishes_and_its_summary_says_so(tmp_path: Path) -> None:
    """Round 1's checkpoint is written, then the disk refuses writes (RLIMIT_FSIZE). The run goes on (a
    disk that fills must not cost the rounds in memory) and finishes; its summary says which round the
    newest checkpoint on disk is of, next to the write errors logged as they came."""
    import subprocess
    import sys

    code = f"""
import logging, resource, signal, sys, time
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from flwr.app import ArrayRecord, MetricRecord
from experiments.inprocess import InProcessGrid, _server_identity
from fedrobust import RobustStrategy
from tests.integration.test_library import _echo_app, make_net, refuse_writes_once_round_1_is_on_disk

logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
ckpt = Path({str(tmp_path / "ckpt")!r})
strategy = RobustStrategy(aggregator="median", checkpoint_dir=ckpt, progress=True)

def evaluate(server_round, arrays):
    if server_round == 2:
        refuse_writes_once_round_1_is_on_disk(ckpt)
    return MetricRecord({{"loss": 1.0, "accuracy": 0.5}})

grid = InProcessGrid(_echo_app(lambda _: {{"num-examples": 10}}), 3, seed=0)
with _server_identity(grid.run.run_id):
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=3,
                            evaluate_fn=evaluate)
print("rounds in the result:", sorted(result.train_metrics_clientapp))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rounds in the result: [1, 2, 3]" in done.stdout, done.stdout + done.stderr
    assert ("CHECKPOINTS FAILED: the newest checkpoint on disk is of round 1, the run ended after round 3"
            in done.stdout), done.stdout + done.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("round-*")) == ["round-000001"]


def test_flowers_exit_path_stops_a_users_run_after_checkpointing_it(tmp_path: Path) -> None:
    """In a user's own ServerApp, under ``flwr run`` (a thread of flwr-simulation) or on a deployment, a
    signal or ``flwr stop`` ends the process through Flower's exit handlers. ``start()`` registers one for
    its run: it asks the round loop to stop and returns only once the stop's checkpoint is on disk. With
    ``checkpoint_every=0`` only a stop writes one before the last round. A run that ended leaves none."""
    import threading
    import time

    from flwr.supercore.exit import exit_handler

    from experiments.inprocess import InProcessGrid, _server_identity
    from fedrobust import Preempted

    before = list(exit_handler.registered_exit_handlers)
    ckpt = tmp_path / "ckpt"
    strategy = RobustStrategy(aggregator="median", num_byzantine=1, checkpoint_dir=ckpt, checkpoint_every=0,
                              progress=False)
    checkpointed_on_return: list[bool] = []

    def flower_exits() -> None:  # what flwr_exit does in flwr-simulation's main thread, before its force-exit timer
        exit_handler.trigger_exit_handlers(run_before_force_exit=True)
        checkpointed_on_return.append((ckpt / "round-000002" / "manifest.json").exists())

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        if server_round == 2:
            threading.Thread(target=flower_exits).start()
            deadline = time.monotonic() + 10
            while not strategy.stop_requested and time.monotonic() < deadline:
                time.sleep(0.01)
        return MetricRecord({"loss": 1.0})

    grid = InProcessGrid(_echo_app(lambda _: {"num-examples": 10}), 4, seed=0)
    with _server_identity(grid.run.run_id), pytest.raises(Preempted) as stopped:
        strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=5,
                       evaluate_fn=evaluate)
    assert stopped.value.checkpointed
    assert sorted(p.name for p in ckpt.glob("round-*")) == ["round-000002"]
    assert stopped.value.result is not None and sorted(stopped.value.result.train_metrics_clientapp) == [1, 2]
    deadline = time.monotonic() + 10
    while not checkpointed_on_return and time.monotonic() < deadline:
        time.sleep(0.01)
    assert checkpointed_on_return == [True]  # Flower's exit waited for the stop's checkpoint
    assert exit_handler.registered_exit_handlers == before  # the run took its registration back

    finished = RobustStrategy(aggregator="median", num_byzantine=1, progress=False)
    _start_on_honest_nodes(finished, 4)
    assert exit_handler.registered_exit_handlers == before


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGQUIT"])
def test_a_users_app_in_the_main_thread_with_flowers_signal_handlers_stops_with_its_checkpoint(
    tmp_path: Path, signame: str
) -> None:
    """flwr-serverapp (a deployment) runs the ServerApp in its main thread, under Flower's signal handlers,
    whose exit path would run in the round loop's own thread and could not wait for it. During start()
    a signal Flower handles asks the loop to stop instead: the checkpoint of round 2 is written, Preempted
    is raised, and Flower's handler is back afterwards."""
    import subprocess

    code = f"""
import os, signal, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from flwr.app import ArrayRecord, MetricRecord
from flwr.supercore.exit import register_signal_handlers
from flwr.supercore.telemetry import EventType
from experiments.inprocess import InProcessGrid, _server_identity
from fedrobust import Preempted, RobustStrategy
from tests.integration.test_library import _echo_app, make_net

register_signal_handlers(event_type=EventType.FLWR_SERVERAPP_RUN_LEAVE, exit_message="Task stopped by user.")
flowers = signal.getsignal(signal.{signame})
strategy = RobustStrategy(aggregator="median", num_byzantine=1, checkpoint_dir={str(tmp_path / "ckpt")!r},
                          checkpoint_every=0, progress=False)

def evaluate(server_round, arrays):
    if server_round == 2:
        os.kill(os.getpid(), signal.{signame})
    return MetricRecord({{"loss": 1.0}})

grid = InProcessGrid(_echo_app(lambda _: {{"num-examples": 10}}), 4, seed=0)
""" + _STARTS_UNTIL_STOPPED.format(rounds=5) + f"""
print("flower's handler back:", signal.getsignal(signal.{signame}) is flowers)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "checkpointed: True" in done.stdout and "flower's handler back: True" in done.stdout, done.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("round-*")) == ["round-000002"]


def test_fedrobusts_own_app_in_the_deployment_shape_stops_gracefully_in_one_line(tmp_path: Path) -> None:
    """fedrobust's ServerApp as flwr-serverapp runs it: main thread, Flower's signal handlers, the run config
    from Flower. SIGTERM in round 2 checkpoints round 2 and ends main with Preempted, which Flower's
    ServerApp runner treats as a graceful exit (an AppExitException with a code of 0-99: the process exits
    0, not 1 with "Exit Code: 201") and logs without a traceback; Flower's handler is back afterwards
    (the app used to keep handlers of its own for good)."""
    import subprocess

    code = f"""
import io, logging, os, signal, sys, threading, time
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from flwr.app import Context, RecordDict
from flwr.app.exception import AppExitException
from flwr.common.logger import log as flower_log
from flwr.supercore.exit import register_signal_handlers
from flwr.supercore.telemetry import EventType
from experiments.inprocess import InProcessGrid, _server_identity
from fedrobust import Preempted
from fedrobust.clients.client_app import app as client_app
from fedrobust.strategies.server_app import make_server_app

register_signal_handlers(event_type=EventType.FLWR_SERVERAPP_RUN_LEAVE, exit_message="Task stopped by user.")
flowers = signal.getsignal(signal.SIGTERM)
ckpt = Path({str(tmp_path / "ckpt")!r})
run_config = {{"num_rounds": 6, "num_clients": 3, "clients_per_round": 3, "num_byzantine": 0,
              "checkpoint.dir": str(ckpt), "output_dir": {str(tmp_path / "out")!r}}}

def signal_in_round_2():
    while not (ckpt / "round-000001").is_dir():
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=signal_in_round_2, daemon=True).start()
grid = InProcessGrid(client_app, 3, seed=0, run_config=run_config)
context = Context(run_id=grid.run.run_id, node_id=0, node_config={{}}, state=RecordDict(), run_config=run_config)
seen = io.StringIO()
logging.getLogger("flwr").addHandler(logging.StreamHandler(seen))
try:
    with _server_identity(grid.run.run_id):
        make_server_app()(grid, context)
except Preempted as stopped:
    print("checkpointed:", stopped.checkpointed)
    print("graceful:", isinstance(stopped, AppExitException) and 0 <= stopped.exit_code < 100)
    flower_log(logging.ERROR, "ServerApp raised an exception", exc_info=stopped)  # what flwr-serverapp runs
    print("traceback:", "Traceback" in seen.getvalue())
print("flower's handler back:", signal.getsignal(signal.SIGTERM) is flowers)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    keys = ("checkpointed:", "graceful:", "traceback:", "flower's handler back:")
    lines = [line for line in done.stdout.splitlines() if line.startswith(keys)]
    assert lines == ["checkpointed: True", "graceful: True", "traceback: False", "flower's handler back: True"], (
        done.stdout + done.stderr)
    rounds = sorted(p.name for p in (tmp_path / "ckpt").glob("round-*"))
    assert rounds[-1] in ("round-000001", "round-000002") and "round-000006" not in rounds, rounds


def test_a_resumed_result_has_the_initial_evaluation_of_the_first_start(tmp_path: Path) -> None:
    """Flower's Result holds the initial model's central evaluation as round 0. A resume does not evaluate
    the initial arrays again (they may be a fresh random init): round 0 comes from the checkpoint."""
    from experiments.inprocess import InProcessGrid, _server_identity

    def first_weight(arrays: ArrayRecord) -> float:
        return float(arrays["0.weight"].numpy().flat[0])

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        return MetricRecord({"first_weight": first_weight(arrays), "loss": 1.0 / (server_round + 1)})

    def initial(shift: float) -> ArrayRecord:
        return ArrayRecord({k: v + shift for k, v in make_net().state_dict().items()})

    def start(num_rounds: int, shift: float) -> Result:
        grid = InProcessGrid(_echo_app(lambda _: {"num-examples": 10}), 3, seed=0)
        strategy = RobustStrategy(aggregator="median", checkpoint_dir=tmp_path / "ckpt", progress=False)
        with _server_identity(grid.run.run_id):
            return strategy.start(grid=grid, initial_arrays=initial(shift), num_rounds=num_rounds,
                                  evaluate_fn=evaluate)

    first = start(2, shift=0.0)
    second = start(3, shift=1.0)  # another initial model: the resume takes round 2's from the checkpoint
    assert sorted(second.evaluate_metrics_serverapp) == [0, 1, 2, 3]
    assert second.evaluate_metrics_serverapp[0] == first.evaluate_metrics_serverapp[0]
    assert first_weight(initial(1.0)) != first.evaluate_metrics_serverapp[0]["first_weight"]


def test_check_resume_says_where_start_would_resume_and_refuses_as_it_would_without_changing_anything(
    tmp_path: Path,
) -> None:
    """check_resume(): the round start() would resume after, or start()'s own refusal (other settings, no
    checkpoint that verifies), before any node is up; nothing moved aside, the global RNG untouched."""
    from experiments.inprocess import InProcessGrid, _server_identity
    from fedrobust import NoValidCheckpointError

    ckpt = tmp_path / "ckpt"
    arrays = ArrayRecord(make_net().state_dict())

    def strategy(**options: Any) -> RobustStrategy:
        return RobustStrategy(aggregator="median", checkpoint_dir=ckpt, progress=False, **options)

    assert strategy().check_resume(arrays, num_rounds=2) is None  # nothing there yet: round 1
    grid = InProcessGrid(_echo_app(lambda _: {"num-examples": 10}), 3, seed=0)
    with _server_identity(grid.run.run_id):
        strategy().start(grid=grid, initial_arrays=arrays, num_rounds=2)
    on_disk = sorted(p.name for p in ckpt.iterdir())
    wider = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
    rng = torch.get_rng_state()
    assert strategy().check_resume(arrays, num_rounds=3) == 2
    with pytest.raises(CheckpointMismatchError, match=r"round-000002 \(round 2\) was saved with other settings: "
                                                      r"aggregator: 'median' -> 'mean'"):
        RobustStrategy(aggregator="mean", checkpoint_dir=ckpt, progress=False).check_resume(arrays, num_rounds=3)
    with pytest.raises(CheckpointMismatchError, match=r"holds another model than the run's initial arrays"):
        strategy().check_resume(ArrayRecord(wider.state_dict()), num_rounds=3)
    # The newest checkpoint corrupted: the one before it is where start() would resume; it stays in place.
    newest = ckpt / "round-000002"
    target = next(p for p in newest.iterdir() if p.suffix == ".safetensors")
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: its sha256 no longer matches the manifest's
    target.write_bytes(bytes(data))
    assert strategy().check_resume(arrays, num_rounds=3) == 1
    (ckpt / "round-000001" / target.name).write_bytes(b"not a checkpoint")
    with pytest.raises(NoValidCheckpointError, match=r"no checkpoint in .* verifies"):
        strategy().check_resume(arrays, num_rounds=3)
    assert sorted(p.name for p in ckpt.iterdir()) == on_disk  # nothing moved aside, as start() would
    assert torch.equal(torch.get_rng_state(), rng)
    assert strategy(resume="never").check_resume(arrays) is None
    assert RobustStrategy(aggregator="median", progress=False).check_resume(arrays) is None  # no checkpoint_dir

def test_a_run_whose_server_lr_follows_a_schedule_is_not_extended_on_resume(tmp_path: Path) -> None:
    """A cosine lr spans num_rounds: rounds 1-2 of a 2-round run had other lrs than in a 4-round run, so a
    resume with num_rounds=4 would not give a 4-round run's model. It is refused, naming num_rounds (a
    constant lr may be extended); force_resume continues anyway."""
    from experiments.inprocess import InProcessGrid, _server_identity

    def start(num_rounds: int, directory: str = "ckpt", **options: Any) -> Result:
        grid = InProcessGrid(_echo_app(lambda _: {"num-examples": 10}), 3, seed=0)
        strategy = RobustStrategy(aggregator="median", checkpoint_dir=tmp_path / directory, progress=False,
                                  **{"server_lr_schedule": "cosine", **options})
        with _server_identity(grid.run.run_id):
            return strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()),
                                  num_rounds=num_rounds)

    start(2)
    with pytest.raises(CheckpointMismatchError, match=r"saved with other settings: num_rounds: 2 -> 4"):
        start(4)
    assert sorted(start(4, force_resume=True).train_metrics_clientapp) == [1, 2, 3, 4]
    # A constant lr may be extended; a resume that switches the schedule on is refused, naming it.
    start(2, "constant", server_lr_schedule="constant")
    assert sorted(start(3, "constant", server_lr_schedule="constant").train_metrics_clientapp) == [1, 2, 3]
    with pytest.raises(CheckpointMismatchError, match=r"server_lr_schedule: 'constant' -> 'cosine'"):
        start(4, "constant")


def _warmup(server_round: int, num_rounds: int, rounds: int = 1) -> float:
    return min(1.0, server_round / rounds)


def test_a_partial_lr_schedule_is_recorded_by_its_function_and_bound_values() -> None:
    """Every functools.partial is the same class: a checkpoint must tell warm-up over 5 rounds from 50."""
    import functools

    def recorded(schedule: Any) -> Any:
        return RobustStrategy(server_lr_schedule=schedule, progress=False).settings["server_lr_schedule"]

    five, fifty = functools.partial(_warmup, rounds=5), functools.partial(_warmup, rounds=50)
    assert recorded(five) != recorded(fifty)
    assert recorded(five) == recorded(functools.partial(_warmup, rounds=5))  # the same in every process
    # An object bound in is recorded by its type: its repr holds an address, other in every process.
    assert recorded(functools.partial(_warmup, rounds=object()))["keywords"] == {"rounds": "object"}


def test_a_float64_model_is_said_to_be_stepped_in_float32(caplog: pytest.LogCaptureFixture) -> None:
    """The server's update matrix and step are float32: a float64 model keeps its dtype but not its
    precision, which the run says at its start rather than leaving a user to find out from the bytes."""
    from experiments.inprocess import InProcessGrid, _server_identity

    app = _echo_app(lambda _: {"num-examples": 10})
    grid = InProcessGrid(app, 3, seed=0)
    model = make_net().double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-12)  # values float32 cannot hold
    assert not all(torch.equal(t, t.float().double()) for t in model.state_dict().values())
    strategy = RobustStrategy(aggregator="mean", progress=False)
    with _server_identity(grid.run.run_id):
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=1)
    said = [r.getMessage() for r in caplog.records if "float64 arrays" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith("their float64 precision is not kept")
    final = result.arrays.to_torch_state_dict()
    assert all(t.dtype == torch.float64 and torch.equal(t, t.float().double()) for t in final.values())


@pytest.mark.parametrize(
    ("kwargs", "error", "says"),
    [
        ({"initial_arrays": "state_dict"}, TypeError,
         "initial_arrays must be a flwr.app.ArrayRecord, e.g. ArrayRecord(model.state_dict()), got OrderedDict"),
        ({"initial_arrays": ArrayRecord()}, ValueError, "initial_arrays has no floating-point array to train (it is"),
        ({"initial_arrays": ArrayRecord({"steps": torch.arange(3)})}, ValueError,
         "initial_arrays has no floating-point array to train (its arrays: steps)"),
        ({"initial_arrays": "nan"}, ValueError, "initial_arrays holds NaN or infinite values in 1 array(s) (0.weight)"),
        ({"timeout": -1}, ValueError, "timeout must be a number of seconds > 0, got -1 (int)"),
        ({"timeout": "10"}, ValueError, "timeout must be a number of seconds > 0, got '10' (str)"),
        ({"timeout": math.nan}, ValueError, "timeout must be a number of seconds > 0, got nan (float)"),
        ({"evaluate_fn": "accuracy"}, ValueError, "evaluate_fn must be a function (server_round, arrays) ->"),
    ],
)
def test_start_refuses_what_it_cannot_run_from_before_any_node_trains(
    kwargs: dict[str, Any], error: type[Exception], says: str
) -> None:
    """A state_dict passed as it is, an empty or integer-only record, a NaN weight, a timeout that is no number
    of seconds, an evaluate_fn that is no function: named at once, not as an AttributeError, a failed round or
    the whole federation quarantined for non-finite replies."""
    from experiments.inprocess import InProcessGrid, _server_identity

    state = make_net().state_dict()
    if kwargs.get("initial_arrays") == "state_dict":
        kwargs["initial_arrays"] = state
    elif kwargs.get("initial_arrays") == "nan":
        state["0.weight"][0, 0] = float("nan")
        kwargs["initial_arrays"] = ArrayRecord(state)
    trained: list[int] = []
    grid = InProcessGrid(_echo_app(lambda p: trained.append(p) or {"num-examples": 10}), 3, seed=0)
    strategy = RobustStrategy(aggregator="median", progress=False)
    with _server_identity(grid.run.run_id), pytest.raises(error) as refused:
        strategy.start(grid=grid, **{"initial_arrays": ArrayRecord(make_net().state_dict()), "num_rounds": 1, **kwargs})
    assert says in str(refused.value)
    assert trained == []


def test_liveness_settings_out_of_range_are_refused_as_in_the_run_config() -> None:
    with pytest.raises(ValueError, match=re.escape("liveness.quarantine_after=-3: must be >= 0 (0: never quarantine)")):
        RobustStrategy(liveness={"quarantine_after": -3})
    with pytest.raises(ValueError, match=re.escape("liveness.dead_after=0: must be >= liveness.suspect_after (1)")):
        RobustStrategy(liveness=LivenessConfig(dead_after=0))
    with pytest.raises(ValueError, match=re.escape("liveness 'suspect_after' must be an integer, got '2' (str)")):
        RobustStrategy(liveness={"suspect_after": "2"})
    with pytest.raises(ValueError, match=re.escape("liveness 'dead_after' must be an integer, got '3' (str)")):
        RobustStrategy(liveness=LivenessConfig(dead_after="3"))  # type: ignore[arg-type]


def test_an_evaluate_fn_without_a_loss_is_said_to_leave_the_guard_without_its_loss_test(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from experiments.inprocess import InProcessGrid, _server_identity

    grid = InProcessGrid(_echo_app(lambda _: {"num-examples": 10}), 3, seed=0)
    strategy = RobustStrategy(aggregator="median", progress=False)
    with _server_identity(grid.run.run_id), caplog.at_level("WARNING"):
        strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=2,
                       evaluate_fn=lambda _, __: MetricRecord({"acc": 0.5}))
    said = [r.getMessage() for r in caplog.records if "returned no 'loss'" in r.getMessage()]
    assert said == ["evaluate_fn returned no 'loss' (acc): the divergence guard rolls back only a non-finite model; "
                    "return the loss for its loss test (divergence_factor=10)"]  # once a run


def test_a_weighted_by_key_the_clients_do_not_send_is_named_with_the_keys_they_do() -> None:
    """weighted_by_key="num_examples" (Flower's key is "num-examples"): every reply is rejected, and the
    run's error names the setting and the metrics the replies carry, so the typo shows."""
    strategy = RobustStrategy(aggregator="median", num_byzantine=1, weighted_by_key="num_examples",
                              max_round_retries=0, progress=False)
    with pytest.raises(QuorumError, match=re.escape(
            "5x malformed_reply ('num_examples' (weighted_by_key) missing or not a number; its metrics: "
            "'num-examples')")):
        from experiments.inprocess import InProcessGrid, _server_identity

        grid = InProcessGrid(_echo_app(lambda _: {"num-examples": 10}), 5, seed=0)
        with _server_identity(grid.run.run_id):
            strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=1)


def test_signing_mod_refuses_a_key_it_cannot_use_when_the_app_is_built(tmp_path: Path) -> None:
    from fedrobust import signing_mod

    with pytest.raises(TypeError, match=r"^signing_mod takes the node's Ed25519 private key as a PEM file path, .* "
                                        r"got int$"):
        signing_mod(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^signing_mod: the private key '.*missing.pem' cannot be read: No such file"):
        signing_mod(tmp_path / "missing.pem")
    with pytest.raises(ValueError, match=r"cannot be read: Is a directory$"):
        signing_mod(str(tmp_path))


def test_strategy_from_config_names_what_it_takes() -> None:
    from fedrobust.strategies.from_config import strategy_from_config

    with pytest.raises(TypeError, match=r"^strategy_from_config takes a fedrobust.config.RunConfig, .* got dict$"):
        strategy_from_config({"num_rounds": 3})  # type: ignore[arg-type]


def test_too_few_advice_for_a_users_rule_with_required_parameters_names_num_byzantine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The advice compares with the rule's defaults only for built-in rules: a user's rule by dotted path may
    have no defaults, and building it without its parameters must not turn the advice into an error."""
    (tmp_path / "fr_required_rule.py").write_text(
        "import torch\n\n"
        "class Rule:\n"
        "    def __init__(self, *, f: int, k: int) -> None:\n"
        "        self.f, self.k = f, k\n\n"
        "    def min_n(self) -> int:\n"
        "        return 2 * self.f + self.k\n\n"
        "    def __call__(self, updates: torch.Tensor) -> torch.Tensor:\n"
        "        return updates.median(dim=0).values\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    strategy = RobustStrategy(aggregator="fr_required_rule.Rule", aggregator_params={"k": 2}, num_byzantine=1,
                              progress=False)
    assert strategy.too_few_advice(3, 1).startswith("lower num_byzantine")


def test_start_takes_an_unbounded_timeout_and_none_beside_a_round_deadline() -> None:
    from experiments.inprocess import InProcessGrid, _server_identity

    for strategy, timeout in ((RobustStrategy(aggregator="median", progress=False), math.inf),
                              (RobustStrategy(aggregator="median", round_deadline=30.0, progress=False), None)):
        grid = InProcessGrid(_echo_app(lambda _: {"num-examples": 10}), 3, seed=0)
        with _server_identity(grid.run.run_id):
            result = strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=1,
                                    timeout=timeout)  # type: ignore[arg-type]
        assert sorted(result.train_metrics_clientapp) == [1]
