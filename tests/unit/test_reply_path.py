"""The strategy's reply path (views -> UpdateMatrix -> rule -> flat step) against the plain one it replaced.

The reference is what ``RobustStrategy.aggregate_round`` used to do: every reply loaded as torch
tensors, its update ``local - global`` as a dict, ``fedrobust.tensors.flatten`` into a fresh [n, d]
matrix, the rule, then ``ServerOptimizer.step`` on per-key dicts. The fast path must agree with it
up to float32 rounding, reuse its matrix across rounds, reject malformed replies with a reason and
release each reply's arrays once read.
"""

from __future__ import annotations

import inspect
import logging
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedrobust import aggregators, signing
from fedrobust.server_optim import NAMES, ServerOptimizer
from fedrobust.strategies.replies import MALFORMED_REPLY
from fedrobust.strategies.robust_strategy import RobustStrategy, RoundUpdates
from fedrobust.tensors import flatten, float_keys, unflatten

N = 9
F = 2


class _Grid:
    """What ``configure_train`` asks of a Grid: the run and the nodes."""

    def __init__(self, node_ids: list[int]) -> None:
        self.run = SimpleNamespace(run_id=7)
        self._node_ids = node_ids

    def get_nodes(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(node_id=n, status="online") for n in self._node_ids]

    def get_node_ids(self) -> list[int]:
        return list(self._node_ids)


def _global(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "conv.weight": torch.randn(6, 3, 3, 3, generator=g),
        "bn.weight": torch.rand(6, generator=g) + 0.5,
        "bn.num_batches_tracked": torch.tensor(12, dtype=torch.int64),
        "fc.weight": torch.randn(4, 54, generator=g) * 0.1,
        "fc.bias": torch.zeros(4),
    }


def _instructions(strategy: RobustStrategy, state: dict[str, torch.Tensor], n: int, server_round: int) -> list[Message]:
    from flwr.supercore.task_identity import TaskIdentity

    # Messages are stamped with the running task's identity; a ServerApp process has one.
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 7, 1
    grid = _Grid([100 + i for i in range(n)])
    out = list(strategy.configure_train(server_round, ArrayRecord(state), ConfigRecord({}), grid))
    for i, message in enumerate(out):
        if not message.metadata.message_id:  # a Grid assigns message ids on push
            message.metadata.__dict__["_message_id"] = f"train-{server_round}-{i}"
    return out


def _reply(instruction: Message, arrays: ArrayRecord, num_examples: float) -> Message:
    metrics = MetricRecord({"num-examples": num_examples, "train_loss": 1.0})
    return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=instruction)


def _locals(state: dict[str, torch.Tensor], n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            k: v + 0.01 * (i + 1) * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
            for k, v in state.items()
        }
        for i in range(n)
    ]


@pytest.mark.parametrize("rule", ["mean", "trimmed_mean", "median", "krum", "centered_clipping"])
@pytest.mark.parametrize("server_optimizer", NAMES)
def test_aggregate_train_equals_the_plain_path_over_rounds(rule: str, server_optimizer: str) -> None:
    strategy = RobustStrategy(
        aggregator=rule, num_byzantine=F, min_train_nodes=N, progress=False,
        server_optimizer=server_optimizer, server_lr=0.5,
    )
    reference_opt = ServerOptimizer(server_optimizer, lr=0.5)
    reference_rule_state: dict[str, torch.Tensor] = {}
    state = _global()
    matrices = []
    for server_round in (1, 2, 3):
        instructions = _instructions(strategy, state, N, server_round)
        local = _locals(state, N, seed=server_round)
        replies = [_reply(m, ArrayRecord(s), 50 + i) for i, (m, s) in enumerate(zip(instructions, local, strict=True))]
        arrays, metrics = strategy.aggregate_train(server_round, reversed(replies))  # order must not matter
        assert arrays is not None and metrics["accepted"] == N
        matrices.append(strategy._matrix)
        # The reference carries the stateful rule's state the same way.
        ref_rule = aggregators.build(rule, f=F)
        ref_rule.load_state_dict(reference_rule_state)
        keys = float_keys(state)
        rows = flatten([{k: s[k] - state[k] for k in keys} for s in local], keys)
        aggregate = ref_rule(rows)
        reference_rule_state = ref_rule.state_dict()
        expected = {**state, **reference_opt.step({k: state[k] for k in keys}, unflatten(aggregate, state, keys))}
        got = arrays.to_torch_state_dict()
        assert list(got) == list(expected)
        for key, value in expected.items():
            assert got[key].dtype == value.dtype and got[key].shape == value.shape
            torch.testing.assert_close(got[key], value, rtol=2e-6, atol=2e-7)
        if server_optimizer == "fedavg" and rule in ("mean", "median", "krum"):
            assert all(torch.equal(got[k], expected[k]) for k in expected)  # same rounding, same bits
        state = {k: v.clone() for k, v in got.items()}
        # Every reply's arrays were read once and released.
        assert all(len(r.content["arrays"]) == 0 for r in replies)
    assert matrices[0] is matrices[1] is matrices[2]  # one matrix for all rounds
    tensors, meta = strategy.optimizer.state_dict()
    ref_tensors, ref_meta = reference_opt.state_dict()
    assert meta == ref_meta and sorted(tensors) == sorted(ref_tensors)
    for key in tensors:
        torch.testing.assert_close(tensors[key], ref_tensors[key], rtol=2e-6, atol=2e-7)


