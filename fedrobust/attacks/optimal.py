"""ALIE and IPM with their scale tuned against the aggregation rule in use (ByzFL's Optimal_ALIE / Optimal_IPM).

An omniscient adversary who also knows the server's rule can pick the scale (ALIE's ``z``, IPM's
``epsilon``) that moves the rule's output farthest from the honest mean, instead of a fixed formula.
The objective ``||rule([honest; byzantine]) - mean(honest)||`` is evaluated on a grid of scales in
``[0, max_scale]`` plus the attack's default scale, then refined by golden-section search on the grid
cell on each side of the best grid point. The best scale seen is used, so the result moves the rule's
output at least as far as the default scale and every grid point. ByzFL searches with an expanding,
then contracting line search from 0; a fixed grid plus golden section gives the same kind of answer
with a bounded, predictable number of aggregations (``grid + 1 + refine``).

The rule may be a pipeline (``winsorize+nnm+trimmed_mean``): the search then runs its pre-aggregators
too, as the server does. By default each evaluation builds the rule afresh with
:func:`fedrobust.aggregators.build`, so a stateful rule (the filters' memory of each client, centered
clipping's center, DnC's generator) starts from its initial state every time. With ``memory=True`` the
attacker keeps a copy of the server's pipeline that it feeds every round's rows, and searches against the
rule as the server will run it, memory included (:meth:`_Optimal.craft_round`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from fedrobust import aggregators
from fedrobust.attacks.base import Attack, _fail, check_int, check_real, missing_server_update, server_update_of
from fedrobust.attacks.omniscient import _centre, _check_input, _repeat, alie_z

__all__ = ["OptimalALIE", "OptimalFang", "OptimalIPM", "OptimalMix", "OptimalSearch", "maximize_scale"]

logger = logging.getLogger(__name__)

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def maximize_scale(objective: Callable[[float], float], *, default: float, max_scale: float, grid: int,
                   refine: int) -> tuple[float, float]:
    """Best-effort maximizer of ``objective`` on ``[0, max_scale]``: ``(scale, value)``.

    ``grid`` evenly spaced points from 0 to ``max_scale`` and ``default`` are evaluated; then ``refine``
    golden-section steps search the two grid cells around the best of them. Ties keep the smaller scale.
    """
    seen: dict[float, float] = {}

    def value(scale: float) -> float:
        if scale not in seen:
            seen[scale] = objective(scale)
        return seen[scale]

    points = [max_scale * i / (grid - 1) for i in range(grid)] if grid > 1 else [0.0]
    for scale in sorted({*points, default}):
        value(scale)
    best = max(sorted(seen), key=lambda s: seen[s])  # max() keeps the first (smallest) on ties
    step = max_scale / (grid - 1) if grid > 1 else max_scale
    lo, hi = max(0.0, best - step), min(max(max_scale, default), best + step)
    a, b = hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo)
    for _ in range(refine):
        if value(a) >= value(b):
            hi, b = b, a
            a = hi - _GOLDEN * (hi - lo)
        else:
            lo, a = a, b
            b = lo + _GOLDEN * (hi - lo)
    best = max(sorted(seen), key=lambda s: seen[s])
    return best, seen[best]


def _check_rule(attack: str, rule: Any, rule_f: Any, rule_params: Any, rule_pre_params: Any) -> bool:
    """Validate the rule the attack is tuned against by building it once; whether it needs the server update."""
    pre, name = aggregators.split_pipeline(rule) if isinstance(rule, str) else ([], None)
    users = isinstance(name, str) and any(sep in name for sep in ".:")  # a rule of the user's, by dotted path
    if (name not in aggregators.names() and not users) or any(stage not in aggregators.pre_names() for stage in pre):
        raise ValueError(
            f"attack {attack!r}: parameter 'rule' must be one of {', '.join(aggregators.names())}, or a "
            f"pipeline of pre-aggregators ({', '.join(aggregators.pre_names())}) and a rule joined with "
            f"'+', the rule possibly one of your own by its dotted path, got {rule!r}"
        )
    if rule_f is not None:
        check_int(attack, "rule_f", rule_f, low=0)
    if not isinstance(rule_params, Mapping):
        raise ValueError(f"attack {attack!r}: parameter 'rule_params' must be a mapping, got {rule_params!r}")
    if not isinstance(rule_pre_params, Mapping) or any(
        stage not in pre or not isinstance(params, Mapping) for stage, params in rule_pre_params.items()
    ):
        raise ValueError(
            f"attack {attack!r}: parameter 'rule_pre_params' must be a mapping of stages of {rule!r} "
            f"({', '.join(pre) or 'none'}) to their parameters, got {rule_pre_params!r}"
        )
    f = 0 if rule_f is None else rule_f
    try:
        built = _build(rule, f, rule_params, {})
    except ValueError as err:
        if users and not rule_params:  # nothing but the rule itself to blame: its import or contract
            raise ValueError(
                f"attack {attack!r}: parameter 'rule' must be a rule that builds, got {rule!r}: {err}"
            ) from err
        raise ValueError(
            f"attack {attack!r}: parameter 'rule_params' must be valid parameters of rule {rule!r} ({err}), "
            f"got {dict(rule_params)!r}"
        ) from err
    try:
        _build(rule, f, rule_params, rule_pre_params)
    except ValueError as err:
        raise ValueError(
            f"attack {attack!r}: parameter 'rule_pre_params' must be valid parameters of the stages of {rule!r} "
            f"({err}), got {dict(rule_pre_params)!r}"
        ) from err
    return built.needs_server_update


def _cloned(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A copy of a pipeline state that later calls of the pipeline cannot change."""
    return {key: value.clone() for key, value in state.items()}


