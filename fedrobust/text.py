"""How a list is said in one line of a message: the first few items and how many more."""

from __future__ import annotations

from collections.abc import Sequence


def first_and_more(items: Sequence[object], shown: int = 3) -> str:
    """``"a, b, c and 4 more"``: a message about a whole model's keys or a hundred nodes stays one line."""
    said = ", ".join(map(str, items[:shown]))
    return said + (f" and {len(items) - shown} more" if len(items) > shown else "")