def test_weighted_mean_and_malformed_replies_are_judged_one_by_one() -> None:
    strategy = RobustStrategy(
        aggregator="mean", num_byzantine=F, min_train_nodes=N, progress=False,
        weight_by_num_examples=True, max_update_norm=5.0,
    )
    state = _global()
    instructions = _instructions(strategy, state, N, 1)
    local = _locals(state, N, seed=3)
    records = [ArrayRecord(s) for s in local]
    counts: list[int | float] = [10 * (i + 1) for i in range(N)]
    # Reply 0: truncated .npy bytes; 1: a NaN; 2: a wrong shape; 3: num-examples 0; 4: norm too large.
    bad = records[0]["fc.bias"]
    records[0]["fc.bias"] = Array(dtype=bad.dtype, shape=bad.shape, stype=bad.stype, data=bad.data[:-4])
    nan = local[1]["fc.weight"].clone()
    nan[0, 0] = float("nan")
    records[1]["fc.weight"] = Array(nan.numpy())
    records[2]["fc.bias"] = Array(np.zeros(5, dtype=np.float32))
    counts[3] = 0
    records[4]["conv.weight"] = Array((local[4]["conv.weight"] + 10.0).numpy())
    replies = [_reply(m, r, c) for m, r, c in zip(instructions, records, counts, strict=True)]
    outcome = strategy.aggregate_round(1, replies)
    reasons = {e["node"]: e["reason"] for e in outcome.rejected_nodes}
    assert reasons == {
        100: MALFORMED_REPLY, 101: "non_finite", 102: "wrong_shape", 103: "bad_num_examples", 104: "norm_too_large",
    }
    assert "truncated" in outcome.rejected_nodes[0]["detail"]
    assert outcome.accepted == [105, 106, 107, 108]
    assert outcome.f_used == 0 and outcome.aggregated  # five proven faulty nodes
    good = local[5:]
    weights = torch.tensor([float(c) for c in counts[5:]])
    keys = float_keys(state)
    rows = flatten([{k: s[k] - state[k] for k in keys} for s in good], keys)
    aggregate = aggregators.build("mean", f=0)(rows, weights)
    expected = {**state, **ServerOptimizer().step({k: state[k] for k in keys}, unflatten(aggregate, state, keys))}
    got = outcome.arrays.to_torch_state_dict()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=2e-6, atol=2e-7)


def test_matrix_grows_with_more_replies_and_follows_a_new_model() -> None:
    strategy = RobustStrategy(aggregator="median", num_byzantine=1, min_train_nodes=3, progress=False)
    state = _global()
    for server_round, n in ((1, 4), (2, 3), (3, 7)):
        instructions = _instructions(strategy, state, n, server_round)
        local = _locals(state, n, server_round)
        replies = [_reply(m, ArrayRecord(s), 10) for m, s in zip(instructions, local, strict=True)]
        arrays, _ = strategy.aggregate_train(server_round, replies)
        assert arrays is not None
        assert strategy._matrix is not None and strategy._matrix.capacity == max(4, n)
    # A model with other shapes: a new matrix, no error.
    other = {"w": torch.zeros(3, 2)}
    instructions = _instructions(strategy, other, 3, 4)
    replies = [_reply(m, ArrayRecord(s), 10) for m, s in zip(instructions, _locals(other, 3, 4), strict=True)]
    arrays, _ = strategy.aggregate_train(4, replies)
    assert arrays is not None and strategy._matrix.dim == 6


def test_configure_train_reserves_the_rows_and_aggregation_writes_into_them() -> None:
    strategy = RobustStrategy(aggregator="median", num_byzantine=1, min_train_nodes=5, progress=False)
    state = _global()
    instructions = _instructions(strategy, state, 5, 1)
    reserved = strategy._matrix  # built (and touched in the background) before any reply
    assert reserved is not None and reserved.capacity == len(instructions) == 5
    replies = [_reply(m, ArrayRecord(s), 10) for m, s in zip(instructions, _locals(state, 5, 1), strict=True)]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None
    assert strategy._matrix is reserved and strategy._touching is None
    assert len(reserved) == 5 and bool(reserved.norms().gt(0).all())


