"""Pre-aggregators that drop rows: the direction filter (with its memory of each client) and duplicates.

Like every :class:`~fedrobust.aggregators.base.RowFilter`, each leaves out at most ``f`` rows and
never so many that fewer than ``2f + 1`` are left.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from fedrobust.aggregators._registry import register_pre
from fedrobust.aggregators.base import RowFilter, check_float
from fedrobust.aggregators.rows import Rows

__all__ = ["ClientEvidence", "DirectionFilter", "DuplicateFilter", "center_and_spread", "client_ids", "signed_ids"]

_INT64 = 1 << 64


def signed_ids(clients: Sequence[int]) -> Tensor:
    """Client ids (partition or node ids, up to ``2**64``) as signed 64-bit integers, for a state tensor."""
    return torch.tensor([(k + (1 << 63)) % _INT64 - (1 << 63) for k in clients], dtype=torch.int64)


def client_ids(state: Tensor) -> list[int]:
    """The client ids of :func:`signed_ids` back as non-negative integers."""
    return [k % _INT64 for k in state.tolist()]


def center_and_spread(scores: Tensor) -> tuple[Tensor, Tensor]:
    """The median score (the lower one of an even count) and the scaled MAD around it."""
    center = torch.sort(scores, stable=True).values[(scores.numel() - 1) // 2]
    return center, 1.4826 * (scores - center).abs().median()


class ClientEvidence:
    """Per client, the evidence of the rounds it took part in: a combined z-score and a relative score.

    For each round a client's row was scored, :meth:`add` takes its score's z-score within the round
    (its distance from the round's median score in scaled MADs) and its score relative to the median
    score. :meth:`combined` combines the z-scores by Stouffer's method (their sum over the square root
    of the number of rounds), which stays near ``N(0, 1)`` for a client that is as often above the median
    as below it, and moves away by the square root of the rounds for one that is always on one side.
    With ``decay < 1`` the evidence fades: each time a client is scored, its earlier sums are multiplied
    by ``decay`` first (a weighted Stouffer sum, over the square root of the summed squared weights), so
    a client that turns after a clean record (a sleeper) is judged by its last few replies.
    Keys are the clients' integer ids (partition or node ids); they are kept as signed 64-bit integers in
    the state, so node ids up to ``2**64`` round-trip.
    """

    def __init__(self, decay: float = 1.0) -> None:
        self.decay = decay
        self.z_sum: dict[int, float] = {}
        self.relative_sum: dict[int, float] = {}
        self.rounds: dict[int, int] = {}

    def add(self, clients: Sequence[int], z: Tensor, relative: Tensor) -> None:
        for client, zi, ri in zip(clients, z.tolist(), relative.tolist(), strict=True):
            self.z_sum[client] = self.decay * self.z_sum.get(client, 0.0) + zi
            self.relative_sum[client] = self.decay * self.relative_sum.get(client, 0.0) + ri
            self.rounds[client] = self.rounds.get(client, 0) + 1

    def _weight(self, rounds: int) -> float:
        """The square root of the summed squared weights of ``rounds`` scores: ``sqrt(rounds)`` without decay."""
        if self.decay == 1.0:
            return math.sqrt(rounds)
        return math.sqrt((1.0 - self.decay ** (2 * rounds)) / (1.0 - self.decay**2))

    def combined(self, clients: Sequence[int]) -> Tensor:
        """``[m]`` float64: each client's combined z-score (0 for a client not seen yet)."""
        return torch.tensor(
            [self.z_sum.get(c, 0.0) / self._weight(self.rounds.get(c, 1)) for c in clients], dtype=torch.float64
        )

    def relative(self, clients: Sequence[int]) -> Tensor:
        """``[m]`` float64: each client's summed score relative to its rounds' median scores."""
        return torch.tensor([self.relative_sum.get(c, 0.0) for c in clients], dtype=torch.float64)

    def state_dict(self) -> dict[str, Tensor]:
        keys = sorted(self.rounds)
        return {
            "clients": signed_ids(keys),
            "z_sum": torch.tensor([self.z_sum[k] for k in keys], dtype=torch.float64),
            "relative_sum": torch.tensor([self.relative_sum[k] for k in keys], dtype=torch.float64),
            "rounds": torch.tensor([self.rounds[k] for k in keys], dtype=torch.int64),
        }

    def load_state_dict(self, state: Mapping[str, Tensor], owner: str) -> None:
        names = ("clients", "z_sum", "relative_sum", "rounds")
        if set(state) != set(names):
            raise ValueError(f"{owner}: memory state needs the keys {list(names)}, got {sorted(state)}")
        lengths = {state[name].numel() for name in names}
        if len(lengths) != 1:
            raise ValueError(f"{owner}: memory state tensors differ in length: {sorted(lengths)}")
        keys = client_ids(state["clients"])
        self.z_sum = dict(zip(keys, state["z_sum"].tolist(), strict=True))
        self.relative_sum = dict(zip(keys, state["relative_sum"].tolist(), strict=True))
        self.rounds = dict(zip(keys, state["rounds"].tolist(), strict=True))


