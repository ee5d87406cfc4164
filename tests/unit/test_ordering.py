"""The slow tier's order (tests/support/ordering.py)."""

from __future__ import annotations

from tests.support.ordering import balanced_order, xdist_part_sizes

# Estimated seconds of the slow tier's tests, in collection order: the four long ones are not together.
COSTS = {"a": 0, "b": 35, "c": 30, "d": 120, "e": 100, "f": 95, "g": 20, "h": 0, "i": 100, "j": 25, "k": 0}


def test_parts_have_the_sizes_xdist_hands_out() -> None:
    assert xdist_part_sizes(25, 2) == [12, 13]
    assert xdist_part_sizes(10, 3) == [3, 3, 4]
    assert sum(xdist_part_sizes(7, 4)) == 7


def test_longest_first_and_each_part_of_about_equal_time() -> None:
    order = balanced_order(list(COSTS), COSTS.__getitem__, 2)
    assert sorted(order) == sorted(COSTS)
    first, second = order[:5], order[5:]  # xdist: 11 // 2 = 5 to the first worker, 6 to the second
    totals = [sum(COSTS[k] for k in part) for part in (first, second)]
    assert abs(totals[0] - totals[1]) <= 25, (first, second, totals)
    for part in (first, second):
        costs = [COSTS[k] for k in part]
        assert costs == sorted(costs, reverse=True), part  # the shortest at the end: what is stolen
    # Two of the four long tests in each part, each part starting with one.
    assert sorted(sum(COSTS[k] >= 95 for k in part) for part in (first, second)) == [2, 2]
    assert COSTS[first[0]] >= 95 and COSTS[second[0]] >= 95


def test_without_estimates_the_collection_order_stays() -> None:
    items = list("abcdefg")
    assert balanced_order(items, lambda _: 0.0, 2) == items
