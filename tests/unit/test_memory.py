"""The server process keeps large freed buffers off the heap (fedrobust.memory).

What it saves is measured in docs/benchmarks.md ("Server reply path"), not here: peak memory is a
benchmark figure. This checks that the strategy applies the setting before any reply can arrive.
"""

from __future__ import annotations

import platform
import subprocess
import sys

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def test_the_strategy_fixes_the_threshold_before_replies_arrive() -> None:
    script = r"""
from flwr.app import ArrayRecord, ConfigRecord
import torch
from types import SimpleNamespace
from flwr.supercore.task_identity import TaskIdentity
from fedrobust import RobustStrategy, memory

TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1  # as inside a ServerApp

class Grid:
    run = SimpleNamespace(run_id=1)
    def get_node_ids(self):
        return [1, 2, 3]
    def get_nodes(self):
        return [SimpleNamespace(node_id=n, status="online") for n in self.get_node_ids()]

for enabled in (False, True):
    strategy = RobustStrategy("median", 0, min_train_nodes=3, min_available_nodes=3, progress=False,
                              return_freed_memory=enabled)
    strategy.configure_train(1, ArrayRecord({"w": torch.zeros(4)}), ConfigRecord(), Grid())
    print(memory._applied is not None)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", str(GLIBC)]
