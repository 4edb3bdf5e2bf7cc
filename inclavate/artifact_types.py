"""The values and errors of the artifact store, shared by the store, the wire and the API.

Error tree (each mapped to its HTTP status once, in ``api/errors.py``)::

    InclavateError
    └── ArtifactError
        ├── BadArtifactRequest      400  a media type, filename or query that cannot be used
        ├── ArtifactNotFound        404  unknown, deleted or expired (or another owner's)
        ├── ArtifactNotReady        409  pending or failed: only ready artifacts are readable
        ├── ArtifactTooLarge        413  over the per-request cap (512 MiB, Files: 64 MiB)
        ├── QuotaExceeded           507  the store's max_bytes / max_objects is reached
        └── ArtifactUnavailable     503  storage broken, or the owner peer unreachable
            └── OwnerBusy           503  the owner peer's slots for such requests are taken now

``MalformedId`` (400, :mod:`inclavate.owner_ids`) and the Range errors (400/416,
:mod:`inclavate.byte_ranges`) live with the code that raises them.
"""

from __future__ import annotations

import math
import re
import time
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from inclavate.byte_ranges import ByteRange, parse_range
from inclavate.errors import ConfigError, InclavateError

MIB = 1024 * 1024
UPLOAD_MAX_BYTES = 512 * MIB
"""One ``POST /v1/artifacts`` body (the spec's per-request cap)."""
FILE_MAX_BYTES = 64 * MIB
"""One ``POST /v1/files`` upload."""
DEFAULT_MEDIA_TYPE = "application/octet-stream"
MAX_FILENAME_CHARS = 255
MAX_PURPOSE_CHARS = 64
MAX_MEDIA_TYPE_CHARS = 255
MAX_ERROR_CHARS = 1000
"""A failed row's error text, as the store keeps it (:func:`error_text`)."""
LIST_DEFAULT_LIMIT = 100
LIST_MAX_LIMIT = 1000
SWARM_LIST_WINDOW = 20_000
"""The deepest row (offset + limit) a swarm-wide listing reaches: each peer ships its first
``offset + limit`` rows to the peer that merges them."""

ArtifactKind = Literal["uploaded", "generated"]
ArtifactState = Literal["pending", "ready", "failed"]
KINDS: tuple[ArtifactKind, ...] = ("uploaded", "generated")
STATES: tuple[ArtifactState, ...] = ("pending", "ready", "failed")

MAX_BYTES_ENV = "DPPAN_ARTIFACT_MAX_BYTES"
MAX_OBJECTS_ENV = "DPPAN_ARTIFACT_MAX_OBJECTS"
TTL_HOURS_ENV = "DPPAN_ARTIFACT_TTL_HOURS"


class ArtifactError(InclavateError):
    """Base of the artifact store's errors."""


class BadArtifactRequest(ArtifactError):
    """A media type, filename, purpose or query that the store cannot accept (400)."""


class ArtifactNotFound(ArtifactError):
    """No such artifact: never existed, deleted, or expired (404)."""


class ArtifactNotReady(ArtifactError):
    """The artifact exists but is pending or failed; only ready ones are readable (409)."""


class ArtifactTooLarge(ArtifactError):
    """More bytes than one upload may carry (413)."""


class QuotaExceeded(ArtifactError):
    """The store is at its byte or object ceiling (507); retrying at once frees nothing."""

    should_retry = False


class ArtifactUnavailable(ArtifactError):
    """The bytes exist somewhere but cannot be reached now: a disk or database failure,
    or the owning peer did not answer (503)."""


class OwnerBusy(ArtifactUnavailable):
    """The owner refused a request because its slots for such requests are taken. A read
    slot is held for one piece at a time, so this passes in moments: a reader waits and asks
    again rather than cutting a download off half way (still a 503 if it never passes)."""


def now_ms() -> int:
    return int(time.time() * 1000)


def rfc3339(ms: int) -> str:
    """``2026-08-06T09:14:22.981Z``: the spec's timestamp form, millisecond precision."""
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


