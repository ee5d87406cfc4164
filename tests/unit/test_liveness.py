"""Liveness tracker: alive -> suspected -> dead -> back, backoff probes, quarantine, state round trip."""

from __future__ import annotations

import json
import logging

import pytest

from fedrobust.liveness import LivenessTracker


def test_misses_make_a_node_suspected_then_dead_and_a_reply_revives_it() -> None:
    tracker = LivenessTracker(suspect_after=2, dead_after=3)
    tracker.record_miss(1, 1, now=1.0)
    assert tracker.status(1) == "alive"
    tracker.record_miss(1, 2, now=2.0)
    assert tracker.status(1) == "suspected"
    assert tracker.eligible([1], 3) == [1]  # suspected nodes are still sampled
    tracker.record_miss(1, 3, now=3.0)
    assert tracker.status(1) == "dead"
    tracker.record_reply(1, 4, now=4.0)
    assert tracker.status(1) == "alive"
    # Counters were reset: it takes the full number of misses again.
    tracker.record_miss(1, 5)
    tracker.record_miss(1, 6)
    assert tracker.status(1) == "suspected"


def test_a_reply_in_between_resets_the_consecutive_misses() -> None:
    tracker = LivenessTracker(suspect_after=1, dead_after=2)
    tracker.record_miss(1, 1)
    tracker.record_reply(1, 2)
    tracker.record_miss(1, 3)
    assert tracker.status(1) == "suspected"


def test_dead_node_is_excluded_for_the_backoff_then_probed_with_doubling_backoff() -> None:
    tracker = LivenessTracker(suspect_after=1, dead_after=1, backoff_rounds=2, max_backoff=5)
    tracker.record_miss(7, 10)
    assert tracker.status(7) == "dead"
    excluded = []
    probes = []
    for round_ in range(11, 40):
        if tracker.eligible([7], round_):
            probes.append(round_)
            tracker.record_miss(7, round_)  # the probe fails again
        else:
            excluded.append(round_)
    # Backoff 2, then 4, then capped at 5.
    assert probes == [13, 18, 24, 30, 36]
    assert excluded[:2] == [11, 12]
    tracker.record_reply(7, 40)
    assert tracker.eligible([7], 41) == [7]
    tracker.record_miss(7, 41)
    assert tracker.eligible([7], 42) == []  # a fresh death starts from backoff_rounds again
    assert tracker.eligible([7], 44) == [7]


def test_offline_node_is_dead_at_once_and_excluded_until_online() -> None:
    tracker = LivenessTracker(backoff_rounds=1)
    tracker.eligible([1, 2], 1)
    tracker.observe_node(2, online=False, now=5.0)
    assert tracker.status(2) == "dead"
    for round_ in range(2, 30):  # backoff over long ago, but Flower still says offline
        assert tracker.eligible([1, 2], round_) == [1]
    tracker.observe_node(2, online=True, now=6.0)
    assert tracker.status(2) == "alive"
    assert tracker.eligible([1, 2], 30) == [1, 2]


def test_online_report_does_not_revive_a_node_that_misses_deadlines() -> None:
    tracker = LivenessTracker(suspect_after=1, dead_after=1)
    tracker.record_miss(3, 1)
    tracker.observe_node(3, online=True, now=1.0)
    assert tracker.status(3) == "dead"


def test_any_reply_proves_liveness_but_invalid_ones_are_counted() -> None:
    tracker = LivenessTracker(suspect_after=1, dead_after=1)
    tracker.record_miss(4, 1)
    tracker.record_reply(4, 2, ok=False, now=2.0)
    assert tracker.status(4) == "alive"
    node = tracker.state_dict()["nodes"]["4"]
    assert (node["replies"], node["invalid_replies"], node["last_seen"]) == (1, 1, 2.0)


def test_repeated_rejections_quarantine_then_release_on_probation() -> None:
    tracker = LivenessTracker(quarantine_after=3, quarantine_rounds=4, rejection_window=5, probation_rounds=3)
    tracker.record_rejection(9, 1, "norm")
    tracker.record_rejection(9, 2, "nonfinite")
    assert tracker.status(9) == "alive"
    tracker.record_rejection(9, 3, "norm")
    assert tracker.status(9) == "quarantined"
    assert tracker.snapshot() == {"alive": 0, "suspected": 0, "dead": 0, "quarantined": 1}
    assert [r for r in range(4, 12) if tracker.eligible([9], r)] == [8, 9, 10, 11]
    assert tracker.status(9) == "alive"
    # On probation (rounds 8..10) one rejection is enough.
    tracker.record_rejection(9, 10, "signature")
    assert tracker.status(9) == "quarantined"
    assert tracker.state_dict()["nodes"]["9"]["rejection_reasons"] == {"norm": 2, "nonfinite": 1, "signature": 1}
    # After probation it takes quarantine_after rejections within the window again.
    assert tracker.eligible([9], 15) == [9]
    tracker.record_rejection(9, 20, "norm")
    tracker.record_rejection(9, 21, "norm")
    assert tracker.status(9) == "alive"


