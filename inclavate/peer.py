"""One peer: the composition root that starts every service in one trio nursery.

Start-up order, and why:

0. pre-flight (:func:`preflight`): the model and ``--layers`` against the catalog, then the
   data dir's lock and the API port, so a typo leaves no data dir and no port was opened
   (nothing is removed after a later failure: a data dir may hold the model store);
1. identity (so the PeerID survives restarts) and the model file (pulled if missing);
2. the libp2p host, the registry gossip, discovery, the forward protocol and the REST API,
   so the peer is reachable and can answer ``/health`` and ``/nodes`` while it loads;
3. learn the swarm (bootstrap peers, anti-entropy), then choose layers (``--layers``, or
   :mod:`p2p.placement`), announce ``Joining`` and watch for collisions for ``settle_s``;
4. load the engine, announce ``Ready``.

Then the healer (:mod:`inclavate.healer`) runs: when layers lose their last holder and this
peer's span is replicated, it may be elected to move there.

Shutdown (:meth:`Peer.shutdown`), the polite stop: refuse new chats, announce ``draining``
(routes avoid this peer; entry peers move its sessions to other holders), wait up to
``drain_s`` for its sessions to go (moved or finished), announce ``Dead``, fail whatever is
left with a clear error (freeing its KV cache), and leave.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from functools import partial
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import IO

import trio

from api.app import create_app, serve_api
from api.chat_completion import complete_turn, prompt_byte_limit
from api.chat_model import ChatModel
from api.errors import NotFound, ServiceUnavailable, UnknownModel
from api.limits import RequestLimits
from api.request_guard import HostPolicy
from inclavate import __version__, hardware
from inclavate.artifact_swarm import SwarmArtifacts
from inclavate.artifact_types import ArtifactConfig
from inclavate.artifacts import ArtifactStore
from inclavate.catalog import Catalog, ModelSpec, overlay_path
from inclavate.errors import ConfigError, InclavateError
from inclavate.generation_settings import GenerationSettings
from inclavate.generations import GenerationService
from inclavate.gguf_meta import GgufMetadata, read_metadata
from inclavate.job_runner import JobRunner, RunnerConfig
from inclavate.jobs import JobStore
from inclavate.healer import Healer
from inclavate.metrics import MetricsRecorder, slice_key
from inclavate.metrics_store import MetricsStore, run_metrics
from inclavate.peer_book import PeerBook
from inclavate.peer_http import PeerHttp
from inclavate.peer_config import PeerConfig, capacity
from inclavate.pipeline import Pipeline
from inclavate.ports import port_in_use
from inclavate.store import ModelStore
from inclavate.types import LayerRange, ModelId, NodeId, PeerId, SessionId
from node.gguf_slice import write_vocab_only
from node.engine import LayerEngine
from node.engine_thread import EngineThread
from node.engines import load_engine
from node.errors import EngineError
from node.generators.chat_reader import ChatModelReader
from node.generators.loader import installed_generators
from node.stage import Stage
from p2p.chain import SwarmPipeline
from p2p.coverage import ModelCoverage, agreed, model_coverage
from p2p.discovery import run_discovery
from p2p.failover import PeerHealth
from p2p.forward import ForwardService
from p2p.gossip import RegistryService
from p2p.host import P2PHost, open_host
from p2p.identity import Identity, load_or_create_identity
from p2p.latency import LatencyMonitor
from p2p.admin import AdminCommand, AdminRefused, AdminService
from p2p.artifacts import RemoteArtifacts, serve_artifacts
from p2p.legacy import LegacyNodes
from p2p.placement import choose_range, should_move
from p2p.record_schema import MAX_MULTIADDRS
from p2p.records import NodeRecord, now_ms
from p2p.registry import NodeView
from p2p.routing import Hop, chain_context
from p2p.vocab import choose_vocab, fetch_vocab, serve_vocab, sha256_file
from p2p.wire import max_frame_bytes

log = logging.getLogger(__name__)

DRAIN_QUIET_S = 2.0
"""A drained peer has had no session this long (see :meth:`Peer._drain`): longer than an
entry takes to replay a moved session up to this hop (a loaded 2-core VM needed > 1 s)."""

FORCE_REMOVE_BAN_S = 600.0
"""How long a force-deregistered node's records are ignored (it is not told, and keeps
publishing until it notices nobody routes to it or its operator restarts it)."""


class Peer:
    version = __version__

    def __init__(self, config: PeerConfig) -> None:
        self.config = config
        sessions = config.engine.max_sessions  # an entry drives no more than a stage holds
        self.limits = RequestLimits(max_generations=sessions, max_waiting_generations=4 * sessions)
        self.admin_token = config.admin_token
        self.identity: Identity | None = None
        self.host: P2PHost | None = None
        self.registry: RegistryService | None = None
        self.forward: ForwardService | None = None
        self.stage: Stage | None = None
        self.api_urls: list[str] = []
        self.shutting_down = False
        self.leaving_now = False
        """A second Ctrl-C: what is left of the peer answers nothing more (no close waits)."""
        self._started = time.time()
        self._spec: ModelSpec | None = None
        self._model_path: Path | None = None
        self._chat_models: dict[str, ChatModel] = {}
        self._chat_locks: dict[str, trio.Lock] = {}
        self._pipelines: dict[str, SwarmPipeline] = {}
        self._peer_health = PeerHealth(config.failover)
        """This peer's experience of others as an entry: who failed its sessions (all models)."""
        self._cancel: trio.CancelScope | None = None
        self.latency: LatencyMonitor | None = None
        self.legacy: LegacyNodes | None = None
        self.admin_service: AdminService | None = None
        self._nursery: trio.Nursery | None = None
        self._stage_scope: trio.CancelScope | None = None
        self._heal_scope: trio.CancelScope | None = None
        self._reload = trio.Lock()
        self.metrics_store: MetricsStore | None = None
        self.metrics = MetricsRecorder()
        self._catalog_cache: tuple[int, Catalog] | None = None
        self.artifact_store: ArtifactStore | None = None
        self.peer_book: PeerBook | None = None
        self._artifacts: SwarmArtifacts | None = None
        self.generations: GenerationService | None = None
        self._model_sha256 = ""
        self._vocab_sha256 = ""
        """Of the vocab-only file we serve, announced in our record once computed."""

    # ------------------------------------------------------------------ run

    @property
    def peer_id(self) -> str:
        assert self.identity is not None
        return self.identity.peer_id

    async def run(self, *, task_status: trio.TaskStatus[Peer] = trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        # Before the data dir: what the catalog alone can judge (an unknown --model, --layers past
        # the model's end) must leave nothing behind; before, a typo created a peer-<port> dir.
        preflight(cfg, self._catalog())
        # Before the API port: the same command run again while the last run still drains
        # must say so, not send the user to another --api-port (another default data dir).
        lock = hold_data_dir(cfg.data_dir)
        try:
            busy = port_in_use(cfg.api_host, cfg.api_port)
            if busy is not None:
                raise ConfigError(f"cannot serve the API on {cfg.api_host}:{cfg.api_port}: {busy} ({_api_bind_fix(busy)})")
            await self._run(task_status)
        finally:
            lock.close()

    async def _run(self, task_status: trio.TaskStatus[Peer]) -> None:
        cfg = self.config
        self.identity = load_or_create_identity(cfg.data_dir)
        self.metrics_store = MetricsStore.in_dir(cfg.data_dir)
        self.metrics = MetricsRecorder(state=self.metrics_store.load())
        artifact_config = ArtifactConfig.from_env(os.environ)  # DPPAN_ARTIFACT_*: a bad value stops us here
        self._generation_settings = GenerationSettings.from_env(os.environ)  # DPPAN_GENERATION_*, *_SYNC_TIMEOUT_SECS
        catalog = self._catalog()
        self._spec = spec = catalog.get(cfg.model_id)
        log.info("peer %s: model %s", self.peer_id, spec.model_id)
        pulled = await trio.to_thread.run_sync(ModelStore(cfg.home).pull, spec)
        self._model_path, self._model_sha256 = pulled.path, pulled.sha256
        meta = read_metadata(self._model_path)
        # Opened, and what a crash left cleaned up, before anything is served.
        self.artifact_store = ArtifactStore(cfg.data_dir, self.peer_id, artifact_config)
        jobs = JobStore.in_dir(cfg.data_dir)
        try:
            self.peer_book = PeerBook.in_dir(cfg.data_dir)
            await self._serve(meta, jobs, task_status)
        finally:
            self.metrics_store.close()  # after run_metrics' last save: its task has ended
            jobs.close()
            self.artifact_store.close()
            if self.peer_book is not None:
                self.peer_book.close()

    def _generation_service(self, jobs: JobStore, settings: GenerationSettings) -> GenerationService:
        """This peer's job runner over its installed generators, and the swarm-wide service."""
        assert self.artifact_store is not None and self._artifacts is not None
        runner = JobRunner(
            jobs, self.artifact_store, installed_generators(self.config.home, settings.transcription_max_seconds) if self.config.generators else {}, self.peer_id,
            read_input=lambda artifact_id, limit: self.generations.read_artifact(artifact_id, limit),  # type: ignore[union-attr]
            config=RunnerConfig(workers=settings.workers, max_active=settings.max_active, history_max=settings.history_max),
            fallback=lambda model: (ChatModelReader(model, partial(complete_turn, self), partial(prompt_byte_limit, self))
                              if self.knows_model(model) else None),
        )  # fmt: skip
        return GenerationService(self.peer_id, runner, self._artifacts, self.views, PeerHttp(), self._erase_remote_job,
                                 settings, self._readable_models)  # fmt: skip

    def _readable_models(self) -> dict[str, bool]:
        """The models a text job may name (:meth:`knows_model`'s), and whether a Ready chain
        covers each now."""
        served = {model: coverage.chain_complete for model, coverage in self.coverage().items()}
        return {**{spec.model_id: False for spec in self.catalog()}, **served}

    async def _erase_remote_job(self, owner: str, job_id: str, artifacts: bool) -> dict:
        assert self.admin_service is not None
        command = self.admin_service.command("erase_generation", job_id, PeerId(owner), artifacts=artifacts)
        return await self.admin_service.send(PeerId(owner), command)

    async def _serve(self, meta: GgufMetadata, jobs: JobStore, task_status: trio.TaskStatus[Peer]) -> None:
        cfg = self.config
        assert self.identity is not None and self._spec is not None
        spec = self._spec
        cap = capacity(cfg, meta)  # a budget too small is refused before anything is served
        async with open_host(self.identity, listen_port=cfg.p2p_port or self._port_of_last_run(), listen_host=cfg.p2p_host,
                             enable_mdns=cfg.mdns) as host:  # fmt: skip
            self.host = host
            port = host.listen_port()
            if self.peer_book is not None and port is not None:
                self.peer_book.listened_on(port)
            with trio.CancelScope() as self._cancel:
                async with trio.open_nursery() as nursery:
                    self.registry = RegistryService(host, self.identity, cfg.liveness)
                    self.registry.refresh = self._refresh_record
                    host.connection_guard.valued = lambda peer: bool(self._signed_by(peer))
                    await nursery.start(self.registry.run)
                    await nursery.start(run_metrics, self.metrics, self.metrics_store, self.views)
                    await nursery.start(partial(run_discovery, host, list(cfg.bootstrap), book=self.peer_book))
                    self.forward = ForwardService(host, node_id=NodeId(self.peer_id), stage=None, wire_dtype=cfg.wire_dtype,
                                                  direct_port=cfg.direct_port,
                                                  max_frame_bytes=max_frame_bytes(cfg.engine.context_length, meta.d_model))
                    self.forward.record_of = self._registered
                    self.forward.records_signed_by = self._signed_by
                    self.forward.registry_table = self._registry_table
                    await nursery.start(self.forward.run)
                    serve_vocab(host, self._local_vocab)
                    self.latency = LatencyMonitor(host, self._route_candidates)
                    await nursery.start(self.latency.run)
                    self.legacy = LegacyNodes(self.registry, self._model_facts, send=self.forward.send,
                                              join_token=cfg.join_token)
                    self.forward.relayed = self.legacy
                    await nursery.start(self.legacy.run)
                    self.admin_service = AdminService(host, self.identity, cfg.admin_peers, self._execute_admin)
                    self.admin_service.start()
                    assert self.artifact_store is not None
                    # Pieces over the forward service's direct links (one DirectLinks per peer:
                    # one listening port, one ticket table; artifact links in a table of their own).
                    serve_artifacts(host, self.artifact_store, self.forward.direct)
                    remote_artifacts = RemoteArtifacts(host, self.forward.direct)
                    await nursery.start(remote_artifacts.run)
                    self._artifacts = SwarmArtifacts(
                        self.artifact_store, remote_artifacts, self._registry_peers, self._live_peers
                    )
                    await nursery.start(self.artifact_store.run_sweeper)
                    self._nursery = nursery
                    self.generations = self._generation_service(jobs, self._generation_settings)
                    await nursery.start(self.generations.runner.run)
                    hosts = HostPolicy.for_bind(cfg.api_host, cfg.api_port, cfg.allowed_hosts)
                    self.api_urls = await nursery.start(serve_api, create_app(self, hosts=hosts), cfg.api_host, cfg.api_port)
                    log.info("API on %s; p2p on %s", ", ".join(self.api_urls), ", ".join(host.multiaddrs()))

                    await self._learn_swarm()
                    layers = await self._place(meta.n_layers, cap, meta.d_model)
                    await self._start_stage(layers)
                    await self._announce("Ready", layers)
                    log.info("ready: %s layers %s", spec.model_id, layers)
                    nursery.start_soon(self._prepare_vocab)
                    if cfg.heal.enabled:
                        nursery.start_soon(self._run_healer)
                    task_status.started(self)

    def _port_of_last_run(self) -> int:
        """The p2p port this peer listened on last time, where it is free, else 0 (any): the
        addresses other peers keep of it (their books, their ``--bootstrap``) then stay right
        across its restarts (:mod:`inclavate.peer_book`)."""
        port = self.peer_book.own_port() if self.peer_book is not None else None
        if port is None:
            return 0
        busy = port_in_use(self.config.p2p_host, port)
        if busy is not None:
            log.warning("the p2p port of the last run, %d, is taken (%s): listening on another, so addresses of this "
                        "peer given to others (their --bootstrap) must be updated from this run's", port, busy)  # fmt: skip
            return 0
        return port

    async def shutdown(self) -> None:
        """Leave the swarm politely; returns once everything has stopped.

        Draining first, Dead last: while draining the peer still serves the sessions it has
        (its record stays Ready, flagged ``draining``), so entry peers can move them to other
        holders without a failure, and generations it drives as entry can finish."""
        if self.shutting_down:
            return
        self.shutting_down = True
        if self._heal_scope is not None:
            self._heal_scope.cancel()
        announced = self.registry is not None and self._own_record() is not None
        if announced:
            log.info("leaving: draining sessions (up to %g s; Ctrl-C again to exit at once)", self.config.drain_s)
            with trio.move_on_after(2.0):
                await self._set_flags(draining=True)
        if not await self._drain(self.config.drain_s, entry=True):
            log.warning("sessions still open after %g s: %s; leaving anyway", self.config.drain_s, self.open_sessions())
        # Stage first: steps still arriving are answered ``shutting_down`` (not left
        # unanswered) while the departure is announced and those answers are sent.
        if self.forward is not None:
            self.forward.leaving = True
        await self._stop_stage("this peer is shutting down")
        await self.leave_now()
        if self._cancel is not None:
            self._cancel.cancel()

    async def leave_now(self) -> None:
        """Tell the hops of the sessions this peer drives, then announce Dead (each bounded:
        a second Ctrl-C must not wait on the network)."""
        self.leaving_now = True
        # While the links still run: once the peer's tasks are cancelled, a generation's own
        # close raced its link's cancelled task, and the hops kept the session (a CI run).
        with trio.move_on_after(1.0):
            for pipeline in list(self._pipelines.values()):
                await pipeline.leave()
        if self.registry is None or self._own_record() is None:
            return  # never announced anything
        log.info("announcing departure")
        with trio.move_on_after(1.0):
            await self._announce("Dead")
            await trio.sleep(0.2)  # let the gossip leave the building

    async def _drain(self, timeout: float, *, entry: bool) -> bool:
        """Wait until no session uses this peer's stage (and, with ``entry``, none that
        this peer drives as entry is open) for ``DRAIN_QUIET_S``, at most ``timeout`` seconds.

        Quiet for a while, not zero once: an entry moving a session off *another* leaving
        hop closes the old leg here and opens the new one (still through this peer, the
        only other way) a moment later."""
        quiet_since: float | None = None
        with trio.move_on_after(timeout):
            while True:
                sessions = self.open_sessions()
                if sessions["stage"] == 0 and (not entry or sessions["entry"] == 0):
                    quiet_since = trio.current_time() if quiet_since is None else quiet_since
                    if trio.current_time() - quiet_since >= DRAIN_QUIET_S:
                        return True
                else:
                    quiet_since = None
                await trio.sleep(0.1)
        return quiet_since is not None

    # ------------------------------------------------------- joining the swarm

    async def _learn_swarm(self) -> None:
        """With bootstrap addresses, wait (bounded) until connected and synced, so that
        placement sees the layers others already hold."""
        assert self.host is not None and self.registry is not None
        if not self.config.bootstrap:
            return
        with trio.move_on_after(self.config.join_timeout_s):
            while not self.host.connected_peers():
                await trio.sleep(0.05)
            for peer in self.host.connected_peers():
                await self.registry.sync_with(peer)
            return
        log.warning("no bootstrap peer answered within %.0f s; placing on what is known", self.config.join_timeout_s)

    def _route_candidates(self) -> list[PeerId]:
        """Peers this peer may route sessions through: those serving any model."""
        return sorted({PeerId(v.record.peer_id) for v in self.views() if v.routable})

    def _model_views(self) -> list[NodeView]:
        assert self.registry is not None
        return [v for v in self.registry.views() if v.record.model_id == self.config.model_id]

    async def _place(self, n_layers: int, cap: int, d_model: int) -> LayerRange:
        self._n_layers, self._d_model, self._capacity = n_layers, d_model, cap
        if self.config.layers is not None:
            if self.config.layers.end > n_layers:
                raise ConfigError(f"--layers {self.config.layers} exceeds the model's {n_layers} layers")
            await self._announce("Joining", self.config.layers)
            return self.config.layers
        layers = choose_range(self._model_views(), n_layers, cap)
        await self._announce("Joining", layers)
        for _ in range(10):
            await trio.sleep(self.config.settle_s)
            moved = should_move(self._model_views(), NodeId(self.peer_id), layers, n_layers, cap)
            if moved is None:
                break
            log.info("layers %s are also being taken by a senior peer; moving to %s", layers, moved)
            layers = moved
            await self._announce("Joining", layers)
        return layers

    async def _start_stage(self, layers: LayerRange) -> None:
        engine_thread = EngineThread(f"engine {layers}")
        try:
            engine = await engine_thread.run(self._load_engine, layers)
        except BaseException:
            engine_thread.close()
            raise
        stage = Stage(engine, engine_thread=engine_thread, inline_tokens=self.config.inline_tokens,
                      on_batch=self.metrics.record_tokens, on_error=self.metrics.record_error,
                      keep_outputs=self.config.wire_dtype, decode_lanes=self.config.decode_lanes)
        assert self._nursery is not None and self.forward is not None

        async def run_stage(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with trio.CancelScope() as self._stage_scope:
                await stage.run(task_status=task_status)

        await self._nursery.start(run_stage)
        self.stage = stage
        self.forward.stage = stage

    async def _stop_stage(self, reason: str) -> None:
        stage, self.stage = self.stage, None
        if self.forward is not None:
            self.forward.stage = None
        if stage is None:
            return
        await stage.fail_pending(EngineError(reason))
        if self._stage_scope is not None:
            self._stage_scope.cancel()
        await stage.close_engine()

    async def _run_healer(self) -> None:
        healer = Healer(
            me=NodeId(self.peer_id), n_layers=self._n_layers, capacity=self._capacity, views=self._model_views,
            can_move=self._can_move, move=self._heal_move, config=self.config.heal, version=self._heal_key,
        )  # fmt: skip
        with trio.CancelScope() as self._heal_scope:
            await healer.run()

    def _heal_key(self) -> Hashable:
        """What the healer's last look depends on in the registry (:meth:`p2p.gossip.Registry.heal_key`)."""
        assert self.registry is not None
        return self.registry.heal_key(self.config.model_id)

    def _can_move(self) -> bool:
        record = self._own_record()
        return (
            not self.shutting_down and self.stage is not None and not self._reload.locked()
            and record is not None and not record.idle
        )  # fmt: skip

    async def _heal_move(self, target: LayerRange, still_elected: Callable[[], bool]) -> bool:
        """Move to ``target`` to heal a gap: drain (entry peers move this stage's sessions
        to the other holders of its span, which is what made this peer eligible), confirm
        the election, reload."""
        await self._set_flags(draining=True)
        if not await self._drain(self.config.heal.drain_s, entry=False):
            log.warning("moving with %d sessions still on this stage", self.open_sessions()["stage"])
        if self.shutting_down:
            return False
        if not still_elected():
            log.info("no longer elected to move to %s; staying", target)
            await self._set_flags(draining=False)
            return False
        assert self.stage is not None
        previous = self.stage.engine.info.layers
        try:
            await self.reassign(target)
        except (InclavateError, OSError) as exc:
            log.error("could not load layers %s to heal the gap (%s); back to %s", target, exc, previous)
            try:
                await self.reassign(previous)
            except (InclavateError, OSError) as again:
                log.error("could not reload layers %s either (%s); leaving the swarm", previous, again)
                assert self._nursery is not None
                self._nursery.start_soon(self.shutdown)  # not here: shutdown cancels the healer
            return False
        return True

    async def reassign(self, layers: LayerRange) -> None:
        """Reload a new range: announce Joining with it (so routing stops using the old
        one), stop the old stage, load the new engine, announce Ready."""
        async with self._reload:
            n_layers = self._n_layers
            if layers.end > n_layers:
                raise ConfigError(f"layers {layers} exceed the model's {n_layers} layers")
            log.info("reassigned to layers %s", layers)
            await self._announce("Joining", layers)
            await self._stop_stage(f"this peer is moving to layers {layers}")
            await self._start_stage(layers)
            await self._announce("Ready", layers)

    async def _set_flags(self, **flags: bool) -> None:
        """Publish our record with ``idle`` / ``draining`` changed."""
        record = self._own_record()
        assert record is not None and self.registry is not None
        await self.registry.publish(record.replace(**flags))

    async def _execute_admin(self, command: AdminCommand) -> dict:
        """Run an admin command addressed to this peer (already authenticated and trusted)."""
        assert self.registry is not None
        target = command.target
        if command.action == "erase_generation":
            assert self.generations is not None
            deleted = await self.generations.runner.erase(target, artifacts=bool(command.args.get("artifacts", True)))
            return {"artifacts_deleted": deleted}
        if command.action == "force_remove":
            self.registry.ban(target, FORCE_REMOVE_BAN_S)
            if self.legacy is not None:
                self.legacy.forget(target)
            return {"node_id": target}
        if target != self.peer_id:
            raise AdminRefused(f"node {target} is not held by this peer (legacy nodes choose their range at registration)")
        if command.action == "reassign":
            layers = LayerRange(int(command.args["start_layer"]), int(command.args["end_layer"]))
            await self.reassign(layers)
            return {"node_id": target, "start_layer": layers.start, "end_layer": layers.end}
        idle = command.args["state"] == "idle"
        await self._set_flags(idle=idle)
        return {"node_id": target, "state": "Idle" if idle else "Ready"}

    def _catalog_shape(self, model_id: str) -> tuple[int, int] | None:
        """(n_layers, d_model) of a model of this peer's catalog; None for any other."""
        try:
            spec = self._catalog().get(model_id)
        except InclavateError:
            return None
        return spec.n_layers, spec.d_model

    def _model_facts(self, model_id: str) -> tuple[int, int] | None:
        """(n_layers, d_model) of a model, from the catalog or the registry."""
        if (shape := self._catalog_shape(model_id)) is not None:
            return shape
        records = [v.record for v in self.views() if v.record.model_id == model_id]
        n_layers, d_model = agreed(records, lambda r: r.n_layers), agreed(records, lambda r: r.d_model)
        return (n_layers, d_model) if n_layers is not None and d_model is not None else None

    def _load_engine(self, layers: LayerRange) -> LayerEngine:
        assert self._spec is not None and self._model_path is not None
        return load_engine(
            self.config.engine_kind,
            model_id=ModelId(self._spec.model_id),
            model_path=self._model_path,
            model_sha256=self._spec.gguf_sha256,
            layers=layers,
            config=self.config.engine,
            slice_cache=self.config.home / "slices",
        )

    # ------------------------------------------------------------ own record

    def _registered(self, node_id: NodeId) -> NodeRecord | None:
        """The registry's record of a node: what forward routes are checked against."""
        entry = self.registry.table.get(node_id) if self.registry is not None else None
        return entry.record if entry is not None else None

    def _registry_table(self) -> object:
        """The registry's table as it is now: a new object whenever a record changes."""
        return self.registry.table if self.registry is not None else None

    def _signed_by(self, peer: PeerId) -> list[NodeRecord]:
        """Every record ``peer`` signs in the registry (its node's, its legacy nodes')."""
        return self.registry.table.records_signed_by(peer) if self.registry is not None else []

    def _own_record(self) -> NodeRecord | None:
        assert self.registry is not None
        return self.registry.own(NodeId(self.peer_id))

    async def _announce(self, state: str, layers: LayerRange | None = None) -> None:
        assert self.registry is not None and self.host is not None
        current = self._own_record()
        if layers is None:
            assert current is not None
            layers = current.layers
        record = (current or self._new_record(layers)).replace(
            state=state, start_layer=layers.start, end_layer=layers.end,
            multiaddrs=tuple(self.host.multiaddrs()[:MAX_MULTIADDRS]), draining=False,
        )
        await self.registry.publish(self._refresh_record(record))

    def _new_record(self, layers: LayerRange) -> NodeRecord:
        assert self._spec is not None
        return NodeRecord(
            node_id=NodeId(self.peer_id), peer_id=PeerId(self.peer_id), model_id=ModelId(self._spec.model_id),
            start_layer=layers.start, end_layer=layers.end, n_layers=self._n_layers, d_model=self._d_model,
            state="Joining", seq=0, ts_ms=0, hardware=hardware.profile(self.config.engine_kind),
            api_url=self.api_urls[0] if self.api_urls else "", started_ms=int(self._started * 1000),
            context_length=self.config.engine.context_length, version=self.version,
            engine=self.config.engine_kind,
            generators=tuple(self.generations.local_capabilities()) if self.generations else (),
        )  # fmt: skip

    def _refresh_record(self, record: NodeRecord) -> NodeRecord:
        m = self.metrics
        m.measuring(slice_key(record.model_id, record.layers))  # the figures are for the slice it names
        changes: dict = {
            "model_sha256": self._model_sha256,
            "vocab_sha256": self._vocab_sha256,
            "uptime_s": int(time.time() - self._started),
            "counters": m.counters(),
            "throughput_tps": m.throughput_tps(),
            "samples": m.samples(),
            "buckets": m.buckets(now_ms()),
            "requests_by_model": m.requests_by_model(),
        }
        if self.stage is not None:
            changes.update(
                step_ms_per_layer=round(self.stage.stats.step_ms_per_layer, 4),
                vram_mb=self.stage.engine.memory().total_mb + (self.stage.kept.reserved_bytes >> 20 if self.stage.kept else 0),
            )
        return record.replace(**changes)

    # ------------------------------------------------------- PeerContext API

    def multiaddrs(self) -> list[str]:
        return self.host.multiaddrs() if self.host else []

    def views(self) -> list[NodeView]:
        return self.registry.views() if self.registry else []

    def view_of(self, node_id: NodeId) -> NodeView | None:
        return self.registry.view(node_id) if self.registry else None

    def coverage(self) -> dict[ModelId, ModelCoverage]:
        """Each model's coverage, a model of the catalog in the catalog's shape (records stating
        another hold no part of it: routes leave them out too)."""
        return model_coverage(self.views(), self._catalog_shape)

    def catalog(self) -> list[ModelSpec]:
        return self._catalog().all()

    def local_engine(self) -> tuple[NodeId, ModelId, LayerRange] | None:
        if self.stage is None:
            return None
        info = self.stage.engine.info
        return NodeId(self.peer_id), info.model_id, info.layers

    def artifacts(self) -> SwarmArtifacts:
        if self._artifacts is None:
            raise ServiceUnavailable("artifact storage is not open yet on this peer")
        return self._artifacts

    def _registry_peers(self) -> list[str]:
        """Every libp2p peer the registry names (owners of ids, even if now Dead)."""
        return sorted({v.record.peer_id for v in self.views()})

    def _live_peers(self) -> list[str]:
        return sorted({v.record.peer_id for v in self.views() if v.state != "Dead"})
    def session_route(self, session_id: SessionId) -> tuple[Hop, ...] | None:
        for pipeline in self._pipelines.values():
            route = pipeline.route_of(session_id)
            if route is not None:
                return route
        return None

    def metrics_archive(self) -> MetricsStore:
        assert self.metrics_store is not None
        return self.metrics_store

    def failover_counters(self) -> dict[str, int]:
        stats = self.stage.stats if self.stage else None
        return {"adopted": stats.adopted if stats else 0, "recomputed": stats.recomputed if stats else 0}

    def connection_counters(self) -> dict[str, int]:
        if self.host is None:
            return {}
        guard, rate = self.host.connection_guard, self.host.connection_guard.rate
        return {
            "refused_by_source": rate.refused_by_source,
            "refused_in_all": rate.refused_in_all,
            "let_in_quiet": rate.let_in_quiet,
            "handshakes_evicted": guard.handshaking.evicted,
            "inbound_evicted": guard.established.evicted,
            "outbound_closed": self.host.outbound_guard.closed,
        }

    def open_sessions(self) -> dict[str, int]:
        return {
            "stage": self.stage.sessions if self.stage else 0,
            "entry": sum(len(p.open_sessions) for p in self._pipelines.values()),
        }

    def stage_batching(self) -> dict[str, object] | None:
        if self.stage is None:
            return None
        stats = self.stage.stats
        return {"step_rounds": stats.step_rounds, "step_jobs": stats.step_jobs,
                "mean_step_batch": round(stats.mean_step_batch, 3), "step_seconds": round(stats.step_seconds, 6),
                "inline_cpu_seconds": round(stats.inline_cpu_seconds, 6),
                "step_rounds_by_lane": list(stats.step_rounds_by_lane)}  # fmt: skip

    # ------------------------------------------------- admin and legacy nodes

    def _record_of(self, node_id: str) -> NodeView:
        for view in self.views():
            if view.record.node_id == node_id:
                return view
        raise NotFound(f"no node {node_id!r} in the registry")

    async def admin_command(self, action: str, node_id: str, **args: object) -> dict:
        """Run an admin action on the peer responsible for ``node_id``, signed by this peer.

        A forced deregistration goes to every other peer (the node itself is not told)."""
        assert self.admin_service is not None
        view = self._record_of(node_id)
        service = self.admin_service
        if action != "force_remove":
            holder = PeerId(view.record.peer_id)
            return await service.send(holder, service.command(action, node_id, holder, **args))  # type: ignore[arg-type]
        targets = {PeerId(v.record.peer_id) for v in self.views() if v.state != "Dead"} | {PeerId(self.peer_id)}
        if not view.record.relayed:
            targets.discard(PeerId(view.record.peer_id))
        failures: list[str] = []

        async def tell(peer: PeerId) -> None:
            try:
                await service.send(peer, service.command(action, node_id, peer))  # type: ignore[arg-type]
            except AdminRefused as exc:
                failures.append(f"{peer}: {exc}")

        async with trio.open_nursery() as nursery:
            for peer in targets:
                nursery.start_soon(tell, peer)
        if failures:
            log.warning("force-deregistration of %s not applied everywhere: %s", node_id, "; ".join(failures))
        return {"node_id": node_id}

    async def legacy_register(self, body: dict, *, assign: bool, join_token: str | None = None) -> dict:
        assert self.legacy is not None
        return await self.legacy.register(body, assign=assign, join_token=join_token)

    async def legacy_heartbeat(self, node_id: str, body: dict, *, token: str | None = None) -> None:
        assert self.legacy is not None
        await self.legacy.heartbeat(node_id, body, token)

    async def legacy_leave(self, node_id: str, *, token: str | None = None) -> None:
        assert self.legacy is not None
        await self.legacy.leave(node_id, token)

    def knows_model(self, model_id: str) -> bool:
        return model_id in self._catalog() or any(v.record.model_id == model_id for v in self.views())

    async def chat_model(self, model_id: str) -> ChatModel:
        cached = self._chat_models.get(model_id)
        if cached is not None:
            return cached
        lock = self._chat_locks.setdefault(model_id, trio.Lock())
        async with lock:
            if model_id not in self._chat_models:
                path = await self._vocab_path(model_id)
                self._chat_models[model_id] = await trio.to_thread.run_sync(ChatModel.load, ModelId(model_id), path)
        return self._chat_models[model_id]

    async def local_chat_model(self, model_id: str) -> ChatModel | None:
        """Loaded already, or readable from the model file pulled here; never fetched."""
        if model_id in self._chat_models:
            return self._chat_models[model_id]
        if self._pulled_path(model_id) is None:
            return None
        return await self.chat_model(model_id)

    async def _vocab_path(self, model_id: str) -> Path:
        """Where to read a model's vocabulary: its own file when pulled here (llama.cpp's
        vocab-only load skips the weights), else a vocab-only copy fetched from a holder and
        verified against the hash the holders announce (:mod:`p2p.vocab`)."""
        pulled = self._pulled_path(model_id)
        if pulled is not None:
            return pulled
        if not self.knows_model(model_id):
            raise UnknownModel(f"model {model_id!r} is not in the registry")
        assert self.host is not None
        try:
            catalog_sha = self._catalog().get(model_id).gguf_sha256
        except InclavateError:  # a model only the registry knows
            catalog_sha = ""
        source = choose_vocab(self.views(), model_id, catalog_sha)
        cached = self.config.data_dir / "vocab" / f"{_file_safe(model_id)}@{source.sha256[:16]}.gguf"
        if cached.exists() and await trio.to_thread.run_sync(sha256_file, cached) == source.sha256:
            return cached
        return await fetch_vocab(self.host, model_id, source, cached)

    async def _prepare_vocab(self) -> None:
        """Write (once per model file, in the shared slice cache) the vocab-only GGUF we
        serve and announce its hash with the next heartbeat. Seconds of work, so it runs
        after Ready; until then fetchers use other holders."""
        # Abandoned on cancel: shutdown must not wait seconds for a file nobody will fetch
        # (the unfinished temporary file is never renamed into place).
        try:
            path = await trio.to_thread.run_sync(self._own_vocab_file, abandon_on_cancel=True)
            self._vocab_sha256 = await trio.to_thread.run_sync(sha256_file, path, abandon_on_cancel=True)
        except (OSError, InclavateError) as exc:
            log.warning("cannot prepare the vocabulary file others fetch: %s", exc)

    def _own_vocab_file(self) -> Path:
        """Peers sharing a home (a machine's local swarm) write it once: the first holds a
        file lock while the others wait and reuse its result."""
        assert self._model_path is not None
        key = self._model_sha256[:16] or _file_safe(self.config.model_id)
        dest = self.config.home / "slices" / key / "vocab-only.gguf"
        if dest.exists():
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest.with_name(".vocab-only.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return dest if dest.exists() else write_vocab_only(self._model_path, dest)

    def _catalog(self) -> Catalog:
        """The catalog plus overlay, re-read only when the overlay file changed (a request
        path must not parse TOML on every call, but `inclavate pull --as` must show up)."""
        overlay = overlay_path(self.config.home)
        stamp = overlay.stat().st_mtime_ns if overlay.exists() else 0
        if self._catalog_cache is None or self._catalog_cache[0] != stamp:
            self._catalog_cache = (stamp, Catalog.load(self.config.home))
        return self._catalog_cache[1]

    def _pulled_path(self, model_id: str) -> Path | None:
        store = ModelStore(self.config.home)
        try:
            spec = self._catalog().get(model_id)
        except InclavateError:  # unknown here
            return None
        return store.path(spec) if store.is_pulled(spec) else None

    def _local_vocab(self, model_id: str) -> Path | None:
        """For ``/inclavate/vocab/1``: the vocab-only GGUF of the model we serve (the file
        whose hash our record announces); None for any other model."""
        if model_id != self.config.model_id or not self._vocab_sha256:
            return None
        return self._own_vocab_file()

    def _measured_step_ms(self, model_id: str) -> float:
        """Our own stage's measured ms per layer for ``model_id`` (0 when we run none): what
        routing trusts over any other node's claim of being faster."""
        stage = self.stage
        if stage is None or stage.engine.info.model_id != model_id:
            return 0.0
        return float(stage.stats.step_ms_per_layer)

    def pipeline(self, model_id: str) -> Pipeline:
        if self.shutting_down:
            raise ServiceUnavailable("this peer is shutting down; send the request to another peer")
        assert self.forward is not None and self.host is not None
        pipeline = self._pipelines.get(model_id)
        if pipeline is None:
            pipeline = self._pipelines[model_id] = SwarmPipeline(
                self.forward, ModelId(model_id), self.views, 0, self.view_of,
                link_ms=lambda: self.latency.link_ms() if self.latency else {},
                measured_step_ms=lambda: self._measured_step_ms(model_id),
                is_connected=self.host.is_connected,
                probe=self.latency.responds if self.latency else None,
                policy=self.config.failover, health=self._peer_health, lanes=self.config.decode_lanes,
                left=lambda: self.leaving_now,
            )  # fmt: skip
        facts, shape = self._model_facts(model_id), self._catalog_shape(model_id)
        pipeline.n_layers = facts[0] if facts else None
        pipeline.d_model = shape[1] if shape else None
        pipeline.context_length = self._chain_context(model_id, pipeline.n_layers, pipeline.d_model)
        pipeline.check_route()  # raises NoRoute (503) before any work
        self.metrics.record_request(model_id)
        return pipeline

    def _chain_context(self, model_id: str, n_layers: int | None, d_model: int | None = None) -> int:
        """Positions a chain of ``model_id`` holds (:func:`p2p.routing.chain_context`): the
        largest context a complete chain still holds, up to this peer's own when it serves the
        model, else up to its own or what most peers state, whichever is more. Records only
        ever leave themselves out of routes: a vote of three free records saying 2 refused
        every chat on every peer (an audit, 2026-12-07; it was what most peers stated, and one
        record saying 2 before that). A larger claim than that cap is never taken: a node
        claiming the whole model and a huge context would then be the only route."""
        views, own = self.views(), self.config.engine.context_length
        cap = own
        if self._spec is None or self._spec.model_id != model_id:
            routable = [v.record for v in views if v.record.model_id == model_id and v.routable and v.record.context_length]
            cap = max(own, agreed(routable, lambda r: r.context_length) or 0)
        return chain_context(views, ModelId(model_id), PeerId(self.peer_id), cap, n_layers=n_layers, d_model=d_model)

DATA_DIR_LOCK = "peer.lock"


def preflight(config: PeerConfig, catalog: Catalog) -> ModelSpec:
    """What can be refused from the catalog alone, before the data dir is made or any port is
    opened: the model (:class:`~inclavate.catalog.ModelNotFound`) and ``--layers`` against its
    layer count (checked again against the GGUF in :meth:`Peer._place`)."""
    spec = catalog.get(config.model_id)
    if config.layers is not None and config.layers.end > spec.n_layers:
        raise ConfigError(f"--layers {config.layers} exceeds the model's {spec.n_layers} layers")
    return spec


def _api_bind_fix(busy: OSError) -> str:
    """What the user should change when the API's address cannot be bound: a name that does
    not resolve or an address this machine does not have is the host's fault, not the port's."""
    if isinstance(busy, socket.gaierror) or busy.errno == errno.EADDRNOTAVAIL:
        return "check --api-host"
    return "choose another --api-port"


def hold_data_dir(data_dir: Path) -> IO[str]:
    """Create ``data_dir`` if need be and take it for this process (an exclusive ``flock`` on ``peer.lock``, which the
    kernel releases however the process ends, ``kill -9`` included); close the file to free it.

    A data directory is a peer's identity: two peers running on one would publish records of
    one PeerID, each replacing the other's in the registry, and write into each other's stores
    and peer book. The second is refused with :class:`ConfigError` naming the holder's pid."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        lock = open(data_dir / DATA_DIR_LOCK, "a+")  # noqa: SIM115 (held for the peer's life)
    except OSError as exc:  # a path under /proc, a file, no permission: a usage error, not a traceback
        raise ConfigError(f"cannot use {data_dir} as the data dir: {exc} (choose another --data-dir)") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise ConfigError(f"{data_dir} is in use by another peer (pid {holder}): wait for it to exit (a peer "
                          "stopping with Ctrl-C drains first), or give this one its own --data-dir") from None  # fmt: skip
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def _file_safe(model_id: str) -> str:
    return model_id.replace(":", "@").replace("/", "_")