def _build(
    rule: str, f: int, rule_params: Mapping[str, Any], rule_pre_params: Mapping[str, Mapping[str, Any]]
) -> aggregators.Aggregator:
    """The pipeline ``rule`` with ``f``, its rule's parameters and each pre-aggregator's."""
    if not rule_pre_params:
        return aggregators.build(rule, f=f, **rule_params)
    pre, name = aggregators.split_pipeline(rule)
    return aggregators.build(name, f=f, pre=[{"name": p, **rule_pre_params.get(p, {})} for p in pre], **rule_params)


@dataclass(frozen=True)
class _Optimal(Attack):
    """Common part: the rule to attack, and the search over a scale along one line (or several)."""

    omniscient: ClassVar[bool] = True
    rule: str = "consistency+direction+dedup+winsorize+nnm+trimmed_mean"  # the server's default
    rule_f: int | None = None
    rule_params: dict[str, Any] = field(default_factory=dict)
    rule_pre_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    max_scale: float = 10.0
    grid: int = 11
    refine: int = 8
    memory: bool = False
    # With ``memory``: the server's pipeline state as the attacker follows it ("state"; one for every f,
    # as the server shares its state between the f it runs with), and a pipeline per f to run it on.
    _memory: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        needs = _check_rule(self.name, self.rule, self.rule_f, self.rule_params, self.rule_pre_params)
        # Per instance, not per class: tuned to FLTrust, the search runs FLTrust, which needs the server's
        # update of the round (craft_round's server_update); tuned to another rule, it needs none.
        object.__setattr__(self, "needs_server_update", needs)
        object.__setattr__(self, "max_scale", check_real(self.name, "max_scale", self.max_scale, low=0.0))
        check_int(self.name, "grid", self.grid, low=2)
        check_int(self.name, "refine", self.refine, low=0)
        if not isinstance(self.memory, bool):
            raise _fail(self.name, "memory", "true or false", self.memory)

    def _line(self, honest: Tensor) -> tuple[Tensor, Tensor]:
        """``(base, direction)``: the Byzantine row at scale ``t`` is ``base + t * direction``."""
        raise NotImplementedError

    def _default(self, honest: Tensor, f: int) -> float:
        """The attack's own default scale."""
        raise NotImplementedError

    def _rule(self, f: int) -> aggregators.Aggregator:
        """The rule attacked, built afresh with ``f``."""
        return _build(self.rule, f, self.rule_params, self.rule_pre_params)

    def _rule_f(self, h: int, f: int) -> int:
        """The rule's f for ``h`` honest and ``f`` Byzantine rows, once the rule is known to take them."""
        rule_f = f if self.rule_f is None else self.rule_f
        needed = self._rule(rule_f).min_n()
        if h + f < needed:
            raise ValueError(
                f"attack {self.name!r}: rule {self.rule!r} with f={rule_f} needs n >= {needed} rows, "
                f"got h={h} honest + f={f} Byzantine"
            )
        return rule_f

    def _lines(self, honest: Tensor, f: int) -> list[tuple[Tensor, Tensor, float]]:
        """``(base, direction, default scale)`` of each line searched; most attacks search one."""
        base, direction = self._line(honest)
        return [(base, direction, self._default(honest, f))]

    def _on_line(
        self, honest: Tensor, f: int, aggregate: Callable[[Tensor], Tensor], line: tuple[Tensor, Tensor, float]
    ) -> tuple[float, Tensor]:
        """``(how far the rule moves, the row)`` at the best scale along one line."""
        base, direction, default = line
        target = honest.mean(dim=0)

        def objective(scale: float) -> float:
            out = aggregate(_repeat(base + scale * direction, f))
            return float(torch.linalg.vector_norm((out - target).double()))

        scale, value = maximize_scale(
            objective, default=default, max_scale=self.max_scale, grid=self.grid, refine=self.refine
        )
        logger.debug("%s against %s: scale=%.6g moves it by %.6g", self.name, self.rule, scale, value)
        return value, base + scale * direction

    def _search(
        self, honest: Tensor, f: int, aggregate: Callable[[Tensor], Tensor], generator: torch.Generator
    ) -> Tensor:
        """The ``f`` rows on the attack's lines whose ``aggregate(rows)`` lands farthest from the honest mean."""
        best: tuple[float, Tensor] | None = None
        for line in self._lines(honest, f):
            value, row = self._on_line(honest, f, aggregate, line)
            if best is None or value > best[0]:  # ties keep the first line
                best = (value, row)
        assert best is not None
        return _repeat(best[1], f)

    def craft(self, honest: Tensor, *, f: int, generator: torch.Generator) -> Tensor:
        if self.needs_server_update:
            raise missing_server_update(self.name)
        return self._craft_fresh(honest, f, generator, None)

    def _craft_fresh(
        self, honest: Tensor, f: int, generator: torch.Generator, server_update: Tensor | None
    ) -> Tensor:
        """The search against the rule built afresh for every candidate, given ``server_update`` if it needs one."""
        _check_input(self.name, honest, f, min_h=2)
        h, d = honest.shape
        if f == 0:
            return honest.new_empty((0, d))
        rule_f = self._rule_f(h, f)

        def fresh(byzantine: Tensor) -> Tensor:
            rule = self._rule(rule_f)
            if server_update is not None:
                rule.set_server_update(server_update)
            return rule(torch.cat([honest, byzantine]))

        return self._search(honest, f, fresh, generator)

    def craft_round(
        self,
        rows: Tensor,
        byzantine: Tensor,
        clients: Sequence[int],
        *,
        generator: torch.Generator,
        server_update: Tensor | None = None,
        global_model: Tensor | None = None,
    ) -> Tensor:
        """With ``memory``: search against the rule as the server runs it this round, its memory included.

        The attacker sees every row of every round and knows the server's code and configuration, so it
        follows the server's pipeline state: it runs the pipeline on the rows the server aggregates, in the
        server's order and with its client ids, so its state (the filters' memory of each client, DnC's
        generator) stays the server's. Each candidate is tried on the pipeline loaded with that state. As
        the server does, one state serves every ``f`` (a round with fewer Byzantine rows runs the pipeline
        built for that ``f`` on the same state). It assumes the server aggregates every round with the rows
        it is given (no crafted row dropped by validation, the same ``f``) and unit weights.

        A rule that needs the server's update of the round (FLTrust) is given ``server_update`` before
        every candidate is tried, as the server gives it before it aggregates.
        """
        g0 = None
        if self.needs_server_update:
            g0 = server_update_of(self.name, server_update, rows.shape[-1]).to(rows.device)
        if not self.memory:
            return self._craft_fresh(rows[~byzantine], int(byzantine.sum()), generator, g0)
        honest = rows[~byzantine]
        f = int(byzantine.sum())
        _check_input(self.name, honest, f, min_h=2)
        rule_f = self._rule_f(honest.shape[0], f)
        pipelines = self._memory.setdefault("pipelines", {})
        if rule_f not in pipelines:
            pipelines[rule_f] = self._rule(rule_f)
        pipeline = pipelines[rule_f]
        state = self._memory.get("state")
        if state is None:
            state = _cloned(pipeline.state_dict())  # a fresh pipeline's: the server's before round 1
        index = byzantine.nonzero().flatten()
        ids = list(clients)

        def with_memory(candidate: Tensor) -> Tensor:
            pipeline.load_state_dict(_cloned(state))
            if g0 is not None:
                pipeline.set_server_update(g0)
            placed = rows.clone()
            placed[index] = candidate.to(rows.dtype)
            return pipeline(placed, clients=ids)

        crafted = self._search(honest, f, with_memory, generator)
        # The server's memory moves on with the rows it is about to aggregate; what it aggregates is the
        # history an attack that learns from it (``rop``) starts the next round from.
        self._memory["aggregate"] = with_memory(crafted).detach().clone()
        self._memory["state"] = _cloned(pipeline.state_dict())
        return crafted


