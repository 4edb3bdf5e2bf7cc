"""Node records: what every peer publishes about itself, signed, and how they travel.

A record is a frozen value; its wire form is canonical JSON (sorted keys, no spaces),
signed with the publishing peer's Ed25519 key, in an envelope that carries the signed bytes
verbatim, so a receiver verifies exactly what was signed and a newer peer's extra fields
neither break the signature nor the parse (unknown fields are ignored)::

    {"v": 1, "record": "<canonical JSON of the record>", "sig": "<base64 Ed25519 signature>"}

The signer is ``record.peer_id``. For a libp2p peer ``node_id == peer_id``; a legacy HTTP
node's record is published (vouched for) by the peer that accepted it, so its ``node_id`` is
the legacy id namespaced under that peer (``<PeerID>:<id>``) and ``relayed`` is true. A record
for any other id is refused (:meth:`NodeRecord.check_ownership`): no peer can speak for a node
it does not own. Records from the network are typed by :mod:`p2p.record_schema`. Anyone holding the PeerID can verify: the public key
is inside it.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import enum
import functools
import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from inclavate.types import LayerRange, ModelId, NodeId, PeerId
from p2p.errors import P2PError
from p2p.identity import Identity, verify

NodeState = Literal["Joining", "Ready", "Degraded", "Dead"]
NODE_STATES: tuple[NodeState, ...] = ("Joining", "Ready", "Degraded", "Dead")
RECORD_VERSION = 1
_ENGINE_NAME = re.compile(r"[a-z0-9_-]{1,32}")
"""Engine kinds are short names ("llamacpp", "mlx"); a newer peer may run one we do not
know, which routing need not understand (every engine speaks the same hidden states)."""


class RecordProblem(enum.Enum):
    """Why a record was refused before the registry's rules ran (drop-counter keys)."""

    BAD_ENVELOPE = "bad_envelope"
    BAD_VERSION = "bad_version"
    BAD_LAYERS = "bad_layers"
    NOT_OWNER = "not_owner"


class InvalidRecord(P2PError):
    """A record that is malformed, wrongly signed, stale, replayed or from the future.

    ``reason`` is a fixed code (:class:`RecordProblem` or :class:`inclavate.untrusted.Reason`)
    for counters; the message may say more."""

    def __init__(self, message: str, reason: enum.Enum = RecordProblem.BAD_ENVELOPE) -> None:
        super().__init__(message)
        self.reason = reason


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
    engine: str = "llamacpp"
    """The engine that runs this node's range ("llamacpp" or "mlx"); informational."""
    generators: tuple[dict[str, Any], ...] = ()
    """Media generators this peer runs (their ``/v1/generations/capabilities`` entries),
    so any peer can list the swarm's generators and send a job where one runs. Bounded
    by :func:`check_generators`."""
    model_sha256: str = ""
    """sha256 of the model file this node serves ("" if unknown)."""
    vocab_sha256: str = ""
    """sha256 of the vocab-only GGUF it serves on ``/inclavate/vocab/1`` ("" until computed)."""
    slim: bool = False
    """A heartbeat: the :data:`DETAIL_FIELDS` are left out (empty here) and receivers keep
    those of this node's newest full record (:func:`with_details`). Missing or not a boolean:
    a full record, as every record was before heartbeats slimmed down."""
    heartbeat_ms: int = 0
    """The publisher's heartbeat interval, which grows with the swarm
    (:class:`p2p.registry.Cadence`); receivers judge its silence by it. 0: their default."""

    @property
    def layers(self) -> LayerRange:
        return LayerRange(self.start_layer, self.end_layer)

    def replace(self, **changes: Any) -> NodeRecord:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        """Field by field rather than ``dataclasses.asdict``, whose recursive deep copy of 120
        samples and buckets made signing a record cost milliseconds on every heartbeat."""
        data = {f.name: getattr(self, f.name) for f in _RECORD_FIELDS}
        data["hardware"] = copy.deepcopy(self.hardware)
        data["counters"] = dataclasses.asdict(self.counters)
        data["multiaddrs"] = list(self.multiaddrs)
        data["samples"] = [{"tps": s.tps, "latency_ms": s.latency_ms, "ts_ms": s.ts_ms} for s in self.samples]
        data["buckets"] = [{"ts_ms": b.ts_ms, "requests": b.requests, "tokens": b.tokens} for b in self.buckets]
        data["requests_by_model"] = dict(self.requests_by_model)
        data["generators"] = [copy.deepcopy(g) for g in self.generators]
        return data

    @classmethod
    def from_json(cls, data: Any) -> NodeRecord:
        """Type a record received from the network (see :mod:`p2p.record_schema`)."""
        from p2p.record_schema import decode_record  # the schema module imports this one

        return decode_record(data)

    def check_ownership(self) -> None:
        """A peer may publish only its own record (``node_id == peer_id``) or records of
        legacy nodes it vouches for, whose ids are namespaced under its own PeerID
        (:func:`legacy_node_id`), so no record can ever claim another publisher's node."""
        if not (0 <= self.start_layer < self.end_layer <= self.n_layers):
            raise InvalidRecord(f"bad layer range {self.start_layer}-{self.end_layer} of {self.n_layers}",
                                RecordProblem.BAD_LAYERS)
        if self.relayed:
            if legacy_owner(self.node_id) != self.peer_id:
                raise InvalidRecord("a relayed node's id must be namespaced under its vouching peer",
                                    RecordProblem.NOT_OWNER)
        elif self.node_id != self.peer_id:
            raise InvalidRecord("a peer may only publish its own record, or vouch for a relayed node",
                                RecordProblem.NOT_OWNER)


