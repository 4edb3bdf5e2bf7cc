"""The swarm as text, for ``inclavate status``: pure functions over the ``/nodes`` JSON.

The dashboard's Swarm page draws the same picture in the browser
(``api/static/js/coverage.js``): per model, how many serving nodes hold each layer, and
which node holds which range. A node *serves* when it is Ready, not set idle and not
draining, the same rule routing uses, so a layer showing 0 is one no new chat can get through.

Every value is a peer's word, checked here (an audit from outside, 2026-12-08, drew
tracebacks from well-formed JSON of other shapes): a row that is not an object is left
out, a layer number that is not an integer holds nothing (shown as ``?``), a model's layer
count is clamped to :data:`MAX_LAYERS`, and a non-finite number is shown as ``-``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import isfinite
from typing import Any

from inclavate.terminal import printable, printable_tree

Node = Mapping[str, Any]

RED, GREEN, YELLOW, BLUE, GREY, BOLD, DIM, RESET = (
    "\x1b[31m", "\x1b[32m", "\x1b[33m", "\x1b[34m", "\x1b[90m", "\x1b[1m", "\x1b[2m", "\x1b[0m",
)  # fmt: skip
STATE_COLOURS = {"Ready": GREEN, "Joining": BLUE, "Degraded": YELLOW, "Dead": RED, "Idle": GREY, "Draining": GREY}
MAX_CELLS = 60
"""Widest coverage strip: beyond this many layers one character stands for several."""
MAX_LAYERS = 100_000
"""A model's most layers: ``p2p.record_schema.MAX_LAYERS``, which real peers' records keep
to (not imported: that module pulls libp2p in, and these commands must start fast). A fake
peer's ``n_layers: 10**12`` was a ``MemoryError`` in :func:`layer_counts`."""


