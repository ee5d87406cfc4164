"""Tests for fedrobust.signing and the fedrobust.keygen command."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedrobust import signing
from fedrobust.signing import (
    REASON_BAD_SIGNATURE,
    REASON_DUPLICATE_REPLY,
    REASON_KEY_BOUND_TO_OTHER_NODE,
    REASON_MISSING_SIGNATURE,
    REASON_UNKNOWN_KEY,
    REASON_WRONG_ROUND_OR_NONCE,
    ReplayGuard,
    TrustStore,
    canonical_digest,
    derive_keypair,
    generate_keypair,
    key_id,
    load_private_key,
    load_public_key,
    sign_update,
    verify_reply,
    verify_update,
    write_private_key,
    write_public_key,
)

RUN_ID = 42
SEED = 7


def _arrays() -> dict[str, np.ndarray]:
    return {
        "fc.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
        "fc.bias": np.array([0.5, -1.0], dtype=np.float32),
    }


class Federation:
    """A server (trust store + replay guard) and simulated clients with derived keys."""

    def __init__(self, num_clients: int = 4) -> None:
        self.store = TrustStore.for_simulation(SEED, range(num_clients))
        self.guard = ReplayGuard(rng=random.Random(0))
        self.keys = {pid: derive_keypair(SEED, pid) for pid in range(num_clients)}

    def send(self, node_id: int, rnd: int, attempt: int = 0) -> bytes:
        return self.guard.issue((rnd, node_id, attempt), node_id, rnd)

    def reply(self, partition: int, node_id: int, rnd: int, nonce: bytes, **overrides: Any) -> dict[str, Any]:
        """An honest, signed reply's fields as verify_reply takes them."""
        private_key, public_key = self.keys[partition]
        fields = {"run_id": RUN_ID, "round": rnd, "node_id": node_id, "nonce": nonce,
                  "num_examples": 100, "arrays": _arrays()}
        fields.update(overrides)
        return {"key_id": key_id(public_key), "signature": sign_update(private_key, **fields), **fields}

    def verify(self, reply: dict[str, Any], require_signature: bool = True, **server_view: Any) -> str | None:
        """What the server decides; `server_view` overrides what it sees (tampering in transit)."""
        return verify_reply(self.store, self.guard, **{**reply, **server_view}, require_signature=require_signature)


@pytest.fixture
def fed() -> Federation:
    return Federation()


# --------------------------------------------------------------------------------------------------
# verify_reply: acceptance and every rejection path
# --------------------------------------------------------------------------------------------------
def test_honest_reply_accepted_and_pins_key(fed: Federation) -> None:
    reply = fed.reply(0, node_id=11, rnd=1, nonce=fed.send(11, 1))
    assert fed.verify(reply) is None
    assert fed.store.bound_node(reply["key_id"]) == 11


def test_bad_signature_random_bytes(fed: Federation) -> None:
    reply = fed.reply(0, node_id=11, rnd=1, nonce=fed.send(11, 1))
    assert fed.verify(reply, signature=os.urandom(64)) == REASON_BAD_SIGNATURE


# Seeded bytes, not os.urandom: the same test ids in every collection (pytest-xdist's workers must agree).
_RANDOM = random.Random(0)


@pytest.mark.parametrize(
    "signature",
    [_RANDOM.randbytes(63), _RANDOM.randbytes(65), "not bytes", 12345, np.zeros(64, np.uint8)],
    ids=["63 bytes", "65 bytes", "str", "int", "ndarray"],
)
def test_malformed_signature_is_bad_signature(fed: Federation, signature: Any) -> None:
    reply = fed.reply(0, node_id=11, rnd=1, nonce=fed.send(11, 1))
    assert fed.verify(reply, signature=signature) == REASON_BAD_SIGNATURE


def test_unknown_key(fed: Federation) -> None:
    stranger_private, stranger_public = generate_keypair()
    nonce = fed.send(11, 1)
    fields = {"run_id": RUN_ID, "round": 1, "node_id": 11, "nonce": nonce, "num_examples": 5, "arrays": _arrays()}
    reply = {"key_id": key_id(stranger_public), "signature": sign_update(stranger_private, **fields), **fields}
    assert fed.verify(reply) == REASON_UNKNOWN_KEY
    assert fed.verify(reply, key_id=None) == REASON_UNKNOWN_KEY


def test_key_bound_to_another_node(fed: Federation) -> None:
    private_key, public_key = generate_keypair()
    fed.store.bind(5, public_key)
    fields = {"run_id": RUN_ID, "round": 1, "node_id": 6, "nonce": fed.send(6, 1), "num_examples": 5,
              "arrays": _arrays()}
    reply = {"key_id": key_id(public_key), "signature": sign_update(private_key, **fields), **fields}
    assert fed.verify(reply) == REASON_KEY_BOUND_TO_OTHER_NODE


