"""The REST app over a real model in this process, for API tests that need no swarm.

``LocalContext`` implements ``api.context.PeerContext`` with the real chat model (tokenizer,
template, reasoning probe) and a ``LocalPipeline`` of real engines: everything but the
network. ``serve`` runs the app on a free loopback port with hypercorn, in the test's trio
nursery.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from collections.abc import AsyncIterator
from pathlib import Path

import trio

from api.app import create_app, serve_api
from api.chat_model import ChatModel
from api.errors import UnknownModel
from api.limits import RequestLimits
from inclavate.catalog import ModelSpec
from inclavate.local_swarm import free_port
from inclavate.types import LayerRange, ModelId, NodeId, PeerId
from node.engine import EngineConfig
from node.llamacpp_engine import LlamaCppEngine
from node.local_pipeline import LocalPipeline
from p2p.coverage import ModelCoverage, model_coverage
from p2p.records import NodeRecord
from p2p.registry import NodeView


class LocalContext:
    version = "test"
    peer_id = "local"
    admin_token: str | None = None
    generations = None  # no generators in process: chat turns offer no generation tools

    def __init__(self, model_id: str, path: Path, cache: Path, *, context_length: int = 1024) -> None:
        self.model_id = ModelId(model_id)
        self.limits = RequestLimits()
        self.chat = ChatModel.load(self.model_id, path)
        self.engine = LlamaCppEngine(model_id=self.model_id, model_path=path, layers=LayerRange(0, _n_layers(path)),
                                     config=EngineConfig(n_threads=1, context_length=context_length, max_sessions=4),
                                     slice_cache=cache)  # fmt: skip
        self.local_pipeline = LocalPipeline([self.engine])

    def close(self) -> None:
        self.chat.close()
        self.engine.close()

    def multiaddrs(self) -> list[str]:
        return []

    def views(self) -> list[NodeView]:
        info = self.engine.info
        record = NodeRecord(NodeId("local"), PeerId("local"), self.model_id, 0, info.n_layers, info.n_layers,
                            info.d_model, "Ready", 1, 0)  # fmt: skip
        return [NodeView(record, "Ready")]

    def coverage(self) -> dict[ModelId, ModelCoverage]:
        return model_coverage(self.views())

    def catalog(self) -> list[ModelSpec]:
        return []

    def local_engine(self) -> tuple[NodeId, ModelId, LayerRange] | None:
        return NodeId("local"), self.model_id, self.engine.info.layers

    def failover_counters(self) -> dict[str, int]:
        return {"adopted": 0, "recomputed": 0}

    def open_sessions(self) -> dict[str, int]:
        return {"stage": self.engine.memory().sessions, "entry": 0}

    def stage_batching(self) -> dict[str, object] | None:
        return None

    def connection_counters(self) -> dict[str, int]:
        return {}

    def knows_model(self, model_id: str) -> bool:
        return model_id == self.model_id

    async def chat_model(self, model_id: str) -> ChatModel:
        if model_id != self.model_id:
            raise UnknownModel(f"model {model_id!r} is not in the registry")
        return self.chat

    async def local_chat_model(self, model_id: str) -> ChatModel | None:
        return await self.chat_model(model_id)

    def pipeline(self, model_id: str) -> LocalPipeline:
        return self.local_pipeline

    def session_route(self, session_id: str) -> None:
        return None  # one process: no peers to route through

    def metrics_archive(self) -> _NoArchive:
        return _NoArchive()


class _NoArchive:
    def archived_minutes(self, since_ms: int, until_ms: int) -> list:
        return []


def _n_layers(path: Path) -> int:
    from inclavate.gguf_meta import read_metadata

    return read_metadata(path).n_layers


@asynccontextmanager
async def serve(ctx: LocalContext) -> AsyncIterator[str]:
    """The app on a free loopback port for the duration of the block; yields its base URL."""
    port = free_port()
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_api, create_app(ctx), "127.0.0.1", port)
        yield f"http://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()
