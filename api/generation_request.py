"""``POST /v1/generations`` bodies: decoded JSON in, a :class:`inclavate.jobs.NewJob` out.

Pure, so the audio adapters (which build the same submission from OpenAI's fields) and the
tests share it. ``params`` is generator-specific and passed through untouched (the
generator checks it); everything else is checked here, each failure a 400 naming the field.
"""

from __future__ import annotations

import json
import math
from typing import Any

from api.errors import BadRequest
from api.query_params import list_page
from inclavate.generation_settings import MAX_DEADLINE_S
from inclavate.generations import LIST_MAX_LIMIT
from inclavate.jobs import MAX_INPUT_ARTIFACTS, MAX_MODEL_CHARS, MAX_PARAMS_BYTES, NewJob
from inclavate.owner_ids import MalformedId, parse_id
from node.generators.base import MODALITIES

MAX_KEY_CHARS = 255
LIST_DEFAULT_LIMIT = 100


def parse_generation(body: object, default_deadline_s: float) -> NewJob:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model or len(model) > MAX_MODEL_CHARS:
        raise BadRequest("model is required: a generator's model id from GET /v1/generations/capabilities")
    modality = body.get("modality")
    if modality not in MODALITIES:
        raise BadRequest(f"modality must be one of {', '.join(MODALITIES)}")
    params = body.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise BadRequest("params must be a JSON object")
    if len(json.dumps(params)) > MAX_PARAMS_BYTES:
        raise BadRequest(f"params take more than {MAX_PARAMS_BYTES} bytes")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise BadRequest("seed must be a non-negative integer")
    return NewJob(
        modality=modality,
        model=model,
        params=params,
        seed=seed,
        input_artifacts=parse_artifact_ids(body.get("input_artifacts")),
        idempotency_key=_key(body.get("idempotency_key")),
        deadline_s=_deadline(body.get("deadline_seconds"), default_deadline_s),
    )


def parse_artifact_ids(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_INPUT_ARTIFACTS:
        raise BadRequest(f"input_artifacts must be a list of at most {MAX_INPUT_ARTIFACTS} artifact ids")
    try:
        return tuple(parse_id(item) for item in value)
    except MalformedId as exc:
        raise BadRequest(f"input_artifacts: {exc}") from exc


def _key(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_KEY_CHARS:
        raise BadRequest(f"idempotency_key must be a non-empty string of at most {MAX_KEY_CHARS} characters")
    return value


def _deadline(value: Any, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise BadRequest("deadline_seconds must be a positive number")
    if value > MAX_DEADLINE_S:
        raise BadRequest(f"deadline_seconds may not exceed 24 hours ({MAX_DEADLINE_S})")
    return float(value)


def parse_page(args: Any) -> tuple[int, int]:
    """``?limit=`` (default 100, max 1000) and ``?offset=`` (default 0), read like every list
    route's (:mod:`api.query_params`); a swarm-wide listing bounds offset + limit too
    (``GenerationService.list``)."""
    return list_page(args, default_limit=LIST_DEFAULT_LIMIT, max_limit=LIST_MAX_LIMIT)
