// Small SVG charts drawn by hand: no library, nothing to download.

import { s } from "./dom.js";

function finite(values) {
  return values.filter((v) => typeof v === "number" && Number.isFinite(v));
}

/** A sparkline of values (oldest first); a flat dash when there is nothing to draw. */
export function sparkline(values, { width = 120, height = 28, cls = "" } = {}) {
  const svg = s("svg", { class: `spark ${cls}`, width, height, viewBox: `0 0 ${width} ${height}`, role: "img" });
  const data = finite(values);
  if (data.length < 2) {
    svg.append(s("line", { x1: 2, x2: width - 2, y1: height / 2, y2: height / 2, class: "spark-empty" }));
    return svg;
  }
  const max = Math.max(...data), min = Math.min(0, ...data);
  const span = max - min || 1;
  const step = (width - 4) / (data.length - 1);
  const points = data.map((v, i) => `${(2 + i * step).toFixed(1)},${(height - 3 - ((v - min) / span) * (height - 6)).toFixed(1)}`);
  svg.append(
    s("polygon", { points: `2,${height - 3} ${points.join(" ")} ${(2 + (data.length - 1) * step).toFixed(1)},${height - 3}`, class: "spark-area" }),
    s("polyline", { points: points.join(" "), class: "spark-line" }),
    s("title", {}, `last ${data[data.length - 1].toFixed(1)}, max ${max.toFixed(1)}`),
  );
  return svg;
}

function niceMax(v) {
  if (v <= 0) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  // Multiples of 4 where they matter, so the 4 gridlines land on whole numbers.
  for (const m of [1, 2, 4, 8, 12]) if (v <= m * p) return m * p;
  return 12 * p;
}

function formatTick(v) {
  if (v >= 1e6) return `${(v / 1e6).toFixed(1)}M`;
  if (v >= 1e3) return `${(v / 1e3).toFixed(v >= 1e4 ? 0 : 1)}k`;
  return Number.isInteger(v) ? String(v) : v.toFixed(1);
}

/** A bar chart over time buckets: points [{x: label, y: value}], 4 gridlines, a tooltip per bar. */
export function barChart(points, { width = 1100, height = 210, cls = "", unit = "", labelEvery = 10 } = {}) {
  const pad = { l: 44, r: 8, t: 10, b: 22 };
  const svg = s("svg", { class: `chart ${cls}`, viewBox: `0 0 ${width} ${height}`, role: "img" });
  // At least 4, so an idle swarm's axis reads 0 1 2 3 4 rather than fractions of a request.
  const max = niceMax(Math.max(4, ...finite(points.map((p) => p.y))));
  const innerW = width - pad.l - pad.r, innerH = height - pad.t - pad.b;
  for (let i = 0; i <= 4; i += 1) {
    const y = pad.t + innerH - (innerH * i) / 4;
    svg.append(
      s("line", { x1: pad.l, x2: width - pad.r, y1: y, y2: y, class: "grid" }),
      s("text", { x: pad.l - 6, y: y + 4, class: "axis", "text-anchor": "end" }, formatTick((max * i) / 4)),
    );
  }
  const slot = innerW / Math.max(points.length, 1);
  points.forEach((p, i) => {
    const barH = (Math.max(0, p.y) / max) * innerH;
    const x = pad.l + i * slot + slot * 0.12;
    svg.append(s("rect", { x, y: pad.t + innerH - barH, width: Math.max(1, slot * 0.76), height: barH, class: "bar" },
      s("title", {}, `${p.x}: ${p.y.toLocaleString("en-US")}${unit ? " " + unit : ""}`)));
    const last = i === points.length - 1 && i % labelEvery >= labelEvery / 2;
    if (i % labelEvery === 0 || last) {
      svg.append(s("text", { x: x + slot * 0.38, y: height - 6, class: "axis", "text-anchor": "middle" }, p.x));
    }
  });
  return svg;
}

/** Horizontal bars for a few labelled totals: rows [{label, value}]. */
export function hbars(rows, { width = 560, rowHeight = 26, format = (v) => v.toLocaleString("en-US") } = {}) {
  const labelW = 170, pad = 8;
  const height = rows.length * rowHeight + pad;
  const svg = s("svg", { class: "chart hbars", viewBox: `0 0 ${width} ${height}`, role: "img" });
  const max = Math.max(1, ...finite(rows.map((r) => r.value)));
  rows.forEach((row, i) => {
    const y = pad / 2 + i * rowHeight;
    const w = ((width - labelW - 90) * Math.max(0, row.value)) / max;
    svg.append(
      s("text", { x: 0, y: y + rowHeight * 0.65, class: "label" }, row.label),
      s("rect", { x: labelW, y: y + 4, width: Math.max(1, w), height: rowHeight - 8, rx: 3, class: "bar" }),
      s("text", { x: labelW + w + 6, y: y + rowHeight * 0.65, class: "value" }, format(row.value)),
    );
  });
  return svg;
}