@register_pre
class DirectionFilter(RowFilter):
    """Drop rows that push against the others, in this round or over the rounds a client took part in.

    A row's score is its inner product with a robust mean of the other rows, divided by its own norm
    (the cosine with that mean, times the mean's norm): per other row, the inner product with this
    row; of those ``m - 1`` values, the ``f`` largest and ``f`` smallest are trimmed and the rest
    averaged. The mean of many rows carries the direction the model learns in with little of each
    client's noise, so an honest row scores above zero even on non-IID data, while a row that reverses
    an update (sign flip), pushes against the mean (IPM, Fang's attacks) or only adds noise scores
    at or below zero.

    **This round.** A row is dropped when its score is at most ``-margin`` times the median score
    **and** lies more than ``z`` scaled median absolute deviations below the median score: late in
    training honest rows also score near zero, and a plain sign test would drop them. A reversed
    honest row scores about minus the median; an honest client whose data the others lack can score
    a little below zero, most of all when copies of another client pull the mean away from it (mimic),
    and ``margin`` keeps it.

    **Memory** (when the pipeline is given the clients of the rows, as
    :class:`~fedrobust.strategies.RobustStrategy` does). Late in training a reversed update scores near
    zero like the honest ones and passes the round's test; but the same client scored below the others
    in the earlier rounds too. So the filter keeps, per client, the z-scores of its rounds (the score's
    distance from the round's median in scaled MADs) and its scores relative to each round's median.
    A client is a suspect when its combined z-score (Stouffer's: the sum over the square root of its
    rounds) is below ``-z`` **and** its relative scores sum to at most zero: over its rounds, it pushed
    against the others more than it pulled with them. A client of non-IID data that is often below the
    median but still pulls the same way is not a suspect. Suspects are dropped first (lowest combined
    z-score first), then the round's outliers (lowest score first).

    **The previous aggregate** (``previous=True``, the default). Copies of one client sent this round (mimic, spread
    by noise) pull the mean of the others towards them, and an honest client with other data can then
    look like an outlier. They cannot move the aggregate of the round before. With ``previous``, a row
    is dropped in its round only if it is also an outlier by its score against the pipeline's previous
    output (the same test, on the inner product with that output over the row's norm); the memory's
    test is unchanged. The previous output is state (in the checkpoint: one model-sized vector).

    At most ``f`` rows are dropped and at least ``2f + 1`` kept. The scores come from the Gram matrix of
    the rows, one pass over the data; a stage after it that reads the same rows (NNM or a distance rule,
    with no winsorizing between) reuses that matrix. Needs ``n >= 2f + 1``; with ``f = 0`` the rows
    pass unchanged.

    Parameters
    ----------
    f : int
        Most rows dropped, and the trimming of each row's inner products.
    z : float, default 3.0
        How many scaled median absolute deviations (``1.4826 * MAD``, the standard deviation for
        normal scores) below the median score a row must lie to be dropped; the same bound on a
        client's combined z-score.
    margin : float, default 0.0
        How far below zero, in median scores, a row's score must lie to be dropped in its round (the
        memory's test is unchanged).
    memory : bool, default True
        Keep each client's evidence over the rounds (and in the checkpoint). Without the rows' clients
        (``Aggregator(updates)`` with no ``clients``) each call stands alone either way.
    decay : float, default 1.0
        In ``(0, 1]``: how much of a client's earlier evidence is kept each time it is scored again
        (1: all of it, every round counts alike).
    previous : bool, default True
        Drop a row in its round only if its score against the previous aggregate is an outlier too
        (chosen on validation data with the default pipeline, docs/results.md).
    """

    name = "direction"
    needs_norms = True
    uses_clients = True

    def __init__(
        self,
        f: int = 0,
        *,
        z: float = 3.0,
        margin: float = 0.0,
        memory: bool = True,
        decay: float = 1.0,
        previous: bool = True,
    ) -> None:
        super().__init__(f)
        self.z = check_float(self.name, "z", z, minimum=0.0, inclusive=True)
        self.margin = check_float(self.name, "margin", margin, minimum=0.0, inclusive=True)
        decay = check_float(self.name, "decay", decay, minimum=0.0, inclusive=False, maximum=1.0)
        for name, value in (("memory", memory), ("previous", previous)):
            if not isinstance(value, bool):
                raise ValueError(f"{self.name}: parameter {name} must be true or false, got {value!r}")
        self.memory = memory
        self.previous = previous
        self.last_aggregate: Tensor | None = None  # the pipeline's previous output, with previous=True
        self.evidence = ClientEvidence(decay)
        self.clients: list[int] | None = None

    def observe(self, aggregate: Tensor) -> None:
        if self.previous:
            self.last_aggregate = aggregate.detach().clone()

    def scores_against_last(self, rows: Rows) -> Tensor | None:
        """``[m]`` float64: each row's inner product with the previous aggregate, over its norm (or ``None``)."""
        last = self.last_aggregate
        if last is None or last.shape[0] != rows.basis.d:
            return None
        last = last.to(device=rows.device, dtype=torch.float64)
        inner = torch.zeros(rows.m, dtype=torch.float64, device=rows.device)
        for start, stop, chunk in rows.chunks(torch.float64, reuse=True):
            # A sum per row, not chunk @ last: a matrix-vector product's bytes change with the thread count.
            inner += (chunk * last[start:stop]).sum(dim=1)
        return inner / rows.sq_norms().sqrt().clamp(min=torch.finfo(torch.float64).tiny)

    def _outlying(self, scores: Tensor) -> Tensor:
        """Rows whose score is at most ``-margin`` median scores and more than ``z`` scaled MADs below it."""
        center, spread = center_and_spread(scores)
        return (scores <= -self.margin * center.clamp(min=0)) & (scores < center - self.z * spread)

    def set_clients(self, clients: Sequence[int] | None) -> None:
        self.clients = None if clients is None else list(clients)

    def scores(self, rows: Rows) -> Tensor:
        """``[m]`` float64: each row's inner product with the trimmed mean of the others, over its norm."""
        m = rows.m
        norms = rows.sq_norms()
        inner = 0.5 * (norms[:, None] + norms[None, :] - rows.sq_distances())
        others = inner[~torch.eye(m, dtype=torch.bool, device=inner.device)].view(m, m - 1)
        trim = min(self.f, (m - 2) // 2)
        kept = torch.sort(others, dim=1).values[:, trim : m - 1 - trim]
        return kept.mean(dim=1) / norms.sqrt().clamp(min=torch.finfo(torch.float64).tiny)

    def choose(self, rows: Rows, budget: int) -> Tensor:
        clients = self.clients if self.memory else None
        # With 2f + 1 rows left it may drop none, but the memory still needs the round's scores.
        if self.f == 0 or (budget <= 0 and clients is None):
            return torch.empty(0, dtype=torch.int64)
        scores = self.scores(rows).cpu()
        ranked = torch.sort(scores, stable=True)
        center, spread = center_and_spread(scores)
        outlying = self._outlying(scores)
        against_last = self.scores_against_last(rows) if self.previous else None
        if against_last is not None:
            outlying &= self._outlying(against_last.cpu())
        this_round = ranked.indices[outlying[ranked.indices]]
        if clients is None:
            return this_round[:budget].to(rows.device)
        if len(clients) != rows.m:
            raise ValueError(f"{self.name}: {len(clients)} clients given for {rows.m} rows")
        # A round whose scores do not spread (or whose median row pulls nowhere) adds no evidence. The
        # relative score is capped at one median score either way: late in training the median is near
        # zero, and an uncapped ratio would let one round outweigh all the others.
        z = (scores - center) / spread if spread > 0 else torch.zeros_like(scores)
        relative = (scores / center).clamp(-1.0, 1.0) if center > 0 else torch.zeros_like(scores)
        self.evidence.add(clients, z, relative)
        combined = self.evidence.combined(clients)
        suspect = (combined < -self.z) & (self.evidence.relative(clients) <= 0)
        by_evidence = torch.sort(combined, stable=True).indices
        suspects = by_evidence[suspect[by_evidence]]
        rest = this_round[~torch.isin(this_round, suspects)]
        return torch.cat([suspects, rest])[: max(budget, 0)].to(rows.device)

    def state_dict(self) -> dict[str, Tensor]:
        state = {}
        if self.memory:
            state = {f"memory.{key}": value for key, value in self.evidence.state_dict().items()}
        if self.previous and self.last_aggregate is not None:
            state["last_aggregate"] = self.last_aggregate.cpu()
        return state

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        valid = [f"memory.{k}" for k in ("clients", "z_sum", "relative_sum", "rounds")] if self.memory else []
        valid += ["last_aggregate"] if self.previous else []
        unknown = [key for key in state if key not in valid]
        if unknown:
            raise ValueError(
                f"{self.name}: unknown state keys {sorted(unknown)}; valid keys: {', '.join(valid) or 'none'}"
            )
        memory = {k.removeprefix("memory."): v for k, v in state.items() if k.startswith("memory.")}
        if memory:
            self.evidence.load_state_dict(memory, self.name)
        self.last_aggregate = state.get("last_aggregate")


@register_pre
class DuplicateFilter(RowFilter):
    """Count a group of (near) copies once: sybils that send the same update, with or without noise.

    Attackers who copy one update (mimic copies an honest client's; ALIE, IPM and min-max send one
    crafted update ``f`` times) give it ``f + 1`` times the weight of a client in every rule after them;
    on non-IID data one client's data then pulls the model its way. Adding a little noise to each copy
    hides it from an exact test, so the test is relative: the filter repeatedly drops the row whose
    nearest remaining neighbour is closest, while that distance is at most ``tol`` times the typical
    nearest-neighbour distance (the median over the input rows). Of the pair at that distance, the row
    whose second-nearest neighbour is farther goes: a copy around the row it copies, not the row itself
    (exact ties: the later row). At most ``f`` rows are dropped and at least ``2f + 1`` kept, like the
    other filters, so on honest rows it thins the densest places only, where a dropped row has a close
    neighbour that stays. An attacker who spreads the copies as far apart as honest clients are is not
    caught; the copies then carry as much noise as signal. Needs ``n >= 2f + 1``.

    With ``lower_f`` the stages after the filter tolerate one Byzantine row fewer for each row it dropped.
    A dropped row is a copy of a row that stays: either it was Byzantine, or the row that stays is a
    Byzantine copy of an honest update and now stands for that update (within ``tol``). Either way one
    Byzantine row fewer is left to outvote, so a trimmed mean after it trims fewer honest values. This
    assumes that no two honest clients send the same update, which holds for clients with data of their
    own; where clients may share data and seeds, leave it off.

    Parameters
    ----------
    f : int
        Most rows dropped.
    tol : float, default 0.01
        The largest nearest-neighbour distance at which a row counts as a copy, as a fraction of the
        median nearest-neighbour distance of the input rows (at most 1).
    lower_f : bool, default False
        Lower the ``f`` of the stages after the filter by the number of rows dropped.
    """

    name = "dedup"

    def __init__(self, f: int = 0, *, tol: float = 0.01, lower_f: bool = False) -> None:
        super().__init__(f)
        self.tol = check_float(self.name, "tol", tol, minimum=0.0, inclusive=True, maximum=1.0)
        if not isinstance(lower_f, bool):
            raise ValueError(f"{self.name}: parameter lower_f must be true or false, got {lower_f!r}")
        self.lower_f = lower_f

    def byzantine_dropped(self) -> int:
        return self.last_dropped if self.lower_f else 0

    def choose(self, rows: Rows, budget: int) -> Tensor:
        if budget <= 0:
            return torch.empty(0, dtype=torch.int64)
        dist = rows.sq_distances().cpu().to(torch.float64).clone()
        dist.fill_diagonal_(math.inf)
        bound = self.tol**2 * float(dist.min(dim=1).values.median())
        alive = torch.arange(rows.m)
        dropped: list[int] = []
        while len(dropped) < budget:
            # budget <= m - (2f + 1) leaves at least 3 rows alive, so every row has a second neighbour.
            two = dist[alive][:, alive].topk(2, dim=1, largest=False).values
            closest = two[:, 0].min()
            if closest > bound:
                break
            second = torch.where(two[:, 0] == closest, two[:, 1], -math.inf)
            pick = int(torch.nonzero(second == second.max()).flatten()[-1])
            dropped.append(int(alive[pick]))
            alive = torch.cat([alive[:pick], alive[pick + 1 :]])
        return torch.tensor(sorted(dropped), dtype=torch.int64, device=rows.device)
