"""The filters that drop rows: the direction filter's memory of each client, and the duplicate filter.

Each test plants what the filter is meant to catch (a client whose reversed updates fade, copies of one
update) next to what it must leave alone (a client of its own data that is always below the others but
pulls the same way, rows that only look alike), over real calls of the pipeline."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from fedrobust import aggregators

N, F, D = 16, 4, 200
CLIENTS = [1000 + 7 * i for i in range(N)]  # ids that are not the row positions


def honest_rows(seed: int, n: int = N, pull: float = 1.0) -> Tensor:
    """``n`` rows around one common direction (``pull`` in every coordinate) with fresh noise per seed:
    one round of honest updates. A small pull is late training, where the noise dominates."""
    g = torch.Generator().manual_seed(seed)
    return pull + 2.0 * torch.randn(n, D, generator=g, dtype=torch.float64)


def direction(memory: bool = True, f: int = F) -> aggregators.Aggregator:
    return aggregators.build("mean", f=f, pre=[{"name": "direction", "memory": memory}])


def fading_attack(rounds: int) -> list[Tensor]:
    """Rounds where the last row reverses an honest update. For three rounds the honest rows pull clearly
    and the reversed row stands out; after that (late training) the honest pull is a fifth of what it
    was, buried in the noise, and the reversed row's score lies within the honest scores' spread."""
    out = []
    for r in range(rounds):
        if r < 3:
            x = honest_rows(r)
            x[-1] = -x[0]
        else:
            x = honest_rows(30 + r, pull=0.2)
            x[-1] = -0.2 + 2.0 * torch.randn(D, generator=torch.Generator().manual_seed(130 + r), dtype=torch.float64)
        out.append(x)
    return out


def test_memory_drops_a_client_whose_reversed_updates_fade_below_the_rounds_test() -> None:
    rounds = fading_attack(6)
    with_memory, alone = direction(), direction(memory=False)
    for r, x in enumerate(rounds):
        with_memory(x, clients=CLIENTS)
        alone(x, clients=CLIENTS)
        assert with_memory.last_filtered == (N - 1,), r
        assert alone.last_filtered == ((N - 1,) if r < 3 else ()), r  # the round's test alone lets it back in
    torch.testing.assert_close(with_memory(rounds[-1], clients=CLIENTS), rounds[-1][:-1].mean(0))


def test_memory_follows_the_client_not_the_row() -> None:
    rounds = fading_attack(5)
    agg = direction()
    for x in rounds[:4]:
        agg(x, clients=CLIENTS)
    order = torch.randperm(N, generator=torch.Generator().manual_seed(3))
    agg(rounds[4][order], clients=[CLIENTS[i] for i in order.tolist()])
    assert agg.last_filtered == (int((order == N - 1).nonzero()),)
    # Without the clients the call stands alone: the faded row passes.
    agg(rounds[4][order])
    assert agg.last_filtered == ()


def test_one_round_whose_median_pulls_nowhere_cannot_outweigh_the_others() -> None:
    """A round in which the honest rows barely pull (the median score near zero) and the client follows
    the others' mean: its score is 57 median scores. Counted as it is, that one round would clear three
    rounds of reversing; capped at one, the client stays a suspect."""
    rounds = fading_attack(6)
    x = honest_rows(301, pull=0.02)
    x[-1] = 3.0 * x[:-1].mean(0)
    agg = direction()
    for y in [*rounds[:3], x, *rounds[3:]]:
        agg(y, clients=CLIENTS)
    assert agg.last_filtered == (N - 1,)


def test_a_client_below_the_others_that_still_pulls_with_them_is_not_a_suspect() -> None:
    """On non-IID data a client can be below the median score every round while its update still points
    the others' way: its combined z-score alone would make it a suspect, its positive scores keep it in."""
    agg = direction()
    stage = agg.pre[0]
    for r in range(12):
        x = honest_rows(r)
        x[-1] = 0.4 + 2.0 * torch.randn(D, generator=torch.Generator().manual_seed(200 + r), dtype=torch.float64)
        agg(x, clients=CLIENTS)
        assert agg.last_filtered == (), r
    assert float(stage.evidence.combined([CLIENTS[-1]])[0]) < -stage.z  # far below the others, every round
    assert float(stage.evidence.relative([CLIENTS[-1]])[0]) > 0


