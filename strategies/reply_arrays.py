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
    # BytesIO over bytes shares the buffer (copy-on-write) and is only read from here.
    stream = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(stream)
        reader = _READERS.get(version)
        if reader is None:
            raise ValueError(f"unsupported .npy format version {version}")
        shape, fortran_order, dtype = reader(stream)
    except (ValueError, SyntaxError, TypeError, EOFError) as err:
        raise ValueError(f"not a .npy array: {err}") from err
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise ValueError(f"dtype {dtype} is not a plain numeric dtype")
    if tuple(array.shape) != tuple(shape):
        raise ValueError(f"Array.shape {tuple(array.shape)} disagrees with its data's shape {tuple(shape)}")
    if array.dtype != str(dtype):
        raise ValueError(f"Array.dtype {array.dtype!r} disagrees with its data's dtype {str(dtype)!r}")
    offset = stream.tell()
    count = math.prod(shape)
    expected = count * dtype.itemsize
    if len(data) - offset != expected:
        raise ValueError(
            f"payload of {len(data) - offset} bytes, shape {tuple(shape)} of {dtype} needs {expected} (truncated data?)"
        )
    if count == 0:
        flat = np.empty(0, dtype=dtype)
    else:
        flat = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
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
