"""Model endpoints: ``/v1/models`` (and ``/v1/models/:id``), ``/api/models``, ``/models/registry``,
``/admin/chain/:id``."""

from __future__ import annotations

import logging
from typing import Any

import trio
from quart import jsonify
from quart_trio import QuartTrio

from api.auth import require_admin
from api.context import PeerContext
from api.errors import NotFound
from inclavate.errors import InclavateError
from inclavate.types import ModelId
from p2p.coverage import ModelCoverage

log = logging.getLogger(__name__)

# Text-only models until the projector issue lands; the spec's fields are present and honest.
_DECODER_REQUIREMENTS_UNKNOWN = {"m_rope": None, "non_causal_media": None}
_CAPABILITY_TIMEOUT = 10.0


def _ranges(ranges: Any) -> list[list[int]]:
    return [[r.start, r.end] for r in ranges]


async def _capabilities(ctx: PeerContext, model_id: str) -> dict[str, Any]:
    """Per-model facts derived from its GGUF metadata (the chat template, the projector).

    Only from what this peer already has on disk: a listing must never make it fetch a
    stranger's vocabulary file (and compile its template). A model this peer cannot read
    yet reports no reasoning levels and no tools until its first chat fetches the file."""
    levels: list[str] = []
    tools = False
    with trio.move_on_after(_CAPABILITY_TIMEOUT):
        try:
            chat = await ctx.local_chat_model(model_id)
            if chat is not None:
                levels, tools = chat.reasoning_levels, chat.supports_tools
        except InclavateError as exc:
            log.info("capabilities of %s unavailable: %s", model_id, exc)
    return {
        "input_modalities": ["text"],
        "supports_tools": tools,
        "supports_video_files": False,
        "reasoning_effort_levels": levels,
        "projector_state": "missing",
        "decoder_requirements": dict(_DECODER_REQUIREMENTS_UNKNOWN),
        "unsupported_reason": None,
    }


def openai_model(model_id: str) -> dict[str, Any]:
    """One model in OpenAI's shape; the listing and the single read build it here, so the
    SDK's ``models.retrieve`` and ``models.list`` cannot disagree."""
    return {"id": model_id, "object": "model", "owned_by": "dppan"}


def coverage_json(cov: ModelCoverage) -> dict[str, Any]:
    return {
        "id": cov.model_id,
        "n_layers": cov.n_layers,
        "d_model": cov.d_model,
        "node_count": cov.node_count,
        "active_nodes": cov.states["Ready"] - cov.states["Idle"],
        "idle_nodes": cov.states["Idle"],
        "joining_nodes": cov.states["Joining"],
        "degraded_nodes": cov.states["Degraded"],
        "dead_nodes": cov.states["Dead"],
        "covered": _ranges(cov.ranges),
        "gaps": _ranges(cov.gaps),
        "chain_complete": cov.chain_complete,
        "total_vram_mb": cov.total_vram_mb,
    }


def listed_models(ctx: PeerContext) -> list[ModelId]:
    """Models with a node that has not left: a departed node's record stays, Dead, until the
    registry drops it (~60 s), and its model must not be offered all that time."""
    return [model for model, cov in ctx.coverage().items() if cov.node_count > cov.states.get("Dead", 0)]


def install(app: QuartTrio, ctx: PeerContext) -> None:
    @app.get("/v1/models")
    async def openai_models():  # type: ignore[no-untyped-def]
        """OpenAI-compatible list of the models the swarm serves."""
        return jsonify(
            object="list",
            data=[openai_model(m) for m in listed_models(ctx)],
        )

    @app.get("/v1/models/<path:model_id>")
    async def openai_model_by_id(model_id: str):  # type: ignore[no-untyped-def]
        """One model of the ``/v1/models`` list (OpenAI's ``models.retrieve``).

        ``path:`` because an id is matched whole: ``smollm2:135m`` has a colon, and an id a
        peer announces is not held to the catalog's pattern, so it may hold a ``/`` (the SDK
        sends it as ``%2F``, which arrives decoded)."""
        if model_id not in listed_models(ctx):
            raise NotFound(f"no node serves model {model_id!r}")
        return jsonify(openai_model(model_id))

    @app.get("/api/models")
    async def live_models():  # type: ignore[no-untyped-def]
        """Live coverage of every model with registered nodes, plus capabilities."""
        out = []
        for cov in ctx.coverage().values():
            out.append({**coverage_json(cov), **await _capabilities(ctx, cov.model_id)})
        return jsonify(out)

    @app.get("/models/registry")
    async def model_registry():  # type: ignore[no-untyped-def]
        """The catalog plus the local overlay, including models no node serves."""
        engine = ctx.local_engine()
        return jsonify([
            {
                "model_id": spec.model_id,
                "n_layers": spec.n_layers,
                "d_model": spec.d_model,
                "gguf_sha256": spec.gguf_sha256,
                "quant_type": spec.quant_type,
                "arch": spec.arch,
                "engine_loaded": engine is not None and engine[1] == spec.model_id,
                "source": spec.source,
                "input_modalities": list(spec.input_modalities),
                "projector_state": "missing",
                "decoder_requirements": dict(_DECODER_REQUIREMENTS_UNKNOWN),
                "unsupported_reason": None,
            }
            for spec in ctx.catalog()
        ])  # fmt: skip

    @app.get("/admin/chain/<model_id>")
    async def admin_chain(model_id: str):  # type: ignore[no-untyped-def]
        """Which layer ranges of a model are covered (admin)."""
        require_admin(ctx.admin_token)
        cov = ctx.coverage().get(model_id)  # type: ignore[call-overload]
        if cov is not None:
            return jsonify(model_id=cov.model_id, n_layers=cov.n_layers, covered=_ranges(cov.ranges),
                           gaps=_ranges(cov.gaps), ready=cov.chain_complete)  # fmt: skip
        # A model of the registry (``/models/registry``) that no node serves is one whole gap,
        # as a chat with it is a 503 (a chain gap), not a 404 (2026-12-07, an audit from outside).
        spec = next((spec for spec in ctx.catalog() if spec.model_id == model_id), None)
        if spec is None:
            raise NotFound(f"model {model_id!r} is neither served by a node nor in the registry")
        return jsonify(model_id=spec.model_id, n_layers=spec.n_layers, covered=[], gaps=[[0, spec.n_layers]], ready=False)
