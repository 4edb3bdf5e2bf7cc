"""``/v1/files``: the OpenAI Files API as an adapter over the artifact store (same ids).

``files.create`` is a streamed multipart upload (:mod:`api.multipart`) written straight
into the store, capped at 64 MiB of file bytes; the purpose is validated against the
allow-list, and refused by name for workflows this deployment does not run. If the
``purpose`` field comes after the file, the bytes are written first and discarded (never
committed) when the purpose turns out to be wrong.

The listing shows what was uploaded through this API (artifacts with a purpose), newest
first, with OpenAI's cursor paging (``after``, ``limit``, ``order``, ``purpose``); any
artifact id works for the per-file routes, as the spec says a file is an artifact.
"""

from __future__ import annotations

from typing import Any

from quart import jsonify, request
from quart_trio import QuartTrio

from api.context import PeerContext
from api.downloads import serve_artifact
from api.errors import BadRequest, PayloadTooLarge
from api.multipart import MultipartError, MultipartReader
from api.query_params import whole_number
from api.uploads import RequestChunks, set_body_limit
from api.request_guard import takes_any_body
from inclavate.artifact_types import MAX_PURPOSE_CHARS, MIB, ArtifactMeta, ListQuery, media_type_of, safe_filename
from inclavate.owner_ids import parse_id

PURPOSES = ("assistants", "user_data", "vision")
REFUSED_PURPOSES = {
    "fine-tune": "fine-tuning", "batch": "batch jobs", "evals": "evals",
}  # fmt: skip
FILES_DEFAULT_LIMIT = 10_000
FILES_MAX_LIMIT = 10_000
MULTIPART_OVERHEAD = 1 * MIB
"""Room for the multipart framing and the purpose field around a 64 MiB file."""
_STATUS = {"pending": "uploaded", "ready": "processed", "failed": "error"}


def check_purpose(purpose: str | None) -> str:
    if purpose is None:
        raise BadRequest("missing form field 'purpose' (one of: " + ", ".join(PURPOSES) + ")")
    if purpose in REFUSED_PURPOSES:
        raise BadRequest(
            f"purpose {purpose!r} is not supported: this deployment does not run {REFUSED_PURPOSES[purpose]}; "
            "use one of: " + ", ".join(PURPOSES)
        )
    if purpose not in PURPOSES:
        raise BadRequest(f"unknown purpose {purpose[:40]!r}; use one of: " + ", ".join(PURPOSES))
    return purpose


def file_object(meta: ArtifactMeta) -> dict[str, Any]:
    """OpenAI's FileObject for an artifact."""
    return {
        "id": meta.id,
        "object": "file",
        "bytes": meta.size_bytes,
        "created_at": meta.created_at_ms // 1000,
        "expires_at": meta.expires_at_ms // 1000 if meta.expires_at_ms is not None else None,
        "filename": meta.filename if meta.filename is not None else meta.id,
        "purpose": meta.purpose,
        "status": _STATUS[meta.state],
    }


def install(app: QuartTrio, ctx: PeerContext) -> None:
    cap = ctx.limits.max_file_bytes
    set_body_limit(app, "POST", "/v1/files", cap + MULTIPART_OVERHEAD)

    @app.post("/v1/files")
    @takes_any_body
    async def create_file():  # type: ignore[no-untyped-def]
        """Upload a file (multipart: purpose, file; at most 64 MiB), stored as an artifact."""
        store = ctx.artifacts().store
        length = request.content_length
        if length is not None and length > cap + MULTIPART_OVERHEAD:
            raise PayloadTooLarge(f"a file upload is limited to {cap // MIB} MiB ({cap} bytes)")
        reader = MultipartReader(RequestChunks(), request.headers.get("Content-Type"))
        purpose: str | None = None
        writer = None
        try:
            async for part in reader:
                if part.name == "purpose" and part.filename is None and purpose is None:
                    purpose = check_purpose(await part.text())
                elif part.name == "file" and part.filename is not None and writer is None:
                    writer = store.begin(
                        media_type=media_type_of(part.content_type), kind="uploaded", max_bytes=cap,
                        filename=safe_filename(part.filename),
                    )  # fmt: skip
                    async for chunk in part:
                        await writer.write(chunk)
                else:
                    raise MultipartError(f"unexpected form part {part.name[:40]!r} (fields: purpose, file)")
            if writer is None:
                raise BadRequest("missing form field 'file'")
            purpose = check_purpose(purpose)
            meta = await writer.commit(purpose=purpose)
        finally:
            if writer is not None:
                await writer.abort("the upload did not complete")
        return jsonify(file_object(meta)), 201

    @app.get("/v1/files")
    async def list_files():  # type: ignore[no-untyped-def]
        """Files uploaded through this API, newest first (after, limit, order, purpose)."""
        limit = whole_number("limit", request.args.get("limit"), FILES_DEFAULT_LIMIT, 1, FILES_MAX_LIMIT)
        order = request.args.get("order", "desc")
        if order not in ("asc", "desc"):
            raise BadRequest("order must be asc or desc")
        after = request.args.get("after")
        cursor = (await ctx.artifacts().meta(after)).sort_key() if after else None
        purpose = request.args.get("purpose")
        if purpose is not None and len(purpose) > MAX_PURPOSE_CHARS:
            raise BadRequest(f"purpose is at most {MAX_PURPOSE_CHARS} characters")
        query = ListQuery(limit=limit, files_only=True, purpose=purpose, after=cursor,
                          ascending=order == "asc")  # fmt: skip
        page = await ctx.artifacts().list(query)
        data = [file_object(m) for m in page.artifacts]
        return jsonify(
            object="list", data=data, has_more=page.truncated,
            first_id=data[0]["id"] if data else None, last_id=data[-1]["id"] if data else None,
        )  # fmt: skip

    @app.get("/v1/files/<file_id>")
    async def retrieve_file(file_id: str):  # type: ignore[no-untyped-def]
        """A file's metadata (any artifact id)."""
        return jsonify(file_object(await ctx.artifacts().meta(file_id)))

    @app.get("/v1/files/<file_id>/content")
    async def file_content(file_id: str):  # type: ignore[no-untyped-def]
        """The bytes, as an attachment with nosniff and an inert media type."""
        return await serve_artifact(ctx.artifacts(), file_id, request.headers.get("Range"), attachment=True)

    @app.delete("/v1/files/<file_id>")
    async def delete_file(file_id: str):  # type: ignore[no-untyped-def]
        """Delete a file (its artifact)."""
        await ctx.artifacts().delete(file_id)
        return jsonify(id=parse_id(file_id), object="file", deleted=True)
