"""Benchmark the remote and incremental checkpoint modes: mirror blocking time, bytes of deltas vs full saves.

1. **Mirror**: the time a save blocks the caller with ``MirroredStore`` (local disk, then a background
   upload to S3) against a plain local save and a direct save to S3. S3 is moto's server on loopback (see
   :mod:`experiments.local_s3`), so the "network" is fast here; what matters is that the mirrored save
   costs what the local one costs, whatever the upload takes (also reported).
2. **Incremental**: bytes written over a 50-round run checkpointed every round, full checkpoints every
   round vs ``full_every=10`` (a full checkpoint every 10 saves, deltas in between), for a 2.8M-parameter
   ResNet with FedAdam's two moments (three model-sized copies). Two honest training regimes:

   * ``all parameters train``: every float tensor (weights, BN statistics, both Adam moments) changes
     every round, as in ordinary FL; the deltas then hold the zlib-compressed XOR of each tensor's bytes
     with the previous round's (exact), so the saving is only what compression of close floats gives;
   * ``head + BN train``: a frozen backbone (federated fine-tuning of the classifier head and the
     BatchNorm layers); the pseudo-gradient of the frozen tensors is exactly zero, so they and their Adam
     moments do not change and the deltas skip them.

   Pseudo-gradients are Gaussian with std 1e-3 (FedAdam, lr 0.01, tau 1e-3), drawn from a seeded generator.

Run::

    .venv/bin/python -m experiments.bench_checkpoint_remote [--repeats 5] [--rounds 50] [--full-every 10]
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
from typing import Any

import torch

from experiments.bench_checkpoint import median_seconds, server_state
from experiments.local_s3 import local_s3
from fedrobust.checkpoint import CheckpointStore, join_groups
from fedrobust.checkpoint_mirror import MirroredStore
from fedrobust.models import build_model
from fedrobust.server_optim import ServerOptimizer


def bench_mirror(case: str, directory: str, repeats: int) -> dict[str, Any]:
    tensors, meta = server_state(case)
    rounds = iter(range(1, 100_000))
    with local_s3(bucket="bench") as s3:
        local = CheckpointStore(os.path.join(directory, f"{case}-local"), keep=2)
        local_s = median_seconds(lambda: local.save(next(rounds), tensors, meta), repeats)
        direct = CheckpointStore(f"s3://bench/{case}-direct", keep=2, storage_options=s3.storage_options)
        direct_s = median_seconds(lambda: direct.save(next(rounds), tensors, meta), repeats)

        mirror = MirroredStore(
            os.path.join(directory, f"{case}-mirror"), f"s3://bench/{case}-mirror", keep=2,
            storage_options=s3.storage_options,
        )
        blocked, uploads, async_blocked = [], [], []
        for _ in range(repeats):
            start = time.perf_counter()
            mirror.save(next(rounds), tensors, meta)
            blocked.append(time.perf_counter() - start)
            assert mirror.flush(timeout=600)
            uploads.append(time.perf_counter() - start - blocked[-1])
        for _ in range(repeats):
            start = time.perf_counter()
            mirror.save_async(next(rounds), tensors, meta)
            async_blocked.append(time.perf_counter() - start)
            assert mirror.flush(timeout=600)
        mirror.close()
        assert mirror.upload_failures == 0
    return {
        "case": case,
        "local_ms": local_s * 1e3,
        "direct_ms": direct_s * 1e3,
        "mirror_ms": statistics.median(blocked) * 1e3,
        "mirror_async_ms": statistics.median(async_blocked) * 1e3,
        "upload_ms": statistics.median(uploads) * 1e3,
    }


def training_states(regime: str, rounds: int) -> list[dict[str, torch.Tensor]]:
    """The server state after each round (model + FedAdam moments), for one training regime."""
    torch.manual_seed(0)
    model = build_model("resnet", input_shape=(3, 32, 32), num_classes=10, widths=(32, 64, 128, 256),
                        blocks_per_stage=2)
    params = {k: v.clone() for k, v in model.state_dict().items()}
    trains = {
        k: regime == "all" or k.startswith("head.") or ".bn" in k or k.startswith("stem.1")
        for k in params
    }
    optimizer = ServerOptimizer(name="fedadam", lr=0.01, tau=1e-3)
    gen = torch.Generator().manual_seed(1)
    states = []
    for _ in range(rounds):
        update = {}
        for key, value in params.items():
            if value.is_floating_point():
                noise = torch.randn(value.shape, generator=gen) * 1e-3
                update[key] = noise if trains[key] else torch.zeros_like(value)
        params.update(optimizer.step(params, update))
        for key, value in params.items():
            if key.endswith("num_batches_tracked") and trains[key]:
                params[key] = value + 10
        opt_tensors, _ = optimizer.state_dict()
        states.append({k: v.clone() for k, v in join_groups({"model": params, "optimizer": opt_tensors}).items()})
    return states


def bench_incremental(regime: str, directory: str, rounds: int, full_every: int) -> dict[str, Any]:
    states = training_states(regime, rounds)
    result: dict[str, Any] = {"regime": regime, "elements": sum(t.numel() for t in states[0].values())}
    for mode, every in (("full", 1), ("incremental", full_every)):
        path = os.path.join(directory, f"{regime}-{mode}")
        store = CheckpointStore(path, keep=rounds + 1, full_every=every)
        written, save_times = 0, []
        for round_, tensors in enumerate(states):
            start = time.perf_counter()
            location = store.save(round_, tensors, {"round": round_})
            save_times.append(time.perf_counter() - start)
            written += sum(entry.stat().st_size for entry in os.scandir(location))
        start = time.perf_counter()
        checkpoint = CheckpointStore(path).latest_valid()
        load_s = time.perf_counter() - start
        assert checkpoint is not None and checkpoint.round == rounds - 1
        for key, tensor in states[-1].items():  # bit-identical restore, or the figures mean nothing
            restored = checkpoint.tensors[key]
            assert torch.equal(restored.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), key
        result[f"{mode}_bytes"] = written
        result[f"{mode}_save_ms"] = statistics.median(save_times) * 1e3
        result[f"{mode}_load_ms"] = load_s * 1e3
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="timed saves per measurement (median reported)")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--full-every", type=int, default=10)
    parser.add_argument("--dir", default=None, help="directory on the disk to test (default: a temp dir)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    directory = tempfile.mkdtemp(prefix=f"bench-ckpt-remote-{uuid.uuid4().hex[:6]}-", dir=args.dir)
    try:
        mirror_rows = [bench_mirror(case, directory, args.repeats) for case in ("mlp-digits", "resnet-11m")]
        incremental_rows = [bench_incremental(r, directory, args.rounds, args.full_every) for r in ("all", "head")]
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    print(
        f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f}, disk under {args.dir or tempfile.gettempdir()}"
    )
    print()
    print("| state | local save | direct S3 save | mirrored save blocks | mirrored / local | mirrored save_async "
          "blocks | background upload |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in mirror_rows:
        print(
            f"| {r['case']} | {r['local_ms']:.1f} ms | {r['direct_ms']:.1f} ms | {r['mirror_ms']:.1f} ms "
            f"| {r['mirror_ms'] / r['local_ms']:.2f} | {r['mirror_async_ms']:.1f} ms | {r['upload_ms']:.1f} ms |"
        )
    print()
    print(f"| regime ({args.rounds} rounds, every round saved) | tensor elements | full: bytes | incremental "
          f"(K={args.full_every}): bytes | ratio | save full / incr. (median) | load last full / incr. |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    names = {"all": "all parameters train", "head": "head + BN train (frozen backbone)"}
    for r in incremental_rows:
        print(
            f"| {names[r['regime']]} | {r['elements']:,} | {r['full_bytes'] / 1e6:.1f} MB "
            f"| {r['incremental_bytes'] / 1e6:.1f} MB | {r['incremental_bytes'] / r['full_bytes']:.1%} "
            f"| {r['full_save_ms']:.0f} / {r['incremental_save_ms']:.0f} ms "
            f"| {r['full_load_ms']:.0f} / {r['incremental_load_ms']:.0f} ms |"
        )


if __name__ == "__main__":
    main()