def test_an_aggregation_device_that_is_not_a_device_is_refused_with_the_valid_choices() -> None:
    with pytest.raises(ValueError, match=r"^aggregation_device: invalid device 'gpu'; valid: 'auto', 'cpu', 'cuda'"):
        RobustStrategy(aggregation_device="gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_aggregation_is_refused_where_there_is_no_cuda() -> None:
    with pytest.raises(ValueError, match=r"^aggregation_device: device 'cuda' requested but CUDA is not available"):
        RobustStrategy(aggregation_device="cuda")
    assert RobustStrategy(aggregation_device="auto").aggregation_device == torch.device("cpu")


_DEFAULT_RULE = inspect.signature(RobustStrategy).parameters["aggregator"].default
_PRE_PARAMS = {"clipping": {"threshold": 1.0}}  # pre-aggregators with a required parameter


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_rule_on_a_cuda_device_gives_the_cpu_result_over_rounds() -> None:
    """Rows from page-locked memory, the rule (and its state, for the stateful ones) on the device,
    checkpoint state on the CPU; each round's model as on the CPU, up to float rounding, and the same
    bytes in a second run on the device."""
    rules = [r for r in aggregators.names() if r != "fltrust"] + ["winsorize+nnm+trimmed_mean", "arc+nnm+median"]
    configs: list[dict[str, Any]] = [{"aggregator": rule} for rule in [*rules, _DEFAULT_RULE]]
    configs += [
        {"aggregator": "trimmed_mean", "pre": [{"name": pre, **_PRE_PARAMS.get(pre, {})}]}
        for pre in aggregators.pre_names()
    ]
    for config in configs:
        rule = f"{config}"
        n = max(N, aggregators.build(config["aggregator"], f=F, pre=config.get("pre", ())).min_n())  # Bulyan: 4f + 3
        on = {
            device: RobustStrategy(
                **config, num_byzantine=F, min_train_nodes=n, progress=False, aggregation_device=device
            )
            for device in ("cpu", "cuda", "cuda:0")
        }
        state = _global()
        for server_round in (1, 2, 3):
            got = {}
            for device, strategy in on.items():
                instructions = _instructions(strategy, state, n, server_round)
                local = _locals(state, n, seed=server_round)
                replies = [_reply(m, ArrayRecord(s), 50) for m, s in zip(instructions, local, strict=True)]
                arrays, metrics = strategy.aggregate_train(server_round, replies)
                assert arrays is not None and metrics["accepted"] == n, (rule, device)
                got[device] = arrays.to_torch_state_dict()
            for key, value in got["cpu"].items():
                torch.testing.assert_close(got["cuda"][key], value, rtol=1e-4, atol=1e-6, msg=f"{rule} {key}")
                assert torch.equal(got["cuda"][key], got["cuda:0"][key]), f"{rule} {key}: not deterministic"
            state = got["cpu"]
        assert on["cuda"]._matrix is not None and on["cuda"]._matrix.rows().is_pinned(), rule
        tensors, _ = on["cuda"].state_dict()
        assert all(t.device.type == "cpu" for t in tensors.values()), rule


def test_a_process_ending_right_after_configure_train_exits_cleanly() -> None:
    """The thread that touches a new matrix must not abort an interpreter that exits meanwhile.

    As a daemon thread it did ("terminate called without an active exception") in 9 of 12 runs.
    """
    script = (
        "from types import SimpleNamespace\n"
        "import torch\n"
        "from flwr.app import ArrayRecord, ConfigRecord\n"
        "from flwr.supercore.task_identity import TaskIdentity\n"
        "from fedrobust import RobustStrategy\n"
        "TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 7, 1\n"
        "grid = SimpleNamespace(run=SimpleNamespace(run_id=7), get_node_ids=lambda: [1, 2, 3],\n"
        "                       get_nodes=lambda: [SimpleNamespace(node_id=n, status='online') for n in (1, 2, 3)])\n"
        "for _ in range(2):\n"
        "    strategy = RobustStrategy('median', 0, min_train_nodes=3, progress=False)\n"
        "    strategy.configure_train(1, ArrayRecord({'w': torch.zeros(4)}), ConfigRecord(), grid)\n"
    )
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr[-2000:]


def test_update_hook_rewrites_rows_and_failing_rows_are_dropped() -> None:
    seen = {}

    def hook(updates: RoundUpdates) -> list[int]:
        seen["round"] = updates.round
        seen["byzantine"] = updates.byzantine.tolist()
        seen["clients"] = updates.clients
        seen["server_update"] = updates.server_update  # the mean needs none
        seen["global_model"] = updates.global_model.clone() if updates.global_model is not None else None
        updates.rows[0] = float("nan")  # rejected when rechecked
        updates.rows[1] = 0.0  # accepted: an all-zero update
        return [0, 1]

    strategy = RobustStrategy(aggregator="mean", num_byzantine=0, min_train_nodes=3, progress=False, update_hook=hook)
    state = _global()
    instructions = _instructions(strategy, state, 4, 1)
    local = _locals(state, 4, 1)
    replies = []
    for i, (m, s) in enumerate(zip(instructions, local, strict=True)):
        metrics = MetricRecord({"num-examples": 10, "sim-byzantine": int(i < 2)})
        replies.append(Message(RecordDict({"arrays": ArrayRecord(s), "metrics": metrics}), reply_to=m))
    outcome = strategy.aggregate_round(1, replies)
    assert seen["round"] == 1 and seen["byzantine"] == [True, True, False, False]
    assert seen["server_update"] is None
    assert seen["clients"] == [100, 101, 102, 103]  # no partitions known: the node ids
    assert [(e["node"], e["reason"]) for e in outcome.rejected_nodes] == [(100, "non_finite")]
    assert outcome.accepted == [101, 102, 103]
    keys = float_keys(state)
    # The global model the clients were sent, in the rows' layout: an update plus it is a local model.
    torch.testing.assert_close(seen["global_model"], flatten([state], keys)[0], rtol=0, atol=0)
    rows = flatten([{k: s[k] - state[k] for k in keys} for s in local[2:]], keys)
    mean = torch.cat([torch.zeros(1, rows.shape[1]), rows]).mean(dim=0)
    expected = torch.cat([state[k].reshape(-1) for k in keys]) + mean
    got = outcome.arrays.to_torch_state_dict()
    torch.testing.assert_close(torch.cat([got[k].reshape(-1) for k in keys]), expected, rtol=2e-6, atol=2e-7)


def test_update_hook_sees_the_server_update_the_rule_gets_computed_once() -> None:
    state = _global()
    keys = float_keys(state)
    calls = []

    def server_update_fn(server_round: int, global_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        calls.append(server_round)
        return {k: 0.01 * torch.ones_like(v) * (i + 1) if v.is_floating_point() else v for i, (k, v) in
                enumerate(global_state.items())}

    seen = {}

    def hook(updates: RoundUpdates) -> list[int]:
        assert updates.server_update is not None
        seen["server_update"] = updates.server_update.clone()
        return []

    strategy = RobustStrategy(
        aggregator="fltrust", num_byzantine=1, min_train_nodes=3, progress=False, update_hook=hook,
        server_update_fn=server_update_fn,
    )
    instructions = _instructions(strategy, state, 4, 1)
    local = _locals(state, 4, 1)
    replies = [
        Message(RecordDict({"arrays": ArrayRecord(s), "metrics": MetricRecord({"num-examples": 10})}), reply_to=m)
        for m, s in zip(instructions, local, strict=True)
    ]
    outcome = strategy.aggregate_round(1, replies)
    assert outcome.aggregated and calls == [1]
    expected = flatten([server_update_fn(1, state)], keys)[0]
    torch.testing.assert_close(seen["server_update"], expected, rtol=0, atol=0)
    # The rule got that very vector: its trust scores are those of the rows against it.
    rows = flatten([{k: s[k] - state[k] for k in keys} for s in local], keys).double()
    cos = torch.nn.functional.cosine_similarity(rows, expected.double()[None], dim=1).clamp(min=0)
    torch.testing.assert_close(strategy.aggregator.rule.last_trust, cos, rtol=1e-5, atol=1e-6)


def test_signature_digest_of_numpy_views_equals_that_of_torch_tensors() -> None:
    from fedrobust.strategies.reply_arrays import array_views

    state = _global()
    state["half"] = torch.randn(3, 5).half()
    state["flag"] = torch.tensor([True, False])
    views = array_views(ArrayRecord(state))
    fields = {"run_id": 7, "round": 2, "node_id": 100, "nonce": b"n" * 16, "num_examples": 50}
    assert signing.canonical_digest(arrays=views, **fields) == signing.canonical_digest(arrays=state, **fields)


@pytest.mark.parametrize("name", NAMES)
def test_flat_step_matches_the_dict_step_and_resumes_from_its_state(name: str) -> None:
    state = _global()
    keys = float_keys(state)
    layout = [(k, tuple(state[k].shape)) for k in keys]
    g = torch.Generator().manual_seed(5)
    updates = [{k: torch.randn(state[k].shape, generator=g) for k in keys} for _ in range(4)]
    by_dict, flat = ServerOptimizer(name, lr=0.3), ServerOptimizer(name, lr=0.3)
    p = {k: state[k] for k in keys}
    q = flatten([p], keys)[0]
    for step, update in enumerate(updates):
        if step == 2:  # resume the flat one from its own state_dict: same format as the dict path's
            tensors, meta = flat.state_dict()
            ref_tensors, _ = by_dict.state_dict()
            assert {k: v.shape for k, v in tensors.items()} == {k: v.shape for k, v in ref_tensors.items()}
            flat = ServerOptimizer(name, lr=0.3)
            flat.load_state_dict(tensors, meta)
        p = by_dict.step(p, update)
        q = flat.step_flat(q, flatten([update], keys)[0], layout).clone()
        torch.testing.assert_close(q, flatten([p], keys)[0], rtol=2e-6, atol=2e-7)
        if name == "fedavg":
            assert torch.equal(q, flatten([p], keys)[0])


def test_replies_taken_as_they_arrive_give_the_bytes_of_any_other_arrival_order() -> None:
    """RoundIntake writes each reply into its node's row on arrival; gaps close at the end, in order.

    Node 103's reply is rejected (NaN), node 106 never answers, node 101 answers twice.
    """
    state = _global()
    outcomes = []
    for arrival in ([0, 1, 1, 2, 3, 4, 5, 7, 8], [8, 2, 3, 0, 7, 4, 1, 5, 1], [5, 3, 1, 7, 0, 1, 2, 8, 4]):
        strategy = RobustStrategy(aggregator="mean", num_byzantine=F, min_train_nodes=N, progress=False)
        instructions = _instructions(strategy, state, N, 1)
        records = [ArrayRecord(s) for s in _locals(state, N, seed=4)]
        nan = records[3]["fc.bias"].numpy().copy()
        nan[0] = float("nan")
        records[3]["fc.bias"] = Array(nan)
        replies = [_reply(m, r, 20) for m, r in zip(instructions, records, strict=True)]
        intake = strategy.open_round(1, [m.metadata.dst_node_id for m in instructions])
        intake.expect({m.metadata.message_id: m.metadata.dst_node_id for m in instructions})
        for i in arrival:
            intake.take(replies[i])
            assert len(replies[i].content["arrays"]) == 0  # its bytes are released on arrival
        outcomes.append(intake.close())
    first = outcomes[0]
    assert first.accepted == [100, 101, 102, 104, 105, 107, 108] and first.aggregated
    for outcome in outcomes:
        assert outcome.accepted == first.accepted
        # Reported in the fixed order, not in the order the rejections happened.
        assert [(e["node"], e["reason"]) for e in outcome.rejected_nodes] == [
            (101, "duplicate_reply"), (103, "non_finite")
        ]
        got, want = outcome.arrays.to_torch_state_dict(), first.arrays.to_torch_state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)  # the mean sums the rows in one order: same bits
    # And the same as the round's valid replies handed over at once (Flower's aggregate_train).
    strategy = RobustStrategy(aggregator="mean", num_byzantine=F, min_train_nodes=N, progress=False)
    instructions = _instructions(strategy, state, N, 1)
    records = [ArrayRecord(s) for s in _locals(state, N, seed=4)]
    kept = [i for i in range(N) if i not in (3, 6)]
    arrays, _ = strategy.aggregate_train(1, [_reply(instructions[i], records[i], 20) for i in reversed(kept)])
    got, want = arrays.to_torch_state_dict(), first.arrays.to_torch_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_update_matrix_rows_written_out_of_order_are_kept_in_order() -> None:
    from fedrobust.update_matrix import UpdateMatrix

    state = _global()
    matrix = UpdateMatrix(state, 5)
    local = _locals(state, 5, seed=9)
    for row in (4, 0, 2):
        assert matrix.add(local[row], full_weights=True, row=row) is None
    assert len(matrix) == 0  # nothing is accepted before keep()
    matrix.keep([4, 0, 2])
    keys = float_keys(state)
    expected = flatten([{k: local[i][k] - state[k] for k in keys} for i in (0, 2, 4)], keys)
    assert torch.equal(matrix.rows(), expected)
    torch.testing.assert_close(matrix.norms(), expected.double().norm(dim=1))
    with pytest.raises(ValueError, match="already added in order"):
        matrix.add(local[1], full_weights=True, row=1)
    with pytest.raises(ValueError, match="outside 0..4"):
        UpdateMatrix(state, 5).add(local[1], full_weights=True, row=5)


class _Network:
    """A grid's transport for :func:`push_and_collect`: each reply can be pulled ``at`` seconds after
    the push; a message without a reply here goes to a node that died (it never answers)."""

    def __init__(self, replies: dict[str, tuple[float, Message]]) -> None:
        self._replies = replies
        self._pushed_at = 0.0

    def push_messages(self, messages: list[Message]) -> list[str]:
        self._pushed_at = time.monotonic()
        return [m.metadata.message_id for m in messages]

    def pull_messages(self, message_ids: list[str]) -> list[Message]:
        now = time.monotonic() - self._pushed_at
        due = [mid for mid in message_ids if mid in self._replies and self._replies[mid][0] <= now]
        return [self._replies.pop(mid)[1] for mid in due]


def _round_with_dead_nodes(strategy: RobustStrategy, arrivals: dict[int, float]) -> tuple[list[Message], object]:
    """Round 1 of ``strategy`` to N nodes, node ``i`` answering ``arrivals[i]`` s after the push (node 3 with
    NaN, which validation rejects); the nodes not in ``arrivals`` never answer. The messages and the intake."""
    state = _global()
    instructions = _instructions(strategy, state, N, 1)
    records = [ArrayRecord(s) for s in _locals(state, N, seed=5)]
    nan = records[3]["fc.bias"].numpy().copy()
    nan[0] = float("nan")
    records[3]["fc.bias"] = Array(nan)
    network = _Network({
        instructions[i].metadata.message_id: (at, _reply(instructions[i], records[i], 20)) for i, at in arrivals.items()
    })
    return instructions, network


def test_the_quorum_counts_valid_replies_against_f_lowered_by_the_rejected_ones() -> None:
    # The median with f=2 needs 2f+1 = 5 rows; one proven faulty node lowers f to 1: 3 rows.
    strategy = RobustStrategy(aggregator="median", num_byzantine=F, min_train_nodes=N, progress=False)
    instructions, network = _round_with_dead_nodes(strategy, dict.fromkeys(range(N), 0.0))
    intake = strategy.open_round(1, [m.metadata.dst_node_id for m in instructions])
    intake.expect({m.metadata.message_id: m.metadata.dst_node_id for m in instructions})
    replies = network.pull_messages([m.metadata.message_id for m in instructions])
    quorum = []
    for i in (0, 1, 2, 3, 4):
        intake.take(replies[i])
        quorum.append(intake.can_aggregate())
    assert quorum == [False, False, False, True, True]  # 3 valid and f=1 after node 3's NaN
    outcome = intake.close()
    assert outcome.aggregated and outcome.f_used == 1 and outcome.accepted == [100, 101, 102, 104]


@pytest.mark.parametrize("grace", [0.0, 1.0])
def test_after_the_quorum_missing_replies_get_only_the_grace(grace: float) -> None:
    """Nodes 0-5 answer at once (node 3 rejected: f=1, 3 rows needed, 5 valid), node 6 within the grace,
    node 7 after it, node 8 never (dead). With a grace the round ends a grace after the quorum; without
    one, at the deadline."""
    from fedrobust.strategies.collect import push_and_collect

    deadline = 4.0
    strategy = RobustStrategy(aggregator="median", num_byzantine=F, min_train_nodes=N, progress=False)
    instructions, network = _round_with_dead_nodes(strategy, {**dict.fromkeys(range(6), 0.0), 6: 0.3, 7: 2.5})
    intake = strategy.open_round(1, [m.metadata.dst_node_id for m in instructions])
    started = time.monotonic()
    sent, replies = push_and_collect(
        network,  # type: ignore[arg-type]  # the two calls push_and_collect makes of a Grid
        instructions,
        timeout=deadline,
        on_pushed=intake.expect,
        on_reply=intake.take,
        quorum=intake.can_aggregate if grace > 0 else None,
        grace=grace,
    )
    waited = time.monotonic() - started
    answered = sorted(sent[r.metadata.reply_to_message_id] for r in replies)
    outcome = intake.close()
    if grace:
        assert answered == [100, 101, 102, 103, 104, 105, 106]  # node 106 came within the grace
        assert grace <= waited < 2.5  # ended by the grace, before node 107 answered
    else:
        assert answered == [100, 101, 102, 103, 104, 105, 106, 107]
        assert waited >= deadline  # node 108 was waited for until the deadline
    assert outcome.aggregated and outcome.accepted == [n for n in answered if n != 103]


class _SuperLinkNetwork(_Network):
    """As :class:`_Network`, with Flower's HTTP grid's order of work: a call takes every listed reply off the
    SuperLink, then downloads them one after the other, reply ``m`` for ``download[m]`` seconds (a large
    model on a slow link, or an upload that never completes). Asked again, a reply already taken is
    ``MESSAGE_UNAVAILABLE``."""

    def __init__(
        self, replies: dict[str, tuple[float, Message]], instructions: list[Message], download: dict[str, float]
    ) -> None:
        super().__init__(replies)
        self._instructions = {m.metadata.message_id: m for m in instructions}
        self._download = download
        self._taken: set[str] = set()
        self._lock = threading.Lock()

    def pull_messages(self, message_ids: list[str]) -> list[Message]:
        from flwr.app import Error
        from flwr.common.constant import ErrorCode

        now = time.monotonic() - self._pushed_at
        with self._lock:
            due = [mid for mid in message_ids if mid in self._replies and self._replies[mid][0] <= now]
            taken = [self._replies.pop(mid)[1] for mid in due]
            gone = [mid for mid in message_ids if mid in self._taken]
            self._taken.update(due)
        error = Error(code=ErrorCode.MESSAGE_UNAVAILABLE, reason="not found")
        out = [Message(error, reply_to=self._instructions[mid]) for mid in gone]
        for mid, reply in zip(due, taken, strict=True):
            time.sleep(self._download.get(mid, 0.0))
            out.append(reply)
        return out


def _collect_through_superlink(
    arrivals: dict[int, float], download: dict[int, float], deadline: float
) -> tuple[list[int], list[Message], float]:
    """Round 1 to N nodes through :class:`_SuperLinkNetwork`: node ``i`` answers ``arrivals[i]`` s after the
    push and its reply downloads in ``download[i]`` s. The nodes whose replies came in, the replies, the wait."""
    from fedrobust.strategies import collect

    strategy = RobustStrategy(aggregator="median", num_byzantine=F, min_train_nodes=N, progress=False)
    instructions, _ = _round_with_dead_nodes(strategy, {})
    records = [ArrayRecord(s) for s in _locals(_global(), N, seed=5)]
    replies_at = {m.metadata.message_id: (arrivals[i], _reply(m, records[i], 20))
                  for i, m in enumerate(instructions) if i in arrivals}
    network = _SuperLinkNetwork(
        replies_at, instructions, {instructions[i].metadata.message_id: at for i, at in download.items()}
    )
    started = time.monotonic()
    sent, replies = collect.push_and_collect(network, instructions, timeout=deadline)  # type: ignore[arg-type]
    return sorted(sent[r.metadata.reply_to_message_id] for r in replies), replies, time.monotonic() - started


def test_a_reply_whose_pull_never_finishes_holds_no_round_past_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 6's upload never completes: the call that takes its reply blocks far beyond the deadline. The
    replies before it count, node 7's, which arrives while that call is held, too (the SuperLink's
    MESSAGE_UNAVAILABLE for node 6, asked again, is not taken for its reply), and the round ends at its
    deadline (plus the wait for held calls) instead of after the blocked download."""
    from fedrobust.strategies import collect

    monkeypatch.setattr(collect, "SLOW_PULL_SECONDS", 0.3)
    answered, replies, waited = _collect_through_superlink(
        {**dict.fromkeys(range(6), 0.0), 6: 0.5, 7: 1.0}, {6: 30.0}, deadline=2.5
    )
    assert not any(r.has_error() for r in replies)
    assert answered == [100, 101, 102, 103, 104, 105, 107]
    assert 2.5 <= waited < 2.5 + 0.3 + 1.0  # not the 30 s the blocked download takes


def test_slow_downloads_that_overlap_lose_no_reply(monkeypatch: pytest.MonkeyPatch) -> None:
    """Large replies on a slow link: calls held one after another, each reply downloading for longer than a
    call is waited for. Every reply counts, none is replaced by the SuperLink's MESSAGE_UNAVAILABLE that a
    later call gets for it, and a reply a held call took before the deadline still counts after it."""
    from fedrobust.strategies import collect

    monkeypatch.setattr(collect, "SLOW_PULL_SECONDS", 0.5)
    arrivals = {**dict.fromkeys(range(6), 0.0), 6: 0.25, 7: 0.75}
    answered, replies, _ = _collect_through_superlink(arrivals, {0: 1.3, 6: 0.65, 7: 0.4}, deadline=4.0)
    assert not any(r.has_error() for r in replies) and answered == [100 + i for i in range(8)]
    # Node 0's reply is taken at once and downloads past the 1.1 s deadline: it was off the SuperLink already.
    answered, replies, waited = _collect_through_superlink({0: 0.0, 1: 0.0}, {0: 1.3}, deadline=1.1)
    assert answered == [100, 101] and not any(r.has_error() for r in replies) and waited < 1.1 + 0.5 + 0.5


def test_replies_the_direction_filter_or_the_rule_leaves_out_are_reported_by_node() -> None:
    """The honest replies move the model one way, two reverse their update: the pipeline's direction filter
    leaves those two out, and the round says which nodes they came from (a rule without it, none); so does
    Multi-Krum, which gives them no weight."""
    n = 12
    state = _global()
    g = torch.Generator().manual_seed(4)
    direction = {k: 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items() if v.is_floating_point()}
    local = []
    for i in range(n):
        sign = -1.0 if i in (2, 7) else 1.0
        noise = {k: 0.01 * torch.randn(d.shape, generator=g) for k, d in direction.items()}
        local.append({k: v + sign * (direction[k] + noise[k]) if k in direction else v for k, v in state.items()})
    cases = (
        ("direction+winsorize+nnm+trimmed_mean", 3, [102, 107], []),
        ("winsorize+nnm+trimmed_mean", 3, [], []),
        ("multikrum", 2, [], [102, 107]),  # a rule that selects rows names the ones it gave no weight
    )
    for aggregator, f, filtered, excluded in cases:
        strategy = RobustStrategy(aggregator=aggregator, num_byzantine=f, min_train_nodes=n, progress=False)
        instructions = _instructions(strategy, state, n, 1)
        replies = [_reply(m, ArrayRecord(s), 10) for m, s in zip(instructions, local, strict=True)]
        outcome = strategy.aggregate_round(1, replies)
        assert outcome.aggregated and len(outcome.accepted) == n
        assert (outcome.filtered, outcome.excluded) == (filtered, excluded)
        record = outcome.metric_record()
        assert (record["filtered"], record["excluded"]) == (len(filtered), len(excluded))


def test_the_direction_filter_remembers_replies_by_partition_or_else_by_node() -> None:
    """The strategy names each row's client: its partition when every node's is known (node ids change
    from one simulation run to the next), else its node id; the filter's memory is kept under those."""
    n, state = 8, _global()
    by_partition = {100 + i: n - 1 - i for i in range(n)}
    for partitions, expected in (({}, [100 + i for i in range(n)]), (by_partition, list(range(n)))):
        strategy = RobustStrategy(
            aggregator="direction+winsorize+nnm+trimmed_mean", num_byzantine=F, min_train_nodes=n, progress=False
        )
        strategy.partitions.update(partitions)
        for server_round in (1, 2):
            instructions = _instructions(strategy, state, n, server_round)
            local = _locals(state, n, seed=server_round)
            replies = [_reply(m, ArrayRecord(s), 10) for m, s in zip(instructions, local, strict=True)]
            assert strategy.aggregate_round(server_round, replies).aggregated
        memory = strategy.aggregator.state_dict()
        assert sorted(memory["pre.0.memory.clients"].tolist()) == expected
        assert memory["pre.0.memory.rounds"].tolist() == [2] * n


