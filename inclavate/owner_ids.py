"""Ids that say which peer owns them: a UUID (version 4 layout) with a 32-bit owner tag.

Any peer serves the whole API, but an artifact's bytes (or a job's record) live on the one
peer that created it. Rather than a lookup protocol or a replicated index, the id itself
carries a short tag of its owner, so any peer finds the owner with no network round trip::

    xxxxxxxx-xxxx-4xxx-Vxxx-xxxxxxxxxxxx
    └ tag ─┘                                 32 bits: owner_tag(owner PeerID)
             └──── 90 random bits ────┘      (V: the RFC 4122 variant, 10xx)

The tag is the first 4 bytes of SHA-256 over the owner's PeerID (domain-separated), so it is
the same on every peer and needs no coordination; the registry maps it back to a PeerID by
tagging every known peer (:func:`owner_candidates`). 32 bits make a tag collision between
two peers of one swarm very unlikely (about n^2 / 2^33: 10^-5 for 300 peers); when it
happens the caller asks each candidate. The 90 random bits keep ids unguessable and
collision-free (the store also refuses a duplicate).

The ids are ordinary UUIDs to every client: 36 characters, lowercase hex, hyphens, version
nibble 4. :func:`parse_id` accepts any UUID spelling (8-4-4-4-12 hex, either case) and
normalises it, so a client that upper-cases ids still finds its objects.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import uuid
from collections.abc import Iterable

from inclavate.errors import InclavateError

__all__ = ["MalformedId", "new_id", "owner_candidates", "owner_tag", "parse_id", "tag_of"]

TAG_BYTES = 4
_TAG_DOMAIN = b"inclavate/owner-tag/1:"
_UUID_RE = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


class MalformedId(InclavateError):
    """Text that is not a UUID (a 400 at the API: "malformed ID")."""


def owner_tag(peer_id: str) -> int:
    """The 32-bit tag of a PeerID, as it appears in the ids that peer mints."""
    digest = hashlib.sha256(_TAG_DOMAIN + peer_id.encode()).digest()
    return int.from_bytes(digest[:TAG_BYTES], "big")


def new_id(owner: str) -> str:
    """A fresh id owned by PeerID ``owner``: its tag, 90 random bits, UUID v4 layout."""
    raw = bytearray(owner_tag(owner).to_bytes(TAG_BYTES, "big") + secrets.token_bytes(16 - TAG_BYTES))
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # RFC 4122 variant
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


def tag_of(id_: str) -> int:
    """The owner tag carried by a (canonical) id."""
    return int(id_[:8], 16)


def owner_candidates(id_: str, peers: Iterable[str]) -> list[str]:
    """The peers among ``peers`` whose tag the id carries (usually one; none if unknown)."""
    tag = tag_of(id_)
    return sorted({p for p in peers if owner_tag(p) == tag})
