"""Zero-copy NumPy views on the arrays of a received Flower ArrayRecord.

Flower stores each :class:`flwr.app.Array` as the bytes of a ``.npy`` file
(``stype == "numpy.ndarray"``, written by ``numpy.save``). ``Array.numpy()`` and
``ArrayRecord.to_torch_state_dict()`` copy those bytes into a new array; with 50
replies of a ResNet-18 that is 2.2 GB copied before anything is checked. Here the
small ``.npy`` header is parsed with NumPy's own reader (``numpy.lib.format``, no
pickle) and the payload is viewed in place with ``numpy.frombuffer``: the views are
read-only and keep the reply's bytes alive for as long as they live.
"""

from __future__ import annotations

import functools
import io
import math

import numpy as np
from flwr.app import Array, ArrayRecord
from flwr.common.constant import SType

# The .npy versions numpy.save writes: 1.0, and 2.0 for headers over 64 KiB. 3.0 only
# appears for structured dtypes with non-Latin-1 field names, which no model tensor has.
_READERS = {
    (1, 0): np.lib.format.read_array_header_1_0,
    (2, 0): np.lib.format.read_array_header_2_0,
}


def _parse_header(data: bytes | bytearray | memoryview) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """Shape, Fortran order, dtype and payload offset of a .npy byte string.

    NumPy's header reader (``ast.literal_eval`` on a dict literal) takes ~50 us; every reply
    of a round repeats the same few dozen headers, so parsed headers are cached by their bytes.
    """
    prefix = bytes(data[:12])
    if len(prefix) < 10 or prefix[:6] != b"\x93NUMPY":
        raise ValueError("not a .npy array: bad magic string")
    version = (prefix[6], prefix[7])
    if version == (1, 0):
        header_end = 10 + int.from_bytes(prefix[8:10], "little")
    elif version == (2, 0) and len(prefix) >= 12:
        header_end = 12 + int.from_bytes(prefix[8:12], "little")
    else:
        raise ValueError(f"unsupported .npy format version {version}")
    if header_end > len(data):
        raise ValueError(f"not a .npy array: header of {header_end} bytes in {len(data)} (truncated)")
    return (*_parse_header_bytes(bytes(data[:header_end])), header_end)


@functools.lru_cache(maxsize=1024)
def _parse_header_bytes(header: bytes) -> tuple[tuple[int, ...], bool, np.dtype]:
    # Bounded: a client sending endless distinct headers only evicts entries, it never grows the cache.
    stream = io.BytesIO(header)
    try:
        version = np.lib.format.read_magic(stream)
        shape, fortran_order, dtype = _READERS[version](stream)
    except (ValueError, SyntaxError, TypeError, EOFError, KeyError) as err:
        raise ValueError(f"not a .npy array: {err}") from err
    if stream.tell() != len(header):
        raise ValueError("not a .npy array: header length mismatch")
    return tuple(shape), bool(fortran_order), dtype


def array_view(array: Array) -> np.ndarray:
    """A read-only NumPy view on the values of one Flower ``Array``, sharing its bytes.

    Raises
    ------
    ValueError
        When the array is not NumPy-serialised, its ``.npy`` header does not parse, its
        dtype holds Python objects, its payload is shorter or longer than its shape needs,
        or its header disagrees with the ``Array``'s own ``dtype``/``shape`` fields.
    """
    if array.stype != SType.NUMPY:
        raise ValueError(f"unsupported serialisation {array.stype!r} (only {SType.NUMPY!r})")
    data = array.data
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ValueError(f"array data is {type(data).__name__}, not bytes")
    shape, fortran_order, dtype, offset = _parse_header(data)
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise ValueError(f"dtype {dtype} is not a plain numeric dtype")
    if tuple(array.shape) != tuple(shape):
        raise ValueError(f"Array.shape {tuple(array.shape)} disagrees with its data's shape {tuple(shape)}")
    if array.dtype != str(dtype):
        raise ValueError(f"Array.dtype {array.dtype!r} disagrees with its data's dtype {str(dtype)!r}")
    count = math.prod(shape)
    expected = count * dtype.itemsize
    if len(data) - offset != expected:
        raise ValueError(
            f"payload of {len(data) - offset} bytes, shape {tuple(shape)} of {dtype} needs {expected} (truncated data?)"
        )
    flat = np.empty(0, dtype=dtype) if count == 0 else np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    # Fortran-ordered data is the transpose of a C-ordered array of the reversed shape.
    view = flat.reshape(shape[::-1]).T if fortran_order else flat.reshape(shape)
    view.flags.writeable = False  # also for bytearray data: nobody writes into a reply
    return view


def array_views(record: ArrayRecord) -> dict[str, np.ndarray]:
    """Zero-copy, read-only NumPy views on the tensors of a received ``ArrayRecord``, in its order.

    Parameters
    ----------
    record : ArrayRecord
        A reply's arrays, as received.

    Returns
    -------
    dict[str, numpy.ndarray]
        One view per array; each shares memory with that ``Array``'s ``data`` bytes.

    Raises
    ------
    ValueError
        Naming the array, when one does not parse (see :func:`array_view`): the caller
        rejects the reply as malformed.
    """
    views: dict[str, np.ndarray] = {}
    for key, array in record.items():
        try:
            views[key] = array_view(array)
        except ValueError as err:
            raise ValueError(f"array {key!r}: {err}") from err
    return views
