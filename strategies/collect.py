"""Push messages, then pull replies until they are all in, a quorum is met, or a deadline passes.

Flower's ``send_and_receive`` blocks until every reply or the timeout; this loop
can stop as soon as enough replies are in (over-selection), can give the rest only a
grace period once the round can be aggregated (a dead node then costs the round that
grace, not the whole deadline), and never waits without bound.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from flwr.app import Message
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

log = logging.getLogger(__name__)

POLL_SECONDS = 0.05
# How long one pull is waited for before the next starts beside it (_Pulls); a slow pull is not cut
# short, its replies count when it returns.
SLOW_PULL_SECONDS = 5.0
# At most this many held pulls at once: each is a request the SuperLink serves beside the others (its state
# database takes one writer at a time), and a busy SuperLink only gets busier with more.
MAX_HELD_PULLS = 2
# A pull that failed (a SuperLink's 500, a dropped connection) is tried again after this, doubling with each
# failure in a row up to the maximum; the round's deadline still holds.
PULL_RETRY_SECONDS = 0.5
MAX_PULL_RETRY_SECONDS = 5.0


def push(grid: Grid, messages: Sequence[Message]) -> dict[str, int]:
    """Push ``messages``; return message id -> destination node of each one the grid took.

    Flower's grids differ on a message they refuse: the HTTP grid (Deployment Engine) keeps an empty id in
    its place, the in-memory grid (simulation) leaves it out, and a payload too large gives no ids at all.
    Both set each message's id before pushing, so ids are matched, not positions; a grid that sets no id on
    the messages must return one per message, in order. Nodes whose message was refused are logged here.
    """
    returned = list(grid.push_messages(messages))
    took = {str(mid) for mid in returned if mid is not None and mid != ""}
    pairs = [(m.metadata.message_id, m.metadata.dst_node_id) for m in messages]
    if took <= {mid for mid, _ in pairs if mid}:
        sent = {mid: node for mid, node in pairs if mid in took}
    elif len(returned) == len(messages):
        sent = {str(mid): node for mid, (_, node) in zip(returned, pairs, strict=True) if mid is not None and mid != ""}
    else:
        raise ValueError(
            f"the grid returned {len(returned)} ids for {len(messages)} messages and set none of them on the "
            "messages: the replies cannot be attributed to nodes"
        )
    refused = sorted({node for _, node in pairs} - set(sent.values()))
    if refused:
        log.warning(
            "the grid did not take %d of %d messages (to node%s %s); Flower's log may say why",
            len(refused),
            len(messages),
            "s" if len(refused) > 1 else "",
            ", ".join(map(str, refused)),
        )
    return sent


def push_and_collect(
    grid: Grid,
    messages: Sequence[Message],
    *,
    timeout: float,
    enough: Callable[[list[Message]], bool] | None = None,
    on_pushed: Callable[[dict[str, int]], None] | None = None,
    on_reply: Callable[[Message], None] | None = None,
    quorum: Callable[[], bool] | None = None,
    grace: float = 0.0,
) -> tuple[dict[str, int], list[Message]]:
    """Send ``messages`` and gather their replies.

    Parameters
    ----------
    grid : Grid
        Flower's grid of the running ServerApp.
    messages : Sequence[Message]
        One message per destination node.
    timeout : float
        Seconds after which missing replies are given up on.
    enough : callable, optional
        Called with the replies so far; returning True ends the wait early.
    on_pushed : callable, optional
        Called once the messages are pushed, with ``sent`` (below).
    on_reply : callable, optional
        Called with each reply as soon as it is pulled (the strategy checks it and writes its row
        then, while the other nodes are still training).
    quorum : callable, optional
        Whether the replies taken so far can be aggregated; once it first says so, the missing
        replies get at most ``grace`` more seconds (never beyond ``timeout``).
    grace : float
        Seconds the missing replies are waited for once ``quorum`` is met.

    Returns
    -------
    sent : dict[str, int]
        Message id -> destination node id of the messages the grid took (see :func:`push`), to
        attribute replies (error replies come from the SuperLink's node id) and to name the nodes
        that missed the deadline.
    replies : list[Message]
        The replies received before the deadline, in arrival order, and those a held pull had taken off
        the SuperLink by then (waited for up to :data:`SLOW_PULL_SECONDS` more; see :class:`_Pulls`).
    """
    sent = push(grid, messages)
    if on_pushed is not None:
        on_pushed(sent)
    pending = set(sent)
    replies: list[Message] = []
    deadline = time.monotonic() + timeout
    ended_early = False
    quorum_met = cut_by_grace = False
    pulls = _Pulls(grid)

    def take(pulled: list[Message]) -> None:
        for reply in pulled:
            message_id = reply.metadata.reply_to_message_id
            if message_id not in pending:  # answered already
                continue
            pending.discard(message_id)
            replies.append(reply)
            if on_reply is not None:
                on_reply(reply)

    while pending and time.monotonic() < deadline:
        take(pulls.pull(pending))
        if enough is not None and enough(replies):
            ended_early = True  # enough replies, or a stop request: the rest did not miss a deadline
            break
        if pending and quorum is not None and not quorum_met and quorum():
            quorum_met = True
            if time.monotonic() + grace < deadline:
                deadline, cut_by_grace = time.monotonic() + grace, True
                log.info("quorum met: waiting at most %.0f s for the %d missing replies", grace, len(pending))
        if pending:
            time.sleep(POLL_SECONDS)
    if pending and not ended_early:
        take(pulls.finish(until=time.monotonic() + SLOW_PULL_SECONDS))  # replies held calls took already
    if pending and not ended_early:
        waited = f"{grace:.0f} s grace after quorum" if cut_by_grace else f"{timeout:.0f} s deadline"
        log.info("%d of %d replies missed the %s", len(pending), len(sent), waited)
    return sent, replies


class _Pulls:
    """``grid.pull_messages`` that does not hold a round past its deadline for a reply that never arrives.

    Flower's HTTP grid (deployment) takes the listed replies off the SuperLink and then downloads their
    objects one reply after the other, retrying for up to two hours (``PULL_MAX_TIME``) when a node's
    upload never completes (a SuperLink error mid-upload): that call then blocks, with every reply it
    took. So each call runs in a daemon thread and is waited for at most :data:`SLOW_PULL_SECONDS`. A
    call still running then is held: the replies it took count when its result comes in, and the next
    calls pull the other replies meanwhile. Those calls are told ``MESSAGE_UNAVAILABLE`` for the ids a
    held call took off the SuperLink; such an answer is not the node's reply: it is dropped until the
    holding call's result has been read, and the id is not asked for again meanwhile. When the round
    ends, held calls get up to :data:`SLOW_PULL_SECONDS` more (:meth:`finish`); replies a call took
    with a stuck one are lost with it. A fast call, the normal case and always the case in simulation,
    is waited for in full: replies arrive in the same order and rounds as with a direct call. At most
    :data:`MAX_HELD_PULLS` calls are held at once. A call that fails in the transport (a SuperLink's 500
    while its state database is locked, a dropped connection) is tried again after a backoff until the
    round's deadline, as if its replies had not come in yet (those it had taken off the SuperLink are lost
    with it); any other error ends the round.
    """

    def __init__(self, grid: Grid) -> None:
        self._grid = grid
        self._done: queue.Queue[tuple[threading.Thread, list[Message], BaseException | None]] = queue.Queue()
        self._held: dict[threading.Thread, frozenset[str]] = {}  # calls whose result has not been read yet
        self._taken_elsewhere: set[str] = set()  # ids answered MESSAGE_UNAVAILABLE while a held call has them
        self._failures = 0  # pulls failed in a row
        self._retry_at = 0.0  # no pull starts before this (monotonic seconds) after a failure

    def pull(self, pending: Iterable[str]) -> list[Message]:
        """The replies among ``pending`` that came in (one may come twice: keep the first)."""
        ids = frozenset(pending) - self._taken_elsewhere
        if ids and len(self._held) < MAX_HELD_PULLS and time.monotonic() >= self._retry_at:
            call = self._start(ids)
            call.join(SLOW_PULL_SECONDS)
            if call.is_alive():
                global _said_slow
                log.log(logging.INFO if _said_slow else logging.WARNING,
                        "pulling %d replies has taken more than %.0f s (a busy SuperLink, a large model on a slow "
                        "link, or a reply whose upload does not complete): asking again beside it", len(ids),
                        SLOW_PULL_SECONDS)
                _said_slow = True
                self._held[call] = ids
        return self._read()

    def finish(self, *, until: float) -> list[Message]:
        """Wait for the held calls until ``until`` (the replies they took are off the SuperLink); theirs."""
        for call in list(self._held):
            call.join(max(0.0, until - time.monotonic()))
        return self._read()

    def _read(self) -> list[Message]:
        results = []
        while True:
            try:
                results.append(self._done.get_nowait())
            except queue.Empty:
                break
        for source, _, error in results:
            self._held.pop(source, None)  # its result is in: it holds nothing any more
            if error is not None:
                self._failed(error)
            elif self._failures:
                log.info("pulling replies works again after %d failed tries", self._failures)
                self._failures = 0
        held = {mid for ids in self._held.values() for mid in ids}
        self._taken_elsewhere &= held
        pulled = [m for _, messages, _ in results for m in messages]
        unavailable = [m for m in pulled if _unavailable(m)]
        self._taken_elsewhere |= {m.metadata.reply_to_message_id for m in unavailable} & held
        # Real replies first: where a call's reply and another's MESSAGE_UNAVAILABLE for it come in together,
        # the reply is taken.
        return [m for m in pulled if not _unavailable(m)] + [
            m for m in unavailable if m.metadata.reply_to_message_id not in held
        ]

    def _failed(self, error: BaseException) -> None:
        """A failed pull: tried again after a backoff where the failure is the transport's or the SuperLink's
        (a 5xx); any other error (a refusal: 4xx, a bug) is raised in the round's thread. Replies the failed
        call had already taken off the SuperLink are lost with it, as with a stuck call."""
        if not _transient(error):
            raise error
        self._failures += 1
        wait = min(MAX_PULL_RETRY_SECONDS, PULL_RETRY_SECONDS * 2 ** (self._failures - 1))
        self._retry_at = time.monotonic() + wait
        log.log(logging.WARNING if self._failures == 1 else logging.DEBUG,
                "pulling replies failed (%s: %s): trying again in %.1f s, until the round's deadline",
                type(error).__name__, " ".join(str(error).split())[:200], wait)

    def _start(self, ids: frozenset[str]) -> threading.Thread:
        def call() -> None:
            try:
                self._done.put((thread, list(self._grid.pull_messages(sorted(ids))), None))
            except BaseException as error:  # raised again in the round's thread
                self._done.put((thread, [], error))

        thread = threading.Thread(target=call, name="fedrobust-pull", daemon=True)
        thread.start()
        return thread


_said_slow = False  # the slow pull's warning, once a process (a busy SuperLink says it every round)


def _transient(error: BaseException) -> bool:
    """Whether a pull failed in the transport or the SuperLink rather than in the code or by a refusal: a
    connection or timeout error, and of Flower's HTTP grid's httpx errors the transport's and a 5xx (a
    SuperLink's 500, e.g. its state database locked); not a 4xx, which asking again does not change."""
    if isinstance(error, ConnectionError | TimeoutError):
        return True
    try:
        import httpx
    except ImportError:  # a Flower without the HTTP grid
        return False
    if isinstance(error, httpx.HTTPStatusError):
        return error.response.status_code >= 500
    return isinstance(error, httpx.TransportError)


def _unavailable(message: Message) -> bool:
    """The SuperLink's answer for a message it no longer has (here: a reply another call took)."""
    return message.has_error() and message.error.code == ErrorCode.MESSAGE_UNAVAILABLE