def layer_of(value: object) -> int | None:
    """A layer number as a peer stated it, or None when it is no integer (``"zero"``, null,
    a float, a bool)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _span(node: Node) -> tuple[int, int] | None:
    start, end = layer_of(node.get("start_layer")), layer_of(node.get("end_layer"))
    return None if start is None or end is None else (start, end)


def _sort_key(node: Node) -> tuple[int, int, str]:
    start, end = layer_of(node.get("start_layer")), layer_of(node.get("end_layer"))
    return (-1 if start is None else start, -1 if end is None else end, str(node.get("node_id")))


def serving(node: Node) -> bool:
    """Routable for a new chat: Ready, not set idle, not draining (a peer stopping politely)."""
    return node.get("state") == "Ready" and not node.get("idle") and not node.get("draining")


def state_label(node: Node) -> str:
    state = str(node.get("state", "?"))
    if state == "Ready" and node.get("idle"):
        return "Idle"
    return "Draining" if state == "Ready" and node.get("draining") else state


@dataclass(frozen=True)
class ModelView:
    model_id: str
    n_layers: int
    nodes: tuple[Node, ...]
    holders: tuple[Node, ...] | None = None
    """The nodes that count towards coverage (None: all of them): with the model's shape
    known, those whose records state it, as routes take only those."""

    @property
    def counts(self) -> list[int]:
        return layer_counts(self.serving_nodes, self.n_layers)

    @property
    def serving_nodes(self) -> tuple[Node, ...]:
        return self.nodes if self.holders is None else self.holders


def models_of(nodes: Sequence[Node], shapes: Mapping[str, int] | None = None) -> list[ModelView]:
    """Models in ``/nodes`` order by id, each with its nodes sorted by range.

    ``shapes``: each model's layer count as the peer's ``/api/models`` states it (the
    catalog's for a catalog model, :func:`shapes_of`), and only the nodes whose records
    state that shape count towards its coverage, as only they carry routes. Without one,
    the largest any record states: a single stranger's record saying ``n_layers: 100000``
    drew the whole swarm's model as 100,000 layers with one long gap, while every chat was
    served."""
    grouped: dict[str, list[Node]] = {}
    for node in nodes:
        grouped.setdefault(str(node.get("model_id", "?")), []).append(node)
    out = []
    for model_id in sorted(grouped):
        members = sorted(grouped[model_id], key=_sort_key)
        shape = (shapes or {}).get(model_id)
        if shape:
            holders = tuple(n for n in members if n.get("n_layers") in (None, shape))
            out.append(ModelView(model_id, min(shape, MAX_LAYERS), tuple(members), holders))
        else:
            stated = (layer_of(n.get("n_layers")) or layer_of(n.get("end_layer")) or 0 for n in members)
            out.append(ModelView(model_id, min(max(0, *stated), MAX_LAYERS), tuple(members)))
    return out


def shapes_of(models: object) -> dict[str, int]:
    """Each model's layer count from a peer's ``/api/models`` answer; what is not a model
    entry with a positive integer ``n_layers`` is left out (a peer's word, checked)."""
    shapes: dict[str, int] = {}
    for entry in models if isinstance(models, list) else ():
        if not isinstance(entry, dict):
            continue
        model_id, n_layers = entry.get("id"), entry.get("n_layers")
        if isinstance(model_id, str) and isinstance(n_layers, int) and not isinstance(n_layers, bool) and n_layers > 0:
            shapes[model_id] = min(n_layers, MAX_LAYERS)
    return shapes


def layer_counts(nodes: Sequence[Node], n_layers: int) -> list[int]:
    """How many serving nodes hold each layer ``0..n_layers-1``."""
    counts = [0] * max(0, min(n_layers, MAX_LAYERS))
    for node in nodes:
        span = _span(node)
        if serving(node) and span:
            for layer in range(max(0, span[0]), min(len(counts), span[1])):
                counts[layer] += 1
    return counts


def has_chain(nodes: Sequence[Node], n_layers: int) -> bool:
    """Whether serving nodes' ranges connect layer 0 to ``n_layers``, each starting where one
    ends (as ``p2p.coverage.has_chain``): every layer held is not enough, since a node holding
    15-30 cannot start at 20."""
    ends: dict[int, set[int]] = {}
    for node in nodes:
        span = _span(node)
        if serving(node) and span:
            ends.setdefault(span[0], set()).add(span[1])
    reached, frontier = {0}, [0]
    while frontier:
        for end in ends.get(frontier.pop(), ()):
            if end not in reached:
                reached.add(end)
                frontier.append(end)
    return n_layers in reached


def runs(counts: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs of equal count as ``(start, end, count)``, end exclusive."""
    out: list[tuple[int, int, int]] = []
    for layer, count in enumerate(counts):
        if out and out[-1][2] == count:
            out[-1] = (out[-1][0], layer + 1, count)
        else:
            out.append((layer, layer + 1, count))
    return out


def coverage_strip(counts: Sequence[int], *, color: bool = False, max_cells: int = MAX_CELLS) -> str:
    """One character per layer (or per group of layers, showing the group's minimum):
    the replica count, ``+`` above 9, ``!`` for a layer nobody serves."""
    if not counts:
        return ""
    per_cell = -(-len(counts) // max_cells)
    cells = [min(counts[i : i + per_cell]) for i in range(0, len(counts), per_cell)]
    out = []
    for count in cells:
        char = "!" if count == 0 else str(count) if count < 10 else "+"
        out.append(_paint(char, RED if count == 0 else GREEN if count > 1 else "", color))
    return "".join(out)


def render_status(nodes: Sequence[Node], api: str, *, color: bool = False, shapes: Mapping[str, int] | None = None) -> str:
    """The whole ``inclavate status`` screen (``shapes``: see :func:`models_of`). Every
    string of ``nodes`` is any peer's word (a model id, a node id): it is printed without
    the characters a terminal acts on."""
    shapes = {printable(model_id): n for model_id, n in (shapes or {}).items()}
    nodes = [printable_tree(node) for node in nodes if isinstance(node, Mapping)]
    lines = [_paint(f"Inclavate swarm at {printable(api)}", BOLD, color)]
    models = models_of(nodes, shapes)
    if not nodes:
        return "\n".join([*lines, "", "No node is registered yet."])
    peers = len({repr(n.get("peer_id")) for n in nodes})  # any JSON value, a list included
    ready = sum(serving(n) for n in nodes)
    lines.append(f"{peers} peer{'s' * (peers != 1)}, {ready}/{len(nodes)} nodes serving, {len(models)} model{'s' * (len(models) != 1)}")
    for model in models:
        lines += ["", *_model_lines(model, color)]
    lines += ["", *_node_table(models, color)]
    return "\n".join(lines)


def _model_lines(model: ModelView, color: bool) -> list[str]:
    counts = model.counts
    gaps = [(s, e) for s, e, c in runs(counts) if c == 0]
    if gaps:
        health = _paint("gap at layers " + ", ".join(f"{s}-{e}" for s, e in gaps), RED, color)
    elif not has_chain(model.serving_nodes, model.n_layers):
        health = _paint("no chain: held ranges do not meet end to start", RED, color)
    else:
        health = _paint("chain complete", GREEN, color)
    fewest = min(counts) if counts else 0
    strip = coverage_strip(counts, color=color)
    per_cell = -(-model.n_layers // MAX_CELLS) if model.n_layers else 1
    scale = f"1 char = {per_cell} layers" if per_cell > 1 else "1 char = 1 layer"
    replicas = ", ".join(f"{s}-{e} x{c}" for s, e, c in runs(counts))
    return [
        _paint(model.model_id, BOLD, color) + f"  {model.n_layers} layers  {health}  (fewest replicas: {fewest})",
        f"  coverage [{strip}]  {scale}",
        f"  replicas {replicas}",
    ]


def _node_table(models: Sequence[ModelView], color: bool) -> list[str]:
    header = ("NODE", "MODEL", "LAYERS", "STATE", "TOK/S", "STEP MS", "REQUESTS", "UPTIME")
    rows = []
    for model in models:
        for n in model.nodes:
            rows.append((
                _short(str(n.get("node_id", ""))) + (" (legacy)" if n.get("legacy") else ""),
                model.model_id,
                "-".join("?" if layer_of(v) is None else str(v) for v in (n.get("start_layer"), n.get("end_layer"))),
                state_label(n),
                _number(n.get("throughput_tps"), 1),
                _number(n.get("avg_latency_ms"), 1),
                _number(n.get("requests_served"), 0),
                _duration(n.get("uptime_s")),
            ))  # fmt: skip
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    out = [_paint("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip(), DIM, color)]
    for row in rows:
        cells = [c.ljust(w) for c, w in zip(row, widths, strict=True)]
        cells[3] = _paint(cells[3], STATE_COLOURS.get(row[3], ""), color)
        out.append("  ".join(cells).rstrip())
    return out


def _short(node_id: str) -> str:
    return "…" + node_id[-8:] if len(node_id) > 12 else node_id


def _finite(value: object) -> float | int | None:
    """A number a peer stated, or None (a bool, a string, NaN, Infinity: JSON as Python reads it)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, int):
        return value if abs(value) < 2**63 else None  # a float's format of 10**400 overflows
    return value if isfinite(value) else None


def _number(value: object, digits: int) -> str:
    number = _finite(value)
    return "-" if number is None else f"{number:,.{digits}f}"


def _duration(value: object) -> str:
    number = _finite(value)
    if number is None or number < 0:
        return "-"
    s = int(number)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _paint(text: str, code: str, color: bool) -> str:
    return f"{code}{text}{RESET}" if color and code else text
