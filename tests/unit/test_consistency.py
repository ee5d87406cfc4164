"""The consistency filter: a client that turns against its own past replies (a sleeper) is dropped.

Each client here has a direction of its own (its data), the same every round up to fresh noise, as on
non-IID data; every test runs the filter through the pipeline, over several calls, as rounds."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from fedrobust import aggregators

N, F, D = 12, 3, 300
CLIENTS = [500 + 11 * i for i in range(N)]  # ids that are not the row positions
SLEEPERS = (2, 7)
TURN = 4  # the round (0-based) from which the sleepers reverse their updates


def client_directions() -> Tensor:
    g = torch.Generator().manual_seed(99)
    return torch.randn(N, D, generator=g, dtype=torch.float64)


def round_rows(r: int, *, turned: bool = True) -> Tensor:
    """Round ``r``: each client's own direction plus as much fresh noise; the sleepers reverse theirs
    from round ``TURN`` on (when ``turned``)."""
    g = torch.Generator().manual_seed(1000 + r)
    x = client_directions() + torch.randn(N, D, generator=g, dtype=torch.float64)
    if turned and r >= TURN:
        for i in SLEEPERS:
            x[i] = -x[i]
    return x


def consistency(**params: object) -> aggregators.Aggregator:
    return aggregators.build("mean", f=F, pre=[{"name": "consistency", **params}])


def test_a_client_that_turns_is_dropped_from_that_round_on_and_no_honest_client_is() -> None:
    agg = consistency()
    for r in range(TURN + 4):
        agg(round_rows(r), clients=CLIENTS)
        assert agg.last_filtered == (SLEEPERS if r >= TURN else ()), r


def test_the_turn_is_caught_on_sampled_coordinates() -> None:
    agg = consistency(coordinates=64)
    for r in range(TURN + 2):
        agg(round_rows(r), clients=CLIENTS)
        assert agg.last_filtered == (SLEEPERS if r >= TURN else ()), r


def test_the_filter_follows_the_client_not_the_row() -> None:
    agg = consistency()
    order = torch.randperm(N, generator=torch.Generator().manual_seed(5))
    for r in range(TURN + 2):
        x = round_rows(r)
        if r == TURN + 1:  # the rows come in another order: the sleepers are still found by their ids
            x, clients = x[order], [CLIENTS[i] for i in order.tolist()]
            agg(x, clients=clients)
            expected = tuple(sorted(order.tolist().index(i) for i in SLEEPERS))
        else:
            agg(x, clients=CLIENTS)
            expected = SLEEPERS if r >= TURN else ()
        assert agg.last_filtered == expected, r


def test_without_the_clients_it_drops_nothing() -> None:
    agg = consistency()
    for r in range(TURN + 2):
        torch.testing.assert_close(agg(round_rows(r)), round_rows(r).mean(0))
        assert agg.last_filtered == ()


def test_a_checkpointed_filter_goes_on_as_one_never_stopped() -> None:
    running = consistency()
    for r in range(TURN):
        running(round_rows(r), clients=CLIENTS)
    state = running.state_dict()
    assert state["pre.0.directions"].shape == (N, D)
    resumed = consistency()
    resumed.load_state_dict(state)
    for r in range(TURN, TURN + 2):
        torch.testing.assert_close(resumed(round_rows(r), clients=CLIENTS), running(round_rows(r), clients=CLIENTS))
        assert resumed.last_filtered == SLEEPERS


def test_a_reply_it_drops_does_not_move_the_clients_direction() -> None:
    """A sleeper dropped in one round is compared with its accepted past again the next: it stays turned."""
    agg = consistency(decay=0.0)  # the direction is the last accepted reply alone
    for r in range(TURN + 3):
        agg(round_rows(r), clients=CLIENTS)
    assert agg.last_filtered == SLEEPERS


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"decay": 1.0}, "decay must be < 1"),
        ({"decay": -0.1}, "decay"),
        ({"coordinates": 0}, "coordinates must be an integer >= 1"),
        ({"z": -1.0}, "parameter z"),
        ({"slow_decay": 0.5}, r"slow_decay must be null \(one direction\) or a number between decay \(0.7\) and 1"),
        ({"decay": 0.98}, r"slow_decay must be null \(one direction\) or a number between decay \(0.98\) and 1"),
        ({"slow_decay": 1.0}, r"slow_decay must be null \(one direction\) or a number between"),
        ({"slow_decay": "0.9"}, r"slow_decay must be null \(one direction\) or a number between"),
    ],
)
def test_a_wrong_parameter_names_what_is_valid(params: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        consistency(**params)


def test_a_state_of_the_wrong_shape_is_refused() -> None:
    agg = consistency()
    agg(round_rows(0), clients=CLIENTS)
    state = agg.state_dict()
    state["pre.0.clients"] = state["pre.0.clients"][:-1]
    with pytest.raises(ValueError, match="consistency: state has 11 clients"):
        consistency().load_state_dict(state)


def test_the_pipeline_names_the_filter_that_left_each_row_out() -> None:
    """The sleepers fall to the consistency filter; a reply the direction filter drops is named by it."""
    agg = aggregators.build("mean", f=F, pre=["consistency", {"name": "direction", "memory": False}])
    for r in range(TURN + 1):
        x = round_rows(r)
        if r == TURN:
            x[5] = -2.0 * x[:5].mean(0)  # no record to turn against, but pushes against the others
        agg(x, clients=CLIENTS if r < TURN else CLIENTS[:5] + [9999] + CLIENTS[6:])
    assert agg.last_filtered_by == {2: "consistency", 7: "consistency", 5: "direction"}


def test_a_state_made_with_other_coordinates_is_refused_by_name() -> None:
    agg = consistency(coordinates=64)
    agg(round_rows(0), clients=CLIENTS)
    resumed = consistency(coordinates=128)
    resumed.load_state_dict(agg.state_dict())
    with pytest.raises(ValueError, match="directions have 64 coordinates, but coordinates=128 samples 128"):
        resumed(round_rows(1), clients=CLIENTS)


def turning_rows(r: int, start: int = TURN, steps: int = 6) -> Tensor:
    """Round ``r``: as ``round_rows``, but the sleepers turn from their direction to its reverse in
    ``steps`` equal steps from round ``start`` on, through a direction orthogonal to it."""
    x = round_rows(r, turned=False)
    angle = math.pi * min(max(r - start + 1, 0), steps) / steps
    g = torch.Generator().manual_seed(7)
    for i in SLEEPERS:
        own = client_directions()[i]
        side = torch.randn(D, generator=g, dtype=torch.float64)
        side -= (side @ own) / (own @ own) * own
        side *= own.norm() / side.norm()
        x[i] += (math.cos(angle) - 1.0) * own + math.sin(angle) * side
    return x


def test_a_client_that_turns_by_small_steps_is_caught_by_the_slow_direction_only() -> None:
    """The fast direction alone follows the turn; the slow one (on by default) remembers the start."""
    fast, both = consistency(slow_decay=None), consistency()
    caught_fast, caught_both = set(), set()
    for r in range(TURN + 8):
        fast(turning_rows(r), clients=CLIENTS)
        both(turning_rows(r), clients=CLIENTS)
        assert set(fast.last_filtered) <= set(SLEEPERS) and set(both.last_filtered) <= set(SLEEPERS), r
        caught_fast |= set(fast.last_filtered)
        caught_both |= set(both.last_filtered)
        if r >= TURN + 5:  # reversed since round TURN + 5: the slow direction still remembers them
            assert both.last_filtered == SLEEPERS, r
    assert caught_fast == set()
    assert caught_both == set(SLEEPERS)


def test_the_slow_direction_is_in_the_checkpoint() -> None:
    running = consistency()
    for r in range(TURN + 2):
        running(turning_rows(r), clients=CLIENTS)
    state = running.state_dict()
    assert set(state) == {"pre.0.clients", "pre.0.directions", "pre.0.slow_directions"}
    resumed = consistency()
    resumed.load_state_dict(state)
    for r in range(TURN + 2, TURN + 8):
        torch.testing.assert_close(resumed(turning_rows(r), clients=CLIENTS), running(turning_rows(r), clients=CLIENTS))
        assert resumed.last_filtered == running.last_filtered
    with pytest.raises(ValueError, match="a state saved with slow_decay set resumes with the same"):
        consistency(slow_decay=None).load_state_dict(state)


def test_a_state_saved_without_the_slow_direction_is_refused_with_how_to_resume() -> None:
    agg = consistency(slow_decay=None)
    agg(round_rows(0), clients=CLIENTS)
    with pytest.raises(ValueError, match="a state saved with slow_decay=null resumes with the same"):
        consistency().load_state_dict(agg.state_dict())


def test_a_turn_spread_over_the_whole_run_is_caught_early_by_the_anchored_slow_direction() -> None:
    """From the second round on, by 18 degrees a round: a running mean of the client's replies trails
    the turn by half its angle, and the filter sees nothing until the turn is complete; a slow direction
    that starts at the first reply with full weight sees it once it is well past a right angle."""
    anchored, running = consistency(slow_anchor=True), consistency(slow_anchor=False)
    for r in range(12):
        anchored(turning_rows(r, start=1, steps=10), clients=CLIENTS)
        running(turning_rows(r, start=1, steps=10), clients=CLIENTS)
        assert set(anchored.last_filtered) <= set(SLEEPERS), r
        if r >= 6:  # turned by 108 degrees or more
            assert anchored.last_filtered == SLEEPERS, r
        if r < 10:  # not yet reversed
            assert running.last_filtered == (), r
