"""A stand-in for an identity ground to another peer's 32-bit owner tag.

Libp2p identities cost nothing: a stranger generating ed25519 keys finds one whose owner tag
starts with an honest peer's 32 bits after about 2^32 / N tries (N honest peers). Tests
cannot spend that, so :func:`ground` makes ``hostile``'s owner digest
(``sha256(domain + PeerID)`` in :mod:`inclavate.owner_ids`) what the grinder would have found:
equal to ``honest``'s on its first 32 bits, different on every bit after them (a ground key
matches further with odds 2^-28, which is what the wider tag relies on).
"""

from __future__ import annotations

import hashlib
import types
from typing import Any

import pytest

import inclavate.owner_ids


class _Digest:
    def __init__(self, value: bytes) -> None:
        self._value = value

    def digest(self) -> bytes:
        return self._value


def ground(monkeypatch: pytest.MonkeyPatch, honest: str, hostile: str) -> None:
    """From now on (until the test ends) ``hostile``'s digest shares ``honest``'s first 4 bytes."""
    real = hashlib.sha256
    suffix = hostile.encode()

    def sha256(data: bytes = b"") -> Any:
        if not data.endswith(b":" + suffix):
            return real(data)
        honest_digest = real(data[: -len(suffix)] + honest.encode()).digest()
        return _Digest(honest_digest[:4] + bytes(b ^ 0xFF for b in honest_digest[4:]))

    monkeypatch.setattr(inclavate.owner_ids, "hashlib", types.SimpleNamespace(sha256=sha256))