@pytest.mark.parametrize("lower_f", [False, True])
def test_the_round_reports_the_f_the_rule_ran_with_after_dedup_took_copies_out(lower_f: bool) -> None:
    strategy = RobustStrategy(
        aggregator="trimmed_mean", num_byzantine=F, pre=[{"name": "dedup", "lower_f": lower_f}],
        min_train_nodes=N, progress=False,
    )
    state = _global()
    instructions = _instructions(strategy, state, N, 1)
    local = _locals(state, N, seed=3)
    local[-1] = local[-2]  # two nodes send the same update: dedup keeps one
    replies = [_reply(m, ArrayRecord(s), 50) for m, s in zip(instructions, local, strict=True)]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is not None and metrics["filtered"] == 1
    assert metrics["f-used"] == (F - 1 if lower_f else F)


class _RefusingNetwork(_Network):
    """A grid that refuses the message to node ``refused``: ``omit`` leaves its id out as Flower's
    in-memory grid does, else it keeps an empty id in its place as the HTTP grid does."""

    def __init__(self, replies: dict[str, tuple[float, Message]], refused: int, *, omit: bool) -> None:
        super().__init__(replies)
        self._refused, self._omit = refused, omit

    def push_messages(self, messages: list[Message]) -> list[str | None]:  # type: ignore[override]
        ids = super().push_messages(messages)
        kept = [None if m.metadata.dst_node_id == self._refused else mid for mid, m in zip(ids, messages, strict=True)]
        return [mid for mid in kept if mid is not None] if self._omit else [mid or "" for mid in kept]


