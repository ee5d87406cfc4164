"""Which nodes may be sampled: heartbeat/deadline bookkeeping, dropouts and quarantine.

A pure bookkeeping class: the strategy tells it what happened (a reply, a missed deadline, a rejected
reply, what Flower's node list says) and asks which nodes are eligible for the next round. Its clock is the
round number it is told about; ``now`` timestamps are only recorded for reporting.

Liveness. A node is ``alive`` until it misses ``suspect_after`` consecutive rounds (``suspected``, still
sampled) and ``dead`` after ``dead_after`` consecutive misses, or at once when Flower reports it offline. A
dead node is excluded for ``backoff_rounds`` rounds and then probed (sampled once more); each failed probe
doubles the backoff up to ``max_backoff``. A node Flower reports offline stays excluded until Flower reports
it online again. Any reply (valid or not: it proves the node is up), or an online report after an offline
one, makes the node ``alive`` and resets its misses and backoff.

Quarantine. Rejections (invalid replies) are counted in a sliding window of the last ``rejection_window``
rounds; ``quarantine_after`` rejections inside the window quarantine the node for the next
``quarantine_rounds`` rounds. A sliding window rather than a lifetime total, so that a node with a rare
transient fault (a flaky disk, one NaN batch) is not eventually quarantined by accumulation. After the
quarantine the node is released on probation for ``probation_rounds`` rounds, during which a single
rejection quarantines it again.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from fedrobust.text import first_and_more

logger = logging.getLogger(__name__)

Status = Literal["alive", "suspected", "dead", "quarantined"]
STATUSES: tuple[Status, ...] = ("alive", "suspected", "dead", "quarantined")
_STATE_VERSION = 1


@dataclass
class _Node:
    """Everything the tracker knows about one node (JSON-able field types only)."""

    status: str = "alive"  # liveness only: alive | suspected | dead; quarantine is the flag below
    misses: int = 0  # consecutive missed rounds
    offline: bool = False  # Flower's node list reports it offline
    backoff: int = 0  # current exclusion length in rounds while dead; 0 once it answers again
    retry_round: int = 0  # a dead node may be probed from this round on
    quarantined: bool = False
    release_round: int = 0  # quarantined until (excluding) this round
    probation_until: int = 0  # one rejection before this round quarantines again
    quarantines: int = 0
    rejection_rounds: list[int] = field(default_factory=list)  # inside the sliding window
    rejection_reasons: dict[str, int] = field(default_factory=dict)  # lifetime totals
    replies: int = 0
    invalid_replies: int = 0
    last_seen: float | None = None  # last reply or online report
    last_miss: float | None = None


class LivenessTracker:
    """Track node liveness and misbehaviour across rounds and decide who may be sampled.

    Parameters
    ----------
    suspect_after : int, default 1
        Consecutive missed rounds after which a node is ``suspected`` (>= 1).
    dead_after : int, default 3
        Consecutive missed rounds after which a node is ``dead`` (>= suspect_after).
    backoff_rounds : int, default 2
        Rounds a newly dead node is excluded before it is probed again (>= 1).
    max_backoff : int, default 16
        Cap of the backoff, which doubles after each failed probe (>= backoff_rounds).
    quarantine_after : int, default 3
        Rejections within ``rejection_window`` rounds that quarantine a node (>= 1).
    quarantine_rounds : int, default 10
        Rounds a quarantined node is excluded (>= 1).
    rejection_window : int, default 10
        Length in rounds of the sliding window in which rejections are counted (>= 1).
    probation_rounds : int, default 10
        Rounds after a release during which a single rejection quarantines again (>= 0).

    Raises
    ------
    ValueError
        If a parameter is not an integer in its allowed range; the message names it and the range.
    """

    def __init__(
        self,
        suspect_after: int = 1,
        dead_after: int = 3,
        backoff_rounds: int = 2,
        max_backoff: int = 16,
        quarantine_after: int = 3,
        quarantine_rounds: int = 10,
        rejection_window: int = 10,
        probation_rounds: int = 10,
    ) -> None:
        _check_int("suspect_after", suspect_after, 1)
        _check_int("dead_after", dead_after, suspect_after, "suspect_after")
        _check_int("backoff_rounds", backoff_rounds, 1)
        _check_int("max_backoff", max_backoff, backoff_rounds, "backoff_rounds")
        _check_int("quarantine_after", quarantine_after, 1)
        _check_int("quarantine_rounds", quarantine_rounds, 1)
        _check_int("rejection_window", rejection_window, 1)
        _check_int("probation_rounds", probation_rounds, 0)
        self.suspect_after = suspect_after
        self.dead_after = dead_after
        self.backoff_rounds = backoff_rounds
        self.max_backoff = max_backoff
        self.quarantine_after = quarantine_after
        self.quarantine_rounds = quarantine_rounds
        self.rejection_window = rejection_window
        self.probation_rounds = probation_rounds
        self._round = 0
        self._nodes: dict[int, _Node] = {}
        # Nodes this tracker heard of since it was built or since a resume (forget_heard): the report counts
        # these. After a resume the checkpoint's nodes that never show again (a simulation's nodes get new
        # ids) are not part of the federation any more; counted, they would stay "dead" in every row.
        self._heard: set[int] = set()
        self._resumed = False  # set by forget_heard (a resume) until the next node list

    # ------------------------------------------------------------------------------------- events
    def observe_node(
        self, node_id: int, *, online: bool, now: float | None = None, reason: str = "reported offline"
    ) -> None:
        """Record what Flower's node list (``grid.get_nodes()``) says about a node.

        Offline marks the node dead at once and keeps it excluded while offline. Online after offline
        makes it alive again with its counters reset; online otherwise changes nothing (a connected node
        that misses deadlines is still suspected or dead). ``reason`` says in the log why it is offline
        (part of the documented contract, docs/contracts.md).
        """
        node = self._node(node_id)
        if online:
            node.last_seen = _now(now)
            if node.offline:
                logger.info("node %d is online again", node_id)
                self._revive(node)
            return
        if node.offline:
            return
        node.offline = True
        if node.status != "dead":
            logger.info("node %d %s: marked dead", node_id, reason)
            self._kill(node, self._round)

    def observe_listed(self, listed: Iterable[int]) -> list[int]:
        """The nodes Flower's node list holds now: every known node not among them is offline (unregistered,
        or an id from before a restart that gave the nodes new ids); returns those newly marked dead.

        One log line for them all: a resumed simulation of 100 nodes would otherwise log 100.
        """
        present = set(listed)
        unlisted = [n for n, node in sorted(self._nodes.items()) if n not in present and not node.offline]
        gone = [n for n in unlisted if self._nodes[n].status != "dead"]  # dead already: nothing new to say
        for node_id in unlisted:
            self._nodes[node_id].offline = True
        for node_id in gone:
            self._kill(self._nodes[node_id], self._round)
        if gone:
            shown = first_and_more(gone)
            nodes = f"node {shown}" if len(gone) == 1 else f"{len(gone)} nodes ({shown})"
            if self._resumed:  # ids of the checkpoint's run: a simulation's nodes get new ones in every run
                logger.info("%s of the checkpoint's run not connected now (a restarted simulation gives its nodes "
                            "new ids): marked dead", nodes)
            else:
                logger.info("%s no longer listed by Flower: marked dead", nodes)
        self._resumed = False
        return gone

    def record_reply(self, node_id: int, round: int, *, ok: bool = True, now: float | None = None) -> None:
        """Record a reply that arrived in time.

        Any reply proves the node is up, so it becomes ``alive`` whether or not the reply was valid. ``ok``
        only feeds the node's reply counters; record a rejected reply's reason with
        :meth:`record_rejection`.
        """
        self._advance(round)
        node = self._node(node_id)
        if node.status != "alive":
            logger.info("node %d answered in round %d: alive again", node_id, round)
        self._revive(node)
        node.replies += 1
        node.invalid_replies += 0 if ok else 1
        node.last_seen = _now(now)

    def record_miss(self, node_id: int, round: int, *, now: float | None = None) -> None:
        """Record a missed deadline or an error reply of a node that was sampled in ``round``."""
        self._advance(round)
        node = self._node(node_id)
        node.misses += 1
        node.last_miss = _now(now)
        if node.status == "dead":
            # A probe after the backoff failed: wait twice as long before the next one.
            node.backoff = min(node.backoff * 2, self.max_backoff)
            node.retry_round = round + node.backoff + 1
            logger.debug(
                "node %d failed its probe in round %d; next probe in round %d",
                node_id,
                round,
                node.retry_round,
            )
        elif node.misses >= self.dead_after:
            logger.info("node %d missed %d rounds in a row: marked dead", node_id, node.misses)
            self._kill(node, round)
        elif node.misses >= self.suspect_after:
            node.status = "suspected"

    def record_rejection(self, node_id: int, round: int, reason: str) -> None:
        """Record an invalid reply (bad signature, shape, non-finite values, norm bound, ...).

        ``quarantine_after`` rejections within the last ``rejection_window`` rounds, or one rejection while
        on probation, quarantine the node for the next ``quarantine_rounds`` rounds.
        """
        self._advance(round)
        node = self._node(node_id)
        node.rejection_reasons[reason] = node.rejection_reasons.get(reason, 0) + 1
        if node.quarantined:
            return  # a late reply from before the quarantine; it does not extend it
        node.rejection_rounds = [r for r in node.rejection_rounds if r > round - self.rejection_window]
        node.rejection_rounds.append(round)
        on_probation = node.quarantines > 0 and round < node.probation_until
        if on_probation or len(node.rejection_rounds) >= self.quarantine_after:
            node.quarantined = True
            node.quarantines += 1
            node.release_round = round + self.quarantine_rounds + 1
            node.probation_until = node.release_round + self.probation_rounds
            node.rejection_rounds = []
            logger.warning(
                "node %d quarantined in round %d until round %d (%s; last reason: %s)",
                node_id,
                round,
                node.release_round,
                "rejected while on probation"
                if on_probation
                else f"{self.quarantine_after} rejections within {self.rejection_window} rounds",
                reason,
            )

    # ------------------------------------------------------------------------------------- queries
    def eligible(self, node_ids: Iterable[int], round: int) -> list[int]:
        """Return the sorted node ids that may be sampled in ``round``.

        Eligible: alive or suspected, or dead with the backoff over (a probe); never quarantined or
        reported offline. Unknown node ids count as alive.
        """
        self._advance(round)
        chosen = set()
        for node_id in node_ids:
            node = self._nodes.get(node_id)
            if node is None or self._is_eligible(node, round):
                chosen.add(node_id)
        return sorted(chosen)

    def status(self, node_id: int) -> Status:
        """Current status of a node (``"alive"`` for an unknown node)."""
        node = self._nodes.get(node_id)
        if node is None:
            return "alive"
        if node.quarantined:
            return "quarantined"
        return node.status  # type: ignore[return-value]

    def dead_nodes(self) -> dict[int, int | None]:
        """The dead nodes heard of (``dead_after`` missed rounds in a row, or reported offline), by id, each
        with the round it is next sampled in as a probe (None: when Flower reports it online again). Sampling
        leaves them out until then, so a round's report names them: they are neither dropped nor rejected."""
        return {
            node_id: None if node.offline else node.retry_round
            for node_id, node in sorted(self._nodes.items())
            if node_id in self._heard and node.status == "dead" and not node.quarantined
        }

    def known_nodes(self) -> list[int]:
        """Every node id the tracker has heard of, sorted."""
        return sorted(self._nodes)

    def carry_over(self, old_id: int, new_id: int) -> None:
        """The node ``old_id`` of a checkpoint's run is ``new_id`` now (a restarted simulation gives the same
        client a new id): its record, quarantine and rejections included, is the new id's, and the old id is
        forgotten. What the new id's record held (its online report this run) gives way to it."""
        if old_id == new_id or old_id not in self._nodes:
            return
        node = self._nodes.pop(old_id)
        node.offline = False  # the new id is listed: it is connected
        self._nodes[new_id] = node
        self._heard.discard(old_id)
        self._heard.add(new_id)

    def forget_heard(self) -> None:
        """A resume: the report counts only the nodes heard of from now on (see ``snapshot``). Not on every
        restore: a rollback within a run keeps counting the run's nodes."""
        self._heard = set()
        self._resumed = True  # the next node list tells the checkpoint's nodes that are gone

    def snapshot(self) -> dict[str, int]:
        """Number of nodes per status, for the per-round report: the nodes heard of since this tracker was
        built or since a resume (not those of the checkpoint that never showed again)."""
        counts: dict[str, int] = dict.fromkeys(STATUSES, 0)
        for node_id in self._nodes:
            if node_id in self._heard:
                counts[self.status(node_id)] += 1
        return counts

    # ------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """JSON-able state (node ids become string keys); :meth:`load_state_dict` restores it exactly."""
        return {
            "version": _STATE_VERSION,
            "round": self._round,
            "nodes": {str(nid): dataclasses.asdict(node) for nid, node in sorted(self._nodes.items())},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict` (possibly after a JSON round trip).

        Raises
        ------
        ValueError
            If the state has a different version or malformed node entries.
        """
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"liveness state version {state.get('version')!r} is not supported "
                f"(expected {_STATE_VERSION})"
            )
        known = {f.name for f in dataclasses.fields(_Node)}
        nodes: dict[int, _Node] = {}
        for key, fields in state["nodes"].items():
            unknown = sorted(set(fields) - known)
            if unknown:
                raise ValueError(f"liveness state of node {key} has unknown fields {unknown}")
            node = _Node(**fields)
            if node.status not in ("alive", "suspected", "dead"):
                raise ValueError(f"liveness state of node {key} has invalid status {node.status!r}")
            # JSON object keys are strings; Flower node ids are integers.
            node.rejection_rounds = list(node.rejection_rounds)
            node.rejection_reasons = dict(node.rejection_reasons)
            nodes[int(key)] = node
        self._round = int(state["round"])
        self._nodes = nodes

    # ------------------------------------------------------------------------------------- internals
    def _node(self, node_id: int) -> _Node:
        self._heard.add(node_id)
        if node_id not in self._nodes:
            self._nodes[node_id] = _Node()
        return self._nodes[node_id]

    def _advance(self, round: int) -> None:
        if isinstance(round, bool) or not isinstance(round, int) or round < 0:
            raise ValueError(f"round must be an integer >= 0, got {round!r}")
        if round <= self._round:
            return  # late news about an earlier round: the clock never goes back
        self._round = round
        for node_id, node in self._nodes.items():
            if node.quarantined and round >= node.release_round:
                node.quarantined = False
                logger.info(
                    "node %d released from quarantine, on probation until round %d",
                    node_id,
                    node.probation_until,
                )

    def _is_eligible(self, node: _Node, round: int) -> bool:
        if node.quarantined or node.offline:
            return False
        return node.status != "dead" or round >= node.retry_round

    def _kill(self, node: _Node, round: int) -> None:
        node.status = "dead"
        node.backoff = self.backoff_rounds
        node.retry_round = round + node.backoff + 1

    @staticmethod
    def _revive(node: _Node) -> None:
        node.status = "alive"
        node.misses = 0
        node.offline = False
        node.backoff = 0
        node.retry_round = 0


def _check_int(name: str, value: Any, minimum: int, minimum_name: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        bound = f">= {minimum_name} ({minimum})" if minimum_name else f">= {minimum}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")


def _now(now: float | None) -> float:
    return time.time() if now is None else float(now)
