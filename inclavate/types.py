"""Identifiers and small value types shared by every package.

Separate id types keep a peer id from being passed where a session id is expected;
they cost nothing at run time (``NewType``) but mypy and the reader both see them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType

PeerId = NewType("PeerId", str)
"""A libp2p peer id in its base58 text form (``12D3KooW...``)."""

NodeId = NewType("NodeId", str)
"""A registry node id: the peer id for libp2p peers, a client-chosen id for legacy nodes."""

SessionId = NewType("SessionId", str)
"""A generation session: one conversation's KV cache on every stage of its chain."""

ModelId = NewType("ModelId", str)
"""A catalog model name such as ``smollm2:135m``."""


@dataclass(frozen=True, order=True)
class LayerRange:
    """Transformer layers ``[start, end)``, 0-based with exclusive end, as in the spec."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not (0 <= self.start < self.end):
            raise ValueError(f"invalid layer range {self.start}-{self.end}: need 0 <= start < end")

    @classmethod
    def parse(cls, text: str) -> LayerRange:
        """Parse the spec's ``"A-B"`` form (``"0-8"`` is layers 0..7)."""
        parts = text.strip().split("-")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"layer range must look like A-B (e.g. 0-8), got {text!r}")
        return cls(int(parts[0]), int(parts[1]))

    def __len__(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        return f"{self.start}-{self.end}"

    def contains(self, other: LayerRange) -> bool:
        return self.start <= other.start and other.end <= self.end

    def overlaps(self, other: LayerRange) -> bool:
        return self.start < other.end and other.start < self.end