@pytest.mark.parametrize("omit", [True, False], ids=["in-memory grid", "HTTP grid"])
def test_a_message_the_grid_refuses_costs_its_node_only(omit: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Every other reply is still attributed to its own node, the refused node is named, and the round
    does not wait for a reply that cannot come."""
    from fedrobust.strategies.collect import push_and_collect

    strategy = RobustStrategy(aggregator="median", num_byzantine=F, min_train_nodes=N, progress=False)
    instructions, network = _round_with_dead_nodes(strategy, dict.fromkeys(range(N), 0.0))
    refused = instructions[2].metadata.dst_node_id
    refusing = _RefusingNetwork(network._replies, refused, omit=omit)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="fedrobust.strategies.collect"):
        sent, replies = push_and_collect(refusing, instructions, timeout=5.0)  # type: ignore[arg-type]
    assert time.monotonic() - started < 2.0
    assert sorted(sent.values()) == sorted(m.metadata.dst_node_id for m in instructions if m is not instructions[2])
    assert len(replies) == N - 1
    for reply in replies:  # the reply from node i is attributed to node i
        assert sent[reply.metadata.reply_to_message_id] == reply.metadata.src_node_id
    assert f"did not take 1 of {N} messages (to node {refused})" in caplog.text


def test_a_grid_whose_ids_cannot_be_matched_to_the_messages_is_refused_by_name() -> None:
    from fedrobust.strategies.collect import push

    class Shuffling:
        def push_messages(self, messages: list[Message]) -> list[str]:
            return ["x"]

    instructions = _instructions(RobustStrategy(aggregator="median", progress=False), _global(), 3, 1)
    with pytest.raises(ValueError, match="returned 1 ids for 3 messages"):
        push(Shuffling(), instructions)  # type: ignore[arg-type]


def test_a_partition_query_the_grid_refuses_is_asked_again_at_the_next_poll_not_every_50_ms(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from fedrobust.strategies.discovery import Discovery

    _instructions(RobustStrategy(aggregator="median", progress=False), _global(), 1, 1)  # the task's identity

    class RefusingNode2:
        def get_node_ids(self) -> list[int]:
            return [1, 2]

        def push_messages(self, messages: list[Message]) -> list[str]:
            for m in messages:  # as Flower's grids do: each message's id set, the refused one left out
                m.metadata.__dict__["_message_id"] = f"q{m.metadata.dst_node_id}"
            return [m.metadata.message_id for m in messages if m.metadata.dst_node_id != 2]

        def pull_messages(self, message_ids: list[str]) -> list[Message]:
            return []

    discovery = Discovery(RefusingNode2(), {}, set(), {})  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="fedrobust.strategies.collect"):
        discovery.poll(needed=2, wait=0.5)
        assert sum("did not take" in m for m in caplog.messages) == 1  # not once per 50 ms loop
        discovery.poll(needed=2, wait=0.2)
    assert sum("did not take" in m for m in caplog.messages) == 2  # the next poll asks again
    assert discovery.pending == {"q1": 1}


def test_discovery_judges_only_the_nodes_still_connected(caplog: pytest.LogCaptureFixture) -> None:
    """Node 1's ClientApp fails the query and node 1 leaves; node 3 (a SuperNode restarted under a new id)
    then says it holds node 1's partition. Neither a failure nor a shared partition of a node that left counts."""
    from flwr.app import Error
    from flwr.common.constant import ErrorCode

    from fedrobust import protocol
    from fedrobust.strategies.discovery import Discovery

    _instructions(RobustStrategy(aggregator="median", progress=False), _global(), 1, 1)  # the task's identity

    class Nodes:
        def __init__(self) -> None:
            self.connected = [1, 2]
            self.asked: dict[str, Message] = {}

        def get_node_ids(self) -> list[int]:
            return list(self.connected)

        def push_messages(self, messages: list[Message]) -> list[str]:
            for m in messages:
                m.metadata.__dict__["_message_id"] = f"q{m.metadata.dst_node_id}"
                self.asked[m.metadata.message_id] = m
            return [m.metadata.message_id for m in messages]

        def pull_messages(self, message_ids: list[str]) -> list[Message]:
            replies = []
            for mid in message_ids:
                query = self.asked.pop(mid)
                node = query.metadata.dst_node_id
                if node == 1:
                    failed = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason="boom")
                    replies.append(Message(failed, reply_to=query))
                else:
                    info = ConfigRecord({protocol.PARTITION_ID: 0 if node == 3 else 1})
                    replies.append(Message(RecordDict({protocol.INFO: info}), reply_to=query))
            return replies

    grid = Nodes()
    discovery = Discovery(grid, {}, set(), {})  # type: ignore[arg-type]
    discovery.poll()
    assert discovery.failed_now() == {1: "boom"} and discovery.partitions == {2: 1}
    discovery.partitions[1] = 0  # what node 1 said in an earlier run of the loop, before it failed and left
    grid.connected = [2, 3]
    discovery.poll()
    assert discovery.failed_now() == {}  # node 1 left: its failure no longer counts
    assert discovery.partitions[3] == 0
    assert not [m for m in caplog.messages if "both hold partition-id" in m]


