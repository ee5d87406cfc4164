"""CPU cost of fedrobust's part of a ClientApp process on a SuperNode, which starts one per message.

    python -m experiments.bench_client_start --repeats 5

Each repeat is a fresh process that does what a train message does on a device with its own data:
imports ``fedrobust.clients.client_app`` (what ``flwr-clientapp`` loads), ``fedrobust.components``
and ``fedrobust.training`` (what the train handler imports), and reads a 50-example ``.npz`` with
``components.load_local``. It prints the process's CPU time (user + system) at the end.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

CHILD = """
import time
from fedrobust.clients import client_app  # noqa: F401
from fedrobust import components, training  # noqa: F401
from fedrobust.config import RunConfig
assert len(components.load_local({path!r}, RunConfig())) == 50
print(time.process_time())
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.bench_client_start", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes (default 5)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "device.npz"
        rng = np.random.default_rng(0)
        np.savez(path, x=rng.random((50, 64), dtype=np.float32), y=rng.integers(0, 10, 50))
        seconds = [
            float(subprocess.run([sys.executable, "-c", CHILD.format(path=str(path))], check=True,
                                 capture_output=True, text=True).stdout.split()[-1])
            for _ in range(args.repeats)
        ]
    listed = ", ".join(f"{s:.2f}" for s in seconds)
    print(f"CPU per process (s): {listed}; median {statistics.median(seconds):.2f}")


if __name__ == "__main__":
    main()