def test_unpin_frees_a_first_use_pin_and_leaves_a_configured_binding(fed: Federation) -> None:
    assert fed.verify(fed.reply(0, node_id=11, rnd=1, nonce=fed.send(11, 1))) is None
    fed.store.unpin(key_id(fed.keys[0][1]))
    assert fed.verify(fed.reply(0, node_id=12, rnd=1, nonce=fed.send(12, 1))) is None  # pinned to 12 now
    _, configured = generate_keypair()
    fed.store.bind(5, configured)
    fed.store.unpin(key_id(configured))
    assert fed.store.bound_node(key_id(configured)) == 5


def test_key_pinned_on_first_use_is_refused_to_another_node(fed: Federation) -> None:
    assert fed.verify(fed.reply(0, node_id=11, rnd=1, nonce=fed.send(11, 1))) is None
    # Node 12 holds partition 0's key too (a Byzantine operator running two nodes on one identity).
    assert fed.verify(fed.reply(0, node_id=12, rnd=1, nonce=fed.send(12, 1))) == REASON_KEY_BOUND_TO_OTHER_NODE
    # Once node 11 is gone, its first-use pin can be released and the key used by its new node id.
    assert fed.store.release_node(11) == [key_id(fed.keys[0][1])]
    assert fed.verify(fed.reply(0, node_id=12, rnd=2, nonce=fed.send(12, 2))) is None


def test_wrong_round(fed: Federation) -> None:
    nonce = fed.send(11, 2)
    # A reply that claims round 1 for the round-2 nonce: signed, but for a round the nonce is not for.
    reply = fed.reply(0, node_id=11, rnd=1, nonce=nonce)
    assert fed.verify(reply) == REASON_WRONG_ROUND_OR_NONCE


def test_replayed_reply_from_earlier_round(fed: Federation) -> None:
    old = fed.reply(0, node_id=11, rnd=1, nonce=fed.send(11, 1))
    assert fed.verify(old) is None
    fed.send(11, 2)
    # The captured round-1 reply, delivered again while the server collects round 2.
    assert fed.verify(old, round=2) == REASON_WRONG_ROUND_OR_NONCE
    # Long after, when the guard has forgotten round 1's nonces, it is still refused.
    for rnd in range(3, 10):
        fed.send(11, rnd)
    assert fed.verify(old, round=9) == REASON_WRONG_ROUND_OR_NONCE
    assert fed.verify(old) == REASON_WRONG_ROUND_OR_NONCE


def test_nonce_never_issued_or_for_another_node(fed: Federation) -> None:
    fed.send(11, 1)
    assert fed.verify(fed.reply(0, node_id=11, rnd=1, nonce=os.urandom(16))) == REASON_WRONG_ROUND_OR_NONCE
    other_nodes_nonce = fed.send(12, 1)
    assert fed.verify(fed.reply(0, node_id=11, rnd=1, nonce=other_nodes_nonce)) == REASON_WRONG_ROUND_OR_NONCE


@pytest.mark.parametrize("nonce", [None, "text", b"short", 7])
def test_malformed_nonce_is_wrong_nonce_not_an_exception(fed: Federation, nonce: Any) -> None:
    reply = fed.reply(0, node_id=11, rnd=1, nonce=fed.send(11, 1))
    assert fed.verify(reply, nonce=nonce) == REASON_WRONG_ROUND_OR_NONCE


def test_duplicate_reply(fed: Federation) -> None:
    reply = fed.reply(0, node_id=11, rnd=1, nonce=fed.send(11, 1))
    assert fed.verify(reply) is None
    assert fed.verify(reply) == REASON_DUPLICATE_REPLY


def test_tampered_num_examples(fed: Federation) -> None:
    reply = fed.reply(0, node_id=11, rnd=1, nonce=fed.send(11, 1))
    assert fed.verify(reply, num_examples=10_000) == REASON_BAD_SIGNATURE


@pytest.mark.parametrize("num_examples", [-1, 2.5, "100", None])
def test_malformed_num_examples_is_bad_signature(fed: Federation, num_examples: Any) -> None:
    reply = fed.reply(0, node_id=11, rnd=1, nonce=fed.send(11, 1))
    assert fed.verify(reply, num_examples=num_examples) == REASON_BAD_SIGNATURE


def test_tampered_array_bytes(fed: Federation) -> None:
    reply = fed.reply(0, node_id=11, rnd=1, nonce=fed.send(11, 1))
    tampered = _arrays()
    tampered["fc.weight"].view(np.uint8)[0] ^= 1  # one bit of one float
    assert fed.verify(reply, arrays=tampered) == REASON_BAD_SIGNATURE


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda a: {"fc.w": a["fc.weight"], "fc.bias": a["fc.bias"]}, id="name"),
        pytest.param(lambda a: {**a, "fc.weight": a["fc.weight"].view(np.int32)}, id="dtype-same-bytes"),
        pytest.param(lambda a: {**a, "fc.weight": a["fc.weight"].reshape(3, 2)}, id="shape-same-bytes"),
        pytest.param(lambda a: {**a, "extra": np.zeros(1, np.float32)}, id="added-array"),
        pytest.param(lambda a: {"fc.weight": a["fc.weight"]}, id="dropped-array"),
    ],
)
def test_tampered_array_metadata(fed: Federation, change: Any) -> None:
    reply = fed.reply(0, node_id=11, rnd=1, nonce=fed.send(11, 1))
    assert fed.verify(reply, arrays=change(_arrays())) == REASON_BAD_SIGNATURE


