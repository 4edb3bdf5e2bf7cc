// Admin: the token (kept in this tab only), verify it, and the node actions: reassign a
// range, set idle / ready, force-remove. The peer checks the token on every call; without
// one it answers 403 and the page says so.

import { get, request } from "../api.js";
import { adminHeaders, adminToken, setAdminToken } from "../admin_token.js";
import { confirmButton, fill, h, message, shortId, stateBadge } from "../dom.js";

export function mount(root, page) {
  const token = h("input", { type: "password", id: "admin-token", autocomplete: "off", placeholder: "the peer's --admin-token", value: adminToken() });
  const tokenStatus = h("div", { id: "admin-token-status" });
  const result = h("div", { id: "admin-result" });
  const table = h("div", {});

  async function verify() {
    setAdminToken(token.value.trim());
    if (!adminToken()) { fill(tokenStatus, message("info", "No token entered: admin actions will be refused (403).")); return; }
    try {
      await get("/admin/verify", { headers: adminHeaders(), signal: page.signal });
      fill(tokenStatus, message("ok", "Token accepted by this peer. It is kept in this browser tab only."));
    } catch (err) {
      fill(tokenStatus, message("error", `Token refused: ${err.message}`));
    }
  }

  function forget() {
    setAdminToken("");
    token.value = "";
    fill(tokenStatus, message("info", "Token forgotten."));
  }

  async function act(what, method, path, body) {
    try {
      const answer = await request(method, path, { body, headers: adminHeaders(), signal: page.signal });
      fill(result, message("ok", `${what}: done${answer && answer.state ? ` (now ${answer.state})` : ""}.`));
      setTimeout(() => load().catch((err) => page.showError(err)), 1500);
    } catch (err) {
      fill(result, message("error", `${what} refused: ${err.describe ? err.describe() : err.message}`));
    }
  }

  function row(node) {
    const id = encodeURIComponent(node.node_id);
    const start = h("input", { type: "number", min: 0, value: node.start_layer, class: "layer-input", "aria-label": "start layer" });
    const end = h("input", { type: "number", min: 1, value: node.end_layer, class: "layer-input", "aria-label": "end layer" });
    const label = `${shortId(node.node_id)}`;
    return h("tr", { "data-node": node.node_id },
      h("td", { title: node.node_id }, h("code", {}, label)),
      h("td", {}, node.model_id),
      h("td", {}, stateBadge(node.state, node.idle)),
      h("td", { class: "actions" }, start, "–", end,
        h("button", { type: "button", class: "reassign", onclick: () =>
          act(`Reassign ${label} to ${start.value}–${end.value}`, "POST", `/admin/nodes/${id}/reassign`,
            { start_layer: Number(start.value), end_layer: Number(end.value) }) }, "Reassign")),
      h("td", { class: "actions" },
        node.idle
          ? h("button", { type: "button", class: "set-ready", onclick: () => act(`Set ${label} ready`, "PATCH", `/admin/nodes/${id}/state`, { state: "ready" }) }, "Set ready")
          : h("button", { type: "button", class: "set-idle", onclick: () => act(`Set ${label} idle`, "PATCH", `/admin/nodes/${id}/state`, { state: "idle" }) }, "Set idle"),
        confirmButton("Force remove", "Really remove?", () => act(`Force-remove ${label}`, "DELETE", `/admin/nodes/${id}/force`), { class: "danger force-remove" })));
  }

  async function load() {
    const nodes = await get("/nodes", { signal: page.signal });
    fill(table, nodes.length
      ? h("table", { class: "grid-table admin-table" },
          h("thead", {}, h("tr", {}, ["Node", "Model", "State", "Layer range", "Actions"].map((t) => h("th", {}, t)))),
          h("tbody", {}, nodes.map(row)))
      : message("info", "No node is registered."));
  }

  root.append(
    h("div", { class: "page-head" }, h("h1", {}, "Admin")),
    h("section", { class: "card" }, h("h2", {}, "Admin token"),
      h("p", { class: "muted" }, "Sent as X-Admin-Token to this peer only, kept in this browser tab (sessionStorage), never in a cookie."),
      h("div", { class: "row" }, token,
        h("button", { type: "button", class: "primary", id: "admin-verify", onclick: verify }, "Save & verify"),
        h("button", { type: "button", onclick: forget }, "Forget")),
      tokenStatus),
    h("section", { class: "card" },
      h("div", { class: "card-head" }, h("h2", {}, "Nodes"),
        h("button", { type: "button", onclick: () => load().catch((err) => page.showError(err)) }, "Refresh")),
      h("p", { class: "muted" }, "Reassign reloads a node on another range; an idle node stays registered but gets no new chains; force-remove bans a node for 10 minutes without telling it."),
      result, table));
  if (adminToken()) verify();
  else fill(tokenStatus, message("info", "Enter the token this peer was started with (--admin-token)."));
  load().catch((err) => page.showError(err));
}
