// Nodes: the /nodes table joined with /nodes/rankings, throughput and latency sparklines
// from /nodes/:id/metrics, and a node's hardware on click.

import { get } from "../api.js";
import { sparkline } from "../charts.js";
import { fill, fmtDuration, fmtNumber, h, loading, message, shortId, stateBadge } from "../dom.js";

const POLL_MS = 3000;
const SAMPLES_MS = 10000; // nodes sample every 10 s
const NUMERIC = new Set([0, 1, 4, 8, 9, 10, 11]); // right-aligned columns

export function mount(root, page) {
  const table = h("div", { class: "card" }, loading("Loading nodes…"));
  root.append(h("div", { class: "page-head" }, h("h1", {}, "Nodes"),
    h("span", { class: "muted" }, "ranked by throughput and latency; click a row for its hardware")), table);
  const samples = new Map(); // node id -> [{tps, latency_ms, ts_ms}]
  const hardware = new Map(); // node id -> object | Error
  let open = null;
  let lastSamples = 0;
  let latest = { nodes: [], ranks: new Map() };

  async function loadSamples(nodes) {
    await Promise.all(nodes.map(async (node) => {
      try {
        const body = await get(`/nodes/${encodeURIComponent(node.node_id)}/metrics`, { signal: page.signal });
        samples.set(node.node_id, body.samples || []);
      } catch (err) {
        if (err.status !== 404) throw err; // a node that left between the two calls
      }
    }));
  }

  async function toggle(nodeId) {
    open = open === nodeId ? null : nodeId;
    if (open && !hardware.has(open)) {
      try {
        hardware.set(open, await get(`/nodes/${encodeURIComponent(open)}/hardware`, { signal: page.signal }));
      } catch (err) {
        hardware.set(open, err);
      }
    }
    render();
  }

  function hardwareRow(nodeId, cols) {
    const hw = hardware.get(nodeId);
    let content;
    if (!hw) content = loading("Loading hardware…");
    else if (hw instanceof Error) content = message("error", hw.describe ? hw.describe() : hw.message);
    else {
      const entries = Object.entries(hw);
      content = entries.length
        ? h("dl", { class: "kv" }, entries.map(([k, v]) => [h("dt", {}, k), h("dd", {}, typeof v === "object" ? JSON.stringify(v) : String(v))]))
        : message("info", "This node reported no hardware.");
    }
    return h("tr", { class: "detail" }, h("td", { colspan: cols }, h("strong", {}, "Hardware of " + nodeId), content));
  }

  function render() {
    const { nodes, ranks } = latest;
    if (!nodes.length) {
      fill(table, message("info", "No node is registered."));
      return;
    }
    const heads = ["#", "Score", "Node", "Model", "Layers", "State", "Throughput (tok/s)", "Step latency (ms)", "Tokens", "Requests", "Errors", "Uptime"];
    const sorted = [...nodes].sort((a, b) => (ranks.get(a.node_id)?.rank ?? 1e9) - (ranks.get(b.node_id)?.rank ?? 1e9));
    const rows = [];
    for (const node of sorted) {
      const rank = ranks.get(node.node_id);
      const series = samples.get(node.node_id) || [];
      rows.push(h("tr", { class: `clickable${open === node.node_id ? " open" : ""}`, "data-node": node.node_id, onclick: () => toggle(node.node_id) },
        h("td", { class: "num" }, rank ? String(rank.rank) : "–"),
        h("td", { class: "num" }, rank ? rank.score.toFixed(2) : "–"),
        h("td", { title: node.node_id }, h("code", {}, shortId(node.node_id)), node.legacy ? h("span", { class: "muted" }, " legacy") : null),
        h("td", {}, node.model_id),
        h("td", { class: "num" }, `${node.start_layer}–${node.end_layer}`),
        h("td", {}, stateBadge(node.state, node.idle)),
        h("td", {}, h("div", { class: "spark-cell" }, sparkline(series.map((p) => p.tps), { cls: "tps" }), h("span", { class: "num" }, fmtNumber(node.throughput_tps, 1)))),
        h("td", {}, h("div", { class: "spark-cell" }, sparkline(series.map((p) => p.latency_ms), { cls: "latency" }), h("span", { class: "num" }, fmtNumber(node.avg_latency_ms, 1)))),
        h("td", { class: "num" }, fmtNumber(node.tokens_total)),
        h("td", { class: "num" }, fmtNumber(node.requests_served)),
        h("td", { class: "num" }, fmtNumber(node.errors)),
        h("td", { class: "num" }, fmtDuration(node.uptime_s))));
      if (open === node.node_id) rows.push(hardwareRow(node.node_id, heads.length));
    }
    fill(table, h("table", { class: "grid-table nodes-table" },
      h("thead", {}, h("tr", {}, heads.map((t, i) => h("th", { class: NUMERIC.has(i) ? "num" : null }, t)))), h("tbody", {}, rows)));
  }

  page.poll(async () => {
    const [nodes, ranking] = await Promise.all([
      get("/nodes", { signal: page.signal }),
      get("/nodes/rankings", { signal: page.signal }),
    ]);
    if (Date.now() - lastSamples > SAMPLES_MS) {
      lastSamples = Date.now();
      await loadSamples(nodes);
    }
    latest = { nodes, ranks: new Map((ranking.rankings || []).map((r) => [r.node_id, r])) };
    render();
  }, POLL_MS);
}