def test_reply_from_another_run(fed: Federation) -> None:
    reply = fed.reply(0, node_id=11, rnd=1, nonce=fed.send(11, 1))
    assert fed.verify(reply, run_id=RUN_ID + 1) == REASON_BAD_SIGNATURE


def test_missing_signature_when_required(fed: Federation) -> None:
    reply = fed.reply(0, node_id=11, rnd=1, nonce=fed.send(11, 1))
    assert fed.verify(reply, signature=None) == REASON_MISSING_SIGNATURE
    assert fed.verify(reply, signature=b"", key_id=None) == REASON_MISSING_SIGNATURE
    # The refused reply did not consume the nonce.
    assert fed.verify(reply) is None


def test_unsigned_reply_accepted_when_not_required_but_still_replay_checked(fed: Federation) -> None:
    reply = fed.reply(0, node_id=11, rnd=1, nonce=fed.send(11, 1))
    unsigned = {**reply, "signature": None, "key_id": None}
    assert fed.verify(unsigned, require_signature=False) is None
    assert fed.verify(unsigned, require_signature=False) == REASON_DUPLICATE_REPLY
    # A signature that is present is checked even when not required.
    other = fed.reply(1, node_id=12, rnd=1, nonce=fed.send(12, 1))
    assert fed.verify(other, require_signature=False, signature=os.urandom(64)) == REASON_BAD_SIGNATURE


def test_forged_reply_does_not_consume_honest_nonce_or_pin_key(fed: Federation) -> None:
    nonce = fed.send(11, 1)
    honest = fed.reply(0, node_id=11, rnd=1, nonce=nonce)
    forged_arrays = {name: value * 100 for name, value in _arrays().items()}
    assert fed.verify(honest, arrays=forged_arrays) == REASON_BAD_SIGNATURE
    assert fed.verify(honest, signature=os.urandom(64)) == REASON_BAD_SIGNATURE
    # A forger on another node claiming partition 0's key must not pin that key to itself.
    fed.send(99, 1)
    assert fed.verify(honest, node_id=99) in (REASON_BAD_SIGNATURE, REASON_WRONG_ROUND_OR_NONCE)
    assert fed.store.bound_node(honest["key_id"]) is None
    assert fed.verify(honest) is None


def test_check_order(fed: Federation) -> None:
    stranger = generate_keypair()[1]
    bound_private, bound_public = generate_keypair()
    fed.store.bind(5, bound_public)
    reply = fed.reply(0, node_id=11, rnd=1, nonce=fed.send(11, 1))
    wrong_nonce = os.urandom(16)
    # Each check wins over the ones after it.
    assert fed.verify(reply, signature=None, key_id=key_id(stranger), nonce=wrong_nonce) == REASON_MISSING_SIGNATURE
    assert fed.verify(reply, key_id=key_id(stranger), nonce=wrong_nonce) == REASON_UNKNOWN_KEY
    assert fed.verify(reply, key_id=key_id(bound_public), nonce=wrong_nonce) == REASON_KEY_BOUND_TO_OTHER_NODE
    assert fed.verify(reply, nonce=wrong_nonce, signature=os.urandom(64)) == REASON_WRONG_ROUND_OR_NONCE
    assert fed.verify(reply, signature=os.urandom(64)) == REASON_BAD_SIGNATURE
    assert fed.verify(reply) is None


@pytest.mark.parametrize("field,value", [("round", -1), ("node_id", "11"), ("run_id", 1.5), ("round", True)])
def test_malformed_server_fields_raise(fed: Federation, field: str, value: Any) -> None:
    reply = fed.reply(0, node_id=11, rnd=1, nonce=fed.send(11, 1))
    with pytest.raises(ValueError, match=field):
        fed.verify(reply, **{field: value})


def test_reasons_are_exported_and_distinct() -> None:
    assert set(signing.REASONS) == {
        "missing_signature", "unknown_key", "key_bound_to_other_node", "bad_signature",
        "wrong_round_or_nonce", "duplicate_reply",
    }
    assert set(signing.REASON_DETAILS) == set(signing.REASONS)  # each explained in a rejection's detail


_DTYPES = ["float32", "float64", "float16", "bfloat16", "int64", "int8", "uint8", "bool"]


