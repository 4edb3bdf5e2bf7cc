"""Admin endpoints (``X-Admin-Token``): verify, reassign, set state, force-deregister.

The token is checked here, on the peer the operator talks to; a command for a node held
by another peer travels to it over libp2p signed by this peer (``p2p.admin``).
"""

from __future__ import annotations

from typing import Any

from quart import jsonify
from quart_trio import QuartTrio

from api.auth import require_admin
from api.bodies import json_object
from api.context import PeerContext
from api.errors import BadRequest
from api.routes_nodes import find_node


def _layer_range(ctx: PeerContext, node_id: str, body: dict[str, Any]) -> tuple[int, int]:
    """The ``start_layer``/``end_layer`` of a reassign, checked against the node's model
    here, where the request is read: a range the model does not have is a bad request (400).
    Left to the node's peer it came back as that peer's refusal, a conflict (409), which stays
    the answer for what only that peer can know. An unknown node is the command's 404."""
    start, end = body.get("start_layer"), body.get("end_layer")
    if not (isinstance(start, int) and isinstance(end, int)) or isinstance(start, bool) or not 0 <= start < end:
        raise BadRequest("start_layer and end_layer must be integers with 0 <= start_layer < end_layer")
    n_layers = next((v.record.n_layers for v in ctx.views() if v.record.node_id == node_id), None)
    if n_layers is not None and end > n_layers:
        raise BadRequest(f"end_layer {end} is past the model's {n_layers} layers (end_layer <= {n_layers})")
    return start, end


def install(app: QuartTrio, ctx: PeerContext) -> None:
    @app.get("/admin/verify")
    async def admin_verify():  # type: ignore[no-untyped-def]
        """Check an admin token."""
        require_admin(ctx.admin_token)
        return jsonify(ok=True)

    @app.post("/admin/nodes/<node_id>/reassign")
    async def admin_reassign(node_id: str):  # type: ignore[no-untyped-def]
        """Move a node to another layer range (it reloads: Joining, then Ready)."""
        require_admin(ctx.admin_token)
        node_id = find_node(ctx, node_id).record.node_id  # a legacy node by its own id too, as /nodes/:id reads
        start, end = _layer_range(ctx, node_id, await json_object())
        result = await ctx.admin_command("reassign", node_id, start_layer=start, end_layer=end)
        return jsonify(ok=True, node_id=node_id, start_layer=result.get("start_layer", start), end_layer=result.get("end_layer", end))

    @app.patch("/admin/nodes/<node_id>/state")
    async def admin_state(node_id: str):  # type: ignore[no-untyped-def]
        """Set a node ready or idle (an idle node stays registered but gets no new chains)."""
        require_admin(ctx.admin_token)
        node_id = find_node(ctx, node_id).record.node_id
        state = (await json_object()).get("state")
        if state not in ("ready", "idle"):
            raise BadRequest('state must be "ready" or "idle"')
        result = await ctx.admin_command("set_state", node_id, state=state)
        return jsonify(ok=True, node_id=node_id, state=result.get("state", state.capitalize()))

    @app.delete("/admin/nodes/<node_id>/force")
    async def admin_force(node_id: str):  # type: ignore[no-untyped-def]
        """Deregister a node everywhere without notifying it."""
        require_admin(ctx.admin_token)
        node_id = find_node(ctx, node_id).record.node_id
        await ctx.admin_command("force_remove", node_id)
        return jsonify(ok=True, node_id=node_id)
