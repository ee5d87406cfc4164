"""Coordinate-wise order statistics of :class:`Rows`: numba kernels on CPU, torch sorts elsewhere.

Both paths compute the same thing: per coordinate, sort the ``m`` row values, then either average a
window of sorted positions (median, trimmed mean) or average the ``beta`` values closest to the
median (Bulyan). Each pass also proves the input finite, so no separate validation sweep is needed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from fedrobust.aggregators._backend import flat_rows, numba_kernels
from fedrobust.aggregators._networks import sorting_network, window_network
from fedrobust.aggregators.rows import Rows

__all__ = ["closest_mean", "window_bounds", "window_mean"]


def _window_torch(y: Tensor, lo: int, hi: int) -> Tensor:
    window = torch.sort(y, dim=0).values[lo:hi]
    return window.sum(dim=0, dtype=torch.float64) / (hi - lo)


def _closest_torch(y: Tensor, beta: int) -> Tensor:
    values = torch.sort(y, dim=0).values.to(torch.float64)
    m = values.shape[0]
    median = 0.5 * (values[(m - 1) // 2] + values[m // 2])
    # Window s covers sorted positions s..s+beta-1; its cost is its largest distance to the median.
    cost = torch.maximum(median - values[: m - beta + 1], values[beta - 1 :] - median)
    best = cost.argmin(dim=0)  # first (lowest) window on ties, as in the kernel
    position = torch.arange(m, device=y.device)[:, None]
    inside = (position >= best) & (position < best + beta)
    return torch.where(inside, values, 0.0).sum(dim=0) / beta


def _reduce(
    rows: Rows,
    kernel_name: str,
    network: tuple[np.ndarray, np.ndarray],
    params: tuple[int, ...],
    torch_fn: Callable[[Tensor], Tensor],
    outputs: tuple[int, ...] = (),
) -> Tensor:
    """``[d, *outputs]``: the kernel's result per coordinate."""
    basis = rows.basis
    out = _run(rows, kernel_name, network, params, torch_fn, rows.dtype, outputs)
    if out is None:
        basis.check_finite()
        # Finite input but non-finite combined rows: float32 overflow in a pre-aggregator's mix.
        out = _run(rows, kernel_name, network, params, torch_fn, torch.float64, outputs)
        if out is None:
            raise basis.error("pre-aggregated rows overflow float64", "input entries must be below about 1e300")
        out = out.to(rows.dtype)
    if rows.index is None:  # a row subset proves only its own rows finite
        basis.validated = True
    return out


def _run(
    rows: Rows,
    kernel_name: str,
    network: tuple[np.ndarray, np.ndarray],
    params: tuple[int, ...],
    torch_fn: Callable[[Tensor], Tensor],
    dtype: torch.dtype,
    outputs: tuple[int, ...],
) -> Tensor | None:
    """One pass; returns ``None`` if a non-finite value was seen."""
    basis = rows.basis
    out = torch.empty((rows.d, *outputs), dtype=dtype, device=rows.device)
    kernels = numba_kernels(rows.device)
    if kernels is None:
        finite = torch.ones((), dtype=torch.bool, device=rows.device)
        for start, stop, y in rows.chunks(dtype, reuse=True):
            finite &= torch.isfinite(y).all()
            out[start:stop] = torch_fn(y)
        return out if bool(finite) else None

    kernel = getattr(kernels, kernel_name)
    comp_a, comp_b = network
    block = kernels.block_size(rows.m, torch.finfo(dtype).bits // 8)
    out_np = out.numpy()
    all_finite = True
    if rows.mix is None and basis.in_place and basis.x.dtype == dtype and basis.x.stride(1) == 1:
        # Read the input in place; a row subset is passed as indices instead of being copied.
        flat, row_stride = flat_rows(basis.x)
        index = torch.arange(basis.n) if rows.index is None else rows.index
        index_np = np.ascontiguousarray(index.numpy(), dtype=np.int64)
        # One launch over every column: the kernel works block by block in its own scratch, and
        # launch splits the columns over the threads.
        all_finite = kernels.launch(kernel, flat, row_stride, 0, out_np, index_np, comp_a, comp_b, *params, block)
    else:
        index_np = np.arange(rows.m, dtype=np.int64)
        for start, stop, y in rows.chunks(dtype, reuse=True):
            flat, row_stride = flat_rows(y.contiguous())
            all_finite &= kernels.launch(
                kernel, flat, row_stride, 0, out_np[start:stop], index_np, comp_a, comp_b, *params, block
            )
    return out if all_finite else None


def window_mean(rows: Rows, lo: int, hi: int) -> Tensor:
    """Per coordinate, the mean of the sorted row values at positions ``lo..hi-1``.

    Parameters
    ----------
    rows : Rows
        ``m`` rows of length ``d``.
    lo, hi : int
        ``0 <= lo < hi <= m``.

    Returns
    -------
    Tensor
        ``[d]`` in the rows' compute dtype.
    """
    return _reduce(rows, "window_mean", window_network(rows.m, lo, hi), (lo, hi), lambda y: _window_torch(y, lo, hi))


def window_bounds(rows: Rows, lo: int, hi: int) -> Tensor:
    """``[2, d]``: per coordinate, the smallest and the largest of the sorted row values at positions ``lo..hi-1``.

    One pass for both (the window network of a trimmed mean, then a minimum and a maximum over the window).
    """
    pair = _reduce(
        rows, "window_bounds", window_network(rows.m, lo, hi), (lo, hi), lambda y: _bounds_torch(y, lo, hi), (2,)
    )
    return pair.T.contiguous()


def _bounds_torch(y: Tensor, lo: int, hi: int) -> Tensor:
    ordered = torch.sort(y, dim=0).values
    return torch.stack([ordered[lo], ordered[hi - 1]], dim=1)


def closest_mean(rows: Rows, beta: int) -> Tensor:
    """Per coordinate, the mean of the ``beta`` row values closest to the coordinate's median.

    Ties between equally close windows of sorted values go to the lowest window.
    """
    return _reduce(rows, "closest_mean", sorting_network(rows.m), (beta,), lambda y: _closest_torch(y, beta))