@dataclass(frozen=True)
class OptimalALIE(_Optimal):
    """ALIE (``mu - z * sigma``) with the ``z`` in ``[0, max_scale]`` that moves ``rule``'s output farthest.

    The candidates include ALIE's own ``z`` for ``n = h + f`` (:func:`~fedrobust.attacks.alie_z`) when it
    exists, so the chosen ``z`` moves the rule at least as far as plain ALIE.

    Parameters
    ----------
    rule : str, default "consistency+direction+dedup+winsorize+nnm+trimmed_mean"
        Registered aggregation rule, or ``+``-joined pipeline, the server is assumed to run.
    rule_f : int or None, default None
        The rule's ``f``; ``None`` means the number of Byzantine rows of the round.
    rule_params : dict, default {}
        The rule's parameters.
    rule_pre_params : dict, default {}
        Parameters of the pipeline's pre-aggregators, by stage name (as ``aggregator.pre_params``);
        the simulation fills them from the server's configuration when ``memory`` is on.
    max_scale : float, default 10.0
        Largest ``z`` searched.
    grid : int, default 11
        Evenly spaced ``z`` values evaluated on ``[0, max_scale]`` (at least 2).
    refine : int, default 8
        Golden-section steps around the best grid value.
    memory : bool, default False
        Search against the rule with the state the server's has this round (a copy of the server's
        pipeline fed the same rows, in simulation), instead of a rule built afresh.

    References
    ----------
    Baruch, Baruch, Goldberg. "A Little Is Enough: Circumventing Defenses For Distributed Learning."
    NeurIPS 2019; Allouah et al. "Fixing by Mixing", AISTATS 2023 (the tuned variant, as in ByzFL).
    """

    name: ClassVar[str] = "optimal_alie"

    def _line(self, honest: Tensor) -> tuple[Tensor, Tensor]:
        mu, _, sigma = _centre(honest)
        return mu, -sigma

    def _default(self, honest: Tensor, f: int) -> float:
        n = honest.shape[0] + f
        return alie_z(n, f) if math.floor(n / 2 + 1) - f >= 1 else 0.0