@dataclass(frozen=True)
class ArtifactMeta:
    """One artifact's metadata, as stored and as served (:meth:`to_json`)."""

    id: str
    media_type: str
    size_bytes: int
    digest: str | None
    """SHA-256 (hex) of the whole object; None until it is ready."""
    state: ArtifactState
    kind: ArtifactKind
    created_at_ms: int
    expires_at_ms: int | None = None
    filename: str | None = None
    """Set only for uploads through the Files API (display metadata, not the origin)."""
    purpose: str | None = None
    error: str | None = None
    """Why a failed artifact failed (not served over HTTP; for logs and jobs)."""

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def range_to_read(self, range_header: str | None) -> ByteRange | None:
        """The part of this artifact a read with ``range_header`` serves (None: all of it).
        The store and a peer reading from the owner decide it the same way, so a remote
        400/409/416 is the local one."""
        if not self.ready:
            raise ArtifactNotReady(f"artifact {self.id} is {self.state}; only ready artifacts can be read")
        return parse_range(range_header, self.size_bytes)

    def expired(self, at_ms: int) -> bool:
        return self.expires_at_ms is not None and self.expires_at_ms <= at_ms

    def sort_key(self) -> tuple[int, str]:
        """The listing order's key; the spec lists by (created_at DESC, id DESC)."""
        return (self.created_at_ms, self.id)

    def to_json(self) -> dict[str, Any]:
        """The spec's body (upload response, meta, listing rows), plus ``kind``."""
        body: dict[str, Any] = {
            "id": self.id,
            "media_type": self.media_type,
            "size_bytes": self.size_bytes,
            "digest": self.digest,
            "state": self.state,
            "kind": self.kind,
            "created_at": rfc3339(self.created_at_ms),
            "expires_at": rfc3339(self.expires_at_ms) if self.expires_at_ms is not None else None,
        }
        if self.filename is not None:
            body["filename"] = self.filename
        if self.purpose is not None:
            body["purpose"] = self.purpose
        return body

    def to_record(self) -> dict[str, Any]:
        """Every field, machine-readable (the SQLite row and the peer-to-peer wire form)."""
        return {
            "id": self.id, "media_type": self.media_type, "size_bytes": self.size_bytes,
            "digest": self.digest, "state": self.state, "kind": self.kind,
            "created_at_ms": self.created_at_ms, "expires_at_ms": self.expires_at_ms,
            "filename": self.filename, "purpose": self.purpose, "error": self.error,
        }  # fmt: skip

    @classmethod
    def from_record(cls, row: Mapping[str, Any]) -> ArtifactMeta:
        """Rebuild from :meth:`to_record`; strict, since the wire form comes from other peers."""
        try:
            meta = cls(
                id=_text(row["id"], 36), media_type=_text(row["media_type"], MAX_MEDIA_TYPE_CHARS),
                size_bytes=_count(row["size_bytes"]), digest=_optional_text(row.get("digest"), 64),
                state=row["state"], kind=row["kind"], created_at_ms=_count(row["created_at_ms"]),
                expires_at_ms=_optional_count(row.get("expires_at_ms")),
                filename=_optional_text(row.get("filename"), MAX_FILENAME_CHARS),
                purpose=_optional_text(row.get("purpose"), MAX_PURPOSE_CHARS), error=_optional_text(row.get("error"), MAX_ERROR_CHARS),
            )  # fmt: skip
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not an artifact record: {exc}") from exc
        if meta.state not in STATES or meta.kind not in KINDS:
            raise ValueError(f"not an artifact record: state {meta.state!r}, kind {meta.kind!r}")
        return meta


def _text(value: object, limit: int) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise TypeError(f"expected a string of at most {limit} characters")
    return value


def _optional_text(value: object, limit: int) -> str | None:
    return None if value is None else _text(value, limit)


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise TypeError("expected a non-negative integer")
    return value


def _optional_count(value: object) -> int | None:
    return None if value is None else _count(value)


@dataclass(frozen=True)
class ArtifactPage:
    artifacts: list[ArtifactMeta]
    truncated: bool
    """More rows exist past this page (walk on with ``offset``)."""


SortKey = tuple[int, str]
"""A listing row's place in the order: ``(created_at_ms, id)`` (:meth:`ArtifactMeta.sort_key`)."""


@dataclass(frozen=True)
class KeyPage:
    """A peer's listing as sort keys only: what a swarm-wide merge needs to place its rows,
    at a size that does not depend on how long their filenames are."""

    keys: list[SortKey]
    truncated: bool


@dataclass(frozen=True)
class ListQuery:
    """One listing request: ``limit`` rows after skipping ``offset``, newest first.

    ``files_only`` keeps artifacts uploaded through the Files API; ``after`` is a keyset
    cursor (the sort key of the last row already seen) used by the Files listing.
    """

    limit: int = LIST_DEFAULT_LIMIT
    offset: int = 0
    kind: ArtifactKind | None = None
    files_only: bool = False
    purpose: str | None = None
    after: tuple[int, str] | None = None
    ascending: bool = False