def test_rejections_spread_beyond_the_window_do_not_quarantine() -> None:
    tracker = LivenessTracker(quarantine_after=3, rejection_window=5)
    for round_ in (1, 4, 7, 10, 13, 16):
        tracker.record_rejection(5, round_, "norm")
    assert tracker.status(5) == "alive"
    tracker.record_rejection(5, 17, "norm")  # 13, 16, 17 fall in one window
    assert tracker.status(5) == "quarantined"


def test_eligible_is_sorted_unique_and_unknown_nodes_are_alive() -> None:
    tracker = LivenessTracker(suspect_after=1, dead_after=1)
    tracker.record_miss(2, 1)
    assert tracker.eligible([5, 3, 2, 3, 1], 2) == [1, 3, 5]
    assert tracker.status(12345) == "alive"
    assert tracker.snapshot() == {"alive": 0, "suspected": 0, "dead": 1, "quarantined": 0}


def test_state_dict_round_trips_through_json() -> None:
    tracker = LivenessTracker(suspect_after=1, dead_after=2, quarantine_after=1, quarantine_rounds=3)
    tracker.record_reply(1, 1, now=1.5)
    tracker.record_miss(2, 1)
    tracker.record_miss(2, 2)
    tracker.record_miss(3, 2)
    tracker.record_rejection(4, 2, "shape")
    tracker.observe_node(2**63 + 5, online=False, now=2.0)  # Flower node ids are uint64
    state = tracker.state_dict()

    restored = LivenessTracker(suspect_after=1, dead_after=2, quarantine_after=1, quarantine_rounds=3)
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.state_dict() == state
    nodes = [1, 2, 3, 4, 2**63 + 5, 6]
    for round_ in range(3, 10):
        assert restored.eligible(nodes, round_) == tracker.eligible(nodes, round_)
        assert [restored.status(n) for n in nodes] == [tracker.status(n) for n in nodes]


def test_load_state_dict_rejects_malformed_state() -> None:
    tracker = LivenessTracker()
    with pytest.raises(ValueError, match="version"):
        tracker.load_state_dict({"version": 99, "round": 0, "nodes": {}})
    with pytest.raises(ValueError, match="unknown fields"):
        tracker.load_state_dict({"version": 1, "round": 0, "nodes": {"1": {"colour": "red"}}})
    with pytest.raises(ValueError, match="status"):
        tracker.load_state_dict({"version": 1, "round": 0, "nodes": {"1": {"status": "zombie"}}})


@pytest.mark.parametrize(
    ("params", "name"),
    [
        ({"suspect_after": 0}, "suspect_after"),
        ({"suspect_after": 3, "dead_after": 2}, "dead_after"),
        ({"backoff_rounds": 0}, "backoff_rounds"),
        ({"backoff_rounds": 4, "max_backoff": 3}, "max_backoff"),
        ({"quarantine_after": 0}, "quarantine_after"),
        ({"quarantine_rounds": 0}, "quarantine_rounds"),
        ({"rejection_window": 0}, "rejection_window"),
        ({"probation_rounds": -1}, "probation_rounds"),
        ({"dead_after": 2.5}, "dead_after"),
        ({"suspect_after": True}, "suspect_after"),
    ],
)
def test_invalid_parameters_name_the_parameter_and_range(params: dict, name: str) -> None:
    with pytest.raises(ValueError, match=rf"{name} must be an integer >= "):
        LivenessTracker(**params)


def test_invalid_round_is_rejected() -> None:
    with pytest.raises(ValueError, match="round"):
        LivenessTracker().record_miss(1, -1)


