"""Legacy nodes: machines that speak HTTP but not libp2p, vouched for by a peer.

A legacy node registers with any peer (``POST /nodes`` or ``/nodes/join``), heartbeats to it
(``POST /nodes/:id/health``) and leaves with ``DELETE /nodes/:id``. That peer publishes the
node's record in the registry, signed by itself and marked ``relayed``, and is its transport:
a chain hop for the node arrives at the relaying peer over libp2p, which POSTs the forward
frame to the node's ``/forward`` endpoint and sends what comes back (the next hop's forward,
or the token) on over libp2p. Frames are the forward protocol's own bytes; a per-node secret
(``X-Inclavate-Relay-Token``, given by the node at registration, never gossiped) means only
the peer it registered with can drive it.

The node's registry id is namespaced under the vouching peer, ``<PeerID>:<its own id>``
(:func:`p2p.records.legacy_node_id`): a record is accepted only from the peer that owns its
id, so a legacy id can never collide with, or take over, a PeerID or another peer's node.
The node itself keeps using its own id with this peer (heartbeats, leave).

When heartbeats stop, the peer stops vouching, and the node ages to Degraded then Dead like
any silent peer.

Registration is open to strangers (unless the peer has a ``--join-token``), so it is
bounded: the URL must be ``http(s)`` and answer ``GET /health`` before the node is
announced; heartbeats and leave must present the relay token given at registration, and a
live id can only be registered again with that same token (a node restarting). All HTTP
to a node goes through :mod:`p2p.legacy_http` (no redirects, bounded size and time, its own
threads). A node whose forward fails at the transport level is *held out* of routing (its
record says Joining) for a backoff that doubles on every failure, so chains route around it
while its heartbeats still say ready.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from inclavate import tensors
from inclavate.untrusted import Malformed, as_dict, as_float, as_str, read_bool, read_float, read_int, read_str
from inclavate.types import LayerRange, ModelId, NodeId, PeerId
from p2p import wire
from p2p.coverage import uncovered
from p2p.errors import P2PError
from p2p.forward_checks import FrameRejected, check_states, relay_answer_matches
from p2p.legacy_http import HttpLimits, LegacyHttp, NodeUnreachable, check_node_url
from p2p.gossip import RegistryService
from p2p.record_schema import MAX_COUNT
from p2p.records import Counters, InvalidRecord, NodeRecord, legacy_local_id, legacy_node_id, legacy_owner
from p2p.ticks import sleep_to_tick

log = logging.getLogger(__name__)

TOKEN_HEADER = "X-Inclavate-Relay-Token"
JOIN_TOKEN_HEADER = "X-Inclavate-Join-Token"
MIN_TOKEN_CHARS = 16
PROBE_TIMEOUT_S = 5.0
PROBE_LIMITS = HttpLimits(timeout_s=PROBE_TIMEOUT_S, max_response_bytes=64 * 1024, threads=4)
"""A probe reads a small ``/health`` answer, four at a time: a burst of registrations naming
slow URLs may have an honest one refused (it registers again), never a relay delayed."""
HOLD_OUT_S = (5.0, 600.0)
"""First and longest hold-out of a node whose forward failed (doubling in between)."""
MAX_LEGACY_NODES = 32
"""Legacy nodes one peer vouches for (strangers register them; its registry quota is 64)."""
_LOCAL_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
_MAX_TEXT = 512


class LegacyError(P2PError):
    """Base of the errors a legacy registration can meet."""


class BadRegistration(LegacyError):
    """A registration or heartbeat body that is missing or mistypes a field (400)."""


class DuplicateNode(LegacyError):
    """A live node with this id is already registered (409)."""


class NodeMismatch(LegacyError):
    """Unknown model, or the node's shape (layers, width) does not match it (422)."""


class NoRangeAvailable(LegacyError):
    """Every layer of the model is already covered: nothing to assign (503)."""


class UnknownLegacyNode(LegacyError):
    """No legacy node with this id is registered at this peer (404)."""