_RECORD_FIELDS = dataclasses.fields(NodeRecord)

DETAIL_FIELDS: tuple[str, ...] = (
    "samples", "buckets", "requests_by_model", "hardware", "generators", "model_sha256", "vocab_sha256", "version",
)  # fmt: skip
"""Bulky or slowly changing fields: sent in full records only (on change, rate-limited, and
when the samples are due), never in every heartbeat. The samples and buckets are 85% of a
busy peer's record and most of what decoding one costs."""
_EMPTY_DETAILS = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
                  for f in _RECORD_FIELDS if f.name in DETAIL_FIELDS}  # fmt: skip


def slim_record(record: NodeRecord) -> NodeRecord:
    """``record`` as a heartbeat: its details left out, ``slim`` set."""
    return record.replace(slim=True, **_EMPTY_DETAILS)


def with_details(live: NodeRecord, details: NodeRecord | None) -> NodeRecord:
    """A node's record as readers see it: its newest liveness record (``live``, slim or
    full) with the details of its newest full record (``details``)."""
    if not live.slim or details is None:
        return live
    return live.replace(**{name: getattr(details, name) for name in DETAIL_FIELDS})


def details_changed(record: NodeRecord, sent: NodeRecord, *, samples: bool) -> bool:
    """Whether ``record``'s details differ from those last sent in full (``samples``: count
    the metric samples, which change every 10 s even on an idle peer)."""
    return any(getattr(record, name) != getattr(sent, name) for name in DETAIL_FIELDS if samples or name != "samples")


MAX_GENERATORS = 8
MAX_GENERATORS_BYTES = 4096
_GENERATOR_KEYS = {
    "modality": str, "model": str, "kind": str, "ready": bool, "requires_speaker": bool,
    "requires_reference_text": bool, "voices": list, "builtin_voices": list, "languages": list,
    "input_modalities": list, "speed_range": dict, "limits": dict,
}  # fmt: skip


def check_engine(engine: Any) -> str:
    if not isinstance(engine, str) or not _ENGINE_NAME.fullmatch(engine):
        raise InvalidRecord(f"bad engine name {str(engine)[:40]!r}")
    return engine