def test_a_node_flower_no_longer_lists_is_dead_and_not_reported_alive(caplog: pytest.LogCaptureFixture) -> None:
    """After a restart that gave the nodes new ids (a resumed simulation) the old ids are gone from
    Flower's node list: they are dead in the round's report, never sampled, and alive again if listed again."""
    from types import SimpleNamespace

    from fedrobust.strategies.robust_strategy import RobustStrategy

    def grid(node_ids: list[int]) -> SimpleNamespace:
        nodes = [SimpleNamespace(node_id=n, status="online") for n in node_ids]
        return SimpleNamespace(get_nodes=lambda: nodes)

    strategy = RobustStrategy(aggregator="median", progress=False)
    assert strategy.refresh_liveness(grid([1, 2, 3, 4]), 1) == [1, 2, 3, 4]
    with caplog.at_level(logging.INFO, logger="fedrobust.liveness"):
        assert strategy.refresh_liveness(grid([5, 6, 7, 8]), 2) == [5, 6, 7, 8]
    # The log says why, in one line for them all: the nodes are gone from the list, not reported offline.
    assert [m for m in caplog.messages if "no longer listed" in m] == [
        "4 nodes (1, 2, 3 and 1 more) no longer listed by Flower: marked dead"
    ]
    assert "reported offline" not in caplog.text
    assert strategy.liveness.snapshot() == {"alive": 4, "suspected": 0, "dead": 4, "quarantined": 0}
    assert strategy.refresh_liveness(grid([1, 5, 6, 7, 8]), 3) == [1, 5, 6, 7, 8]
    assert strategy.liveness.status(1) == "alive" and strategy.liveness.status(2) == "dead"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fedrobust.liveness"):
        assert strategy.refresh_liveness(grid([5, 6, 7, 8]), 4) == [5, 6, 7, 8]
    assert [m for m in caplog.messages if "no longer listed" in m] == ["node 1 no longer listed by Flower: marked dead"]
    # After a resume, the first node list tells the checkpoint's nodes that are gone as what they are.
    strategy.liveness.forget_heard()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fedrobust.liveness"):
        strategy.refresh_liveness(grid([9, 10]), 5)
        strategy.refresh_liveness(grid([10]), 6)
    assert [m for m in caplog.messages if "marked dead" in m] == [
        "4 nodes (5, 6, 7 and 1 more) of the checkpoint's run not connected now (a restarted simulation gives its "
        "nodes new ids): marked dead",
        "node 9 no longer listed by Flower: marked dead",
    ]


def test_a_dead_node_that_drops_off_the_list_is_not_reported_again() -> None:
    tracker = LivenessTracker(dead_after=1)
    tracker.observe_listed([1, 2])
    tracker.record_reply(1, 1)
    tracker.record_reply(2, 1)
    tracker.record_miss(1, 2)  # dead: missed dead_after rounds
    assert tracker.status(1) == "dead"
    assert tracker.observe_listed([2]) == []  # already dead: nothing newly marked
    assert tracker.observe_listed([]) == [2]
    assert tracker.eligible([1, 2], 10) == []  # both offline now


def test_only_the_first_round_of_a_run_frees_the_key_pins_of_unlisted_nodes() -> None:
    """Pins restored from a checkpoint name node ids from before a restart: freed at the first round. Later a
    node drops off Flower's list (online nodes only) while merely offline, and keeps its key."""
    from types import SimpleNamespace

    from fedrobust.signing import TrustStore, generate_keypair
    from fedrobust.strategies.robust_strategy import RobustStrategy

    def grid(node_ids: list[int]) -> SimpleNamespace:
        return SimpleNamespace(get_nodes=lambda: [SimpleNamespace(node_id=n, status="online") for n in node_ids])

    trust = TrustStore()
    kid = trust.add(generate_keypair()[1])
    trust.pin(kid, 1)  # as restored from a checkpoint: node 1 is an id from before the restart
    strategy = RobustStrategy(aggregator="median", signing=trust, progress=False)
    strategy.refresh_liveness(grid([7, 8]), 1)
    assert trust.bound_node(kid) is None
    trust.pin(kid, 7)
    strategy.refresh_liveness(grid([8]), 2)  # node 7 offline: not listed, but its key stays its own
    assert trust.bound_node(kid) == 7


