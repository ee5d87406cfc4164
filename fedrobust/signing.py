"""Ed25519 update signing: keys, the canonical update digest, trust store and replay guard.

A client signs every reply it sends: the model update, its number of examples and the context it was
produced in (run, round, node, the server's nonce for that message). The server checks the signature
against a trust store of public keys, each bound to one node, and checks the nonce against the nonces
it issued, so that a reply cannot be forged, moved to another node, replayed from an earlier round or
delivered twice. Nothing here imports flwr: the Flower glue converts messages to the plain values
below at its edge.

Canonical byte layout (format version 1)
----------------------------------------
Integers are unsigned big-endian: ``u32`` is 4 bytes, ``u64`` is 8 bytes. Every variable-length field
is length-prefixed, ``lp(b) = u32(len(b)) || b``, so no two different inputs give the same bytes::

    message = lp(b"fedrobust-update")       domain tag: a signature is never valid for another protocol
              u32(1)                         format version
              lp(utf8(str(run_id)))          run id (an int is written as its decimal string)
              u64(round)
              u64(node_id)
              lp(nonce)                      server nonce for this message, 16 to 64 bytes
              u64(num_examples)
              u32(number of arrays)
              for each array, sorted by name (Unicode code point order = UTF-8 byte order):
                  lp(utf8(name))
                  lp(ascii(dtype))           numpy/torch dtype name: "float32", "bfloat16", "int64", "bool"
                  u32(ndim) u64(dim_0) ... u64(dim_{ndim-1})
                  sha256(data)               32 bytes; data = the array's C-contiguous little-endian bytes

    digest    = SHA-512(message)             what `canonical_digest` returns (64 bytes)
    signature = Ed25519-sign(private key, digest)

The digest, not the message, is what gets signed: it is a fixed 64 bytes whatever the number of arrays,
and equal digests mean equal signed content, which is convenient to compare and to log. A numpy array
and a torch tensor with the same dtype, shape and values hash the same, so a client may sign torch
tensors that the server verifies as numpy arrays. Torch dtypes numpy lacks (bfloat16, float8) are hashed
from their raw bytes under the torch dtype name. Tensors on an accelerator are copied to the CPU first.

Keys are stored as PEM: PKCS8 (unencrypted) for private keys, written with mode 0600, and
SubjectPublicKeyInfo for public keys. A key id is the hex SHA-256 of the raw 32-byte public key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import operator
import os
import random
import stat
import struct
import sys
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeAlias, Union, cast

import numpy as np
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

__all__ = [
    "DOMAIN_TAG",
    "FORMAT_VERSION",
    "NONCE_MAX_BYTES",
    "NONCE_MIN_BYTES",
    "REASONS",
    "REASON_DETAILS",
    "REASON_BAD_SIGNATURE",
    "REASON_DUPLICATE_REPLY",
    "REASON_KEY_BOUND_TO_OTHER_NODE",
    "REASON_MISSING_SIGNATURE",
    "REASON_UNKNOWN_KEY",
    "REASON_WRONG_ROUND_OR_NONCE",
    "TRUST_FILE",
    "ReplayGuard",
    "TrustStore",
    "canonical_digest",
    "canonical_message",
    "derive_keypair",
    "generate_keypair",
    "key_id",
    "load_private_key",
    "load_public_key",
    "sign_update",
    "verify_reply",
    "verify_update",
    "write_private_file",
    "write_private_key",
    "write_public_key",
]

DOMAIN_TAG: Final = b"fedrobust-update"
FORMAT_VERSION: Final = 1
NONCE_MIN_BYTES: Final = 16
NONCE_MAX_BYTES: Final = 64
SIGNATURE_BYTES: Final = 64

REASON_MISSING_SIGNATURE: Final = "missing_signature"
REASON_UNKNOWN_KEY: Final = "unknown_key"
REASON_KEY_BOUND_TO_OTHER_NODE: Final = "key_bound_to_other_node"
REASON_BAD_SIGNATURE: Final = "bad_signature"
REASON_WRONG_ROUND_OR_NONCE: Final = "wrong_round_or_nonce"
REASON_DUPLICATE_REPLY: Final = "duplicate_reply"
#: Every reason `verify_reply` can return, in the order the checks run.
REASONS: Final = (
    REASON_MISSING_SIGNATURE,
    REASON_UNKNOWN_KEY,
    REASON_KEY_BOUND_TO_OTHER_NODE,
    REASON_WRONG_ROUND_OR_NONCE,
    REASON_BAD_SIGNATURE,
    REASON_DUPLICATE_REPLY,
)

#: What each reason means for the operator, for a rejection's detail.
REASON_DETAILS: Final = {
    REASON_MISSING_SIGNATURE: (
        "no signature: the ClientApp needs signing_mod(), and signing_mod a key for the node (the node config's "
        "signing-key, or a key or key_for(context) passed to signing_mod)"
    ),
    REASON_UNKNOWN_KEY: "signed with a key the trust store does not hold",
    REASON_KEY_BOUND_TO_OTHER_NODE: "signed with a key the trust store binds to another node",
    REASON_WRONG_ROUND_OR_NONCE: "signed for another round or nonce than this round's: a replay",
    REASON_BAD_SIGNATURE: "the signature does not match the reply's arrays and count under its key",
    REASON_DUPLICATE_REPLY: "a second reply with this round's nonce",
}

#: Name of the binding file inside a trust store directory.
TRUST_FILE: Final = "trust.json"
_TRUST_FORMAT: Final = "fedrobust-trust-store"
_TRUST_VERSION: Final = 1
_SIM_KEY_TAG: Final = b"fedrobust-simulation-key"
_U64_MAX: Final = 2**64 - 1
# Only plain numeric/bool arrays have a meaningful byte representation; object or structured arrays
# would hash pointers or padding.
_NUMPY_KINDS: Final = frozenset("biufc")

PathLike = str | os.PathLike[str]
# A string forward reference: torch is only imported for type checking (see `_array_record`).
ArrayLike: TypeAlias = Union[np.ndarray, "torch.Tensor"]


# --------------------------------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------------------------------
def generate_keypair() -> tuple[Ed25519PrivateKey, Ed25519PublicKey]:
    """Generate a fresh Ed25519 key pair from the operating system's random source.

    Returns
    -------
    tuple[Ed25519PrivateKey, Ed25519PublicKey]
        The private key and its public key.
    """
    private_key = Ed25519PrivateKey.generate()
    return private_key, private_key.public_key()


def derive_keypair(run_seed: int, partition_id: int) -> tuple[Ed25519PrivateKey, Ed25519PublicKey]:
    """Derive a deterministic Ed25519 key pair for a simulated client.

    The 32-byte private seed is ``SHA-256(lp(tag) || i64(run_seed) || u64(partition_id))``, so simulated
    clients and the server agree on every key without any file. Anyone who knows the run seed can
    derive these keys: they are for simulation only, never for deployment.

    Parameters
    ----------
    run_seed : int
        The run's seed, in the signed 64-bit range.
    partition_id : int
        The client's partition id, ``>= 0``.

    Returns
    -------
    tuple[Ed25519PrivateKey, Ed25519PublicKey]
        The private key and its public key.
    """
    seed = _as_int("run_seed", run_seed, low=-(2**63), high=2**63 - 1)
    partition = _as_int("partition_id", partition_id)
    material = hashlib.sha256(
        _lp(_SIM_KEY_TAG) + seed.to_bytes(8, "big", signed=True) + partition.to_bytes(8, "big")
    ).digest()
    private_key = Ed25519PrivateKey.from_private_bytes(material)
    return private_key, private_key.public_key()


def key_id(public_key: Ed25519PublicKey) -> str:
    """Return the key id of a public key: the hex SHA-256 of its raw 32 bytes.

    Parameters
    ----------
    public_key : Ed25519PublicKey
        The key.

    Returns
    -------
    str
        64 lowercase hex characters.
    """
    if not isinstance(public_key, Ed25519PublicKey):
        raise ValueError(f"key_id needs an Ed25519PublicKey, got {type(public_key).__name__}")
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def write_private_file(path: PathLike, data: bytes, *, overwrite: bool = False) -> Path:
    """Write secret bytes to a file that is mode 0600 from the moment it exists.

    Parameters
    ----------
    path : str or PathLike
        Destination file; its directory must exist.
    data : bytes
        The secret content.
    overwrite : bool
        Replace an existing file (atomically, through a 0600 temporary file). Without it an existing
        file raises `FileExistsError`.

    Returns
    -------
    Path
        The path written.
    """
    path = Path(path)
    # Overwriting goes through a temporary file and a rename: a reader never sees a half-written key,
    # and the old file's (possibly lax) mode is not inherited.
    target = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp") if overwrite else path
    # O_EXCL: never follow a planted symlink or reuse an existing file; the mode is set at creation,
    # so the file is never group/world readable, even briefly.
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            if hasattr(os, "fchmod"):
                # The umask can only remove bits from 0o600; fchmod makes the mode exact anyway.
                os.fchmod(handle.fileno(), 0o600)
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if overwrite:
            os.replace(target, path)
    except BaseException:
        if overwrite:
            target.unlink(missing_ok=True)
        raise
    return path


def write_private_key(path: PathLike, private_key: Ed25519PrivateKey, *, overwrite: bool = False) -> Path:
    """Write an Ed25519 private key as unencrypted PKCS8 PEM with mode 0600.

    Parameters
    ----------
    path : str or PathLike
        Destination file.
    private_key : Ed25519PrivateKey
        The key.
    overwrite : bool
        Replace an existing file; otherwise an existing file raises `FileExistsError`.

    Returns
    -------
    Path
        The path written.
    """
    if not isinstance(private_key, Ed25519PrivateKey):
        raise ValueError(f"write_private_key needs an Ed25519PrivateKey, got {type(private_key).__name__}")
    pem = private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    written = write_private_file(path, pem, overwrite=overwrite)
    log.info("wrote private key %s (mode 0600, key id %s)", written, key_id(private_key.public_key()))
    return written


def write_public_key(path: PathLike, public_key: Ed25519PublicKey, *, overwrite: bool = False) -> Path:
    """Write an Ed25519 public key as SubjectPublicKeyInfo PEM.

    Parameters
    ----------
    path : str or PathLike
        Destination file.
    public_key : Ed25519PublicKey
        The key.
    overwrite : bool
        Replace an existing file; otherwise an existing file raises `FileExistsError`.

    Returns
    -------
    Path
        The path written.
    """
    if not isinstance(public_key, Ed25519PublicKey):
        raise ValueError(f"write_public_key needs an Ed25519PublicKey, got {type(public_key).__name__}")
    path = Path(path)
    pem = public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    with path.open("wb" if overwrite else "xb") as handle:
        handle.write(pem)
    log.info("wrote public key %s (key id %s)", path, key_id(public_key))
    return path


def load_private_key(path: PathLike) -> Ed25519PrivateKey:
    """Load an unencrypted PKCS8 PEM Ed25519 private key.

    Logs a warning when the file is readable by its group or by others.

    Parameters
    ----------
    path : str or PathLike
        The key file.

    Returns
    -------
    Ed25519PrivateKey
        The key.

    Raises
    ------
    ValueError
        The file is not an unencrypted PEM Ed25519 private key. The message names the file only,
        never its content.
    """
    path = Path(path)
    mode = path.stat().st_mode
    if os.name == "posix" and mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning(
            "private key %s has mode %04o: readable by group or others; restrict it with `chmod 600 %s`",
            path,
            stat.S_IMODE(mode),
            path,
        )
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        # `from None`: the library's error is not needed to act, and nothing derived from the secret
        # file's bytes should travel in the exception chain.
        raise ValueError(f"{path}: not an unencrypted PEM (PKCS8) Ed25519 private key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path}: holds a {type(key).__name__}, expected an Ed25519 private key")
    return key


def load_public_key(path: PathLike) -> Ed25519PublicKey:
    """Load a SubjectPublicKeyInfo PEM Ed25519 public key.

    Parameters
    ----------
    path : str or PathLike
        The key file.

    Returns
    -------
    Ed25519PublicKey
        The key.

    Raises
    ------
    ValueError
        The file is not a PEM Ed25519 public key.
    """
    path = Path(path)
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except (ValueError, UnsupportedAlgorithm) as err:
        raise ValueError(f"{path}: not a PEM (SubjectPublicKeyInfo) Ed25519 public key") from err
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"{path}: holds a {type(key).__name__}, expected an Ed25519 public key")
    return key


# --------------------------------------------------------------------------------------------------
# Canonical digest, sign, verify
# --------------------------------------------------------------------------------------------------
def _lp(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _as_int(name: str, value: Any, *, low: int = 0, high: int = _U64_MAX) -> int:
    # bool is an int subclass; True as a round number is a bug, not a value.
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got bool")
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}") from None
    if not low <= number <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {number}")
    return number


def _check_run_id(run_id: Any) -> None:
    if isinstance(run_id, bool) or not isinstance(run_id, int | str):
        raise ValueError(f"run_id must be an int or str, got {type(run_id).__name__}")


def _check_nonce(nonce: Any) -> bytes:
    if not isinstance(nonce, bytes | bytearray):
        raise ValueError(f"nonce must be bytes, got {type(nonce).__name__}")
    if not NONCE_MIN_BYTES <= len(nonce) <= NONCE_MAX_BYTES:
        raise ValueError(f"nonce must be {NONCE_MIN_BYTES} to {NONCE_MAX_BYTES} bytes, got {len(nonce)}")
    return bytes(nonce)


def _array_record(name: str, value: Any) -> bytes:
    """Return lp(name) lp(dtype) shape sha256(data) for one array."""
    # torch is looked up, not imported: a tensor can only exist if torch is loaded, and the key and
    # certificate command-line tools start in a fraction of the time without it.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_quantized:
            raise ValueError(f"array {name!r}: only dense, non-quantized tensors can be signed")
        tensor = value.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        # Conjugate/negative views carry a lazy bit; resolve it so the bytes are the values.
        tensor = tensor.resolve_conj().resolve_neg().contiguous()
        dtype = str(value.dtype).removeprefix("torch.")
        shape = tuple(value.shape)
        # Raw bytes through a uint8 view: works for dtypes numpy lacks (bfloat16, float8); torch only
        # runs on little-endian hosts, so these are the little-endian bytes.
        data = hashlib.sha256(tensor.reshape(-1).view(torch.uint8).numpy().data).digest()
    elif isinstance(value, np.ndarray):
        if value.dtype.kind not in _NUMPY_KINDS:
            raise ValueError(
                f"array {name!r}: dtype {value.dtype} cannot be signed; use a bool, integer, float "
                "or complex dtype"
            )
        dtype = value.dtype.name
        shape = tuple(value.shape)
        # Little-endian C order whatever the array's own byte order and strides.
        contiguous = np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("<"))
        data = hashlib.sha256(contiguous.data).digest()
    else:
        raise ValueError(f"array {name!r} must be a numpy array or torch tensor, got {type(value).__name__}")
    dims = b"".join(struct.pack(">Q", dim) for dim in shape)
    return _lp(name.encode("utf-8")) + _lp(dtype.encode("ascii")) + struct.pack(">I", len(shape)) + dims + data


def canonical_message(
    *,
    run_id: int | str,
    round: int,
    node_id: int,
    nonce: bytes,
    num_examples: int,
    arrays: Mapping[str, ArrayLike],
) -> bytes:
    """Return the canonical byte string of an update (layout in the module docstring).

    Parameters
    ----------
    run_id : int or str
        The run id (Flower's ``Context.run_id`` or a run name).
    round : int
        The server round, ``>= 0``.
    node_id : int
        The replying node's id, in ``[0, 2**64)``.
    nonce : bytes
        The server's nonce for this message, 16 to 64 bytes.
    num_examples : int
        The number of training examples the client reports, ``>= 0``.
    arrays : Mapping[str, numpy.ndarray or torch.Tensor]
        The update's arrays by name.

    Returns
    -------
    bytes
        The canonical message.

    Raises
    ------
    ValueError
        A field has the wrong type or range, or an array cannot be signed.
    """
    _check_run_id(run_id)
    if not isinstance(arrays, Mapping):
        raise ValueError(f"arrays must be a mapping of name -> array, got {type(arrays).__name__}")
    for name in arrays:
        if not isinstance(name, str):
            raise ValueError(f"array names must be str, got {type(name).__name__}")
    parts = [
        _lp(DOMAIN_TAG),
        struct.pack(">I", FORMAT_VERSION),
        _lp(str(run_id).encode("utf-8")),
        struct.pack(">Q", _as_int("round", round)),
        struct.pack(">Q", _as_int("node_id", node_id)),
        _lp(_check_nonce(nonce)),
        struct.pack(">Q", _as_int("num_examples", num_examples)),
        struct.pack(">I", len(arrays)),
    ]
    parts.extend(_array_record(name, arrays[name]) for name in sorted(arrays))
    return b"".join(parts)


def canonical_digest(
    *,
    run_id: int | str,
    round: int,
    node_id: int,
    nonce: bytes,
    num_examples: int,
    arrays: Mapping[str, ArrayLike],
) -> bytes:
    """Return the 64-byte digest that is signed: SHA-512 of `canonical_message`.

    Parameters are those of `canonical_message`.

    Returns
    -------
    bytes
        ``SHA-512(canonical_message(...))``.
    """
    message = canonical_message(
        run_id=run_id, round=round, node_id=node_id, nonce=nonce, num_examples=num_examples, arrays=arrays
    )
    return hashlib.sha512(message).digest()


def sign_update(
    private_key: Ed25519PrivateKey,
    *,
    run_id: int | str,
    round: int,
    node_id: int,
    nonce: bytes,
    num_examples: int,
    arrays: Mapping[str, ArrayLike],
) -> bytes:
    """Sign an update's canonical digest.

    Parameters
    ----------
    private_key : Ed25519PrivateKey
        The client's key.
    run_id, round, node_id, nonce, num_examples, arrays
        The update and its context, as in `canonical_message`.

    Returns
    -------
    bytes
        The 64-byte Ed25519 signature.
    """
    if not isinstance(private_key, Ed25519PrivateKey):
        raise ValueError(f"sign_update needs an Ed25519PrivateKey, got {type(private_key).__name__}")
    digest = canonical_digest(
        run_id=run_id, round=round, node_id=node_id, nonce=nonce, num_examples=num_examples, arrays=arrays
    )
    return private_key.sign(digest)


def verify_update(
    public_key: Ed25519PublicKey,
    signature: bytes,
    *,
    run_id: int | str,
    round: int,
    node_id: int,
    nonce: bytes,
    num_examples: int,
    arrays: Mapping[str, ArrayLike],
) -> bool:
    """Check a signature over an update's canonical digest.

    Parameters
    ----------
    public_key : Ed25519PublicKey
        The key the signature claims.
    signature : bytes
        The signature; anything that is not 64 bytes is simply invalid.
    run_id, round, node_id, nonce, num_examples, arrays
        The update and its context, as in `canonical_message`.

    Returns
    -------
    bool
        True when the signature is valid; False otherwise (never raises for a bad signature).

    Raises
    ------
    ValueError
        A digest field is malformed (wrong type or range), or `public_key` is not an Ed25519 key.
    """
    if not isinstance(public_key, Ed25519PublicKey):
        raise ValueError(f"verify_update needs an Ed25519PublicKey, got {type(public_key).__name__}")
    digest = canonical_digest(
        run_id=run_id, round=round, node_id=node_id, nonce=nonce, num_examples=num_examples, arrays=arrays
    )
    if not isinstance(signature, bytes | bytearray) or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        public_key.verify(bytes(signature), digest)
    except InvalidSignature:
        return False
    return True


# --------------------------------------------------------------------------------------------------
# Trust store
# --------------------------------------------------------------------------------------------------
@dataclass
class _TrustEntry:
    public_key: Ed25519PublicKey
    partition_id: int | None
    node_id: int | None
    # True when node_id was learnt from the first verified reply rather than configured.
    pinned_on_use: bool = False


class TrustStore:
    """Trusted client public keys by key id, each bound to at most one node.

    A key is either bound to a Flower node id up front (`bind`, or ``node_id`` in the binding file),
    or added unbound with the partition it belongs to (`add`, or a ``partition_id``-only binding-file
    entry, as `python -m fedrobust.keygen` writes: node ids are assigned by the SuperLink and unknown
    when keys are made). An unbound key is pinned to the node of its first verified reply (the server
    drops that pin again where the reply then fails validation: `unpin`); from then
    on another node using it is refused, so one key is one identity and a Byzantine operator cannot
    multiply its voice by running many nodes with one trusted key. `release_node` drops first-use pins
    of a node that is gone (a SuperNode that restarts without Flower's node authentication comes back
    with a new node id).

    Binding file ``trust.json`` (in the trust store directory)::

        {"format": "fedrobust-trust-store", "version": 1,
         "keys": [{"partition_id": 0, "key_id": "<hex>", "file": "client-0.pub"}, ...]}

    ``file`` is relative to the directory; ``key_id`` must match the file's key; an entry may carry
    ``node_id`` (bound now), ``partition_id``, or both.
    """

    def __init__(self) -> None:
        self._entries: dict[str, _TrustEntry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, kid: object) -> bool:
        return kid in self._entries

    def __repr__(self) -> str:
        bound = sum(entry.node_id is not None for entry in self._entries.values())
        return f"TrustStore(keys={len(self._entries)}, bound={bound})"

    def add(
        self, public_key: Ed25519PublicKey, *, node_id: int | None = None, partition_id: int | None = None
    ) -> str:
        """Trust a public key, optionally bound to a node now and labelled with its partition.

        Parameters
        ----------
        public_key : Ed25519PublicKey
            The key.
        node_id : int, optional
            Bind the key to this node now; without it the key is pinned on first verified use.
        partition_id : int, optional
            The data partition (client) the key belongs to.

        Returns
        -------
        str
            The key id.

        Raises
        ------
        ValueError
            The key is already trusted with a different node or partition.
        """
        kid = key_id(public_key)
        node = None if node_id is None else _as_int("node_id", node_id)
        partition = None if partition_id is None else _as_int("partition_id", partition_id)
        existing = self._entries.get(kid)
        if existing is not None:
            if node is not None and existing.node_id not in (None, node):
                raise ValueError(f"key {kid} is already bound to node {existing.node_id}, not {node}")
            if partition is not None and existing.partition_id not in (None, partition):
                raise ValueError(f"key {kid} already belongs to partition {existing.partition_id}, not {partition}")
            if node is not None:
                existing.node_id, existing.pinned_on_use = node, False
            if partition is not None:
                existing.partition_id = partition
            return kid
        self._entries[kid] = _TrustEntry(public_key=public_key, partition_id=partition, node_id=node)
        return kid

    def bind(self, node_id: int, public_key: Ed25519PublicKey) -> str:
        """Trust a public key and bind it to a node.

        Parameters
        ----------
        node_id : int
            The only node that may use the key.
        public_key : Ed25519PublicKey
            The key.

        Returns
        -------
        str
            The key id.
        """
        return self.add(public_key, node_id=node_id)

    def lookup(self, key_id: str) -> Ed25519PublicKey | None:
        """Return the trusted public key with this key id, or None."""
        entry = self._entries.get(key_id) if isinstance(key_id, str) else None
        return None if entry is None else entry.public_key

    def bound_node(self, key_id: str) -> int | None:
        """Return the node a key is bound to (configured or pinned), or None."""
        entry = self._entries.get(key_id)
        return None if entry is None else entry.node_id

    def partition_id(self, key_id: str) -> int | None:
        """Return the partition a key belongs to, or None."""
        entry = self._entries.get(key_id)
        return None if entry is None else entry.partition_id

    def check_binding(self, key_id: str, node_id: int) -> str | None:
        """Return why `node_id` may not use key `key_id`, or None when it may.

        Returns
        -------
        str or None
            `REASON_UNKNOWN_KEY`, `REASON_KEY_BOUND_TO_OTHER_NODE` or None.
        """
        entry = self._entries.get(key_id) if isinstance(key_id, str) else None
        if entry is None:
            return REASON_UNKNOWN_KEY
        if entry.node_id is not None and entry.node_id != node_id:
            return REASON_KEY_BOUND_TO_OTHER_NODE
        return None

    def pin(self, key_id: str, node_id: int) -> None:
        """Bind an unbound key to the node that just used it (no-op if already bound to it).

        Raises
        ------
        ValueError
            The key is unknown or bound to another node.
        """
        reason = self.check_binding(key_id, node_id)
        if reason is not None:
            raise ValueError(f"cannot pin key {key_id} to node {node_id}: {reason}")
        entry = self._entries[key_id]
        if entry.node_id is None:
            entry.node_id, entry.pinned_on_use = _as_int("node_id", node_id), True
            log.debug("key %s pinned to node %s on first use", key_id, node_id)

    def remove_partition(self, partition_id: int) -> list[str]:
        """Stop trusting the keys labelled with ``partition_id`` (a leaked key); the key ids removed."""
        removed = [kid for kid, entry in self._entries.items() if entry.partition_id == partition_id]
        for kid in removed:
            del self._entries[kid]
        return removed

    def partitions(self) -> set[int]:
        """The partition ids the trusted keys are labelled with."""
        return {entry.partition_id for entry in self._entries.values() if entry.partition_id is not None}

    def pinned_nodes(self) -> set[int]:
        """The nodes that hold a first-use pin."""
        return {entry.node_id for entry in self._entries.values() if entry.pinned_on_use and entry.node_id is not None}

    def unpin(self, key_id: str) -> None:
        """Drop the first-use pin of one key (a configured binding stays): the reply that made it failed a
        later check, so it is not the reply a key's node should be learnt from."""
        entry = self._entries.get(key_id)
        if entry is not None and entry.pinned_on_use:
            entry.node_id, entry.pinned_on_use = None, False

    def release_node(self, node_id: int) -> list[str]:
        """Drop the first-use pins of a node that is gone; configured bindings stay.

        Returns
        -------
        list[str]
            The key ids released.
        """
        released = [
            kid for kid, entry in self._entries.items() if entry.pinned_on_use and entry.node_id == node_id
        ]
        for kid in released:
            self._entries[kid].node_id, self._entries[kid].pinned_on_use = None, False
        return released

    def state_dict(self) -> dict[str, Any]:
        """Return the first-use pins (JSON-able), for a server checkpoint."""
        return {"pins": {kid: entry.node_id for kid, entry in self._entries.items() if entry.pinned_on_use}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore first-use pins saved by `state_dict`; keys no longer trusted are skipped with a warning."""
        for kid, node in state["pins"].items():
            if kid not in self._entries:
                log.warning("checkpointed pin for key %s skipped: the key is no longer trusted", kid)
                continue
            self.pin(kid, node)

    @classmethod
    def for_simulation(cls, run_seed: int, partition_ids: range | list[int]) -> TrustStore:
        """Trust the `derive_keypair` keys of these partitions, pinned on first use.

        Parameters
        ----------
        run_seed : int
            The run's seed.
        partition_ids : iterable of int
            The simulated clients' partition ids.
        """
        store = cls()
        for partition in partition_ids:
            store.add(derive_keypair(run_seed, partition)[1], partition_id=partition)
        return store

    @classmethod
    def load(cls, directory: PathLike) -> TrustStore:
        """Load a trust store directory: PEM public keys plus the ``trust.json`` binding file.

        Parameters
        ----------
        directory : str or PathLike
            The directory (``<keygen --out>/trust``).

        Raises
        ------
        ValueError
            The binding file is missing or malformed, an entry names a file outside the directory,
            or a file's key does not match the entry's key id.
        """
        directory = Path(directory)
        binding = directory / TRUST_FILE
        if not binding.is_file():
            # python -m fedrobust.keygen --out D writes the trust store to D/trust, beside the private keys.
            inside = directory / "trust" / TRUST_FILE
            hint = f" (python -m fedrobust.keygen wrote one to {inside.parent}: pass that)" if inside.is_file() else ""
            raise ValueError(f"trust store {directory}: no {TRUST_FILE} binding file{hint}")
        try:
            document = json.loads(binding.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{binding}: not valid JSON ({err})") from err
        if not isinstance(document, dict) or document.get("format") != _TRUST_FORMAT:
            raise ValueError(f"{binding}: expected an object with \"format\": \"{_TRUST_FORMAT}\"")
        if document.get("version") != _TRUST_VERSION:
            raise ValueError(f"{binding}: unsupported version {document.get('version')!r}; supported: {_TRUST_VERSION}")
        entries = document.get("keys")
        if not isinstance(entries, list):
            raise ValueError(f"{binding}: \"keys\" must be a list")
        store = cls()
        for index, entry in enumerate(entries):
            where = f"{binding}: keys[{index}]"
            if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
                raise ValueError(f"{where}: needs a \"file\" string")
            name = Path(entry["file"])
            # Keys come only from inside the trust directory: no absolute paths, no "..".
            if name.is_absolute() or ".." in name.parts:
                raise ValueError(f"{where}: file {entry['file']!r} must be a path inside {directory}")
            public_key = load_public_key(directory / name)
            kid = key_id(public_key)
            if entry.get("key_id", kid) != kid:
                raise ValueError(f"{where}: {name} has key id {kid}, the entry says {entry['key_id']}")
            try:
                store.add(public_key, node_id=entry.get("node_id"), partition_id=entry.get("partition_id"))
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from err
        log.info("loaded trust store %s: %d keys", directory, len(store))
        return store

    def save(self, directory: PathLike, *, overwrite: bool = False) -> Path:
        """Write the trusted public keys and ``trust.json`` into a directory (created if needed).

        First-use pins are run state, not configuration: they are not written (see `state_dict`).

        Parameters
        ----------
        directory : str or PathLike
            Destination directory.
        overwrite : bool
            Replace existing files; otherwise an existing file raises `FileExistsError`.

        Returns
        -------
        Path
            The binding file written.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        records = []
        # Partition order first, then unlabelled keys by id: a stable, readable file.
        def order(item: tuple[str, _TrustEntry]) -> tuple[bool, int, str]:
            return item[1].partition_id is None, item[1].partition_id or 0, item[0]

        for kid, entry in sorted(self._entries.items(), key=order):
            name = f"client-{entry.partition_id}.pub" if entry.partition_id is not None else f"key-{kid[:16]}.pub"
            write_public_key(directory / name, entry.public_key, overwrite=overwrite)
            record: dict[str, Any] = {"key_id": kid, "file": name}
            if entry.partition_id is not None:
                record["partition_id"] = entry.partition_id
            if entry.node_id is not None and not entry.pinned_on_use:
                record["node_id"] = entry.node_id
            records.append(record)
        binding = directory / TRUST_FILE
        text = json.dumps({"format": _TRUST_FORMAT, "version": _TRUST_VERSION, "keys": records}, indent=2)
        with binding.open("w" if overwrite else "x", encoding="utf-8") as handle:
            handle.write(text + "\n")
        return binding


# --------------------------------------------------------------------------------------------------
# Replay guard
# --------------------------------------------------------------------------------------------------
@dataclass
class _Issued:
    message_key: Hashable
    node_id: int
    round: int
    consumed: bool = False


class ReplayGuard:
    """Server nonces: one fresh nonce per message, accepted once, for its node and round only.

    Memory is bounded: issuing for round ``r`` forgets nonces of rounds ``< r - keep_rounds + 1``;
    a reply carrying a forgotten nonce is refused as unknown, which is what it is. The guard is not
    checkpointed: after a server restart no earlier nonce is valid, which only refuses stale replies.

    Parameters
    ----------
    nonce_bytes : int
        Nonce length, 16 to 32 bytes.
    keep_rounds : int
        How many most recent rounds' nonces are remembered, ``>= 1``.
    rng : random.Random or numpy.random.Generator, optional
        Seeded source for reproducible simulations. Default: ``os.urandom``, which deployment should
        keep, so that nonces are unpredictable.
    """

    def __init__(
        self,
        *,
        nonce_bytes: int = 16,
        keep_rounds: int = 2,
        rng: random.Random | np.random.Generator | None = None,
    ) -> None:
        if not NONCE_MIN_BYTES <= nonce_bytes <= 32:
            raise ValueError(f"ReplayGuard: nonce_bytes must be {NONCE_MIN_BYTES} to 32, got {nonce_bytes}")
        if keep_rounds < 1:
            raise ValueError(f"ReplayGuard: keep_rounds must be >= 1, got {keep_rounds}")
        if rng is not None and not isinstance(rng, random.Random | np.random.Generator):
            raise ValueError(
                f"ReplayGuard: rng must be random.Random, numpy.random.Generator or None, got {type(rng).__name__}"
            )
        self.nonce_bytes = nonce_bytes
        self.keep_rounds = keep_rounds
        self._rng = rng
        self._issued: dict[bytes, _Issued] = {}
        self._by_message: dict[Hashable, bytes] = {}
        self._latest_round = -1

    def __len__(self) -> int:
        return len(self._issued)

    def __repr__(self) -> str:
        return f"ReplayGuard(outstanding={len(self._issued)}, keep_rounds={self.keep_rounds})"

    def _draw(self) -> bytes:
        if self._rng is None:
            return os.urandom(self.nonce_bytes)
        if isinstance(self._rng, random.Random):
            return self._rng.randbytes(self.nonce_bytes)
        return self._rng.bytes(self.nonce_bytes)

    def issue(self, message_key: Hashable, node_id: int, round: int) -> bytes:
        """Issue the nonce for one message to one node in one round.

        Parameters
        ----------
        message_key : Hashable
            Identifies the message (e.g. ``(round, node_id, attempt)``); one nonce per message.
        node_id : int
            The destination node.
        round : int
            The server round.

        Returns
        -------
        bytes
            The nonce to put into the message.

        Raises
        ------
        ValueError
            A nonce was already issued for `message_key` and is still remembered.
        """
        node, rnd = _as_int("node_id", node_id), _as_int("round", round)
        if message_key in self._by_message:
            raise ValueError(f"ReplayGuard: message {message_key!r} already has a nonce; one nonce per message")
        if rnd > self._latest_round:
            self._latest_round = rnd
            self._forget_before(rnd - self.keep_rounds + 1)
        nonce = self._draw()
        while nonce in self._issued:  # only possible with a badly seeded rng
            nonce = self._draw()
        self._issued[nonce] = _Issued(message_key=message_key, node_id=node, round=rnd)
        self._by_message[message_key] = nonce
        return nonce

    def _forget_before(self, oldest_round: int) -> None:
        stale = [nonce for nonce, issued in self._issued.items() if issued.round < oldest_round]
        for nonce in stale:
            del self._by_message[self._issued.pop(nonce).message_key]

    def check(self, nonce: Any, node_id: int, round: int) -> str | None:
        """Return why a reply's nonce is not acceptable now, without consuming it; None if it is.

        Returns
        -------
        str or None
            `REASON_WRONG_ROUND_OR_NONCE` (unknown or forgotten nonce, or issued for another node or
            round: a replayed older reply), `REASON_DUPLICATE_REPLY` (already consumed), or None.
        """
        issued = self._issued.get(bytes(nonce)) if isinstance(nonce, bytes | bytearray) else None
        if issued is None or issued.node_id != node_id or issued.round != round:
            return REASON_WRONG_ROUND_OR_NONCE
        if issued.consumed:
            return REASON_DUPLICATE_REPLY
        return None

    def consume(self, nonce: Any, node_id: int, round: int) -> str | None:
        """Accept a reply's nonce once: return None and mark it used, or return why not (see `check`)."""
        reason = self.check(nonce, node_id, round)
        if reason is None:
            self._issued[bytes(nonce)].consumed = True
        return reason


# --------------------------------------------------------------------------------------------------
# Server-side check of one reply
# --------------------------------------------------------------------------------------------------
def verify_reply(
    trust_store: TrustStore,
    replay_guard: ReplayGuard,
    *,
    key_id: str | None,
    signature: Any,
    run_id: int | str,
    round: int,
    node_id: int,
    nonce: Any,
    num_examples: Any,
    arrays: Any,
    require_signature: bool,
) -> str | None:
    """Check one reply's signature, key binding and nonce; consume the nonce when it is accepted.

    Checks run in this order: missing signature, unknown key, key bound to another node, nonce
    (unknown, wrong node or round, already used), signature. The nonce is consumed and an unbound key
    pinned to `node_id` only after the signature verified, so a forged reply cannot burn an honest
    client's nonce or claim its key. An unsigned reply, when signatures are not required, still has its
    nonce checked and consumed (a duplicate delivery is refused either way).

    Parameters
    ----------
    trust_store : TrustStore
        Trusted keys.
    replay_guard : ReplayGuard
        The nonces this server issued.
    key_id : str or None
        The key id the reply claims.
    signature : bytes or None
        The reply's signature; None or empty means unsigned, any other non-bytes value is a bad signature.
    run_id, round, node_id
        Set by the server (its run, the round it is collecting, the node the reply came from);
        a malformed value is a server bug and raises `ValueError`.
    nonce, num_examples, arrays
        Taken from the reply. Malformed client content never raises: a bad nonce is
        ``wrong_round_or_nonce``, bad num-examples or arrays are ``bad_signature`` (no honest client
        can sign them).
    require_signature : bool
        Refuse unsigned replies.

    Returns
    -------
    str or None
        None if the reply is accepted, otherwise one of `REASONS`.
    """
    # The server's own fields: a bad value here is a bug in the caller, not a bad reply.
    _check_run_id(run_id)
    _as_int("round", round)
    _as_int("node_id", node_id)
    if signature is None or (isinstance(signature, bytes | bytearray) and not signature):
        if require_signature:
            return REASON_MISSING_SIGNATURE
        # Signatures optional: an unsigned reply is taken as it would be with no trust store. A node without
        # a key sends no signature record and so no nonce (keys rolled out to some devices only).
        return None if nonce is None else replay_guard.consume(nonce, node_id, round)
    if not isinstance(key_id, str) or (public_key := trust_store.lookup(key_id)) is None:
        return REASON_UNKNOWN_KEY
    reason = trust_store.check_binding(key_id, node_id) or replay_guard.check(nonce, node_id, round)
    if reason is not None:
        return reason
    try:
        valid = verify_update(
            public_key, signature, run_id=run_id, round=round, node_id=node_id,
            nonce=cast(bytes, nonce),  # the replay guard accepted it, so it is bytes
            num_examples=num_examples, arrays=arrays,
        )
    except ValueError as err:
        log.debug("reply from node %s round %s: unsignable content (%s)", node_id, round, err)
        valid = False
    if not valid:
        return REASON_BAD_SIGNATURE
    trust_store.pin(key_id, node_id)
    return replay_guard.consume(nonce, node_id, round)
