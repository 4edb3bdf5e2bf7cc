"""``GET /health`` and ``GET /openapi.json``."""

from __future__ import annotations

from quart import jsonify
from quart_trio import QuartTrio

from api.context import PeerContext
from api.openapi import openapi_document


def install(app: QuartTrio, ctx: PeerContext) -> None:
    @app.get("/health")
    async def health():  # type: ignore[no-untyped-def]
        engine = ctx.local_engine()
        return jsonify(
            ok=True,
            version=ctx.version,
            peer_id=ctx.peer_id,
            multiaddrs=ctx.multiaddrs(),
            model_id=engine[1] if engine else None,
            layers=[engine[2].start, engine[2].end] if engine else None,
            sessions=ctx.open_sessions(),
            failover=ctx.failover_counters(),
            batching=ctx.stage_batching(),
            connections=ctx.connection_counters(),
        )

    @app.get("/openapi.json")
    async def openapi():  # type: ignore[no-untyped-def]
        return jsonify(openapi_document(app, ctx.version))
