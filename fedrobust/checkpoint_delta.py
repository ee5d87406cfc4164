"""The bytes of incremental checkpoints: safetensors blobs as raw tensor views, and deltas between two.

A delta stores each tensor as "same" (unchanged), "xor" (zlib of the byte-shuffled XOR with the base:
two close floats share their sign, exponent and high mantissa bytes) or "full"; every encoding restores
the exact bytes. :mod:`fedrobust.checkpoint` decides when a checkpoint is a delta and checks it.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np


class MalformedDeltaError(ValueError):
    """A safetensors blob or a delta that cannot be read back (a corrupted or foreign checkpoint)."""


class Raw(NamedTuple):
    """One tensor as safetensors stores it: dtype name, shape and its raw bytes (a uint8 view, no copy)."""

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray


def parse_safetensors(data: bytes) -> dict[str, Raw]:
    """Views of every tensor's raw bytes in a safetensors blob (no copy; the blob must stay alive)."""
    try:
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + header_len])
        buffer = np.frombuffer(data, dtype=np.uint8)
        start = 8 + header_len
        out: dict[str, Raw] = {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            if not 0 <= begin <= end <= len(data) - start:
                raise ValueError(f"offsets of {key!r} lie outside the data")
            shape = tuple(int(d) for d in info["shape"])
            out[key] = Raw(str(info["dtype"]), shape, buffer[start + begin : start + end])
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise MalformedDeltaError(f"malformed safetensors data: {exc!r}") from None
    return out


def build_safetensors(tensors: Mapping[str, Raw]) -> bytes:
    """The safetensors blob of raw tensors (the inverse of :func:`parse_safetensors`)."""
    header: dict[str, Any] = {}
    offset = 0
    for key in sorted(tensors):
        raw = tensors[key]
        header[key] = {"dtype": raw.dtype, "shape": list(raw.shape), "data_offsets": [offset, offset + raw.data.size]}
        offset += raw.data.size
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)  # safetensors aligns the data to 8 bytes
    body = [len(header_bytes).to_bytes(8, "little"), header_bytes]
    body += [tensors[key].data.tobytes() for key in sorted(tensors)]
    return b"".join(body)


def _shuffle(data: np.ndarray, itemsize: int) -> np.ndarray:
    # Byte planes (all first bytes, then all second bytes, ...): the XOR of two close floats has zero sign,
    # exponent and high-mantissa bytes, which zlib then compresses to almost nothing.
    return data.reshape(-1, itemsize).T.reshape(-1) if itemsize > 1 else data


def _unshuffle(data: np.ndarray, itemsize: int) -> np.ndarray:
    return data.reshape(itemsize, -1).T.reshape(-1) if itemsize > 1 else data


def encode_delta(new: Mapping[str, Raw], base: Mapping[str, Raw]) -> tuple[bytes, dict[str, Any]]:
    """Encode ``new`` against ``base``: per tensor "same", "xor" (zlib of the shuffled XOR) or "full".

    Every encoding restores the exact bytes; "xor" is used only where it is smaller than the raw bytes.
    """
    stored: dict[str, Raw] = {}
    index: dict[str, Any] = {}
    for key in sorted(new):
        raw = new[key]
        entry: dict[str, Any] = {"dtype": raw.dtype, "shape": list(raw.shape), "nbytes": int(raw.data.size)}
        old = base.get(key)
        numel = int(np.prod(raw.shape, dtype=np.int64))
        if old is not None and old.dtype == raw.dtype and old.shape == raw.shape and old.data.size == raw.data.size:
            if np.array_equal(old.data, raw.data):
                index[key] = entry | {"op": "same"}
                continue
            itemsize = raw.data.size // numel
            # .data: the array's buffer as a memoryview (numpy types ndarray as a buffer only for Python >= 3.12).
            packed = zlib.compress(_shuffle(np.bitwise_xor(old.data, raw.data), itemsize).data, 1)
            if len(packed) < raw.data.size:
                stored[key] = Raw("U8", (len(packed),), np.frombuffer(packed, dtype=np.uint8))
                index[key] = entry | {"op": "xor", "codec": "zlib", "itemsize": itemsize}
                continue
        stored[key] = Raw("U8", (raw.data.size,), raw.data)
        index[key] = entry | {"op": "full"}
    return build_safetensors(stored), {"tensors": index}


def apply_delta(base: Mapping[str, Raw], stored: Mapping[str, Raw], index: Any) -> dict[str, Raw]:
    """Inverse of :func:`encode_delta`; raises KeyError/TypeError/zlib.error/MalformedDeltaError on bad input."""
    out: dict[str, Raw] = {}
    for key, entry in index["tensors"].items():
        op, nbytes = entry["op"], int(entry["nbytes"])
        shape = tuple(int(d) for d in entry["shape"])
        if op == "same":
            data = base[key].data
        elif op == "full":
            data = stored[key].data
        elif op == "xor":
            itemsize = int(entry["itemsize"])
            xor = np.frombuffer(zlib.decompress(stored[key].data.tobytes()), dtype=np.uint8)
            if xor.size != nbytes or base[key].data.size != nbytes:
                raise MalformedDeltaError(f"delta of {key!r} has {xor.size} bytes, expected {nbytes}")
            data = np.bitwise_xor(base[key].data, _unshuffle(xor, itemsize))
        else:
            raise MalformedDeltaError(f"unknown delta op {op!r} for {key!r}")
        if data.size != nbytes:
            raise MalformedDeltaError(f"{key!r} restores to {data.size} bytes, expected {nbytes}")
        out[key] = Raw(str(entry["dtype"]), shape, data)
    return out
