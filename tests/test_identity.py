"""The persisted Ed25519 identity and verification of records against a bare PeerID."""

from __future__ import annotations

import stat
from pathlib import Path

import base58
import pytest
from libp2p.crypto.rsa import create_new_key_pair as create_rsa_key_pair
from libp2p.peer.id import ID

from p2p.errors import IdentityError
from p2p.identity import (
    KEY_FILE_NAME,
    Identity,
    load_or_create_identity,
    public_key_from_peer_id,
    verify,
)


def test_identity_persists_across_reloads(tmp_path: Path) -> None:
    first = load_or_create_identity(tmp_path / "data")
    second = load_or_create_identity(tmp_path / "data")
    assert first.peer_id == second.peer_id
    assert first.peer_id.startswith("12D3KooW")
    key_file = tmp_path / "data" / KEY_FILE_NAME
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert not [p for p in key_file.parent.iterdir() if p.name != KEY_FILE_NAME]


def test_different_data_dirs_are_different_peers(tmp_path: Path) -> None:
    assert load_or_create_identity(tmp_path / "a").peer_id != load_or_create_identity(
        tmp_path / "b"
    ).peer_id


def test_loose_permissions_are_repaired(tmp_path: Path) -> None:
    identity = load_or_create_identity(tmp_path)
    (tmp_path / KEY_FILE_NAME).chmod(0o644)
    assert load_or_create_identity(tmp_path).peer_id == identity.peer_id
    assert stat.S_IMODE((tmp_path / KEY_FILE_NAME).stat().st_mode) == 0o600


def test_corrupt_key_is_an_error_not_a_new_identity(tmp_path: Path) -> None:
    (tmp_path / KEY_FILE_NAME).write_bytes(b"not a key")
    with pytest.raises(IdentityError):
        load_or_create_identity(tmp_path)
    assert (tmp_path / KEY_FILE_NAME).read_bytes() == b"not a key"


def test_peer_id_matches_libp2p_derivation() -> None:
    identity = Identity.generate()
    assert identity.peer_id == ID.from_pubkey(identity.key_pair.public_key).to_base58()
    assert public_key_from_peer_id(identity.peer_id) == identity.key_pair.public_key.to_bytes()


def test_sign_verify_round_trip() -> None:
    identity = Identity.generate()
    record = b'{"layers": "0-10", "model": "smollm2:135m"}'
    signature = identity.sign(record)
    assert len(signature) == 64
    assert verify(identity.peer_id, record, signature)


def test_verify_rejects_wrong_key_tampered_data_and_garbage() -> None:
    alice, mallory = Identity.generate(), Identity.generate()
    record = b"record"
    signature = alice.sign(record)
    assert not verify(mallory.peer_id, record, signature)
    assert not verify(alice.peer_id, record + b"!", signature)
    assert not verify(alice.peer_id, record, signature[:-1] + bytes([signature[-1] ^ 1]))
    assert not verify(alice.peer_id, record, signature[:63])
    assert not verify(alice.peer_id, record, b"")
    for bad_id in ["", "not-base58-0OIl", "12D3KooW", alice.peer_id[:-1], "Qm" + "1" * 44]:
        assert not verify(bad_id, record, signature)
    assert not verify(None, record, signature)  # type: ignore[arg-type]
    assert not verify(alice.peer_id, "text", signature)  # type: ignore[arg-type]


def test_verify_rejects_non_ed25519_peer_ids() -> None:
    rsa_id = ID.from_pubkey(create_rsa_key_pair().public_key).to_base58()
    assert rsa_id.startswith("Qm")
    assert public_key_from_peer_id(rsa_id) is None
    assert not verify(rsa_id, b"x", b"\x00" * 64)


def test_verify_rejects_an_invalid_curve_point() -> None:
    # A well-formed Ed25519 PeerID whose 32 "key" bytes are not a point on the curve.
    prefix = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])
    bogus = base58.b58encode(prefix + b"\xff" * 32).decode()
    assert public_key_from_peer_id(bogus) is not None
    assert not verify(bogus, b"x", b"\x00" * 64)