def test_memory_survives_a_checkpoint_with_node_ids_of_64_bits() -> None:
    clients = [*CLIENTS[:-2], 2**63, 2**64 - 1]  # Flower's node ids are unsigned 64-bit
    rounds = fading_attack(6)
    agg = direction()
    for x in rounds[:4]:
        agg(x, clients=clients)
    state = agg.state_dict()
    assert state["pre.0.memory.clients"].dtype == torch.int64
    restored = direction()
    restored.load_state_dict(state)
    assert restored.pre[0].evidence.rounds == agg.pre[0].evidence.rounds
    for x in rounds[4:]:
        assert torch.equal(agg(x, clients=clients), restored(x, clients=clients))
        assert agg.last_filtered == restored.last_filtered == (N - 1,)
    fresh = direction()
    fresh(rounds[5], clients=clients)
    assert fresh.last_filtered == ()  # what the restored filter knew came from the checkpoint


def test_memory_state_is_checked_on_load() -> None:
    agg = direction()
    agg(honest_rows(0), clients=CLIENTS)
    state = agg.state_dict()
    with pytest.raises(ValueError, match="memory state tensors differ in length"):
        direction().load_state_dict({**state, "pre.0.memory.rounds": torch.ones(3, dtype=torch.int64)})
    with pytest.raises(ValueError, match="direction: unknown state keys"):
        direction(memory=False).load_state_dict(state)
    assert direction(memory=False).state_dict() == {}


