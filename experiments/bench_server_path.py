"""Benchmark the server's whole reply path: one ``aggregate_train`` on n real Flower reply Messages.

Every entry runs in a fresh interpreter (one per repeat), which first builds ``n`` reply
``Message`` objects as a ServerApp receives them in Flower's convention (an ArrayRecord
``arrays`` with the client's full local weights, a MetricRecord ``metrics`` with
``num-examples``), warms up what the entry imports or compiles, and then times one
``aggregate_train(server_round, replies)`` call and its peak resident memory above the
resident memory with the replies built ("extra"; ``VmHWM`` after resetting it through
``/proc/self/clear_refs``, else ``ru_maxrss``).

Entries:

* Flower 1.41's ``FedAvg``, ``FedTrimmedAvg`` (beta = f/n), ``FedMedian`` and ``Krum``
  (``num_malicious_nodes = f``) from ``flwr.serverapp.strategy``;
* fedrobust with a rule (``trimmed_mean``, ``median``, ``krum``, ...): the path of the
  robust strategy, :func:`fedrobust_path`: ``array_views`` on each reply, ``UpdateMatrix.add``
  (full weights: the row is local minus global, checked for structure, finiteness and norm
  in the same pass), the rule on ``matrix.rows()``, then global + lr * aggregate, returned
  as an ArrayRecord like Flower's strategies return it. It keeps its ``UpdateMatrix`` between
  rounds (``reset``), as the strategy should;
* with ``--strategy``, ``RobustStrategy(aggregator=rule, num_byzantine=f).aggregate_train``
  itself (entries ``strategy:<rule>``), after its ``configure_train`` (it computes each update
  against the global model it sent). It takes the same path as ``fedrobust_path`` plus what a
  server needs on top: the fixed node order, signature and num-examples checks, outcome
  bookkeeping, the server optimizer's flat step into a buffer kept across rounds; and it empties
  each reply's ArrayRecord once its row is written (as Flower's FedMedian pops the arrays it reads),
  so the reply's bytes can be freed while the next replies are processed.
* with ``--streamed``, the same strategy taking the replies as they arrive, as its round loop does
  (entries ``streamed:<rule>``): every reply but the last is handed to the round's intake
  (``open_round(...).take``) untimed, as happens while the slower clients still train; timed is
  what is left once the last reply is in: taking it, then ``close`` (gaps, rule, step).
* with ``--arriving``, the whole streamed round's memory (entries ``arriving:<rule>``): each reply is
  built only when it "arrives" and handed to the intake at once, so at most one reply exists at a time,
  as in the round loop when the clients finish one after another; the peak is taken above the resident
  memory before the first reply (the strategy's matrix, kept across rounds, already resident), and the
  time is that of the takes and ``close`` (building the replies is not timed).

With ``--rounds 2`` each process then builds a second set of replies and calls the same
strategy object again: round 1 pays for first-touching new memory (on this VM a page fault per
4 KiB costs about ten times writing it), later rounds show what a long-running server pays.
Memory a strategy keeps between rounds (fedrobust's matrix) is in the RSS before round 2, so
round 2's "extra" does not count it.

``f = max(1, (n - 3) // 4)`` as in ``experiments.bench_aggregators``. The model is a
ResNet-18 for 10 classes (CIFAR variant: 3x3 stem), its 62 parameter tensors, 11.17M float32
values (``--d-model 11m``), or the same network with 20/40/80/160 channels, 1.09M values
(``--d-model 1m``).

Usage::

    python -m experiments.bench_server_path --n 20 --d-model 1m              # quick, ~1 min
    python -m experiments.bench_server_path --n 50 --d-model 11m --repeats 1 --rounds 2 --strategy
                                                   # the issue's size (replies 2.2 GB), ~15 min
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, cast

# Single-threaded BLAS/OpenMP in the children unless --threads says otherwise: set before numpy loads.
if "--child" in sys.argv:
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ.setdefault(_var, os.environ.get("BENCH_THREADS", "1"))
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from fedrobust import aggregators
from fedrobust.strategies.reply_arrays import array_views
from fedrobust.training import pick_device
from fedrobust.update_matrix import UpdateMatrix
from fedrobust.validation import check_num_examples

if TYPE_CHECKING:
    from flwr.serverapp import Grid

    from fedrobust.strategies.robust_strategy import RobustStrategy

log = logging.getLogger(__name__)

FLOWER_ENTRIES = ("flower_fedavg", "flower_trimmed_mean", "flower_median", "flower_krum")
DEFAULT_RULES = ("trimmed_mean", "median", "krum")
# Flower's strategy that computes the same rule, for the "x Flower's rule" column.
FLOWER_FOR = {"trimmed_mean": "flower_trimmed_mean", "median": "flower_median", "krum": "flower_krum"}
MODEL_WIDTHS = {"11m": (64, 128, 256, 512), "1m": (20, 40, 80, 160)}
NUM_CLASSES = 10


def byzantine_count(n: int) -> int:
    """f for n replies: what every rule (Bulyan included) accepts."""
    return max(1, (n - 3) // 4)


def resnet18_shapes(widths: tuple[int, int, int, int]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the parameters of a CIFAR-style ResNet-18 (62 tensors)."""
    shapes: dict[str, tuple[int, ...]] = {"conv1.weight": (widths[0], 3, 3, 3)}
    shapes.update({"bn1.weight": (widths[0],), "bn1.bias": (widths[0],)})
    in_ch = widths[0]
    for stage, width in enumerate(widths, start=1):
        for block in range(2):
            prefix = f"layer{stage}.{block}"
            first_in = in_ch if block == 0 else width
            shapes[f"{prefix}.conv1.weight"] = (width, first_in, 3, 3)
            shapes.update({f"{prefix}.bn1.weight": (width,), f"{prefix}.bn1.bias": (width,)})
            shapes[f"{prefix}.conv2.weight"] = (width, width, 3, 3)
            shapes.update({f"{prefix}.bn2.weight": (width,), f"{prefix}.bn2.bias": (width,)})
            if block == 0 and first_in != width:
                shapes[f"{prefix}.shortcut.0.weight"] = (width, first_in, 1, 1)
                shapes.update({f"{prefix}.shortcut.1.weight": (width,), f"{prefix}.shortcut.1.bias": (width,)})
        in_ch = width
    shapes.update({"linear.weight": (NUM_CLASSES, widths[-1]), "linear.bias": (NUM_CLASSES,)})
    return shapes


