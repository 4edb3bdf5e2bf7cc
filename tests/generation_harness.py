"""A generation service over real generators, a real job table and a real artifact store,
served in-process on loopback (no LLM, no swarm): what the generation and audio route
tests drive."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import trio

from api.app import create_app, serve_api
from api.chat_completion import complete_turn, prompt_byte_limit
from api.limits import RequestLimits
from inclavate.artifact_swarm import SwarmArtifacts
from inclavate.artifacts import ArtifactStore
from inclavate.generation_settings import GenerationSettings
from inclavate.generations import GenerationService
from inclavate.job_runner import JobRunner, RunnerConfig
from inclavate.jobs import JobStore
from inclavate.local_swarm import free_port
from inclavate.peer_http import PeerHttp
from node.generators.chat_reader import ChatModelReader

PEER_ID = "12D3KooWGenerationHarnessPeer"
CHAT_MODEL = "smollm2:135m"
ADMIN_TOKEN = "secret-token"


class GenerationContext:
    """The slice of ``PeerContext`` the generation and audio routes use."""

    version = "test"
    peer_id = PEER_ID

    def __init__(self, generations: GenerationService | None, admin_token: str | None) -> None:
        self.limits = RequestLimits()
        self.generations = generations
        self.admin_token = admin_token

    def knows_model(self, model_id: str) -> bool:
        return model_id == CHAT_MODEL

    def artifacts(self) -> SwarmArtifacts:
        assert self.generations is not None
        return self.generations.artifacts


@dataclass
class Served:
    url: str
    service: GenerationService
    runner: JobRunner
    artifacts: ArtifactStore
    jobs: JobStore
    app: Any = None


def build_service(data_dir: Path, generators: dict, config: RunnerConfig,
                  settings: GenerationSettings = GenerationSettings(), chat: Any = None) -> GenerationService:  # fmt: skip
    jobs = JobStore.in_dir(data_dir)
    artifacts = ArtifactStore(data_dir, PEER_ID)
    holder: list[GenerationService] = []
    runner = JobRunner(jobs, artifacts, generators, PEER_ID,
                       read_input=lambda artifact_id, limit: holder[0].read_artifact(artifact_id, limit),
                       config=config, fallback=lambda model: _reader(model, chat))  # fmt: skip
    chat_models = (lambda: {CHAT_MODEL: True}) if chat is not None else dict
    holder.append(GenerationService(PEER_ID, runner, SwarmArtifacts(artifacts), lambda: [], PeerHttp(), settings=settings,
                                    chat_models=chat_models))  # fmt: skip
    return holder[0]


def _reader(model: str, chat: Any) -> ChatModelReader | None:
    """Chat models read text inputs through ``chat`` (a LocalContext with the real model)."""
    if model != CHAT_MODEL:
        return None
    if chat is None:
        return ChatModelReader(model)
    return ChatModelReader(model, partial(complete_turn, chat), partial(prompt_byte_limit, chat))


@asynccontextmanager
async def serve_generations(data_dir: Path, generators: dict, *, config: RunnerConfig | None = None,
                            admin_token: str | None = ADMIN_TOKEN,
                            settings: GenerationSettings = GenerationSettings(), chat: Any = None) -> AsyncIterator[Served]:  # fmt: skip
    service = build_service(data_dir, generators, config or RunnerConfig(poll_s=0.1), settings, chat)
    port = free_port()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(service.runner.run)
            app = create_app(GenerationContext(service, admin_token))
            await nursery.start(serve_api, app, "127.0.0.1", port)
            yield Served(f"http://127.0.0.1:{port}", service, service.runner, service.runner.artifacts, service.runner.store, app)
            nursery.cancel_scope.cancel()
    finally:
        await service.http.aclose()
        service.runner.store.close()
        service.runner.artifacts.close()
