"""Ids that say which peer owns them: a UUID (version 4 layout) with a 60-bit owner tag.

Any peer serves the whole API, but an artifact's bytes (or a job's record) live on the one
peer that created it. Rather than a lookup protocol or a replicated index, the id itself
carries a tag of its owner, so any peer finds the owner with no network round trip::

    tttttttt-tttt-4ttt-Vrrr-rrrrrrrrrrrr
    t: 60 bits, the owner's tag (bytes 0-5, the low nibble of byte 6, byte 7)
    r: 62 random bits (V: the RFC 4122 variant, 10rr; 4: the version nibble)

The tag is the first 60 bits of ``sha256("inclavate/owner-tag/1:" + PeerID)``, so it is the
same on every peer and needs no coordination; a peer maps it back to a PeerID by tagging
every peer it knows (:class:`Owners`). Its first 32 bits are the whole tag of ids minted
before it was widened (a "legacy" id: 32-bit tag, 90 random bits), so a peer that only
reads 32 bits still finds the owner of a new id.

Why 60 bits: PeerIDs cost nothing, so a stranger can grind keys until one's tag equals an
honest peer's, and become a candidate owner of every id that peer mints (asked for its
bytes, its deletes, its job records; trusted for its listing rows). With N honest peers,
32 bits took about 2^32 / N key generations (minutes on one machine); 60 bits take about
2^60 / N (centuries). An id whose 60-bit tag matches a known peer names that peer alone;
only an id whose 60 bits match no known peer falls back to its first 32 bits, which is
what a legacy id (still in peers' SQLite tables) needs, and what a grinder can still use
against those ids, or against a new id whose owner this peer does not know.

The 62 random bits keep ids unguessable and collision-free (the store also refuses a
duplicate). The ids are ordinary UUIDs to every client: 36 characters, lowercase hex,
hyphens, version nibble 4. :func:`parse_id` accepts any UUID spelling (8-4-4-4-12 hex,
either case) and normalises it, so a client that upper-cases ids still finds its objects.

Callers do not read the layout: :func:`owner_candidates` (whom to ask about an id) and
:meth:`Owners.carries_owner` (may this peer list this id) are the two questions.
(``tests/test_owner_ids.py``; the grinding, stood in for: ``tests/owner_grinding.py``.)
"""

from __future__ import annotations

import hashlib
import re
import secrets
import uuid
from collections.abc import Iterable

from inclavate.errors import InclavateError

__all__ = ["MalformedId", "Owners", "carries_owner", "new_id", "owner_candidates", "parse_id"]

TAG_BITS = 60
LEGACY_TAG_BITS = 32
_TAG_DOMAIN = b"inclavate/owner-tag/1:"
_UUID_RE = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


class MalformedId(InclavateError):
    """Text that is not a UUID (a 400 at the API: "malformed ID")."""


