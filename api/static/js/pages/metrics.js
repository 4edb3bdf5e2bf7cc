// Metrics: cluster totals (/metrics/summary), requests and tokens per minute
// (/metrics/history) and each model's share (/metrics/model/:id), as hand-drawn SVG.

import { get } from "../api.js";
import { barChart, hbars } from "../charts.js";
import { fill, fmtNumber, fmtTime, h, message } from "../dom.js";

const POLL_MS = 10000;
const WINDOWS = [[15, "15 min"], [60, "1 hour"], [360, "6 hours"], [1440, "24 hours"]];

export function mount(root, page) {
  let minutes = 60;
  const select = h("select", { "aria-label": "history window", onchange: () => { minutes = Number(select.value); refresh().catch((err) => page.showError(err)); } },
    WINDOWS.map(([m, label]) => h("option", { value: m, selected: m === minutes }, label)));
  const tiles = h("div", { class: "tiles" });
  const requestsChart = h("div", { class: "chart-box" });
  const tokensChart = h("div", { class: "chart-box" });
  const perModel = h("div", {});
  root.append(
    h("div", { class: "page-head" }, h("h1", {}, "Metrics"), h("span", { class: "muted" }, "cluster-wide, the same on every peer"), select),
    tiles,
    h("section", { class: "card" }, h("h2", {}, "Requests per minute"), requestsChart),
    h("section", { class: "card" }, h("h2", {}, "Tokens per minute"), h("p", { class: "muted" }, "full-model tokens: a stage holding a third of the layers counts a third of each token"), tokensChart),
    h("section", { class: "card" }, h("h2", {}, "Per model"), perModel));

  async function refresh() {
    const [sum, hist, nodes] = await Promise.all([
      get("/metrics/summary", { signal: page.signal }),
      get(`/metrics/history?minutes=${minutes}`, { signal: page.signal }),
      get("/nodes", { signal: page.signal }),
    ]);
    fill(tiles,
      tile("Nodes ready", `${sum.ready_nodes} / ${sum.total_nodes}`),
      tile("Requests", fmtNumber(sum.total_requests)),
      tile("Tokens", fmtNumber(sum.total_tokens)),
      tile("Mean step latency", `${fmtNumber(sum.avg_latency_ms, 1)} ms`));
    const buckets = hist.buckets || [];
    const every = Math.max(1, Math.round(buckets.length / 8));
    fill(requestsChart, barChart(buckets.map((b) => ({ x: fmtTime(b.ts_ms), y: b.requests })), { cls: "requests", unit: "requests", labelEvery: every }));
    fill(tokensChart, barChart(buckets.map((b) => ({ x: fmtTime(b.ts_ms), y: b.tokens })), { cls: "tokens", unit: "tokens", labelEvery: every }));
    const ids = [...new Set(nodes.map((n) => n.model_id))].sort();
    const models = [];
    for (const id of ids) {
      try {
        models.push(await get(`/metrics/model/${encodeURIComponent(id)}`, { signal: page.signal }));
      } catch (err) {
        if (err.status !== 404) throw err;
      }
    }
    if (!models.length) {
      fill(perModel, message("info", "No model has nodes or requests yet."));
      return;
    }
    fill(perModel,
      h("div", { class: "two-col" },
        h("div", {}, h("h3", {}, "Requests"), hbars(models.map((m) => ({ label: m.model_id, value: m.requests })))),
        h("div", {}, h("h3", {}, "Tokens"), hbars(models.map((m) => ({ label: m.model_id, value: m.tokens }))))),
      h("table", { class: "grid-table" },
        h("thead", {}, h("tr", {}, ["Model", "Nodes", "Requests", "Tokens", "Mean step latency (ms)"].map((t, i) => h("th", { class: i ? "num" : null }, t)))),
        h("tbody", {}, models.map((m) => h("tr", { "data-model": m.model_id },
          h("td", {}, m.model_id), h("td", { class: "num" }, String(m.nodes)), h("td", { class: "num" }, fmtNumber(m.requests)),
          h("td", { class: "num" }, fmtNumber(m.tokens)), h("td", { class: "num" }, fmtNumber(m.avg_latency_ms, 1)))))));
  }

  function tile(label, value) {
    return h("div", { class: "tile" }, h("div", { class: "tile-value" }, value), h("div", { class: "tile-label" }, label));
  }

  page.poll(refresh, POLL_MS);
}
