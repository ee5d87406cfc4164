"""Checks a single client update must pass before it may be aggregated.

Each reply is judged on its own: one malformed, non-finite or oversized update is
rejected with a reason and never stops the others from being aggregated.

The pieces (structure, num-examples, finiteness and norm) are separate functions so
that :class:`fedrobust.update_matrix.UpdateMatrix`, which checks a reply while it
copies it into the aggregation matrix, gives the same reasons as :func:`check_update`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedrobust.text import first_and_more

WRONG_KEYS = "wrong_keys"
WRONG_SHAPE = "wrong_shape"
WRONG_DTYPE = "wrong_dtype"
NON_FINITE = "non_finite"
NORM_TOO_LARGE = "norm_too_large"
BAD_NUM_EXAMPLES = "bad_num_examples"

# Elements per block of the blockwise sum of squares: 128 KiB of float32 stays in L2
# cache between writing a block and summing its squares, and a float32 dot product
# over 32k elements (accumulated in float64 across blocks) is accurate to ~1e-7.
BLOCK = 1 << 15


@dataclass(frozen=True)
class Rejection:
    """Why a reply was not aggregated: a short ``reason`` code and a human ``detail``."""

    reason: str
    detail: str


@functools.lru_cache(maxsize=64)
def _torch_dtype_of_numpy(dtype: np.dtype) -> torch.dtype | None:
    try:
        # Byte order is a property of the serialisation, not of the values: '>f4' holds float32.
        return torch.from_numpy(np.empty(0, dtype=dtype.newbyteorder("="))).dtype
    except TypeError:  # object, string, structured ... dtypes have no torch equivalent
        return None


def torch_dtype(dtype: torch.dtype | np.dtype) -> torch.dtype | None:
    """The torch dtype of a torch or NumPy dtype (any byte order), or ``None`` when torch has none."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return _torch_dtype_of_numpy(np.dtype(dtype))


def check_structure(update: Mapping[str, Any], template: Mapping[str, torch.Tensor]) -> Rejection | None:
    """Return why ``update`` does not have exactly the names, shapes and dtypes of ``template``.

    Parameters
    ----------
    update : Mapping[str, torch.Tensor | numpy.ndarray]
        Anything with ``.shape`` and ``.dtype`` per name; NumPy dtypes compare equal to
        the torch dtype that holds the same values (``float32`` == ``torch.float32``).
    template : Mapping[str, torch.Tensor]
        The global model (tensors on any device, ``meta`` included).
    """
    if update.keys() != template.keys():
        missing, extra = sorted(set(template) - set(update)), sorted(set(update) - set(template))
        return Rejection(WRONG_KEYS, f"missing {first_and_more(missing) or 'none'}, "
                                     f"unexpected {first_and_more(extra) or 'none'}")
    for key, ref in template.items():
        got = update[key]
        if tuple(got.shape) != tuple(ref.shape):
            return Rejection(WRONG_SHAPE, f"{key}: {tuple(got.shape)} != {tuple(ref.shape)}")
        if torch_dtype(got.dtype) != ref.dtype:
            return Rejection(WRONG_DTYPE, f"{key}: {got.dtype} != {ref.dtype}")
    return None


def check_num_examples(num_examples: object, max_num_examples: int) -> Rejection | None:
    """Return why ``num_examples`` is not an integer in [1, max_num_examples], or ``None``."""
    if (
        isinstance(num_examples, bool)
        or not isinstance(num_examples, int | float)
        or not math.isfinite(num_examples)
        or num_examples != int(num_examples)
        or not 1 <= num_examples <= max_num_examples
    ):
        return Rejection(BAD_NUM_EXAMPLES, f"{num_examples!r} not an integer in [1, {max_num_examples}]")
    return None


# Batch norms' running statistics: buffers a client sends back with its weights, whose change can be far
# larger than the weights' (a running variance follows the data's scale, not the learning rate).
RUNNING_STATISTICS = ("running_mean", "running_var")


def is_running_statistic(key: str) -> bool:
    """Whether the state-dict ``key`` is a batch norm's running mean or variance."""
    return key.rsplit(".", 1)[-1] in RUNNING_STATISTICS