def _owner_tag(peer_id: str) -> int:
    """The 60-bit tag of a PeerID: the first 60 bits of its domain-separated SHA-256."""
    digest = hashlib.sha256(_TAG_DOMAIN + peer_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") >> (64 - TAG_BITS)


def _legacy(tag: int) -> int:
    """A 60-bit tag's first 32 bits: the whole tag of an id minted before the widening."""
    return tag >> (TAG_BITS - LEGACY_TAG_BITS)


def _tag_of(id_: str) -> int:
    """The 60-bit tag field of a canonical id: hex digits 0-7, 9-12 and 15-17 (digit 14 is
    the version nibble). In a legacy id only its first 32 bits are a tag."""
    return int(id_[0:8] + id_[9:13] + id_[15:18], 16)


def _prefix(tag: int) -> str:
    """How the ids carrying ``tag`` begin (canonical, version 4): their first 18 characters."""
    digits = f"{tag:015x}"
    return f"{digits[:8]}-{digits[8:12]}-4{digits[12:]}"


def new_id(owner: str) -> str:
    """A fresh id owned by PeerID ``owner``: its 60-bit tag, 62 random bits, UUID v4 layout."""
    tag = _owner_tag(owner)
    raw = bytearray((tag >> 12).to_bytes(6, "big") + secrets.token_bytes(10))
    raw[6] = 0x40 | ((tag >> 8) & 0x0F)  # version 4, then the tag's next 4 bits
    raw[7] = tag & 0xFF
    raw[8] = (raw[8] & 0x3F) | 0x80  # RFC 4122 variant, then 6 random bits
    return str(uuid.UUID(bytes=bytes(raw)))


def parse_id(text: str) -> str:
    """The canonical (lowercase, hyphenated) form of a UUID, or :class:`MalformedId`.

    Checked with a regex before anything else so a hostile path segment (huge, non-ASCII,
    ``../``) is refused without being interpreted.
    """
    if not isinstance(text, str) or len(text) != 36 or not _UUID_RE.fullmatch(text):
        shown = text[:40] + "..." if isinstance(text, str) and len(text) > 40 else text
        raise MalformedId(f"malformed id {shown!r}: expected a UUID like 1deaf021-07a3-407c-9d6f-1af47c23db18")
    return text.lower()


class Owners:
    """The tags of the peers this peer knows (its registry), each hashed once: who owns an
    id, and whether a peer may speak for one. Holds one entry per peer given, no more."""

    def __init__(self, peers: Iterable[str]) -> None:
        self._tag: dict[str, int] = {}
        self._by_tag: dict[int, list[str]] = {}
        self._by_legacy: dict[int, list[str]] = {}
        for peer in sorted(set(peers)):
            tag = self._tag[peer] = _owner_tag(peer)
            self._by_tag.setdefault(tag, []).append(peer)
            self._by_legacy.setdefault(_legacy(tag), []).append(peer)
        self._prefix = {peer: (_prefix(tag), _prefix(tag)[:8], len(self._by_legacy[_legacy(tag)]) == 1)
                        for peer, tag in self._tag.items()}  # fmt: skip
        """Per peer: how its ids begin, how its legacy ids begin, and whether it is the only
        known peer with those 32 bits. String compares: parsing every listed id's tag took
        as long as the rest of decoding a listing's keys (``scripts/bench_owner_tags.py``)."""

    def prefix(self, peer: str) -> str | None:
        """How every id ``peer`` mints begins (canonical; None for a peer not given): an id
        that begins so is ``peer``'s (:meth:`carries_owner`'s first test), so a listing checks
        a whole answer of such ids at once (``p2p.artifact_wire.decode_keys``)."""
        known = self._prefix.get(peer)
        return None if known is None else known[0]

    def candidates(self, id_: str) -> list[str]:
        """The known peers that may own canonical ``id_``, sorted: those carrying its whole
        tag; only when none does, those carrying its first 32 bits (a legacy id's tag)."""
        tag = _tag_of(id_)
        exact = self._by_tag.get(tag)
        return list(exact) if exact else list(self._by_legacy.get(_legacy(tag), ()))

    def carries_owner(self, id_: str, peer: str) -> bool:
        """Whether ``peer`` may list canonical ``id_`` as its own: the id carries its whole
        tag, or it is a legacy id (its 60-bit field names no known peer) carrying its 32."""
        known = self._prefix.get(peer)
        if known is not None:
            prefix, legacy_prefix, alone = known
            if id_.startswith(prefix):
                return True
            if not id_.startswith(legacy_prefix):
                return False
            if alone:  # no other known peer's whole tag can be in the id: its own, or legacy
                return True
        mine = self._tag[peer] if known is not None else _owner_tag(peer)
        tag = _tag_of(id_)
        return tag == mine or (tag not in self._by_tag and _legacy(tag) == _legacy(mine))


def owner_candidates(id_: str, peers: Iterable[str]) -> list[str]:
    """The peers among ``peers`` that may own canonical ``id_`` (usually one; none if unknown):
    :meth:`Owners.candidates`."""
    return Owners(peers).candidates(id_)


def carries_owner(id_: str, peer: str, known: Iterable[str] = ()) -> bool:
    """Whether ``peer`` may list canonical ``id_`` as its own, given the peers ``known``
    (:meth:`Owners.carries_owner`; a listing builds :class:`Owners` once instead)."""
    return Owners([peer, *known]).carries_owner(id_, peer)
