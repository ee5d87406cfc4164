"""Accepted client updates as the rows of one preallocated float32 matrix.

The server's reply path used to turn every reply into a state dict (one copy),
validate it (a float64 copy per tensor for the norm) and then stack the accepted
updates (a second copy): about twice the replies' size in extra memory and several
passes over every byte. :class:`UpdateMatrix` does one pass per reply instead:
for each block of a few ten thousand values it writes the update into the
reply's row of the matrix (subtracting the global model on the way when the client
sent its full weights) and, while that block is still in cache, adds its squares to
the norm, which also tells whether the block holds NaN or infinity.

It is pure NumPy/PyTorch (no Flower): the Flower edge hands it read-only NumPy views
on the reply's bytes (:func:`strategies.reply_arrays.array_views`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedrobust.tensors import float_keys, unflatten
from fedrobust.threads import pool, thread_count
from fedrobust.validation import (
    BLOCK,
    Rejection,
    block_sum_squares,
    check_norm,
    check_structure,
    is_running_statistic,
    non_finite,
)

ArrayLike = np.ndarray | torch.Tensor

# Rows of at least this many values are written by several threads (below it, handing the work
# to the pool costs more than it saves).
_PARALLEL_WRITE = 1 << 20


@dataclass(frozen=True)
class _Segment:
    """Where one floating-point tensor of the template lies in a row."""

    key: str
    start: int
    stop: int
    # The global tensor in float64 (flattened) when the template is float64: the
    # difference local - global is then taken in float64 and rounded once, as
    # (local - global).float() would; None for float16/bfloat16/float32 templates,
    # whose values are exact in float32.
    wide_global: np.ndarray | None


class UpdateMatrix:
    """Accepted client updates as rows of one preallocated ``[capacity, d]`` float32 matrix.

    Parameters
    ----------
    template : Mapping[str, torch.Tensor]
        The global model state dict the server sent (names, shapes, dtypes). Its
        floating-point tensors, in template order (``fedrobust.tensors.float_keys``),
        form a row; other tensors (integer buffers such as ``num_batches_tracked``)
        must match in name, shape and dtype but are not part of the row. The template
        is copied (as float32, plus float64 for float64 tensors): later changes to it
        do not affect the matrix.
    capacity : int
        Most rows that will be accepted. Memory is reserved, not touched: only rows
        that are written count in the resident set.
    max_norm : float, optional
        Bound on the L2 norm of an update; 0 (default) disables the check.
    pin_memory : bool, default False
        Allocate the matrix in page-locked memory, for a server that aggregates on a CUDA device:
        the rows then go to the device in one asynchronous copy. Page-locked memory is resident at
        once (all ``capacity`` rows) and needs a CUDA build of torch.

    Notes
    -----
    A row is ``local - global`` for full weights, computed in float32 for float16,
    bfloat16 and float32 templates (those values are exact in float32, so the result
    equals ``local.float() - global.float()`` bit for bit) and in float64, rounded once
    to float32, for float64 templates. Float64 values beyond the float32 range become
    infinite in the row and the reply is rejected as ``non_finite``.
    """

    def __init__(
        self, template: Mapping[str, torch.Tensor], capacity: int, *, max_norm: float = 0.0, pin_memory: bool = False
    ) -> None:
        if capacity < 1:
            raise ValueError(f"UpdateMatrix capacity must be >= 1, got {capacity}")
        if not max_norm >= 0:
            raise ValueError(f"UpdateMatrix max_norm must be >= 0 (0 disables the bound), got {max_norm}")
        self.max_norm = float(max_norm)
        # Names, shapes and dtypes only: structure checks and unflatten need nothing else.
        self._meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in template.items()}
        self._keys = float_keys(template)
        if not self._keys:
            raise ValueError("UpdateMatrix template has no floating-point tensor to aggregate")
        segments, start = [], 0
        for key in self._keys:
            ref = template[key]
            wide = np.empty(ref.numel(), dtype=np.float64) if ref.dtype == torch.float64 else None
            segments.append(_Segment(key, start, start + ref.numel(), wide))
            start += ref.numel()
        self._segments: tuple[_Segment, ...] = tuple(segments)
        # Which segments a norm rejection reports apart (batch norms' running statistics).
        self._is_statistic = tuple(is_running_statistic(seg.key) for seg in self._segments)
        self.dim = start
        self._global = torch.empty(self.dim, dtype=torch.float32)
        self._global_np = self._global.numpy()
        self.capacity = int(capacity)
        self._matrix = torch.empty((self.capacity, self.dim), dtype=torch.float32, pin_memory=pin_memory)
        self._matrix_np = self._matrix.numpy()  # shares memory: NumPy ufuncs write into the rows
        self._norms = torch.zeros(self.capacity, dtype=torch.float64)
        self._len = 0
        self._load_global(template)

    def _load_global(self, template: Mapping[str, torch.Tensor]) -> None:
        for seg in self._segments:
            value = template[seg.key].detach()
            self._global[seg.start : seg.stop] = value.reshape(-1)
            if seg.wide_global is not None:
                seg.wide_global[:] = value.cpu().reshape(-1).numpy()

    def reset(self, template: Mapping[str, torch.Tensor]) -> None:
        """Start a new round on the same storage: forget all rows and take the new global values.

        The matrix's pages are already mapped after a first round; a fresh ``[n, d]``
        allocation costs a page fault per 4 KiB on first write, which on a VM takes longer
        than copying the replies. A strategy keeps one ``UpdateMatrix`` and resets it.

        Raises
        ------
        ValueError
            When ``template`` does not have the names, shapes and dtypes the matrix was built for.
        """
        rejection = check_structure(template, self._meta)
        if rejection is not None:
            raise ValueError(f"UpdateMatrix.reset: template differs from the one it was built for: {rejection.detail}")
        self._load_global(template)
        self._len = 0

    def touch(self) -> None:
        """Map every page of the matrix now, by writing zeros over all ``capacity`` rows.

        A new matrix is reserved, not resident: its first round pays a page fault per page
        while the replies are written (on a VM about ten times the cost of the write itself,
        and huge pages do not help there: the host faults per page too). A server calls this
        while its clients train, when it is otherwise idle, so that the first round's rows go
        into resident memory as every later round's do. It overwrites the rows: call it only
        before a round's first :meth:`add`, never concurrently with it.
        """
        self._matrix.zero_()

    # ------------------------------------------------------------------ filling
    def add(self, arrays: Mapping[str, ArrayLike], *, full_weights: bool, row: int | None = None) -> Rejection | None:
        """Check one reply and write its update into the next free row, in one pass over its bytes.

        Parameters
        ----------
        arrays : Mapping[str, numpy.ndarray | torch.Tensor]
            The reply's tensors by name (read-only NumPy views are fine; nothing is written
            to them). Torch tensors on another device are copied to the CPU.
        full_weights : bool
            ``True`` when the client sent its local weights (Flower's convention): the row
            is ``arrays - global``. ``False`` when ``arrays`` already is the update.
        row : int, optional
            Write into this row instead (``0 <= row < capacity``): replies arriving in any
            order each go to the row of their place in a fixed order, and :meth:`keep` then
            makes the written rows the accepted ones. Not mixed with rows added without it
            in one round.

        Returns
        -------
        Rejection or None
            ``None`` when the update was accepted (``len(self)`` grew by one, or with ``row``
            the row is written); otherwise why not (``wrong_keys``, ``wrong_shape``,
            ``wrong_dtype``, ``non_finite``, ``norm_too_large``), and the row is free again.

        Raises
        ------
        ValueError
            When the matrix already holds ``capacity`` rows, or ``row`` is out of range or
            rows were added without it this round.
        """
        if row is None:
            if self._len >= self.capacity:
                raise ValueError(f"UpdateMatrix is full: capacity {self.capacity} rows already accepted")
            index = self._len
        elif not 0 <= row < self.capacity or self._len:
            raise ValueError(f"row {row}: outside 0..{self.capacity - 1}, or rows were already added in order")
        else:
            index = row
        rejection = check_structure(arrays, self._meta)
        if rejection is not None:
            return rejection
        out = self._matrix_np[index]
        parts = self._write_all(out, arrays, full_weights)
        squared = statistics = 0.0
        for seg, part, is_statistic in zip(self._segments, parts, self._is_statistic, strict=True):
            if math.isnan(part):
                return non_finite(seg.key)
            squared += part  # in segment order: the same norm whatever the number of threads
            if is_statistic:
                statistics += part
        norm = math.sqrt(squared)
        rejection = check_norm(norm, self.max_norm, math.sqrt(statistics))
        if rejection is not None:
            return rejection
        self._norms[index] = norm
        if row is None:
            self._len += 1
        return None

    def keep(self, rows: Sequence[int]) -> None:
        """Make ``rows``, written by :meth:`add` with ``row=``, the accepted rows, in increasing order.

        Each moves up in place over the rows not kept (a reply missing or rejected); when
        none is missing before it, a row stays where it was written and costs nothing.
        """
        ordered = sorted(set(rows))
        if self._len or (ordered and not 0 <= ordered[0] <= ordered[-1] < self.capacity):
            raise ValueError(f"rows {ordered}: outside 0..{self.capacity - 1}, or rows were already added in order")
        for new, old in enumerate(ordered):
            if new != old:
                self._matrix[new].copy_(self._matrix[old])
                self._norms[new] = self._norms[old]
        self._len = len(ordered)

    def _write_all(self, row: np.ndarray, arrays: Mapping[str, ArrayLike], full_weights: bool) -> list[float]:
        """Write every tensor's update into ``row``; the sum of squares of each segment, in order.

        NumPy's loops release the GIL, so a large row is written by ``thread_count()`` threads, each
        taking a contiguous share of the segments (every segment's own sum is computed the same way
        either way).
        """

        def write(segments: Sequence[_Segment]) -> list[float]:
            # Overflow to infinity is expected from hostile input and is what the check detects.
            with np.errstate(over="ignore", invalid="ignore"):
                return [self._write(row, seg, arrays[seg.key], full_weights) for seg in segments]

        threads = thread_count()
        if threads == 1 or self.dim < _PARALLEL_WRITE:
            return write(self._segments)
        shares = self._shares(threads)
        return [part for share in pool(threads).map(write, shares) for part in share]

    def _shares(self, threads: int) -> list[tuple[_Segment, ...]]:
        """The segments cut into ``threads`` contiguous runs of about equal size."""
        cuts, target, done = [0], self.dim / threads, 0
        for i, seg in enumerate(self._segments):
            done += seg.stop - seg.start
            if done >= target * len(cuts) and len(cuts) < threads:
                cuts.append(i + 1)
        cuts.append(len(self._segments))
        return [self._segments[a:b] for a, b in itertools.pairwise(cuts) if b > a]

    def _write(self, row: np.ndarray, seg: _Segment, value: ArrayLike, full_weights: bool) -> float:
        """Write one tensor's update into ``row[seg]`` block by block; return its sum of squares."""
        out = row[seg.start : seg.stop]
        glob = seg.wide_global if seg.wide_global is not None else self._global_np[seg.start : seg.stop]
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if value.device.type != "cpu":
                value = value.cpu()
            if value.dtype == torch.bfloat16:  # NumPy has no bfloat16: torch computes this one
                return self._write_torch(out, seg, value, full_weights)
            value = value.numpy()
        if not value.flags.c_contiguous:
            # Rare (a Fortran-ordered or strided array): one whole-tensor ufunc walks the
            # strides in C order without a contiguous copy; then sum the squares blockwise.
            shaped = out.reshape(value.shape)
            if full_weights:
                np.subtract(value, glob.reshape(value.shape), out=shaped)
            else:
                np.copyto(shaped, value, casting="same_kind")
            return _sum_blocks(out)
        src = value.reshape(-1)
        total = 0.0
        for start in range(0, out.size, BLOCK):
            stop = start + BLOCK
            block = out[start:stop]
            if full_weights:
                # float16 - float32 and float32 - float32 run in float32; float64 - float64
                # runs in float64 and is rounded once into the float32 row.
                np.subtract(src[start:stop], glob[start:stop], out=block)
            else:
                np.copyto(block, src[start:stop], casting="same_kind")
            total += block_sum_squares(block)
        return total

    def _write_torch(self, out: np.ndarray, seg: _Segment, value: torch.Tensor, full_weights: bool) -> float:
        out_t = torch.from_numpy(out)  # writable: a view on the matrix
        src = value.reshape(-1)  # a copy only if value is not contiguous
        glob = self._global[seg.start : seg.stop]
        total = 0.0
        for start in range(0, out.size, BLOCK):
            stop = start + BLOCK
            if full_weights:
                torch.sub(src[start:stop], glob[start:stop], out=out_t[start:stop])  # bf16 - f32 runs in f32
            else:
                out_t[start:stop].copy_(src[start:stop])
            total += block_sum_squares(out[start:stop])
        return total

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        """Number of accepted rows."""
        return self._len

    def rows(self) -> torch.Tensor:
        """The accepted updates, ``[len, d]`` float32: a view on the matrix, no copy."""
        return self._matrix[: self._len]

    def norms(self) -> torch.Tensor:
        """L2 norms of the accepted rows, ``[len]`` float64 (computed by ``add``/``recheck``), a view."""
        return self._norms[: self._len]

    @property
    def keys(self) -> list[str]:
        """Names of the template's floating-point tensors, in row order."""
        return list(self._keys)

    def global_flat(self) -> torch.Tensor:
        """The template's floating-point tensors as one ``[d]`` float32 vector (shared, do not modify)."""
        return self._global

    def unflatten(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split a ``[d]`` vector into the template's floating-point tensors, shaped and typed like them.

        Tensors whose dtype matches the vector's are views on it; others are converted copies.
        """
        return unflatten(vector, self._meta, self._keys)

    # ------------------------------------------------------------------ changing
    def recheck(self, index: int) -> Rejection | None:
        """Check finiteness and norm of row ``index`` again after it was changed in place.

        A simulated adversary rewrites rows of :meth:`rows`; its rows must pass the same
        bounds as honest ones. Updates ``norms()[index]``; returns the rejection or ``None``.
        """
        if not 0 <= index < self._len:
            raise IndexError(f"row {index} out of range for {self._len} accepted rows")
        row = self._matrix_np[index]
        squared = 0.0
        with np.errstate(over="ignore", invalid="ignore"):
            for seg in self._segments:
                part = _sum_blocks(row[seg.start : seg.stop])
                if math.isnan(part):
                    return non_finite(seg.key)
                squared += part
        norm = math.sqrt(squared)
        self._norms[index] = norm
        return check_norm(norm, self.max_norm)

    def drop(self, indices: Sequence[int]) -> None:
        """Remove rows ``indices``; the remaining rows keep their order and move up in place."""
        doomed = set(indices)
        if any(not 0 <= i < self._len for i in doomed):
            raise IndexError(f"rows {sorted(doomed)} out of range for {self._len} accepted rows")
        kept = [i for i in range(self._len) if i not in doomed]
        for new, old in enumerate(kept):
            if new != old:
                self._matrix[new].copy_(self._matrix[old])
                self._norms[new] = self._norms[old]
        self._len = len(kept)


def _sum_blocks(values: np.ndarray) -> float:
    """Blockwise sum of squares of a 1-D float32 array (NaN when non-finite)."""
    return sum((block_sum_squares(values[s : s + BLOCK]) for s in range(0, values.size, BLOCK)), 0.0)
