"""One shared pool of worker threads for the server's compiled kernels and row writes.

The kernels and NumPy's inner loops release the GIL, so threads give real parallelism. One pool
per thread count (``torch.get_num_threads()``, which users and launchers already set) means at most
that many of these tasks run at once, whichever part of the server starts them.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["pool", "thread_count"]

_pools: dict[int, ThreadPoolExecutor] = {}


def thread_count() -> int:
    """The threads the server may use for one computation: ``torch.get_num_threads()``."""
    return max(1, torch.get_num_threads())


def pool(threads: int) -> ThreadPoolExecutor:
    """The pool of ``threads`` workers (created on first use, then kept)."""
    found = _pools.get(threads)
    if found is None:
        found = _pools[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fedrobust-kernel")
    return found
