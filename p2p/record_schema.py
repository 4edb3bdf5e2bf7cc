"""The registry record's schema: the one place a record from the network gets its types.

Every field of a :class:`~p2p.records.NodeRecord` is read with a type and a range before
anything (routing, metrics, sqlite, the REST API) sees it: one gossiped record with
``"requests": "1"``, a layer given as text or a counter of ``2**70`` used to crash every
peer that received it. Bounds are generous for honest peers and small enough that sums over
a full table stay inside a 64-bit integer (4096 records x 2**48 < 2**63).

Unknown fields are ignored (a newer peer may add some; the signature covers the verbatim
bytes anyway); missing optional fields take their defaults. Any violation raises
:class:`~p2p.records.InvalidRecord` with a fixed reason code.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from urllib.parse import urlsplit
from typing import Any, Final

from inclavate.types import ModelId, NodeId, PeerId
from inclavate.untrusted import (
    Malformed,
    Reason,
    as_dict,
    as_int,
    as_str,
    parse_json,
    read_bool,
    read_dict,
    read_float,
    read_int,
    read_list,
    read_str,
)
from p2p.records import (
    NODE_STATES,
    RECORD_VERSION,
    Counters,
    InvalidRecord,
    MetricSample,
    MinuteBucket,
    NodeRecord,
    RecordProblem,
    SignedRecord,
    canonical_bytes,
    check_engine,
    check_generators,
)

MAX_RECORD_BYTES: Final = 64 * 1024
"""A record's canonical JSON. An honest heartbeat record is 3-8 KB (60 samples, 60 buckets);
a publisher trims rather than exceed this (:func:`p2p.records.fit_record`)."""
MAX_ENVELOPE_BYTES: Final = 256 * 1024
"""The envelope escapes the record inside a JSON string; = the gossip message limit."""
MAX_DEPTH: Final = 8
MAX_COUNT: Final = 2**48
"""Counters, token and request totals."""
MAX_TIME_MS: Final = 2**53
MAX_LAYERS: Final = 100_000
MAX_RATE: Final = 1e9
"""tokens/s, ms per layer, latencies: any real value is far below."""
MAX_SERIES: Final = 120
"""Samples and minute buckets (60 are kept; room for a newer peer's longer window)."""
MAX_ID: Final = 256
MAX_URL: Final = 512
MAX_MODELS: Final = 64
MAX_MULTIADDRS: Final = 32
"""A peer on many interfaces (container bridges) advertises its first 32."""
MAX_HEARTBEAT_MS: Final = 3_600_000
"""An announced heartbeat interval; receivers clamp it further (:class:`p2p.registry.Liveness`)."""
_SIG_BYTES: Final = 64
_HEX64: Final = re.compile(r"[0-9a-f]{64}")


def decode_envelope(data: bytes) -> SignedRecord:
    """An envelope from the network, typed; its signature is checked later
    (:meth:`SignedRecord.verified`: it is the costly check, done last)."""
    return decode_opened(open_envelope(data))


@dataclass(frozen=True)
class RecordHeader:
    """The fields the registry's rules read before anything costly (:func:`p2p.registry.admit`):
    typed exactly as :func:`decode_record` types them, so a record the header refuses is one
    the full decode would have refused too."""

    node_id: NodeId
    peer_id: PeerId
    seq: int
    ts_ms: int
    heartbeat_ms: int
    slim: bool


@dataclass(frozen=True)
class Envelope:
    """An envelope opened but its record not yet typed: what a sync answer's records cost
    before we know whether they are worth typing and verifying."""

    payload: bytes
    signature: bytes

    def header(self) -> RecordHeader:
        """The record's header, from a plain parse of the payload (~1/7 of typing it: no
        float hook, no depth walk, no schema). What that parse lets through (NaN, deep
        nesting elsewhere) the full decode still refuses; the header's own fields are read
        by the same typed readers."""
        try:
            body = json.loads(self.payload)
        except (ValueError, RecursionError):
            raise InvalidRecord("malformed record: not valid JSON", Reason.NOT_JSON) from None
        try:
            return _read_header(as_dict(body, "record", max_len=256))
        except Malformed as exc:
            raise InvalidRecord(f"malformed record: {exc}", exc.reason) from None


def decode_opened(envelope: Envelope) -> SignedRecord:
    """Type an opened envelope's record: the full parse and the schema."""
    try:
        body = parse_json(envelope.payload, max_bytes=MAX_RECORD_BYTES, max_depth=MAX_DEPTH)
    except Malformed as exc:
        raise InvalidRecord(f"malformed record: {exc}", exc.reason) from None
    return SignedRecord(decode_record(body), envelope.payload, envelope.signature)


def open_envelope(data: bytes) -> Envelope:
    """The envelope's signed bytes and signature, its record still untyped."""
    try:
        envelope = as_dict(parse_json(data, max_bytes=MAX_ENVELOPE_BYTES, max_depth=2), "envelope", max_len=16)
        version = read_int(envelope, "v", lo=0, hi=2**31)
        payload = read_str(envelope, "record", max_len=MAX_RECORD_BYTES)
        sig = read_str(envelope, "sig", max_len=128)
        signature = base64.b64decode(sig, validate=True)
    except Malformed as exc:
        raise InvalidRecord(f"malformed record envelope: {exc}", exc.reason) from None
    except (binascii.Error, ValueError):
        raise InvalidRecord("malformed record envelope: sig is not base64", Reason.BAD_VALUE) from None
    if version != RECORD_VERSION:
        raise InvalidRecord(f"record version {version} is not {RECORD_VERSION}", RecordProblem.BAD_VERSION)
    if len(signature) != _SIG_BYTES:
        raise InvalidRecord("malformed record envelope: wrong signature length", Reason.BAD_VALUE)
    return Envelope(payload.encode(), signature)


def decode_record(data: Any) -> NodeRecord:
    """A record's JSON object, typed and range-checked, ownership included."""
    try:
        record = _read_record(as_dict(data, "record", max_len=256))
    except Malformed as exc:
        raise InvalidRecord(f"malformed record: {exc}", exc.reason) from None
    record.check_ownership()
    return record


def _read_header(d: dict[str, Any]) -> RecordHeader:
    return RecordHeader(
        node_id=NodeId(read_str(d, "node_id", max_len=MAX_ID)),
        peer_id=PeerId(read_str(d, "peer_id", max_len=MAX_ID)),
        seq=read_int(d, "seq", lo=0),
        ts_ms=read_int(d, "ts_ms", lo=0, hi=MAX_TIME_MS),
        heartbeat_ms=read_int(d, "heartbeat_ms", lo=0, hi=MAX_HEARTBEAT_MS, default=0),
        slim=d.get("slim") is True,
    )


def _api_url(url: str) -> str:
    """A peer's REST API as an origin, ``http(s)://host[:port]`` and nothing more, or "".

    Other peers send requests there (a job's submission, read, cancel, listing: a fixed path
    appended), so a path, query or fragment of the record's choosing let any peer have honest
    peers send GET, POST and DELETE requests to any path of any host they can reach, a
    volunteer's LAN included (its path before ours, ours cut off by a ``?``: an audit,
    2026-12-07). A peer's own URL is what its server bound, an origin."""
    if not url:
        return url
    try:
        parts = urlsplit(url)
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
    if (not port_ok or parts.scheme not in ("http", "https") or not parts.hostname or parts.username is not None
            or parts.password is not None or parts.path or parts.query or parts.fragment or "#" in url or "?" in url
            or any(ch <= " " or ch == "\x7f" for ch in url)):  # fmt: skip
        raise Malformed(Reason.BAD_VALUE, "api_url", "must be an http(s) origin: scheme, host and port only")
    return url


def _read_record(d: dict[str, Any]) -> NodeRecord:
    def count(key: str) -> int:
        return read_int(d, key, lo=0, hi=MAX_COUNT, default=0)

    header = _read_header(d)
    return NodeRecord(
        node_id=header.node_id,
        peer_id=header.peer_id,
        model_id=ModelId(read_str(d, "model_id", max_len=MAX_ID)),
        start_layer=read_int(d, "start_layer", lo=0, hi=MAX_LAYERS),
        end_layer=read_int(d, "end_layer", lo=0, hi=MAX_LAYERS),
        n_layers=read_int(d, "n_layers", lo=1, hi=MAX_LAYERS),
        d_model=read_int(d, "d_model", lo=0, hi=2**24),
        state=read_str(d, "state", max_len=16, choices=frozenset(NODE_STATES)),  # type: ignore[arg-type]
        seq=header.seq,
        ts_ms=header.ts_ms,
        vram_mb=count("vram_mb"),
        hardware=read_dict(d, "hardware", max_len=64, default={}),
        api_url=_api_url(read_str(d, "api_url", max_len=MAX_URL, default="")),
        multiaddrs=tuple(as_str(a, "multiaddrs", max_len=MAX_URL) for a in read_list(d, "multiaddrs", max_len=MAX_MULTIADDRS, default=[])),
        counters=_counters(read_dict(d, "counters", max_len=16, default={})),
        uptime_s=count("uptime_s"),
        started_ms=read_int(d, "started_ms", lo=0, hi=MAX_TIME_MS, default=0),
        throughput_tps=read_float(d, "throughput_tps", lo=0.0, hi=MAX_RATE, default=0.0),
        step_ms_per_layer=read_float(d, "step_ms_per_layer", lo=0.0, hi=MAX_RATE, default=0.0),
        context_length=read_int(d, "context_length", lo=0, hi=2**31, default=0),
        idle=read_bool(d, "idle", default=False),
        relayed=read_bool(d, "relayed", default=False),
        forward_url=read_str(d, "forward_url", max_len=MAX_URL, default=""),
        samples=tuple(_sample(s) for s in read_list(d, "samples", max_len=MAX_SERIES, default=[])),
        buckets=tuple(_bucket(b) for b in read_list(d, "buckets", max_len=MAX_SERIES, default=[])),
        requests_by_model=_requests_by_model(read_dict(d, "requests_by_model", max_len=MAX_MODELS, default={})),
        version=read_str(d, "version", max_len=64, default=""),
        model_sha256=_sha256(d, "model_sha256"),
        vocab_sha256=_sha256(d, "vocab_sha256"),
        engine=check_engine(read_str(d, "engine", max_len=32, default="llamacpp")),
        # Added after the first release: a missing or odd value means "not draining".
        draining=d.get("draining") is True,
        generators=check_generators(tuple(read_list(d, "generators", max_len=16, default=[]))),
        slim=header.slim,
        heartbeat_ms=header.heartbeat_ms,
    )


def _sha256(d: dict[str, Any], key: str) -> str:
    value = read_str(d, key, max_len=64, default="")
    if value and not _HEX64.fullmatch(value):
        raise Malformed(Reason.BAD_VALUE, key, "must be 64 lowercase hex digits")
    return value


def _counters(c: dict[str, Any]) -> Counters:
    return Counters(
        tokens_total=read_int(c, "tokens_total", lo=0, hi=MAX_COUNT, default=0),
        requests_served=read_int(c, "requests_served", lo=0, hi=MAX_COUNT, default=0),
        errors=read_int(c, "errors", lo=0, hi=MAX_COUNT, default=0),
        avg_latency_ms=read_float(c, "avg_latency_ms", lo=0.0, hi=MAX_RATE, default=0.0),
    )


def _sample(value: Any) -> MetricSample:
    s = as_dict(value, "samples", max_len=16)
    return MetricSample(
        tps=read_float(s, "tps", lo=0.0, hi=MAX_RATE),
        latency_ms=read_float(s, "latency_ms", lo=0.0, hi=MAX_RATE),
        ts_ms=read_int(s, "ts_ms", lo=0, hi=MAX_TIME_MS),
    )


def _bucket(value: Any) -> MinuteBucket:
    b = as_dict(value, "buckets", max_len=16)
    return MinuteBucket(
        ts_ms=read_int(b, "ts_ms", lo=0, hi=MAX_TIME_MS),
        requests=read_int(b, "requests", lo=0, hi=MAX_COUNT),
        tokens=read_int(b, "tokens", lo=0, hi=MAX_COUNT),
    )


def _requests_by_model(d: dict[str, Any]) -> dict[str, int]:
    for key in d:
        as_str(key, "requests_by_model", max_len=MAX_ID)
    return {key: as_int(n, "requests_by_model", lo=0, hi=MAX_COUNT) for key, n in d.items()}


def fit_record(record: NodeRecord, limit: int = MAX_RECORD_BYTES) -> NodeRecord:
    """``record`` trimmed to what every receiver accepts: at most the schema's counts (the
    newest samples and buckets, the most-asked models, the first addresses), then, until
    its canonical JSON fits in ``limit`` bytes, the oldest samples and minute buckets, the
    per-model request counts, the hardware profile.

    A record over a limit is refused by every receiver (and by our own gossip validator),
    so an unbounded field must never make a peer silently stop announcing itself."""
    if len(record.requests_by_model) > MAX_MODELS:
        top = sorted(record.requests_by_model.items(), key=lambda kv: -kv[1])[:MAX_MODELS]
        record = record.replace(requests_by_model=dict(top))
    if len(record.samples) > MAX_SERIES or len(record.buckets) > MAX_SERIES or len(record.multiaddrs) > MAX_MULTIADDRS:
        record = record.replace(samples=record.samples[-MAX_SERIES:], buckets=record.buckets[-MAX_SERIES:],
                                multiaddrs=record.multiaddrs[:MAX_MULTIADDRS])  # fmt: skip
    while len(canonical_bytes(record)) > limit:
        if record.samples or record.buckets:
            record = record.replace(samples=record.samples[len(record.samples) // 2 + 1 :] if record.samples else (),
                                    buckets=record.buckets[len(record.buckets) // 2 + 1 :] if record.buckets else ())
        elif record.requests_by_model:
            record = record.replace(requests_by_model={})
        elif record.hardware:
            record = record.replace(hardware={})
        else:
            raise InvalidRecord(f"record of {record.node_id} exceeds {limit} bytes even trimmed")
    return record
