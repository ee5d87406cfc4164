"""How a list is said in one line of a message: the first few items and how many more; the name meant."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence


def first_and_more(items: Sequence[object], shown: int = 3) -> str:
    """``"a, b, c and 4 more"``: a message about a whole model's keys or a hundred nodes stays one line."""
    said = ", ".join(map(str, items[:shown]))
    return said + (f" and {len(items) - shown} more" if len(items) > shown else "")



def did_you_mean(name: object, valid: Iterable[str]) -> str:
    """``" (did you mean 'krum'?)"`` for a misspelt name (``'Krum'``, ``'krumm'``, ``'trimmed-mean'``) or a
    shortened one (``'geomedian'``, ``'tmean'``); empty when no valid name is close. For messages that list
    the valid names after it."""
    if not isinstance(name, str):
        return ""
    normal = {c.lower().replace("-", "_"): c for c in valid}  # 'Krum' and 'trimmed-mean' are exact matches
    typed = name.strip().lower().replace("-", "_").replace(" ", "_")
    if typed in normal:
        close = [typed]
    else:
        # A name shortened part by part is meant more surely than one that merely looks alike: by spelling
        # alone 'geomedian' is nearer 'median' than 'geometric_median'.
        short = [c for c in normal if _shortens(typed.replace("_", ""), c.split("_"))]
        close = short if len(short) == 1 else difflib.get_close_matches(typed, list(normal), n=1, cutoff=0.75)
    match = normal[close[0]] if close else None
    return f" (did you mean {match!r}?)" if match is not None and match != name else ""


def _shortens(typed: str, parts: list[str]) -> bool:
    """Whether ``typed`` is a prefix of each of ``parts`` in turn, every part used: ``geomedian`` of
    ``geometric``, ``median``; ``tmean`` of ``trimmed``, ``mean``."""
    if not parts:
        return not typed
    head, rest = parts[0], parts[1:]
    return any(
        head[:k] == typed[:k] and _shortens(typed[k:], rest) for k in range(min(len(typed), len(head)), 0, -1)
    )
