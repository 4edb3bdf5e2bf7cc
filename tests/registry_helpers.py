"""Building registry tables in unit tests without a network."""

from __future__ import annotations

from typing import Any

from inclavate.types import ModelId, NodeId, PeerId
from p2p.identity import Identity
from p2p.records import NodeRecord, SignedRecord
from p2p.registry import NodeView

MODEL = ModelId("m:1")


def record(identity: Identity, start: int, end: int, **fields: Any) -> NodeRecord:
    base: dict[str, Any] = dict(
        node_id=NodeId(identity.peer_id), peer_id=identity.peer_id, model_id=MODEL,
        start_layer=start, end_layer=end, n_layers=30, d_model=576, state="Ready",
        seq=1, ts_ms=1_000_000,
    )  # fmt: skip
    base.update(fields)
    return NodeRecord(**base)


def signed(identity: Identity, start: int, end: int, **fields: Any) -> SignedRecord:
    return SignedRecord.sign(record(identity, start, end, **fields), identity)


def view(node: str, start: int, end: int, state: str = "Ready", **fields: Any) -> NodeView:
    """A view for pure placement/routing tests: ids are plain strings, nothing is signed."""
    base: dict[str, Any] = dict(
        node_id=NodeId(node), peer_id=PeerId(node), model_id=MODEL, start_layer=start,
        end_layer=end, n_layers=fields.pop("n_layers", 30), d_model=576, state=state,
        seq=1, ts_ms=0,
    )  # fmt: skip
    base.update(fields)
    return NodeView(NodeRecord(**base), state)  # type: ignore[arg-type]