@dataclass(frozen=True)
class OptimalIPM(_Optimal):
    """IPM (``-epsilon * mean(honest)``) with the ``epsilon`` in ``[0, max_scale]`` that moves ``rule``'s
    output farthest.

    The candidates include IPM's default ``epsilon = 0.1``, so the chosen one moves the rule at least as
    far as plain IPM.

    Parameters
    ----------
    rule : str, default "consistency+direction+dedup+winsorize+nnm+trimmed_mean"
        Registered aggregation rule, or ``+``-joined pipeline, the server is assumed to run.
    rule_f : int or None, default None
        The rule's ``f``; ``None`` means the number of Byzantine rows of the round.
    rule_params : dict, default {}
        The rule's parameters.
    rule_pre_params : dict, default {}
        Parameters of the pipeline's pre-aggregators, by stage name (as ``aggregator.pre_params``);
        the simulation fills them from the server's configuration when ``memory`` is on.
    max_scale : float, default 10.0
        Largest ``epsilon`` searched.
    grid : int, default 11
        Evenly spaced ``epsilon`` values evaluated on ``[0, max_scale]`` (at least 2).
    refine : int, default 8
        Golden-section steps around the best grid value.
    memory : bool, default False
        Search against the rule with the state the server's has this round (a copy of the server's
        pipeline fed the same rows, in simulation), instead of a rule built afresh.

    References
    ----------
    Xie, Koyejo, Gupta. "Fall of Empires: Breaking Byzantine-tolerant SGD by Inner Product Manipulation."
    UAI 2020; Allouah et al. "Fixing by Mixing", AISTATS 2023 (the tuned variant, as in ByzFL).
    """

    name: ClassVar[str] = "optimal_ipm"

    def _line(self, honest: Tensor) -> tuple[Tensor, Tensor]:
        return torch.zeros_like(honest[0]), -honest.mean(dim=0)

    def _default(self, honest: Tensor, f: int) -> float:
        return 0.1


