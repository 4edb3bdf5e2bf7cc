"""``GET /openapi.json``: an OpenAPI 3.1 document generated from the routes actually served.

Paths and methods come from the app's URL map, so the document cannot list a route that is
not served or miss one that is; summaries come from the handlers' docstrings. Request and
response schemas are written out for the main contracts (chat, responses, errors).
"""

from __future__ import annotations

import re
from typing import Any

from quart_trio import QuartTrio

from api.chat_request import ChatRequest

_ERROR = {
    "oneOf": [
        {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]},
        {
            "type": "object",
            "properties": {
                "error": {
                    "type": "object",
                    "properties": {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": {"type": ["string", "null"]},
                        "code": {"type": "string"},
                    },
                    "required": ["message", "type", "code"],
                }
            },
            "required": ["error"],
        },
    ]
}

_MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"enum": ["system", "user", "assistant", "tool", "developer"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}, {"type": "null"}]},
    },
    "required": ["role"],
}

CHAT_REQUEST = {
    "type": "object",
    "properties": {
        "model": {"type": "string"},
        "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
        "max_tokens": {"type": "integer", "minimum": 1, "default": ChatRequest.max_tokens},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2, "default": ChatRequest.temperature},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": ChatRequest.top_p},
        "stream": {"type": "boolean", "default": False},
        "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]},
        "seed": {"type": "integer"},
        "thinking": {"type": "boolean"},
        "reasoning_effort": {"type": "string"},
        "tools": {"type": "array", "items": {"type": "object"}},
        "tool_choice": {},
        "parallel_tool_calls": {"type": "boolean", "default": True},
    },
    "required": ["model", "messages"],
}

_INPUT_ITEM = {
    "type": "object",
    "properties": {
        "type": {"enum": ["message"]},
        "role": {"enum": ["user", "assistant", "system", "developer"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object", "properties": {
            "type": {"enum": ["input_text", "output_text"]}, "text": {"type": "string"}}, "required": ["type", "text"]}}]},
    },
    "required": ["role", "content"],
}

RESPONSES_REQUEST = {
    "type": "object",
    "description": "OpenAI's Responses API, text only (api/responses_request.py says what is refused)",
    "properties": {
        "model": {"type": "string"},
        "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": _INPUT_ITEM, "minItems": 1}]},
        "instructions": {"type": "string"},
        "max_output_tokens": {"type": "integer", "minimum": 1, "default": ChatRequest.max_tokens},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2, "default": ChatRequest.temperature},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": ChatRequest.top_p},
        "stream": {"type": "boolean", "default": False},
        "metadata": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 512}, "maxProperties": 16},
        "user": {"type": "string"},
        "store": {"type": "boolean", "description": "accepted; nothing is stored"},
        "text": {"type": "object", "properties": {"format": {"type": "object", "properties": {"type": {"enum": ["text"]}}}}},
    },
    "required": ["model", "input"],
}

GENERATION_REQUEST = {
    "type": "object",
    "properties": {
        "model": {"type": "string"},
        "modality": {"enum": ["audio", "image", "video", "text"]},
        "params": {"type": "object"},
        "seed": {"type": "integer", "minimum": 0},
        "input_artifacts": {"type": "array", "items": {"type": "string", "format": "uuid"}, "maxItems": 16},
        "idempotency_key": {"type": "string", "maxLength": 255},
        "deadline_seconds": {"type": "number", "exclusiveMinimum": 0, "maximum": 86400},
    },
    "required": ["model", "modality"],
}

SPEECH_REQUEST = {
    "type": "object",
    "properties": {
        "model": {"type": "string"},
        "input": {"type": "string"},
        "voice": {"type": "string"},
        "response_format": {"enum": ["wav"]},
        "stream_format": {"enum": ["audio"]},
        "speed": {"type": "number"},
        "language": {"type": "string"},
        "instruct": {"type": "string"},
        "max_duration_seconds": {"type": "number", "exclusiveMinimum": 0},
    },
    "required": ["model", "input"],
}

NODE_REGISTRATION = {
    "type": "object",
    "properties": {
        "node_id": {"type": "string"},
        "model_id": {"type": "string"},
        "http_url": {"type": "string", "description": "http(s) URL; must answer GET /health"},
        "relay_token": {"type": "string", "minLength": 16, "description": "the node's secret; heartbeats and leave present it"},
        "start_layer": {"type": "integer", "minimum": 0},
        "end_layer": {"type": "integer", "minimum": 1},
        "layers": {"type": "string"},
        "n_total_layers": {"type": "integer"},
        "d_model": {"type": "integer"},
        "vram_mb": {"type": "integer", "minimum": 0},
        "hardware": {"type": "object"},
    },
    "required": ["node_id", "model_id", "http_url", "relay_token"],
}

NODE_HEARTBEAT = {
    "type": "object",
    "properties": {
        "tokens_generated": {"type": "integer", "minimum": 0},
        "requests_served": {"type": "integer", "minimum": 0},
        "errors": {"type": "integer", "minimum": 0},
        "avg_latency_ms": {"type": "number", "minimum": 0},
        "peak_vram_mb": {"type": "integer", "minimum": 0},
        "ready": {"type": "boolean"},
    },
}

_BODIES: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/v1/chat/completions"): CHAT_REQUEST,
    ("post", "/v1/responses"): RESPONSES_REQUEST,
    ("post", "/v1/generations"): GENERATION_REQUEST,
    ("post", "/v1/audio/speech"): SPEECH_REQUEST,
    ("post", "/nodes"): NODE_REGISTRATION,
    ("post", "/nodes/join"): NODE_REGISTRATION,
    ("post", "/nodes/{node_id}/health"): NODE_HEARTBEAT,
}

