// Storage: artifact usage split by origin (generated / uploaded), the artifacts of each with
// delete, and jobs whose outputs are gone (their records can be cleared with the admin token).

import { get, request } from "../api.js";
import { adminHeaders } from "../admin_token.js";
import { hbars } from "../charts.js";
import { confirmButton, fill, fmtBytes, fmtNumber, h, loading, message, shortId, unavailable } from "../dom.js";

export function mount(root, page) {
  let kind = "generated";
  const usageBox = h("div", {}, loading("Reading artifact usage…"));
  const listBox = h("div", {});
  const orphanBox = h("div", {});
  const result = h("div", {});
  const tabs = h("div", { class: "tabs" });
  root.append(h("div", { class: "page-head" }, h("h1", {}, "Storage"), h("span", { class: "muted" }, "artifacts kept by this deployment")), result, usageBox);

  async function load() {
    let usage;
    try {
      usage = await get("/v1/artifacts/usage", { signal: page.signal });
    } catch (err) {
      fill(usageBox, unavailable(err, "Artifact storage"));
      return;
    }
    const part = (name) => usage[name] || { bytes: 0, objects: 0 };
    const limit = usage.max_bytes ? ` of ${fmtBytes(usage.max_bytes)}` : " (no quota)";
    fill(usageBox,
      h("div", { class: "tiles" },
        tile("Stored", `${fmtBytes(usage.bytes)}${limit}`), tile("Objects", fmtNumber(usage.objects)),
        tile("Generated", `${fmtBytes(part("generated").bytes)} · ${part("generated").objects}`),
        tile("Uploaded", `${fmtBytes(part("uploaded").bytes)} · ${part("uploaded").objects}`)),
      h("section", { class: "card" }, h("h2", {}, "By origin"),
        hbars([{ label: "generated", value: part("generated").bytes }, { label: "uploaded", value: part("uploaded").bytes }], { format: fmtBytes })),
      h("section", { class: "card" }, tabs, listBox),
      h("section", { class: "card" }, h("h2", {}, "Jobs whose outputs were deleted"), orphanBox));
    fill(tabs, ["generated", "uploaded"].map((k) => h("button", { type: "button", class: k === kind ? "tab active" : "tab",
      onclick: () => { kind = k; load().catch((err) => page.showError(err)); } }, `${k} (${part(k).objects})`)));
    await Promise.all([loadList(), loadOrphans()]);
  }

  async function loadList() {
    const body = await get(`/v1/artifacts?kind=${kind}&limit=100`, { signal: page.signal });
    const rows = body.artifacts || [];
    fill(listBox, rows.length
      ? h("table", { class: "grid-table" },
          h("thead", {}, h("tr", {}, ["Artifact", "Type", "Size", "Created", "Expires", ""].map((t) => h("th", {}, t)))),
          h("tbody", {}, rows.map((a) => h("tr", { "data-artifact": a.id },
            h("td", { title: a.id }, h("code", {}, a.filename || shortId(a.id))), h("td", {}, a.media_type),
            h("td", { class: "num" }, fmtBytes(a.size_bytes)), h("td", {}, a.created_at || ""), h("td", {}, a.expires_at || "never"),
            h("td", {}, confirmButton("Delete", "Really delete?", () => remove(`artifact ${shortId(a.id)}`, "DELETE", `/v1/artifacts/${encodeURIComponent(a.id)}`)))))),
          body.truncated ? h("tfoot", {}, h("tr", {}, h("td", { colspan: 6 }, "More artifacts exist than listed here."))) : null)
      : message("info", `No ${kind} artifact.`));
  }

  async function loadOrphans() {
    let jobs;
    try {
      const list = await get("/v1/generations?limit=200", { signal: page.signal });
      jobs = Array.isArray(list) ? list : list.generations || list.data || list.jobs || [];
    } catch (err) {
      fill(orphanBox, unavailable(err, "The job list"));
      return;
    }
    const orphans = jobs.filter((j) => j.artifacts_deleted > 0);
    fill(orphanBox, orphans.length
      ? h("table", { class: "grid-table" }, h("tbody", {}, orphans.map((j) => h("tr", { "data-job": j.id },
          h("td", {}, h("code", {}, shortId(j.id))), h("td", {}, j.model), h("td", {}, `${j.artifacts_deleted} output(s) deleted`),
          h("td", {}, confirmButton("Clear record", "Really clear?", () =>
            remove(`job ${shortId(j.id)}`, "DELETE", `/admin/generations/${encodeURIComponent(j.id)}?artifacts=false`, adminHeaders())))))))
      : message("info", "None: every finished job still has its outputs."));
  }

  async function remove(what, method, path, headers = {}) {
    try {
      await request(method, path, { headers, signal: page.signal });
      fill(result, message("ok", `Deleted ${what}.`));
    } catch (err) {
      fill(result, message("error", `Could not delete ${what}: ${err.describe ? err.describe() : err.message}`));
    }
    load().catch((err) => page.showError(err));
  }

  function tile(label, value) {
    return h("div", { class: "tile" }, h("div", { class: "tile-value" }, value), h("div", { class: "tile-label" }, label));
  }

  load().catch((err) => page.showError(err));
}
