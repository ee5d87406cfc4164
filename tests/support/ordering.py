"""The order of the slow tier: the longest tests first, split so that both workers finish together."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def xdist_part_sizes(count: int, workers: int) -> list[int]:
    """How many of ``count`` tests xdist's worksteal scheduler hands each worker at the start: worker
    ``i`` takes ``remaining // (workers - i)`` from the front of what is left."""
    sizes, left = [], count
    for i in range(workers):
        sizes.append(left // (workers - i))
        left -= sizes[-1]
    return sizes


def balanced_order(items: Sequence[T], seconds: Callable[[T], float], workers: int) -> list[T]:
    """``items`` as ``workers`` consecutive parts of xdist's sizes, of about equal estimated time.

    Longest first, each to the part with the least time so far (longest-processing-time scheduling);
    so each part starts with its longest tests and ends with its shortest, the ones a worker that
    runs dry steals.
    """
    sizes = xdist_part_sizes(len(items), workers)
    parts: list[list[T]] = [[] for _ in range(workers)]
    totals = [0.0] * workers
    for item in sorted(items, key=lambda item: -seconds(item)):  # stable: ties keep collection order
        open_parts = [i for i in range(workers) if len(parts[i]) < sizes[i]]
        part = min(open_parts, key=lambda i: (totals[i], i))  # the least loaded part, the first among equals
        parts[part].append(item)
        totals[part] += seconds(item)
    return [item for part in parts for item in part]
