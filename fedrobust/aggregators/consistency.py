"""A filter that remembers each client's direction and drops a client that turns against it (a sleeper)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from fedrobust.aggregators._registry import register_pre
from fedrobust.aggregators.base import RowFilter, check_float, check_int
from fedrobust.aggregators.filters import center_and_spread, client_ids, signed_ids
from fedrobust.aggregators.rows import Rows

__all__ = ["ConsistencyFilter"]

# Coordinates are sampled with a fixed seed, so a resumed run samples the same ones.
_SAMPLE_SEED = 0


@register_pre
class ConsistencyFilter(RowFilter):
    """Drop rows whose client turned against its own past replies.

    A client trains on the same data every round, so its updates point much the same way from one
    round to the next, on non-IID data most of all (the cosine of an honest update with the client's
    earlier ones stays near 0.3-0.8 through training). An attacker that sends honest updates until
    some round and then reverses them (a sleeper) builds a clean record with every filter that judges
    a client against the others, and its reversed updates late in training look no worse than honest
    ones there. Against its own past it turns at once: its cosine drops to about -0.7.

    Per client, the filter keeps a running direction: the mean of the unit vectors of the client's
    accepted replies, each earlier one weighed down by ``decay`` per round (on ``coordinates`` sampled
    coordinates, so the state stays small for large models). A row is dropped when its cosine with
    its client's direction is at most zero **and** more than ``z`` scaled median absolute deviations
    below the round's median cosine. A dropped row does not enter the direction, so a client that
    turned stays turned (the same test fails every round after), while an honest client dropped once
    is judged by its accepted past again next round. Like FLDetector (Zhang et al., KDD 2022), which
    tests each update against one predicted from the client's history, but with a plain running mean.

    Needs the rows' clients (``RobustStrategy`` gives them); without them each call drops nothing. At
    most ``f`` rows are dropped and at least ``2f + 1`` kept, lowest cosine first.

    An attacker that turns by small steps, a little each round, stays close to a direction that
    follows it. So each client has a second, slower direction too (``slow_decay``), which remembers
    where it started: the turn is caught once it passes a right angle from there. A row is dropped
    when it fails the test against either direction. One slow direction alone would not do: an
    attacker that copies another honest client each round (mimic) averages many clients' directions
    there, and only the fast one, which follows its last copy, sees the next copy turn.

    Parameters
    ----------
    f : int
        Most rows dropped.
    z : float, default 3.0
        How many scaled median absolute deviations below the round's median cosine a dropped row lies.
    decay : float, default 0.7
        In ``[0, 1)``: how much of a client's earlier direction is kept each round it is accepted
        (0: only its last accepted reply).
    coordinates : int, default 8192
        How many coordinates (sampled once, with a fixed seed) the directions are kept on; all of them
        for a smaller model. State: this many float32 values per client.
    slow_decay : float or None, default 0.97
        In ``(decay, 1)``: the decay of each client's second, slower direction (chosen on validation
        data, docs/results/default_choice.md). ``None``: the fast direction alone. State: as many float32
        values again per client.
    slow_anchor : bool, default True
        Start a client's slow direction at its first accepted reply with full weight, as if the client
        had sent it in every round before, so that it fades from there at ``slow_decay`` a round (an
        anchor with a half-life of about 23 rounds at 0.97). ``False``: the first reply weighs what any
        later one does, and the slow direction is a running mean that trails a steady turn by half its
        angle, so a turn spread over the whole run never passes a right angle from it.
    """

    name = "consistency"
    uses_clients = True

    def __init__(
        self,
        f: int = 0,
        *,
        z: float = 3.0,
        decay: float = 0.7,
        coordinates: int = 8192,
        slow_decay: float | None = 0.97,
        slow_anchor: bool = True,
    ) -> None:
        super().__init__(f)
        self.z = check_float(self.name, "z", z, minimum=0.0, inclusive=True)
        self.decay = check_float(self.name, "decay", decay, minimum=0.0, inclusive=True, maximum=1.0)
        if self.decay == 1.0:
            raise ValueError(f"{self.name}: parameter decay must be < 1, got {decay!r}")
        self.coordinates = check_int(self.name, "coordinates", coordinates, minimum=1)
        if slow_decay is not None:
            ok = isinstance(slow_decay, (int, float)) and not isinstance(slow_decay, bool)
            if not (ok and self.decay < slow_decay < 1.0):
                raise ValueError(
                    f"{self.name}: parameter slow_decay must be null (one direction) or a number between decay "
                    f"({self.decay}) and 1, both excluded, got {slow_decay!r}"
                )
            slow_decay = float(slow_decay)
        self.slow_decay = slow_decay
        if not isinstance(slow_anchor, bool):
            raise ValueError(f"{self.name}: parameter slow_anchor must be true or false, got {slow_anchor!r}")
        self.slow_anchor = slow_anchor
        self.directions: dict[int, Tensor] = {}
        self.slow_directions: dict[int, Tensor] = {}
        self.clients: list[int] | None = None
        self._sample: tuple[int, Tensor] | None = None

    def set_clients(self, clients: Sequence[int] | None) -> None:
        self.clients = None if clients is None else list(clients)

    def sample(self, d: int) -> Tensor:
        """The sampled coordinates of a ``d``-coordinate model (int64, ascending; computed once per ``d``)."""
        if self._sample is None or self._sample[0] != d:
            if d <= self.coordinates:
                index = torch.arange(d)
            else:
                generator = torch.Generator().manual_seed(_SAMPLE_SEED)
                index = torch.randperm(d, generator=generator)[: self.coordinates].sort().values
            self._sample = (d, index)
        return self._sample[1]

    def choose(self, rows: Rows, budget: int) -> Tensor:
        clients = self.clients
        if self.f == 0 or clients is None:
            return torch.empty(0, dtype=torch.int64)
        if len(clients) != rows.m:
            raise ValueError(f"{self.name}: {len(clients)} clients given for {rows.m} rows")
        sample = self.sample(rows.d)
        width = next((t.numel() for t in self.directions.values()), sample.numel())
        if width != sample.numel():
            raise ValueError(
                f"{self.name}: the clients' directions have {width} coordinates, but coordinates={self.coordinates} "
                f"samples {sample.numel()} of this model's {rows.d}: resume with the state's coordinates"
            )
        units = rows.columns(sample.to(rows.device)).cpu().to(torch.float64)
        units = units / units.norm(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float64).tiny)
        cosines, turned = self._turned(self.directions, clients, units)
        if self.slow_decay is not None:
            slow_cosines, slow_turned = self._turned(self.slow_directions, clients, units)
            cosines = torch.fmin(cosines, slow_cosines)
            turned |= slow_turned
        self._follow(self.directions, self.decay, clients, units, turned)
        if self.slow_decay is not None:
            self._follow(self.slow_directions, self.slow_decay, clients, units, turned, start_whole=self.slow_anchor)
        flagged = torch.nonzero(turned).flatten()
        order = torch.sort(cosines[flagged], stable=True).indices
        return flagged[order][: max(budget, 0)].to(rows.device)

    def _turned(self, directions: dict[int, Tensor], clients: Sequence[int], units: Tensor) -> tuple[Tensor, Tensor]:
        """Each row's cosine with its client's direction (NaN for a new client), and which rows turned."""
        known = [i for i, c in enumerate(clients) if c in directions]
        cosines = torch.full((len(clients),), float("nan"), dtype=torch.float64)
        for i in known:
            past = directions[clients[i]].to(torch.float64)
            cosines[i] = (units[i] * past).sum() / past.norm().clamp(min=torch.finfo(torch.float64).tiny)
        turned = torch.zeros(len(clients), dtype=torch.bool)
        if len(known) >= 3:
            scores = cosines[known]
            center, spread = center_and_spread(scores)
            turned[known] = (scores <= 0) & (scores < center - self.z * spread)
        return cosines, turned

    @staticmethod
    def _follow(
        directions: dict[int, Tensor],
        decay: float,
        clients: Sequence[int],
        units: Tensor,
        turned: Tensor,
        *,
        start_whole: bool = False,
    ) -> None:
        """Move each accepted client's direction towards its reply; a turned row leaves it as it was.

        With ``start_whole`` a client's first accepted reply starts its direction with full weight, as
        if the client had sent it in every round before; it then fades by ``decay`` a round like any
        other. (Without it the first reply has the weight of any later one, ``1 - decay``.)
        """
        for i, client in enumerate(clients):
            if not turned[i]:
                earlier = directions.get(client)
                if earlier is None:
                    fresh = units[i] if start_whole else (1.0 - decay) * units[i]
                else:
                    fresh = (1.0 - decay) * units[i] + decay * earlier.to(torch.float64)
                directions[client] = fresh.to(torch.float32)

    def _keys(self) -> list[str]:
        return ["clients", "directions"] + (["slow_directions"] if self.slow_decay is not None else [])

    def state_dict(self) -> dict[str, Tensor]:
        keys = sorted(self.directions)
        if not keys:
            return {}
        state = {"clients": signed_ids(keys), "directions": torch.stack([self.directions[k] for k in keys])}
        if self.slow_decay is not None:
            state["slow_directions"] = torch.stack([self.slow_directions[k] for k in keys])
        return state

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        if not state:
            self.directions, self.slow_directions = {}, {}
            return
        if set(state) != set(self._keys()):
            saved_with = "slow_decay set" if "slow_directions" in state else "slow_decay=null"
            raise ValueError(
                f"{self.name}: state needs the keys {self._keys()}, got {sorted(state)} (a state saved with "
                f"{saved_with} resumes with the same)"
            )
        clients = client_ids(state["clients"])
        for key in self._keys()[1:]:
            directions = state[key]
            if directions.dim() != 2 or directions.shape[0] != len(clients):
                raise ValueError(
                    f"{self.name}: state has {len(clients)} clients and {key} of shape {list(directions.shape)}"
                )
        self.directions = dict(zip(clients, state["directions"].to(torch.float32), strict=True))
        if self.slow_decay is not None:
            self.slow_directions = dict(zip(clients, state["slow_directions"].to(torch.float32), strict=True))