@st.composite
def _update(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(st.text(min_size=1, max_size=8), min_size=0, max_size=4, unique=True))
    arrays: dict[str, Any] = {}
    for name in names:
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
        dtype = draw(st.sampled_from(_DTYPES))
        values = torch.randn(shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**31))))
        tensor = values.to(getattr(torch, dtype))
        use_numpy = dtype != "bfloat16" and draw(st.booleans())
        arrays[name] = tensor.numpy() if use_numpy else tensor
    return {
        "run_id": draw(st.one_of(st.integers(0, 2**64 - 1), st.text(max_size=10))),
        "round": draw(st.integers(0, 2**64 - 1)),
        "node_id": draw(st.integers(0, 2**64 - 1)),
        "num_examples": draw(st.integers(0, 2**64 - 1)),
        "partition": draw(st.integers(0, 3)),
        "arrays": arrays,
    }


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(update=_update())
def test_no_false_rejections(update: dict[str, Any]) -> None:
    fed = Federation()
    partition = update.pop("partition")
    rnd, node = update.pop("round"), update.pop("node_id")
    nonce = fed.send(node, rnd)
    reply = fed.reply(partition, node_id=node, rnd=rnd, nonce=nonce, **update)
    assert fed.verify(reply) is None
    # The server may see numpy where the client signed torch (Flower's ArrayRecord), and vice versa.
    fed2 = Federation()
    nonce2 = fed2.send(node, rnd)
    reply2 = fed2.reply(partition, node_id=node, rnd=rnd, nonce=nonce2, **update)
    as_numpy = {name: (value.numpy() if isinstance(value, torch.Tensor) and value.dtype != torch.bfloat16
                       else value) for name, value in update["arrays"].items()}
    assert fed2.verify(reply2, arrays=as_numpy) is None


# --------------------------------------------------------------------------------------------------
# verify_update and the canonical digest
# --------------------------------------------------------------------------------------------------
_FIELDS: dict[str, Any] = {"run_id": 1, "round": 3, "node_id": 1234567890123, "nonce": bytes(range(16)),
                           "num_examples": 32}
_GOLDEN_ARRAYS = {"w": np.arange(4, dtype=np.float32).reshape(2, 2), "b": np.array([1, 2], dtype=np.int64)}
# Pins format version 1: if this changes, every deployed signer and verifier disagree.
_GOLDEN_DIGEST = (
    "744489cfa387fb22e63792e494d82e9e3749e7df310f96300ed443f2937071fd"
    "80cd2ed4209388726fd62241c81a040dbe0bee744285ab1438282ae9e8c2c609"
)


def test_digest_golden() -> None:
    digest = canonical_digest(**_FIELDS, arrays=_GOLDEN_ARRAYS)
    assert len(digest) == 64
    assert digest.hex() == _GOLDEN_DIGEST


