"""``/v1/artifacts``: upload, list, usage, read (whole or one range), meta, delete.

Thin: parse the request, call :class:`inclavate.artifact_swarm.SwarmArtifacts` (which finds
the peer that owns an id), shape the answer. Errors are raised, and mapped to statuses in
``api/errors.py``; downloads (and their 416, which carries ``Content-Range``) are built in
``api/downloads.py``.
"""

from __future__ import annotations

from quart import jsonify, request
from quart_trio import QuartTrio

from api.context import PeerContext
from api.downloads import serve_artifact
from api.query_params import list_page
from api.uploads import RequestChunks, set_body_limit
from api.request_guard import takes_any_body
from api.responses import no_content
from inclavate.artifact_types import (
    KINDS,
    LIST_DEFAULT_LIMIT,
    LIST_MAX_LIMIT,
    ArtifactKind,
    ListQuery,
    media_type_of,
)


def install(app: QuartTrio, ctx: PeerContext) -> None:
    cap = ctx.limits.max_artifact_bytes
    set_body_limit(app, "POST", "/v1/artifacts", cap)

    @app.post("/v1/artifacts")
    @takes_any_body
    async def upload_artifact():  # type: ignore[no-untyped-def]
        """Upload an artifact: the body, streamed (at most 512 MiB); Content-Type is recorded."""
        artifacts = ctx.artifacts()
        media_type = media_type_of(request.headers.get("Content-Type"))
        meta = await artifacts.store.create(
            RequestChunks(), media_type=media_type, kind="uploaded", max_bytes=cap, declared_size=request.content_length
        )
        return jsonify(meta.to_json()), 201

    @app.get("/v1/artifacts")
    async def list_artifacts():  # type: ignore[no-untyped-def]
        """List artifacts, newest first (limit, offset, kind = generated | uploaded)."""
        limit, offset = list_page(request.args, default_limit=LIST_DEFAULT_LIMIT, max_limit=LIST_MAX_LIMIT)
        raw_kind = request.args.get("kind")
        # The spec: an unrecognised kind lists both rather than erroring.
        kind: ArtifactKind | None = raw_kind if raw_kind in KINDS else None  # type: ignore[assignment]
        page = await ctx.artifacts().list(ListQuery(limit=limit, offset=offset, kind=kind))
        return jsonify(artifacts=[m.to_json() for m in page.artifacts], truncated=page.truncated)

    @app.get("/v1/artifacts/usage")
    async def artifact_usage():  # type: ignore[no-untyped-def]
        """Bytes and objects stored (COUNT/SUM, split by origin) and the ceilings (0 = none)."""
        return jsonify((await ctx.artifacts().usage()).to_json())

    @app.get("/v1/artifacts/<artifact_id>")
    async def read_artifact(artifact_id: str):  # type: ignore[no-untyped-def]
        """The bytes; ``Range: bytes=<start>-<end>`` for one range (206)."""
        return await serve_artifact(ctx.artifacts(), artifact_id, request.headers.get("Range"), attachment=False)

    @app.get("/v1/artifacts/<artifact_id>/meta")
    async def artifact_meta(artifact_id: str):  # type: ignore[no-untyped-def]
        """Metadata only, in any state; the upload response's shape."""
        return jsonify((await ctx.artifacts().meta(artifact_id)).to_json())

    @app.delete("/v1/artifacts/<artifact_id>")
    async def delete_artifact(artifact_id: str):  # type: ignore[no-untyped-def]
        """Remove bytes and metadata (204)."""
        await ctx.artifacts().delete(artifact_id)
        return no_content()