def test_a_client_errors_reason_is_its_root_cause_in_one_line() -> None:
    """Flower's error replies, as each engine words them (type and message as Flower formats them)."""
    from flwr.clientapp.client_app import ClientAppException

    from fedrobust.strategies.replies import error_reason

    def flowers(ex: BaseException) -> str:  # vce_api.py and run_clientapp.py: str(type(ex)) + ":<'" + str(ex) + "'>"
        return str(type(ex)) + ":<'" + str(ex) + "'>"

    # A SuperNode: Flower's ClientAppException, no traceback.
    assert error_reason(flowers(ClientAppException("client exploded"))) == (
        "Exception ClientAppException occurred. Message: client exploded"
    )
    # Ray's simulation: Ray's error holds the actor's traceback, in colour; its root cause comes first.
    ray = (
        "\x1b[36mray::ClientAppActor.run()\x1b[39m (pid=12450, ip=192.0.2.2, actor_id=b11f, repr=<ClientAppActor>)\n"
        '  File "/venv/flwr/clientapp/client_app.py", line 188, in __call__\n'
        "    raise ValueError(f\"No query function registered with name '{name}'\")\n"
        "ValueError: No query function registered with name 'default'\n\n"
        "The above exception was the direct cause of the following exception:\n\n"
        '  File "/venv/flwr/simulation/ray_transport/ray_actor.py", line 63, in run\n'
        "    raise ClientAppException(str(ex)) from ex\n"
        "flwr.clientapp.client_app.ClientAppException: \n"
        "Exception ClientAppException occurred. Message: No query function registered with name 'default'"
    )
    reason = "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'" + ray + "'>"
    assert error_reason(reason) == "ValueError: No query function registered with name 'default'"
    # A client that raised its own error while handling another: its own is the reason.
    handled = (
        '  File "/app/client_app.py", line 12, in train\n    partition = context.node_config["partition-id"]\n'
        "KeyError: 'partition-id'\n\nDuring handling of the above exception, another exception occurred:\n\n"
        '  File "/app/client_app.py", line 14, in train\n'
        "ValueError: node config has no partition-id\n\n"
        "The above exception was the direct cause of the following exception:\n\n"
        "flwr.clientapp.client_app.ClientAppException: \n"
        "Exception ClientAppException occurred. Message: node config has no partition-id"
    )
    assert error_reason("<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'" + handled + "'>") == (
        "ValueError: node config has no partition-id"
    )
    # The one-line form of an error that is not a wrapper (a ClientApp process, the in-process grid).
    assert error_reason(flowers(KeyError("num-examples"))) == "KeyError: 'num-examples'"
    assert error_reason(flowers(ValueError("No evaluate function registered"))) == (
        "ValueError: No evaluate function registered"
    )
    assert error_reason("the node went away") == "the node went away"
    assert error_reason("") == error_reason("\n \n") == "unknown error"
    assert len(error_reason("x" * 1000, limit=50)) == 50
    # A long one is cut after a word: the round's line does not end in half a name.
    listed = "ValueError: a device plays a client-side attack: backdoor, gaussian, inf, label_flip, lying_weight"
    assert error_reason(listed, limit=80) == (
        "ValueError: a device plays a client-side attack: backdoor, gaussian, inf ...")