def test_message_layout_matches_the_documented_layout() -> None:
    import hashlib
    import struct

    def lp(data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + data

    w, b = _GOLDEN_ARRAYS["w"], _GOLDEN_ARRAYS["b"]
    expected = (
        lp(b"fedrobust-update") + struct.pack(">I", 1) + lp(b"1") + struct.pack(">QQ", 3, 1234567890123)
        + lp(bytes(range(16))) + struct.pack(">QI", 32, 2)
        + lp(b"b") + lp(b"int64") + struct.pack(">IQ", 1, 2) + hashlib.sha256(b.astype("<i8").tobytes()).digest()
        + lp(b"w") + lp(b"float32") + struct.pack(">IQQ", 2, 2, 2) + hashlib.sha256(w.astype("<f4").tobytes()).digest()
    )
    message = signing.canonical_message(**_FIELDS, arrays=_GOLDEN_ARRAYS)
    assert message == expected
    assert canonical_digest(**_FIELDS, arrays=_GOLDEN_ARRAYS) == hashlib.sha512(expected).digest()


@pytest.mark.parametrize(
    "change",
    [
        {"run_id": 2}, {"run_id": "1x"}, {"round": 4}, {"node_id": 1234567890124}, {"nonce": bytes(range(1, 17))},
        {"nonce": bytes(range(17))}, {"num_examples": 33},
        {"arrays": {**_GOLDEN_ARRAYS, "w": _GOLDEN_ARRAYS["w"] + 1}},
        {"arrays": {**_GOLDEN_ARRAYS, "w": _GOLDEN_ARRAYS["w"].astype(np.float64)}},
        {"arrays": {**_GOLDEN_ARRAYS, "w": _GOLDEN_ARRAYS["w"].reshape(4)}},
        {"arrays": {"W": _GOLDEN_ARRAYS["w"], "b": _GOLDEN_ARRAYS["b"]}},
        {"arrays": {"w": _GOLDEN_ARRAYS["w"]}},
        {"arrays": {}},
    ],
)
def test_digest_changes_with_every_field(change: dict[str, Any]) -> None:
    base = canonical_digest(**_FIELDS, arrays=_GOLDEN_ARRAYS)
    assert canonical_digest(**{**_FIELDS, "arrays": _GOLDEN_ARRAYS, **change}) != base


def test_digest_fields_are_length_prefixed() -> None:
    x = np.zeros(2, np.float32)
    # Same concatenated names, different split: length prefixes keep them apart.
    split_one = canonical_digest(**_FIELDS, arrays={"ab": x, "c": x})
    assert split_one != canonical_digest(**_FIELDS, arrays={"a": x, "bc": x})


def test_digest_independent_of_layout_and_insertion_order() -> None:
    base = canonical_digest(**_FIELDS, arrays=_GOLDEN_ARRAYS)
    reordered = {"b": _GOLDEN_ARRAYS["b"], "w": _GOLDEN_ARRAYS["w"]}
    fortran = {"w": np.asfortranarray(_GOLDEN_ARRAYS["w"]), "b": _GOLDEN_ARRAYS["b"].astype(">i8")}
    strided = {"w": np.arange(8, dtype=np.float32)[::2].reshape(2, 2) / 2, "b": _GOLDEN_ARRAYS["b"]}
    torch_view = {"w": torch.arange(4, dtype=torch.float32).reshape(2, 2).t().contiguous().t(),
                  "b": torch.tensor([1, 2])}
    for arrays in (reordered, fortran, strided, torch_view):
        assert canonical_digest(**_FIELDS, arrays=arrays) == base


def test_bfloat16_is_hashed_from_raw_bytes() -> None:
    values = torch.tensor([1.0, -2.5, 3.0e-3])
    bf16 = canonical_digest(**_FIELDS, arrays={"w": values.to(torch.bfloat16)})
    assert bf16 != canonical_digest(**_FIELDS, arrays={"w": values.to(torch.bfloat16).float()})
    assert bf16 != canonical_digest(**_FIELDS, arrays={"w": values.to(torch.float16)})
    nudged = values.to(torch.bfloat16)
    nudged.view(torch.int16)[0] += 1  # the smallest change bf16 can represent
    assert bf16 != canonical_digest(**_FIELDS, arrays={"w": nudged})
    assert b"bfloat16" in signing.canonical_message(**_FIELDS, arrays={"w": values.to(torch.bfloat16)})


def test_tensor_with_grad_and_conjugate_view() -> None:
    with_grad = torch.ones(3, requires_grad=True)
    assert canonical_digest(**_FIELDS, arrays={"w": with_grad}) == canonical_digest(
        **_FIELDS, arrays={"w": np.ones(3, np.float32)})
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    assert canonical_digest(**_FIELDS, arrays={"z": z.conj()}) == canonical_digest(
        **_FIELDS, arrays={"z": np.conj(z.numpy())})


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"nonce": "0" * 16}, "nonce must be bytes"),
        ({"nonce": b"x" * 15}, "nonce must be 16 to 64 bytes"),
        ({"round": -1}, "round"),
        ({"node_id": 2**64}, "node_id"),
        ({"num_examples": 1.0}, "num_examples"),
        ({"run_id": None}, "run_id"),
        ({"arrays": [np.zeros(1)]}, "mapping"),
        ({"arrays": {1: np.zeros(1)}}, "names must be str"),
        ({"arrays": {"w": [1.0, 2.0]}}, "numpy array or torch tensor"),
        ({"arrays": {"w": np.array([object()])}}, "cannot be signed"),
    ],
)
def test_verify_update_raises_on_malformed_input(overrides: dict[str, Any], match: str) -> None:
    private_key, public_key = generate_keypair()
    signature = sign_update(private_key, **_FIELDS, arrays=_GOLDEN_ARRAYS)
    with pytest.raises(ValueError, match=match):
        verify_update(public_key, signature, **{**_FIELDS, "arrays": _GOLDEN_ARRAYS, **overrides})


def test_verify_update_returns_false_never_raises_on_bad_signature() -> None:
    private_key, public_key = generate_keypair()
    signature = sign_update(private_key, **_FIELDS, arrays=_GOLDEN_ARRAYS)
    assert verify_update(public_key, signature, **_FIELDS, arrays=_GOLDEN_ARRAYS)
    for bad in (os.urandom(64), signature[:-1], signature + b"\0", b"", None, "sig", bytes(64)):
        assert verify_update(public_key, bad, **_FIELDS, arrays=_GOLDEN_ARRAYS) is False
    assert verify_update(generate_keypair()[1], signature, **_FIELDS, arrays=_GOLDEN_ARRAYS) is False


# --------------------------------------------------------------------------------------------------
# Keys and key files
# --------------------------------------------------------------------------------------------------
def test_key_id_is_sha256_of_raw_public_key() -> None:
    import hashlib

    public_key = generate_keypair()[1]
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert key_id(public_key) == hashlib.sha256(raw).hexdigest()


def test_derive_keypair_is_deterministic_and_distinct() -> None:
    assert key_id(derive_keypair(1, 0)[1]) == key_id(derive_keypair(1, 0)[1])
    ids = {key_id(derive_keypair(seed, pid)[1]) for seed in (0, 1, -1) for pid in range(5)}
    assert len(ids) == 15
    with pytest.raises(ValueError, match="partition_id"):
        derive_keypair(0, -1)


def _private_material(private_key: Any) -> list[str]:
    """Strings that would reveal a private key if they appeared anywhere."""
    raw = private_key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                    serialization.NoEncryption())
    pem = private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()).decode()
    return [raw.hex(), pem.splitlines()[1], repr(raw)[2:-1]]


