// Swarm: the network as a picture. Peers as nodes coloured by state, the chains between
// them, and per model a coverage bar (Ready holders per layer, gaps in red) over lanes
// showing which peer holds which layers. Polls /nodes every 2 s.

import { get } from "../api.js";
import { fill, fmtNumber, h, loading, message, s, shortId, stateBadge } from "../dom.js";
import { gaps, hasChain, lanes, layerCounts, modelsOf, runs, serving, shapesOf } from "../coverage.js";

const POLL_MS = 2000;
const STATES = ["Ready", "Joining", "Degraded", "Dead", "Idle", "Draining"];

function stateOf(node) {
  if (node.state !== "Ready") return node.state;
  return node.idle ? "Idle" : node.draining ? "Draining" : node.state;
}

function legend() {
  return h("div", { class: "legend" }, STATES.map((st) => h("span", {}, h("i", { class: `swatch state-${st}` }), st)));
}

function summary(nodes, models) {
  const ready = nodes.filter(serving).length;
  const complete = models.filter((m) => hasChain(m.holders, m.nLayers)).length;
  const peers = new Set(nodes.map((n) => n.peer_id)).size;
  return h("div", { class: "tiles" },
    tile("Peers", peers), tile("Nodes ready", `${ready} / ${nodes.length}`),
    tile("Models", models.length), tile("Complete chains", `${complete} / ${models.length}`));
}

function tile(label, value) {
  return h("div", { class: "tile" }, h("div", { class: "tile-value" }, String(value)), h("div", { class: "tile-label" }, label));
}

/**
 * The swarm as a pipeline: one band per model, each node a circle placed over the middle of
 * its layer range (replicas stacked), an arrow wherever one node's range ends where another's
 * starts: the hand-offs a chain can take.
 */
function networkGraph(models, selfPeer) {
  const W = 900, PAD = 70, LANE = 112;
  const BAND_TOP = models.length > 1 ? 26 : 8;
  const bands = models.map((m) => ({ model: m, placed: lanes(m.nodes) }));
  const heights = bands.map((b) => BAND_TOP + Math.max(1, ...b.placed.map((p) => p.lane + 1)) * LANE);
  const H = heights.reduce((a, b) => a + b, 0);
  const svg = s("svg", { class: "network", viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "peers of the swarm" });
  svg.append(s("defs", {}, s("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 4, markerHeight: 4, orient: "auto-start-reverse" },
    s("path", { d: "M 0 0 L 10 5 L 0 10 z", class: "arrow-head" }))));
  let top = 0;
  bands.forEach(({ model, placed }, i) => {
    const n = Math.max(model.nLayers, 1);
    const x = (layer) => PAD + (layer / n) * (W - 2 * PAD);
    const spacing = Math.min(...placed.map((p) => x(p.node.end_layer) - x(p.node.start_layer)));
    const R = Math.max(12, Math.min(30, spacing / 2 - 6));
    const pos = new Map(placed.map(({ node, lane }) => [node.node_id,
      { x: (x(node.start_layer) + x(node.end_layer)) / 2, y: top + BAND_TOP + lane * LANE + R + 4 }]));
    if (models.length > 1) svg.append(s("text", { x: 4, y: top + 16, class: "band-label" }, model.id));
    for (const a of model.nodes) {
      for (const b of model.nodes) {
        if (a.end_layer !== b.start_layer) continue;
        const p = pos.get(a.node_id), q = pos.get(b.node_id);
        const len = Math.hypot(q.x - p.x, q.y - p.y) || 1;
        const ux = (q.x - p.x) / len, uy = (q.y - p.y) / len;
        svg.append(s("line", {
          x1: p.x + ux * (R + 3), y1: p.y + uy * (R + 3), x2: q.x - ux * (R + 5), y2: q.y - uy * (R + 5),
          class: serving(a) && serving(b) ? "edge" : "edge broken", "marker-end": "url(#arrow)",
        }));
      }
    }
    for (const { node } of placed) {
      const { x: cx, y: cy } = pos.get(node.node_id);
      const st = stateOf(node);
      const g = s("g", { class: `peer state-${st}`, "data-node": node.node_id, "data-state": node.state });
      if (node.peer_id === selfPeer) g.append(s("circle", { cx, cy, r: R + 6, class: "self-ring" }));
      g.append(
        s("circle", { cx, cy, r: R, class: "peer-dot" }),
        s("text", { x: cx, y: cy + 5, class: "peer-range", "text-anchor": "middle" }, R >= 24 ? `${node.start_layer}–${node.end_layer}` : ""),
        s("text", { x: cx, y: cy + R + 17, class: "peer-name", "text-anchor": "middle" }, `${shortId(node.peer_id)}${node.legacy ? " (legacy)" : ""}`),
        s("text", { x: cx, y: cy + R + 31, class: "peer-sub", "text-anchor": "middle" },
          `${st}${node.throughput_tps ? ` · ${fmtNumber(node.throughput_tps, 1)} tok/s` : ""}`),
        s("title", {}, `${node.node_id}\n${node.model_id} layers ${node.start_layer}-${node.end_layer}\n${st}`));
      svg.append(g);
    }
    top += heights[i];
  });
  return svg;
}