@dataclass(frozen=True)
class OptimalFang(_Optimal):
    """Fang's attack on the trimmed mean with its reach tuned against ``rule``: ``mu + t * (e - mu)``,
    ``t`` in ``[0, max_scale]``, that moves ``rule``'s output farthest.

    ``e`` is the honest extreme opposite to each coordinate's changing direction, as in Fang's attack:
    ``e_j`` is the smallest honest value of coordinate ``j`` where ``mean_j > 0`` and the largest
    elsewhere. ``t = 1`` puts the Byzantine rows on that extreme, just inside every coordinate's honest
    range, where clamping (``winsorize``) and trimming leave them as they are; ``t > 1`` goes beyond it,
    as Fang's own attack does; ``t < 1`` stays closer to the mean, where a filter that scores whole rows
    (``direction``, DnC) may let them through. ``t = 1`` is always a candidate, so the chosen ``t`` moves
    the rule at least as far as rows on the extreme.

    Parameters
    ----------
    rule : str, default "consistency+direction+dedup+winsorize+nnm+trimmed_mean"
        Registered aggregation rule, or ``+``-joined pipeline, the server is assumed to run.
    rule_f : int or None, default None
        The rule's ``f``; ``None`` means the number of Byzantine rows of the round.
    rule_params : dict, default {}
        The rule's parameters.
    rule_pre_params : dict, default {}
        Parameters of the pipeline's pre-aggregators, by stage name (as ``aggregator.pre_params``);
        the simulation fills them from the server's configuration when ``memory`` is on.
    max_scale : float, default 10.0
        Largest ``t`` searched.
    grid : int, default 11
        Evenly spaced ``t`` values evaluated on ``[0, max_scale]`` (at least 2).
    refine : int, default 8
        Golden-section steps around the best grid value.
    memory : bool, default False
        Search against the rule with the state the server's has this round (a copy of the server's
        pipeline fed the same rows, in simulation), instead of a rule built afresh.

    References
    ----------
    Fang, Cao, Jia, Gong. "Local Model Poisoning Attacks to Byzantine-Robust Federated Learning."
    USENIX Security 2020 (the direction); Allouah et al. "Fixing by Mixing", AISTATS 2023 (tuning the
    scale against the rule, as ByzFL's Optimal_ALIE / Optimal_IPM do).
    """

    name: ClassVar[str] = "optimal_fang"

    def _line(self, honest: Tensor) -> tuple[Tensor, Tensor]:
        mu = honest.mean(dim=0)
        extreme = torch.where(mu > 0, honest.min(dim=0).values, honest.max(dim=0).values)
        return mu, extreme - mu

    def _default(self, honest: Tensor, f: int) -> float:
        return 1.0