@pytest.mark.parametrize(
    ("clients", "match"),
    [
        (CLIENTS[:-1], "clients must be 16 non-negative integer ids"),
        ([*CLIENTS[:-1], -1], "clients must be 16 non-negative integer ids"),
        ([*CLIENTS[:-1], 2.0], "clients must be 16 non-negative integer ids"),
        ([*CLIENTS[:-1], CLIENTS[0]], "clients must be distinct"),
    ],
)
def test_bad_clients_are_refused_with_the_reason(clients: list[object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        direction()(honest_rows(0), clients=clients)  # type: ignore[arg-type]


def test_a_bad_memory_flag_names_the_valid_values() -> None:
    with pytest.raises(ValueError, match="direction: parameter memory must be true or false, got 'yes'"):
        aggregators.build("mean", f=1, pre=[{"name": "direction", "memory": "yes"}])


# --------------------------------------------------------------------------- duplicates


def with_copies(copies: int, noise: float = 0.0, seed: int = 0) -> tuple[Tensor, Tensor]:
    """``(x, honest)``: ``N - copies`` honest rows, then ``copies`` copies of honest row 3 (mimic), each
    moved by ``noise`` times the honest rows' median nearest-neighbour distance in a random direction."""
    honest = honest_rows(seed, N - copies)
    dist = torch.cdist(honest, honest).fill_diagonal_(torch.inf).min(dim=1).values.median()
    g = torch.Generator().manual_seed(seed + 1)
    step = torch.randn(copies, D, generator=g, dtype=torch.float64)
    copy = honest[3] + noise * dist * step / step.norm(dim=1, keepdim=True)
    return torch.cat([honest, copy]), honest


def test_dedup_keeps_one_row_of_each_group_of_copies() -> None:
    x, honest = with_copies(F)
    agg = aggregators.build("dedup+mean", f=F)
    torch.testing.assert_close(agg(x), honest.mean(0))  # row 3 stays, its copies go
    assert agg.last_filtered == tuple(range(N - F, N))


def test_dedup_catches_near_copies_within_its_tolerance_only() -> None:
    near, _ = with_copies(F, noise=0.001)
    agg = aggregators.build("dedup+mean", f=F)
    agg(near)
    assert agg.last_filtered == tuple(range(N - F, N))
    apart, _ = with_copies(F, noise=0.5)  # half the typical distance: rows of their own
    agg(apart)
    assert agg.last_filtered == ()
    agg(honest_rows(5))
    assert agg.last_filtered == ()


def test_dedup_drops_noisy_copies_around_the_row_they_copy_and_keeps_that_row() -> None:
    noisy, honest = with_copies(F, noise=0.3)  # each copy 0.3 typical distances from row 3, 0.42 from the others
    agg = aggregators.build("mean", f=F, pre=[{"name": "dedup", "tol": 0.5}])
    torch.testing.assert_close(agg(noisy), honest.mean(0))
    assert agg.last_filtered == tuple(range(N - F, N))
    assert agg(honest_rows(5)) is not None and agg.last_filtered == ()  # no honest row that close here
    loose, _ = with_copies(F, noise=0.8)  # beyond the tolerance: rows of their own
    agg(loose)
    assert not set(agg.last_filtered) & set(range(N - F, N))


def test_dedup_drops_the_same_rows_in_any_order() -> None:
    """Without exact ties the rows dropped do not depend on the order the replies came in."""
    x = honest_rows(11)
    agg = aggregators.build("mean", f=F, pre=[{"name": "dedup", "tol": 1.0}])
    out = agg(x)
    dropped = set(agg.last_filtered)
    assert len(dropped) == F  # at tol 1 about half the rows are close enough: the budget binds
    for seed in range(3):
        order = torch.randperm(N, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(agg(x[order]), out)
        assert {int(order[i]) for i in agg.last_filtered} == dropped


def test_dedup_drops_at_most_f_and_keeps_2f_plus_1() -> None:
    x, _ = with_copies(F + 2)
    agg = aggregators.build("dedup+mean", f=F)
    agg(x)
    assert agg.last_filtered == tuple(range(N - F, N))  # of seven equal rows, the last f go
    few, _ = with_copies(3)
    tight = torch.cat([few[:7], few[-3:]])  # 7 honest rows and 3 copies of row 3: room for one drop above 2f + 1
    agg(tight)
    assert agg.last_filtered == (9,)  # the last of the four equal rows


def crafted_copies(copies: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """``(x, honest)``: ``N - copies`` honest rows, then ``copies`` equal crafted rows at the upper end of
    every coordinate's honest values (as min-max or ALIE send them), so trimming decides what stays."""
    honest = honest_rows(seed, N - copies)
    crafted = honest.max(dim=0).values - 0.01
    return torch.cat([honest, crafted.expand(copies, D)]), honest


def reference_trimmed_mean(x: Tensor, cut: int) -> Tensor:
    return torch.sort(x, dim=0).values[cut : x.shape[0] - cut].mean(dim=0)


@pytest.mark.parametrize("copies", [2, 3, 4])
def test_dedup_with_lower_f_lets_the_rule_trim_one_row_fewer_per_copy_dropped(copies: int) -> None:
    x, honest = crafted_copies(copies)
    kept = x[: N - copies + 1]  # the honest rows and one crafted row
    lowered = aggregators.build("trimmed_mean", f=F, pre=[{"name": "dedup", "lower_f": True}])
    out = lowered(x)
    assert lowered.last_filtered == tuple(range(N - copies + 1, N)) and lowered.last_f == F - (copies - 1)
    torch.testing.assert_close(out, reference_trimmed_mean(kept, F - (copies - 1)))
    assert lowered.rule.f == F and lowered.pre[0].f == F  # the stages keep their own f between calls
    plain = aggregators.build("trimmed_mean", f=F, pre=["dedup"])
    torch.testing.assert_close(plain(x), reference_trimmed_mean(kept, F))
    assert plain.last_f == F
    # The one crafted row left is still trimmed at the top of every coordinate; the lowered f keeps more honest
    # values, so the aggregate lies closer to the honest mean.
    assert (out - honest.mean(0)).norm() < (plain(x) - honest.mean(0)).norm()


def test_dedup_with_lower_f_leaves_f_alone_without_copies() -> None:
    agg = aggregators.build("trimmed_mean", f=F, pre=[{"name": "dedup", "lower_f": True}])
    x = honest_rows(7)
    torch.testing.assert_close(agg(x), reference_trimmed_mean(x, F))
    assert agg.last_filtered == () and agg.last_f == F


def test_a_bad_lower_f_flag_names_the_valid_values() -> None:
    with pytest.raises(ValueError, match="dedup: parameter lower_f must be true or false, got 'yes'"):
        aggregators.build("mean", f=1, pre=[{"name": "dedup", "lower_f": "yes"}])


def test_a_filter_before_the_memory_passes_on_the_clients_of_the_rows_it_kept() -> None:
    x, _ = with_copies(F)
    agg = aggregators.build("mean", f=F, pre=["dedup", "direction"])
    agg(x, clients=CLIENTS)
    assert agg.pre[1].clients == CLIENTS[: N - F]
    buckets = aggregators.build("mean", f=2, pre=[{"name": "bucketing", "s": 2}, "direction"])
    buckets(x, clients=CLIENTS)
    assert buckets.pre[1].clients is None  # a bucket is no one client



def test_the_direction_memory_scores_a_round_in_which_it_may_drop_no_row() -> None:
    """With 2f + 1 rows left (few replies, or a filter before it dropped f) the filter drops nothing,
    but the round still counts for each client's record."""
    x = fading_attack(1)[0][: 2 * F + 1]
    agg = direction()
    agg(x, clients=CLIENTS[: 2 * F + 1])
    assert agg.last_filtered == ()
    assert agg.pre[0].evidence.rounds == dict.fromkeys(CLIENTS[: 2 * F + 1], 1)

def test_margin_keeps_a_row_a_little_below_zero_and_still_drops_a_reversed_one() -> None:
    x = honest_rows(0)
    x[-1] = -x[0]  # reversed: scores about minus the median
    x[-2] = -0.1 + 0.5 * torch.randn(D, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    plain = aggregators.build("mean", f=F, pre=["direction"])
    plain(x)
    assert plain.last_filtered == (N - 2, N - 1)  # at or below zero and an outlier: both go
    with_margin = aggregators.build("mean", f=F, pre=[{"name": "direction", "margin": 0.5}])
    with_margin(x)
    assert with_margin.last_filtered == (N - 1,)
    with pytest.raises(ValueError, match="margin"):
        aggregators.build("mean", f=F, pre=[{"name": "direction", "margin": -1.0}])


def test_fading_memory_names_a_sleeper_whose_clean_record_would_outweigh_its_flips() -> None:
    """Nine honest rounds, then the last client reverses its updates in late training, where the round's
    test catches it only now and then. Without decay its clean record keeps its relative sum above
    zero and the memory never names it; with decay 0.5 the record fades and it is dropped every round
    from the third flip on."""

    def run(decay: float) -> tuple[list[tuple[int, ...]], float]:
        agg = aggregators.build("mean", f=F, pre=[{"name": "direction", "decay": decay}])
        dropped = []
        for r in range(14):
            x = honest_rows(50 + r, pull=1.0 if r < 9 else 0.3)
            if r >= 9:
                x[-1] = -x[-1]
            agg(x, clients=CLIENTS)
            dropped.append(agg.last_filtered)
        return dropped[9:], agg.pre[0].evidence.relative(CLIENTS[-1:]).item()

    kept_record, relative = run(1.0)
    assert relative > 0 and () in kept_record[2:]
    fading, relative = run(0.5)
    assert relative < 0 and fading[2:] == [(N - 1,)] * 3
    with pytest.raises(ValueError, match="decay"):
        aggregators.build("mean", f=F, pre=[{"name": "direction", "decay": 0.0}])


def test_previous_keeps_a_row_the_copies_turned_into_an_outlier_and_still_drops_a_reversed_one() -> None:
    """Round 2: four copies pull the others' mean towards e2, so an honest row along e1 - e2 scores below
    zero against the others; it still points the way of round 1's aggregate (e1), and with ``previous``
    it stays. A reversed row scores below zero against both and goes either way."""
    half = D // 2
    e1 = torch.cat([torch.ones(half), torch.zeros(half)]).double()
    e2 = torch.cat([torch.zeros(half), torch.ones(half)]).double()
    g = torch.Generator().manual_seed(5)

    def noise(n: int) -> Tensor:
        return 0.3 * torch.randn(n, D, generator=g, dtype=torch.float64)

    first = e1 + noise(N)
    second = torch.cat([(e1 + e2) + noise(N - 6), 3 * e2 + noise(4), (e1 - e2)[None], -(e1 + e2)[None]])

    def dropped(previous: bool) -> tuple[int, ...]:
        agg = aggregators.build("mean", f=F, pre=[{"name": "direction", "memory": False, "previous": previous}])
        agg(first)
        agg(second)
        return agg.last_filtered

    assert dropped(False) == (N - 2, N - 1)
    assert dropped(True) == (N - 1,)


def test_previous_aggregate_survives_a_checkpoint() -> None:
    rounds = fading_attack(5)

    def build() -> aggregators.Aggregator:
        return aggregators.build("mean", f=F, pre=[{"name": "direction", "previous": True}])

    agg = build()
    for x in rounds[:3]:
        agg(x, clients=CLIENTS)
    state = agg.state_dict()
    assert state["pre.0.last_aggregate"].shape == (D,)
    restored = build()
    restored.load_state_dict(state)
    for x in rounds[3:]:
        assert torch.equal(agg(x, clients=CLIENTS), restored(x, clients=CLIENTS))
        assert agg.last_filtered == restored.last_filtered
    without_previous = aggregators.build("mean", f=F, pre=[{"name": "direction", "previous": False}])
    with pytest.raises(ValueError, match=r"unknown state keys \['last_aggregate'\]; valid keys: memory.clients"):
        without_previous.load_state_dict(state)
    with pytest.raises(ValueError, match="direction: parameter previous must be true or false, got 'yes'"):
        aggregators.build("mean", f=1, pre=[{"name": "direction", "previous": "yes"}])