def test_private_key_file_mode_round_trip_and_overwrite(tmp_path: Path) -> None:
    private_key, public_key = generate_keypair()
    old_umask = os.umask(0)  # even with a permissive umask the file is created 0600
    try:
        path = write_private_key(tmp_path / "k.key", private_key)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS8
    assert key_id(load_private_key(path).public_key()) == key_id(public_key)

    pub = write_public_key(tmp_path / "k.pub", public_key)
    assert pub.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")  # SubjectPublicKeyInfo
    assert key_id(load_public_key(pub)) == key_id(public_key)

    other_private, other_public = generate_keypair()
    with pytest.raises(FileExistsError):
        write_private_key(path, other_private)
    with pytest.raises(FileExistsError):
        write_public_key(pub, other_public)
    assert key_id(load_private_key(path).public_key()) == key_id(public_key)  # untouched

    path.chmod(0o644)
    write_private_key(path, other_private, overwrite=True)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert key_id(load_private_key(path).public_key()) == key_id(other_public)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left


def test_load_private_key_warns_on_lax_mode(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write_private_key(tmp_path / "k.key", generate_keypair()[0])
    with caplog.at_level(logging.WARNING, logger="fedrobust.signing"):
        load_private_key(path)
    assert not caplog.records
    path.chmod(0o640)
    with caplog.at_level(logging.WARNING, logger="fedrobust.signing"):
        load_private_key(path)
    assert any("readable by group or others" in record.getMessage() for record in caplog.records)


def test_no_private_material_in_logs_repr_or_errors(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fed = Federation()
    private_key = fed.keys[0][0]
    secrets = _private_material(private_key)
    with caplog.at_level(logging.DEBUG):
        path = write_private_key(tmp_path / "k.key", private_key)
        path.chmod(0o644)
        loaded = load_private_key(path)
        reply = fed.reply(0, node_id=11, rnd=1, nonce=fed.send(11, 1))
        assert fed.verify(reply) is None
        fed.store.save(tmp_path / "trust")
        TrustStore.load(tmp_path / "trust")
    shown = [caplog.text, repr(loaded), str(loaded), repr(fed.store), str(fed.store), repr(fed.guard)]
    # A file that is a valid PEM private key of the wrong type: the error names the file, not the bytes.
    wrong = tmp_path / "x25519.key"
    wrong_key = X25519PrivateKey.generate()
    wrong.write_bytes(wrong_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()))
    with pytest.raises(ValueError) as excinfo:
        load_private_key(wrong)
    corrupt = tmp_path / "corrupt.key"
    corrupt.write_bytes(path.read_bytes()[:-30])
    with pytest.raises(ValueError) as excinfo2:
        load_private_key(corrupt)
    assert excinfo2.value.__cause__ is None and excinfo2.value.__suppress_context__
    shown += [str(excinfo.value), str(excinfo2.value), repr(excinfo2.value)]
    wrong_secrets = _private_material_x25519(wrong_key)
    for text in shown:
        for secret in [*secrets, *wrong_secrets]:
            assert secret not in text
    assert "wrote private key" in caplog.text  # the logging itself happened


def _private_material_x25519(private_key: X25519PrivateKey) -> list[str]:
    raw = private_key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                    serialization.NoEncryption())
    pem = private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()).decode()
    return [raw.hex(), pem.splitlines()[1]]


# --------------------------------------------------------------------------------------------------
# TrustStore and ReplayGuard
# --------------------------------------------------------------------------------------------------
def test_trust_store_save_load_round_trip(tmp_path: Path) -> None:
    store = TrustStore()
    keys = [generate_keypair()[1] for _ in range(3)]
    store.add(keys[0], partition_id=0)
    store.bind(77, keys[1])
    store.add(keys[2], partition_id=2, node_id=78)
    store.save(tmp_path)
    loaded = TrustStore.load(tmp_path)
    assert len(loaded) == 3
    for key in keys:
        assert key_id(loaded.lookup(key_id(key))) == key_id(key)
    assert loaded.partition_id(key_id(keys[0])) == 0 and loaded.bound_node(key_id(keys[0])) is None
    assert loaded.bound_node(key_id(keys[1])) == 77
    assert (loaded.partition_id(key_id(keys[2])), loaded.bound_node(key_id(keys[2]))) == (2, 78)
    assert loaded.lookup("0" * 64) is None and loaded.lookup(None) is None  # type: ignore[arg-type]


def _trust_dir(tmp_path: Path, entries: list[dict[str, Any]]) -> Path:
    write_public_key(tmp_path / "a.pub", generate_keypair()[1])
    (tmp_path / signing.TRUST_FILE).write_text(
        json.dumps({"format": "fedrobust-trust-store", "version": 1, "keys": entries}))
    return tmp_path