@dataclass(frozen=True)
class OptimalMix(_Optimal):
    """The tuned attacks' directions and their mixes, each with its scale tuned against ``rule``; the
    rows that move ``rule``'s output farthest of all.

    The directions are ALIE's (``-sigma``), IPM's (``-mean``) and Fang's (``e - mean``, each coordinate's
    honest extreme opposite to the mean's sign), each of unit length; the lines searched start at the
    honest mean and go along each of them, along the mean of each pair and along the mean of all three,
    seven in all, every one scaled to the norm of ``sigma`` (so ``t = 1`` moves the rows by one honest
    standard deviation's norm). Each line's ``t`` in ``[0, max_scale]`` is searched as the other tuned
    attacks search theirs (``t = 1`` always a candidate), and the best line wins: a search over the
    direction in the plane of the three, not only the scale along one. It costs seven times the
    aggregations of one tuned attack.

    Parameters
    ----------
    rule : str, default "consistency+direction+dedup+winsorize+nnm+trimmed_mean"
        Registered aggregation rule, or ``+``-joined pipeline, the server is assumed to run.
    rule_f : int or None, default None
        The rule's ``f``; ``None`` means the number of Byzantine rows of the round.
    rule_params : dict, default {}
        The rule's parameters.
    rule_pre_params : dict, default {}
        Parameters of the pipeline's pre-aggregators, by stage name (as ``aggregator.pre_params``);
        the simulation fills them from the server's configuration when ``memory`` is on.
    max_scale : float, default 10.0
        Largest ``t`` searched on each line.
    grid : int, default 11
        Evenly spaced ``t`` values evaluated on ``[0, max_scale]`` (at least 2).
    refine : int, default 8
        Golden-section steps around the best grid value.
    memory : bool, default False
        Search against the rule with the state the server's has this round (a copy of the server's
        pipeline fed the same rows, in simulation), instead of a rule built afresh.

    References
    ----------
    Baruch et al. (ALIE, NeurIPS 2019), Xie et al. (IPM, UAI 2020), Fang et al. (USENIX Security 2020)
    for the directions; Shejwalkar, Houmansadr (NDSS 2021) for tailoring the attack to the known rule.
    """

    name: ClassVar[str] = "optimal_mix"

    def _lines(self, honest: Tensor, f: int) -> list[tuple[Tensor, Tensor, float]]:
        return _mix_lines(honest)


def _tuned_directions(honest: Tensor) -> list[Tensor]:
    """The unit directions of ALIE (``-sigma``), IPM (``-mean``) and Fang (``e - mean``), where not zero."""
    mu, _, sigma = _centre(honest)
    extreme = torch.where(mu > 0, honest.min(dim=0).values, honest.max(dim=0).values)
    return [v / torch.linalg.vector_norm(v) for v in (-sigma, -mu, extreme - mu) if bool(v.any())]


def _mix_lines(honest: Tensor) -> list[tuple[Tensor, Tensor, float]]:
    """``optimal_mix``'s lines: from the mean along each tuned direction, each pair's mean and all three's."""
    mu, _, sigma = _centre(honest)
    unit = torch.linalg.vector_norm(sigma)
    directions = _tuned_directions(honest)
    mixes = [[i] for i in range(len(directions))]
    mixes += [[i, j] for i in range(len(directions)) for j in range(i + 1, len(directions))]
    mixes += [list(range(len(directions)))] if len(directions) > 2 else []
    lines = []
    for mix in mixes:
        v = torch.stack([directions[i] for i in mix]).sum(dim=0)
        norm = torch.linalg.vector_norm(v)
        if norm > 0:
            lines.append((mu, v * (unit / norm), 1.0))
    return lines or [(mu, torch.zeros_like(mu), 0.0)]


