"""Node records: what every peer publishes about itself, signed, and how they travel.

A record is a frozen value; its wire form is canonical JSON (sorted keys, no spaces),
signed with the publishing peer's Ed25519 key, in an envelope that carries the signed bytes
verbatim, so a receiver verifies exactly what was signed and a newer peer's extra fields
neither break the signature nor the parse (unknown fields are ignored)::

    {"v": 1, "record": "<canonical JSON of the record>", "sig": "<base64 Ed25519 signature>"}

The signer is ``record.peer_id``. For a libp2p peer ``node_id == peer_id``; a legacy HTTP
node's record is published (vouched for) by the peer that accepted it, so its ``node_id`` is
the legacy id and ``relayed`` is true. Anyone holding the PeerID can verify: the public key
is inside it.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from inclavate.types import LayerRange, ModelId, NodeId, PeerId
from p2p.errors import P2PError
from p2p.identity import Identity, verify

NodeState = Literal["Joining", "Ready", "Degraded", "Dead"]
NODE_STATES: tuple[NodeState, ...] = ("Joining", "Ready", "Degraded", "Dead")
RECORD_VERSION = 1


class InvalidRecord(P2PError):
    """A record that is malformed, wrongly signed, stale, replayed or from the future."""


@dataclass(frozen=True)
class Counters:
    tokens_total: int = 0
    requests_served: int = 0
    errors: int = 0
    avg_latency_ms: float = 0.0


@dataclass(frozen=True)
class MetricSample:
    """One 10-second sample of a node's own throughput and step latency."""

    tps: float
    latency_ms: float
    ts_ms: int


@dataclass(frozen=True)
class MinuteBucket:
    """Traffic a peer saw in one minute: requests it served as entry, tokens its stage ran."""

    ts_ms: int
    """Start of the minute (epoch ms, a multiple of 60 000)."""
    requests: int
    tokens: int


@dataclass(frozen=True)
class NodeRecord:
    node_id: NodeId
    peer_id: PeerId
    model_id: ModelId
    start_layer: int
    end_layer: int
    n_layers: int
    d_model: int
    state: NodeState
    seq: int
    """Strictly increasing per node: a receiver keeps only the newest and drops replays."""
    ts_ms: int
    """When the record was published (publisher's clock); bounded skew is enforced."""
    vram_mb: int = 0
    hardware: dict[str, Any] = field(default_factory=dict)
    api_url: str = ""
    multiaddrs: tuple[str, ...] = ()
    counters: Counters = Counters()
    uptime_s: int = 0
    started_ms: int = 0
    throughput_tps: float = 0.0
    """Tokens per second one step of this range has sustained (0 before any traffic)."""
    step_ms_per_layer: float = 0.0
    """Measured compute time per layer per step, the routing cost model's input."""
    context_length: int = 0
    idle: bool = False
    """Set by an admin: stays in the registry, receives no new chains."""
    draining: bool = False
    """The peer is leaving (polite stop): no new chains; entry peers move its sessions away."""
    relayed: bool = False
    """A legacy node vouched for by ``peer_id``; reached through that peer's HTTP forward."""
    forward_url: str = ""
    """For legacy nodes: the node's own HTTP forward endpoint."""
    samples: tuple[MetricSample, ...] = ()
    """The last ~60 samples, oldest first."""
    buckets: tuple[MinuteBucket, ...] = ()
    """The last ~60 minutes of traffic, oldest first (minutes without traffic omitted)."""
    requests_by_model: dict[str, int] = field(default_factory=dict)
    """Chat requests this peer served as entry, cumulative, per model."""
    version: str = ""

    @property
    def layers(self) -> LayerRange:
        return LayerRange(self.start_layer, self.end_layer)

    def replace(self, **changes: Any) -> NodeRecord:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["multiaddrs"] = list(self.multiaddrs)
        data["samples"] = [dataclasses.asdict(s) for s in self.samples]
        data["buckets"] = [dataclasses.asdict(b) for b in self.buckets]
        return data

    @classmethod
    def from_json(cls, data: Any) -> NodeRecord:
        if not isinstance(data, dict):
            raise InvalidRecord("a record must be a JSON object")
        try:
            known = {f.name for f in dataclasses.fields(cls)}
            fields = {k: v for k, v in data.items() if k in known}
            fields["counters"] = Counters(**fields.get("counters", {}))
            fields["samples"] = tuple(MetricSample(**s) for s in fields.get("samples", ()))
            fields["buckets"] = tuple(MinuteBucket(**b) for b in fields.get("buckets", ()))
            fields["multiaddrs"] = tuple(fields.get("multiaddrs", ()))
            # Added after the first release: a missing or odd value means "not draining".
            fields["draining"] = fields.get("draining") is True
            record = cls(**fields)
        except (TypeError, ValueError) as exc:
            raise InvalidRecord(f"malformed record: {exc}") from exc
        record._check_shape()
        return record

    def _check_shape(self) -> None:
        if self.state not in NODE_STATES:
            raise InvalidRecord(f"unknown state {self.state!r}")
        if not (0 <= self.start_layer < self.end_layer <= self.n_layers):
            raise InvalidRecord(f"bad layer range {self.start_layer}-{self.end_layer} of {self.n_layers}")
        if not self.relayed and self.node_id != self.peer_id:
            raise InvalidRecord("a peer may only publish its own record, or vouch for a relayed node")


def canonical_bytes(record: NodeRecord) -> bytes:
    return json.dumps(record.to_json(), sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class SignedRecord:
    record: NodeRecord
    payload: bytes
    """The exact bytes that were signed."""
    signature: bytes

    @classmethod
    def sign(cls, record: NodeRecord, identity: Identity) -> SignedRecord:
        if record.peer_id != identity.peer_id:
            raise InvalidRecord("a record must be signed by the peer it names as its publisher")
        payload = canonical_bytes(record)
        return cls(record, payload, identity.sign(payload))

    def verified(self) -> bool:
        return verify(self.record.peer_id, self.payload, self.signature)

    def encode(self) -> bytes:
        envelope = {
            "v": RECORD_VERSION,
            "record": self.payload.decode(),
            "sig": base64.b64encode(self.signature).decode(),
        }
        return json.dumps(envelope, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> SignedRecord:
        """Parse an envelope; the signature is checked separately (:meth:`verified`)."""
        try:
            envelope = json.loads(data)
            version, payload, sig = envelope["v"], envelope["record"], envelope["sig"]
            signature = base64.b64decode(sig, validate=True)
            body = json.loads(payload)
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidRecord(f"malformed record envelope: {exc}") from exc
        if version != RECORD_VERSION:
            raise InvalidRecord(f"record version {version} is not {RECORD_VERSION}")
        return cls(NodeRecord.from_json(body), payload.encode(), signature)


def now_ms() -> int:
    return int(time.time() * 1000)
