"""Name registries of rules and pre-aggregators, and :func:`build`."""

from __future__ import annotations

import copy
import inspect
import logging
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from fedrobust.aggregators.base import Component, PreAggregator, Rule
from fedrobust.aggregators.pipeline import Aggregator
from fedrobust.text import did_you_mean

log = logging.getLogger(__name__)

__all__ = ["build", "build_pre", "names", "pre_names", "register_pre", "register_rule", "split_pipeline"]

# Joins a pipeline's stages in one name, as the study and results name them: "winsorize+nnm+trimmed_mean"
# is winsorize, then nnm, then the rule trimmed_mean. One name lets a single config field pick a pipeline.
PIPELINE_SEPARATOR = "+"

_RULES: dict[str, type[Rule]] = {}
_PRES: dict[str, type[PreAggregator]] = {}

# User rules that passed their contract check in this process, by what was built (target, f, parameters,
# pre-aggregators). One run validates its config more than once (the command line, the simulation, the
# ServerApp) and then builds its strategy: a rule that is slow to build or to run is checked once.
_CHECKED: set[tuple[Any, ...]] = set()

R = TypeVar("R", bound=type[Rule])
P = TypeVar("P", bound=type[PreAggregator])


def register_rule(cls: R) -> R:
    """Class decorator: make a rule available to :func:`build` under ``cls.name``."""
    _RULES[cls.name] = cls
    return cls


def register_pre(cls: P) -> P:
    """Class decorator: make a pre-aggregator available in ``build(..., pre=...)``."""
    _PRES[cls.name] = cls
    return cls


def names() -> list[str]:
    """Names of the registered robust rules."""
    return list(_RULES)


def pre_names() -> list[str]:
    """Names of the registered pre-aggregators."""
    return list(_PRES)


def split_pipeline(name: str) -> tuple[list[str], str]:
    """The pre-aggregators and the rule a pipeline name joins with ``+``, in order.

    >>> split_pipeline("winsorize+nnm+trimmed_mean")
    (['winsorize', 'nnm'], 'trimmed_mean')
    >>> split_pipeline("krum")
    ([], 'krum')
    """
    *pre, rule = (stage.strip() for stage in name.split(PIPELINE_SEPARATOR))
    return pre, rule


def pipeline_order_hint(name: str) -> str | None:
    """What to write instead of a pipeline whose stages are all known but out of order (a rule before a
    pre-aggregator: ``'krum+nnm'``) or that names a stage twice (``'nnm+nnm+krum'``), or None where
    neither is the problem."""
    stages = [stage.strip() for stage in name.split(PIPELINE_SEPARATOR)]
    if len(stages) < 2 or any(s not in _RULES and s not in _PRES for s in stages):
        return None  # a bare name, or an unknown stage: the unknown-name message says more
    if stages[-1] in _RULES and all(s in _PRES for s in stages[:-1]):
        # In order. A stage twice is a typo, most likely, and its parameters are set by its name
        # (aggregator.pre_params.<name>); DnC, a rule and a filter, may be both: a filter and then the rule.
        twice = sorted({s for s in stages if stages.count(s) > (2 if s == stages[-1] and s in _PRES else 1)})
        if twice:
            once = PIPELINE_SEPARATOR.join([*dict.fromkeys(stages[:-1]), stages[-1]])
            return f"names {', '.join(repr(s) for s in twice)} more than once; each stage once, e.g. {once!r}"
        return None
    # DnC is both a rule and a pre-aggregator: it is the rule only where no other stage can be.
    rules = [s for s in stages if s in _RULES and s not in _PRES] or [s for s in stages if s in _RULES][-1:]
    if len(rules) != 1:
        return (f"a pipeline is pre-aggregators and then exactly one rule; {name!r} names "
                f"{len(rules) or 'no'} rule{'s' if len(rules) > 1 else ''} (rules: {', '.join(_RULES)})")
    last = len(stages) - 1 - stages[::-1].index(rules[0])  # the rule's last place: only that one moves
    ordered = PIPELINE_SEPARATOR.join([*stages[:last], *stages[last + 1 :], rules[0]])
    return f"the rule goes last, after its pre-aggregators: {ordered!r}"