@pytest.mark.parametrize(
    "entries,match",
    [
        ([{"file": "a.pub", "key_id": "ab" * 32}], "has key id"),
        ([{"file": "../a.pub"}], "inside"),
        ([{"file": "/etc/passwd"}], "inside"),
        ([{"partition_id": 0}], "file"),
        ([{"file": "a.pub", "node_id": 1}, {"file": "a.pub", "node_id": 2}], "already bound"),
        ([{"file": "a.pub", "partition_id": -3}], "partition_id"),
    ],
)
def test_trust_store_load_rejects_bad_binding_files(tmp_path: Path, entries: list[dict[str, Any]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TrustStore.load(_trust_dir(tmp_path, entries))


def test_trust_store_load_needs_binding_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="trust.json"):
        TrustStore.load(tmp_path)
    (tmp_path / "trust.json").write_text('{"format": "something-else"}')
    with pytest.raises(ValueError, match="format"):
        TrustStore.load(tmp_path)


def test_trust_store_pins_survive_a_checkpoint(fed: Federation) -> None:
    assert fed.verify(fed.reply(2, node_id=21, rnd=1, nonce=fed.send(21, 1))) is None
    state = json.loads(json.dumps(fed.store.state_dict()))
    resumed = TrustStore.for_simulation(SEED, range(4))
    resumed.load_state_dict(state)
    kid = key_id(fed.keys[2][1])
    assert resumed.bound_node(kid) == 21
    assert resumed.check_binding(kid, 22) == REASON_KEY_BOUND_TO_OTHER_NODE


def test_replay_guard_seeded_is_deterministic_and_memory_bounded() -> None:
    first = ReplayGuard(rng=np.random.default_rng(3), nonce_bytes=24, keep_rounds=2)
    second = ReplayGuard(rng=np.random.default_rng(3), nonce_bytes=24, keep_rounds=2)
    for rnd in range(50):
        for node in range(10):
            nonce = first.issue((rnd, node), node, rnd)
            assert nonce == second.issue((rnd, node), node, rnd) and len(nonce) == 24
        assert len(first) <= 2 * 10
    assert ReplayGuard().issue("m", 1, 1) != ReplayGuard().issue("m", 1, 1)  # os.urandom by default


def test_replay_guard_one_nonce_per_message_and_validation() -> None:
    guard = ReplayGuard()
    guard.issue(("r1", 5), 5, 1)
    with pytest.raises(ValueError, match="one nonce per message"):
        guard.issue(("r1", 5), 5, 1)
    with pytest.raises(ValueError, match="nonce_bytes"):
        ReplayGuard(nonce_bytes=8)
    with pytest.raises(ValueError, match="keep_rounds"):
        ReplayGuard(keep_rounds=0)
    with pytest.raises(ValueError, match="rng"):
        ReplayGuard(rng=torch.Generator())  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# python -m fedrobust.keygen
# --------------------------------------------------------------------------------------------------
def _keygen(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fedrobust.keygen", *args], capture_output=True, text=True,
                          timeout=60, check=False)


def test_keygen_cli_writes_keys_and_trust_store(tmp_path: Path) -> None:
    out = tmp_path / "keys"
    result = _keygen("--out", str(out), "--clients", "3")
    assert result.returncode == 0, result.stderr
    names = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert names == sorted([*(f"client-{i}.{ext}" for i in range(3) for ext in ("key", "pub")),
                            *(f"trust/client-{i}.pub" for i in range(3)), "trust/trust.json"])
    store = TrustStore.load(out / "trust")
    for index in range(3):
        private_key = load_private_key(out / f"client-{index}.key")
        assert stat.S_IMODE((out / f"client-{index}.key").stat().st_mode) == 0o600
        kid = key_id(private_key.public_key())
        assert store.lookup(kid) is not None and store.partition_id(kid) == index
        assert kid in result.stdout
        for secret in _private_material(private_key):
            assert secret not in result.stdout + result.stderr

    before = (out / "client-0.key").read_bytes()
    again = _keygen("--out", str(out), "--clients", "3")
    assert again.returncode == 1 and "--force" in again.stderr
    assert (out / "client-0.key").read_bytes() == before
    forced = _keygen("--out", str(out), "--clients", "3", "--force")
    assert forced.returncode == 0, forced.stderr
    assert (out / "client-0.key").read_bytes() != before
    assert stat.S_IMODE((out / "client-0.key").stat().st_mode) == 0o600
    fewer = _keygen("--out", str(out), "--clients", "1", "--force")  # the earlier clients 1, 2: not trusted now
    assert fewer.returncode == 0 and "removed the keys of client(s) 1, 2 of the earlier set" in fewer.stdout, fewer
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "client-0.key", "client-0.pub", "trust/client-0.pub", "trust/trust.json"]
    both = _keygen("--out", str(out), "--clients", "6", "--replace", "1")
    assert both.returncode == 2 and "--clients and --replace cannot be combined" in both.stderr