@dataclass(frozen=True)
class OptimalSearch(_Optimal):
    """A search over the direction as well as the scale, against ``rule``: the rows that move its output
    farthest from the honest mean among ``optimal_mix``'s seven lines and lines in a wider span.

    The span is that of the three tuned directions (ALIE's, IPM's, Fang's) and the honest rows' top
    ``components`` principal directions (where honest rows differ most, so where a row can go far and
    still look like one of them). After ``optimal_mix``'s lines it tries ``directions`` random lines in
    that span (Gaussian coefficients from the round's generator), then ``local`` steps from the best
    line so far: a random step of the direction's coefficients, kept when the rule moves farther, the
    step shrunk (x0.7) when not. Each line's scale is searched as in the other tuned attacks, every line
    scaled to the norm of the honest standard deviation (``t = 1`` always a candidate). The result moves
    the rule at least as far as ``optimal_mix`` with the same grid; it costs ``7 + directions + local``
    times the aggregations of one tuned attack.

    Parameters
    ----------
    rule : str, default "consistency+direction+dedup+winsorize+nnm+trimmed_mean"
        Registered aggregation rule, or ``+``-joined pipeline, the server is assumed to run.
    rule_f : int or None, default None
        The rule's ``f``; ``None`` means the number of Byzantine rows of the round.
    rule_params : dict, default {}
        The rule's parameters.
    rule_pre_params : dict, default {}
        Parameters of the pipeline's pre-aggregators, by stage name (as ``aggregator.pre_params``);
        the simulation fills them from the server's configuration when ``memory`` is on.
    max_scale : float, default 10.0
        Largest ``t`` searched on each line.
    grid : int, default 11
        Evenly spaced ``t`` values evaluated on ``[0, max_scale]`` (at least 2).
    refine : int, default 8
        Golden-section steps around the best grid value.
    memory : bool, default False
        Search against the rule with the state the server's has this round (a copy of the server's
        pipeline fed the same rows, in simulation), instead of a rule built afresh.
    components : int, default 3
        Top principal directions of the honest rows added to the span.
    directions : int, default 16
        Random lines tried in the span.
    local : int, default 16
        Steps of the local search from the best line.

    References
    ----------
    Shejwalkar, Houmansadr (NDSS 2021) for tailoring the attack to the known rule; the directions as in
    ``optimal_mix``.
    """

    name: ClassVar[str] = "optimal_search"
    components: int = 3
    directions: int = 16
    local: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        for param in ("components", "directions", "local"):
            check_int(self.name, param, getattr(self, param), low=0)

    def _span(self, honest: Tensor) -> Tensor:
        """``[d, k]`` orthonormal columns (float64) spanning the tuned directions and top components."""
        mu = honest.mean(dim=0)
        vectors = [v.double() for v in _tuned_directions(honest)]
        if self.components:
            _, singular, vh = torch.linalg.svd((honest - mu).double(), full_matrices=False)
            keep = singular > singular[0] * 1e-6 if singular.numel() else singular.bool()
            vectors += list(vh[keep][: self.components])
        if not vectors:
            return torch.zeros((honest.shape[1], 0), dtype=torch.float64, device=honest.device)
        q, r = torch.linalg.qr(torch.stack(vectors, dim=1))
        independent = r.diagonal().abs() > 1e-9
        return q[:, independent]

    def _search(
        self, honest: Tensor, f: int, aggregate: Callable[[Tensor], Tensor], generator: torch.Generator
    ) -> Tensor:
        mu, _, sigma = _centre(honest)
        unit = torch.linalg.vector_norm(sigma)
        span = self._span(honest)
        k = span.shape[1]

        def try_line(line: tuple[Tensor, Tensor, float]) -> tuple[float, Tensor, Tensor]:
            value, row = self._on_line(honest, f, aggregate, line)
            return value, row, span.T @ line[1].double()  # the line's coefficients in the span

        def along(coefficients: Tensor) -> tuple[Tensor, Tensor, float]:
            v = span @ coefficients
            return mu, (v * (unit / torch.linalg.vector_norm(v))).to(honest.dtype), 1.0

        best = max((try_line(line) for line in _mix_lines(honest)), key=lambda t: t[0])  # first on ties
        if k == 0 or not bool(best[2].any()):
            return _repeat(best[1], f)
        for _ in range(self.directions):
            c = torch.randn(k, generator=generator, dtype=torch.float64).to(span.device)
            candidate = try_line(along(c))
            if candidate[0] > best[0]:
                best = candidate
        step = 0.5
        for _ in range(self.local):
            c = best[2] / torch.linalg.vector_norm(best[2])
            c = c + step * torch.randn(k, generator=generator, dtype=torch.float64).to(span.device)
            candidate = try_line(along(c))
            if candidate[0] > best[0]:
                best = candidate
            else:
                step *= 0.7
        logger.debug("%s against %s: best line moves it by %.6g", self.name, self.rule, best[0])
        return _repeat(best[1], f)