def check_norm(norm: float, max_norm: float, statistics_norm: float = 0.0) -> Rejection | None:
    """Return a ``norm_too_large`` rejection when ``max_norm > 0`` and ``norm`` exceeds it; a rejection
    says how much of the norm the running statistics make up (``statistics_norm``, L2), where they add any."""
    if max_norm > 0 and not norm <= max_norm:
        share = f" (the batch norms' running statistics: {statistics_norm:.4g} of it)" if statistics_norm else ""
        return Rejection(NORM_TOO_LARGE, f"L2 norm {norm:.4g} > bound {max_norm:.4g}{share}")
    return None


def non_finite(key: str) -> Rejection:
    """The rejection of an update whose tensor ``key`` holds NaN or infinity."""
    return Rejection(NON_FINITE, f"{key} holds NaN or infinity")


def block_sum_squares(block: np.ndarray) -> float:
    """Sum of squares of a 1-D float32 or float64 block; NaN when it holds NaN or infinity.

    A float32 dot product is exact enough over one block (see ``BLOCK``) and NaN or
    infinity in the block makes it non-finite, so finiteness costs nothing on the common
    path. Only a non-finite result looks again: a finite float32 block whose squares
    overflow float32 is summed again in float64 (a copy of one block, and only then).
    Callers expecting hostile values wrap it in ``numpy.errstate(over="ignore")``.
    """
    total = float(np.dot(block, block))
    if math.isfinite(total):
        return total
    if not bool(np.isfinite(block).all()):
        return math.nan
    wide = block.astype(np.float64)
    return float(np.dot(wide, wide))  # +inf only if float64 overflows too


def sum_of_squares(values: torch.Tensor | np.ndarray) -> float:
    """Sum of squares of all elements of a floating-point tensor or array, blockwise.

    Returns NaN when an element is NaN or infinite (so ``math.isfinite`` on the result
    is the finiteness check), +inf only when finite float64 values overflow. Half
    precision (float16, bfloat16) is widened to float32 one block at a time, so no copy
    of the whole tensor is made for contiguous input.
    """
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is detected, not an error
        return _sum_of_squares(values)


def _sum_of_squares(values: torch.Tensor | np.ndarray) -> float:
    if isinstance(values, torch.Tensor):
        flat_t = values.detach().cpu().reshape(-1)
        total = 0.0
        for start in range(0, flat_t.numel(), BLOCK):
            block = flat_t[start : start + BLOCK]
            if block.dtype not in (torch.float32, torch.float64):
                block = block.to(torch.float32)
            total += block_sum_squares(block.numpy())
        return total
    flat = np.asarray(values).reshape(-1)
    total = 0.0
    for start in range(0, flat.size, BLOCK):
        block_np = flat[start : start + BLOCK]
        if block_np.dtype not in (np.float32, np.float64):
            block_np = block_np.astype(np.float32)
        total += block_sum_squares(block_np)
    return total


def check_update(
    update: Mapping[str, torch.Tensor],
    template: Mapping[str, torch.Tensor],
    *,
    num_examples: float,
    max_norm: float,
    max_num_examples: int,
) -> Rejection | None:
    """Return why ``update`` may not be aggregated, or ``None`` when it may.

    Parameters
    ----------
    update : Mapping[str, torch.Tensor]
        The client's update (local minus global), by parameter name.
    template : Mapping[str, torch.Tensor]
        The global model: the update must have exactly its names, shapes and dtypes.
    num_examples : float
        What the client says it trained on; must be an integer in [1, max_num_examples].
    max_norm : float
        Bound on the L2 norm of the whole update; 0 disables the check.
    max_num_examples : int
        Largest believable num-examples.
    """
    rejection = check_structure(update, template) or check_num_examples(num_examples, max_num_examples)
    if rejection is not None:
        return rejection
    squared = 0.0
    for key, got in update.items():
        if not got.is_floating_point():
            continue
        part = sum_of_squares(got)
        if math.isnan(part):
            return non_finite(key)
        squared += part
    return check_norm(math.sqrt(squared), max_norm)