/** The coverage bar (per-layer Ready holders) over lanes of node ranges, one model. */
function coverageChart(model) {
  const W = 900, BAR = 30, LANE = 30, TOP = 4, AXIS = 20;
  const counts = layerCounts(model.holders, model.nLayers);
  const placed = lanes(model.nodes);
  const nLanes = Math.max(1, ...placed.map((p) => p.lane + 1));
  const height = TOP + BAR + AXIS + nLanes * LANE + 6;
  const x = (layer) => (layer / Math.max(model.nLayers, 1)) * W;
  const svg = s("svg", { class: "coverage", viewBox: `0 0 ${W} ${height}`, role: "img", "data-model": model.id });
  const bar = s("g", { class: "coverage-bar" });
  counts.forEach((count, layer) => {
    bar.append(s("rect", {
      x: x(layer), y: TOP, width: x(layer + 1) - x(layer), height: BAR,
      class: `cov cov-${Math.min(count, 3)}`, "data-layer": layer, "data-count": count,
    }, s("title", {}, `layer ${layer}: ${count} Ready holder${count === 1 ? "" : "s"}`)));
  });
  svg.append(bar);
  const ticks = new Set([0, model.nLayers, ...model.nodes.flatMap((n) => [n.start_layer, n.end_layer])]);
  for (const run of runs(counts)) {
    ticks.add(run.start);
    const mid = (x(run.start) + x(run.end)) / 2;
    const label = run.count === 0 ? "gap" : `×${run.count}`;
    if (x(run.end) - x(run.start) > 26) {
      svg.append(s("text", { x: mid, y: TOP + BAR / 2 + 5, class: `cov-label${run.count === 0 ? " gap" : ""}`, "text-anchor": "middle" }, label));
    }
  }
  for (const t of ticks) {
    const anchor = t === 0 ? "start" : t === model.nLayers ? "end" : "middle";
    svg.append(s("text", { x: x(t), y: TOP + BAR + 15, class: "axis", "text-anchor": anchor }, String(t)));
  }
  for (const { node, lane } of placed) {
    const st = stateOf(node);
    const y = TOP + BAR + AXIS + lane * LANE;
    const w = Math.max(2, x(node.end_layer) - x(node.start_layer) - 2);
    svg.append(s("g", { class: `lane state-${st}`, "data-node": node.node_id, "data-state": node.state },
      s("rect", { x: x(node.start_layer) + 1, y, width: w, height: LANE - 6, rx: 4 }),
      laneLabel(node, st, w) ? s("text", { x: x(node.start_layer) + 8, y: y + 16, class: "lane-label" }, laneLabel(node, st, w)) : null,
      s("title", {}, `${node.node_id}: layers ${node.start_layer}-${node.end_layer}, ${st}`)));
  }
  return svg;
}

/** The longest label that fits a lane ``width`` units wide (about 7.5 units a character). */
function laneLabel(node, state, width) {
  const range = `${node.start_layer}–${node.end_layer}`;
  const options = [`${shortId(node.peer_id)} · ${range} · ${state}`, `${shortId(node.peer_id)} · ${range}`, range];
  return options.find((text) => text.length * 7.5 + 16 <= width) || "";
}

function modelCard(model) {
  const counts = layerCounts(model.holders, model.nLayers);
  const missing = gaps(counts);
  const status = missing.length > 0
    ? h("span", { class: "badge bad" }, `gap: layers ${missing.map((g) => `${g.start}–${g.end}`).join(", ")}`)
    : hasChain(model.holders, model.nLayers)
      ? h("span", { class: "badge ok" }, "chain complete")
      : h("span", { class: "badge bad" }, "no chain: held ranges do not meet end to start");
  const minReplicas = counts.length ? Math.min(...counts) : 0;
  return h("section", { class: "card model-card", "data-model": model.id },
    h("div", { class: "card-head" },
      h("h2", {}, model.id),
      h("span", { class: "muted" }, `${model.nLayers} layers · ${model.nodes.length} node${model.nodes.length === 1 ? "" : "s"} · fewest replicas ${minReplicas}`),
      status),
    coverageChart(model),
    h("div", { class: "chips" }, model.nodes.map((n) =>
      h("span", { class: "chip" }, stateBadge(n.state, n.idle), ` ${shortId(n.peer_id)} ${n.start_layer}–${n.end_layer}`))));
}

export function mount(root, page) {
  const head = h("div", { class: "page-head" }, h("h1", {}, "Swarm"), h("span", { class: "muted live" }, "live"), legend());
  const body = h("div", {}, loading("Loading the registry…"));
  root.append(head, body);
  let selfPeer = "";
  get("/health", { signal: page.signal }).then((health) => { selfPeer = health.peer_id; }, () => {});
  page.poll(async () => {
    const [nodes, live] = await Promise.all([
      get("/nodes", { signal: page.signal }),
      get("/api/models", { signal: page.signal }).catch(() => []), // drawn from the records alone
    ]);
    const models = modelsOf(nodes, shapesOf(live));
    if (!nodes.length) {
      fill(body, message("info", "No node is registered yet: start a peer with `inclavate peer --model ID`."));
      return;
    }
    fill(body,
      summary(nodes, models),
      h("section", { class: "card" }, h("div", { class: "card-head" }, h("h2", {}, "Peers"),
        h("span", { class: "muted" }, "arrows: where one range hands off to the next; the ringed peer serves this page")),
      networkGraph(models, selfPeer)),
      models.map(modelCard));
  }, POLL_MS);
}