def test_keygen_adds_a_device_and_replaces_a_leaked_key_keeping_the_others(tmp_path: Path) -> None:
    from fedrobust import keygen

    out = tmp_path / "keys"
    assert keygen.main(["--out", str(out), "--clients", "2"]) == 0
    kept = (out / "client-0.key").read_bytes()
    leaked = key_id(load_private_key(out / "client-1.key").public_key())

    assert keygen.main(["--out", str(out), "--clients", "4", "--add"]) == 0  # devices 2 and 3 join
    assert keygen.main(["--out", str(out), "--replace", "1"]) == 0  # device 1's key leaked
    store = TrustStore.load(out / "trust")
    assert sorted(store.partitions()) == [0, 1, 2, 3] and len(store) == 4
    assert (out / "client-0.key").read_bytes() == kept
    assert store.lookup(leaked) is None
    for index in range(4):
        kid = key_id(load_private_key(out / f"client-{index}.key").public_key())
        assert store.partition_id(kid) == index
    assert keygen.main(["--out", str(out), "--clients", "4", "--add"]) == 0  # nothing missing: nothing written
    assert TrustStore.load(out / "trust").partitions() == {0, 1, 2, 3}
    # The keygen output folder itself is not the trust store: the error points to its trust/ folder.
    with pytest.raises(ValueError, match=rf"no trust.json binding file \(python -m fedrobust.keygen wrote one to "
                                         rf"{re.escape(str(out / 'trust'))}: pass that\)"):
        TrustStore.load(out)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--clients", "2", "--add"], "holds no trust store ("),
        (["--replace", "1"], "make the keys first, without --add or --replace"),
        (["--replace", "7"], "trusts no key of client(s) [7]: add them with --clients N --add"),
        (["--replace", "-1"], "--replace takes client ids >= 0, got [-1]"),
    ],
)
def test_keygen_add_and_replace_refuse_what_does_not_fit(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedrobust import keygen

    out = tmp_path / "keys"
    if "--replace" in args and args[-1] != "1":
        assert keygen.main(["--out", str(out), "--clients", "2"]) == 0
    assert keygen.main(["--out", str(out), *args]) == 1
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "args",
    [
        ["--clients", "2"],
        ["--out", "x", "--clients", "0"],
        ["--out", "x", "--clients", "two"],
        ["--out", "x"],
        ["--out", "x", "--clients", "2", "--replace", "1"],
        ["--out", "x", "--clients", "2", "--add", "--force"],
    ],
)
def test_keygen_cli_usage_errors(args: list[str]) -> None:
    from fedrobust import keygen

    with pytest.raises(SystemExit) as excinfo:
        keygen.main(args)
    assert excinfo.value.code == 2


def test_seed_derived_keys_are_flagged_on_the_deployment_engine_only() -> None:
    """signing.require without a trust store checks keys anyone can derive from the run's seed: fine in a
    simulation, a false guarantee on Flower's Deployment Engine (its HttpGrid), where the ServerApp refuses it."""
    from flwr.superlink.grid import HttpGrid, InMemoryGrid

    from fedrobust.config import from_flat
    from fedrobust.strategies.server_app import seed_keys_on_a_deployment

    deployment, simulation = HttpGrid.__new__(HttpGrid), InMemoryGrid.__new__(InMemoryGrid)  # no connection needed
    required = from_flat({"signing.require": True})
    with_store = from_flat({"signing.require": True, "signing.trust_dir": "/srv/keys/trust"})
    assert seed_keys_on_a_deployment(deployment, required)
    assert not seed_keys_on_a_deployment(simulation, required)
    assert not seed_keys_on_a_deployment(deployment, with_store)
    assert not seed_keys_on_a_deployment(deployment, from_flat({}))


def test_fedrobusts_app_refuses_seed_derived_keys_on_a_deployment_before_any_round(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The devices sign with keygen keys: every reply would be unknown_key, round after round, and the seed's
    keys prove nothing anyway. Refused as a configuration problem, in one line, before the grid is used."""
    from flwr.app import Context, RecordDict
    from flwr.superlink.grid import HttpGrid

    from fedrobust.config import ConfigError, RunConfig
    from fedrobust.strategies.server_app import make_server_app

    grid = HttpGrid.__new__(HttpGrid)  # no connection: nothing may be sent
    run_config = {**RunConfig().to_flat(), "signing.require": True}
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    with caplog.at_level("ERROR"), pytest.raises(ConfigError) as refused:
        make_server_app()(grid, context)
    assert refused.value.problems == [
        "signing.require=true: on a deployment it needs signing.trust_dir, the trust store of python -m "
        "fedrobust.keygen (docs/deployment.md, sections 2 and 7); without it replies would be checked against keys "
        "derived from the run's seed, which anyone who knows the run config can derive"]
    assert "fedrobust: invalid configuration:" in caplog.text


def test_a_node_s_unreadable_signing_key_names_the_node_config_entry(tmp_path: Path) -> None:
    """The ClientApp's error reaches the server's log as a client error: it must say which setting to fix."""
    from flwr.app import Context, RecordDict

    from fedrobust.clients.signing_mod import node_config_key

    def context(path: str) -> Context:
        return Context(run_id=1, node_id=2, node_config={"signing-key": path}, state=RecordDict(), run_config={})

    with pytest.raises(ValueError, match=r"^node config signing-key='.*nonexistent.key': .*No such file"):
        node_config_key(context(str(tmp_path / "nonexistent.key")))
    (tmp_path / "bad.key").write_text("not a key")
    (tmp_path / "bad.key").chmod(0o600)
    with pytest.raises(ValueError, match=r"^node config signing-key='.*bad.key': .*not an unencrypted PEM"):
        node_config_key(context(str(tmp_path / "bad.key")))
