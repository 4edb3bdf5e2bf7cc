// The dashboard shell: hash routing between pages, and the life cycle each page runs in.
// A page module exports mount(root, page); everything it starts (polls, streams, event
// sources) is tied to `page` and stopped when the user navigates away.

import { get, isAbort } from "./api.js";
import { fill, h, message, shortId } from "./dom.js";
import * as admin from "./pages/admin.js";
import * as chat from "./pages/chat.js";
import * as generate from "./pages/generate.js";
import * as metrics from "./pages/metrics.js";
import * as nodes from "./pages/nodes.js";
import * as storage from "./pages/storage.js";
import * as swarm from "./pages/swarm.js";

const PAGES = [
  ["swarm", "Swarm", swarm],
  ["nodes", "Nodes", nodes],
  ["metrics", "Metrics", metrics],
  ["chat", "Chat", chat],
  ["generate", "Generate", generate],
  ["admin", "Admin", admin],
  ["storage", "Storage", storage],
];

class Page {
  constructor(root) {
    this.root = root;
    this.controller = new AbortController();
    this.cleanups = [];
    this.alive = true;
    this.banner = h("div", { class: "banner" });
  }

  get signal() {
    return this.controller.signal;
  }

  /** Show an error (or any message) at the top of the page, instead of a blank page. */
  showError(err) {
    if (isAbort(err) || !this.alive) return;
    const text = err && typeof err.describe === "function" ? err.describe() : String((err && err.message) || err);
    fill(this.banner, message("error", text));
  }

  clearError() {
    this.banner.replaceChildren();
  }

  /** Run fn now and every ms after it settles, until the page is left. */
  poll(fn, ms) {
    let timer = null;
    const tick = async () => {
      if (!this.alive) return;
      try {
        await fn();
        this.clearError();
      } catch (err) {
        this.showError(err);
      }
      if (this.alive) timer = setTimeout(tick, ms);
    };
    tick();
    this.onLeave(() => clearTimeout(timer));
  }

  onLeave(fn) {
    this.cleanups.push(fn);
  }

  leave() {
    this.alive = false;
    this.controller.abort();
    for (const fn of this.cleanups) {
      try { fn(); } catch (_) { /* a cleanup must not stop the others */ }
    }
  }
}

let current = null;

function route() {
  const name = (location.hash.replace(/^#\/?/, "").split("/")[0] || "swarm").toLowerCase();
  const entry = PAGES.find(([key]) => key === name) || PAGES[0];
  if (current) current.leave();
  const root = document.getElementById("page");
  root.replaceChildren();
  const page = new Page(root);
  current = page;
  root.append(page.banner);
  for (const link of document.querySelectorAll("#nav a")) {
    link.classList.toggle("active", link.dataset.page === entry[0]);
  }
  document.title = `${entry[1]} · Inclavate`;
  try {
    entry[2].mount(root, page);
  } catch (err) {
    page.showError(err);
  }
}

async function showPeer() {
  const el = document.getElementById("peer");
  try {
    const health = await get("/health");
    const layers = health.layers ? ` · layers ${health.layers[0]}–${health.layers[1]}` : "";
    fill(el, h("span", { class: "dot" }), `peer ${shortId(health.peer_id)}${layers} · v${health.version}`);
    el.title = `The peer serving this page: ${health.peer_id}`;
  } catch (err) {
    fill(el, h("span", { class: "dot down" }), "peer unreachable");
  }
}

function start() {
  fill(document.getElementById("nav"), PAGES.map(([key, label]) => h("a", { href: `#/${key}`, "data-page": key }, label)));
  window.addEventListener("hashchange", route);
  route();
  showPeer();
  setInterval(showPeer, 15000);
}

start();
