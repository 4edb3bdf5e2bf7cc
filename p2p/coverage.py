"""What the registry says about each model: covered ranges, gaps, whether a chain exists.

A chain needs ranges that *meet*: a peer holding layers 10-30 cannot start at layer 12, so
full union coverage is not enough; ``chain_complete`` asks whether boundaries connect 0 to
``n_layers`` through routable nodes (Ready and not idle).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from inclavate.types import LayerRange, ModelId
from p2p.records import NodeRecord
from p2p.registry import NodeView


@dataclass(frozen=True)
class ModelCoverage:
    model_id: ModelId
    n_layers: int
    d_model: int
    ranges: tuple[LayerRange, ...]
    """Distinct layer ranges of routable nodes, sorted."""
    gaps: tuple[LayerRange, ...]
    chain_complete: bool
    states: dict[str, int] = field(default_factory=dict)
    """Node counts by state, plus "Idle" for Ready nodes an admin set idle."""
    total_vram_mb: int = 0
    node_count: int = 0


def uncovered(ranges: Iterable[LayerRange], n_layers: int) -> list[LayerRange]:
    """Maximal runs of layers no range covers."""
    covered = [False] * n_layers
    for r in ranges:
        for layer in range(r.start, min(r.end, n_layers)):
            covered[layer] = True
    gaps, start = [], None
    for layer, is_covered in enumerate([*covered, True]):
        if not is_covered and start is None:
            start = layer
        elif is_covered and start is not None:
            gaps.append(LayerRange(start, layer))
            start = None
    return gaps


def has_chain(ranges: Iterable[LayerRange], n_layers: int) -> bool:
    """Whether boundaries connect 0 to ``n_layers`` (ranges must meet exactly)."""
    by_start: dict[int, list[int]] = {}
    for r in ranges:
        by_start.setdefault(r.start, []).append(r.end)
    reached, frontier = {0}, [0]
    while frontier:
        for end in by_start.get(frontier.pop(), []):
            if end not in reached:
                reached.add(end)
                frontier.append(end)
    return n_layers in reached


def agreed(records: Iterable[NodeRecord], value: Callable[[NodeRecord], int]) -> int | None:
    """The value of a model's records that the most peers state, each peer counted once (its
    legacy nodes' records too), the smaller on a tie; None without records. A record costs
    nothing to publish, so the largest or smallest of them is any stranger's to choose."""
    votes = Counter(v for _, v in {(r.peer_id, value(r)) for r in records})
    if not votes:
        return None
    most = max(votes.values())
    return min(v for v, n in votes.items() if n == most)


Shape = Callable[[ModelId], "tuple[int, int] | None"]
"""A model's (n_layers, d_model) as this peer's catalog has it; None outside the catalog."""


def model_coverage(views: Iterable[NodeView], shape: Shape = lambda _model: None) -> dict[ModelId, ModelCoverage]:
    grouped: dict[ModelId, list[NodeView]] = {}
    for view in views:
        grouped.setdefault(view.record.model_id, []).append(view)
    coverage = {model: _coverage(model, nodes, shape(model)) for model, nodes in sorted(grouped.items())}
    return {model: cov for model, cov in coverage.items() if cov is not None}


def _coverage(model_id: ModelId, nodes: list[NodeView], known: tuple[int, int] | None) -> ModelCoverage | None:
    # A model of the catalog has the catalog's shape (routing is given the same): a record
    # stating another is not a holder of it. It was what most peers stated: three free records
    # saying 29 layers outvoted three honest peers, and /api/models showed 30 layers' model as
    # 29 with a gap (an audit, 2026-12-07). Outside the catalog, what most peers say wins, each
    # peer counted once, as routing counts it (``p2p.routing.agreed``); None: no holder left.
    if known is not None:
        n_layers, d_model = known
        nodes = [v for v in nodes if (v.record.n_layers, v.record.d_model) == known]
        if not nodes:
            return None
    else:
        records = [v.record for v in nodes]
        n_layers = agreed(records, lambda r: r.n_layers) or 0
        d_model = agreed(records, lambda r: r.d_model) or 0
    routable = [v.record.layers for v in nodes if v.routable and v.record.n_layers == n_layers]
    states = Counter(v.state for v in nodes)
    states["Idle"] = sum(1 for v in nodes if v.state == "Ready" and v.record.idle)
    live = [v for v in nodes if v.state != "Dead"]
    return ModelCoverage(
        model_id=model_id,
        n_layers=n_layers,
        d_model=d_model,
        ranges=tuple(sorted(set(routable))),
        gaps=tuple(uncovered(routable, n_layers)),
        chain_complete=has_chain(routable, n_layers),
        states={s: states.get(s, 0) for s in ("Ready", "Joining", "Degraded", "Dead", "Idle")},
        total_vram_mb=sum(v.record.vram_mb for v in live),
        node_count=len(nodes),
    )
