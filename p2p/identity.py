"""A peer's long-lived identity: one Ed25519 key that is both its PeerID and its signer.

The same key serves twice. libp2p derives the PeerID from it and Noise proves
possession of it on every connection; the application signs its own records (gossip
announcements, results) with it, so anyone who knows a PeerID can check a record
without fetching a key: for Ed25519 the PeerID *is* the public key, wrapped in an
identity multihash (``12D3KooW...``). :func:`verify` unwraps it with no network access.

The key lives in ``<data_dir>/identity.key`` in libp2p's protobuf private-key format
(the format go-libp2p and rust-libp2p use), readable by its owner only, so a restarted
peer keeps its PeerID and the swarm's view of it.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import base58
from libp2p.crypto.ed25519 import Ed25519PrivateKey, create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.serialization import deserialize_private_key
from libp2p.peer.id import ID
from nacl.exceptions import CryptoError
from nacl.signing import VerifyKey

from inclavate.durable import replace_durably
from inclavate.types import PeerId
from p2p.errors import IdentityError

logger = logging.getLogger(__name__)

KEY_FILE_NAME = "identity.key"

# An Ed25519 PeerID is the identity multihash of the protobuf-encoded public key:
#   0x00 (identity hash) 0x24 (36 bytes follow)
#   0x08 0x01 (field 1 KeyType = 1, Ed25519)   0x12 0x20 (field 2 Data, 32 bytes)
# libp2p requires this deterministic encoding, so a byte-exact prefix check is the
# whole parser; anything else (RSA ids are sha256 multihashes) is not ours to verify.
_ED25519_PEER_ID_PREFIX = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])
_ED25519_PUBLIC_KEY_LEN = 32
_ED25519_SIGNATURE_LEN = 64


@dataclass(frozen=True)
class Identity:
    """A peer's key pair and the PeerID derived from it."""

    key_pair: KeyPair
    peer_id: PeerId

    @classmethod
    def from_key_pair(cls, key_pair: KeyPair) -> Identity:
        if not isinstance(key_pair.private_key, Ed25519PrivateKey):
            raise IdentityError("only Ed25519 identities are supported")
        peer_id = PeerId(ID.from_pubkey(key_pair.public_key).to_base58())
        return cls(key_pair=key_pair, peer_id=peer_id)

    @classmethod
    def generate(cls) -> Identity:
        """A fresh, unpersisted identity (tests, throw-away clients)."""
        return cls.from_key_pair(create_new_key_pair())

    def sign(self, data: bytes) -> bytes:
        """A detached 64-byte Ed25519 signature that :func:`verify` accepts for our PeerID."""
        return self.key_pair.private_key.sign(data)


def load_or_create_identity(data_dir: Path) -> Identity:
    """Load the peer's key from ``data_dir``, creating (and persisting) one on first run.

    Raises :class:`IdentityError` if a key file exists but cannot be used: replacing it
    would silently give the peer a new PeerID.
    """
    path = Path(data_dir) / KEY_FILE_NAME
    if path.exists():
        return _load(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    identity = Identity.generate()
    _write_private(path, identity.key_pair.private_key.serialize())
    logger.info("created new identity %s in %s", identity.peer_id, path)
    return identity


def _load(path: Path) -> Identity:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        # Like ssh we will not use a key others can read; unlike ssh we repair it,
        # since the data dir is ours and the alternative is a peer that will not start.
        logger.warning("identity key %s had mode %o; restricting it to 0600", path, mode)
        path.chmod(0o600)
    try:
        private_key = deserialize_private_key(path.read_bytes())
    except Exception as exc:  # protobuf and key-type errors vary by libp2p version
        raise IdentityError(f"cannot read identity key {path}: {exc}") from exc
    if not isinstance(private_key, Ed25519PrivateKey):
        raise IdentityError(f"identity key {path} is not an Ed25519 key")
    return Identity.from_key_pair(KeyPair(private_key, private_key.get_public_key()))


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically, never readable by anyone but the owner.

    The file is created 0600 (not chmod-ed afterwards, which would leave a window) in the
    same directory and renamed over, so a crash leaves either no key or a whole one.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        replace_durably(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def public_key_from_peer_id(peer_id: str) -> bytes | None:
    """The raw 32-byte Ed25519 public key inside an Ed25519 PeerID, else ``None``."""
    try:
        raw = base58.b58decode(peer_id)
    except (ValueError, TypeError):
        return None
    if len(raw) != len(_ED25519_PEER_ID_PREFIX) + _ED25519_PUBLIC_KEY_LEN:
        return None
    if not raw.startswith(_ED25519_PEER_ID_PREFIX):
        return None
    return raw[len(_ED25519_PEER_ID_PREFIX) :]


def verify(peer_id: str, data: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is ``peer_id``'s Ed25519 signature of ``data``.

    Never raises: a malformed or non-Ed25519 PeerID, a signature of the wrong length or
    a forged one all give ``False``, so gossip validators can call it on hostile input.
    """
    if not isinstance(data, bytes | bytearray) or not isinstance(signature, bytes | bytearray):
        return False
    if len(signature) != _ED25519_SIGNATURE_LEN:
        return False
    public_key = public_key_from_peer_id(peer_id) if isinstance(peer_id, str) else None
    if public_key is None:
        return False
    try:
        VerifyKey(public_key).verify(bytes(data), bytes(signature))
    except (CryptoError, ValueError, TypeError):
        # Besides bad signatures, PyNaCl rejects some 32-byte strings that are not points.
        return False
    return True
