// Pure functions over the /nodes JSON: per-layer replica counts, lanes for drawing.
// `inclavate status` computes the same in Python (inclavate/swarm_view.py).

/** A node that can carry a new chain: Ready, not set idle, not draining (stopping politely). */
export function serving(node) {
  return node.state === "Ready" && !node.idle && !node.draining;
}

/**
 * Models seen in /nodes, each with its layer count and its nodes sorted by range.
 * `shapes` (from shapesOf): a model's layer count as the peer's /api/models states it (the
 * catalog's for a catalog model); then only the nodes whose records state that shape are its
 * `holders` (what coverage counts, as only they carry routes). Without it, the largest count
 * any record states: one stranger's record saying 100000 drew the model as 100,000 layers.
 */
export function modelsOf(nodes, shapes = new Map()) {
  const byModel = new Map();
  for (const node of nodes) {
    const model = byModel.get(node.model_id) || { id: node.model_id, nLayers: 0, nodes: [] };
    model.nLayers = Math.max(model.nLayers, node.n_layers || node.end_layer || 0);
    model.nodes.push(node);
    byModel.set(node.model_id, model);
  }
  const models = [...byModel.values()].sort((a, b) => a.id.localeCompare(b.id));
  for (const m of models) {
    m.nodes.sort((a, b) => a.start_layer - b.start_layer || a.end_layer - b.end_layer || a.node_id.localeCompare(b.node_id));
    const shape = shapes.get(m.id);
    if (shape) m.nLayers = shape;
    m.holders = shape ? m.nodes.filter((n) => n.n_layers == null || n.n_layers === shape) : m.nodes;
  }
  return models;
}

/** Each model's layer count from a peer's /api/models answer: well-formed entries only. */
export function shapesOf(live) {
  const shapes = new Map();
  for (const entry of Array.isArray(live) ? live : []) {
    if (entry && typeof entry.id === "string" && Number.isInteger(entry.n_layers) && entry.n_layers > 0) {
      shapes.set(entry.id, entry.n_layers);
    }
  }
  return shapes;
}

/** How many serving nodes hold each layer 0..nLayers-1. */
export function layerCounts(nodes, nLayers) {
  const counts = new Array(nLayers).fill(0);
  for (const node of nodes) {
    if (!serving(node)) continue;
    for (let l = Math.max(0, node.start_layer); l < Math.min(nLayers, node.end_layer); l += 1) counts[l] += 1;
  }
  return counts;
}

/** Runs of equal count: [{start, end, count}], end exclusive. */
export function runs(counts) {
  const out = [];
  counts.forEach((count, layer) => {
    const last = out[out.length - 1];
    if (last && last.count === count) last.end = layer + 1;
    else out.push({ start: layer, end: layer + 1, count });
  });
  return out;
}

/** Layer ranges no serving node holds. */
export function gaps(counts) {
  return runs(counts).filter((r) => r.count === 0);
}

/**
 * Whether serving nodes' ranges connect layer 0 to nLayers, each starting where one ends
 * (p2p/coverage.py's has_chain): every layer held is not enough, a node holding 15-30
 * cannot start at 20.
 */
export function hasChain(nodes, nLayers) {
  const ends = new Map();
  for (const node of nodes) {
    if (!serving(node)) continue;
    if (!ends.has(node.start_layer)) ends.set(node.start_layer, []);
    ends.get(node.start_layer).push(node.end_layer);
  }
  const reached = new Set([0]);
  const frontier = [0];
  while (frontier.length) {
    for (const end of ends.get(frontier.pop()) || []) {
      if (!reached.has(end)) { reached.add(end); frontier.push(end); }
    }
  }
  return reached.has(nLayers);
}

/** Greedy interval packing: each node gets the first lane where it overlaps nothing. */
export function lanes(nodes) {
  const ends = [];
  return nodes.map((node) => {
    let lane = ends.findIndex((end) => end <= node.start_layer);
    if (lane < 0) { lane = ends.length; ends.push(0); }
    ends[lane] = node.end_layer;
    return { node, lane };
  });
}
