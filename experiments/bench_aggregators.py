"""Benchmark the robust aggregation rules against a plain mean and against Flower's built-in rules.

For every size ``n x d`` the script times, on one float32 tensor in one process and in interleaved
rounds (the minimum per entry is reported), a plain
``x.mean(0)``, every fedrobust rule, and Flower's implementations on the same values:
``np.median`` over the stacked arrays (what ``FedMedian`` does),
``flwr.serverapp.strategy.fedtrimmedavg.trim_mean`` and the distance + selection step
``flwr.serverapp.strategy.multikrum.select_multikrum`` (used by Flower's ``Krum`` and ``MultiKrum``).
Ratios taken in one run are robust to other work on the machine; absolute times are not.

With ``--memory`` each rule also runs once more in a fresh subprocess, which reports its peak
resident memory during the call (``VmHWM`` after resetting it, else ``ru_maxrss``) above what the
process held with the input allocated.

Usage::

    python -m experiments.bench_aggregators                    # full grid: n in {10,20,50}, d in {100k,1M,11.2M}
    python -m experiments.bench_aggregators --quick            # n=20, d in {100k, 1M}
    python -m experiments.bench_aggregators --sizes 20x1M,50x11.2M --memory --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from fedrobust import aggregators

logger = logging.getLogger(__name__)

RULE_PARAMS: dict[str, dict] = {"centered_clipping": {"tau": 1.0}}
FLOWER = ("flower_median", "flower_trimmed_mean", "flower_multikrum_select")
# Which Flower implementation each fedrobust rule is compared with.
FLOWER_FOR = {
    "median": "flower_median",
    "trimmed_mean": "flower_trimmed_mean",
    "krum": "flower_multikrum_select",
    "multikrum": "flower_multikrum_select",
}
DEFAULT_SIZES = [(n, d) for n in (10, 20, 50) for d in (100_000, 1_000_000, 11_200_000)]
QUICK_SIZES = [(20, 100_000), (20, 1_000_000)]


def parse_size(text: str) -> tuple[int, int]:
    """``"20x1M"`` -> ``(20, 1_000_000)``; suffixes k and M, decimals allowed (``11.2M``)."""
    n, d = text.lower().split("x")
    scale = {"k": 1_000, "m": 1_000_000}.get(d[-1], 1)
    return int(n), int(float(d.rstrip("km")) * scale)


def byzantine_count(n: int) -> int:
    """The largest ``f`` every rule accepts (Bulyan: ``n >= 4f + 3``), at least 1."""
    return max(1, (n - 3) // 4)


def make_input(n: int, d: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def flower_callables(x: torch.Tensor, f: int, names: tuple[str, ...] = FLOWER) -> dict[str, Callable[[], object]]:
    """Flower's own functions, fed the way its strategies feed them (one array per client).

    The ArrayRecords that ``select_multikrum`` reads are built here, outside the timing: in a
    Flower server they arrive as the clients' replies.
    """
    from flwr.app import ArrayRecord, RecordDict
    from flwr.serverapp.strategy.fedtrimmedavg import trim_mean
    from flwr.serverapp.strategy.multikrum import select_multikrum
    from threadpoolctl import threadpool_limits

    n = x.shape[0]
    layers = [row.numpy() for row in x]
    fns: dict[str, Callable[[], object]] = {
        "flower_median": lambda: np.median(np.stack(layers), axis=0),
        "flower_trimmed_mean": lambda: trim_mean(np.stack(layers), f / n),
    }
    if "flower_multikrum_select" in names:
        contents = [RecordDict({"arrays": ArrayRecord([layer])}) for layer in layers]

        def multikrum_select() -> object:
            # One BLAS thread: on a shared 2-core machine numpy's multi-threaded OpenBLAS matmul
            # swings between 0.05 and 10 s for the same call; one thread is steady and, if
            # anything, flatters Flower here.
            with threadpool_limits(limits=1, user_api="blas"):
                return select_multikrum(contents, num_malicious_nodes=f, num_nodes_to_select=n - f)

        fns["flower_multikrum_select"] = multikrum_select
    return {name: fns[name] for name in names}


def fedrobust_callables(x: torch.Tensor, f: int, rules: list[str]) -> dict[str, Callable[[], object]]:
    built = {name: aggregators.build(name, f=f, **RULE_PARAMS.get(name, {})) for name in rules}
    # FLTrust also takes the server's own update each call: the mean of the rows stands for it (computed
    # once, outside the timing; a server trains it on its root data set).
    server_update = x.mean(dim=0) if any(agg.needs_server_update for agg in built.values()) else None
    return {name: functools.partial(_call, agg, x, server_update) for name, agg in built.items()}


def _call(agg: aggregators.Aggregator, x: torch.Tensor, server_update: torch.Tensor | None) -> object:
    if server_update is not None and agg.needs_server_update:
        agg.set_server_update(server_update)
    return agg(x)


def best_times(fns: dict[str, Callable[[], object]], repeats: int, budget_s: float) -> dict[str, float]:
    """Minimum wall time of each function, over interleaved rounds that call every function once.

    Interleaving spreads bursts of other work on the machine over all functions instead of letting
    one burst inflate a single entry. A function drops out of later rounds once it has two timings
    and has used ``budget_s`` seconds. Each function is called once untimed first (warm-up).
    """
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if len(times[name]) >= 2 and sum(times[name]) > budget_s:
                continue
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: min(values) for name, values in times.items()}


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


@dataclass
class Row:
    n: int
    d: int
    f: int
    name: str
    seconds: float
    ratio_to_mean: float
    flower: str | None = None
    speedup_vs_flower: float | None = None
    peak_extra_bytes: int | None = None


def child_peak(n: int, d: int, name: str) -> int:
    """Run ``name`` once in a fresh interpreter; its peak RSS minus the RSS with the input allocated."""
    threads = ["--threads", str(torch.get_num_threads())]
    out = subprocess.run(
        [sys.executable, "-m", "experiments.bench_aggregators", "--child", f"{n}x{d}", name, *threads],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(json.loads(out.stdout.strip().splitlines()[-1])["peak_extra_bytes"])


def run_child(size: str, name: str) -> None:
    n, d = parse_size(size)
    f = byzantine_count(n)
    # Load (or compile) the kernels on a tiny input first: their code is not the rule's memory.
    aggregators.build("median")(torch.randn(3, 8))
    x = make_input(n, d)
    fn: Callable[[], object]
    if name == "plain_mean":
        fn = lambda: x.mean(dim=0)  # noqa: E731
    elif name in FLOWER:
        fn = flower_callables(x, f, (name,))[name]
    else:
        fn = fedrobust_callables(x, f, [name])[name]
    before = status_bytes("VmRSS")
    if reset_peak_rss():
        fn()
        peak = status_bytes("VmHWM")
    else:  # ru_maxrss cannot be reset: it also counts peaks from before the call
        fn()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    print(json.dumps({"peak_extra_bytes": peak - before}))


def compile_seconds() -> tuple[float, float]:
    """Seconds to compile the numba kernels with an empty cache, and to load them from the cache."""
    import tempfile

    code = (
        "import time, fedrobust.aggregators; t = time.perf_counter(); "
        "import fedrobust.aggregators._kernels; print(time.perf_counter() - t)"
    )
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}

        def timed_import() -> float:
            done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            return float(done.stdout)

        cold = timed_import()
        warm = timed_import()
    return cold, warm


def benchmark_size(n: int, d: int, rules: list[str], args: argparse.Namespace) -> list[Row]:
    f = byzantine_count(n)
    x = make_input(n, d)
    fns: dict[str, Callable[[], object]] = {"plain_mean": lambda: x.mean(dim=0)}
    fns.update(fedrobust_callables(x, f, rules))
    if not args.no_flower:
        fns.update(flower_callables(x, f))
    times = best_times(fns, args.repeats, args.budget)
    for name, seconds in times.items():
        logger.info("n=%d d=%d %s: %.1f ms", n, d, name, 1e3 * seconds)
    mean_s = times["plain_mean"]
    rows = []
    for name, seconds in times.items():
        flower = None if args.no_flower else FLOWER_FOR.get(name)
        row = Row(n, d, f, name, seconds, seconds / mean_s, flower, times[flower] / seconds if flower else None)
        if args.memory:
            row.peak_extra_bytes = child_peak(n, d, name)
        rows.append(row)
    return rows


def print_table(rows: list[Row]) -> None:
    print("| n | d | f | rule | time (ms) | x mean | vs Flower | peak extra RSS (MiB) | % of input |")
    print("|---|---|---|---|---:|---:|---|---:|---:|")
    for r in rows:
        vs = f"{r.speedup_vs_flower:.1f}x faster than {r.flower}" if r.flower else ""
        mem = pct = ""
        if r.peak_extra_bytes is not None:
            mem = f"{r.peak_extra_bytes / 2**20:.0f}"
            pct = f"{100 * r.peak_extra_bytes / (4 * r.n * r.d):.0f}"
        cells = [r.n, f"{r.d:,}", r.f, r.name, f"{1e3 * r.seconds:.1f}", f"{r.ratio_to_mean:.1f}", vs, mem, pct]
        print("| " + " | ".join(map(str, cells)) + " |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only n=20 with d in {100k, 1M}")
    parser.add_argument("--sizes", help="comma-separated n x d, e.g. 20x1M,50x11.2M")
    parser.add_argument("--rules", help="comma-separated subset of fedrobust rules")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (the minimum per rule is reported)")
    parser.add_argument("--budget", type=float, default=20.0, help="stop repeating a rule after this many s")
    parser.add_argument("--threads", type=int, help="torch threads (also the kernels' thread count)")
    parser.add_argument("--memory", action="store_true", help="peak RSS per rule, each in a fresh subprocess")
    parser.add_argument("--no-flower", action="store_true", help="skip Flower's implementations")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--child", nargs=2, metavar=("SIZE", "NAME"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        run_child(*args.child)
        return
    if args.sizes:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    else:
        sizes = QUICK_SIZES if args.quick else DEFAULT_SIZES
    rules = args.rules.split(",") if args.rules else aggregators.names()
    cold, warm = compile_seconds()
    print(f"numba kernels: compile {cold:.1f} s with an empty cache, load {warm:.2f} s from the cache (not timed)")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f} at start\n"
    )
    rows = [row for n, d in sizes for row in benchmark_size(n, d, rules, args)]
    print_table(rows)
    print(f"\nload average {os.getloadavg()[0]:.1f} at end")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"compile_s": cold, "load_s": warm, "rows": [asdict(r) for r in rows]}, fh, indent=1)


if __name__ == "__main__":
    main()
