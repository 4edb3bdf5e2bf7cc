"""Choosing the chain of peers for a session: a pure function of the registry.

The chain is a path through *layer boundaries*: node ``v`` holding ``[s, e)`` is an edge
from boundary ``s`` to ``e``, and a route is a path from 0 to ``n_layers``. Each edge costs
its expected step time::

    cost(v) = layers(v) * step_ms_per_layer(v) + link_ms(v) + HOP_MS

``step_ms_per_layer`` is what the node says it measured, *trusted only to make it look
slower* (:func:`trusted_step_ms_per_layer`): a claim below the reference speed, this peer's
own measurement of the model or else the median claim, counts as the reference, so one
record claiming to be a thousand times faster cannot attract every session (and see every
prompt); ``link_ms`` is half the round trip this peer measured to it
(unknown peers get ``DEFAULT_LINK_MS``; the entry peer itself costs nothing), and
``HOP_MS`` charges every hop its fixed serialization and scheduling cost, which is what
makes fewer hops win between otherwise equal chains. Two factors spread sessions over
replicas: each session this entry already routes through the node raises its cost by
``SESSION_SHARE`` (measured costs are never exactly equal, so without it every session would
pile onto the cheapest replica, and all sessions failing over at once onto one survivor;
with it, replicas share sessions roughly in inverse proportion to their cost), and the
node's measured reliability divides the cost (a node that failed this entry's sessions
looks slower).
Among chains within ``NEAR_EQUAL`` of the cheapest one is drawn at random: measured costs
of replicas on similar machines differ by noise, which must not decide where every session
goes.

A route may start at a boundary other than 0 (failover re-routes from the failed boundary,
keeping the hops before it), may exclude peers (the failed one, and those avoided), and may
be held to ``proven`` peers (probation: those that served the entry before; the caller
decides when, ``p2p.chain``).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from inclavate.types import LayerRange, ModelId, NodeId, PeerId
from p2p.coverage import agreed, uncovered
from p2p.errors import P2PError
from p2p.records import NodeRecord
from p2p.registry import NodeView

HOP_MS = 1.0
DEFAULT_STEP_MS_PER_LAYER = 1.0
DEFAULT_LINK_MS = 5.0
SESSION_SHARE = 1.0
"""Each session this entry already sends through a node adds the node's whole cost again:
measured speeds of replicas are noisy (one step under load can take 5x another), and a weaker
share let such noise send all of 8 sessions failing over at once to one survivor."""
MIN_RELIABILITY = 0.1
NEAR_EQUAL = 0.02
"""Ways to a boundary costing at most this much more than the cheapest count as equal."""
_EPSILON = 1e-9


class NoRoute(P2PError):
    """No chain of Ready nodes covers the model; ``missing`` names the uncovered layers."""

    def __init__(self, model_id: str, n_layers: int, missing: list[LayerRange]) -> None:
        self.model_id = model_id
        self.missing = missing
        if missing:
            detail = "layers " + ", ".join(str(r) for r in missing) + " have no Ready node"
        elif n_layers:
            detail = "every layer is held but no ranges meet end to start to form a chain"
        else:
            detail = "no node serves it"
        super().__init__(f"no Ready chain covers {model_id}: {detail}")


@dataclass(frozen=True)
class Hop:
    node_id: NodeId
    peer_id: PeerId
    """The libp2p peer that runs this hop: the node itself, or the peer relaying a legacy node."""
    layers: LayerRange
    forward_url: str = ""
    """Set for a relayed legacy node: its HTTP forward endpoint."""

    @property
    def blame_id(self) -> str:
        """Whom a failure of this hop blames, and a failover avoids: its peer, or a relayed
        legacy node alone, by its node id. The relaying peer's own node and its other relays
        are not at fault, and anyone may register a node for a peer to relay: a stranger's
        failing node had entries avoid the relaying peer altogether, its own layers included
        (with the entry's own, every chat in flight failed: an audit, 2026-12-07)."""
        return self.node_id if self.forward_url else self.peer_id

    def blamed_in(self, blamed: Collection[str]) -> bool:
        """Whether ``blamed`` (peers, or relayed nodes: :attr:`blame_id`) takes this hop in."""
        return self.peer_id in blamed or self.node_id in blamed


@dataclass(frozen=True)
class CostModel:
    link_ms: Mapping[PeerId, float] = field(default_factory=dict)
    """Measured one-way latency from this peer to others."""
    hop_ms: float = HOP_MS
    measured_step_ms: float = 0.0
    """This peer's own measured ms per layer per step for the model (0: it runs none)."""
    load: Mapping[PeerId, int] = field(default_factory=dict)
    """Sessions this entry already routes through each peer."""
    reliability: Mapping[PeerId, float] = field(default_factory=dict)
    """Measured share of this entry's sessions a peer served without failing (default 1)."""

    def edge_ms(self, record: NodeRecord, entry: PeerId, reference: float) -> float:
        """``reference``: see :func:`reference_step_ms`."""
        peer = record.peer_id
        cost = self.serve_ms(record, entry, reference) * (1 + SESSION_SHARE * self.load.get(peer, 0))
        # A relayed node's failures are its own (``Hop.blame_id``): its reliability too.
        blamed_as = record.node_id if record.relayed else peer
        return cost / max(MIN_RELIABILITY, min(1.0, self.reliability.get(blamed_as, 1.0)))

    def serve_ms(self, record: NodeRecord, entry: PeerId, reference: float) -> float:
        """What a step through the node should take, as far as its claim and our link to it
        say: the route's cost before load and reliability weigh it, and the pace a session
        through it is held to (:func:`route_step_ms`)."""
        step = trusted_step_ms_per_layer(record.step_ms_per_layer, reference)
        peer = record.peer_id
        link = 0.0 if peer == entry and not record.relayed else self.link_ms.get(peer, DEFAULT_LINK_MS)
        return len(record.layers) * step + link + self.hop_ms


def route_step_ms(records: Sequence[NodeRecord], entry: PeerId, costs: CostModel) -> float | None:
    """What one decode step through these hops (a live route's records) should cost, or None
    when nothing was measured yet: not by this peer, nor by any hop (a new swarm's first
    session has nothing to be held to, and the default guess would make a slow machine's
    honest steps look a hundred times too slow). A hop claiming nothing or being faster than
    the reference is held to the reference, as routing costs it, so no claim makes a route
    look cheaper than it is; a hop claiming to be slow is held to its claim, and routing
    already sends sessions elsewhere for it."""
    claims = _claim_per_peer(records)
    if costs.measured_step_ms <= 0 and not any(c > 0 for c in claims):
        return None
    reference = reference_step_ms(claims, costs.measured_step_ms)
    return sum(costs.serve_ms(r, entry, reference) for r in records)


def reference_step_ms(claims: Iterable[float], measured: float = 0.0) -> float:
    """The speed a node may claim to have without being believed faster: what this peer
    measured itself where it has run the model, else the median claim (a minority of liars
    cannot move it), else the default."""
    if measured > 0:
        return measured
    positive = sorted(c for c in claims if c > 0)
    return positive[(len(positive) - 1) // 2] if positive else DEFAULT_STEP_MS_PER_LAYER


def _claim_per_peer(records: Iterable[NodeRecord]) -> list[float]:
    """One ms-per-layer claim a peer (the slowest of its records'): a peer's legacy nodes cost
    it nothing, and seven records of one identity claiming 0.001 ms outvoted six honest
    nodes in the median (an audit, 2026-12-07)."""
    claims: dict[str, float] = {}
    for r in records:
        claims[r.peer_id] = max(claims.get(r.peer_id, 0.0), r.step_ms_per_layer)
    return list(claims.values())


def trusted_step_ms_per_layer(claimed: float, reference: float) -> float:
    """A node's compute cost as routing believes it: its claim when that makes it *slower*
    than the reference (an honest slow node is avoided), the reference otherwise (no claim,
    or one of being faster: unverifiable, and exactly what an attacker would say to draw
    every session, so equal-seeming nodes share the load at random)."""
    return max(claimed, reference)


def choose_route(
    views: Iterable[NodeView],
    model_id: ModelId,
    entry: PeerId,
    costs: CostModel = CostModel(),
    rng: random.Random | None = None,
    *,
    start: int = 0,
    end: int | None = None,
    exclude: Collection[str] = (),
    n_layers: int | None = None,
    d_model: int | None = None,
    min_context: int = 0,
    proven: Collection[str] | None = None,
) -> list[Hop]:
    """The cheapest chain of routable nodes from boundary ``start`` to boundary ``end`` (the
    model's last layer when None: a failover may replace only a span in the middle), through
    no node of a peer in ``exclude`` and no relayed node it names (:attr:`Hop.blame_id`).

    ``n_layers``: the model's layers as the caller knows them (its catalog), else the count
    most peers state (:func:`agreed`); only nodes stating it are routed through. It was the
    largest any record stated: one record claiming 100,000 layers made every chat of the model
    a 503, one claiming a layer more and holding all of them drew every route (an audit,
    2026-12-07). ``d_model``: the model's width as the caller's catalog has it; a node stating
    another holds some other model (None: any). ``min_context``: nodes stating a shorter
    context are left out. ``proven``: when given, only nodes whose :attr:`Hop.blame_id` it
    names (a peer's own nodes by the peer, a relayed node by its id) are routed through
    (``NoRoute`` if they form no chain)."""
    candidates = [v.record for v in views if v.record.model_id == model_id and v.routable]
    n_layers = n_layers or agreed(candidates, lambda r: r.n_layers)
    if not candidates or n_layers is None:
        raise NoRoute(model_id, 0, [])
    candidates = [r for r in candidates if r.n_layers == n_layers and d_model in (None, r.d_model)
                  and r.peer_id not in exclude and r.node_id not in exclude
                  and (not r.context_length or r.context_length >= min_context)
                  and (proven is None or (r.node_id if r.relayed else r.peer_id) in proven)]  # fmt: skip
    edges: dict[int, list[tuple[float, Hop]]] = {}
    reference = reference_step_ms(_claim_per_peer(candidates), costs.measured_step_ms)
    for r in candidates:
        hop = Hop(r.node_id, r.peer_id, r.layers, r.forward_url if r.relayed else "")
        edges.setdefault(r.start_layer, []).append((costs.edge_ms(r, entry, reference), hop))

    target = n_layers if end is None else end
    best, preds = _shortest(edges, n_layers, start)
    if target not in best:
        gaps = uncovered((r.layers for r in candidates), n_layers)
        missing = [LayerRange(max(m.start, start), min(m.end, target)) for m in gaps if m.end > start and m.start < target]
        raise NoRoute(model_id, n_layers, missing)
    rng = rng or random.Random()
    route: list[Hop] = []
    boundary = target
    while boundary != start:
        hop = rng.choice(preds[boundary])
        route.append(hop)
        boundary = hop.layers.start
    return route[::-1]


def _shortest(
    edges: Mapping[int, list[tuple[float, Hop]]], n_layers: int, start: int
) -> tuple[dict[int, float], dict[int, list[Hop]]]:
    """Dijkstra over boundaries; then, for each boundary, every last hop of a way there
    within ``NEAR_EQUAL`` of the cheapest (the random draw among them spreads sessions)."""
    best: dict[int, float] = {start: 0.0}
    queue = [(0.0, start)]
    while queue:
        cost, boundary = heapq.heappop(queue)
        if cost > best.get(boundary, float("inf")) + _EPSILON:
            continue
        for edge_cost, hop in edges.get(boundary, []):
            end, total = hop.layers.end, cost + edge_cost
            if total < best.get(end, float("inf")) - _EPSILON:
                best[end] = total
                heapq.heappush(queue, (total, end))
    preds: dict[int, list[Hop]] = {}
    for boundary, outgoing in edges.items():
        if boundary not in best:
            continue
        for edge_cost, hop in outgoing:
            end = hop.layers.end
            if best[boundary] + edge_cost <= best[end] * (1 + NEAR_EQUAL) + _EPSILON:
                preds.setdefault(end, []).append(hop)
    return best, preds


def chain_context(views: Iterable[NodeView], model_id: ModelId, entry: PeerId, cap: int, *,
                  n_layers: int | None = None, d_model: int | None = None) -> int:  # fmt: skip
    """The most positions a complete chain of ``model_id`` holds, at most ``cap``: the largest
    context (``cap`` itself, else one a routable record states below it) at which
    :func:`choose_route` with ``min_context`` still finds a chain; the least of them when none
    does (the caller's route check then names the missing layers).

    Only a route's own hops decide it: a record stating less is left out of the routes (a
    sole holder of a span running less lowers it to its own, an honest replica running less
    is routed round), never counted as a vote. It was what most peers stated: three free
    records of fresh identities on layers 0-1 saying 2 outvoted three honest peers, and every
    chat on every peer was a 400 (an audit, 2026-12-07). ``cap`` is the caller's to choose
    (its own engine's context): a record claiming the whole model and a huge context must not
    become the only route."""
    views = list(views)
    stated = {v.record.context_length for v in views
              if v.record.model_id == model_id and v.routable and 0 < v.record.context_length < cap}  # fmt: skip
    candidates = sorted({cap, *stated})

    def holds(context: int) -> bool:
        try:
            choose_route(views, model_id, entry, n_layers=n_layers, d_model=d_model, min_context=context)
        except NoRoute:
            return False
        return True

    # A chain holding a context holds every smaller one: a binary search, so that records
    # stating many distinct contexts cost a few route searches, not one each.
    low, high = 0, len(candidates) - 1
    while low < high:
        middle = (low + high + 1) // 2
        if holds(candidates[middle]):
            low = middle
        else:
            high = middle - 1
    return candidates[low]
