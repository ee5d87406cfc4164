"""Benchmark round checkpoints: save / load time, size on disk, and what save_async saves the caller.

Two server states, each as the round loop checkpoints it (global model, server-optimizer moments, RNG
states, liveness state and metrics history in JSON):

* ``mlp-digits``: the default digits MLP (64 -> 64 -> 10, 4,810 parameters) with FedAdam's two moments;
* ``resnet-11m``: an 11.2M-parameter ResNet (widths 64/128/256/512, two blocks per stage, as ResNet-18)
  with Adam's two moments.

For each it times a synchronous ``save`` (serialize + sha256 + write + fsync + rename), ``latest_valid``
(read + verify + load), the time ``save_async`` blocks its caller (serialization only), and, as a
reference without the disk, a ``save`` to ``memory://``. Times are medians over ``--repeats`` runs.

Run::

    .venv/bin/python -m experiments.bench_checkpoint [--repeats 5] [--dir /path/on/the/disk/to/test]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import fsspec
import torch

from fedrobust.checkpoint import CheckpointStore, capture_rng_state, config_hash, join_groups
from fedrobust.liveness import LivenessTracker
from fedrobust.models import build_model
from fedrobust.server_optim import ServerOptimizer


def server_state(case: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors and meta of one realistic server checkpoint for ``case``."""
    torch.manual_seed(0)
    if case == "mlp-digits":
        model = build_model("mlp", input_shape=(64,), num_classes=10, hidden=(64,))
    else:
        model = build_model(
            "resnet", input_shape=(3, 32, 32), num_classes=10, widths=(64, 128, 256, 512), blocks_per_stage=2
        )
    params = model.state_dict()
    optimizer = ServerOptimizer(name="fedadam", lr=0.01)
    # One step fills both moments (m and v) of every float tensor: two extra model copies.
    update = {k: torch.randn_like(v) for k, v in params.items() if v.is_floating_point()}
    optimizer.step(params, update)
    opt_tensors, opt_meta = optimizer.state_dict()
    rng_tensors, rng_meta = capture_rng_state()

    tracker = LivenessTracker()
    for node in range(20):
        tracker.record_reply(node, 100, now=float(node))
    history = [{"round": r, "accuracy": 0.9, "loss": 0.3, "accepted": 18, "rejected": 2} for r in range(100)]
    tensors = join_groups({"model": params, "optimizer": opt_tensors, "rng": rng_tensors})
    meta = {
        "config_hash": config_hash({"case": case}),
        "optimizer": opt_meta,
        "rng": rng_meta,
        "liveness": tracker.state_dict(),
        "history": history,
    }
    return tensors, meta


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_case(case: str, directory: str, repeats: int) -> dict[str, Any]:
    tensors, meta = server_state(case)
    numel = sum(t.numel() for t in tensors.values())
    path = os.path.join(directory, case)
    store = CheckpointStore(path, keep=2)
    round_ = iter(range(1, 10_000))

    save_s = median_seconds(lambda: store.save(next(round_), tensors, meta), repeats)
    load_s = median_seconds(lambda: store.latest_valid(meta["config_hash"]), repeats)

    blocked = []
    for _ in range(repeats):
        start = time.perf_counter()
        future = store.save_async(next(round_), tensors, meta)
        blocked.append(time.perf_counter() - start)
        future.result()  # measure one write at a time: no queueing behind the previous one
    store.close()

    latest = os.path.join(path, f"round-{store.rounds()[-1]:06d}")
    size = sum(entry.stat().st_size for entry in os.scandir(latest))

    memory_url = f"memory://bench-{uuid.uuid4().hex}"
    memory_store = CheckpointStore(memory_url, keep=2)
    memory_s = median_seconds(lambda: memory_store.save(next(round_), tensors, meta), repeats)
    fs, root = fsspec.core.url_to_fs(memory_url)
    fs.rm(root, recursive=True)

    return {
        "case": case,
        "elements": numel,
        "size_mb": size / 1e6,
        "save_ms": save_s * 1e3,
        "load_ms": load_s * 1e3,
        "async_blocked_ms": statistics.median(blocked) * 1e3,
        "memory_save_ms": memory_s * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median reported)")
    parser.add_argument("--dir", default=None, help="directory on the disk to test (default: a temp dir)")
    args = parser.parse_args()
    if args.dir is not None and not os.path.isdir(args.dir):
        parser.error(f"--dir {args.dir}: no such directory (the disk to test is one that exists)")

    torch.set_num_threads(1)  # serialization is single-threaded anyway; keep the shared machine usable
    directory = tempfile.mkdtemp(prefix="bench-checkpoint-", dir=args.dir)
    try:
        rows = [bench_case(case, directory, args.repeats) for case in ("mlp-digits", "resnet-11m")]
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    print(
        f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f}, disk under {args.dir or tempfile.gettempdir()}, "
        f"median of {args.repeats}"
    )
    print()
    print(
        "| state | tensor elements | size on disk | save (fsync) | load + verify | save_async blocks caller "
        "| blocked / save | save to memory:// |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['case']} | {r['elements']:,} | {r['size_mb']:.2f} MB | {r['save_ms']:.1f} ms "
            f"| {r['load_ms']:.1f} ms | {r['async_blocked_ms']:.1f} ms "
            f"| {r['async_blocked_ms'] / r['save_ms']:.2f} | {r['memory_save_ms']:.1f} ms |"
        )


if __name__ == "__main__":
    main()