class _FlakyNetwork(_Network):
    """As :class:`_Network`, with pulls that raise ``errors`` first, one per call, and that count how many
    calls run at once (each call takes ``seconds``)."""

    def __init__(self, replies: dict[str, tuple[float, Message]], errors: list[BaseException],
                 seconds: float = 0.0) -> None:
        super().__init__(replies)
        self._errors = errors
        self._seconds = seconds
        self._lock = threading.Lock()
        self.running = self.most_at_once = self.calls = 0

    def pull_messages(self, message_ids: list[str]) -> list[Message]:
        with self._lock:
            self.calls += 1
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
            error = self._errors.pop(0) if self._errors else None
        try:
            time.sleep(self._seconds)
            if error is not None:
                raise error
            with self._lock:
                return super().pull_messages(message_ids)
        finally:
            with self._lock:
                self.running -= 1


def test_a_pull_the_superlink_fails_is_tried_again(caplog: pytest.LogCaptureFixture) -> None:
    """A SuperLink's 500 (its state database locked) or a dropped connection while pulling, before any reply
    was handed out, is the transport's failure, not the round's: the pull is tried again after a backoff,
    every reply counts, and it is said once."""
    import httpx

    from fedrobust.strategies.collect import push_and_collect

    strategy = RobustStrategy(aggregator="median", num_byzantine=F, min_train_nodes=N, progress=False)
    instructions, _ = _round_with_dead_nodes(strategy, {})
    records = [ArrayRecord(s) for s in _locals(_global(), N, seed=5)]
    replies_at = {m.metadata.message_id: (0.0, _reply(m, records[i], 20)) for i, m in enumerate(instructions)}
    request = httpx.Request("POST", "https://superlink/v1/runtime/pull-messages")
    locked = httpx.HTTPStatusError("Server error '500 Internal Server Error'", request=request,
                                   response=httpx.Response(500, request=request))
    network = _FlakyNetwork(replies_at, [locked, ConnectionResetError("reset by peer")])
    with caplog.at_level("INFO"):
        sent, replies = push_and_collect(network, instructions, timeout=10.0)  # type: ignore[arg-type]
    assert sorted(sent[r.metadata.reply_to_message_id] for r in replies) == [100 + i for i in range(N)]
    said = [r.getMessage() for r in caplog.records if "pulling replies" in r.getMessage()]
    assert said[0].startswith("pulling replies failed (HTTPStatusError: Server error '500 Internal Server Error'): "
                              "trying again in 0.5 s")
    assert said[-1] == "pulling replies works again after 2 failed tries"
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
    # An error of the code, or a refusal that asking again does not change, ends the round as it is.
    forbidden = httpx.HTTPStatusError("Client error '403 Forbidden'", request=request,
                                      response=httpx.Response(403, request=request))
    for error in (TypeError("a bug"), forbidden):
        network = _FlakyNetwork(dict(replies_at), [error])
        with pytest.raises(type(error)):
            push_and_collect(network, instructions, timeout=10.0)  # type: ignore[arg-type]


def test_slow_pulls_are_held_two_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy SuperLink answers every pull slowly: the round asks again beside a held call, but with at most
    two held calls running at once, not one more every SLOW_PULL_SECONDS."""
    from fedrobust.strategies import collect

    monkeypatch.setattr(collect, "SLOW_PULL_SECONDS", 0.05)
    strategy = RobustStrategy(aggregator="median", num_byzantine=F, min_train_nodes=N, progress=False)
    instructions, _ = _round_with_dead_nodes(strategy, {})
    records = [ArrayRecord(s) for s in _locals(_global(), N, seed=5)]
    replies_at = {m.metadata.message_id: (0.2 * i, _reply(m, records[i], 20)) for i, m in enumerate(instructions)}
    network = _FlakyNetwork(replies_at, [], seconds=0.4)
    sent, replies = collect.push_and_collect(network, instructions, timeout=8.0)  # type: ignore[arg-type]
    assert sorted(sent[r.metadata.reply_to_message_id] for r in replies) == [100 + i for i in range(N)]
    assert network.calls > 3 and network.most_at_once == collect.MAX_HELD_PULLS
