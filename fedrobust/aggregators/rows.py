"""Lazy rows: the stacked updates and the linear maps that pre-aggregators apply to them.

Every pre-aggregator (NNM, bucketing, clipping, ARC) replaces the rows by linear combinations of
them, and every distance-based rule (Krum, Bulyan, geometric median, centered clipping) needs only
inner products between the rows plus one final linear combination. So the ``[n, d]`` data is read in
a few chunked passes: one for the Gram matrix, one for the output, and, for coordinate-wise rules,
one that forms the combined rows chunk by chunk. All ``n``-sized work happens on small float64
matrices on the data's device; nothing is copied to the host.

Distances come from a *centered* Gram matrix: rows minus a reference row chosen near the middle of
the data, so adding a constant offset to every input changes neither the centered data nor any
distance (no ``|x|^2 + |y|^2 - 2<x, y>`` cancellation on large offsets).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from fedrobust.aggregators._backend import flat_rows, numba_kernels
from fedrobust.aggregators.base import compute_dtype

__all__ = ["Basis", "Rows"]

logger = logging.getLogger(__name__)

# Temporary buffers per chunk stay around this size: small next to a model-sized [n, d] input and
# small enough to stay in the last-level cache between the two operations of a fused pass.
_CHUNK_BYTES = 8 << 20
# Coordinates sampled to pick the reference row.
_REFERENCE_SAMPLE = 1024


def inner_products(rows: Tensor) -> Tensor:
    """``rows @ rows.T``, row by row: the same bytes on any thread count, and exactly symmetric.

    A matrix product's bytes change with the thread count under MKL (16 threads here, 3 on an Intel
    Xeon), and a near-tie in what is computed from it could then pick another row.
    """
    return torch.stack([(rows * row).sum(dim=1) for row in rows])


class _Scratch:
    """Storage reused for one pass's per-chunk temporaries.

    Chunk-sized tensors allocated afresh for every chunk made the default pipeline's close 60% slower in a
    streamed round, after the replies came and went one by one (7.5 s against 4.6 s at n = 50, d = 11.2M;
    the time went to the clamps and the mixing, most likely page faults on freshly mapped memory, as glibc
    maps large blocks once its adaptive threshold has moved). One buffer per pass is touched once.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._flat: Tensor | None = None

    def take(self, rows: int, cols: int, dtype: torch.dtype) -> Tensor:
        """A contiguous ``[rows, cols]`` tensor over the reused storage (its old contents are garbage)."""
        need = rows * cols
        if self._flat is None or self._flat.dtype != dtype or self._flat.numel() < need:
            self._flat = torch.empty(need, dtype=dtype, device=self._device)
        return self._flat[:need].view(rows, cols)