def global_state(d_model: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """The global model the server sent: float32 values drawn from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=g) * 0.05 for k, shape in resnet18_shapes(MODEL_WIDTHS[d_model]).items()}


def _instructions(n: int) -> list[Message]:
    """n train instructions with the ids a Grid would give them on push."""
    from flwr.supercore.task_identity import TaskIdentity

    # Messages are stamped with the running task's identity; a ServerApp process has one.
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    out = []
    for i in range(n):
        instruction = Message(
            RecordDict({"config": ConfigRecord({"server-round": 1})}),
            dst_node_id=1000 + i,
            message_type=MessageType.TRAIN,
        )
        out.append(instruction)
    return out


def build_replies(
    state: dict[str, torch.Tensor], instructions: list[Message], seed: int = 1
) -> tuple[list[Message], int]:
    """One reply per instruction: local weights = global + small noise, and num-examples.

    Returns the replies and their array bytes.
    """
    g = torch.Generator().manual_seed(seed)
    replies, size = [], 0
    for i, instruction in enumerate(instructions):
        if not instruction.metadata.message_id:  # a Grid assigns message ids on push
            instruction.metadata.__dict__["_message_id"] = f"train-{instruction.metadata.dst_node_id}"
        record = ArrayRecord()
        for key, value in state.items():
            local = value + 0.01 * torch.randn(value.shape, generator=g)
            record[key] = Array(local.numpy())
            size += len(record[key].data)
        metrics = MetricRecord({"num-examples": 100 + i, "train_loss": 1.0})
        replies.append(Message(RecordDict({"arrays": record, "metrics": metrics}), reply_to=instruction))
    return replies, size


# --------------------------------------------------------------------------- fedrobust's path
def fedrobust_path(
    rule: str, f: int, state: dict[str, torch.Tensor], *, lr: float = 1.0, max_norm: float = 0.0
) -> Callable[[int, Iterable[Message]], tuple[ArrayRecord | None, MetricRecord | None]]:
    """What the robust strategy's ``aggregate_train`` does with Flower-convention replies.

    Each reply: its arrays are viewed in place (``array_views``), checked and written into
    its row of an ``UpdateMatrix`` in one pass; the rule runs on the rows; the server step
    is global + lr * aggregate.
    """
    aggregator = aggregators.build(rule, f=f)
    others = {k: v for k, v in state.items() if not v.is_floating_point()}

    kept: list[UpdateMatrix] = []  # one matrix for all rounds: its pages stay mapped

    def aggregate_train(
        server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        if kept and kept[0].capacity >= len(replies):
            matrix = kept[0]
            matrix.reset(state)  # a real strategy passes the global model it sent this round
        else:
            matrix = UpdateMatrix(state, capacity=len(replies), max_norm=max_norm)
            kept[:] = [matrix]
        rejected = 0
        for reply in replies:
            if reply.has_error():
                continue
            content = reply.content
            if check_num_examples(content["metrics"].get("num-examples"), 10**9) is not None:
                rejected += 1
                continue
            record = content["arrays"]
            assert isinstance(record, ArrayRecord)  # build_replies sends the arrays as an ArrayRecord
            try:
                views = array_views(record)
            except ValueError:
                rejected += 1
                continue
            if matrix.add(views, full_weights=True) is not None:
                rejected += 1
        if len(matrix) < aggregator.min_n():
            return None, MetricRecord({"accepted": len(matrix), "rejected": rejected, "aggregated": 0})
        aggregate = aggregator(matrix.rows())
        new_flat = torch.add(matrix.global_flat(), aggregate, alpha=lr)
        new_state = {**others, **matrix.unflatten(new_flat)}
        return ArrayRecord(new_state), MetricRecord({"accepted": len(matrix), "rejected": rejected, "aggregated": 1})

    return aggregate_train


class _BenchGrid:
    """The two things ``RobustStrategy.configure_train`` asks a Grid: the run and the nodes."""

    def __init__(self, node_ids: list[int]) -> None:
        self.run = SimpleNamespace(run_id=1)
        self._node_ids = node_ids

    def get_nodes(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(node_id=n, status="online") for n in self._node_ids]

    def get_node_ids(self) -> list[int]:
        return list(self._node_ids)


def robust_strategy(
    rule: str, n: int, f: int, state: dict[str, torch.Tensor], device: str = "cpu"
) -> tuple[RobustStrategy, list[Message]]:
    """The real ``RobustStrategy`` after ``configure_train`` (it needs the global model it sent)."""
    from fedrobust.strategies.robust_strategy import RobustStrategy

    strategy = RobustStrategy(
        aggregator=rule, num_byzantine=f, min_train_nodes=n, progress=False, aggregation_device=device
    )
    grid = _BenchGrid([1000 + i for i in range(n)])
    # _BenchGrid has the part of the Grid interface that configure_train uses.
    instructions = list(strategy.configure_train(1, ArrayRecord(state), ConfigRecord({}), cast("Grid", grid)))
    return strategy, instructions


def flower_strategy(entry: str, n: int, f: int) -> Callable[..., tuple[ArrayRecord | None, MetricRecord | None]]:
    """Flower's own strategy for ``entry``; its bound ``aggregate_train``."""
    from flwr.serverapp import strategy as fs

    if entry == "flower_fedavg":
        return fs.FedAvg().aggregate_train
    if entry == "flower_trimmed_mean":
        return fs.FedTrimmedAvg(beta=f / n).aggregate_train
    if entry == "flower_median":
        return fs.FedMedian().aggregate_train
    if entry == "flower_krum":
        return fs.Krum(num_malicious_nodes=f).aggregate_train
    raise ValueError(f"unknown Flower entry {entry!r}; valid: {list(FLOWER_ENTRIES)}")


# --------------------------------------------------------------------------- one measurement
def status_bytes(field_name: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field_name)


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


def run_child(entry: str, n: int, d_model: str, rounds: int, device: str = "cpu") -> list[dict[str, float]]:
    """Build the replies, warm up, then time aggregate_train and its peak extra RSS, per round.

    Round 2 (and later) calls the same strategy object on freshly built replies: what a
    server does every round, with whatever the strategy kept from the round before.
    """
    logging.getLogger("flwr").setLevel(logging.WARNING)  # Flower logs every aggregate_train
    f = byzantine_count(n)
    state = global_state(d_model)
    instructions = _instructions(n)
    if entry.startswith("flower_"):
        fn = flower_strategy(entry, n, f)
    elif entry.startswith(("strategy:", "streamed:", "arriving:")):
        strategy, instructions = robust_strategy(entry.split(":", 1)[1], n, f, state, device)
        # The numba kernels, or the device's first kernel launches (CUDA loads modules lazily): not timed.
        aggregators.build(entry.split(":", 1)[1], f=1)(torch.randn(8, 16, device=strategy.aggregation_device))
        fn = strategy.aggregate_train
    else:
        # Load (or compile) the numba kernels on a tiny input: compiling is not the reply path.
        aggregators.build(entry, f=1)(torch.randn(8, 16))
        fn = fedrobust_path(entry, f, state)
    results = []
    for server_round in range(1, rounds + 1):
        if entry.startswith("arriving:"):
            results.append(_arriving_round(strategy, state, instructions, seed=server_round))
            continue
        replies, replies_bytes = build_replies(state, instructions, seed=server_round)
        gc.collect()
        before = status_bytes("VmRSS")
        exact_peak = reset_peak_rss()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        metrics: MetricRecord | None  # Flower's strategies return None where they aggregated nothing
        if entry.startswith("streamed:"):
            intake = strategy.open_round(1, [m.metadata.dst_node_id for m in instructions])
            intake.expect({m.metadata.message_id: m.metadata.dst_node_id for m in instructions})
            for reply in replies[:-1]:  # while the last client still trains
                intake.take(reply)
            start = time.perf_counter()
            intake.take(replies[-1])
            outcome = intake.close()
            arrays, metrics = outcome.arrays, outcome.metric_record()
        else:
            start = time.perf_counter()
            arrays, metrics = fn(1, replies)
        seconds = time.perf_counter() - start
        if exact_peak:
            peak = status_bytes("VmHWM")
        else:  # ru_maxrss cannot be reset: it also counts peaks from before the call
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        if arrays is None:
            raise RuntimeError(f"{entry} did not aggregate: {metrics}")
        results.append({
            "seconds": seconds, "peak_extra_bytes": peak - before, "replies_bytes": replies_bytes,
            "device_peak_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0,
        })
        del replies, arrays, metrics
    return results


def _arriving_round(
    strategy: RobustStrategy, state: dict[str, torch.Tensor], instructions: list[Message], seed: int
) -> dict[str, float]:
    """One streamed round in which each reply exists only from its arrival until the intake has taken it."""
    if strategy._touching is not None:  # the matrix, reserved by configure_train, is resident before the round
        strategy._touching.join()
    gc.collect()
    before = status_bytes("VmRSS")
    exact_peak = reset_peak_rss()
    intake = strategy.open_round(1, [m.metadata.dst_node_id for m in instructions])
    intake.expect({m.metadata.message_id: m.metadata.dst_node_id for m in instructions})
    seconds, replies_bytes = 0.0, 0
    for i, instruction in enumerate(instructions):
        [reply], size = build_replies(state, [instruction], seed=seed * 10_000 + i)
        replies_bytes += size
        start = time.perf_counter()
        intake.take(reply)
        seconds += time.perf_counter() - start
        del reply  # the round loop keeps no reference either
    start = time.perf_counter()
    outcome = intake.close()
    seconds += time.perf_counter() - start
    peak = status_bytes("VmHWM") if exact_peak else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if outcome.arrays is None:
        raise RuntimeError(f"arriving round did not aggregate: {outcome.metric_record()}")
    return {"seconds": seconds, "peak_extra_bytes": peak - before, "replies_bytes": replies_bytes}


def measure(entry: str, n: int, d_model: str, threads: int, rounds: int, device: str) -> list[dict[str, float]]:
    """One fresh interpreter for one call per round."""
    env = {**os.environ, "BENCH_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "experiments.bench_server_path", "--child", entry, "--n", str(n)]
    cmd += ["--d-model", d_model, "--threads", str(threads), "--rounds", str(rounds)]
    cmd += ["--aggregation-device", device]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{entry} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@dataclass
class Row:
    entry: str
    server_round: int
    seconds: float
    peak_extra_bytes: int
    replies_bytes: int
    device_peak_bytes: int = 0  # CUDA memory the round allocated at its peak (--aggregation-device cuda)


def _rule_of(entry: str) -> str:
    return entry.split(":", 1)[1] if entry.startswith(("strategy:", "streamed:", "arriving:")) else entry


def print_table(rows: list[Row]) -> None:
    """Markdown table: time and peak extra memory per entry and round, with the ratios of the issue."""
    by_key = {(r.entry, r.server_round): r for r in rows}
    on_device = any(r.device_peak_bytes for r in rows)  # a column only when rules ran on a CUDA device
    print(
        "| entry | round | time (s) | x Flower FedAvg | Flower's same rule / ours | peak extra (MiB) "
        "| x replies' size |" + (" device peak (MiB) |" if on_device else "")
    )
    print("|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if on_device else ""))
    for r in rows:
        fedavg = by_key.get(("flower_fedavg", r.server_round))
        flower = by_key.get((FLOWER_FOR.get(_rule_of(r.entry), ""), r.server_round))
        vs_avg = f"{r.seconds / fedavg.seconds:.2f}" if fedavg else ""
        vs_rule = f"{flower.seconds / r.seconds:.1f}" if flower and not r.entry.startswith("flower_") else ""
        device = f" {r.device_peak_bytes / 2**20:.0f} |" if on_device else ""
        print(
            f"| {r.entry} | {r.server_round} | {r.seconds:.3f} | {vs_avg} | {vs_rule} "
            f"| {r.peak_extra_bytes / 2**20:.0f} | {r.peak_extra_bytes / r.replies_bytes:.2f} |{device}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=20, help="replies per round (default 20)")
    parser.add_argument("--d-model", choices=sorted(MODEL_WIDTHS), default="1m", help="model size (default 1m)")
    parser.add_argument("--rules", default=",".join(DEFAULT_RULES), help="comma-separated fedrobust rules or pipelines")
    parser.add_argument("--flower", default=",".join(FLOWER_ENTRIES), help="Flower entries ('' for none)")
    parser.add_argument(
        "--strategy", action="store_true", help="also time RobustStrategy.aggregate_train itself for each rule"
    )
    parser.add_argument(
        "--streamed", action="store_true",
        help="also time, for each rule, what is left of a streamed round once its last reply is in",
    )
    parser.add_argument(
        "--arriving", action="store_true",
        help="also measure, for each rule, a streamed round whose replies exist one at a time (memory)",
    )
    parser.add_argument(
        "--bare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time the bare path of each rule (default); --no-bare with --strategy times only the strategy",
    )
    parser.add_argument("--rounds", type=int, default=1, help="rounds per process (round 2 reuses the strategy)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per entry; the fastest is shown")
    parser.add_argument("--threads", type=int, default=1, help="torch/BLAS/OpenMP threads per process (default 1)")
    parser.add_argument(
        "--aggregation-device", default="cpu",
        help="RobustStrategy's aggregation_device for the strategy:/streamed:/arriving: entries (cpu, cuda, ...)",
    )
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(run_child(args.child, args.n, args.d_model, args.rounds, args.aggregation_device)))
        return
    flower = [e for e in args.flower.split(",") if e]
    unknown = [e for e in flower if e not in FLOWER_ENTRIES]
    if unknown:
        raise SystemExit(f"--flower: unknown entry {unknown[0]!r}; valid: {', '.join(FLOWER_ENTRIES)}")
    rules = [r for r in args.rules.split(",") if r]
    for rule in rules:  # a rule or a pipeline (winsorize+nnm+trimmed_mean), as aggregators.build takes it
        try:
            aggregators.build(rule, f=byzantine_count(args.n))
        except ValueError as err:
            raise SystemExit(str(err)) from None
    try:
        device = pick_device(args.aggregation_device)
    except ValueError as err:
        raise SystemExit(f"--aggregation-device: {err}") from None
    on = f", rules on {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    shapes = resnet18_shapes(MODEL_WIDTHS[args.d_model])
    print(
        f"n={args.n} replies, model {args.d_model}: {sum(math.prod(s) for s in shapes.values()):,} float32 in "
        f"{len(shapes)} tensors, f={byzantine_count(args.n)}, {args.threads} thread(s), torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}{on}"
    )
    entries = flower + (rules if args.bare else []) + ([f"strategy:{r}" for r in rules] if args.strategy else [])
    entries += [f"streamed:{r}" for r in rules] if args.streamed else []
    entries += [f"arriving:{r}" for r in rules] if args.arriving else []
    results: dict[str, list[list[dict[str, float]]]] = {e: [] for e in entries}
    for _ in range(args.repeats):  # interleaved, so that load changes hit every entry alike
        for entry in entries:
            results[entry].append(
                measure(entry, args.n, args.d_model, args.threads, args.rounds, args.aggregation_device)
            )
            times = ", ".join(f"{r['seconds']:.3f}" for r in results[entry][-1])
            print(f"  {entry}: {times} s", file=sys.stderr, flush=True)
    rows: list[Row] = []
    for server_round in range(1, args.rounds + 1):
        for entry in entries:
            runs = [per_round[server_round - 1] for per_round in results[entry]]
            rows.append(
                Row(
                    entry=entry,
                    server_round=server_round,
                    seconds=min(r["seconds"] for r in runs),
                    peak_extra_bytes=int(max(r["peak_extra_bytes"] for r in runs)),
                    replies_bytes=int(runs[0]["replies_bytes"]),
                    device_peak_bytes=int(max(r.get("device_peak_bytes", 0) for r in runs)),
                )
            )
    print(
        f"replies: {rows[0].replies_bytes / 2**20:.0f} MiB of array bytes; time: fastest of {args.repeats} "
        f"processes, memory: largest of {args.repeats}; load average now {os.getloadavg()[0]:.1f}"
    )
    print_table(rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([vars(r) for r in rows], fh, indent=2)


if __name__ == "__main__":
    main()