class NotYourNode(LegacyError):
    """A missing or wrong relay token, or join token (403)."""


class UnreachableNode(LegacyError):
    """The node's URL did not answer ``GET /health`` at registration (422)."""


_RELAY_QUEUE = 64
"""Frames waiting for one legacy node's HTTP relay."""


@dataclass
class _Node:
    record: NodeRecord
    forward_url: str
    token: str
    last_heartbeat: float = field(default_factory=time.monotonic)
    queue: trio.MemorySendChannel[wire.Forward | wire.Close] | None = None
    failures: int = 0
    """Consecutive forwards that failed at the transport level."""
    held_out_until: float = 0.0

    def owns(self, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(token.encode(), self.token.encode())

    @property
    def held_out(self) -> bool:
        return time.monotonic() < self.held_out_until


@dataclass
class _Departed:
    """A node gone from this peer's table while receivers may still hold its record."""

    node: _Node
    until: float
    """``time.monotonic()`` past which no receiver keeps its record (the registry's drop horizon)."""
    left: bool
    """It said goodbye (``DELETE``); else it went silent, and a heartbeat with its token revives it."""


ModelFacts = Callable[[str], tuple[int, int] | None]
"""(n_layers, d_model) of a model known to this peer, or None."""


class LegacyNodes:
    def __init__(self, registry: RegistryService, model_facts: ModelFacts, *, send: Any = None,
                 join_token: str | None = None, http: LegacyHttp | None = None) -> None:  # fmt: skip
        self.registry = registry
        self.model_facts = model_facts
        self.send = send
        """``ForwardService.send``: where relayed outputs go (set by the peer)."""
        self.join_token = join_token
        """When set, registration must present it (``X-Inclavate-Join-Token``)."""
        self.http = http or LegacyHttp()
        self.probes = LegacyHttp(PROBE_LIMITS)
        """For registration probes: threads of their own, so that a burst of registrations
        naming slow URLs holds no thread the relays to registered nodes need."""
        self._nodes: dict[NodeId, _Node] = {}
        self._registering: set[NodeId] = set()
        """Ids whose registration is under way (probing the node's URL, publishing)."""
        self._departed: dict[NodeId, _Departed] = {}
        """Nodes that left or went silent, for as long as receivers may hold their records
        (:meth:`_depart`): their ids stay theirs, and they count against the bound."""
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                await sleep_to_tick(1.0)
                self._drop_silent()

    # -------------------------------------------------------- registration

    async def register(self, body: dict[str, Any], *, assign: bool, join_token: str | None = None) -> dict[str, Any]:
        if self.join_token and not (join_token and hmac.compare_digest(join_token.encode(), self.join_token.encode())):
            raise NotYourNode(f"this peer admits legacy nodes only with its join token ({JOIN_TOKEN_HEADER})")
        try:
            return await self._register(body, assign=assign)
        except Malformed as exc:
            raise BadRegistration(str(exc)) from None

    async def _register(self, body: dict[str, Any], *, assign: bool) -> dict[str, Any]:
        local_id = _text(body, "node_id")
        if not _LOCAL_ID.fullmatch(local_id):
            raise BadRegistration("node_id must be 1-128 letters, digits, '.', '_' or '-'")
        node_id = self._registry_id(local_id)
        model_id = _text(body, "model_id")
        facts = self.model_facts(model_id)
        if facts is None:
            raise NodeMismatch(f"unknown model {model_id!r}")
        n_layers, d_model = facts
        for key, expected in (("n_total_layers", n_layers), ("d_model", d_model)):
            # A wrong type is malformed (400), not a shape that does not match (422).
            if (claimed := read_int(body, key, lo=0, default=expected)) != expected:
                raise NodeMismatch(f"{key} {claimed} does not match {model_id} ({expected})")
        claimed = body.get("relay_token") if isinstance(body.get("relay_token"), str) else None
        previous = self._nodes.get(node_id)
        if previous is not None and not previous.owns(claimed):
            raise DuplicateNode(f"node {local_id} is already registered")
        # ``previous``: the same node (it holds the token), restarted. It stays registered
        # until its new registration is published: one refused half-way (a bad range, a URL
        # that does not answer yet) used to leave its old record vouched for by nobody's
        # entry, republished for ever, and its id refused to the node itself (409).
        self._forget_departed()
        departed = self._departed.get(node_id)
        if departed is not None and not departed.node.owns(claimed):
            # Its record may still read Ready or Degraded somewhere: the id is still its own.
            raise DuplicateNode(f"node {local_id} is already registered")
        returning = previous is not None or departed is not None
        self._check_unique(node_id, previous, returning=returning)
        if node_id in self._registering:
            raise DuplicateNode(f"node {local_id} is being registered right now")
        # Registrations still probing count: checking the table alone, any number of
        # concurrent ones passed while each waited for its URL (50 at once made 50 nodes).
        # Departed nodes count until receivers drop their records: registering and leaving
        # fresh ids filled this peer's registry quota with Dead records, and the swarm then
        # refused every record it signed for a quarter of an hour (an audit, 2026-12-07).
        if len(self._nodes.keys() | self._registering | self._departed.keys()) - returning >= MAX_LEGACY_NODES:
            raise NoRangeAvailable(f"this peer already vouches for {MAX_LEGACY_NODES} legacy nodes; register with another peer")
        # The fields a node describes itself with, before a range is chosen: with every layer
        # held, a malformed one was a 503 "every layer is already covered", not a 400 naming it.
        # (A missing relay_token stays after: the spec's own join body has none, and its
        # statuses, 409 taken and 503 covered, come first.)
        http_url = check_node_url(_text(body, "http_url"))
        vram_mb = read_int(body, "vram_mb", lo=0, hi=1 << 40, default=0)
        hardware = _hardware(body.get("hardware"))
        layers = self._requested_layers(body, n_layers) or (self._assign(ModelId(model_id), n_layers, body) if assign else None)
        if layers is None:
            raise BadRegistration("start_layer and end_layer are required")
        token = read_str(body, "relay_token", max_len=256, default="")
        if len(token) < MIN_TOKEN_CHARS:
            raise BadRegistration(f"relay_token is required: a secret of at least {MIN_TOKEN_CHARS} characters")
        self._registering.add(node_id)  # no await since the checks above
        try:
            await self._probe(http_url)
            self._check_unique(node_id, previous, returning=returning)  # again: another may have won meanwhile
            record = NodeRecord(
                node_id=node_id, peer_id=self.registry.identity.peer_id, model_id=ModelId(model_id),
                start_layer=layers.start, end_layer=layers.end, n_layers=n_layers, d_model=d_model, state="Joining",
                seq=0, ts_ms=0, vram_mb=vram_mb, hardware=hardware,
                api_url=http_url, relayed=True, forward_url=http_url, started_ms=int(time.time() * 1000),
            )  # fmt: skip
            node = _Node(record, http_url + "/forward", token)
            replaced = previous is not None and self._nodes.get(node_id) is previous
            self._nodes[node_id] = node
            self._start_worker(node)
            try:
                node.record = await self.registry.publish(record)
            except BaseException as exc:
                self._undo(node, previous if replaced else None)
                if isinstance(exc, InvalidRecord):  # e.g. a hardware profile nested too deep to gossip
                    raise BadRegistration(f"the node's record would be refused by the swarm: {exc}") from exc
                raise
            if self.registry.view(node_id) is None:  # our own table refused it, so will everyone's
                self._undo(node, previous if replaced else None)
                raise NoRangeAvailable("the swarm refuses this peer's record of the node now (its registry "
                                       "quota, or a ban of the id); register with another peer")  # fmt: skip
        finally:
            self._registering.discard(node_id)
        self._departed.pop(node_id, None)
        if previous is not None and previous.queue is not None:
            previous.queue.close()  # its worker ends; the new one relays from now on
        log.info("vouching for legacy node %s (%s layers %s at %s)", node_id, model_id, layers, http_url)
        # The node keeps using the id it chose with this peer; the swarm knows it namespaced.
        return {"node_id": local_id, "registry_id": node_id, "start_layer": layers.start, "end_layer": layers.end,
                "warnings": []}  # fmt: skip

    def _undo(self, node: _Node, previous: _Node | None) -> None:
        """A registration that could not be published: ``previous`` (the node's registration
        it was to replace) goes on as before, or nothing is left of the id."""
        node_id = node.record.node_id
        if self._nodes.get(node_id) is node:
            del self._nodes[node_id]
        if node.queue is not None:
            node.queue.close()
        if previous is not None:
            self._nodes.setdefault(node_id, previous)
        elif node_id not in self._nodes:
            self.registry.stop_vouching(node_id)  # publishing may have got as far as our table

    async def _probe(self, http_url: str) -> None:
        """A node is announced only once its URL answers: a made-up URL never enters routing.

        Every failure gets the same answer. Naming it ("connection refused", "name not
        known", "answered 404") let any HTTP client map what listens on this peer's loopback
        and LAN through registrations; the detail goes to this peer's log only."""
        try:
            status, _ = await self.probes.request("GET", http_url + "/health")
            detail = f"answered {status}"
        except NodeUnreachable as exc:
            status, detail = None, str(exc)
        if status != 200:
            log.info("legacy registration refused: %s did not answer GET /health with 200 (%s)", http_url, detail)
            raise UnreachableNode(f"http_url did not answer GET /health with 200 within {PROBE_TIMEOUT_S:g} s")

    def _registry_id(self, node_id: str) -> NodeId:
        """The registry id of one of our legacy nodes, given its own id or the namespaced one."""
        if legacy_owner(node_id) == self.registry.identity.peer_id:
            return NodeId(node_id)
        return legacy_node_id(self.registry.identity.peer_id, node_id)

    def _check_unique(self, node_id: NodeId, previous: _Node | None = None, *, returning: bool = False) -> None:
        """409 for an id live anywhere in the swarm, under any vouching peer (namespacing
        makes a takeover impossible; this keeps the spec's "already registered" answer).
        ``previous``: this id's live registration; ``returning``: the caller proved it is
        this id's node (it holds the token of its registration, live or departed), so that
        registration and our own record of it are no conflict (a node silent for a few
        seconds was refused its own id for as long as its record read Degraded)."""
        local = legacy_local_id(node_id)
        current = self._nodes.get(node_id)
        if current is not None and current is not previous:
            raise DuplicateNode(f"node {local} is already registered")
        for view in self.registry.views():
            record = view.record
            if returning and record.node_id == node_id:
                continue
            if view.state != "Dead" and record.relayed and legacy_local_id(record.node_id) == local:
                raise DuplicateNode(f"node {local} is already registered")

    @staticmethod
    def _requested_layers(body: dict[str, Any], n_layers: int) -> LayerRange | None:
        try:
            if isinstance(body.get("layers"), str):
                layers = LayerRange.parse(body["layers"])
            elif "start_layer" in body and "end_layer" in body:
                # integers only: int() made 0.5 layer 0, true layer 1 and "7" layer 7
                layers = LayerRange(read_int(body, "start_layer"), read_int(body, "end_layer"))
            else:
                return None
        except (TypeError, ValueError) as exc:
            raise BadRegistration(f"bad layer range: {exc}") from exc
        if layers.end > n_layers:
            raise NodeMismatch(f"layers {layers} exceed the model's {n_layers}")
        return layers

    def _assign(self, model_id: ModelId, n_layers: int, body: dict[str, Any]) -> LayerRange:
        held = [v.record.layers for v in self.registry.views()
                if v.record.model_id == model_id and v.state in ("Ready", "Joining")]  # fmt: skip
        gaps = uncovered(held, n_layers)
        if not gaps:
            raise NoRangeAvailable(f"every layer of {model_id} is already covered")
        gap = max(gaps, key=lambda g: (len(g), -g.start))
        # A node that could hold more than the gap gets the gap (it was a 400 above its width).
        width = read_int(body, "max_layers", lo=1, hi=1 << 20, default=len(gap))
        return LayerRange(gap.start, gap.start + min(width, len(gap)))

    async def heartbeat(self, node_id: str, body: dict[str, Any], token: str | None = None) -> None:
        self._revive(node_id, token)
        node = self._owned(node_id, token)
        old = node.record.counters
        big = MAX_COUNT  # what every receiver takes: a record past it is never published (2^53 was)
        try:
            counters = Counters(
                tokens_total=read_int(body, "tokens_generated", lo=0, hi=big, default=old.tokens_total),
                requests_served=read_int(body, "requests_served", lo=0, hi=big, default=old.requests_served),
                errors=read_int(body, "errors", lo=0, hi=big, default=old.errors),
                avg_latency_ms=read_float(body, "avg_latency_ms", lo=0, hi=1e9, default=old.avg_latency_ms),
            )
            vram_mb = read_int(body, "peak_vram_mb", lo=0, hi=1 << 40, default=node.record.vram_mb)
            # The spec's heartbeat says nothing of readiness: a node that beats serves, unless
            # it says ``"ready": false``. Defaulting to its state, a spec node stayed Joining for
            # good, never routed (an audit, 2026-12-07).
            ready = read_bool(body, "ready", default=True)
        except Malformed as exc:
            raise BadRegistration(f"bad heartbeat: {exc}") from None
        node.last_heartbeat = time.monotonic()
        state = "Ready" if ready and not node.held_out else node.record.state
        record = node.record.replace(
            counters=counters, state=state, uptime_s=int(time.time() - node.record.started_ms / 1000), vram_mb=vram_mb
        )
        # A state change is announced now; counters ride on the registry's next heartbeat.
        node.record = await self.registry.publish(record) if state != node.record.state else self.registry.remember(record)

    async def leave(self, node_id: str, token: str | None = None) -> None:
        node = self._owned(node_id, token)
        self._drop(node.record.node_id)
        self._depart(node, left=True)
        await self.registry.withdraw(node.record.node_id)

    def _depart(self, node: _Node, *, left: bool) -> None:
        """Remember ``node``, gone from this peer's table, for as long as receivers may hold
        its record (the drop horizon at this peer's heartbeat): its id stays its own (a
        stranger took it, once it read Dead, with the same registry id), and it counts
        against :data:`MAX_LEGACY_NODES` as its record counts against this peer's quota."""
        horizon = self.registry.liveness.for_interval(self.registry.heartbeat_s()).drop_after_s
        self._departed[node.record.node_id] = _Departed(node, time.monotonic() + horizon, left)

    def _forget_departed(self) -> None:
        now = time.monotonic()
        for node_id in [n for n, d in self._departed.items() if d.until <= now]:
            del self._departed[node_id]

    def _revive(self, node_id: str, token: str | None) -> None:
        """A node dropped for silence that heartbeats again with its token is back: a
        stopped process (SIGSTOP, a suspended laptop) got 404 for good, and was refused its
        own id when it restarted (an audit, 2026-12-07)."""
        registry_id = self._registry_id(node_id)
        departed = self._departed.get(registry_id)
        if (departed is None or departed.left or departed.until <= time.monotonic() or registry_id in self._nodes
                or not departed.node.owns(token)):  # fmt: skip
            return  # past its horizon the id may be anyone's again: a new registration, not a revival
        del self._departed[registry_id]
        node = departed.node
        node.last_heartbeat = time.monotonic()
        self._nodes[registry_id] = node
        self._start_worker(node)
        self.registry.remember(node.record)  # vouched for again from the next registry heartbeat
        log.info("legacy node %s is heartbeating again; vouching for it again", registry_id)

    def _owned(self, node_id: str, token: str | None) -> _Node:
        node = self._node(node_id)
        if not node.owns(token):
            raise NotYourNode(f"heartbeats and leave need the node's relay token ({TOKEN_HEADER})")
        return node

    def _drop(self, node_id: NodeId) -> None:
        node = self._nodes.pop(node_id, None)
        if node is not None and node.queue is not None:
            node.queue.close()

    def forget(self, node_id: str) -> None:
        """Drop a node without announcing anything (admin force-deregistration)."""
        node = self._nodes.pop(self._registry_id(node_id), None)
        if node is not None and node.queue is not None:
            node.queue.close()

    def _node(self, node_id: str) -> _Node:
        node = self._nodes.get(self._registry_id(node_id))
        if node is None:
            raise UnknownLegacyNode(f"no legacy node {node_id!r} is registered at this peer")
        return node

    def _drop_silent(self) -> None:
        cutoff = time.monotonic() - self.registry.liveness.degraded_after_s
        for node_id, node in list(self._nodes.items()):
            if node.last_heartbeat < cutoff:
                log.info("legacy node %s stopped heartbeating; no longer vouching for it", node_id)
                self.registry.stop_vouching(node_id)
                if node.queue is not None:
                    node.queue.close()
                del self._nodes[node_id]
                self._depart(node, left=False)

    # --------------------------------------------------------------- relay

    def serves(self, node_id: str) -> bool:
        return self._registry_id(node_id) in self._nodes

    async def relay(self, msg: wire.Forward | wire.Close) -> None:
        """Queue a frame for a legacy node; its worker keeps each node's frames in order.

        A full queue is an error to the entry, never a wait: this runs in the reader of the
        sender's inbound stream, and waiting stalled every other session that sender drives
        through this peer until the node's HTTP relays drained."""
        node = self._nodes.get(msg.route[0].node_id)
        if node is None or node.queue is None:
            await self._fail(msg, f"legacy node {msg.route[0].node_id} is not served by this peer")
            return
        try:
            node.queue.send_nowait(msg)
        except trio.WouldBlock:
            await self._fail(msg, f"legacy node {msg.route[0].node_id} is busy: {_RELAY_QUEUE} frames wait for it")
        except trio.ClosedResourceError:
            await self._fail(msg, f"legacy node {msg.route[0].node_id} has left")

    def _start_worker(self, node: _Node) -> None:
        assert self._nursery is not None, "LegacyNodes.run has not started"
        send, receive = trio.open_memory_channel[wire.Forward | wire.Close](_RELAY_QUEUE)
        node.queue = send
        self._nursery.start_soon(self._worker, node, receive)

    async def _worker(self, node: _Node, frames: trio.MemoryReceiveChannel[wire.Forward | wire.Close]) -> None:
        async with frames:
            async for msg in frames:
                try:
                    await self._relay_one(node, msg)
                except Exception:  # noqa: BLE001 - one frame's failure must not end the worker
                    log.exception("relaying a %s frame to legacy node %s failed", msg.TYPE, node.record.node_id)

    async def _relay_one(self, node: _Node, msg: wire.Forward | wire.Close) -> None:
        path = "/forward" if isinstance(msg, wire.Forward) else "/close"
        url = node.forward_url.removesuffix("/forward") + path
        headers = {TOKEN_HEADER: node.token, "content-type": "application/octet-stream"}
        # What a frame's answer can hold: its positions' hidden states (a close's: a header).
        # The generic 64 MiB cap let a node have us read 64 MiB for any one-token step.
        n_tokens = msg.n_tokens if isinstance(msg, wire.Forward) else 0
        most = wire.max_frame_bytes(n_tokens, node.record.d_model)
        try:
            status, body = await self.http.request("POST", url, wire.encode(msg), headers, max_bytes=most)
        except NodeUnreachable as exc:
            await self._node_failed(node, msg, f"is unreachable: {exc}")
            return
        if status == 204 or (status == 200 and not body):
            node.failures = 0
            return
        if status != 200:
            await self._node_failed(node, msg, f"answered {status}")
            return
        try:
            out = wire.decode(body)
        except P2PError as exc:
            await self._node_failed(node, msg, f"sent a bad frame: {exc}")
            return
        if not relay_answer_matches(msg, out):
            # A node may only continue the frame it was given: never redirect it elsewhere
            # under this peer's (trusted) identity.
            await self._node_failed(node, msg, "answered with a frame that does not continue the one it was sent")
            return
        fault = _hidden_fault(msg, out, node.record.d_model)
        if fault is not None:
            # Checked here, not only by the next hop: that hop would refuse them in its own
            # name (``invalid_batch``, which blames it and this peer, the hop before it, as a
            # guess), while the node that made them stayed in routing, costing every request
            # sent through it a failover.
            await self._node_failed(node, msg, f"answered bad hidden states: {fault}")
            return
        node.failures = 0
        if isinstance(out, wire.Forward) and isinstance(msg, wire.Forward):
            # How the next hops treat the frame is the frame's, whatever the node sent back (a
            # flipped ``discard`` had them compute and answer nothing: an audit, 2026-12-07).
            out = dataclasses.replace(out, discard=msg.discard, lane=msg.lane)
        if isinstance(out, wire.Error):  # in the node's name as the swarm knows it (under ours)
            # A node sends nothing on (we do): its "unreachable" is its own failure, and it may
            # name no other hop, or it would get the honest hop after it blamed.
            code: wire.ErrorCode = "engine_error" if out.code == "unreachable" else out.code
            out = dataclasses.replace(out, code=code, origin=PeerId(node.record.node_id), failed_peer=None)
        target = out.route[0].peer_id if isinstance(out, (wire.Forward, wire.Close)) else msg.reply_to
        await self.send(target, out)

    async def _node_failed(self, node: _Node, msg: wire.Forward | wire.Close, what: str) -> None:
        """Report the failure, and hold the node out of routing for a while."""
        node.failures += 1
        first, longest = HOLD_OUT_S
        node.held_out_until = time.monotonic() + min(longest, first * 2 ** (node.failures - 1))
        await self._fail(msg, f"legacy node {node.record.node_id} {what}")
        if node.record.state == "Ready" and self._nodes.get(node.record.node_id) is node:
            log.info("holding legacy node %s out of routing after %d failure(s)", node.record.node_id, node.failures)
            node.record = await self.registry.publish(node.record.replace(state="Joining"))

    async def _fail(self, msg: wire.Forward | wire.Close, message: str) -> None:
        """Tell the entry, in the node's name as the swarm knows it (under ours), that the
        node failed its hop: the entry then avoids that node alone (``p2p.legs.blame``). In
        our own name, as ``unreachable``, it blamed this peer: entries routed round our own
        layers and every other node we relay, whoever registered the failing node."""
        log.info("%s", message)
        await self.send(msg.reply_to, wire.Error(msg.req_id, msg.session_id, "engine_error", message,
                                                 PeerId(msg.route[0].node_id)))  # fmt: skip


def _hidden_fault(sent: wire.Forward | wire.Close, answer: wire.Message, d_model: int) -> str | None:
    """What is wrong with the hidden states a node answered for ``sent``, or None: one row
    per position it was sent, the model's width, finite values."""
    if not isinstance(sent, wire.Forward) or not isinstance(answer, wire.Forward) or answer.hidden is None:
        return None
    try:
        check_states(tensors.decode(answer.hidden), d_model, rows=sent.n_tokens)
    except FrameRejected as exc:
        return str(exc)
    return None


def _text(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise BadRegistration(f"{key} is required (a non-empty string)")
    if len(value) > _MAX_TEXT:  # it travels in the gossiped record, whose fields are bounded
        raise BadRegistration(f"{key} is longer than {_MAX_TEXT} characters")
    return value


def _hardware(value: Any) -> dict[str, Any]:
    """A flat profile of short scalars: it is gossiped in the node's record to every peer."""
    if value is None:
        return {}
    profile = as_dict(value, "hardware", max_len=32)
    for key, item in profile.items():
        as_str(key, "hardware key", max_len=64)
        if isinstance(item, str):
            as_str(item, "hardware value", max_len=256)
        elif item is not None and not isinstance(item, bool):
            as_float(item, "hardware value")
    return dict(profile)
