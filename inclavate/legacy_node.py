"""A legacy node: one layer range served over plain HTTP, vouched for by a peer.

For machines that cannot run libp2p. ``inclavate peer --legacy --orchestrator URL`` registers
with that peer (``POST /nodes/join``, or ``POST /nodes`` with ``--layers``), loads the range it
was given, heartbeats, and serves the relaying peer's forward frames:

* ``POST /forward``: a forward-protocol frame in, the next frame out (a ``forward`` for the
  next hop, the ``result`` token, an ``error``), or 204 for a prefill chunk with nothing to say;
* ``POST /close``: frees a session, answers the ``close`` for the next hop or ``closed``;
* ``GET /health``.

Only the peer it registered with can drive it: both POSTs need the relay token the node sent
at registration. Ctrl-C or SIGTERM deregisters (``DELETE /nodes/:id``) before exiting.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import signal
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import trio
from quart import Response, jsonify, request
from quart_trio import QuartTrio

from api.app import serve_api
from inclavate import __version__, hardware, tensors
from inclavate.catalog import Catalog
from inclavate.errors import ConfigError
from inclavate.gguf_meta import read_metadata
from inclavate.http_client import request_json
from inclavate.peer_config import PeerConfig
from inclavate.store import ModelStore
from inclavate.types import LayerRange, ModelId, PeerId
from node.engine import BatchItem
from node.engine_thread import EngineThread
from node.llamacpp_engine import LlamaCppEngine
from node.stage import Job, Stage, StageResult
from p2p import wire
from p2p.errors import P2PError
from p2p.forward import error_code_for
from p2p.forward_checks import FrameRejected, check_hidden, check_tokens
from p2p.legacy import JOIN_TOKEN_HEADER, TOKEN_HEADER

log = logging.getLogger(__name__)


def _persistent(config: PeerConfig, name: str, make: Callable[[], str]) -> str:
    """A value stable across restarts, kept in the data directory (owner-only)."""
    path = config.data_dir / name
    if path.exists():
        return path.read_text().strip()
    config.data_dir.mkdir(parents=True, exist_ok=True)
    value = make()
    path.touch(mode=0o600)
    path.write_text(value)
    return value


class LegacyNode:
    def __init__(self, config: PeerConfig, orchestrator: str, advertise_url: str | None = None) -> None:
        self.config = config
        self.orchestrator = orchestrator.rstrip("/")
        # Both survive restarts: the id like a PeerID, the token so that a restarted node can
        # register its id again (the peer refuses the id to anyone without its token).
        self.node_id = _persistent(config, "legacy-node-id", lambda: str(uuid.uuid4()))
        self.token = _persistent(config, "legacy-relay-token", lambda: secrets.token_hex(16))
        self.url = advertise_url or f"http://{config.api_host}:{config.api_port}"
        self.stage: Stage | None = None
        self.requests = 0
        self._registration: dict[str, Any] = {}
        """The body this node registered with, its layers fixed: sent again when the peer
        answers a heartbeat 404 (it had dropped the node, which then beat in vain for good)."""

    async def _call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        headers = {TOKEN_HEADER: self.token}
        if self.config.join_token:
            headers[JOIN_TOKEN_HEADER] = self.config.join_token
        return await trio.to_thread.run_sync(lambda: request_json(method, self.orchestrator + path, body, 30.0, headers))

    async def run(self, *, task_status: trio.TaskStatus[LegacyNode] = trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        home = cfg.home
        spec = Catalog.load(home).get(cfg.model_id)
        path = (await trio.to_thread.run_sync(ModelStore(home).pull, spec)).path
        meta = read_metadata(path)
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_api, self._app(), cfg.api_host, cfg.api_port)
            body = {
                "node_id": self.node_id, "model_id": spec.model_id, "http_url": self.url,
                "n_total_layers": meta.n_layers, "d_model": meta.d_model, "vram_mb": 0,
                "hardware": hardware.profile(), "relay_token": self.token,
            }  # fmt: skip
            if cfg.layers is not None:
                status, answer = await self._call("POST", "/nodes", {**body, "start_layer": cfg.layers.start, "end_layer": cfg.layers.end})
                layers = cfg.layers
            else:
                status, answer = await self._call("POST", "/nodes/join", body)
                layers = LayerRange(answer["start_layer"], answer["end_layer"]) if status == 200 else None
            if status != 200 or layers is None:
                raise ConfigError(f"{self.orchestrator} refused the registration ({status}): {answer}")
            self._registration = {**body, "start_layer": layers.start, "end_layer": layers.end}
            log.info("registered as %s with %s: layers %s", self.node_id, self.orchestrator, layers)
            engine_thread = EngineThread(f"engine {layers}")  # the stage's: one thread calls the engine
            engine = await engine_thread.run(lambda: LlamaCppEngine(
                model_id=ModelId(spec.model_id), model_path=path, model_sha256=spec.gguf_sha256,
                layers=layers, config=cfg.engine, slice_cache=home / "slices"))  # fmt: skip
            self.stage = Stage(engine, engine_thread=engine_thread)
            await nursery.start(self.stage.run)
            nursery.start_soon(self._heartbeat)
            log.info("legacy node ready: %s layers %s at %s", spec.model_id, layers, self.url)
            task_status.started(self)

    async def _heartbeat(self) -> None:
        while True:
            assert self.stage is not None
            stats = self.stage.stats
            status, answer = await self._call("POST", f"/nodes/{self.node_id}/health", {
                "tokens_generated": stats.tokens, "requests_served": self.requests, "errors": stats.errors,
                "avg_latency_ms": stats.step_ms_per_layer * len(self.stage.engine.info.layers),
                "peak_vram_mb": self.stage.engine.memory().total_mb, "ready": True,
            })  # fmt: skip
            if status == 404:  # the peer forgot us (silent too long, or it restarted): register again
                status, answer = await self._call("POST", "/nodes", self._registration)
                log.warning("%s no longer knew this node; registering again: %s %s", self.orchestrator, status, answer)
            elif status != 200:
                log.warning("heartbeat refused by %s (%s): %s", self.orchestrator, status, answer)
            await trio.sleep(self.config.liveness.heartbeat_s)

    async def leave(self) -> None:
        with trio.move_on_after(5):
            status, _ = await self._call("DELETE", f"/nodes/{self.node_id}")
            log.info("deregistered from %s (%s)", self.orchestrator, status)

    # ----------------------------------------------------------- HTTP side

    def _app(self) -> QuartTrio:
        app = QuartTrio("inclavate-legacy")

        @app.get("/health")
        async def health():  # type: ignore[no-untyped-def]
            engine = self.stage.engine.info if self.stage else None
            return jsonify(ok=True, version=__version__, node_id=self.node_id, legacy=True,
                           layers=[engine.layers.start, engine.layers.end] if engine else None)  # fmt: skip

        @app.post("/forward")
        async def forward():  # type: ignore[no-untyped-def]
            msg = await self._frame(wire.Forward)
            return await self._run_forward(msg)

        @app.post("/close")
        async def close():  # type: ignore[no-untyped-def]
            msg = await self._frame(wire.Close)
            done = trio.Event()

            async def deliver(_: StageResult) -> None:
                done.set()

            assert self.stage is not None
            await self.stage.submit(Job(None, msg.session_id, deliver))
            await done.wait()
            nxt = (wire.Close(msg.req_id, msg.session_id, msg.route[1:], msg.reply_to) if len(msg.route) > 1
                   else wire.Closed(msg.req_id, msg.session_id))  # fmt: skip
            return Response(wire.encode(nxt), mimetype="application/octet-stream")

        @app.errorhandler(_Http)
        async def _on_http(exc: _Http) -> Response:
            response = jsonify({"error": str(exc)})
            response.status_code = exc.status
            return response

        @app.errorhandler(P2PError)
        async def _on_bad_frame(exc: P2PError) -> Response:
            response = jsonify({"error": f"bad frame: {exc}"})
            response.status_code = 400
            return response

        return app

    async def _frame(self, kind: type) -> Any:
        if self.stage is None:
            raise _Http(503, "still loading")
        if not hmac.compare_digest(request.headers.get(TOKEN_HEADER, "").encode(), self.token.encode()):
            raise _Http(403, "wrong relay token")
        msg = wire.decode(await request.get_data(cache=False))
        if not isinstance(msg, kind):
            raise _Http(400, f"expected a {kind.TYPE} frame")
        return msg

    async def _run_forward(self, msg: wire.Forward) -> Response:
        assert self.stage is not None
        info = self.stage.engine.info
        if msg.route[0].layers != info.layers:
            return self._reply(wire.Error(msg.req_id, msg.session_id, "wrong_route", f"this node holds {info.layers}", PeerId(self.node_id)))
        try:
            if msg.tokens is not None:
                check_tokens(msg.tokens, info)
                item = BatchItem(msg.session_id, msg.start_pos, tokens=msg.tokens)
            else:
                hidden = tensors.decode(msg.hidden) if msg.hidden is not None else np.zeros((0, 0), np.float32)
                check_hidden(hidden, info)
                item = BatchItem(msg.session_id, msg.start_pos, hidden=hidden)
        except FrameRejected as exc:
            return self._reply(wire.Error(msg.req_id, msg.session_id, "invalid_batch", str(exc), PeerId(self.node_id)))
        results: list[StageResult] = []
        done = trio.Event()

        async def deliver(result: StageResult) -> None:
            results.append(result)
            done.set()

        if msg.start_pos == 0:
            self.requests += 1
        await self.stage.submit(Job(item, msg.session_id, deliver, msg.sampling, lane=msg.lane))
        await done.wait()
        result = results[0]
        if result.error is not None:
            return self._reply(wire.Error(msg.req_id, msg.session_id, error_code_for(result.error), str(result.error), PeerId(self.node_id)))
        assert result.output is not None
        if len(msg.route) > 1:
            hidden = tensors.encode(result.output.hidden, self.config.wire_dtype)
            return self._reply(wire.Forward(msg.req_id, msg.session_id, msg.start_pos, msg.route[1:], msg.reply_to,
                                            msg.sampling, hidden=hidden, lane=msg.lane))  # fmt: skip
        if msg.sampling is None:
            return Response(status=204)
        return self._reply(wire.Result(msg.req_id, msg.session_id, result.token))

    @staticmethod
    def _reply(msg: wire.Message) -> Response:
        return Response(wire.encode(msg), mimetype="application/octet-stream")


class _Http(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def run_legacy_until_signal(config: PeerConfig, orchestrator: str, advertise_url: str | None) -> None:
    node = LegacyNode(config, orchestrator, advertise_url)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            async for signum in signals:
                log.info("%s received", signal.Signals(signum).name)
                await node.leave()
                nursery.cancel_scope.cancel()
                break