# The other ways to name a rule, for the error of an unknown name.
_OTHER_RULE_FORMS = (
    f"; or pre-aggregators and then a rule joined with {PIPELINE_SEPARATOR!r} (e.g. 'winsorize+nnm+trimmed_mean'; "
    "pre-aggregators: fedrobust.aggregators.pre_names()); or your own rule: a callable or a dotted path "
    "('my_pkg.rules.my_rule')"
)


def _lookup(registry: Mapping[str, type[Component]], name: object, kind: str, more: str = "") -> type[Component]:
    if not isinstance(name, str) or name not in registry:
        meant = did_you_mean(name, registry)
        raise ValueError(f"unknown {kind} {name!r}{meant}; valid names: {', '.join(registry)}{more}")
    return registry[name]


def _construct(cls: type[Component], f: int, params: Mapping[str, Any]) -> Component:
    signature = inspect.signature(cls.__init__)
    keyword = {p.name: p for p in signature.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    unknown = sorted(set(params) - set(keyword))
    if unknown:
        valid = ", ".join(keyword) or "none"
        meant = did_you_mean(unknown[0], keyword) if len(unknown) == 1 else ""
        raise ValueError(f"{cls.name}: unknown parameter(s) {', '.join(unknown)}{meant}; valid parameters: {valid}")
    missing = [name for name, p in keyword.items() if p.default is inspect.Parameter.empty and name not in params]
    if missing:
        raise ValueError(f"{cls.name}: missing required parameter(s) {', '.join(missing)}")
    return cls(f, **params)


def build(
    name: str | Callable[..., Any],
    f: int = 0,
    *,
    pre: Sequence[str | Mapping[str, Any]] | str | Mapping[str, Any] = (),
    **params: Any,
) -> Aggregator:
    """Build a robust aggregator: a registered rule by name, or a user rule by dotted path or callable.

    Parameters
    ----------
    name : str or callable
        A rule from :func:`names`, or a whole pipeline joined with ``+``: pre-aggregators from
        :func:`pre_names` in order, then the rule (``"winsorize+nnm+trimmed_mean"``); or a dotted
        path (``my_pkg.rules.MyRule``, as a config's
        ``aggregator._target_``) or a callable, built with ``f`` and ``params`` by
        :func:`fedrobust.components.user_rule` and contract-checked
        (:func:`fedrobust.components.check_rule`) before it is returned; once per process for the same
        class or function, ``f``, ``pre`` and ``params``.
    f : int
        Number of Byzantine rows to tolerate; also given to the pre-aggregators.
    pre : sequence of str or mapping
        Pre-aggregators applied in order, each a name from :func:`pre_names` or a mapping
        ``{"name": ..., **params}``. A single name or mapping is accepted too. Not with a pipeline
        name, which names its pre-aggregators itself.
    **params
        Keyword parameters of the rule (see each rule's class).

    Returns
    -------
    Aggregator
        Callable on a ``[n, d]`` float tensor, returning ``[d]``.

    Raises
    ------
    ValueError
        Unknown names or parameters (the message lists the valid ones), invalid values, a user rule
        that cannot be imported or built, or one that fails the contract check.

    Examples
    --------
    >>> import torch
    >>> from fedrobust import aggregators
    >>> agg = aggregators.build("krum", f=1, pre=["nnm"])
    >>> agg(torch.randn(7, 100)).shape
    torch.Size([100])
    >>> aggregators.build("winsorize+nnm+trimmed_mean", f=1)
    Aggregator(trimmed_mean (after winsorize, nnm), f=1)
    """
    if isinstance(name, str) and PIPELINE_SEPARATOR in name:
        if (hint := pipeline_order_hint(name)) is not None:
            raise ValueError(f"aggregator {name!r}: {hint}")
        named_pre, rule_name = split_pipeline(name)
        if pre:
            given = [item if isinstance(item, str) else item.get("name", "?") for item in _pre_items(pre)]
            raise ValueError(
                f"{name!r} names its pre-aggregators itself; give pre only with a bare rule name, or name "
                f"every stage in one: {PIPELINE_SEPARATOR.join([*given, name])!r}"
            )
        return build(rule_name, f, pre=named_pre, **params)
    if isinstance(name, str) and (name in _RULES or not any(sep in name for sep in ".:")):
        rule = _construct(_lookup(_RULES, name, "aggregation rule", _OTHER_RULE_FORMS), f, params)
        return Aggregator(rule, build_pre(pre, f))  # type: ignore[arg-type]
    from fedrobust.components import check_rule, user_rule  # a user's rule: imported on demand

    def pipeline(target: Any = name) -> Aggregator:
        return Aggregator(user_rule(target, f, params), build_pre(pre, f))

    key = _check_key(name, f, pre, params)
    if key is not None and key in _CHECKED:
        return pipeline()
    # On an instance of its own: the check must not move a stateful rule's state. A name or a factory
    # builds a new one; an object built already (or a function) is checked on a copy of it.
    built = not isinstance(name, str | type)
    try:
        probe = copy.deepcopy(name) if built else name
    except Exception as err:  # whatever the object's __deepcopy__ raises: not checked, and said so
        log.warning("aggregator %r could not be copied for its contract check (%s): not checked", name, err)
    else:
        check_rule(pipeline(probe))
        if key is not None:
            _CHECKED.add(key)
    return pipeline()


def _check_key(name: Any, f: int, pre: Any, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """What a passed contract check is remembered by; None for what may change between two builds: an
    object built already (its state), or parameters without a stable ``repr``."""
    if isinstance(name, str):
        from fedrobust.components import import_target

        # The imported object, not its path: a module reloaded in a notebook is checked again.
        try:
            name = import_target(name)
        except Exception:  # user_rule says what is wrong with the path
            return None
    if not isinstance(name, type | types.FunctionType):
        return None
    key = (name, f, repr([dict(item) if isinstance(item, Mapping) else item for item in _pre_items(pre)]),
           repr(sorted(params.items())))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def build_pre(pre: Sequence[str | Mapping[str, Any]] | str | Mapping[str, Any], f: int) -> list[PreAggregator]:
    """The pre-aggregators ``pre`` names (as in :func:`build`), each built with ``f``. A list may repeat a
    stage (a pipeline name, whose stages take their parameters by name, may not): it is the caller's own."""
    stages = []
    for item in _pre_items(pre):
        if isinstance(item, Mapping):
            stage_params = dict(item)
            stage_name = stage_params.pop("name", None)
            if stage_name is None:
                raise ValueError(
                    f"pre-aggregator {dict(item)!r} has no 'name': give one of {pre_names()}, e.g. "
                    "{'name': 'clipping', 'threshold': 5.0}"
                )
        else:
            stage_name, stage_params = item, {}
        if isinstance(stage_name, str) and stage_name not in _PRES and any(sep in stage_name for sep in ",+"):
            listed = [s.strip() for s in stage_name.replace("+", ",").split(",")]
            raise ValueError(f"unknown pre-aggregator {stage_name!r}: give the stages as a list, e.g. pre={listed!r} "
                             f"(valid names: {', '.join(_PRES)})")
        stages.append(_construct(_lookup(_PRES, stage_name, "pre-aggregator"), f, stage_params))
    return stages  # type: ignore[return-value]


def _pre_items(
    pre: Sequence[str | Mapping[str, Any]] | str | Mapping[str, Any],
) -> tuple[str | Mapping[str, Any], ...]:
    """``pre`` as a tuple of stages: a single name or mapping is one stage."""
    return (pre,) if isinstance(pre, (str, Mapping)) else tuple(pre)