class Basis:
    """The ``[n, d]`` input of one aggregation call, plus extra vectors a rule measures against.

    Parameters
    ----------
    x : Tensor
        Stacked updates ``[n, d]``, any float dtype and device.
    extras : sequence of Tensor
        ``[d]`` vectors (e.g. a clipping center) that coefficient vectors may refer to after the
        ``n`` rows.
    augmented : bool
        Also keep inner products with the reference row itself, needed for norms and for rows that
        are not affine combinations of the inputs (after clipping).
    chunk_size : int or None
        Coordinates per pass; ``None`` sizes chunks to about 8 MiB.
    bounds : Tensor or None
        ``[2, d]`` lower and upper bounds (compute dtype) that every read of the rows clamps to
        (coordinate-wise winsorizing without an ``[n, d]`` copy); not applied to the extras.
    owner : str
        Name used in error messages.
    f : int
        The pipeline's ``f``, for error messages.
    """

    def __init__(
        self,
        x: Tensor,
        *,
        extras: Sequence[Tensor] = (),
        augmented: bool = False,
        chunk_size: int | None = None,
        bounds: Tensor | None = None,
        owner: str,
        f: int,
    ) -> None:
        self.x = x
        self.bounds = bounds
        self.n, self.d = x.shape
        self.dtype = compute_dtype(x.dtype)
        self.extras = list(extras)
        self.augmented = augmented
        self.chunk_size = chunk_size
        self.owner = owner
        self.f = f
        self.validated = False
        """Set once some pass has proven every input entry finite."""
        self._gram: Tensor | None = None

    @property
    def size(self) -> int:
        """Number of vectors coefficient vectors refer to: the rows, then the extras."""
        return self.n + len(self.extras)

    @property
    def device(self) -> torch.device:
        return self.x.device

    def error(self, problem: str, requirement: str) -> ValueError:
        """A ``ValueError`` naming the owner, ``n``, ``f`` and the requirement."""
        return ValueError(f"{self.owner}: {problem} (n={self.n}, f={self.f}); {requirement}")

    def spans(self, rows: int) -> Iterator[tuple[int, int]]:
        """Column ranges for a pass whose temporaries have ``rows`` rows."""
        if self.chunk_size is not None:
            width = self.chunk_size
        else:
            width = max(1024, _CHUNK_BYTES // (max(rows, 1) * torch.finfo(self.dtype).bits // 8))
        for start in range(0, self.d, width):
            yield start, min(self.d, start + width)

    @property
    def in_place(self) -> bool:
        """Whether the rows are ``x`` itself, so that a kernel may read ``x``'s memory directly."""
        return self.bounds is None

    def block(self, start: int, stop: int, scratch: _Scratch | None = None) -> Tensor:
        """The rows' coordinates ``start:stop``: ``x``'s columns, clamped to the bounds if any (into
        ``scratch``'s storage when given: valid until its next use)."""
        chunk = self.x[:, start:stop]
        if self.bounds is None:
            return chunk
        out = None if scratch is None else scratch.take(self.n, stop - start, self.dtype)
        return torch.clamp(chunk.to(self.dtype), self.bounds[0, start:stop], self.bounds[1, start:stop], out=out)

    def columns(self, index: Tensor) -> Tensor:
        """The rows' coordinates at ``index`` (int64), clamped to the bounds if any."""
        picked = self.x.index_select(1, index)
        if self.bounds is None:
            return picked
        bounds = self.bounds.index_select(1, index)
        return torch.clamp(picked.to(self.dtype), bounds[0], bounds[1])

    def check_finite(self) -> None:
        """Read the whole input once and raise ``ValueError`` if any entry is NaN or infinite."""
        finite = torch.ones((), dtype=torch.bool, device=self.device)
        for start, stop in self.spans(self.n):
            finite &= torch.isfinite(self.x[:, start:stop]).all()
        if not bool(finite):
            raise self.error("input contains non-finite values (NaN or inf)", "every entry must be finite")
        self.validated = True

    def reference_index(self) -> int:
        """Index of a row near the middle of the data, used to center it.

        On a sample of coordinates, the row whose distance to its ``n // 2``-th nearest row is the
        smallest. Any row gives exact selections in exact arithmetic; a central one keeps the
        centered values, and so the rounding error of the Gram matrix, at the scale of the spread
        of the honest rows even when an outlier sits far away.
        """
        if self.n <= 2:
            return 0
        step = max(1, self.d // _REFERENCE_SAMPLE)
        columns = torch.arange(0, self.d, step, device=self.device)[:_REFERENCE_SAMPLE]
        sample = self.columns(columns).to(torch.float64)
        sample = sample - sample.median(dim=0).values
        inner = inner_products(sample)
        norms = inner.diagonal()
        dist = norms[:, None] + norms[None, :] - 2 * inner
        kth = dist.sort(dim=1).values[:, self.n // 2]
        return int(torch.argmin(kth))

    def gram(self) -> Tensor:
        """Gram matrix of ``[rows; extras] - r`` (and of ``r`` itself when augmented), float64.

        Each chunk is multiplied in the compute dtype and accumulated in float64. If that overflows
        (entries beyond ~1e19 in float32) the pass is repeated in float64. A non-finite result proves
        a non-finite input, which is reported; finite means the input was validated.
        """
        if self._gram is None:
            gram = self._accumulate_gram(self.dtype)
            if not bool(torch.isfinite(gram).all()) and self.dtype != torch.float64:
                logger.debug("%s: Gram overflowed in %s, recomputing in float64", self.owner, self.dtype)
                gram = self._accumulate_gram(torch.float64)
            if not bool(torch.isfinite(gram).all()):
                self.check_finite()
                raise self.error(
                    "squared distances overflow float64", "input entries must stay below about 1e150 in magnitude"
                )
            self._gram = gram
            self.validated = True
        return self._gram

    def _accumulate_gram(self, dtype: torch.dtype) -> Tensor:
        ref_index = self.reference_index()
        k = self.size + int(self.augmented)
        kernels = numba_kernels(self.device)
        if kernels is not None and self.x.dtype == dtype and self.x.stride(1) == 1:
            flat, row_stride = flat_rows(self.x)
            bounds = None if self.bounds is None else self.bounds.to(dtype).numpy()
            if len(self.extras) == 1:
                extras = self.extras[0][None].contiguous()  # a view: no copy of a model-sized vector
            elif self.extras:
                extras = torch.stack(self.extras)
            else:
                extras = torch.empty(0, self.d, dtype=dtype)
            lower = kernels.gram(
                flat, row_stride, list(self.spans(k)), self.n, ref_index, extras.numpy(), self.augmented, bounds
            )
            lower = np.tril(lower[:k, :k])
            return torch.from_numpy(lower + np.tril(lower, -1).T)

        n = self.n
        gram = torch.zeros(k, k, dtype=torch.float64, device=self.device)
        buf = None
        scratch = _Scratch(self.device)
        for start, stop in self.spans(k):
            if buf is None:
                buf = torch.empty(k, stop - start, dtype=dtype, device=self.device)
            z = buf[:, : stop - start]
            chunk = self.block(start, stop, scratch)
            r = chunk[ref_index].to(dtype, copy=True)
            if chunk.dtype == dtype:
                torch.sub(chunk, r, out=z[:n])
            else:
                z[:n].copy_(chunk)
                z[:n].sub_(r)
            for j, vector in enumerate(self.extras):
                z[n + j].copy_(vector[start:stop])
                z[n + j].sub_(r)
            if self.augmented:
                z[-1].copy_(r)
            gram.add_(z @ z.T)
        return gram

    def combine(self, coef: Tensor) -> Tensor:
        """Return ``sum_k coef[k] * v_k`` over the rows and extras, in the compute dtype.

        A finite result of a full pass proves the input finite (``0 * inf`` is NaN). A non-finite
        result with finite input can only be float32 overflow; then the pass is redone in float64.
        """
        out = self._combine(coef, self.dtype)
        # A finite sum proves every entry finite, at a fraction of the cost of isfinite().all(); a
        # sum that overflows on huge finite entries only sends the call down the slow path below.
        if not bool(torch.isfinite(out.sum())):
            self.check_finite()
            out = self._combine(coef, torch.float64).to(self.dtype)
        return out

    def _combine(self, coef: Tensor, dtype: torch.dtype) -> Tensor:
        n = self.n
        row_coef, extra_coef = coef[:n], coef[n:]
        nonzero = torch.nonzero(row_coef).flatten()
        if nonzero.numel() == 1 and not bool(extra_coef.any()) and bool(row_coef[nonzero] == 1):
            # Krum and friends select one row: copy it instead of reading every row.
            row = self.x[int(nonzero)].to(dtype=dtype, copy=True)
            if self.bounds is not None:
                torch.clamp(row, self.bounds[0].to(dtype), self.bounds[1].to(dtype), out=row)
            return row
        out = torch.empty(self.d, dtype=dtype, device=self.device)
        weights = row_coef.to(dtype)[:, None]
        extra_weights = extra_coef.tolist()
        scratch, products = _Scratch(self.device), _Scratch(self.device)
        for start, stop in self.spans(n):
            # Products, then a sum over the rows, not torch.mv: BLAS's gemv splits the sum over the rows
            # between its threads on some CPUs (MKL on an Intel Xeon), so the bytes of the result changed
            # with the thread count. A reduction over dim 0 sums each coordinate in one thread.
            block = self.block(start, stop, scratch).to(dtype)
            terms = torch.mul(block, weights, out=products.take(n, stop - start, dtype))
            torch.sum(terms, dim=0, out=out[start:stop])
            for weight, vector in zip(extra_weights, self.extras, strict=True):
                out[start:stop].add_(vector[start:stop].to(dtype), alpha=weight)
        self.validated = True
        return out

    def row_chunks(
        self, mix: Tensor | None, index: Tensor | None, dtype: torch.dtype, *, reuse: bool = False
    ) -> Iterator[tuple[int, int, Tensor]]:
        """Yield ``(start, stop, y)`` with ``y`` the ``dtype`` chunk of the rows ``mix @ x`` or ``x[index]``.

        With ``reuse``, every chunk is written into the same storage: each ``y`` is valid only until the
        next one is asked for.
        """
        weights = None if mix is None else mix.to(dtype)
        rows = self.n if weights is None else max(self.n, weights.shape[0])
        clamped, mixed = (_Scratch(self.device), _Scratch(self.device)) if reuse else (None, None)
        for start, stop in self.spans(rows):
            chunk = self.block(start, stop, clamped)
            if weights is not None:
                out = None if mixed is None else mixed.take(weights.shape[0], stop - start, dtype)
                yield start, stop, torch.matmul(weights, chunk.to(dtype), out=out)
            elif index is not None:
                yield start, stop, chunk.index_select(0, index).to(dtype)
            else:
                yield start, stop, chunk.to(dtype)


class Rows:
    """``m`` rows, each a linear combination of the input rows of a :class:`Basis`.

    Parameters
    ----------
    basis : Basis
        The data.
    mix : Tensor or None
        ``[m, n]`` float64 coefficients; ``None`` means the input rows themselves.
    index : Tensor or None
        With ``mix=None``, a subset of the input rows (int64 indices).
    affine : bool
        Whether every row's coefficients sum to one.
    """

    def __init__(self, basis: Basis, mix: Tensor | None = None, index: Tensor | None = None, affine: bool = True):
        if not affine and not basis.augmented:
            raise RuntimeError("rows that are not affine combinations need an augmented basis")
        self.basis = basis
        self.mix = mix
        self.index = index
        self.affine = affine

    @property
    def m(self) -> int:
        """Number of rows."""
        if self.mix is not None:
            return self.mix.shape[0]
        return self.basis.n if self.index is None else self.index.shape[0]

    @property
    def d(self) -> int:
        return self.basis.d

    @property
    def device(self) -> torch.device:
        return self.basis.device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (float32, or float64 for float64 input)."""
        return self.basis.dtype

    def coefficients(self) -> Tensor:
        """``[m, n]`` float64 coefficients of the rows over the input rows."""
        if self.mix is not None:
            return self.mix
        eye = torch.eye(self.basis.n, dtype=torch.float64, device=self.device)
        return eye if self.index is None else eye.index_select(0, self.index)

    def transform(self, matrix: Tensor, *, affine: bool) -> Rows:
        """Rows ``matrix @ self`` for a ``[m', m]`` float64 matrix."""
        return Rows(self.basis, mix=matrix @ self.coefficients(), affine=self.affine and affine)

    def select(self, index: Tensor) -> Rows:
        """The rows at ``index`` (int64, on the rows' device)."""
        if self.mix is not None:
            return Rows(self.basis, mix=self.mix.index_select(0, index), affine=self.affine)
        base = index if self.index is None else self.index.index_select(0, index)
        return Rows(self.basis, index=base, affine=self.affine)

    def basis_coefficients(self, weights: Tensor) -> Tensor:
        """``[basis.size]`` coefficients of ``sum_i weights[i] * row_i`` (zero on the extras)."""
        coef = torch.zeros(self.basis.size, dtype=torch.float64, device=self.device)
        coef[: self.basis.n] = weights.to(torch.float64) @ self.coefficients()
        return coef

    def combine(self, weights: Tensor) -> Tensor:
        """``sum_i weights[i] * row_i`` as a ``[d]`` tensor in the compute dtype."""
        return self.basis.combine(self.basis_coefficients(weights))

    def columns(self, index: Tensor) -> Tensor:
        """``[m, k]`` float64: the rows' coordinates at ``index`` (int64, on the rows' device)."""
        picked = self.basis.columns(index).to(torch.float64)
        if self.mix is None:
            return picked if self.index is None else picked.index_select(0, self.index)
        # Row by row, summed in row order: a matrix product's bytes change with the thread count.
        return torch.stack([(weights[:, None] * picked).sum(dim=0) for weights in self.mix])

    def chunks(self, dtype: torch.dtype | None = None, *, reuse: bool = False) -> Iterator[tuple[int, int, Tensor]]:
        """Yield ``(start, stop, [m, stop - start] chunk)`` of the rows, by default in the compute dtype.

        With ``reuse`` the chunks share one storage (no allocation per chunk): a chunk is valid only until
        the next one is asked for, so a caller that keeps chunks must not pass it.
        """
        return self.basis.row_chunks(self.mix, self.index, dtype or self.dtype, reuse=reuse)

    def sq_distances(self) -> Tensor:
        """``[m, m]`` float64 squared Euclidean distances between the rows."""
        gram = self.basis.gram()
        n = self.basis.n
        a = self.coefficients()
        inner = a @ gram[:n, :n] @ a.T
        norms = inner.diagonal()
        dist = norms[:, None] + norms[None, :] - 2 * inner
        if self.basis.augmented:
            # Terms with the reference row vanish for rows with equal coefficient sums (all affine
            # rows); they are added separately so they cannot cancel the centered part above.
            sums = a.sum(dim=1)
            proj = a @ gram[:n, -1]
            ds = sums[:, None] - sums[None, :]
            dist = dist + 2 * ds * (proj[:, None] - proj[None, :]) + ds.square() * gram[-1, -1]
        # Exactly symmetric, so that equal distances give exactly equal Krum scores.
        dist = (0.5 * (dist + dist.T)).clamp_(min=0)
        dist.fill_diagonal_(0)
        return dist

    def sq_norms(self) -> Tensor:
        """``[m]`` float64 squared norms of the rows (needs an augmented basis)."""
        if not self.basis.augmented:
            raise RuntimeError("row norms need an augmented basis")
        coef = torch.zeros(self.m, self.basis.size, dtype=torch.float64, device=self.device)
        coef[:, : self.basis.n] = self.coefficients()
        return self._quadratic(coef, coef.sum(dim=1))

    def sq_distances_to(self, target: Tensor) -> Tensor:
        """``[m]`` float64 squared distances from each row to the vector with basis coefficients ``target``."""
        coef = -target.expand(self.m, -1).clone()
        coef[:, : self.basis.n] += self.coefficients()
        return self._quadratic(coef, coef.sum(dim=1))

    def _quadratic(self, coef: Tensor, sums: Tensor) -> Tensor:
        """Squared norms of ``coef @ [v - r]`` plus ``sums * r`` (the ``r`` part only when augmented)."""
        gram = self.basis.gram()
        size = self.basis.size
        value = ((coef @ gram[:size, :size]) * coef).sum(dim=1)
        if self.basis.augmented:
            value = value + 2 * sums * (coef @ gram[:size, -1]) + sums.square() * gram[-1, -1]
        return value.clamp_(min=0)