def check_generators(generators: tuple[Any, ...]) -> tuple[dict[str, Any], ...]:
    """A record's generator list is small and shaped like capability entries: at most
    :data:`MAX_GENERATORS` objects, known keys of the right JSON types, lists of short
    strings, numbers in ``speed_range``/``limits``, 4 KB in all. Anything else is refused
    (the whole record), since these entries are served to clients as they are."""
    if len(generators) > MAX_GENERATORS:
        raise InvalidRecord(f"more than {MAX_GENERATORS} generators")
    if len(json.dumps(list(generators), separators=(",", ":"))) > MAX_GENERATORS_BYTES:
        raise InvalidRecord(f"generators take more than {MAX_GENERATORS_BYTES} bytes")
    for entry in generators:
        if not isinstance(entry, dict) or not isinstance(entry.get("model"), str) or not isinstance(entry.get("modality"), str):
            raise InvalidRecord("a generator entry is an object with model and modality")
        for key, value in entry.items():
            kind = _GENERATOR_KEYS.get(key)
            if kind is None or not isinstance(value, kind):
                raise InvalidRecord(f"generator field {key!r} is unknown or of the wrong type")
            if isinstance(value, str) and len(value) > 100:
                raise InvalidRecord(f"generator field {key!r} is too long")
            if isinstance(value, list) and not all(isinstance(v, str) and len(v) <= 64 for v in value):
                raise InvalidRecord(f"generator field {key!r} must list short strings")
            if isinstance(value, dict) and not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values()
            ):
                raise InvalidRecord(f"generator field {key!r} must map names to numbers")
        _check_speed_range(entry.get("speed_range"))
    return tuple(generators)


def _check_speed_range(bounds: dict[str, Any] | None) -> None:
    """``speed_range`` is what a speech request's ``speed`` is checked against, by key: an
    entry without both bounds passed the type checks and failed that request with a 500 on
    every peer (an audit, 2026-12-07)."""
    if bounds is None:
        return
    if set(bounds) != {"min", "max"} or not all(math.isfinite(v) for v in bounds.values()) or bounds["min"] > bounds["max"]:
        raise InvalidRecord("generator field 'speed_range' must be finite numbers min <= max")


LEGACY_SEPARATOR = ":"
"""Between the vouching PeerID and a legacy node's own id. PeerIDs are base58, which has
no ``:``, so a legacy id can never equal or imitate a PeerID, and ``:`` is safe in a URL path."""


def legacy_node_id(peer_id: str, local_id: str) -> NodeId:
    """The registry id of legacy node ``local_id`` vouched for by ``peer_id``."""
    return NodeId(f"{peer_id}{LEGACY_SEPARATOR}{local_id}")


def legacy_owner(node_id: str) -> str | None:
    """The PeerID a legacy node id is namespaced under (None for a plain PeerID)."""
    owner, sep, local = node_id.partition(LEGACY_SEPARATOR)
    return owner if sep and local else None


def legacy_local_id(node_id: str) -> str:
    """The id a legacy node chose for itself (the node id unchanged if not namespaced)."""
    owner, sep, local = node_id.partition(LEGACY_SEPARATOR)
    return local if sep and local else node_id


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
        return self._signature_ok

    @functools.cached_property
    def _signature_ok(self) -> bool:
        """Checked once per decoded envelope: the gossip validator and the delivery that
        follows it share the decoded value (:class:`p2p.gossip.RegistryService`)."""
        return verify(self.record.peer_id, self.payload, self.signature)

    def encode(self) -> bytes:
        """The envelope as every peer of this version sends it (cached: a sync answer both
        serves and recognizes the records it holds by these bytes)."""
        return self._wire

    @functools.cached_property
    def _wire(self) -> bytes:
        envelope = {
            "v": RECORD_VERSION,
            "record": self.payload.decode(),
            "sig": base64.b64encode(self.signature).decode(),
        }
        return json.dumps(envelope, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> SignedRecord:
        """Parse an envelope; the signature is checked separately (:meth:`verified`)."""
        from p2p.record_schema import decode_envelope

        return decode_envelope(data)


def now_ms() -> int:
    return int(time.time() * 1000)
