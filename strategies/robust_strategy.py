"""The robust strategy: sample live nodes, validate every reply on its own, aggregate robustly, step.

:class:`RobustStrategy` is a Flower Message-API :class:`~flwr.serverapp.strategy.Strategy`. Used
the Flower way, ``strategy.start(grid=..., initial_arrays=..., num_rounds=...)`` runs the whole
fault-tolerant loop (:mod:`fedrobust.strategies.round_loop`) and returns Flower's ``Result``;
``configure_train`` / ``aggregate_train`` / ``configure_evaluate`` / ``aggregate_evaluate`` also
work one by one, as in Flower's own strategies.

Unlike Flower's built-in robust strategies, one malformed reply never raises (Flower's
``InconsistentMessageReplies`` stops a ServerApp) and a rule is never run on fewer rows than it
needs (Flower's Krum happily picks between 2 replies with f=1): such a round is reported as not
aggregated, with the reason.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedrobust import aggregators, memory, protocol
from fedrobust.config import CHECKPOINT_INTERVAL_AUTO, AggregatorConfig, LivenessConfig
from fedrobust.liveness import LivenessTracker
from fedrobust.server_optim import PARAMS as SERVER_OPTIMIZER_PARAMS
from fedrobust.server_optim import ServerOptimizer, lr_factor
from fedrobust.signing import REASON_DETAILS, TrustStore
from fedrobust.strategies import arguments
from fedrobust.strategies.arguments import check, is_number, names_misspelt_keywords, plain
from fedrobust.strategies.checkpointing import RUN_SETTINGS_KEY
from fedrobust.strategies.errors import AggregationError
from fedrobust.strategies.replies import error_reason, parse_reply
from fedrobust.strategies.signatures import SignatureCheck
from fedrobust.strategies.stopping import on_flower_exit
from fedrobust.tensors import flatten
from fedrobust.training import pick_device
from fedrobust.update_matrix import UpdateMatrix
from fedrobust.validation import BAD_NUM_EXAMPLES, NORM_TOO_LARGE, Rejection, check_num_examples, is_running_statistic

log = logging.getLogger(__name__)

DUPLICATE_REPLY = "duplicate_reply"


@dataclass
class ClientUpdate:
    """One accepted reply: what it claimed. Its update is the row of the round's [n, d] update matrix at its
    index in the round's list of accepted replies (aggregation order)."""

    node_id: int
    partition_id: int
    num_examples: float  # validated: an integer in [1, max_num_examples]
    metrics: dict[str, float]
    sim_byzantine: bool = False


@dataclass
class RoundOutcome:
    """What happened to the replies of one training round: a value, returned by :meth:`aggregate_round`."""

    round: int
    sampled: int = 0
    accepted: list[int] = field(default_factory=list)  # node ids, in aggregation order
    rejected: Counter[str] = field(default_factory=Counter)
    rejected_nodes: list[dict[str, Any]] = field(default_factory=list)  # {"node", "partition", "reason", "detail"}
    dropped: list[int] = field(default_factory=list)  # node ids: error replies or missed deadline
    filtered: list[int] = field(default_factory=list)  # node ids: accepted, then left out by a pre-aggregator
    filtered_by: dict[int, str] = field(default_factory=dict)  # node id -> the filter that left it out
    excluded: list[int] = field(default_factory=list)  # node ids: accepted, given no weight by the rule
    client_errors: Counter[str] = field(default_factory=Counter)  # error message -> replies
    errors_by_node: dict[int, str] = field(default_factory=dict)  # node id -> its error message
    f_used: int = 0
    needed: int = 0  # the valid replies the rule needed (with f_used)
    aggregated: bool = False
    why_not_aggregated: str = ""
    arrays: ArrayRecord | None = None
    train_metrics: dict[str, float] = field(default_factory=dict)
    seconds_aggregate: float = 0.0

    def metric_record(self) -> MetricRecord:
        """Counts and the clients' mean training metrics, as Flower's Result keeps them per round."""
        counts: dict[str, int | float] = {
            "accepted": len(self.accepted),
            "rejected": sum(self.rejected.values()),
            "dropped": len(self.dropped),
            "filtered": len(self.filtered),
            "excluded": len(self.excluded),
            "client-errors": sum(self.client_errors.values()),
            "aggregated": int(self.aggregated),
            "f-used": self.f_used,
        }
        counts.update({f"rejected.{reason}": n for reason, n in sorted(self.rejected.items())})
        return MetricRecord({**counts, **self.train_metrics})


@dataclass(frozen=True)
class RoundUpdates:
    """What an ``update_hook`` sees of a round: its accepted updates, just before they are aggregated.

    One object rather than positional arguments, so a field added later breaks no hook.

    Attributes
    ----------
    round : int
        The server round.
    rows : torch.Tensor
        The ``[n, d]`` float32 update matrix, in aggregation order: writable, not a copy.
    byzantine : torch.Tensor
        ``[n]`` bool mask of the replies marked Byzantine (``sim-byzantine``, simulation only).
    clients : list[int]
        The id of each row's client that the aggregator's memory keys on (its partition where known,
        else its node id).
    server_update : torch.Tensor or None
        The server's own update of the round (``[d]`` float32, in the rows' layout) that the rule
        will get, for rules that need one (FLTrust); None for the others. Not to be modified.
    global_model : torch.Tensor or None
        The global model the round's clients were sent: its floating arrays as one ``[d]`` float32
        vector in the rows' layout (an update plus it is that client's local model). Not to be modified.
    """

    round: int
    rows: torch.Tensor
    byzantine: torch.Tensor
    clients: list[int]
    server_update: torch.Tensor | None = None
    global_model: torch.Tensor | None = None


# Sees the accepted updates of a round before they are aggregated: ``hook(updates: RoundUpdates)``. It
# rewrites ``updates.rows`` in place and returns the indices it rewrote (None: any row may have changed);
# those rows are checked again (finiteness, norm bound) and dropped when they fail. The simulation-only
# omniscient adversary of experiments/ uses it; the strategy carries none by default.
UpdateHook = Callable[[RoundUpdates], Sequence[int] | None]

