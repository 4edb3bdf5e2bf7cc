"""Another peer's answer to ``GET /v1/generations``, read as strictly as this peer writes
its own rows (:meth:`inclavate.jobs.Job.to_json`, ``GenerationService._listed``).

A swarm-wide job listing hands other peers' rows to the HTTP client, so a row is taken only
when it is one this peer could have produced: every field of the spec's job record with its
type and bound (:mod:`inclavate.jobs`' ``MAX_*``), timestamps in the spec's one format
(``2026-08-06T09:14:22.981Z``, so they sort as text), and an id (and output artifact ids)
the answering peer owns (:meth:`inclavate.owner_ids.Owners.carries_owner`: its whole owner
tag, or a legacy id's 32 bits): a peer speaks only for its own jobs, as in artifact
listings (``p2p/artifact_wire.py::decode_page``). Fields the spec does not name are dropped.
An answer with one bad row, more rows than asked, or an id twice is :class:`Malformed` as a
whole (the peer is left out of the page), so what a client sees is never a blob a peer chose.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from inclavate.jobs import (
    MAX_ERROR_CODE_CHARS,
    MAX_ERROR_MESSAGE_CHARS,
    MAX_INPUT_ARTIFACTS,
    MAX_MODEL_CHARS,
    MAX_OUTPUT_ARTIFACTS,
    MAX_PARAMS_BYTES,
    MAX_STAGE_CHARS,
)
from inclavate.owner_ids import MalformedId, parse_id
from inclavate.untrusted import (
    INT64_MAX,
    Malformed,
    Reason,
    as_float,
    as_int,
    as_list,
    as_str,
)
from node.generators.base import MODALITIES

Owns = Callable[[str], bool]
"""Whether the answering peer owns a (canonical) id: ``functools.partial(Owners.carries_owner, peer=...)``."""

STATES = frozenset({"queued", "running", "completed", "failed", "cancelled", "expired"})
_TIMESTAMP = re.compile(r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])T([01]\d|2[0-3]):[0-5]\d:[0-5]\d\.\d{3}Z")
""":func:`inclavate.jobs.rfc3339`'s format, the spec's (``created_at`` sorts the listing)."""
ROWS_PER_STEP = 100
"""Rows checked between two chances for other tasks to run (~1-2 ms of event loop)."""


@dataclass(frozen=True)
class PeerJobPage:
    rows: list[dict[str, Any]]
    """In the listing's order (newest first), each rebuilt field by field."""
    truncated: bool
    """The peer filled the window and says it has more (a claim with fewer rows is ignored)."""


def decode_job_page_in_steps(body: object, owns: Owns, window: int) -> Generator[None, None, PeerJobPage]:
    """A peer's listing of at most ``window`` rows of its own jobs, or :class:`Malformed`.

    Yields after each :data:`ROWS_PER_STEP` rows, so the asker lets other tasks run between
    (:func:`inclavate.fan_out.in_steps`): a full window of 1,000 rows took ~17 ms of checks on
    a busy core, and 16 answers arriving together held the event loop for their sum. Returns
    the page (``StopIteration.value``); rows are checked in their order, then their ids, so a
    peer's garbage raises what it raised when the page was decoded in one go."""
    if not isinstance(body, dict):
        raise Malformed(Reason.WRONG_TYPE, "listing", "must be an object")
    raw = as_list(body.get("generations"), "generations", max_len=window)
    rows: list[dict[str, Any]] = []
    for start in range(0, len(raw), ROWS_PER_STEP):
        rows += [decode_job_row(item, owns) for item in raw[start : start + ROWS_PER_STEP]]
        yield
    if len({row["id"] for row in rows}) != len(rows):
        raise Malformed(Reason.BAD_VALUE, "generations", "lists one job twice")
    # "More past these" only from a peer that filled the window: believed from one that did
    # not, it kept a swarm's last page "truncated" for ever.
    return PeerJobPage(rows, truncated=body.get("truncated") is True and len(rows) == window)


def decode_job_row(item: object, owns: Owns) -> dict[str, Any]:
    """One row, rebuilt from the spec's fields only, each checked (:class:`Malformed`)."""
    if not isinstance(item, dict):
        raise Malformed(Reason.WRONG_TYPE, "generation", "must be an object")
    state = as_str(item.get("state"), "state", max_len=16, choices=STATES)
    outputs = _ids(item.get("output_artifacts"), "output_artifacts", MAX_OUTPUT_ARTIFACTS, owns)
    row = {
        "id": _own_id(item.get("id"), "id", owns),
        "state": state,
        "modality": as_str(item.get("modality"), "modality", max_len=16, choices=frozenset(MODALITIES)),
        "model": as_str(item.get("model"), "model", max_len=MAX_MODEL_CHARS),
        "seed": None if item.get("seed") is None else as_int(item["seed"], "seed", lo=0, hi=INT64_MAX),
        "params": _params(item.get("params")),
        "input_artifacts": _ids(item.get("input_artifacts"), "input_artifacts", MAX_INPUT_ARTIFACTS, None),
        "output_artifacts": outputs,
        "progress_stage": _optional_str(item.get("progress_stage"), "progress_stage", MAX_STAGE_CHARS),
        "progress_fraction": None if item.get("progress_fraction") is None
        else as_float(item["progress_fraction"], "progress_fraction", lo=0.0, hi=1.0),
        "error_code": _optional_str(item.get("error_code"), "error_code", MAX_ERROR_CODE_CHARS),
        "error_message": _optional_str(item.get("error_message"), "error_message", MAX_ERROR_MESSAGE_CHARS),
        "created_at": _timestamp(item.get("created_at"), "created_at"),
        "started_at": _optional_timestamp(item.get("started_at"), "started_at"),
        "completed_at": _optional_timestamp(item.get("completed_at"), "completed_at"),
        "expires_at": _timestamp(item.get("expires_at"), "expires_at"),
        "artifacts_deleted": as_int(item.get("artifacts_deleted"), "artifacts_deleted", lo=0, hi=MAX_OUTPUT_ARTIFACTS),
    }  # fmt: skip
    if outputs and state != "completed":
        raise Malformed(Reason.BAD_VALUE, "output_artifacts", "only a completed job has outputs")
    return row


def _own_id(value: object, field: str, owns: Owns | None) -> str:
    """A UUID, canonical; with ``owns``, one the answering peer minted."""
    try:
        id_ = parse_id(as_str(value, field, max_len=36))
    except MalformedId:
        raise Malformed(Reason.BAD_VALUE, field, "must be a UUID") from None
    if owns is not None and not owns(id_):
        raise Malformed(Reason.BAD_VALUE, field, "names an id the answering peer does not own")
    return id_


def _ids(value: object, field: str, max_len: int, owns: Owns | None) -> list[str]:
    return [_own_id(item, field, owns) for item in as_list(value, field, max_len=max_len)]


def _params(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Malformed(Reason.WRONG_TYPE, "params", "must be an object")
    if len(json.dumps(value)) > MAX_PARAMS_BYTES:
        raise Malformed(Reason.TOO_LONG, "params", f"more than {MAX_PARAMS_BYTES} bytes")
    return value


def _optional_str(value: object, field: str, max_len: int) -> str | None:
    return None if value is None else as_str(value, field, max_len=max_len)


def _timestamp(value: object, field: str) -> str:
    text = as_str(value, field, max_len=24)
    if not _TIMESTAMP.fullmatch(text):
        raise Malformed(Reason.BAD_VALUE, field, "must be like 2026-08-06T09:14:22.981Z")
    return text


def _optional_timestamp(value: object, field: str) -> str | None:
    return None if value is None else _timestamp(value, field)