_STATUS = {
    ("post", "/v1/chat/completions"): ["200", "400", "413", "422", "429", "503"],
    ("post", "/v1/responses"): ["200", "400", "413", "422", "429", "503"],
    ("get", "/v1/models/{model_id}"): ["200", "404"],
    ("post", "/v1/artifacts"): ["201", "400", "408", "413", "503", "507"],
    ("get", "/v1/artifacts"): ["200", "400", "503"],
    ("get", "/v1/artifacts/usage"): ["200", "503"],
    ("get", "/v1/artifacts/{artifact_id}"): ["200", "206", "400", "404", "409", "416", "503"],
    ("get", "/v1/artifacts/{artifact_id}/meta"): ["200", "400", "404", "503"],
    ("delete", "/v1/artifacts/{artifact_id}"): ["204", "400", "404", "503"],
    ("post", "/v1/files"): ["201", "400", "408", "413", "503", "507"],
    ("get", "/v1/files"): ["200", "400", "404", "503"],
    ("get", "/v1/files/{file_id}"): ["200", "400", "404", "503"],
    ("get", "/v1/files/{file_id}/content"): ["200", "206", "400", "404", "409", "416", "503"],
    ("delete", "/v1/files/{file_id}"): ["200", "400", "404", "503"],
    ("get", "/v1/generations/capabilities"): ["200", "503"],
    ("post", "/v1/generations"): ["202", "400", "409", "422", "429", "503"],
    ("get", "/v1/generations"): ["200", "400", "503"],
    ("get", "/v1/generations/{job_id}"): ["200", "400", "404", "503"],
    ("get", "/v1/generations/{job_id}/events"): ["200", "400", "404", "429", "503"],
    ("delete", "/v1/generations/{job_id}"): ["200", "400", "404", "409", "503"],
    ("delete", "/admin/generations/{job_id}"): ["200", "401", "404", "409", "500", "503"],
    ("post", "/v1/audio/speech"): ["200", "400", "422", "429", "503", "504"],
    ("post", "/v1/audio/music"): ["200", "400", "422", "429", "503", "504"],
    ("post", "/v1/audio/transcriptions"): ["200", "400", "413", "429", "503", "504"],
}

_BINARY = {"type": "string", "format": "binary"}
_UPLOADS: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/v1/artifacts"): {"*/*": {"schema": _BINARY}},
    ("post", "/v1/files"): {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "properties": {"purpose": {"enum": ["assistants", "user_data", "vision"]}, "file": _BINARY},
                "required": ["purpose", "file"],
            }
        }
    },
    ("post", "/v1/audio/transcriptions"): {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "properties": {
                    "file": _BINARY,
                    "model": {"type": "string"},
                    "response_format": {"enum": ["json", "text"]},
                    "prompt": {"type": "string"},
                    "language": {"type": "string"},
                    "temperature": {"type": "number"},
                },
                "required": ["file", "model"],
            }
        }
    },
}


def _query(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema}


_QUERIES: dict[tuple[str, str], list[dict[str, Any]]] = {
    ("get", "/v1/artifacts"): [
        _query("limit", {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}),
        _query("offset", {"type": "integer", "minimum": 0, "default": 0}),
        _query("kind", {"enum": ["generated", "uploaded"]}),
    ],
    ("get", "/v1/files"): [
        _query("limit", {"type": "integer", "minimum": 1, "maximum": 10000}),
        _query("after", {"type": "string", "format": "uuid"}),
        _query("order", {"enum": ["asc", "desc"]}),
        _query("purpose", {"type": "string"}),
    ],
    ("get", "/v1/artifacts/{artifact_id}"): [
        {"name": "Range", "in": "header", "required": False, "schema": {"type": "string"}},
    ],
}


def _path(rule: str) -> tuple[str, list[str]]:
    params = re.findall(r"<(?:[a-z]+:)?([a-zA-Z_]+)>", rule)
    return re.sub(r"<(?:[a-z]+:)?([a-zA-Z_]+)>", r"{\1}", rule), params


def openapi_document(app: QuartTrio, version: str) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        path, params = _path(rule.rule)
        view = app.view_functions[rule.endpoint]
        summary = (view.__doc__ or "").strip().split("\n")[0] or rule.endpoint
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            key = (method.lower(), path)
            operation: dict[str, Any] = {
                "summary": summary,
                "operationId": f"{method.lower()}_{rule.endpoint}",
                "responses": {
                    code: {"description": code} for code in _STATUS.get(key, ["200"])
                } | {"default": {"description": "error", "content": {"application/json": {"schema": _ERROR}}}},
            }
            parameters = [
                {"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in params
            ] + _QUERIES.get(key, [])
            if parameters:
                operation["parameters"] = parameters
            if key in _BODIES:
                operation["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": _BODIES[key]}},
                }
            if key in _UPLOADS:
                operation["requestBody"] = {"required": True, "content": _UPLOADS[key]}
            if path.startswith("/admin/"):
                operation["security"] = [{"adminToken": []}]
            if rule.websocket:
                operation["x-websocket"] = True
            paths.setdefault(path, {})[method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "Inclavate", "version": version},
        "paths": dict(sorted(paths.items())),
        "components": {
            "securitySchemes": {"adminToken": {"type": "apiKey", "in": "header", "name": "X-Admin-Token"}}
        },
    }