# The server's own update of a round, for rules that need one (FLTrust): ``fn(round, global_state)`` with
# the global model the round's clients were sent (name -> tensor, not to be modified) returns the server's
# update (its trained weights minus those), keyed like the model; its floating arrays are flattened in the
# update matrix's layout and given to the rule before it aggregates the round.
ServerUpdateFn = Callable[[int, Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]


# Warnings said once a process.
_said = {"plain mean": False, "f=0": False, "no weights": False, "no min_n": False, "no checkpoint_dir": False}
# Settings that only act with a checkpoint_dir (checkpoint_mirror and force_resume without one are errors).
_CHECKPOINT_SETTINGS = (
    "checkpoint_every", "checkpoint_every_seconds", "checkpoint_keep", "checkpoint_full_every",
    "checkpoint_storage_options", "checkpoint_mtbf",
)


class RoundIntake:
    """The replies of one round, each checked and written into its row of the update matrix as it arrives.

    A node's row is its place in the strategy's fixed order (partition, then node id), whatever the
    order the replies arrive in, so the aggregate does not depend on it; :meth:`close` moves the
    rows up over those of missing or rejected replies (none move when none is missing) and
    aggregates. Made by :meth:`RobustStrategy.open_round`.
    """

    def __init__(self, strategy: RobustStrategy, server_round: int, nodes: Sequence[int]) -> None:
        self._strategy = strategy
        self._rows = {node: row for row, node in enumerate(nodes)}
        # Taken at the first reply: until then the rows reserved by configure_train are still being
        # made resident in the background, while the clients train.
        self._matrix: UpdateMatrix | None = None
        self._sent: dict[str, int] = {}
        self._seen: set[int] = set()
        self._accepted: dict[int, ClientUpdate] = {}
        self.outcome = RoundOutcome(round=server_round)

    def expect(self, sent: Mapping[str, int]) -> None:
        """The round's messages: id -> destination node. Error replies from a SuperLink carry the
        SuperLink's node id, not the client's: with ``sent`` they are attributed to the right node."""
        self._sent.update(sent)
        self.outcome.sampled = len(self._sent)

    def take(self, reply: Message) -> None:
        """Check one reply and write it into its row now; its bytes are released once the row is written."""
        s, outcome = self._strategy, self.outcome
        node_id = self._sent.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
        if reply.has_error():
            outcome.dropped.append(node_id)
            reason = error_reason(reply.error.reason)
            outcome.client_errors[reason] += 1
            outcome.errors_by_node[node_id] = reason
            return
        if node_id in self._seen:
            s._reject(outcome.round, node_id, outcome, Rejection(DUPLICATE_REPLY, "second reply"))
            return
        self._seen.add(node_id)
        row = self._rows.get(node_id)
        if row is None:
            raise ValueError(f"round {outcome.round}: a reply from node {node_id}, which open_round was not told of")
        update_or_rejection = s._parse(outcome.round, node_id, reply, self._update_matrix(), row)
        if isinstance(update_or_rejection, Rejection):
            s._reject(outcome.round, node_id, outcome, update_or_rejection)
        else:
            self._accepted[row] = update_or_rejection

    def _update_matrix(self) -> UpdateMatrix:
        if self._matrix is None:
            self._matrix = self._strategy._matrix_for(len(self._rows))
        return self._matrix

    def can_aggregate(self) -> bool:
        """Whether the replies accepted so far are enough for the rule (with ``f`` lowered by the
        nodes proven faulty so far), i.e. whether :meth:`close` would aggregate now."""
        rule, _ = self._strategy._rule_after(self.outcome)
        return len(self._accepted) >= rule.min_n()

    def close(self) -> RoundOutcome:
        """Aggregate the accepted replies, in the fixed order; the outcome of the round."""
        rows = sorted(self._accepted)
        self._update_matrix().keep(rows)
        accepted = [self._accepted[row] for row in rows]
        # Reported in the fixed order too: the round's metrics do not depend on the arrival order.
        place = lambda node: self._rows.get(node, len(self._rows))  # noqa: E731
        self.outcome.rejected_nodes.sort(key=lambda entry: place(entry["node"]))
        self.outcome.dropped.sort(key=place)
        self.outcome.client_errors = Counter(dict(sorted(self.outcome.client_errors.items())))
        return self._strategy._aggregate_accepted(self.outcome, accepted)


class RobustStrategy(Strategy):
    """Byzantine-robust, fault-tolerant federated training on Flower's Message API.

    Parameters
    ----------
    aggregator : str, callable or Aggregator
        The robust rule. A name from ``fedrobust.aggregators.names()`` (``trimmed_mean``, ``median``,
        ``krum``, ``multikrum``, ``geometric_median``, ``centered_clipping``, ``bulyan``, ``mean``,
        ...), or a pipeline: pre-aggregators, then the rule, joined with ``+``. The default,
        ``consistency+direction+dedup+winsorize+nnm+trimmed_mean``, has the best worst case over the attack set of
        the project's study (docs/results.md): it drops replies whose client turned against its own
        earlier replies, replies that push against the others (this round, or over the rounds their
        client took part in) and copies of one update, then winsorizes, mixes neighbours and trims
        each coordinate; a user rule's dotted path
        (``"my_pkg.rules.MyRule"`` or ``"my_pkg.rules:MyRule"``, as a config's
        ``aggregator._target_``), or that class or factory itself: called with ``f`` (when
        its signature names it) and ``aggregator_params``, it returns a callable from the ``[n, d]``
        update matrix to the ``[d]`` aggregate (the rule protocol of :mod:`fedrobust.components`) and
        is contract-checked when built; or an aggregator already built with
        :func:`fedrobust.aggregators.build` (then without ``pre`` and ``aggregator_params``). A name
        or dotted path is built again with a lower ``f`` for a round in which nodes were proven
        faulty; a class, callable or built aggregator keeps ``num_byzantine``.
    num_byzantine : int
        f, the number of faulty or malicious replies per round the rule tolerates.
    pre : sequence of str or mapping
        Pre-aggregators in front of a rule given by bare name or as a user rule (``fedrobust.aggregators.
        pre_names()``: ``nnm``, ``bucketing``, ``clipping``, ``arc``, ``winsorize``, ``direction``, ``dedup``,
        ``consistency``, ``dnc``), each a name or ``{"name": ..., **params}``.
    aggregator_params : mapping, optional
        Keyword parameters of the rule.
    fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes, min_available_nodes
        As in Flower's ``FedAvg``: the share of the (live, non-quarantined) nodes sampled per round,
        at least ``min_*_nodes`` (for training also at least the replies the rule needs, e.g. ``2f + 1``
        for the trimmed mean, where that many nodes are live); training waits (at most ``wait_for_nodes`` s) for
        ``min_available_nodes`` connected nodes. ``fraction_evaluate=0`` turns federated
        evaluation off (use ``evaluate_fn`` for central evaluation).
    weighted_by_key, arrayrecord_key, configrecord_key : str
        Record and metric names, as in Flower's ``FedAvg``.
    train_metrics_aggr_fn, evaluate_metrics_aggr_fn : callable, optional
        As in Flower's ``FedAvg``: ``fn(records, weighted_by_key) -> MetricRecord``, e.g. Flower's
        ``aggregate_metricrecords``. For training it gets the metrics of the accepted replies only (with
        their validated example counts); what it returns is named ``train_<key>`` (unless the key starts
        with ``train_``), next to the round's counts (``accepted``, ``rejected``, ...). For evaluation it
        gets every evaluation reply with metrics and a count in ``(0, max_num_examples]``, and replaces
        the default: each metric trimmed of its ``num_byzantine`` highest and lowest values, then
        example-weighted. Default for training: the same, over every metric of the accepted replies (named
        ``train_<key>``; where clients report both ``loss`` and ``train_loss``, the aggregate of
        ``train_loss`` is kept). Clients report these metrics themselves; none is trusted.
    weight_by_num_examples : bool
        Weight replies by their (unverifiable) example counts where the rule supports weights.
    server_optimizer : str
        ``fedavg``, ``fedavgm``, ``fedadam`` or ``fedyogi``: how the robust aggregate moves the model.
    server_lr : float
        Server learning rate.
    server_optimizer_params : mapping, optional
        ``momentum`` (fedavgm), ``beta_1``, ``beta_2``, ``tau`` (fedadam, fedyogi).
    server_lr_schedule : str or callable
        How the server lr changes over the rounds: ``"constant"``, ``"cosine"`` (from ``server_lr`` in the
        first round down towards ``server_lr_min_ratio * server_lr``, as PyTorch's ``CosineAnnealingLR``;
        :func:`fedrobust.server_optim.lr_factor`), or a function ``(server_round, num_rounds) -> factor``
        (as ``LambdaLR``'s ``lr_lambda``) whose positive factor multiplies ``server_lr``. A rollback's
        ``lr_decay`` multiplies on top.
    server_lr_min_ratio : float
        In ``[0, 1]``: the cosine schedule's floor, relative to ``server_lr``.
    aggregation_device : str
        Where the rule runs: ``"cpu"`` (default; the rules' compiled CPU kernels), ``"cuda"``,
        ``"cuda:<index>"`` or ``"auto"`` (CUDA when available). Replies are always checked and written
        into the update matrix on the CPU; for a CUDA device the matrix is page-locked and its rows go
        to the device in one copy before the rule, whose aggregate comes back for the server step.
        Float sums on a GPU may round differently from the CPU's, so a run's bytes can differ from
        those of the same run aggregated on the CPU.
    max_update_norm : float, optional
        L2 bound on a reply's update; None or 0: no bound (non-finite updates are always rejected).
    max_num_examples : int
        Largest believable example count of a reply.
    round_deadline : float, optional
        Seconds a round waits for replies; None: ``start()``'s ``timeout``.
    max_round_retries : int
        Retries of a round that got fewer valid replies than the rule needs, before stopping.
    over_select : int
        Extra nodes sampled per round; the round ends at the first planned number of replies.
    grace_after_quorum : float
        Once the valid replies of a round are enough for the rule, the missing ones are waited for at
        most this many more seconds (never past the deadline); they then count as dropped, like a
        missed deadline. 0: always wait until every reply is in or the deadline passes. A node that
        died then costs a round this grace instead of the whole deadline; a run in which the grace
        cut a round short is timing-dependent, so not reproducible bit for bit.
    wait_for_nodes : float
        Seconds to wait for ``min_available_nodes`` before giving up (Flower waits forever; ``math.inf`` too);
        0: start with the nodes there now (with ``discover_partitions``, those that have answered).
    liveness : LivenessConfig or mapping, optional
        When a node is suspected, dead or quarantined (``fedrobust.config.LivenessConfig``).
    divergence_factor, lr_decay : float
        Roll back a round whose evaluation loss exceeds ``divergence_factor`` times the best so
        far (a best below 0.01 counts as 0.01, so a model that fits its data is not rolled back for
        noise; 0: only a non-finite model is rolled back) and multiply the server lr by ``lr_decay``.
    checkpoint_dir : str or PathLike, optional
        Local path or fsspec URL for round checkpoints; a second ``start()`` on the same
        directory resumes after the last checkpointed round.
    checkpoint_every, checkpoint_every_seconds, checkpoint_keep
        Checkpoint every k rounds (0: only by time, and after the last round) and/or every T
        seconds; keep the last n. ``checkpoint_every="auto"`` picks the interval itself: Young/Daly's
        ``T ~= sqrt(2 C F)`` rounds from the measured blocking cost ``C`` of a checkpoint, the round
        time and the MTBF ``F`` (``checkpoint_mtbf``), clamped to ``[1, num_rounds]``. The last round
        is always checkpointed.
    checkpoint_mirror : str, optional
        fsspec URL (e.g. ``s3://bucket/run``) to which each checkpoint committed in ``checkpoint_dir``
        (then a local directory) is uploaded in the background; a save blocks only for the local write.
        A resume takes the newest valid checkpoint of either place.
    checkpoint_full_every : int
        Incremental checkpoints: a full one every K saves and deltas of the previous one in between
        (1: every checkpoint is full). A kept delta keeps the checkpoints it was built on, and with
        ``checkpoint_keep`` > 1 the chain before the newest full one stays too (a fallback should the
        full one be corrupt): up to about ``2 * K`` checkpoints are on disk rather than ``keep``.
    checkpoint_storage_options : mapping, optional
        fsspec options (endpoint, credentials) of the remote store: of ``checkpoint_mirror`` when
        given, else of ``checkpoint_dir``. Credentials may also come from the environment.
    checkpoint_mtbf : float, optional
        Mean time between server failures in seconds for ``checkpoint_every="auto"``; None estimates
        it from the restarts recorded in the checkpoint history.
    resume : str
        ``auto`` resumes from the latest valid checkpoint; ``never`` starts fresh.
    force_resume : bool
        Resume even from a checkpoint saved with other settings.
    signing : TrustStore, str or PathLike, optional
        Verify reply signatures against this trust store (or the directory holding one);
        ``require_signatures`` refuses unsigned replies. Without it signatures are not checked.
    require_signatures : bool
        With ``signing``: refuse a reply that carries no signature (default). False accepts unsigned
        replies from nodes that hold no key, while a signed reply is still verified. No effect without
        ``signing``.
    seed : int
        Seeds sampling, so the same seed samples the same nodes.
    discover_partitions : bool
        Ask each node once for its ``partition-id`` (a query its ClientApp must answer) so that
        sampling and aggregation order follow partitions rather than random node ids: runs are then
        bit-reproducible across simulations. Off by default: any ClientApp works.
    metrics_path : str or PathLike, optional
        One JSON row per round, written as each round ends; a fresh run starts the file over, a resumed
        one rewrites it with the checkpoint's rows first.
    on_start : callable, optional
        ``on_start(first_round)``, called once the run's starting point is settled, before any round: 1,
        or the round after the checkpoint resumed from. A resume refused (other settings or model) raises
        before it, so e.g. a run's record of its settings is written only for a run that goes ahead. It
        comes before the strategy's state is restored from the checkpoint and before ``metrics_path`` is
        started over or rewritten, so that it may set an earlier run's files aside (or raise to refuse).
    progress : bool
        Print one line per round and a final summary.
    return_freed_memory : bool
        Fix the C library's mmap threshold (glibc, process-wide) when the first round is sent,
        so that each reply's buffers leave the process as soon as its row is written; without it a
        round peaks at the replies plus the update matrix (see ``fedrobust.memory``).
    update_hook : callable, optional
        Rewrites accepted update rows before aggregation (simulation adversaries); see ``UpdateHook``.
    server_update_fn : callable, optional
        The server's own update of each round from the global model, for rules that need one
        (``fltrust``; required there): see ``ServerUpdateFn``. Built from a RunConfig by
        ``fedrobust.strategies.evaluation.server_update_fn`` (training on a root data set).
    settings : mapping, optional
        Further settings a checkpoint must agree with to be resumed (e.g. the data and model
        settings of an experiment); the strategy's own settings are always included.
    """

    @names_misspelt_keywords
    def __init__(
        self,
        aggregator: str | Callable[..., Any] | aggregators.Aggregator = AggregatorConfig.name,
        num_byzantine: int = 0,
        *,
        pre: Sequence[str | Mapping[str, Any]] | str = (),
        aggregator_params: Mapping[str, Any] | None = None,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 0.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        weighted_by_key: str = protocol.NUM_EXAMPLES,
        arrayrecord_key: str = protocol.ARRAYS,
        configrecord_key: str = protocol.CONFIG,
        train_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord] | None = None,
        evaluate_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord] | None = None,
        weight_by_num_examples: bool = False,
        server_optimizer: str = "fedavg",
        server_lr: float = 1.0,
        server_optimizer_params: Mapping[str, float] | None = None,
        server_lr_schedule: str | Callable[[int, int], float] = "constant",
        server_lr_min_ratio: float = 0.0,
        aggregation_device: str = "cpu",
        max_update_norm: float | None = None,
        max_num_examples: int = 1_000_000,
        round_deadline: float | None = None,
        max_round_retries: int = 2,
        over_select: int = 0,
        grace_after_quorum: float = 0.0,
        wait_for_nodes: float = 120.0,
        liveness: LivenessConfig | Mapping[str, int] | None = None,
        divergence_factor: float = 10.0,
        lr_decay: float = 0.5,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | str = 1,
        checkpoint_every_seconds: float = 0.0,
        checkpoint_keep: int = 3,
        checkpoint_mirror: str | None = None,
        checkpoint_full_every: int = 1,
        checkpoint_storage_options: Mapping[str, Any] | None = None,
        checkpoint_mtbf: float | None = None,
        resume: str = "auto",
        force_resume: bool = False,
        signing: TrustStore | str | os.PathLike[str] | None = None,
        require_signatures: bool = True,
        seed: int = 0,
        discover_partitions: bool = False,
        metrics_path: str | os.PathLike[str] | None = None,
        on_start: Callable[[int], object] | None = None,
        progress: bool = True,
        return_freed_memory: bool = True,
        update_hook: UpdateHook | None = None,
        server_update_fn: ServerUpdateFn | None = None,
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        # FedAvg(0.5) is fraction_train=0.5; here the first argument is the rule.
        check(not is_number(aggregator), f"aggregator={aggregator!r}: RobustStrategy's first argument is the rule "
              f"(FedAvg's is fraction_train): pass fraction_train={aggregator!r} by name")
        a = arguments.checked({name: value for name, value in locals().items() if name != "self"})
        if isinstance(aggregator, aggregators.Aggregator):
            check(
                not pre and not aggregator_params,
                "pre and aggregator_params apply to a rule given by name, not to a built Aggregator",
            )
            self.aggregator = aggregator
        else:
            self.aggregator = aggregators.build(aggregator, f=a.num_byzantine, pre=pre, **plain(aggregator_params))
        check(
            not self.aggregator.needs_server_update or server_update_fn is not None,
            f"aggregator {self.aggregator.label} needs the server's own update each round: pass server_update_fn "
            "(a RunConfig builds it from aggregator.root_size examples of the training data)",
        )
        self._warn_about_f(a.num_byzantine)
        self._warn_about_rule(a.num_byzantine, a.weight_by_num_examples)
        _warn_about_checkpoint_settings(locals())
        self.server_update_fn = server_update_fn
        self._rule_spec = (aggregator, tuple(pre) if not isinstance(pre, str) else (pre,), plain(aggregator_params))
        self.num_byzantine: int = a.num_byzantine
        self.fraction_train: float = a.fraction_train
        self.fraction_evaluate: float = a.fraction_evaluate
        self.min_train_nodes: int = a.min_train_nodes
        self.min_evaluate_nodes: int = a.min_evaluate_nodes
        self.min_available_nodes: int = a.min_available_nodes
        self.weighted_by_key = weighted_by_key
        self.train_metrics_aggr_fn = train_metrics_aggr_fn
        self.evaluate_metrics_aggr_fn = evaluate_metrics_aggr_fn
        self.arrayrecord_key = arrayrecord_key
        self.configrecord_key = configrecord_key
        self.weight_by_num_examples: bool = a.weight_by_num_examples
        self.optimizer = ServerOptimizer(server_optimizer, lr=a.server_lr, **a.server_optimizer_params)
        self.server_lr: float = a.server_lr
        self.server_lr_schedule = server_lr_schedule
        self.server_lr_min_ratio: float = a.server_lr_min_ratio
        try:
            self.aggregation_device = pick_device(aggregation_device)
        except ValueError as err:
            raise ValueError(f"aggregation_device: {err}") from err
        self.max_update_norm: float | None = a.max_update_norm
        self.max_num_examples: int = a.max_num_examples
        self.round_deadline: float | None = a.round_deadline
        self.max_round_retries: int = a.max_round_retries
        self.over_select: int = a.over_select
        self.grace_after_quorum: float = a.grace_after_quorum
        self.wait_for_nodes: float = a.wait_for_nodes
        live = liveness if isinstance(liveness, LivenessConfig) else LivenessConfig(**plain(liveness))
        self.liveness_config = live
        self.liveness = LivenessTracker(
            suspect_after=live.suspect_after,
            dead_after=live.dead_after,
            backoff_rounds=live.backoff_rounds,
            max_backoff=live.max_backoff,
            quarantine_after=max(live.quarantine_after, 1),
            quarantine_rounds=live.quarantine_rounds,
        )
        self.divergence_factor: float = a.divergence_factor
        self.lr_decay: float = a.lr_decay
        self.checkpoint_dir = None if checkpoint_dir in (None, "") else str(checkpoint_dir)
        self.checkpoint_every = checkpoint_every
        self.checkpoint_every_seconds: float = a.checkpoint_every_seconds
        self.checkpoint_keep: int = a.checkpoint_keep
        self.checkpoint_mirror = checkpoint_mirror or None
        self.checkpoint_full_every: int = a.checkpoint_full_every
        self.checkpoint_storage_options = dict(checkpoint_storage_options) if checkpoint_storage_options else None
        self.checkpoint_mtbf: float | None = a.checkpoint_mtbf
        self.resume = resume
        self.force_resume: bool = a.force_resume
        trust = signing if signing is None or isinstance(signing, TrustStore) else TrustStore.load(signing)
        self.signatures = SignatureCheck(trust, require=a.require_signatures)
        self.seed: int = a.seed
        self.discover_partitions: bool = a.discover_partitions
        self.metrics_path = Path(metrics_path) if metrics_path else None
        self.on_start = on_start
        self.progress: bool = a.progress
        self.update_hook = update_hook
        self.return_freed_memory: bool = a.return_freed_memory
        self.settings = {**self._own_settings(), **dict(settings or {})}
        # Built by fedrobust's apps from a run config: messages name its keys, not the constructor's arguments.
        self.from_run_config = RUN_SETTINGS_KEY in self.settings

        # node id -> partition id (discover_partitions); filled by the round loop's discovery.
        self.partitions: dict[int, int] = {}
        self.answered: set[int] = set()  # nodes that answered the partition query, with or without one
        # node id -> the num-partitions its data share is cut by, where its ClientApp says (discovery);
        # the counts are checkpointed, and a resume under other counts is warned about.
        self.num_partitions: dict[int, int] = {}
        self.checkpointed_num_partitions: list[int] = []
        # node id -> partition of a restored checkpoint's nodes whose liveness record has not been carried over
        # to this run's node on the same partition yet (a restarted simulation draws new node ids).
        self._checkpoint_partitions: dict[int, int] = {}
        # Replies the last sampled round waits for (over-selected nodes come on top).
        self.planned_replies = 0
        self.run_id: int | str = 0
        self._global: dict[str, torch.Tensor] | None = None  # the state sent in the current round
        self._global_round = 0
        self._global_arrays: ArrayRecord | None = None
        # Kept across rounds: a fresh [n, d] matrix costs a page fault per 4 KiB on first write.
        self._matrix: UpdateMatrix | None = None
        self._touching: threading.Thread | None = None  # makes a new matrix resident while clients train
        self._step_out: torch.Tensor | None = None  # the new global vector, copied into the ArrayRecord
        self._stop = threading.Event()
        self._rules: dict[int, aggregators.Aggregator] = {num_byzantine: self.aggregator}
        self._said_more_faulty = False  # the warning that more nodes were proven faulty than f, once a run
        self._said_uncounted = False  # the warning about evaluation replies without a count, once a run
        self._pins_checked = False  # key pins of nodes Flower no longer lists freed, once a run (first round)

    def _warn_about_f(self, num_byzantine: int) -> None:
        """Say once a process when f does not fit the rule (a study builds many strategies)."""
        if self.aggregator.label == "mean" and num_byzantine > 0 and not _said["plain mean"]:
            _said["plain mean"] = True
            log.warning(
                "aggregator 'mean' with num_byzantine=%d: the plain mean tolerates no faulty reply (one can move "
                "it anywhere); validation still rejects malformed ones. Pick a robust rule for f > 0, e.g. the "
                "default %r",
                num_byzantine,
                AggregatorConfig.name,
            )
        if num_byzantine == 0 and self.aggregator.label != "mean" and not _said["f=0"]:
            _said["f=0"] = True
            default = aggregators.build(AggregatorConfig.name, f=0).label
            averages = "; the default pipeline then averages every valid reply, as FedAvg does" if (
                self.aggregator.label == default) else ""
            log.warning(
                "num_byzantine=0: aggregator %s is configured for no faulty node (f=0%s); set num_byzantine to the "
                "number of nodes that may be faulty",
                self.aggregator.label, averages,
            )

    def _warn_about_rule(self, num_byzantine: int, weight_by_num_examples: bool) -> None:
        """Say once a process what a setting does not do with this rule: weights it does not take, a user's
        rule without ``min_n()`` that runs on fewer replies than f faulty ones can outvote."""
        if weight_by_num_examples and not self.aggregator.supports_weights and not _said["no weights"]:
            _said["no weights"] = True
            log.warning(
                "weight_by_num_examples=True: aggregator %s takes no weights, so every valid reply counts once "
                "whatever its num-examples (of the built-in rules only 'mean' takes them, and no stage in front "
                "of it may mix rows)",
                self.aggregator.label,
            )
        core = getattr(self.aggregator, "rule", self.aggregator)
        needs = 2 * num_byzantine + 1
        if (num_byzantine > 0 and not getattr(core, "declares_min_n", True) and self.aggregator.min_n() < needs
                and not _said["no min_n"]):
            _said["no min_n"] = True
            log.warning(
                "aggregator %s has no min_n(), so it runs on as few as %d valid repl%s; with num_byzantine=%d, "
                "faulty replies can be half or more of fewer than %d: give the rule a min_n() method returning "
                "the fewest rows it is robust on (docs/components.md)",
                self.aggregator.label, self.aggregator.min_n(), "y" if self.aggregator.min_n() == 1 else "ies",
                num_byzantine, needs,
            )

    # ------------------------------------------------------------------ settings
    def setting_name(self, argument: str, run_config_key: str) -> str:
        """How a message names a setting: ``run_config_key`` (``guard.divergence_factor``) for a strategy
        that fedrobust's apps built from a run config, else the constructor's ``argument``."""
        return run_config_key if self.from_run_config else argument

    def _own_settings(self) -> dict[str, Any]:
        """The settings that change what is computed; a checkpoint must agree with them to resume."""
        rule, pre, params = self._rule_spec
        return {
            "aggregator": self._rule_setting(rule),
            "pre": [p if isinstance(p, str) else dict(p) for p in pre],
            "aggregator_params": params,
            "num_byzantine": self.num_byzantine,
            "server_optimizer": dataclasses.asdict(self.optimizer) | {"buffers": None, "steps": None},
            "server_lr_schedule": self._schedule_setting(),
            "server_lr_min_ratio": self.server_lr_min_ratio,
            "max_update_norm": self.max_update_norm,
            "max_num_examples": self.max_num_examples,
            "weight_by_num_examples": self.weight_by_num_examples,
            "fraction_train": self.fraction_train,
            "min_train_nodes": self.min_train_nodes,
            "liveness": dataclasses.asdict(self.liveness_config),
            "divergence_factor": self.divergence_factor,
            "lr_decay": self.lr_decay,
            "seed": self.seed,
        }

    def _schedule_setting(self) -> Any:
        """The server lr schedule as a checkpoint records it: its name, or what identifies a function (for a
        functools.partial, its function and bound values: every partial is the same class)."""
        schedule = self.server_lr_schedule
        if isinstance(schedule, str):
            return schedule
        from fedrobust.components import rule_identity

        if isinstance(schedule, functools.partial):
            def plain(value: Any) -> Any:  # a scalar as it is; another object by its type (its repr has an address)
                return value if isinstance(value, bool | int | float | str | type(None)) else type(value).__qualname__

            return {"partial": rule_identity(schedule.func), "args": [plain(a) for a in schedule.args],
                    "keywords": {k: plain(v) for k, v in sorted(schedule.keywords.items())}}
        return rule_identity(schedule)

    def _rule_setting(self, rule: Any) -> Any:
        """How the checkpoint's settings name the rule: its name; a built Aggregator's label; for a user's
        function, class or object, its name, code and settings (:func:`fedrobust.components.rule_identity`)."""
        if isinstance(rule, str):
            return rule
        if isinstance(rule, aggregators.Aggregator):
            return self.aggregator.label
        from fedrobust.components import rule_identity  # as aggregators.build imports it: for user rules only

        return rule_identity(rule)

    def request_stop(self) -> None:
        """Ask a running :meth:`start` to checkpoint and stop before its next round (e.g. on SIGTERM)."""
        self._stop.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    # ------------------------------------------------------------------ sampling
    def refresh_liveness(self, grid: Grid, server_round: int) -> list[int]:
        """Feed Flower's node list into the liveness tracker; return the nodes eligible in ``server_round``."""
        nodes = list(grid.get_nodes())
        self._carry_over_by_partition({info.node_id for info in nodes})
        node_ids = []
        for info in nodes:
            node_ids.append(info.node_id)
            status = getattr(info, "status", "")
            # Simulation nodes report no status; a node the SuperLink marks offline is dead now.
            self.liveness.observe_node(info.node_id, online=status not in ("offline", "unregistered"))
        # A node Flower no longer lists is offline too: unregistered, or one from before a restart that gave
        # the nodes new ids (a resumed simulation). Otherwise it would be reported alive for ever.
        listed = set(node_ids)
        self.liveness.observe_listed(listed)
        if not self._pins_checked:
            # Once a run, at its first round: pins restored from a checkpoint name node ids from before a
            # restart. Later, a node drops off the list while it is merely offline; its key stays its own.
            self.signatures.release_gone(listed)
            self._pins_checked = True
        return self.liveness.eligible(node_ids, server_round)

    def _carry_over_by_partition(self, listed: set[int]) -> None:
        """After a resume, give each checkpoint node's liveness record (a quarantine above all) to the node
        that holds its partition now: a restarted simulation draws new node ids, and the client would
        otherwise come back unquarantined while its old id stayed counted as proven faulty. Nodes whose
        partition is not known yet are carried over at a later round's node list."""
        if not self._checkpoint_partitions:
            return
        holders: dict[int, list[int]] = {}
        for node, partition in self.partitions.items():
            if node in listed:
                holders.setdefault(partition, []).append(node)
        for old, partition in list(self._checkpoint_partitions.items()):
            if old in listed:  # the same id (a SuperNode that kept it): its record is its own already
                del self._checkpoint_partitions[old]
            elif len(holders.get(partition, [])) == 1:  # two nodes on one partition: no telling which
                self.liveness.carry_over(old, holders[partition][0])
                del self._checkpoint_partitions[old]

    def _order(self, node_ids: Iterable[int]) -> list[int]:
        """Nodes in a fixed order: by partition where known (node ids are random per run), then by id."""
        return sorted(node_ids, key=lambda n: (self.partitions.get(n, -1), n))

    def sample_size(self, num_eligible: int) -> int:
        """Nodes to train in a round, as Flower's FedAvg computes it, capped at what is eligible.

        Never fewer than the rule needs (``min_n``, e.g. ``2f + 1``) where that many are eligible: a
        round sampled smaller could not be aggregated even if every reply were valid.
        """
        wanted = max(int(num_eligible * self.fraction_train + 1e-9), self.min_train_nodes, self.aggregator.min_n())
        return min(num_eligible, wanted)

    def sample(self, server_round: int, eligible: Iterable[int], attempt: int = 0) -> list[int]:
        """Pick this round's nodes, seeded by (seed, round, attempt); over-selection included."""
        candidates = self._order(eligible)
        if self.discover_partitions:  # only nodes that answered (a device with its own data has no partition)
            candidates = [n for n in candidates if n in self.partitions or n in self.answered]
        self.planned_replies = self.sample_size(len(candidates))
        want = min(len(candidates), self.planned_replies + self.over_select)
        rng = np.random.default_rng([self.seed, server_round, attempt])
        picked: np.ndarray | list[int] = rng.choice(len(candidates), size=want, replace=False) if want else []
        return self._order(candidates[i] for i in picked)

    # ------------------------------------------------------------------ Strategy API
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Messages for this round's sampled nodes: global arrays, round, a fresh nonce, the config."""
        return self.train_messages(server_round, arrays, config, grid)

    def train_messages(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid, *, attempt: int = 0
    ) -> list[Message]:
        """:meth:`configure_train` for one attempt of a round (a retried round samples anew)."""
        if self.return_freed_memory:  # before the replies arrive: their buffers are allocated under it
            memory.return_large_frees_to_os()
        self._remember_global(server_round, arrays)
        self.run_id = grid.run.run_id
        nodes = self.sample(server_round, self.refresh_liveness(grid, server_round), attempt)
        self._reserve_rows(len(nodes))
        return [self._message(node, server_round, arrays, config, MessageType.TRAIN) for node in nodes]

    def _message(
        self, node_id: int, server_round: int, arrays: ArrayRecord, config: ConfigRecord, kind: str
    ) -> Message:
        cfg = ConfigRecord(dict(config))
        cfg[protocol.SERVER_ROUND] = server_round
        if kind == MessageType.TRAIN:
            cfg[protocol.NONCE] = self.signatures.nonce(node_id, server_round)
            # What a signing mod must sign, where the app names it otherwise than Flower's defaults.
            if self.weighted_by_key != protocol.NUM_EXAMPLES:
                cfg[protocol.NUM_EXAMPLES_KEY] = self.weighted_by_key
            if self.arrayrecord_key != protocol.ARRAYS:
                cfg[protocol.ARRAYS_KEY] = self.arrayrecord_key
        content = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: cfg})
        return Message(content, message_type=kind, dst_node_id=node_id)

    def _remember_global(self, server_round: int, arrays: ArrayRecord) -> None:
        if self._global is None or self._global_round != server_round or self._global_arrays is not arrays:
            self._global = dict(arrays.to_torch_state_dict())
            self._global_round = server_round
            self._global_arrays = arrays

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate each reply on its own, aggregate the accepted ones robustly, step the server optimizer."""
        outcome = self.aggregate_round(server_round, replies)
        return outcome.arrays, outcome.metric_record()

    def aggregate_round(
        self, server_round: int, replies: Iterable[Message], sent: Mapping[str, int] | None = None
    ) -> RoundOutcome:
        """:meth:`aggregate_train`, returning the whole outcome of the round.

        Parameters
        ----------
        sent : mapping, optional
            Message id -> destination node of the messages sent this round. Error replies from a
            SuperLink carry the SuperLink's node id, not the client's: with ``sent`` they are
            attributed to the right node. Without it, the source node id is used.
        """
        replies = list(replies)
        sent = dict(sent or {})
        repliers = [
            sent.get(r.metadata.reply_to_message_id, r.metadata.src_node_id) for r in replies if not r.has_error()
        ]
        intake = self.open_round(server_round, [*sent.values(), *repliers])
        intake.expect(sent)
        for reply in replies:
            intake.take(reply)
        return intake.close()

    def open_round(self, server_round: int, nodes: Iterable[int]) -> RoundIntake:
        """Take the replies of a round as they arrive, from ``nodes`` (the nodes sent a message).

        Each reply is checked and written into its row when it comes in (:meth:`RoundIntake.take`),
        so that the round's aggregation after the last reply has only the rule and the step left,
        and each reply's bytes can be freed at once. :meth:`RoundIntake.close` aggregates.
        """
        if self._global is None or self._global_round != server_round:
            raise RuntimeError(
                f"aggregate_train(round {server_round}) needs configure_train for that round first: "
                "the update of each reply is computed against the global model that was sent"
            )
        return RoundIntake(self, server_round, self._order(set(nodes)))

    def _aggregate_accepted(self, outcome: RoundOutcome, accepted: list[ClientUpdate]) -> RoundOutcome:
        """Aggregate the rows of ``accepted`` (the matrix's rows, in order) and step the server optimizer."""
        server_round, matrix = outcome.round, self._matrix
        assert matrix is not None  # built by open_round
        global_state = self._global
        assert global_state is not None
        # Before the hook: a simulated adversary with full knowledge sees the server update the rule gets.
        server_update, server_update_seconds = None, 0.0
        if self.aggregator.needs_server_update and accepted:
            began = time.perf_counter()
            server_update = self._server_update(server_round, global_state, matrix)
            server_update_seconds = time.perf_counter() - began  # counted in the round's aggregation time
        if self.update_hook is not None and accepted:
            accepted = self._run_hook(server_round, accepted, matrix, outcome, server_update)
        outcome.accepted = [u.node_id for u in accepted]
        outcome.train_metrics = self._train_metrics(accepted)
        proven = self._proven_faulty(outcome)
        self._say_if_more_faulty(server_round, len(proven), outcome.rejected)
        f_used = max(0, self.num_byzantine - len(proven))
        rule = self._rule_for(f_used)
        outcome.f_used = f_used
        need = outcome.needed = rule.min_n()
        if len(accepted) < need:
            lowered = (f" (num_byzantine={self.num_byzantine} less {len(proven)} proven faulty)"
                       if proven and self.num_byzantine else "")
            outcome.why_not_aggregated = (
                f"{len(accepted)} valid replies, {rule.label} with f={f_used}{lowered} needs at least {need}"
            )
            if outcome.sampled < need:  # no retry can help while so few nodes are there to ask
                outcome.why_not_aggregated += (
                    f"; only {outcome.sampled} nodes could be asked: connect more (a local simulation: its "
                    f"federation's num-supernodes; a deployment: see flwr supernode ls) or "
                    + self.too_few_advice(outcome.sampled, f_used)
                )
            outcome.why_not_aggregated += _rejections_text(outcome, self.num_byzantine, self.setting_name)
            return outcome
        start = time.perf_counter()
        assert len(matrix) == len(accepted)
        device = self.aggregation_device
        weights = None
        if self.weight_by_num_examples and rule.supports_weights:
            weights = torch.tensor([float(u.num_examples) for u in accepted], device=device)
        if rule.needs_server_update:
            assert server_update is not None  # every f's rule is the configured one
            rule.set_server_update(server_update.to(device))
        # On a CUDA device: one asynchronous copy from the page-locked matrix; the rule's first kernel
        # waits for it on the same stream. The aggregate's copy back synchronises.
        rows = matrix.rows().to(device, non_blocking=True)
        try:
            aggregate = self._call_rule(rule, rows, weights, self._client_ids(outcome.accepted)).to("cpu")
        except Exception as err:  # a user's rule raising: say which rule, in which round, on how many rows
            raise AggregationError(
                f"round {server_round}: aggregator {rule.label} failed on {len(accepted)} replies: "
                f"{type(err).__name__}: {err}"
            ) from err
        if not bool(torch.isfinite(aggregate).all()):
            # Every row was checked finite: the rule made the NaN or infinity. Not a divergence to roll back
            # with a lower server lr (which cannot help), but a round the rule could not aggregate.
            bad = int((~torch.isfinite(aggregate)).sum())
            outcome.why_not_aggregated = (
                f"aggregator {rule.label} returned {bad} non-finite values of {aggregate.numel()} from "
                f"{len(accepted)} finite replies"
            )
            return outcome
        outcome.f_used = getattr(rule, "last_f", f_used)  # lower where dedup took copies out (its lower_f)
        outcome.filtered = [outcome.accepted[i] for i in getattr(rule, "last_filtered", ())]
        outcome.filtered_by = {outcome.accepted[i]: by for i, by in getattr(rule, "last_filtered_by", {}).items()}
        outcome.excluded = [outcome.accepted[i] for i in getattr(rule, "last_excluded", ())]
        if self._step_out is None or self._step_out.shape != (matrix.dim,):
            self._step_out = torch.empty(matrix.dim, dtype=torch.float32)
        layout = [(k, tuple(global_state[k].shape)) for k in matrix.keys]
        stepped = self.optimizer.step_flat(matrix.global_flat(), aggregate, layout, out=self._step_out)
        _statistics_take_the_aggregate(stepped, matrix.global_flat(), aggregate, layout)
        # Views on the step's vector (converted copies for non-float32 tensors); the ArrayRecord copies once.
        new_state = {**global_state, **matrix.unflatten(stepped)}
        outcome.arrays = ArrayRecord(new_state)
        outcome.seconds_aggregate = time.perf_counter() - start + server_update_seconds
        outcome.aggregated = True
        return outcome

    def _server_update(
        self, server_round: int, global_state: Mapping[str, torch.Tensor], matrix: UpdateMatrix
    ) -> torch.Tensor:
        """The server's own update of the round, flattened like the rows of ``matrix`` (float32)."""
        assert self.server_update_fn is not None  # checked in __init__
        update = self.server_update_fn(server_round, global_state)
        missing = [k for k in matrix.keys if k not in update]
        if missing:
            raise ValueError(f"server_update_fn returned no array for {missing[:3]}; it must be keyed like the model")
        return flatten([update], matrix.keys)[0]

    def _rule_after(self, outcome: RoundOutcome) -> tuple[aggregators.Aggregator, int]:
        """The rule for the round so far, and its ``f``: nodes proven faulty are Byzantine nodes the rule
        no longer has to outvote among the accepted rows."""
        f = max(0, self.num_byzantine - len(self._proven_faulty(outcome)))
        return self._rule_for(f), f

    def _train_metrics(self, accepted: list[ClientUpdate]) -> dict[str, float]:
        """The clients' training metrics of the round: by ``train_metrics_aggr_fn`` where given, else each
        metric trimmed of its ``num_byzantine`` highest and lowest values and example-weighted, as
        federated evaluation's are."""
        if not accepted:
            return {}
        if self.train_metrics_aggr_fn is None:
            own = (self.weighted_by_key, protocol.SIM_BYZANTINE)
            keys = sorted({k for u in accepted for k in u.metrics if k not in own})
            aggregated: Mapping[str, Any] = {
                k: _trimmed_weighted(pairs, self.num_byzantine)
                for k in keys
                if (pairs := [(x, u.num_examples) for u in accepted if (x := _finite(u.metrics.get(k))) is not None])
            }
        else:
            records = [
                RecordDict({protocol.METRICS: MetricRecord({**u.metrics, self.weighted_by_key: u.num_examples})})
                for u in accepted
            ]
            aggregated = self.train_metrics_aggr_fn(records, self.weighted_by_key)
        return _train_named(aggregated)

    def _proven_faulty(self, outcome: RoundOutcome) -> set[int]:
        """Nodes proven faulty: a reply rejected this round, or quarantined for earlier ones."""
        proven = {e["node"] for e in outcome.rejected_nodes}
        proven.update(n for n in self.liveness.known_nodes() if self.liveness.status(n) == "quarantined")
        return proven

    def _say_if_more_faulty(self, server_round: int, proven: int, rejected: Counter[str]) -> None:
        """Warn, once a run, when more nodes were proven faulty than ``num_byzantine``: the rule's assumption
        of at most f faulty nodes is then known not to hold, and faulty nodes that validation cannot see
        may be left with no rows to outvote them. When this round's rejections share one reason, that is
        said first: nodes failing alike point at a setting or the ClientApp, not at f."""
        if proven <= self.num_byzantine or self._said_more_faulty:
            return
        self._said_more_faulty = True
        alike = len(rejected) == 1 and sum(rejected.values()) > max(self.num_byzantine, 1)
        advice = (
            f"{sum(rejected.values())} replies were rejected for the same reason ({next(iter(rejected))}), which "
            "points at a setting or the ClientApp's replies rather than at faulty nodes: fix that first (the "
            "reason's detail is in the round's line); if the nodes do misbehave, raise num_byzantine"
        ) if alike else (
            "raise num_byzantine to the number of nodes that may misbehave, or fix the rejected ones (their "
            "reasons are in the round's line)"
        )
        log.warning(
            "round %d: %d node%s proven faulty (rejected or quarantined), more than num_byzantine=%d: the rule "
            "tolerates f faulty nodes, and misconfigured nodes count among them; %s. Said once a run.",
            server_round,
            proven,
            "" if proven == 1 else "s",
            self.num_byzantine,
            advice,
        )

    def _rule_for(self, f: int) -> aggregators.Aggregator:
        """The configured pipeline with ``f`` (a lower f after rejections); state shared with the main one."""
        if f not in self._rules:
            rule, pre, params = self._rule_spec
            if not isinstance(rule, str):
                return self.aggregator  # a user-built aggregator keeps its own f
            self._rules[f] = aggregators.build(rule, f=f, pre=pre, **params)
        return self._rules[f]

    def too_few_advice(self, n: int, f: int) -> str:
        """What to change when the pipeline with ``f`` needs more than ``n`` rows: the rule's own parameters
        where they are what asks for more (trimmed_mean's ``trim``), else num_byzantine, with the largest f
        that ``n`` rows take."""
        rule, pre, params = self._rule_spec
        if rule in aggregators.names() and params:  # a built-in rule: its defaults tell whether params ask for more
            try:
                defaults_fit = aggregators.build(rule, f=f, pre=pre).min_n() <= n
            except ValueError:  # a parameter without a default (none of the built-ins' has one today)
                defaults_fit = False
            if defaults_fit:
                return f"lower the rule's parameters (aggregator_params={params}: with f={f} they need more than {n})"
        fits = self._largest_f_for(n, f)
        return "lower num_byzantine" + (f" (with {n} nodes, at most {fits})" if fits is not None else "")

    def _largest_f_for(self, n: int, below: int) -> int | None:
        """The largest f under ``below`` whose pipeline takes ``n`` rows; None for a user-built aggregator or
        when not even f=0 does."""
        rule, pre, params = self._rule_spec
        if not isinstance(rule, str):
            return None
        fits = (f for f in range(below - 1, -1, -1) if aggregators.build(rule, f=f, pre=pre, **params).min_n() <= n)
        return next(fits, None)

    def _client_ids(self, nodes: list[int]) -> list[int]:
        """The stable id of each node's client for stages that remember clients: its partition where every
        node's is known and no two share one (node ids are new in every simulation run, partitions are
        not), else its node id."""
        partitions = [self.partitions.get(n) for n in nodes]
        if None not in partitions and len(set(partitions)) == len(partitions):
            return [p for p in partitions if p is not None]
        return list(nodes)

    def _call_rule(
        self,
        rule: aggregators.Aggregator,
        matrix: torch.Tensor,
        weights: torch.Tensor | None,
        clients: list[int] | None = None,
    ) -> torch.Tensor:
        if rule is self.aggregator:
            return rule(matrix, weights, clients=clients)
        # Stateful pipelines (centered clipping's center, the direction filter's memory) carry on from the main one.
        rule.load_state_dict(self.aggregator.state_dict())
        result = rule(matrix, weights, clients=clients)
        self.aggregator.load_state_dict(rule.state_dict())
        return result

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Federated evaluation on ``fraction_evaluate`` of the live nodes (none when it is 0)."""
        if self.fraction_evaluate == 0.0:
            return []
        eligible = self._order(self.liveness.eligible(grid.get_node_ids(), server_round))
        want = min(len(eligible), max(int(len(eligible) * self.fraction_evaluate + 1e-9), self.min_evaluate_nodes))
        rng = np.random.default_rng([self.seed, server_round, 0xE7A1])
        picked: np.ndarray | list[int] = rng.choice(len(eligible), size=want, replace=False) if want else []
        return [self._message(eligible[i], server_round, arrays, config, MessageType.EVALUATE) for i in sorted(picked)]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The clients' evaluation metrics, each trimmed of its ``num_byzantine`` highest and lowest values,
        then example-weighted as in FedAvg (the median where fewer than ``2f + 1`` replies have it).

        Clients report these numbers themselves: untrimmed, one client could set the federated loss or
        accuracy by claiming a huge example count or an extreme value. Replies that are errors, have no
        finite metrics, or claim a count outside ``(0, max_num_examples]`` are skipped.
        """
        rows: list[tuple[dict[str, float], float]] = []
        contents: list[RecordDict] = []
        uncounted = 0
        for reply in replies:
            if reply.has_error() or not reply.content.metric_records:
                continue
            records = reply.content.metric_records
            record = records.get(protocol.METRICS) or next(iter(records.values()))
            count = _finite(record.get(self.weighted_by_key))
            if count is None or not 0 < count <= self.max_num_examples:
                uncounted += 1
                continue
            scalars = {k: x for k, v in record.items() if k != self.weighted_by_key and (x := _finite(v)) is not None}
            rows.append((scalars, count))
            contents.append(reply.content)
        if uncounted and not self._said_uncounted:
            self._said_uncounted = True  # a ClientApp's mistake, the same in every round: said once a run
            log.warning(
                "round %d: %d evaluation replies left out: their %r is missing or not in (0, max_num_examples=%d] "
                "(the evaluate reply's MetricRecord needs it, as the train reply's does). Said once a run.",
                server_round, uncounted, self.weighted_by_key, self.max_num_examples,
            )
        if self.evaluate_metrics_aggr_fn is not None:
            return self.evaluate_metrics_aggr_fn(contents, self.weighted_by_key) if contents else None
        keys = sorted({k for r, _ in rows for k in r})
        if not keys:
            return None
        return MetricRecord({k: _trimmed_weighted([(r[k], c) for r, c in rows if k in r], self.num_byzantine)
                             for k in keys})

    def summary(self) -> None:
        """Log the strategy's configuration (:meth:`describe`); ``start()`` shows it with the round lines."""
        log.info("%s", self.describe())

    def describe(self) -> str:
        """The strategy's configuration in one line."""
        signatures = "required" if self.signatures.require else ("checked" if self.signatures.trust else "off")
        evaluation = (f"fraction_evaluate={self.fraction_evaluate:g}" if self.fraction_evaluate
                      else "federated evaluation off (fraction_evaluate=0)")
        params = self._rule_spec[2]
        shown = f" {', '.join(f'{k}={v!r}' for k, v in sorted(params.items()))}" if params else ""
        return (
            f"RobustStrategy: rule={self.aggregator.label}{shown} f={self.num_byzantine} "
            f"fraction_train={self.fraction_train:g} min_train_nodes={self.min_train_nodes} {evaluation} "
            f"server-opt={self._optimizer_text()} max-norm={self.max_update_norm} "
            f"signatures={signatures} checkpoints={self._checkpoint_text()}"
        )

    def _optimizer_text(self) -> str:
        """``fedadam(lr=0.1, beta_1=0.9, beta_2=0.99, tau=0.001, cosine to 0.1 x lr)``: what the server step reads."""
        opt = self.optimizer
        parts = [f"lr={opt.lr:g}", *(f"{name}={getattr(opt, name):g}" for name in SERVER_OPTIMIZER_PARAMS[opt.name])]
        if callable(self.server_lr_schedule):
            schedule = self.server_lr_schedule
            parts.append(f"schedule {getattr(schedule, '__qualname__', type(schedule).__name__)}")
        elif self.server_lr_schedule != "constant":
            parts.append(f"{self.server_lr_schedule} to {self.server_lr_min_ratio:g} x lr")
        return f"{opt.name}({', '.join(parts)})"

    def _checkpoint_text(self) -> str:
        """``DIR (every 1 round(s), keep 3, mirror s3://bucket/run)`` or ``off``."""
        if not self.checkpoint_dir:
            return "off"
        every, parts = self.checkpoint_every, []
        if every == CHECKPOINT_INTERVAL_AUTO:
            parts.append("at the Young/Daly interval")
        elif every:
            parts.append(f"every {every} round(s)")
        if self.checkpoint_every_seconds:
            parts.append(f"every {self.checkpoint_every_seconds:g} s")
        if not every:
            parts.append("after the last round")
        parts.append(f"keep {self.checkpoint_keep}")
        if self.checkpoint_full_every > 1:
            parts.append(f"a full one every {self.checkpoint_full_every}")
        if self.checkpoint_mirror:
            parts.append(f"mirror {self.checkpoint_mirror}")
        return f"{self.checkpoint_dir} ({', '.join(parts)})"

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Run the fault-tolerant loop for ``num_rounds`` rounds (or resume it) and return Flower's Result.

        Each round: liveness from ``grid.get_nodes()``, sample, push, pull until quorum or
        deadline (``round_deadline``, else ``timeout``), validate each reply, aggregate robustly
        or retry the round, step, evaluate (``evaluate_fn`` and/or federated), roll back a
        diverged model, checkpoint.

        Raises
        ------
        NoNodesError
            Fewer than ``min_available_nodes`` nodes connected within ``wait_for_nodes``.
        QuorumError
            A round stayed below the rule's minimum of valid replies after every retry, or its model
            diverged at every retry (a checkpoint of the last completed round is written first). Its
            ``result`` is the Result of the rounds that completed (``result.arrays``: the last one's model).
        CheckpointMismatchError
            The checkpoint to resume from was saved with other settings or another model
            (``force_resume=True`` resumes anyway where only settings differ).
        NoValidCheckpointError
            ``checkpoint_dir`` holds checkpoints but none of them verifies (``resume="never"`` starts fresh).
        CheckpointStorageError
            The checkpoint storage cannot be used (not writable, no credentials).
        ClientFailureError
            Every reply of a round failed on the clients with the same error.
        AggregationError
            The rule raised on a round's valid replies (the message names it and the round).
        fedrobust.dir_lock.DirectoryInUseError
            Another run writes ``checkpoint_dir`` now.
        Preempted
            :meth:`request_stop` was called (SIGTERM/SIGINT); a checkpoint was written first.
        """
        from fedrobust.strategies.round_loop import RoundLoop

        check(
            isinstance(num_rounds, int) and num_rounds >= 1, f"num_rounds must be an integer >= 1, got {num_rounds!r}"
        )
        if self.round_deadline is None:  # else the round deadline is the rounds' timeout, and this one unused
            check(is_number(timeout) and float(timeout) > 0,
                  f"timeout must be a number of seconds > 0, got {timeout!r} ({type(timeout).__name__})")
        check(evaluate_fn is None or callable(evaluate_fn),
              f"evaluate_fn must be a function (server_round, arrays) -> MetricRecord or None, got {evaluate_fn!r}")
        _check_initial_arrays(initial_arrays)
        self._pins_checked = False
        self._said_more_faulty = self._said_uncounted = False  # said once a run
        # What this run's nodes report; a reused strategy's earlier nodes (other ids, other counts) do not count.
        self.num_partitions.clear()
        self.checkpointed_num_partitions = []
        self._checkpoint_partitions = {}  # set again by a checkpoint this run resumes from
        self.liveness.forget_heard()  # nor in the liveness report
        wide = sorted(k for k, a in initial_arrays.items() if a.dtype == "float64")
        if wide:
            log.warning(
                "%d float64 arrays (%s): the server aggregates and steps the model in float32, so each round they "
                "come back rounded to float32 values (still typed float64): their float64 precision is not kept",
                len(wide),
                ", ".join(wide[:3]) + (", ..." if len(wide) > 3 else ""),
            )
        loop = RoundLoop(
            self,
            grid,
            num_rounds=num_rounds,
            deadline=self.round_deadline if self.round_deadline is not None else timeout,
            train_config=train_config or ConfigRecord(),
            evaluate_config=evaluate_config or ConfigRecord(),
            evaluate_fn=evaluate_fn,
        )
        # Under flwr run (a thread of flwr-simulation) a signal or `flwr stop` ends the process through
        # Flower's exit path, which then waits for this run's checkpoint; on a deployment (flwr-serverapp,
        # the main thread) SIGTERM/SIGINT ask for the stop directly while the run lasts.
        with on_flower_exit(self.request_stop):
            return loop.run(initial_arrays)

    def check_resume(
        self, initial_arrays: ArrayRecord, num_rounds: int = 3, train_config: ConfigRecord | None = None
    ) -> int | None:
        """The round a :meth:`start` with these arguments would resume after (None: it would start at round
        1), raising the checkpoint errors ``start()`` would raise there, without a node and without changing
        anything on disk. Call it before starting the nodes (a simulation's Ray, a deployment's SuperNodes)
        to have a resume refused in seconds.

        Raises
        ------
        CheckpointMismatchError, NoValidCheckpointError, CheckpointStorageError
            As :meth:`start`.
        """
        from fedrobust.strategies.round_loop import checkpointer_for

        _check_initial_arrays(initial_arrays)
        checkpointer = checkpointer_for(self, num_rounds, train_config or ConfigRecord())
        try:
            return checkpointer.check_resume(initial_arrays)
        finally:
            checkpointer.close()

    # ------------------------------------------------------------------ validation
    def _reserve_rows(self, count: int) -> None:
        """Have the update matrix for ``count`` replies resident before they arrive.

        A matrix built now (first round, more nodes than before, another model) is touched
        in a background thread while the clients train; the page faults of a first write
        then cost no time on the reply path. :meth:`_matrix_for` waits for that thread.
        """
        if count == 0:
            return
        current = self._matrix
        matrix = self._matrix_for(count)
        if matrix is not current:
            # Not a daemon: an interpreter that exits meanwhile waits the few seconds for it instead of
            # aborting under a thread still writing into torch memory.
            self._touching = threading.Thread(target=matrix.touch, name="fedrobust-touch-rows")
            self._touching.start()
            # The rules' CPU kernels load meanwhile too, not in the first round's aggregation (about 1 s).
            threading.Thread(target=aggregators.load_kernels, name="fedrobust-load-kernels").start()

    def _matrix_for(self, capacity: int) -> UpdateMatrix:
        """The strategy's update matrix, reset to this round's global model, with room for ``capacity`` rows."""
        assert self._global is not None
        if self._touching is not None:  # rows are written only once the touch is over
            self._touching.join()
            self._touching = None
        max_norm = self.max_update_norm or 0.0
        matrix = self._matrix
        if matrix is not None and matrix.capacity >= capacity:
            try:
                matrix.reset(self._global)
            except ValueError:  # the model's names, shapes or dtypes changed: build one for the new model
                matrix = None
        if matrix is None or matrix.capacity < capacity:
            self._matrix = None  # let the old storage go before the new one is reserved
            matrix = UpdateMatrix(
                self._global, max(capacity, 1), max_norm=max_norm, pin_memory=self.aggregation_device.type == "cuda"
            )
        matrix.max_norm = max_norm
        self._matrix = matrix
        return matrix

    def _parse(
        self, server_round: int, node_id: int, reply: Message, matrix: UpdateMatrix, row: int
    ) -> ClientUpdate | Rejection:
        """Parse, verify the signature, check num-examples, then check and write the update into ``row``."""
        parsed = parse_reply(reply.content, arrayrecord_key=self.arrayrecord_key, weighted_by_key=self.weighted_by_key)
        if isinstance(parsed, Rejection):
            return parsed
        try:
            reason = self.signatures.verify(
                run_id=self.run_id,
                node_id=node_id,
                server_round=server_round,
                record=parsed.signature,
                arrays=parsed.arrays,  # read-only views: the digest hashes the reply's bytes in place
                num_examples=parsed.num_examples,
                partitions=self.partitions,
            )
            if reason is not None:
                return Rejection(reason, REASON_DETAILS.get(reason, "signature check failed"))
            # Structure, finiteness and norm in one pass that also writes the row (local - global for
            # Flower's convention): the reply's bytes are read once.
            rejection = check_num_examples(parsed.num_examples, self.max_num_examples) or matrix.add(
                parsed.arrays, full_weights=parsed.full_weights, row=row
            )
        finally:
            # The row holds all that is needed now: let the reply's bytes go (the caller's list of
            # replies would otherwise keep every reply alive until the round ends).
            parsed.release()
        if rejection is not None:
            self.signatures.unpin_last()
            return rejection
        return ClientUpdate(
            node_id=node_id,
            partition_id=self.partitions.get(node_id, -1),
            num_examples=parsed.num_examples,
            metrics=parsed.metrics,
            sim_byzantine=parsed.sim_byzantine,
        )

    def _run_hook(
        self,
        server_round: int,
        accepted: list[ClientUpdate],
        matrix: UpdateMatrix,
        outcome: RoundOutcome,
        server_update: torch.Tensor | None,
    ) -> list[ClientUpdate]:
        """Let ``update_hook`` rewrite rows in place; check the rewritten rows again and drop those that fail."""
        assert self.update_hook is not None
        byzantine = torch.tensor([u.sim_byzantine for u in accepted], dtype=torch.bool)
        clients = self._client_ids([u.node_id for u in accepted])
        rewritten = self.update_hook(
            RoundUpdates(server_round, matrix.rows(), byzantine, clients, server_update, matrix.global_flat())
        )
        indices = range(len(accepted)) if rewritten is None else sorted({int(i) for i in rewritten})
        failed = []
        for index in indices:
            rejection = matrix.recheck(index)
            if rejection is not None:
                self._reject(server_round, accepted[index].node_id, outcome, rejection)
                failed.append(index)
        if not failed:
            return accepted
        matrix.drop(failed)
        return [u for i, u in enumerate(accepted) if i not in set(failed)]

    def _reject(self, server_round: int, node_id: int, outcome: RoundOutcome, rejection: Rejection) -> None:
        outcome.rejected[rejection.reason] += 1
        partition = self.partitions.get(node_id)
        outcome.rejected_nodes.append(
            {"node": node_id, "partition": partition, "reason": rejection.reason, "detail": rejection.detail}
        )
        log.debug(  # the round's progress lines name it (reporting.node_lines): at INFO it showed twice
            "round %d: rejected reply of node %d%s: %s (%s)",
            server_round,
            node_id,
            f" (partition {partition})" if partition is not None else "",
            rejection.reason,
            rejection.detail,
        )
        if self.liveness_config.quarantine_after > 0:
            self.liveness.record_rejection(node_id, server_round, rejection.reason)

    # ------------------------------------------------------------------ state
    def round_lr(self, server_round: int, num_rounds: int) -> float:
        """The server lr of round ``server_round`` of ``num_rounds`` by the schedule (before any rollback)."""
        schedule = self.server_lr_schedule
        if callable(schedule):
            factor = float(schedule(server_round, num_rounds))
            if not (math.isfinite(factor) and factor > 0):
                raise ValueError(f"server_lr_schedule returned {factor!r} for round {server_round}: must be > 0")
        else:
            factor = lr_factor(schedule, server_round, num_rounds, self.server_lr_min_ratio)
        return self.server_lr * factor

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Server optimizer, aggregator, liveness and key-pin state, for checkpoints."""
        opt_tensors, opt_meta = self.optimizer.state_dict()
        tensors = {f"optimizer/{k}": v for k, v in opt_tensors.items()}
        # On the CPU whatever the aggregation device: a checkpoint resumes on any machine.
        tensors.update({f"aggregator/{k}": v.cpu() for k, v in self.aggregator.state_dict().items()})
        meta = {
            "optimizer": opt_meta,
            "server_lr": self.optimizer.lr,
            "liveness": self.liveness.state_dict(),
            "signatures": self.signatures.state_dict(),
            "num_partitions": sorted(set(self.num_partitions.values())) or self.checkpointed_num_partitions,
            # Which partition each node id held, so that a resume with new ids carries the records over.
            "partitions": {str(n): p for n, p in sorted(self.partitions.items())},
        }
        return tensors, meta

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.optimizer.load_state_dict(_strip(tensors, "optimizer/"), meta["optimizer"])
        self.optimizer.lr = float(meta.get("server_lr", self.optimizer.lr))
        self.aggregator.load_state_dict(_strip(tensors, "aggregator/"))
        if "liveness" in meta:
            self.liveness.load_state_dict(meta["liveness"])
        self.signatures.load_state_dict(meta.get("signatures", {}))
        self.checkpointed_num_partitions = [int(n) for n in meta.get("num_partitions", [])]
        self._checkpoint_partitions = {int(n): int(p) for n, p in meta.get("partitions", {}).items()}


# Batch-norm running statistics estimate the data's moments; they are not weights. They take the aggregate
# of the clients' values: a server lr or momentum would step past it, and a running variance carried below
# 0 makes every evaluation NaN. The names are torch.nn's batch norms' (fedrobust.validation.RUNNING_STATISTICS).
def _statistics_take_the_aggregate(
    stepped: torch.Tensor,
    global_flat: torch.Tensor,
    aggregate: torch.Tensor,
    layout: Sequence[tuple[str, tuple[int, ...]]],
) -> None:
    """Set the running statistics' elements of ``stepped`` to the global values plus the aggregated update:
    the same sum as ``fedavg`` at server lr 1 (the same bits there), whatever the optimizer."""
    start = 0
    for key, shape in layout:
        stop = start + math.prod(shape)
        if is_running_statistic(key):
            torch.add(global_flat[start:stop].to(stepped), aggregate[start:stop].to(stepped), out=stepped[start:stop])
        start = stop


def _strip(tensors: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def _finite(value: object) -> float | None:
    """``value`` as a float when it is a finite real number (not a bool), else None."""
    return float(value) if is_number(value) and math.isfinite(value) else None


def _trimmed_weighted(values: list[tuple[float, float]], f: int) -> float:
    """The count-weighted mean of ``(value, count)`` pairs without the ``f`` lowest and ``f`` highest values;
    their median when there are not ``2f + 1`` of them."""
    ordered = sorted(values)
    if len(ordered) <= 2 * f:
        return float(np.median([v for v, _ in ordered]))
    kept = ordered[f : len(ordered) - f]
    return sum(v * c for v, c in kept) / sum(c for _, c in kept)


def _rejections_text(
    outcome: RoundOutcome, tolerated: int, setting_name: Callable[[str, str], str], shown: int = 3
) -> str:
    """``; rejected 5: 5x non_finite (...)``: the most common reasons,
    each with the detail of its first reply, or nothing when no reply was rejected. More than ``tolerated``
    (num_byzantine) replies rejected for one reason are said to look like a bug, not an attack."""
    if not outcome.rejected_nodes:
        return ""
    detail: dict[str, str] = {}
    for entry in outcome.rejected_nodes:
        detail.setdefault(entry["reason"], entry["detail"])
    parts = "; ".join(f"{n}x {reason} ({detail[reason]})" for reason, n in outcome.rejected.most_common(shown))
    # A bound set too low for the model rejects honest nodes too: name the setting that moves it.
    bounds = [setting_name(*_BOUND_SETTINGS[r]) for r, _ in outcome.rejected.most_common(shown) if r in _BOUND_SETTINGS]
    hint = f" (if these nodes are honest, raise the bound: {'; '.join(bounds)})" if bounds else ""
    total = sum(outcome.rejected.values())
    if not hint and len(outcome.rejected) == 1 and total > max(tolerated, 1):
        hint = (f" (more than num_byzantine={tolerated} nodes failing alike points at the ClientApp's replies or a "
                "setting rather than at faulty nodes)")
    return f"; rejected {total}: {parts}{hint}"


_BOUND_SETTINGS = {  # reason -> (argument, run config key) of the bound
    NORM_TOO_LARGE: ("max_update_norm", "validation.max_update_norm"),
    BAD_NUM_EXAMPLES: ("max_num_examples", "validation.max_num_examples"),
}


def _warn_about_checkpoint_settings(given: Mapping[str, Any]) -> None:
    """Say once a process when checkpoint settings other than the defaults come without checkpoint_dir: the
    run would then write no checkpoint, where the settings say the user expects them."""
    if given["checkpoint_dir"] not in (None, "") or _said["no checkpoint_dir"]:
        return
    defaults = inspect.signature(RobustStrategy.__init__).parameters
    changed = [f"{name}={given[name]!r}" for name in _CHECKPOINT_SETTINGS if given[name] != defaults[name].default]
    if changed:
        _said["no checkpoint_dir"] = True
        log.warning("%s without checkpoint_dir: no checkpoint is written; pass checkpoint_dir to checkpoint the "
                    "rounds", ", ".join(changed))


def _train_named(aggregated: Mapping[str, Any]) -> dict[str, float]:
    """The finite training metrics, each named ``train_<key>`` unless it starts with ``train_``: a round's
    row holds the server's evaluation ``loss`` too. Where both ``loss`` and ``train_loss`` were reported,
    the aggregate of ``train_loss`` is kept. NaN is left out (the metrics file would not be JSON)."""
    named = {f"train_{k}": x for k, v in aggregated.items()
             if not k.startswith("train_") and (x := _finite(v)) is not None}
    named.update({k: x for k, v in aggregated.items() if k.startswith("train_") and (x := _finite(v)) is not None})
    return dict(sorted(named.items()))


def _check_initial_arrays(initial_arrays: object) -> None:
    """Refuse, before any node trains, initial arrays the round loop cannot start from: not an ArrayRecord
    (a state_dict given as it is, the commonest slip), nothing to train, or a non-finite value (every
    reply trained from it would be rejected as non-finite, and its nodes quarantined)."""
    if not isinstance(initial_arrays, ArrayRecord):
        raise TypeError(
            f"initial_arrays must be a flwr.app.ArrayRecord, e.g. ArrayRecord(model.state_dict()), got "
            f"{type(initial_arrays).__name__}"
        )
    floating = {k: t for k, t in initial_arrays.to_torch_state_dict().items() if t.is_floating_point()}
    if not floating:
        raise ValueError(
            "initial_arrays has no floating-point array to train"
            + (f" (its arrays: {', '.join(list(initial_arrays)[:5])})" if len(initial_arrays) else " (it is empty)")
        )
    bad = [k for k, t in floating.items() if not bool(torch.isfinite(t).all())]
    if bad:
        raise ValueError(
            f"initial_arrays holds NaN or infinite values in {len(bad)} array(s) ({', '.join(bad[:5])}): every "
            "update trained from it would be rejected; start from a finite model"
        )

