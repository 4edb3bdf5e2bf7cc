"""Node endpoints over the gossiped registry: ``/nodes``, ``/nodes/:id/hardware``,
``/nodes/:id/metrics``. Every peer answers the same (up to gossip delay)."""

from __future__ import annotations

from typing import Any

from quart import jsonify, request
from quart_trio import QuartTrio

from api.bodies import json_object
from api.context import PeerContext
from api.errors import NotFound
from api.responses import no_content
from p2p.records import legacy_local_id
from p2p.legacy import JOIN_TOKEN_HEADER, TOKEN_HEADER
from p2p.registry import NodeView


def node_json(view: NodeView) -> dict[str, Any]:
    r = view.record
    return {
        "node_id": r.node_id,
        "model_id": r.model_id,
        "http_url": r.forward_url if r.relayed else r.api_url,
        "grpc_url": None,
        "start_layer": r.start_layer,
        "end_layer": r.end_layer,
        "n_layers": r.n_layers,
        "engine": r.engine,
        "state": view.state,
        "idle": r.idle,
        "draining": r.draining,
        "vram_mb": r.vram_mb,
        "tokens_total": r.counters.tokens_total,
        "requests_served": r.counters.requests_served,
        "errors": r.counters.errors,
        "avg_latency_ms": r.counters.avg_latency_ms,
        "throughput_tps": r.throughput_tps,  # beyond the spec: tokens/s while busy (dashboard, status)
        "uptime_s": r.uptime_s,
        "peer_id": r.peer_id,
        "multiaddrs": list(r.multiaddrs),
        "relayed": r.relayed,
        "legacy": r.relayed,
        "legacy_id": legacy_local_id(r.node_id) if r.relayed else None,
    }


def find_node(ctx: PeerContext, node_id: str) -> NodeView:
    """By registry id; a legacy node also by the id it chose itself when that is unambiguous
    (the registry namespaces it under its vouching peer: ``<PeerID>:<id>``)."""
    views = ctx.views()
    for view in views:
        if view.record.node_id == node_id:
            return view
    legacy = [v for v in views if v.record.relayed and legacy_local_id(v.record.node_id) == node_id]
    if len(legacy) == 1:
        return legacy[0]
    raise NotFound(f"no node {node_id!r} in the registry")



def install(app: QuartTrio, ctx: PeerContext) -> None:
    @app.get("/nodes")
    async def list_nodes():  # type: ignore[no-untyped-def]
        """Every node in the registry, with the state this peer believes."""
        return jsonify([node_json(v) for v in ctx.views()])

    @app.get("/nodes/<node_id>/hardware")
    async def node_hardware(node_id: str):  # type: ignore[no-untyped-def]
        """The hardware profile a node reported, with the engine that runs its range."""
        record = find_node(ctx, node_id).record
        return jsonify({**record.hardware, "engine": record.engine})

    @app.get("/nodes/<node_id>/metrics")
    async def node_metrics(node_id: str):  # type: ignore[no-untyped-def]
        """The node's recent throughput and latency samples (about 60, every 10 s)."""
        view = find_node(ctx, node_id)
        samples = [{"tps": s.tps, "latency_ms": s.latency_ms, "ts_ms": s.ts_ms} for s in view.record.samples]
        return jsonify(node_id=view.record.node_id, samples=samples)

    # Legacy (HTTP-only) nodes: this peer vouches for them in the registry.

    @app.post("/nodes")
    async def register_node():  # type: ignore[no-untyped-def]
        """Register a legacy node with an explicit layer range."""
        result = await ctx.legacy_register(await json_object(), assign=False, join_token=request.headers.get(JOIN_TOKEN_HEADER))
        return jsonify(node_id=result["node_id"], warnings=result["warnings"])

    @app.post("/nodes/join")
    async def join_node():  # type: ignore[no-untyped-def]
        """Register a legacy node; this peer assigns its range unless ``layers`` is given."""
        return jsonify(await ctx.legacy_register(await json_object(), assign=True, join_token=request.headers.get(JOIN_TOKEN_HEADER)))

    @app.post("/nodes/<node_id>/health")
    async def node_heartbeat(node_id: str):  # type: ignore[no-untyped-def]
        """A legacy node's heartbeat, with its counters (needs its X-Inclavate-Relay-Token)."""
        await ctx.legacy_heartbeat(node_id, await json_object(), token=request.headers.get(TOKEN_HEADER))
        return jsonify(ok=True)

    @app.delete("/nodes/<node_id>")
    async def deregister_node(node_id: str):  # type: ignore[no-untyped-def]
        """A legacy node leaves cleanly (needs its X-Inclavate-Relay-Token)."""
        await ctx.legacy_leave(node_id, token=request.headers.get(TOKEN_HEADER))
        return no_content()
