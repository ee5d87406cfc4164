"""Take a training reply apart: which arrays it carries, in which convention, and its num-examples.

Two conventions are accepted, so that any ClientApp works unchanged:

- **Flower's**: the reply's ArrayRecord (``arrays``, or the only ArrayRecord) holds the client's
  full local weights; the update is computed on the server against the global model it sent.
- **fedrobust's**: an ArrayRecord ``update`` holds the update (local minus global) itself.

Either way the metrics come from the MetricRecord ``metrics`` (or the only MetricRecord), with the
example count under ``weighted_by_key`` (``num-examples``), as Flower's FedAvg reads them.

The arrays are not loaded: they are read-only NumPy views on the reply's own bytes
(:func:`~fedrobust.strategies.reply_arrays.array_views`), which the strategy checks and writes
into its update matrix in one pass. :meth:`ParsedReply.release` then drops them from the reply,
as Flower's FedMedian pops the arrays it has read, so their bytes can be freed during the round.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedrobust import protocol
from fedrobust.strategies.reply_arrays import array_views
from fedrobust.validation import Rejection

MALFORMED_REPLY = "malformed_reply"

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# A traceback's own line of an exception: "ValueError: ...", "flwr.x.ClientAppException: ...".
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning): \S")
_WRAPPER = re.compile(r"ClientAppException|RayTaskError")  # Flower's and Ray's wrappers of the client's error
# Flower's one-line form, str(type(ex)) + ":<'" + str(ex) + "'>", for a client error that is not a wrapper.
_TYPE_AND_MESSAGE = re.compile(r"^<class '(?P<type>[A-Za-z_][\w.]*)'>:<'(?P<message>.*)'>$")


def error_reason(reason: object, limit: int = 300) -> str:
    """What failed on a client, in one line, from the reason of an error reply.

    Flower's reason holds a traceback, under Ray's simulation wrapped in the repr of Ray's error
    (terminal colour codes and a trailing ``'>`` included). Its first exception line is the root cause
    (``ValueError: No query function registered ...``), which Flower's last line (``Exception
    ClientAppException occurred. Message: ...``) repeats without its type; where the client raised
    another exception while handling one (``except KeyError: raise ValueError(...)``), that one. A
    one-line ``<class 'ValueError'>:<'message'>`` (a SuperNode's ClientApp process, the in-process grid)
    reads ``ValueError: message``.
    """
    lines = [line.strip() for line in _ANSI.sub("", str(reason)).splitlines() if line.strip()]
    if len(lines) == 1 and (typed := _TYPE_AND_MESSAGE.match(lines[0])):
        return _clip(f"{typed['type'].rsplit('.', 1)[-1]}: {typed['message']}", limit)
    line = ""
    during = False  # the next exception was raised while handling the one before: it is the one to report
    for text in lines:
        if text.startswith("During handling of the above exception"):
            during = True
        elif text.startswith("The above exception was the direct cause"):
            during = False
        elif _RAISED.match(text) and not _WRAPPER.search(text.split(":", 1)[0]) and (not line or during):
            line, during = text, False
    if not line:
        line = lines[-1] if lines else "unknown error"
    return _clip(line.removesuffix("'>"), limit)


def _clip(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` characters, cut after a word with `` ...`` where it is longer (one line of
    the round's log, one key of its metrics)."""
    if len(text) <= limit:
        return text
    return text[: limit - 4].rsplit(" ", 1)[0].rstrip(",;:") + " ..."


@dataclass
class ParsedReply:
    """The parts of one reply the strategy validates, still as the client sent them."""

    arrays: dict[str, np.ndarray]  # read-only views on the bytes of ``record``: no copy
    full_weights: bool  # Flower's convention: local weights, not an update
    num_examples: float
    metrics: dict[str, float]
    signature: ConfigRecord | None
    # Simulation-only marker of a Byzantine sender (see fedrobust.protocol.SIM_BYZANTINE).
    sim_byzantine: bool = False
    record: ArrayRecord | None = None  # the reply's ArrayRecord the views read from

    def release(self) -> None:
        """Drop the views and empty the reply's ArrayRecord, so that its bytes can be freed.

        The caller's list of replies keeps each Message alive until the round ends; only removing
        the arrays from the record lets the memory go while the next replies are processed.
        Flower's own FedMedian and FedTrimmedAvg ``pop`` the arrays of the replies they read.
        """
        self.arrays = {}
        if self.record is not None:
            self.record.clear()
            self.record = None


def parse_reply(content: RecordDict, *, arrayrecord_key: str, weighted_by_key: str) -> ParsedReply | Rejection:
    """Find the arrays, metrics and signature of a training reply, or say why it is malformed."""
    array_records = content.array_records
    if protocol.UPDATE in array_records:
        record, full_weights = array_records[protocol.UPDATE], False
    elif arrayrecord_key in array_records:
        record, full_weights = array_records[arrayrecord_key], True
    elif len(array_records) == 1:
        record, full_weights = next(iter(array_records.values())), True
    else:
        return Rejection(MALFORMED_REPLY, f"no ArrayRecord {arrayrecord_key!r} or {protocol.UPDATE!r}: {list(content)}")
    metric_records = content.metric_records
    if protocol.METRICS in metric_records:
        metrics = metric_records[protocol.METRICS]
    elif len(metric_records) == 1:
        metrics = next(iter(metric_records.values()))
    else:
        return Rejection(MALFORMED_REPLY, f"no MetricRecord {protocol.METRICS!r}: {list(content)}")
    num_examples = metrics.get(weighted_by_key)
    if isinstance(num_examples, bool) or not isinstance(num_examples, int | float):
        # The keys it has: a weighted_by_key set to a name the ClientApp does not send shows at once.
        keys = sorted(metrics)
        has = ", ".join(map(repr, keys[:6])) + (", ..." if len(keys) > 6 else "") if keys else "none"
        return Rejection(MALFORMED_REPLY, f"{weighted_by_key!r} (weighted_by_key) missing or not a number; "
                                          f"its metrics: {has}")
    try:
        arrays = array_views(record)  # checks each .npy header against its Array's dtype and shape
    except ValueError as err:
        return Rejection(MALFORMED_REPLY, f"arrays do not load: {err}")
    return ParsedReply(
        arrays=arrays,
        full_weights=full_weights,
        num_examples=num_examples,
        metrics={k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)},
        signature=content.config_records.get(protocol.SIGNATURE),
        sim_byzantine=bool(metrics.get(protocol.SIM_BYZANTINE, 0)),
        record=record,
    )
