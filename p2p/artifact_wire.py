"""The messages of ``/inclavate/artifacts/2``, encoded and decoded strictly on both ends.

One request per stream:

* request: one JSON frame of at most 4 KiB, ``{"op": ..., ...}``::

      {"op": "meta",   "id": ID}
      {"op": "read",   "id": ID, "offset": N, "length": L}     1 <= L <= MAX_PIECE
      {"op": "delete", "id": ID}
      {"op": "list",   "limit": N, "kind": K|null, "files_only": B, "purpose": P|null,
                       "after": [MS, ID]|null, "ascending": B, "keys": B}
      {"op": "usage"}

* answer: one JSON frame ``{"ok": true, ...}`` or ``{"ok": false, "error": CODE,
  "message": TEXT[, "size": N]}``, CODE naming one of our exception types (:data:`ERRORS`),
  so the asking side raises the very error the owner's store raised (a remote 404, 409 or
  416 is the local one);
* a ``list`` answers ``"artifacts": [RECORD, ...]`` (at most :data:`MAX_LIST_ROWS`), or with
  ``"keys": true`` only their sort keys, ``"keys": [[MS, ID], ...]`` (up to
  :data:`~inclavate.artifact_types.SWARM_LIST_WINDOW`): a swarm-wide listing places every
  peer's rows by their keys, then asks each peer for the rows of its own that made the page
  (:mod:`inclavate.artifact_swarm`). Each answer's bound follows from its request
  (:func:`answer_limit`) and from the longest row the upload routes can store
  (:data:`MAX_ROW_BYTES`), so every honest answer fits it;
* a ``read`` that succeeded answers ``"range": [FIRST, LAST]`` (inclusive; the end clamped
  to the object's last byte, a start past it is 416) and is followed by those bytes in
  frames of at most 256 KiB and an empty frame that marks the end.

A read is one *piece* of at most :data:`MAX_PIECE` bytes: the asker reads an object piece by
piece, one stream each, so an owner's read slot is held while a piece crosses the wire and
never while the asker's own client is slow to take what it already has. Version 1 read a
whole object per stream (its slot held for as long as the slowest HTTP client took), which
is why the protocol's number changed.

Decoders return typed values or raise: the owner's :func:`decode_request` raises
:class:`BadArtifactRequest` / :class:`MalformedId` (answered as a refusal), the asker's
decoders raise :class:`ArtifactUnavailable` (a peer that sends garbage is a peer we cannot
use), never a bare ``KeyError``.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Generator
from typing import Any

from inclavate.artifact_types import (
    KINDS,
    LIST_MAX_LIMIT,
    MAX_ERROR_CHARS,
    MAX_FILENAME_CHARS,
    MAX_MEDIA_TYPE_CHARS,
    MAX_PURPOSE_CHARS,
    SWARM_LIST_WINDOW,
    ArtifactMeta,
    ArtifactNotFound,
    ArtifactNotReady,
    ArtifactPage,
    ArtifactTooLarge,
    ArtifactUnavailable,
    BadArtifactRequest,
    KeyPage,
    ListQuery,
    OwnerBusy,
    QuotaExceeded,
    SortKey,
    Usage,
)
from inclavate.artifact_reads import READ_CHUNK
from inclavate.byte_ranges import RangeMalformed, RangeNotSatisfiable
from inclavate.errors import InclavateError
from inclavate.owner_ids import MalformedId, Owners, parse_id
from inclavate.untrusted import Malformed, parse_json

PROTOCOL = "/inclavate/artifacts/2"
MAX_REQUEST_BYTES = 4096
MAX_PIECE = 4 * READ_CHUNK
"""Bytes one read asks for (1 MiB): what an asker buffers per download, and what bounds the
time one read may hold an owner's slot (:func:`p2p.artifacts.read_deadline`)."""
MAX_OFFSET = 2**63 - 1
"""A piece's offset: with its length, its last byte still has at most 19 digits, the most
:func:`inclavate.byte_ranges.parse_range` reads."""
MAX_ROW_BYTES = 12 * (36 + MAX_MEDIA_TYPE_CHARS + 64 + MAX_FILENAME_CHARS + MAX_PURPOSE_CHARS + 1000) + 512
"""One artifact record as JSON, at its longest: its text fields (id, media type, digest,
filename, purpose, error) in at most 12 bytes a character (an astral character escaped as
two ``\\uXXXX``), plus keys and numbers (~20 KiB; a 255-character filename of emoji alone
is 3 KiB)."""
HONEST_ROW_BYTES = 36 + MAX_MEDIA_TYPE_CHARS + 64 + 12 * (MAX_FILENAME_CHARS + MAX_PURPOSE_CHARS) + 2 * MAX_ERROR_CHARS + 512
"""The longest record this version's store writes, as JSON (~6.5 KiB): a media type is
ASCII (``media_type_of``), a filename of 255 emoji is 3 KiB, and an error is printable ASCII
(:func:`~inclavate.artifact_types.error_text`: 2 bytes a character at most, a backslash or
a quote escaped). A swarm-wide listing allows each row at least this (:func:`row_allowance`); :data:`MAX_ROW_BYTES` stays what one
row may be on the wire (older stores kept any error text)."""
MAX_RECORD_ANSWER_BYTES = MAX_ROW_BYTES + 512
"""Any answer but a listing (``meta``, ``delete``, ``usage``, a read's header, a refusal): at
most one artifact record, plus the header's keys and range. ~20 KiB, where a listing's 20 MB
used to be allowed for every answer."""
MAX_LIST_ROWS = LIST_MAX_LIMIT
"""Records one ``list`` answer may carry (a swarm-wide merge asks for more in turns): at
:data:`MAX_ROW_BYTES` each, an answer is at most ~20 MB however long the rows."""
KEY_BYTES = 60
"""One sort key as JSON, at its longest: ``[`` 19 digits ``,"`` 36-character id ``"]``."""
KEYS_PER_STEP = 1000
"""Keys :func:`decode_keys_in_steps` decodes between two steps (~0.3 ms on the fast path,
~3 ms on the slow one): an answer of 20,000 keys decoded in one go held the event loop
~35 ms, while every chat stream on the peer waited (``scripts/bench_listing_fanout.py``)."""
MAX_CREATED_MS = 2**63 - 1