@dataclass(frozen=True)
class Totals:
    bytes: int = 0
    objects: int = 0

    def __add__(self, other: Totals) -> Totals:
        return Totals(self.bytes + other.bytes, self.objects + other.objects)

    def to_json(self) -> dict[str, int]:
        return {"bytes": self.bytes, "objects": self.objects}

    @classmethod
    def from_json(cls, value: object) -> Totals:
        """Strict, for what other peers send (ValueError)."""
        try:
            if not isinstance(value, dict):
                raise TypeError("expected an object")
            return cls(_count(value["bytes"]), _count(value["objects"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a bytes/objects pair: {exc}") from exc


@dataclass(frozen=True)
class Usage:
    """``GET /v1/artifacts/usage``: totals split by origin, and the ceilings (0 = none)."""

    generated: Totals = Totals()
    uploaded: Totals = Totals()
    max_bytes: int = 0
    max_objects: int = 0
    default_ttl_hours: float | None = None

    @property
    def total(self) -> Totals:
        return self.generated + self.uploaded

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            **self.total.to_json(), "max_bytes": self.max_bytes, "max_objects": self.max_objects,
            "generated": self.generated.to_json(), "uploaded": self.uploaded.to_json(),
        }  # fmt: skip
        if self.default_ttl_hours is not None:
            body["default_ttl_hours"] = self.default_ttl_hours
        return body

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Usage:
        """Strict, for what other peers send (ValueError); the TTL is the reader's own."""
        try:
            return cls(
                generated=Totals.from_json(body["generated"]), uploaded=Totals.from_json(body["uploaded"]),
                max_bytes=_count(body["max_bytes"]), max_objects=_count(body["max_objects"]),
            )  # fmt: skip
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a usage answer: {exc}") from exc


@dataclass(frozen=True)
class ArtifactConfig:
    """Ceilings and retention of one peer's store. 0 means no ceiling (the default)."""

    max_bytes: int = 0
    max_objects: int = 0
    ttl_hours: float | None = None
    """Artifacts expire this long after creation and are swept; None keeps them."""
    sweep_interval_s: float = field(default=60.0)

    @property
    def ttl_ms(self) -> int | None:
        return None if self.ttl_hours is None else max(1, int(self.ttl_hours * 3_600_000))

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ArtifactConfig:
        """Read ``DPPAN_ARTIFACT_MAX_BYTES``, ``..._MAX_OBJECTS``, ``..._TTL_HOURS``.

        A value that cannot be read stops the peer (ConfigError): a quota or a retention
        silently ignored is worse than a peer that refuses to start with a clear message.
        """
        max_bytes = _env_int(env, MAX_BYTES_ENV)
        max_objects = _env_int(env, MAX_OBJECTS_ENV)
        raw_ttl = env.get(TTL_HOURS_ENV, "").strip()
        ttl: float | None = None
        if raw_ttl:
            try:
                ttl = float(raw_ttl)
            except ValueError:
                ttl = math.nan
            if not 0 < ttl <= 24 * 365 * 100:  # NaN fails too
                raise ConfigError(f"{TTL_HOURS_ENV}={raw_ttl!r} must be a positive number of hours")
        # Sweep often enough that an expired artifact's bytes go within ~1/4 of its life.
        interval = 60.0 if ttl is None else min(60.0, max(0.5, ttl * 3600 / 4))
        return cls(max_bytes, max_objects, ttl, interval)


def _env_int(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return 0
    if not raw.isdigit() or len(raw) > 19:
        raise ConfigError(f"{name}={raw!r} must be a whole number >= 0 (0 = no ceiling)")
    return int(raw)


_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,127}"
_MEDIA_TYPE = re.compile(rf"({_TOKEN})/({_TOKEN})")


def media_type_of(content_type: str | None) -> str:
    """The media type to record for a ``Content-Type`` header: ``type/subtype`` lowercased,
    parameters dropped; absent means ``application/octet-stream``; anything else is 400."""
    if content_type is None or not content_type.strip():
        return DEFAULT_MEDIA_TYPE
    essence = content_type.split(";", 1)[0].strip()
    if not _MEDIA_TYPE.fullmatch(essence):
        raise BadArtifactRequest(f"malformed Content-Type {content_type[:80]!r}: expected type/subtype")
    return essence.lower()


def safe_filename(name: str | None) -> str:
    """A display filename: the last path component, no control characters, at most 255
    characters. It is never used as a path (bytes live under the artifact id)."""
    base = re.split(r"[/\\]", name or "")[-1]
    cleaned = "".join(ch for ch in base if unicodedata.category(ch)[0] != "C").strip()
    if cleaned in ("", ".", ".."):
        cleaned = "file"
    return cleaned[:MAX_FILENAME_CHARS]


def error_text(error: str) -> str:
    """A failed artifact's error as the store keeps it: printable ASCII (others escaped as
    ``\\uXXXX``, control characters a space), at most :data:`MAX_ERROR_CHARS`, so a row's
    JSON stays within ``p2p.artifact_wire.HONEST_ROW_BYTES`` whatever an exception's message held."""
    escaped = error.encode("ascii", "backslashreplace").decode("ascii")
    return "".join(ch if " " <= ch <= "~" else " " for ch in escaped)[:MAX_ERROR_CHARS]
