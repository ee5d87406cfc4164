"""The fault-tolerant loop behind :meth:`RobustStrategy.start`, top to bottom.

Resume from the latest valid checkpoint; wait (bounded) for nodes; then, round by round: refresh
liveness from Flower's node list, sample, push, pull until quorum or deadline (never one blocking
``send_and_receive``), validate each reply on its own, aggregate robustly or retry the round,
evaluate, roll back a diverged model, report, checkpoint. Flower's ``Result`` comes back.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from fedrobust.checkpoint import capture_rng_state
from fedrobust.strategies import client_state
from fedrobust.strategies.arguments import is_number
from fedrobust.strategies.checkpointing import GuardState, RoundCheckpointer, model_is_finite
from fedrobust.strategies.collect import push_and_collect
from fedrobust.strategies.discovery import Discovery
from fedrobust.strategies.errors import ClientFailureError, NodesBusyError, NoNodesError, Preempted, QuorumError
from fedrobust.strategies.replies import error_reason
from fedrobust.strategies.reporting import MetricsLog
from fedrobust.text import first_and_more

if TYPE_CHECKING:
    from fedrobust.aggregators import Aggregator
    from fedrobust.strategies.robust_strategy import RobustStrategy, RoundOutcome

log = logging.getLogger(__name__)

# The divergence guard's best loss counts as at least this (see RoundLoop._diverged).
DIVERGENCE_LOSS_FLOOR = 0.01

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


def checkpointer_for(s: RobustStrategy, num_rounds: int, train_config: ConfigRecord) -> RoundCheckpointer:
    """The checkpointer of a ``start()`` with these arguments: its settings are what a checkpoint must agree with."""
    # The train config reaches every client's training, so a checkpoint must agree with it too.
    settings = {**s.settings, "train_config": dict(train_config)}
    if s.server_lr_schedule != "constant":
        # A schedule spans num_rounds: the rounds run so far followed its span, so a run may be extended
        # (a constant lr) only where the lr does not depend on it.
        settings["num_rounds"] = num_rounds
    return RoundCheckpointer(
        s.checkpoint_dir,
        settings=settings,
        every_rounds=s.checkpoint_every,
        every_seconds=s.checkpoint_every_seconds,
        keep=s.checkpoint_keep,
        resume=s.resume,
        force=s.force_resume,
        full_every=s.checkpoint_full_every,
        storage_options=s.checkpoint_storage_options,
        mirror=s.checkpoint_mirror,
        mtbf=s.checkpoint_mtbf,
        num_rounds=num_rounds,
    )


class RoundLoop:
    """One run of a :class:`RobustStrategy` on a grid (built and run by ``strategy.start()``)."""

    def __init__(
        self,
        strategy: RobustStrategy,
        grid: Grid,
        *,
        num_rounds: int,
        deadline: float,
        train_config: ConfigRecord,
        evaluate_config: ConfigRecord,
        evaluate_fn: EvaluateFn | None,
    ) -> None:
        self.strategy = strategy
        self.grid = grid
        self.num_rounds = num_rounds
        self.deadline = deadline
        self.train_config = train_config
        self.evaluate_config = evaluate_config
        self.evaluate_fn = evaluate_fn
        self._said_no_loss = False  # the warning that evaluate_fn gives no loss for the divergence guard, once
        self._said_evaluation_failed = False  # the warning that no federated evaluation reply came back, once
        s = strategy
        self.checkpointer = checkpointer_for(s, num_rounds, train_config)
        self.metrics = MetricsLog(s.metrics_path, num_rounds, echo=s.progress, f=s.num_byzantine)
        self.discovery = (
            Discovery(grid, s.partitions, s.answered, s.num_partitions) if s.discover_partitions else None
        )
        self.guard = GuardState()
        self.initial_evaluation: dict[str, Any] | None = None  # Result's round 0, kept in checkpoints
        self.first_round = 1  # the first round this start() trains (after a resume, the checkpoint's + 1)
        self.result = Result()
        # Simulated clients' Context.state by partition (strategies/client_state.py): the newest one
        # each sent, and those restored from a checkpoint that still have to be sent back once.
        self.client_states: dict[str, RecordDict] = {}
        self._states_to_send: dict[str, RecordDict] = {}
        # What a round that is abandoned on a stop request rewinds to; None between rounds.
        self._round_start: _RoundStart | None = None
        self._evaluation_incomplete = False  # the last round's federated evaluation missed replies

    # ------------------------------------------------------------------ the run
    def run(self, initial_arrays: ArrayRecord) -> Result:
        """The run, holding its checkpoint directory (one run writes there at a time)."""
        self.checkpointer.claim()
        try:
            return self._run(initial_arrays)
        finally:
            self.checkpointer.release()

    def _run(self, initial_arrays: ArrayRecord) -> Result:
        started = time.perf_counter()
        s = self.strategy
        self.metrics.say(s.describe())
        arrays = initial_arrays
        first_round = 1
        resumed = self.checkpointer.restore(initial_arrays)
        if s.on_start is not None:  # before the metrics file is touched: it may refuse the run
            s.on_start(resumed.round + 1 if resumed is not None else 1)
        if resumed is not None:
            # In the model's own key order, as an uninterrupted run keeps it: the checkpoint gives its
            # tensors back in safetensors' order, and the order of the keys is the layout of the update
            # rows (and of the aggregator's flat state), so the rules' rounding would differ after a resume.
            state = resumed.global_state
            arrays = ArrayRecord({k: state[k] for k in initial_arrays})  # restore() checked: the same keys
            s.load_state_dict(resumed.strategy_tensors, resumed.strategy_meta)
            s.liveness.forget_heard()  # its report counts this run's nodes, not the checkpoint's old ids
            self.guard = resumed.guard
            self.client_states = client_state.decode(resumed.client_tensors, resumed.client_state)
            self._states_to_send = dict(self.client_states)
            self.metrics.restore(resumed.rows)
            self.initial_evaluation = resumed.initial_evaluation
            if self.initial_evaluation is not None:  # first: the Result's rounds in order, as in a run without a stop
                self.result.evaluate_metrics_serverapp[0] = MetricRecord(self.initial_evaluation)
            for row in resumed.rows:
                self._record(row)
            first_round = resumed.round + 1
            self.metrics.say(f"resumed after round {resumed.round} from {self.checkpointer.resumed_from}")
            if resumed.round > self.num_rounds:
                self.metrics.say(
                    f"the checkpoint is after round {resumed.round}, past num_rounds={self.num_rounds}: nothing to "
                    f"train; the result is the model of round {resumed.round}"
                )
        else:
            self.metrics.restore([])  # a fresh run: no rows of an earlier one in its metrics file
            if self.evaluate_fn is not None:
                initial = self.evaluate_fn(0, arrays)
                if initial is not None:
                    self.result.evaluate_metrics_serverapp[0] = initial
                    self.initial_evaluation = dict(initial)
                    # The initial model is the first best: a round 1 that blows the loss up is rolled back
                    # like any later one, instead of becoming the baseline the next rounds are judged by.
                    loss = initial.get("loss")
                    if is_number(loss) and math.isfinite(loss):
                        self.guard.best_loss = min(self.guard.best_loss, float(loss))
        self.result.arrays = arrays
        try:
            self.first_round = first_round  # its deadline also covers the ClientApps' start-up
            if first_round <= self.num_rounds:
                self._wait_for_nodes()
            arrays = self._rounds(arrays, first_round)
        except Exception as err:
            stopped = self._as_stop(err)
            if not isinstance(stopped, Preempted | QuorumError):
                raise
            rng = None
            if isinstance(stopped, Preempted) and self._round_start is not None:
                rng = self._rewind(self._round_start)
            last = self.metrics.rows[-1]["round"] if self.metrics.rows else 0
            saved = last > 0 and self.checkpointer.save(
                last,
                self._state_of(self.result.arrays),
                s.state_dict(),
                self.metrics.rows,
                self.guard,
                client_state=client_state.encode(self.client_states),
                rng_state=rng,
                initial_evaluation=self.initial_evaluation,
                wait=True,
            )
            if isinstance(stopped, Preempted):
                newest = last if saved else self.checkpointer.newest_round()
                stopped.checkpointed = newest is not None and newest > 0
                if saved:
                    self.metrics.say(f"stopping: the checkpoint of round {last} is on disk")
                elif last > 0 and stopped.checkpointed:
                    self.metrics.say(
                        f"stopping: the checkpoint of round {last} could not be written; a resume starts after "
                        f"round {newest}"
                    )
            stopped.result = self.result  # the model and metrics of the rounds that completed
            if stopped is err:
                raise
            raise stopped from err
        finally:
            self.checkpointer.close(stopping=self.strategy.stop_requested)
        self.result.arrays = arrays
        self.metrics.finish(time.perf_counter() - started, first_round, self._checkpoint_notes())
        return self.result

    def _checkpoint_notes(self) -> list[str]:
        """A summary line when the last round's checkpoint is not on disk (the writes failed: the errors
        were logged as they came): the run finished, but a crash near its end would have lost rounds."""
        last = self.metrics.rows[-1]["round"] if self.metrics.rows else 0
        if self.strategy.checkpoint_dir is None or last == 0:
            return []
        notes = []
        if left := self.checkpointer.not_uploaded:
            notes.append(f"MIRROR BEHIND: the checkpoint(s) of round(s) {left} were not uploaded to "
                         f"{self.strategy.checkpoint_mirror} (the upload errors are logged above); they are on the "
                         "local disk")
        newest = self.checkpointer.newest_round()
        if newest == last:
            return notes
        return [f"CHECKPOINTS FAILED: the newest checkpoint on disk is "
                f"{'none' if newest is None else f'of round {newest}'}, the run ended after round {last} (the "
                "write errors are logged above); the final model is in this run's result", *notes]

    def _rounds(self, arrays: ArrayRecord, first_round: int) -> ArrayRecord:
        s = self.strategy
        server_round, rollbacks_this_round = first_round, 0
        while server_round <= self.num_rounds:
            if s.stop_requested:
                raise Preempted(f"stopped before round {server_round}")
            round_started = time.perf_counter()
            self._round_start = _RoundStart(
                server_round, _copy_state(s.state_dict()), capture_rng_state(), dict(self.client_states)
            )
            before = (arrays, self._round_start.strategy_state)
            # Set every round (the schedule's), and again for a round retried after a rollback.
            s.optimizer.lr = s.round_lr(server_round, self.num_rounds) * self.guard.lr_scale
            row, new_arrays = self._train_round(arrays, server_round)
            row.update(self._evaluate(server_round, new_arrays))
            if s.stop_requested and (row["dropped"] or row["client_errors"] or self._evaluation_incomplete):
                # Replies lost to the stop (in a simulation the signal may have reached the clients'
                # workers too): this round is not the one an uninterrupted run computes. Abandon it.
                raise Preempted(
                    f"stopped during round {server_round} ({row['dropped']} of {row['sampled']} replies missing); "
                    "the round was abandoned"
                )
            if (why := self._diverged(new_arrays, row)) is not None:
                arrays, state = before
                s.load_state_dict(*state)
                self._roll_back(server_round, row, self._why_variances_went_negative(self._state_of(new_arrays)))
                rollbacks_this_round += 1
                if rollbacks_this_round > s.max_round_retries:
                    raise QuorumError(
                        f"round {server_round}: the model diverged {rollbacks_this_round} times ({why}); each retry "
                        f"lowered the server lr (by lr_decay), to {s.optimizer.lr:.4g}: if the replies that got "
                        f"through the rule are sound, start with a lower one "
                        f"({s.setting_name('server_lr', 'server_optimizer.lr')})")
                continue  # the same round again, from the state before it, with a lower server lr
            rollbacks_this_round = 0
            arrays = new_arrays
            self.result.arrays = arrays
            if isinstance(row.get("loss"), float) and math.isfinite(row["loss"]):
                self.guard.best_loss = min(self.guard.best_loss, row["loss"])
            row["rollbacks"] = self.guard.rollbacks
            row["server_lr"] = s.optimizer.lr  # the lr this round's step used
            row["liveness"] = s.liveness.snapshot()
            # The adaptive interval weighs a checkpoint's blocking time against the round time without it.
            self.checkpointer.observe_round(time.perf_counter() - round_started)
            if self.checkpointer.current_interval is not None:
                row["checkpoint_interval"] = self.checkpointer.current_interval  # the interval this round obeyed
            if self.checkpointer.due(server_round):  # the last round always is, when checkpoints are on
                t0 = time.perf_counter()
                self.checkpointer.save(
                    server_round,
                    self._state_of(arrays),
                    s.state_dict(),
                    [*self.metrics.rows, row],
                    self.guard,
                    client_state=client_state.encode(self.client_states),
                    initial_evaluation=self.initial_evaluation,
                )
                row["seconds_checkpoint_blocking"] = time.perf_counter() - t0
                self.checkpointer.observe_checkpoint(row["seconds_checkpoint_blocking"], server_round)
            self.metrics.add(row)
            self._record(row)
            self._round_start = None
            server_round += 1
        return arrays

    # ------------------------------------------------------------------ stopping
    def _as_stop(self, err: Exception) -> Exception:
        """``err`` as the run's reason to stop: once a stop was requested, any failure is that stop.

        When a scheduler signals a whole process group, the simulation's workers die with the
        server's stop request in flight; the errors that follow are the stop, not a fault.
        """
        if isinstance(err, Preempted) or not self.strategy.stop_requested:
            return err
        where = f"in round {self._round_start.round}" if self._round_start is not None else "before the first round"
        message = " ".join(str(err).split())[:300]
        log.info("stop requested; %s %s: %s", where, type(err).__name__, message)
        return Preempted(f"stopped {where} (after the stop request: {type(err).__name__}: {message})")

    def _rewind(self, start: _RoundStart) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Restore the strategy and the clients' states of before the abandoned round; its RNG states."""
        self.strategy.load_state_dict(*start.strategy_state)
        self.client_states = start.client_states
        self.metrics.say(f"round {start.round} abandoned on the stop request")
        return start.rng

    # ------------------------------------------------------------------ one round
    def _wait_for_nodes(self) -> None:
        """Wait at most ``wait_for_nodes`` s for ``min_available_nodes``, saying how many are there."""
        s = self.strategy
        need = max(s.min_available_nodes, s.min_train_nodes)
        why = "min_available_nodes" if need == s.min_available_nodes else "min_train_nodes"  # the setting to lower
        deadline = time.monotonic() + s.wait_for_nodes
        last_said = -1
        while True:
            have = connected = len(list(self.grid.get_node_ids()))
            if self.discovery is not None:
                self.discovery.poll()
                have = len(s.answered)
            if have >= need:
                break
            if s.stop_requested:
                raise Preempted("stopped while waiting for nodes")
            failed = self.discovery.failed_now() if self.discovery is not None else {}
            # Only once enough nodes are connected and every one of them failed: a first node that fails
            # (a crash, one misconfigured device) does not stop a run whose healthy nodes are on the way.
            if connected >= need and not s.answered and len(failed) >= connected:
                node, reason = next(iter(failed.items()))
                raise NoNodesError(
                    f"the ClientApp of every connected node ({connected}) failed the partition query, e.g. node "
                    f"{node}: {reason}; nothing was trained. discover_partitions=True asks each node's ClientApp "
                    "for its partition-id with a query message: give the ClientApp a query handler, e.g. "
                    "app.query()(fedrobust.partition_query) (fedrobust's own ClientApp has one), or pass "
                    "discover_partitions=False"
                )
            if time.monotonic() >= deadline and connected >= need:
                from flwr.superlink.grid import HttpGrid

                silent = sorted(set(self.grid.get_node_ids()) - s.answered)
                named = first_and_more(silent, 5)
                busy = ("a SuperNode takes one message at a time, and after a server crash it first works through "
                        "the killed run's messages (minutes under load); one still silent on a second try can be "
                        "stuck behind the killed run's last message: restart its SuperNode") if isinstance(
                    self.grid, HttpGrid) else (
                        "a simulation's ClientApps start in Ray's workers, which take minutes on a loaded machine")
                raise NodesBusyError(
                    f"{connected} nodes connected, but only {have} of the {need} needed ({why}) "
                    f"answered the partition query within {s.wait_for_nodes:g} s (silent: node {named}); nothing "
                    f"was trained. Either the nodes are busy: {busy}: run again, or wait "
                    f"longer ({s.setting_name('wait_for_nodes', 'fault.wait_for_nodes')}). Or their ClientApp "
                    "has no query handler: discover_partitions=True asks each node for its partition-id with a "
                    "query message; give it one, e.g. app.query()(fedrobust.partition_query) (fedrobust's own "
                    "ClientApp has one), or pass discover_partitions=False"
                )
            if time.monotonic() >= deadline:
                # Fewer connected than needed (else the branch above): the count is the connected nodes, with
                # how many of them answered discovery where some did not.
                answered = f" ({have} of them answered the partition query)" if have < connected else ""
                raise NoNodesError(
                    f"{connected} of the {need} nodes needed ({why}) connected within "
                    f"{s.wait_for_nodes:g} s{answered}; nothing was trained. Start more nodes (a local simulation: its "
                    f"federation's num-supernodes; a deployment: flwr supernode ls shows which are online) or "
                    f"need fewer ({s.setting_name(why, 'clients_per_round')})"
                )
            if have != last_said:
                # With discovery a node counts once it has said which partition it holds, so say both.
                counted = (f"{have} of the {need} needed ({why}) answered the partition query "
                           f"({connected} connected)") if self.discovery is not None else (
                    f"{have} of the {need} needed ({why}) connected")
                self.metrics.say(f"waiting for nodes: {counted}")
                last_said = have
            time.sleep(0.2)
        if self.discovery is not None:
            self.discovery.poll(needed=len(list(self.grid.get_node_ids())), wait=min(s.wait_for_nodes, 30.0))
            self.discovery.say_if_other_shares_than(s.checkpointed_num_partitions)
        self._say_if_too_few_for_f()

    def _say_if_too_few_for_f(self) -> None:
        """Warn before any training when fewer nodes are connected than the rule needs at ``num_byzantine``:
        the first round then stops the run after its training, unless validation rejects enough replies (each proven
        faulty one lowers f). Not an error here: nodes may still join, and a drill's attackers may be rejected."""
        s = self.strategy
        connected = len(list(self.grid.get_node_ids()))
        rule = s._rule_for(s.num_byzantine)
        if connected >= rule.min_n():
            self._say_if_no_spare_reply(connected, rule)
            return
        log.warning(
            "%d nodes connected, but %s with f=%d needs at least %d valid replies: the first round stops the run "
            "unless more nodes join (or validation proves replies faulty: each one lowers f by one); connect more "
            "nodes or %s",
            connected, rule.label, s.num_byzantine, rule.min_n(), s.too_few_advice(connected, s.num_byzantine),
        )

    def _say_if_no_spare_reply(self, connected: int, rule: Aggregator) -> None:
        """Warn when every round samples exactly the replies the rule needs with f > 0 (e.g. 3 nodes and f=1):
        a rejected reply lowers f and the round goes on, but one node that drops out or misses the deadline
        leaves it short, and the round is retried or stops the run."""
        s = self.strategy
        sampled = s.sample_size(connected)
        if s.num_byzantine == 0 or s.over_select or sampled != rule.min_n():
            return
        log.warning(
            "each round samples %d of the %d connected nodes, exactly the %d valid replies %s with f=%d needs: "
            "one node that drops out or misses the deadline leaves a round short (rejected replies lower f, "
            "dropouts do not), and it is retried (max_round_retries=%d) or stops the run; connect more nodes, "
            "raise fraction_train, or sample spare nodes with over_select",
            sampled, connected, rule.min_n(), rule.label, s.num_byzantine, s.max_round_retries,
        )

    def _train_round(self, arrays: ArrayRecord, server_round: int) -> tuple[dict[str, Any], ArrayRecord]:
        """One round, retried while too few valid replies came in; raises after the last try."""
        s = self.strategy
        t0 = time.perf_counter()
        outcome: RoundOutcome | None = None
        attempts = 0
        for attempt in range(s.max_round_retries + 1):
            attempts = attempt + 1
            if self.discovery is not None:
                self.discovery.poll()
            config = ConfigRecord(dict(self.train_config))
            messages = s.train_messages(server_round, arrays, config, self.grid, attempt=attempt)
            self._send_client_states(messages)
            # Each reply is checked and written into its row as it arrives, while the others train.
            intake = s.open_round(server_round, [m.metadata.dst_node_id for m in messages])
            sent, replies = push_and_collect(
                self.grid,
                messages,
                timeout=self.deadline,
                enough=self._enough_replies(s.planned_replies),
                on_pushed=intake.expect,
                on_reply=intake.take,
                quorum=intake.can_aggregate if s.grace_after_quorum > 0 else None,
                grace=s.grace_after_quorum,
            )
            self._take_client_states(replies)
            outcome = intake.close()
            outcome.sampled = len(messages)
            answered = {r.metadata.reply_to_message_id for r in replies}
            outcome.dropped.extend(node for mid, node in sent.items() if mid not in answered)  # missed the deadline
            pushed = set(sent.values())
            refused = [m.metadata.dst_node_id for m in messages if m.metadata.dst_node_id not in pushed]
            outcome.dropped.extend(refused)  # the grid did not take their messages (collect.push logged it)
            self._record_liveness(sent, replies, server_round)
            for node_id in refused:  # a node the grid keeps refusing is not asked again every round
                s.liveness.record_miss(node_id, server_round)
            if outcome.aggregated:
                break
            if s.stop_requested:
                raise Preempted(
                    f"stopped during round {server_round} (too few replies in before the stop); the round was "
                    "abandoned"
                )
            if not messages:
                outcome.why_not_aggregated = "no eligible node to sample"
            self._say_not_aggregated(outcome, attempt)
            if self._retry_cannot_help(outcome):
                if attempt < s.max_round_retries and outcome.rejected:
                    outcome.why_not_aggregated += "; not retried: every node's reply was refused for the same reason"
                break
            only_errors = not outcome.accepted and not outcome.rejected
            if outcome.client_errors and only_errors and len(outcome.client_errors) == 1:
                message, count = next(iter(outcome.client_errors.items()))
                if count == len(sent):
                    raise ClientFailureError(
                        f"round {server_round}: all {count} replies failed on the clients: {message}"
                    )
        assert outcome is not None
        if not outcome.aggregated or outcome.arrays is None:
            raise QuorumError(
                f"round {server_round}: not aggregated after {attempts} attempt{'s' if attempts > 1 else ''} "
                f"({outcome.why_not_aggregated})"
                + _errors_text(outcome, self._deadline_name(), first_round=outcome.round == self.first_round
                               and attempts == 1)
            )
        return self._row(outcome, attempts, time.perf_counter() - t0), outcome.arrays

    def _retry_cannot_help(self, outcome: RoundOutcome) -> bool:
        """Every connected node was asked, and either each replied validly and they are fewer than the rule
        needs (a retry would ask the same nodes for as few replies; ``max_round_retries`` is for replies lost
        or rejected), or each reply was refused for one same reason, more than ``num_byzantine`` of them: a
        setting or the ClientApp (a missing key, a norm bound below honest updates), which the same nodes
        would repeat, each retry a rejection more towards quarantining every node."""
        if len(list(self.grid.get_node_ids())) > outcome.sampled:
            return False
        if outcome.dropped or outcome.client_errors:
            return False
        if not outcome.rejected:
            return outcome.sampled < outcome.needed
        alike = not outcome.accepted and len(outcome.rejected) == 1
        return alike and sum(outcome.rejected.values()) > self.strategy.num_byzantine

    def _enough_replies(self, target: int) -> Callable[[list[Message]], bool]:
        """When to stop waiting: ``target`` valid replies, or a stop request (the round is then
        finished only when nothing was missing)."""
        strategy = self.strategy
        return lambda got: strategy.stop_requested or sum(not r.has_error() for r in got) >= target

    def _deadline_name(self) -> str:
        return self.strategy.setting_name("round_deadline, else start()'s timeout", "fault.round_timeout")

    def _say_not_aggregated(self, outcome: RoundOutcome, attempt: int) -> None:
        self.metrics.say(
            f"round {outcome.round} attempt {attempt + 1} not aggregated: {outcome.why_not_aggregated}"
            + _errors_text(outcome, self._deadline_name(), first_round=outcome.round == self.first_round
                           and attempt == 0)
        )

    def _row(self, outcome: RoundOutcome, attempts: int, seconds: float) -> dict[str, Any]:
        s = self.strategy
        dead = s.liveness.dead_nodes()
        return {
            "round": outcome.round,
            "sampled": outcome.sampled,
            "accepted": len(outcome.accepted),
            "rejected": dict(sorted(outcome.rejected.items())),
            "rejected_nodes": outcome.rejected_nodes,
            "dropped": len(outcome.dropped),
            # By partition where known, as the rows: node ids are drawn anew each run, the rows' order is not.
            # With its error where the node replied with one (else it missed the deadline).
            "dropped_nodes": [
                {"node": n, "partition": s.partitions.get(n)}
                | ({"error": outcome.errors_by_node[n]} if n in outcome.errors_by_node else {})
                for n in s._order(outcome.dropped)
            ],
            "filtered": len(outcome.filtered),
            "filtered_nodes": [
                {"node": n, "partition": s.partitions.get(n), "by": outcome.filtered_by.get(n)}
                for n in s._order(outcome.filtered)
            ],
            "excluded": len(outcome.excluded),
            "excluded_nodes": [{"node": n, "partition": s.partitions.get(n)} for n in s._order(outcome.excluded)],
            "client_errors": dict(outcome.client_errors),
            "quarantined": sorted(n for n in s.liveness.known_nodes() if s.liveness.status(n) == "quarantined"),
            "dead_nodes": [{"node": n, "partition": s.partitions.get(n), "probe": dead[n]} for n in s._order(dead)],
            "aggregated": outcome.aggregated,
            "attempts": attempts,
            "f_used": outcome.f_used,
            "seconds_train": seconds - outcome.seconds_aggregate,
            "seconds_aggregate": outcome.seconds_aggregate,
            **outcome.train_metrics,
        }

    def _record_liveness(self, sent: dict[str, int], replies: list[Message], server_round: int) -> None:
        answered = {r.metadata.reply_to_message_id: r for r in replies}
        for message_id, node_id in sorted(sent.items(), key=lambda kv: kv[1]):
            reply = answered.get(message_id)
            if reply is None or reply.has_error():
                self.strategy.liveness.record_miss(node_id, server_round)
            else:
                self.strategy.liveness.record_reply(node_id, server_round)

    def _evaluate(self, server_round: int, arrays: ArrayRecord) -> dict[str, Any]:
        """Central (``evaluate_fn``) and federated evaluation of the round's model."""
        s = self.strategy
        out: dict[str, Any] = {}
        t0 = time.perf_counter()
        if self.evaluate_fn is not None:
            metrics = self.evaluate_fn(server_round, arrays)
            if metrics is not None:
                out.update({k: float(v) for k, v in metrics.items() if isinstance(v, int | float)})
                if "loss" not in out and s.divergence_factor > 0 and not self._said_no_loss:
                    self._said_no_loss = True
                    log.warning(
                        "evaluate_fn returned no 'loss' (%s): the divergence guard rolls back only a non-finite "
                        "model; return the loss for its loss test (divergence_factor=%g)",
                        ", ".join(sorted(out)) or "no numbers", s.divergence_factor,
                    )
        messages = list(s.configure_evaluate(server_round, arrays, ConfigRecord(dict(self.evaluate_config)), self.grid))
        self._evaluation_incomplete = False
        if messages:
            self._send_client_states(messages)
            _, replies = push_and_collect(self.grid, messages, timeout=self.deadline, enough=lambda _: s.stop_requested)
            self._evaluation_incomplete = len(replies) < len(messages) or any(r.has_error() for r in replies)
            out.update(self._evaluation_failures(server_round, messages, replies))
            self._take_client_states(replies)
            federated = s.aggregate_evaluate(server_round, replies)
            if federated is not None:
                out["federated_evaluate"] = {k: float(v) for k, v in federated.items() if isinstance(v, int | float)}
        out["seconds_evaluate"] = time.perf_counter() - t0
        return out

    def _evaluation_failures(
        self, server_round: int, messages: list[Message], replies: list[Message]
    ) -> dict[str, Any]:
        """The round's evaluate replies that were errors (by reason) or never came, for its row; a round where
        none came back usable is also said as a warning, once a run (the same cause every round, most often a
        ClientApp without an evaluate function)."""
        errors: dict[str, int] = {}
        for reply in replies:
            if reply.has_error():
                reason = error_reason(reply.error.reason)
                errors[reason] = errors.get(reason, 0) + 1
        missing = len(messages) - len(replies)
        if not errors and not missing:
            return {}
        if sum(errors.values()) + missing == len(messages) and not self._said_evaluation_failed:
            self._said_evaluation_failed = True
            if errors:
                cause = (f"{sum(errors.values())} errors, e.g. {next(iter(errors))}; {missing} missed the deadline): "
                         "a ClientApp needs an evaluate function (@app.evaluate()) for fraction_evaluate > 0")
            else:
                cause = ("all missed the round's deadline): the clients evaluate within it (round_deadline, else "
                         "start()'s timeout)")
            log.warning(
                "round %d: federated evaluation got no reply of the %d it asked for (%s; fraction_evaluate=0 turns "
                "federated evaluation off. Said once a run",
                server_round, len(messages), cause,
            )
        return {"evaluate_errors": errors, "evaluate_missing": missing}

    def _diverged(self, arrays: ArrayRecord, row: dict[str, Any]) -> str | None:
        """Why the round's model counts as diverged, or None when it does not."""
        state = self._state_of(arrays)
        if not model_is_finite(state):
            return "the model has NaN or infinite values"
        loss = row.get("loss")
        if loss is None:
            return None
        if not math.isfinite(loss):
            return f"evaluation loss {loss}{self._why_variances_went_negative(state)}"
        factor = self.strategy.divergence_factor
        if factor <= 0 or not math.isfinite(self.guard.best_loss):
            return None
        # A model that fits its data has a best loss near 0, and factor x best then trips on noise (1e-6 to
        # 5e-5 is "50 times" but nothing happened): the best counts as at least DIVERGENCE_LOSS_FLOOR.
        if loss > factor * max(self.guard.best_loss, DIVERGENCE_LOSS_FLOOR):
            name = self.strategy.setting_name("divergence_factor", "guard.divergence_factor")
            return f"loss above {name}={factor:g} x the best; 0 turns the loss test off"
        return None

    @staticmethod
    def _why_variances_went_negative(state: dict[str, torch.Tensor]) -> str:
        """A batch norm's running variance below 0 makes every evaluation NaN while the weights are finite.
        The server gives it the aggregate of the clients' values, so replies below 0 got through the rule."""
        negative = [k for k, v in state.items() if k.endswith("running_var") and bool((v < 0).any())]
        if not negative:
            return ""
        return (f"; {first_and_more(negative, 2)} has values below 0: the aggregate of the clients' batch-norm "
                "running variances, so replies with variances below 0 got through the rule")

    def _roll_back(self, server_round: int, row: dict[str, Any], note: str = "") -> None:
        """Count the rollback and lower the server learning rate (the state was restored by the caller)."""
        s = self.strategy
        self.guard.rollbacks += 1
        self.guard.lr_scale *= s.lr_decay
        s.optimizer.lr = s.round_lr(server_round, self.num_rounds) * self.guard.lr_scale
        self.metrics.say(
            f"round {server_round} diverged (loss {row.get('loss', float('nan')):.4g}, "
            f"best {self.guard.best_loss:.4g}{note}): "
            f"rolled back, server lr now {s.optimizer.lr:.4g}"
        )

    # ------------------------------------------------------------------ clients' state (simulation)
    def _client_key(self, node_id: int) -> str:
        """Partition ids survive a restart of the simulation; node ids are drawn anew."""
        partition = self.strategy.partitions.get(node_id)
        return str(partition) if partition is not None else f"node-{node_id}"

    def _send_client_states(self, messages: list[Message]) -> None:
        """Give back each restored state with the first messages to its client after a resume."""
        for message in messages:
            state = self._states_to_send.get(self._client_key(message.metadata.dst_node_id))
            if state is not None:
                client_state.put_state(message.content, state)

    def _take_client_states(self, replies: list[Message]) -> None:
        """Keep the state each reply carries, and remove it from the reply."""
        for reply in replies:
            if reply.has_error():
                continue
            state = client_state.take_state(reply.content)
            if state is not None:
                key = self._client_key(reply.metadata.src_node_id)
                self.client_states[key] = state
                self._states_to_send.pop(key, None)

    # ------------------------------------------------------------------ Result
    def _record(self, row: dict[str, Any]) -> None:
        """Put one round's metrics into Flower's Result."""
        r = row["round"]
        train: dict[str, Any] = {k: row[k] for k in ("accepted", "dropped", "attempts", "f_used", "server_lr")
                                 if k in row}
        train["rejected"] = sum(row.get("rejected", {}).values())
        train.update({f"rejected.{k}": v for k, v in row.get("rejected", {}).items()})
        train.update({k: v for k, v in row.items() if k.startswith("train_")})
        self.result.train_metrics_clientapp[r] = MetricRecord(train)
        central = {k: v for k, v in row.items() if k in _central_keys(row)}
        if central:
            self.result.evaluate_metrics_serverapp[r] = MetricRecord(central)
        if row.get("federated_evaluate"):
            self.result.evaluate_metrics_clientapp[r] = MetricRecord(row["federated_evaluate"])

    @staticmethod
    def _state_of(arrays: ArrayRecord) -> dict[str, torch.Tensor]:
        return dict(arrays.to_torch_state_dict())


