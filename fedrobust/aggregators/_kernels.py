"""Numba kernels for CPU tensors: coordinate-wise order statistics and the centered Gram matrix.

The rows are passed as flat storage plus a row stride, so that every inner loop is a unit-stride loop
numba can vectorize. Each kernel walks the coordinates in cache-sized blocks and first copies the
block of every row it needs into a scratch buffer.

* The order-statistic kernels run a comparator network over the rows of the block (one vectorized
  ``min``/``max`` pass per comparator), then reduce the wanted sorted positions. Coordinates are
  independent, so the result does not depend on the block size or on how the columns are split.
* The Gram kernel centers the block on a reference row while copying it (clamping it first to a
  winsorizing stage's bounds, if given) and accumulates the lower
  triangle of the inner products, two rows by four at a time, in float32 per block and float64
  across blocks. Only this kernel allows reassociation, so that its dot products vectorize.

The kernels are compiled once per dtype (``cache=True`` keeps the machine code on disk, in a directory
keyed by this file's content: see ``_kernel_cache``) and release the GIL, so the columns are split
over a thread pool sized by ``torch.get_num_threads()`` (``fedrobust.threads``), in more pieces than
threads so that a thread slowed by other work on the machine does not hold up a call. A call must get
all its columns at once for that: the order-statistic kernels read the rows in place in one launch,
and the Gram matrix hands its column spans to the pool (adding their parts in span order, so that its
bytes do not depend on the thread count either).
Importing this module compiles or loads them; callers import it lazily.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from numba import types

from fedrobust.aggregators import _kernel_cache
from fedrobust.threads import pool, thread_count

__all__ = ["block_size", "closest_mean", "gram", "launch", "window_bounds", "window_mean"]

logger = logging.getLogger(__name__)

_kernel_cache.install()  # before the decorators below look for their cache

# Scratch per block of every kernel: (rows + 1) x block values, in a core's L2 cache. A comparator
# network makes hundreds of passes over its block, and the Gram kernel a pass per tile of rows, each with
# a fixed cost (row lookups, loop set-up, the tile's sums added to the result); wider blocks spread it.
# On one thread, by scratch size: the trimmed mean of 50 x 11.2M float32 24 KiB (L1, blocks of 112)
# 0.90 s, 96 KiB (480) 0.84 s, 192 KiB (960) 0.60 s, 400 KiB (2000) 0.67 s; the Gram matrix of the same
# rows 0.95-0.99 s at 24 KiB, 0.64 s at 96 KiB, 0.56 s at 192 KiB, and of 100 x 11.2M 4.57 s (blocks of
# 48) against 1.93 s (464). The Gram's float32 partial sums then run over a longer block; pairwise
# distances of close rows (noise 1e-4 on a common row of scale 1e-2) were still within 7e-9 of float64.
_SCRATCH_BYTES = 192 * 1024


@numba.njit(nogil=True, boundscheck=False, cache=True)
def _load_block(x, row_stride, first, rows, width, buf):
    # Slices keep every inner loop on unit-stride, provably non-negative indices, which is what
    # lets LLVM vectorize them. Finiteness is checked in the same pass: v - v is 0 only for finite v.
    finite = True
    for i in range(rows.shape[0]):
        offset = rows[i] * row_stride + first
        src = x[offset : offset + width]
        dst = buf[i]
        for j in range(width):
            v = src[j]
            dst[j] = v
            finite &= (v - v) == 0.0
    return finite


@numba.njit(nogil=True, boundscheck=False, cache=True)
def _run_network(buf, slot, comp_a, comp_b, width):
    # ``slot`` maps wires to scratch rows; the minimum goes to the spare row and the wire is
    # re-pointed. Writing ``min`` back into its own input row makes LLVM emit masked stores, which
    # are slow on some x86 cores; a separate destination keeps both stores plain vector stores.
    spare = slot.shape[0] - 1
    for c in range(comp_a.shape[0]):
        wa = comp_a[c]
        pa = slot[wa]
        ps = slot[spare]
        ra = buf[pa]
        rb = buf[slot[comp_b[c]]]
        rs = buf[ps]
        for j in range(width):
            a = ra[j]
            b = rb[j]
            rs[j] = min(a, b)
            rb[j] = max(a, b)
        slot[wa] = ps
        slot[spare] = pa


def _signature(dtype, *scalars):
    flat = types.Array(dtype, 1, "C")
    index = types.Array(types.int64, 1, "C", readonly=True)
    # x (flattened rows), row stride, first column, columns, row indices, comparators, ..., out
    rows = types.Array(types.int64, 1, "C")
    return types.boolean(flat, types.int64, types.int64, types.int64, rows, index, index, *scalars, flat)


_WINDOW_SIGNATURES = [_signature(t, types.int64, types.int64, types.int64) for t in (types.float32, types.float64)]
_CLOSEST_SIGNATURES = [_signature(t, types.int64, types.int64) for t in (types.float32, types.float64)]
_BOUNDS_SIGNATURES = [
    types.boolean(
        types.Array(t, 1, "C"), types.int64, types.int64, types.int64, types.Array(types.int64, 1, "C"),
        types.Array(types.int64, 1, "C", readonly=True), types.Array(types.int64, 1, "C", readonly=True),
        types.int64, types.int64, types.int64,
        types.Array(t, 2, "C"),  # out: [columns, 2], the smallest then the largest
    )
    for t in (types.float32, types.float64)
]
_GRAM_SIGNATURES = [
    types.void(
        types.Array(t, 1, "C"),  # x: flat rows
        types.int64,  # row stride
        types.int64,  # first column
        types.int64,  # columns
        types.int64,  # n: rows of x
        types.int64,  # reference row
        types.Array(t, 2, "C"),  # extra vectors, [e, d]
        types.int64,  # 1 to append the reference row itself
        types.Array(t, 2, "C", readonly=True),  # [2, d] bounds every row value is clamped to, or [0, 0]
        types.int64,  # block
        types.Array(types.float64, 2, "C"),  # out, accumulated
    )
    for t in (types.float32, types.float64)
]

_compile_start = time.perf_counter()


@numba.njit(_WINDOW_SIGNATURES, nogil=True, boundscheck=False, cache=True)
def window_mean(x, row_stride, first, columns, rows, comp_a, comp_b, lo, hi, block, out):
    """Per column of the selected rows: mean of the sorted positions ``lo..hi-1``.

    Row ``r`` of the input is ``x[r * row_stride + first : r * row_stride + first + columns]``.
    Returns False if any value read was not finite.
    """
    m = rows.shape[0]
    buf = np.empty((m + 1, block), x.dtype)
    slot = np.empty(m + 1, np.int64)
    acc = np.empty(block, np.float64)
    scale = 1.0 / (hi - lo)
    finite = True
    for start in range(0, columns, block):
        width = min(block, columns - start)
        finite &= _load_block(x, row_stride, first + start, rows, width, buf)
        for i in range(m + 1):
            slot[i] = i
        _run_network(buf, slot, comp_a, comp_b, width)
        for j in range(width):
            acc[j] = 0.0
        for p in range(lo, hi):
            row = buf[slot[p]]
            for j in range(width):
                acc[j] += row[j]
        dst = out[start : start + width]
        for j in range(width):
            dst[j] = acc[j] * scale
    return finite


@numba.njit(_BOUNDS_SIGNATURES, nogil=True, boundscheck=False, cache=True)
def window_bounds(x, row_stride, first, columns, rows, comp_a, comp_b, lo, hi, block, out):
    """Per column of the selected rows: the smallest and the largest of the sorted positions ``lo..hi-1``.

    With a window network for ``[lo, hi)`` these are the minimum and maximum over its wires: one pass
    for both, at the cost of a trimmed mean. Returns False if any value read was not finite.
    """
    # The load-and-sort steps are written out in each kernel: moved into a shared jitted helper they made
    # the trimmed mean 15% slower (0.85 -> 0.98 s at n = 50, d = 11.2M).
    m = rows.shape[0]
    buf = np.empty((m + 1, block), x.dtype)
    slot = np.empty(m + 1, np.int64)
    low = np.empty(block, x.dtype)
    high = np.empty(block, x.dtype)
    finite = True
    for start in range(0, columns, block):
        width = min(block, columns - start)
        finite &= _load_block(x, row_stride, first + start, rows, width, buf)
        for i in range(m + 1):
            slot[i] = i
        _run_network(buf, slot, comp_a, comp_b, width)
        row = buf[slot[lo]]
        for j in range(width):
            low[j] = row[j]
            high[j] = row[j]
        for p in range(lo + 1, hi):
            row = buf[slot[p]]
            for j in range(width):
                low[j] = min(low[j], row[j])
                high[j] = max(high[j], row[j])
        for j in range(width):
            out[start + j, 0] = low[j]
            out[start + j, 1] = high[j]
    return finite


@numba.njit(_CLOSEST_SIGNATURES, nogil=True, boundscheck=False, cache=True)
def closest_mean(x, row_stride, first, columns, rows, comp_a, comp_b, beta, block, out):
    """Per column of the selected rows: mean of the ``beta`` values closest to the median.

    ``comp_a``/``comp_b`` must be a full sorting network. The ``beta`` closest values form a
    window of consecutive sorted positions; the window with the smallest largest distance to the
    median wins, the lowest window on ties. Returns False if any value read was not finite.
    """
    m = rows.shape[0]
    buf = np.empty((m + 1, block), x.dtype)
    slot = np.empty(m + 1, np.int64)
    acc = np.empty(block, np.float64)
    median = np.empty(block, np.float64)
    best_cost = np.empty(block, np.float64)
    best = np.empty(block, np.int64)
    finite = True
    for start in range(0, columns, block):
        width = min(block, columns - start)
        finite &= _load_block(x, row_stride, first + start, rows, width, buf)
        for i in range(m + 1):
            slot[i] = i
        _run_network(buf, slot, comp_a, comp_b, width)
        upper = buf[slot[m // 2]]
        lower = buf[slot[(m - 1) // 2]]
        for j in range(width):
            median[j] = 0.5 * (np.float64(lower[j]) + np.float64(upper[j]))
            best_cost[j] = np.inf
            best[j] = 0
        for s in range(m - beta + 1):
            first_row = buf[slot[s]]
            last_row = buf[slot[s + beta - 1]]
            for j in range(width):
                cost = max(median[j] - first_row[j], last_row[j] - median[j])
                better = cost < best_cost[j]
                best_cost[j] = cost if better else best_cost[j]
                best[j] = s if better else best[j]
        for j in range(width):
            acc[j] = 0.0
        for p in range(m):
            row = buf[slot[p]]
            for j in range(width):
                inside = best[j] <= p and p < best[j] + beta
                acc[j] += row[j] if inside else 0.0
        dst = out[start : start + width]
        for j in range(width):
            dst[j] = acc[j] / beta
    return finite


@numba.njit(_GRAM_SIGNATURES, nogil=True, boundscheck=False, cache=True, fastmath={"reassoc", "contract"})
def centered_gram(x, row_stride, first, columns, n, ref_row, extras, augmented, bounds, block, out):
    """Add to ``out`` the inner products of ``[rows; extras] - ref`` (and of ``ref``), lower triangle.

    With ``bounds`` of shape ``[2, d]`` every row value (the reference row's too, not the extras') is
    first clamped to ``[bounds[0], bounds[1]]`` of its column: winsorized rows, read without a copy.
    ``out`` must have at least ``k + 4`` rows and columns for ``k = n + len(extras) + augmented``;
    entries on or below the diagonal of ``out[:k, :k]`` are the result, the others are scratch.
    """
    k = n + extras.shape[0] + augmented
    buf = np.zeros((k + 4, block), x.dtype)  # rows past k stay zero: tiles may overrun k
    ref = np.empty(block, x.dtype)
    clamp = bounds.shape[0] == 2
    for start in range(0, columns, block):
        width = min(block, columns - start)
        offset = ref_row * row_stride + first + start
        ref[:width] = x[offset : offset + width]
        if clamp:
            low = bounds[0, first + start : first + start + width]
            high = bounds[1, first + start : first + start + width]
            for j in range(width):
                ref[j] = min(max(ref[j], low[j]), high[j])
            for i in range(n):
                offset = i * row_stride + first + start
                src = x[offset : offset + width]
                dst = buf[i]
                for j in range(width):
                    dst[j] = min(max(src[j], low[j]), high[j]) - ref[j]
        else:
            for i in range(n):
                offset = i * row_stride + first + start
                src = x[offset : offset + width]
                dst = buf[i]
                for j in range(width):
                    dst[j] = src[j] - ref[j]
        for i in range(extras.shape[0]):
            src = extras[i, first + start : first + start + width]
            dst = buf[n + i]
            for j in range(width):
                dst[j] = src[j] - ref[j]
        if augmented:
            dst = buf[k - 1]
            for j in range(width):
                dst[j] = ref[j]
        if width < block:  # the dot products below always run over a whole (zero-padded) block
            for i in range(k):
                buf[i, width:] = 0.0
        for i0 in range(0, k, 2):
            a0 = buf[i0]
            a1 = buf[i0 + 1]
            for j0 in range(0, i0 + 2, 4):
                b0 = buf[j0]
                b1 = buf[j0 + 1]
                b2 = buf[j0 + 2]
                b3 = buf[j0 + 3]
                s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = x.dtype.type(0.0)
                for t in range(block):
                    u = a0[t]
                    v = a1[t]
                    c0 = b0[t]
                    c1 = b1[t]
                    c2 = b2[t]
                    c3 = b3[t]
                    s00 += u * c0
                    s01 += u * c1
                    s02 += u * c2
                    s03 += u * c3
                    s10 += v * c0
                    s11 += v * c1
                    s12 += v * c2
                    s13 += v * c3
                out[i0, j0] += s00
                out[i0, j0 + 1] += s01
                out[i0, j0 + 2] += s02
                out[i0, j0 + 3] += s03
                out[i0 + 1, j0] += s10
                out[i0 + 1, j0 + 1] += s11
                out[i0 + 1, j0 + 2] += s12
                out[i0 + 1, j0 + 3] += s13


logger.debug("numba kernels compiled or loaded from the cache in %.2f s", time.perf_counter() - _compile_start)

def block_size(rows: int, itemsize: int) -> int:
    """Coordinates per block so that the scratch buffer of ``rows + 1`` rows fits in ``_SCRATCH_BYTES``."""
    return int(min(1024, max(16, _SCRATCH_BYTES // ((rows + 1) * itemsize) // 16 * 16)))


def _pieces(columns: int) -> tuple[ThreadPoolExecutor | None, list[tuple[int, int]]]:
    """The pool to use (None: run inline) and the column ranges to hand out."""
    threads = thread_count()
    if threads == 1 or columns < 65536:
        return None, [(0, columns)]
    workers = pool(threads)
    count = 4 * threads
    bounds = [min(columns, (columns * k // count) // 16 * 16) for k in range(count)] + [columns]
    return workers, [(lo, hi) for lo, hi in itertools.pairwise(bounds) if hi > lo]


def launch(
    kernel: Callable[..., bool], x: np.ndarray, row_stride: int, first: int, out: np.ndarray, *args: object
) -> bool:
    """Run an order-statistic kernel over the columns ``first .. first + len(out)`` of the rows.

    ``x`` is the flat storage of the rows (row ``r`` starts at ``r * row_stride``) and ``args`` the
    kernel's arguments between the row indices and ``out``. Returns True when every value was finite.
    """
    workers, pieces = _pieces(out.shape[0])
    if workers is None:
        return bool(kernel(x, row_stride, first, out.shape[0], *args, out))
    futures = [workers.submit(kernel, x, row_stride, first + lo, hi - lo, *args, out[lo:hi]) for lo, hi in pieces]
    return all(bool(f.result()) for f in futures)


def gram(
    x: np.ndarray,
    row_stride: int,
    spans: list[tuple[int, int]],
    n: int,
    ref_row: int,
    extras: np.ndarray,
    augmented: bool,
    bounds: np.ndarray | None = None,
) -> np.ndarray:
    """Lower triangle (float64, ``[k + 4, k + 4]`` with scratch beyond ``k``) of the centered Gram matrix.

    Covers the column ranges ``spans`` (``(start, stop)`` pairs) of the ``n`` rows of ``x`` (flat
    storage), of the ``extras`` and, if ``augmented``, of the reference row itself; all centered on row
    ``ref_row``. ``bounds`` (``[2, d]``, all columns) clamps the rows' values first.

    Each span's part is computed on its own, on the thread pool, and the parts are added in the order
    of ``spans``: the same bytes whatever the number of threads.
    """
    k = n + extras.shape[0] + int(augmented)
    block = block_size(k + 3, x.itemsize)
    no_bounds = np.empty((0, 0), x.dtype)
    args = (n, ref_row, extras, int(augmented), no_bounds if bounds is None else bounds, block)

    def part(span: tuple[int, int]) -> np.ndarray:
        out = np.zeros((k + 4, k + 4))
        centered_gram(x, row_stride, span[0], span[1] - span[0], *args, out)
        return out

    threads = thread_count()
    parts = map(part, spans) if threads == 1 or len(spans) == 1 else pool(threads).map(part, spans)
    total = np.zeros((k + 4, k + 4))
    for piece in parts:
        total += piece
    return total