def test_after_a_resume_the_report_counts_the_nodes_of_this_run_not_those_of_the_checkpoint() -> None:
    """A resumed simulation's nodes have new ids: the checkpoint's ids never show again. The round's report
    counts the nodes heard of since the restore (as an uninterrupted run's: all alive), while the state
    keeps the old ones dead; a checkpointed node that is listed again (a deployment) counts again."""
    from types import SimpleNamespace

    from fedrobust.strategies.robust_strategy import RobustStrategy

    def grid(node_ids: list[int]) -> SimpleNamespace:
        return SimpleNamespace(get_nodes=lambda: [SimpleNamespace(node_id=n, status="online") for n in node_ids])

    first = RobustStrategy(aggregator="median", progress=False)
    first.refresh_liveness(grid([1, 2, 3, 4]), 1)
    resumed = RobustStrategy(aggregator="median", progress=False)
    resumed.liveness.load_state_dict(json.loads(json.dumps(first.liveness.state_dict())))
    resumed.liveness.forget_heard()  # what the round loop does on a resume
    assert resumed.refresh_liveness(grid([5, 6, 7, 8]), 2) == [5, 6, 7, 8]
    assert resumed.liveness.status(1) == "dead"
    assert resumed.liveness.snapshot() == {"alive": 4, "suspected": 0, "dead": 0, "quarantined": 0}
    resumed.refresh_liveness(grid([1, 5, 6, 7, 8]), 3)
    assert resumed.liveness.snapshot() == {"alive": 5, "suspected": 0, "dead": 0, "quarantined": 0}
    resumed.refresh_liveness(grid([5, 6, 7, 8]), 4)  # node 1, heard of in this run, is gone again: dead
    assert resumed.liveness.snapshot() == {"alive": 4, "suspected": 0, "dead": 1, "quarantined": 0}


def test_a_rollback_within_a_run_keeps_counting_its_dead_nodes() -> None:
    """A divergence rollback restores the liveness state of an earlier round: the node that went dead in
    this run still counts in the report (only a resume forgets the nodes heard of)."""
    from types import SimpleNamespace

    from fedrobust.strategies.robust_strategy import RobustStrategy

    def grid(node_ids: list[int]) -> SimpleNamespace:
        return SimpleNamespace(get_nodes=lambda: [SimpleNamespace(node_id=n, status="online") for n in node_ids])

    strategy = RobustStrategy(aggregator="median", progress=False)
    strategy.refresh_liveness(grid([1, 2, 3, 4]), 1)
    strategy.refresh_liveness(grid([1, 2, 3]), 2)
    strategy.load_state_dict(*strategy.state_dict())  # as a rollback does
    strategy.refresh_liveness(grid([1, 2, 3]), 3)
    assert strategy.liveness.snapshot() == {"alive": 3, "suspected": 0, "dead": 1, "quarantined": 0}


def test_carry_over_gives_a_checkpoint_nodes_quarantine_to_its_new_id() -> None:
    saved = LivenessTracker(quarantine_after=1, quarantine_rounds=5)
    saved.record_rejection(7, 1, "nonfinite")
    tracker = LivenessTracker(quarantine_after=1, quarantine_rounds=5)
    tracker.load_state_dict(json.loads(json.dumps(saved.state_dict())))
    tracker.forget_heard()  # a resume
    tracker.observe_node(70, online=True)  # the same client, listed under the id a restart gave it
    tracker.carry_over(7, 70)
    tracker.observe_listed({70})
    assert tracker.known_nodes() == [70] and tracker.status(70) == "quarantined"
    assert tracker.snapshot()["quarantined"] == 1 and sum(tracker.snapshot().values()) == 1
    released = [r for r in range(2, 12) if tracker.eligible([70], r)]
    assert released == [r for r in range(2, 12) if saved.eligible([7], r)] and released[0] > 2  # when it was due
    assert tracker.state_dict()["nodes"]["70"]["rejection_reasons"] == {"nonfinite": 1}
    tracker.carry_over(8, 80)  # a node the checkpoint does not know: nothing to carry
    assert tracker.known_nodes() == [70]


def test_dead_nodes_name_the_round_of_their_next_probe_and_offline_ones_none() -> None:
    tracker = LivenessTracker(suspect_after=1, dead_after=2, backoff_rounds=2)
    for node in (1, 2, 3):
        tracker.record_reply(node, 1)
    tracker.record_miss(1, 2)
    assert tracker.dead_nodes() == {}  # suspected only: still sampled
    tracker.record_miss(1, 3)
    tracker.observe_node(2, online=False)
    assert tracker.dead_nodes() == {1: 6, 2: None}  # 3 + backoff 2 + 1; offline: until listed online
    assert tracker.eligible([1, 2, 3], 4) == [3] and tracker.eligible([1, 2, 3], 6) == [1, 3]
    tracker.record_reply(1, 6)
    tracker.observe_node(2, online=True)
    assert tracker.dead_nodes() == {}
