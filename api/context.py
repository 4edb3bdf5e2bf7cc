"""What the REST app needs from the peer it runs in, and nothing more.

The app is built over this protocol, not over the peer runtime, so handlers cannot reach
into the host, the engine or the gossip service, and a test can serve the app over a small
fake. ``inclavate.peer.Peer`` implements it.
"""

from __future__ import annotations

from typing import Any, Protocol

from api.chat_model import ChatModel
from api.limits import RequestLimits
from inclavate.artifact_swarm import SwarmArtifacts
from inclavate.catalog import ModelSpec
from inclavate.generations import GenerationService
from inclavate.metrics import MinuteArchive
from inclavate.pipeline import Pipeline
from inclavate.types import LayerRange, ModelId, NodeId, SessionId
from p2p.coverage import ModelCoverage
from p2p.registry import NodeView
from p2p.routing import Hop


class PeerContext(Protocol):
    version: str
    peer_id: str
    admin_token: str | None
    limits: RequestLimits
    generations: GenerationService | None
    """Generation jobs across the swarm; None where generation is not configured (503)."""

    def multiaddrs(self) -> list[str]: ...

    def views(self) -> list[NodeView]:
        """Every node in the registry, with the state this peer currently believes."""
        ...

    def coverage(self) -> dict[ModelId, ModelCoverage]: ...

    def catalog(self) -> list[ModelSpec]:
        """Shipped catalog plus the local ``config/models.toml`` overlay."""
        ...

    def local_engine(self) -> tuple[NodeId, ModelId, LayerRange] | None:
        """The layers this peer itself holds, once loaded."""
        ...

    def open_sessions(self) -> dict[str, int]:
        """KV-holding sessions on this peer's stage, and sessions it drives as entry peer."""
        ...

    def failover_counters(self) -> dict[str, int]:
        """What failovers cost this peer's stage: sessions it kept under a new leg
        (``adopted``) and positions it computed again after a rewind (``recomputed``)."""
        ...

    def stage_batching(self) -> dict[str, object] | None:
        """How many sessions this peer's stage batches per decode-step call (None: no stage)."""
        ...

    def connection_counters(self) -> dict[str, int]:
        """What the libp2p guards refused or closed since start: new inbound connections past
        the accept rate (by source, in all), handshakes and established inbound connections
        evicted past their bound, idle outbound ones closed past theirs. A flood shows here."""
        ...

    def knows_model(self, model_id: str) -> bool:
        """In the catalog, the overlay, or served by some node of the swarm."""
        ...

    async def chat_model(self, model_id: str) -> ChatModel:
        """Vocabulary, template and reasoning controls (raises ``UnknownModel``)."""
        ...

    async def local_chat_model(self, model_id: str) -> ChatModel | None:
        """Like :meth:`chat_model`, from files already on this peer only (never the network);
        None if it would need a download."""
        ...

    def pipeline(self, model_id: str) -> Pipeline:
        """A pipeline over the swarm for a new session (raises ``NoRoute``)."""
        ...

    def session_route(self, session_id: SessionId) -> tuple[Hop, ...] | None:
        """The route of a session this peer drives as entry, while it is open (None otherwise):
        the same object until a failover moves the session."""
        ...

    def metrics_archive(self) -> MinuteArchive:
        """Cluster-wide minute totals this peer archived (so history outlives departed peers)."""
        ...

    async def admin_command(self, action: str, node_id: str, **args: object) -> dict[str, Any]:
        """``reassign`` / ``set_state`` / ``force_remove`` for a node on any peer (the caller
        has checked the admin token; the command travels signed by this peer)."""
        ...

    async def legacy_register(self, body: dict[str, Any], *, assign: bool, join_token: str | None = None) -> dict[str, Any]: ...

    async def legacy_heartbeat(self, node_id: str, body: dict[str, Any], *, token: str | None = None) -> None:
        """``token``: the relay token the node registered with (heartbeats are bound to it)."""
        ...

    async def legacy_leave(self, node_id: str, *, token: str | None = None) -> None: ...

    def artifacts(self) -> SwarmArtifacts:
        """The swarm's artifacts: this peer's store and, through the owner tag of an id,
        every other peer's (raises ``ServiceUnavailable`` while the store is not open)."""
        ...