def list_answer_limit(limit: int, keys: bool, row_bytes: int = MAX_ROW_BYTES) -> int:
    """The largest answer to a ``list`` of ``limit`` rows (or keys) an asker takes, commas and
    the frame's keys included: with the default ``row_bytes`` an honest owner's answer can
    never need more; a swarm-wide listing may allow its rows less (:func:`row_allowance`)."""
    return limit * ((KEY_BYTES if keys else row_bytes) + 1) + 256


def row_allowance(rows: int, budget: int) -> int:
    """Bytes a listing of ``rows`` rows allows each (on average over a peer's answer) when it
    may hold ``budget`` bytes of rows in all: its share, never less than the longest honest
    row (:data:`HONEST_ROW_BYTES`: honest rows always fit) nor more than :data:`MAX_ROW_BYTES`."""
    return min(MAX_ROW_BYTES, max(budget // max(rows, 1), HONEST_ROW_BYTES))


MAX_ANSWER_BYTES = max(list_answer_limit(MAX_LIST_ROWS, False), list_answer_limit(SWARM_LIST_WINDOW, True))
"""The largest answer of any kind (what the owner may send; an asker allows each answer only
what its request needs, :func:`answer_limit`). Until 2026-12-06 a listing answer was bounded
at 1 KiB a row for up to 20 000 rows, so a peer whose rows were longer (a 255-character
filename outside ASCII is 1.5-3 KiB) was left out of every swarm-wide listing deeper than
~7 000 rows."""
OPS = ("meta", "read", "delete", "list", "usage")

ERRORS: dict[str, type[InclavateError]] = {
    "not_found": ArtifactNotFound,
    "not_ready": ArtifactNotReady,
    "too_large": ArtifactTooLarge,
    "quota": QuotaExceeded,
    "bad_request": BadArtifactRequest,
    "malformed_id": MalformedId,
    "malformed_range": RangeMalformed,
    "unsatisfiable_range": RangeNotSatisfiable,
    "busy": OwnerBusy,  # before its base class: refusal() takes the first code that fits
    "unavailable": ArtifactUnavailable,
}
_CODES = {cls: code for code, cls in ERRORS.items()}


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


# -- the owner decodes requests and encodes refusals ----------------------------------


def decode_request(raw: bytes) -> dict[str, Any]:
    """``{"op", "id"[, "offset", "length"]}``, ``{"op": "list", "query": ListQuery}`` or ``{"op": "usage"}``."""
    if len(raw) > MAX_REQUEST_BYTES:
        raise BadArtifactRequest("request too large")
    try:
        body = parse_json(raw, max_bytes=MAX_REQUEST_BYTES)
    except Malformed as exc:  # deep nesting too: json.loads raised RecursionError past the handler
        raise BadArtifactRequest(f"request is not JSON: {exc}") from exc
    if not isinstance(body, dict) or body.get("op") not in OPS:
        raise BadArtifactRequest("request must be an object with a known op")
    op = body["op"]
    if op in ("meta", "read", "delete"):
        out: dict[str, Any] = {"op": op, "id": parse_id(_str(body.get("id"), 36, "id"))}
        if op == "read":
            out["offset"] = _whole(body.get("offset"), 0, MAX_OFFSET, "offset")
            out["length"] = _whole(body.get("length"), 1, MAX_PIECE, "length")
        return out
    if op == "usage":
        return {"op": op}
    keys = body.get("keys") is True
    return {"op": op, "keys": keys, "query": _decode_query(body, SWARM_LIST_WINDOW if keys else MAX_LIST_ROWS)}


def _decode_query(body: dict[str, Any], most: int) -> ListQuery:
    limit = body.get("limit")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= most:
        raise BadArtifactRequest(f"limit must be a whole number from 1 to {most}")
    kind = body.get("kind")
    if kind is not None and kind not in KINDS:
        raise BadArtifactRequest("unknown kind")
    purpose = body.get("purpose")
    after = body.get("after")
    if after is not None:
        if not (isinstance(after, list) and len(after) == 2):
            raise BadArtifactRequest("after must be [created_at_ms, id]")
        after = (_whole(after[0], 0, 2**63 - 1, "after's created_at_ms"), parse_id(_str(after[1], 36, "after id")))
    return ListQuery(
        limit=limit, kind=kind, files_only=body.get("files_only") is True,
        purpose=None if purpose is None else _str(purpose, MAX_PURPOSE_CHARS, "purpose"),
        after=after, ascending=body.get("ascending") is True,
    )  # fmt: skip


def _str(value: object, limit: int, what: str) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise BadArtifactRequest(f"{what} must be a string of at most {limit} characters")
    return value


def _whole(value: object, low: int, high: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadArtifactRequest(f"{what} must be a whole number from {low} to {high}")
    return value


def piece_header(offset: int, length: int) -> str:
    """A decoded read as the ``Range`` header the owner's store parses: the store's one
    parser clamps the end and refuses a start past the object (416 with its size), for a
    peer's read as for an HTTP client's."""
    return f"bytes={offset}-{offset + length - 1}"


def refusal(exc: InclavateError) -> dict[str, Any]:
    """The answer that makes the asker raise ``exc``'s type with its message."""
    code = next((c for cls, c in _CODES.items() if isinstance(exc, cls)), "unavailable")
    answer: dict[str, Any] = {"ok": False, "error": code, "message": str(exc)[:1000]}
    if isinstance(exc, RangeNotSatisfiable):
        answer["size"] = exc.size
    return answer


# -- the asker encodes requests and decodes answers -----------------------------------


def read_request(id_: str, offset: int, length: int) -> dict[str, Any]:
    return {"op": "read", "id": id_, "offset": offset, "length": length}


def list_request(query: ListQuery, keys: bool = False) -> dict[str, Any]:
    """A listing of ``query``'s rows (at most :data:`MAX_LIST_ROWS`), or of their sort keys."""
    return {
        "op": "list", "limit": query.limit, "kind": query.kind, "files_only": query.files_only,
        "purpose": query.purpose, "after": list(query.after) if query.after else None, "ascending": query.ascending,
        "keys": keys,
    }  # fmt: skip


def answer_limit(request: dict[str, Any]) -> int:
    """The largest frame an honest owner answers ``request`` (one we encoded) with."""
    if request["op"] == "list":
        return list_answer_limit(request["limit"], request["keys"] is True)
    return MAX_RECORD_ANSWER_BYTES


def decode_answer(raw: bytes, peer: str) -> dict[str, Any]:
    """The answer if ok; the owner's refusal raised as our own exception type otherwise."""
    try:
        answer = parse_json(raw, max_bytes=MAX_ANSWER_BYTES)
    except Malformed:
        answer = None
    if not isinstance(answer, dict):
        raise ArtifactUnavailable(f"peer {peer} sent a malformed answer")
    if answer.get("ok") is True:
        return answer
    code, message = answer.get("error"), str(answer.get("message", "refused"))[:1000]
    cls = ERRORS.get(code) if isinstance(code, str) else None
    if cls is RangeNotSatisfiable:
        size = answer.get("size")
        raise RangeNotSatisfiable(message, size if isinstance(size, int) and size >= 0 else 0)
    if cls is None:
        raise ArtifactUnavailable(f"peer {peer} refused: {message}")
    raise cls(message)


def decode_meta(record: object, peer: str, id_: str) -> ArtifactMeta:
    """The metadata ``peer`` sent of ``id_``, the artifact it was asked about."""
    meta = _meta(record, peer)
    if meta.id != id_:
        raise ArtifactUnavailable(f"peer {peer} described an artifact it was not asked about")
    return meta


def decode_page(answer: dict[str, Any], peer: str, limit: int, owners: Owners) -> ArtifactPage:
    """A ``list`` answer: at most ``limit`` rows, each of an id ``peer`` owns among ``owners``
    (:meth:`~inclavate.owner_ids.Owners.carries_owner`). A peer speaks only for its own
    artifacts: a listing's rows used to be taken whatever their ids, so a peer could list
    another owner's artifact under a forged filename, size and digest beside the real one
    in every swarm-wide listing; then whatever their ids past the first 32 bits, so could
    a peer whose identity was ground to that owner's 32-bit tag."""
    rows = answer.get("artifacts")
    if not isinstance(rows, list) or len(rows) > limit:
        raise ArtifactUnavailable(f"peer {peer} sent a malformed listing")
    metas = [_meta(r, peer) for r in rows]
    if not all(_canonical(m.id) and owners.carries_owner(m.id, peer) for m in metas):
        raise ArtifactUnavailable(f"peer {peer} listed an artifact it does not own, or under no UUID")
    return ArtifactPage(metas, truncated=answer.get("truncated") is True)


def _canonical(id_: str) -> bool:
    """Whether a row's id is a UUID as this peer writes it (lowercase): a row's id was taken
    as any 36 characters, and one that was not hex escaped the listing as a ValueError."""
    try:
        return parse_id(id_) == id_
    except MalformedId:
        return False


def _meta(record: object, peer: str) -> ArtifactMeta:
    try:
        if not isinstance(record, dict):
            raise ValueError("not an object")
        return ArtifactMeta.from_record(record)
    except ValueError as exc:
        raise ArtifactUnavailable(f"peer {peer} sent malformed artifact metadata: {exc}") from exc


def decode_keys(answer: dict[str, Any], peer: str, query: ListQuery, owners: Owners) -> KeyPage:
    """A ``keys`` listing, decoded in one go (:func:`decode_keys_in_steps`)."""
    steps = decode_keys_in_steps(answer, peer, query, owners)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def decode_keys_in_steps(answer: dict[str, Any], peer: str, query: ListQuery,
                         owners: Owners) -> Generator[None, None, KeyPage]:  # fmt: skip
    """A ``keys`` listing: at most ``query.limit`` keys of ids ``peer`` owns among ``owners``
    (a peer places only its own rows), strictly in ``query``'s order (the merge relies on it)
    and after its cursor: keys before it would lead the page, and its last row would walk a
    client's cursor back over rows it was already shown.

    Yields after each :data:`KEYS_PER_STEP` keys, so the asker lets other tasks run between
    (:func:`inclavate.fan_out.in_steps`); returns the page (``StopIteration.value``). Keys are
    checked, then their order, in the same order as ever, so a peer's garbage raises what it
    raised when it was decoded in one go."""
    raw = answer.get("keys")
    if not isinstance(raw, list) or len(raw) > query.limit:
        raise ArtifactUnavailable(f"peer {peer} sent a malformed key listing")
    keys: list[SortKey] = []
    for start in range(0, len(raw), KEYS_PER_STEP):
        keys += _sort_keys(raw[start : start + KEYS_PER_STEP], peer, owners)
        yield
    for start in range(0, len(keys), KEYS_PER_STEP):
        if not _in_order(keys[start : start + KEYS_PER_STEP + 1], query.ascending):
            raise ArtifactUnavailable(f"peer {peer} listed keys out of order")
        yield
    after = query.after
    if keys and after is not None and not ((keys[0] > after) if query.ascending else (keys[0] < after)):
        raise ArtifactUnavailable(f"peer {peer} listed keys that are not after the listing's cursor")
    # "More past these" only from a peer that filled the limit: a store says it no other way,
    # and believed from one that did not, it kept a swarm's last page "truncated" for ever.
    return KeyPage(keys, truncated=answer.get("truncated") is True and len(keys) == query.limit)


def _in_order(keys: list[SortKey], ascending: bool) -> bool:
    """Whether ``keys`` are strictly ascending (or descending): each pair compared in C."""
    return all(map(operator.lt if ascending else operator.gt, keys, keys[1:]))


def _sort_keys(items: list[Any], peer: str, owners: Owners) -> list[SortKey]:
    """``items`` as sort keys, all checked: at once when every one is well formed and of an id
    ``peer`` minted (:func:`_own_keys`); else one by one, which says what is wrong, and takes
    what else a key may be (an id in capitals, normalised; a legacy id)."""
    prefix = owners.prefix(peer)
    fast = _own_keys(items, prefix) if prefix is not None else None
    return fast if fast is not None else [_sort_key(item, peer, owners) for item in items]


def _own_keys(items: list[Any], prefix: str) -> list[SortKey] | None:
    """``items`` as sort keys if each is ``[created_at_ms, id]`` with ``created_at_ms`` a whole
    number in range and ``id`` a canonical UUID beginning with ``prefix`` (so ``peer``'s:
    :meth:`~inclavate.owner_ids.Owners.prefix`); None if any is not. A few C-level passes
    and one regex over the ids joined, where :func:`_sort_key` made ~8 Python calls a key
    (~1.7 us; ~0.3 us a key here)."""
    if set(map(type, items)) != {list} or set(map(len, items)) != {2}:
        return None
    created, ids = zip(*items)
    if set(map(type, created)) != {int} or min(created) < 0 or max(created) > MAX_CREATED_MS:
        return None
    if set(map(type, ids)) != {str} or set(map(len, ids)) != {36}:  # so no id holds two, joined
        return None
    if _owned_ids(prefix).fullmatch("\n".join(ids) + "\n") is None:
        return None
    return list(zip(created, ids))


def _owned_ids(prefix: str) -> re.Pattern[str]:
    """Canonical ids beginning with ``prefix``, each followed by a newline (which no id holds),
    one after another. ``re`` keeps the patterns it compiled (at most 512, its own bound)."""
    return re.compile(f"(?:{re.escape(prefix)}-[0-9a-f]{{4}}-[0-9a-f]{{12}}\n)+")


def _sort_key(item: object, peer: str, owners: Owners) -> SortKey:
    try:
        if not (isinstance(item, list) and len(item) == 2):
            raise BadArtifactRequest("a key is [created_at_ms, id]")
        key = (_whole(item[0], 0, MAX_CREATED_MS, "created_at_ms"), parse_id(_str(item[1], 36, "id")))
    except (BadArtifactRequest, MalformedId) as exc:
        raise ArtifactUnavailable(f"peer {peer} sent a malformed key: {exc}") from exc
    if not owners.carries_owner(key[1], peer):
        raise ArtifactUnavailable(f"peer {peer} listed an artifact it does not own")
    return key


def decode_usage(answer: dict[str, Any], peer: str) -> Usage:
    try:
        return Usage.from_json(answer)
    except ValueError as exc:
        raise ArtifactUnavailable(f"peer {peer} sent a malformed usage answer: {exc}") from exc


def decode_piece(answer: dict[str, Any], meta: ArtifactMeta, offset: int, length: int, peer: str) -> None:
    """A read's answer must describe the object the asker is reading (``meta``, from its
    ``meta`` answer: the same id, size and digest) and serve exactly the bytes it asked for;
    the asker asks only for bytes inside the object, so there is nothing to clamp."""
    got = decode_meta(answer.get("artifact"), peer, meta.id)
    if (got.size_bytes, got.digest) != (meta.size_bytes, meta.digest):
        raise ArtifactUnavailable(f"peer {peer} served artifact {meta.id} with another size or digest than it described")
    if answer.get("range") != [offset, offset + length - 1]:
        raise ArtifactUnavailable(f"peer {peer} served another range than the one asked for")
