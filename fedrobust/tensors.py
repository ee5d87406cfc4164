"""Flatten named tensors into one row per client, and back.

Aggregation rules see a single [n, d] matrix; the model sees named tensors. Only
floating-point tensors take part: integer buffers (e.g. BatchNorm's
``num_batches_tracked``) are bookkeeping, and averaging them means nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def float_keys(template: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors of ``template``, in its order."""
    return [k for k, v in template.items() if v.is_floating_point()]


def flatten(
    arrays: Sequence[Mapping[str, torch.Tensor]],
    keys: Sequence[str],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Stack the tensors named ``keys`` of every mapping into one [n, d] matrix.

    The matrix is allocated once and filled in place, so peak memory is the
    matrix plus the inputs, never a second concatenated copy.
    """
    if not arrays:
        raise ValueError("flatten needs at least one set of arrays")
    sizes = [arrays[0][k].numel() for k in keys]
    device = device if device is not None else arrays[0][keys[0]].device
    out = torch.empty((len(arrays), sum(sizes)), dtype=dtype, device=device)
    for row, named in enumerate(arrays):
        offset = 0
        for key, size in zip(keys, sizes, strict=True):
            out[row, offset : offset + size] = named[key].reshape(-1)
            offset += size
    return out


def unflatten(
    vector: torch.Tensor, template: Mapping[str, torch.Tensor], keys: Sequence[str]
) -> dict[str, torch.Tensor]:
    """Split a [d] vector into tensors shaped and typed like ``template[keys]``."""
    expected = sum(template[k].numel() for k in keys)
    if vector.ndim != 1 or vector.numel() != expected:
        raise ValueError(f"vector of shape {tuple(vector.shape)} does not match {expected} values")
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for key in keys:
        ref = template[key]
        out[key] = vector[offset : offset + ref.numel()].reshape(ref.shape).to(ref.dtype)
        offset += ref.numel()
    return out
