"""Let a server process hand freed reply buffers back to the operating system at once.

A round's replies are large buffers (one per client, megabytes to gigabytes). glibc's malloc
serves a large block with mmap and returns it to the OS when freed, but after the first such
free it raises its mmap threshold to that block's size ("dynamic threshold"), so later reply
buffers come from the heap and stay in the process after they are freed. The strategy frees
each reply once its row of the update matrix is written; with the dynamic threshold that
memory is not reusable by the matrix (one large block), and the round peaks at replies +
matrix. A fixed threshold keeps large buffers on mmap, so each freed reply leaves the process
as its row is filled (docs/benchmarks.md, "Server reply path": peak extra memory 1.02x -> 0.09x
the replies' size at n=50, d=11.2M).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
DEFAULT_THRESHOLD = 1 << 20  # 1 MiB: tensors above it are the reply's bulk; smaller ones stay on the heap

_applied: int | None = None


def return_large_frees_to_os(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process (once); False where not glibc.

    Process-wide and harmless for correctness: blocks of at least ``threshold`` bytes are mapped
    and unmapped directly instead of being kept in the heap after they are freed.
    """
    global _applied
    if _applied is not None:
        return _applied == threshold
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl or another libc without mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, threshold) != 1:
        log.debug("mallopt(M_MMAP_THRESHOLD, %d) refused", threshold)
        return False
    _applied = threshold
    return True