# Row keys the loop writes itself; every other number in a row came from evaluate_fn.
_OWN_KEYS = frozenset(
    {
        "round", "sampled", "accepted", "rejected", "rejected_nodes", "dropped", "dropped_nodes", "filtered",
        "filtered_nodes", "excluded", "excluded_nodes", "client_errors", "quarantined", "dead_nodes",
        "aggregated", "attempts", "f_used", "seconds_train", "seconds_aggregate", "seconds_evaluate",
        "seconds_checkpoint_blocking", "checkpoint_interval", "rollbacks", "liveness", "federated_evaluate",
        "server_lr", "evaluate_errors", "evaluate_missing",
    }
)


def _central_keys(row: dict[str, Any]) -> list[str]:
    return [
        k for k, v in row.items() if k not in _OWN_KEYS and not k.startswith("train_") and isinstance(v, int | float)
    ]


StrategyState = tuple[dict[str, torch.Tensor], dict[str, Any]]


def _copy_state(state: StrategyState) -> StrategyState:
    tensors, meta = state
    return {k: v.clone() for k, v in tensors.items()}, copy.deepcopy(meta)


@dataclass
class _RoundStart:
    """The state a round began from, restored when the round is abandoned on a stop request."""

    round: int
    strategy_state: tuple[dict[str, torch.Tensor], dict[str, Any]]
    rng: tuple[dict[str, torch.Tensor], dict[str, Any]]
    client_states: dict[str, RecordDict]


def _errors_text(outcome: RoundOutcome, deadline_name: str, *, first_round: bool = False) -> str:
    """The replies that did not come: those that failed on the clients (the commonest errors) and those that
    missed the deadline (``first_round``: of the first round a start() trains, after a resume too)."""
    text = ""
    errors = sum(outcome.client_errors.values())
    if errors:
        parts = "; ".join(f"{n}x {msg}" for msg, n in outcome.client_errors.most_common(3))
        text += f"; {errors} of {outcome.sampled} replies failed on the clients: {parts}"
    missed = len(outcome.dropped) - errors
    if missed > 0:
        text += (f"; {missed} of {outcome.sampled} replies missed the round's deadline ({deadline_name}"
                 + ("; the first round's also covers the ClientApps' start-up, e.g. a simulation's workers"
                    if first_round else "") + ")")
    return text
