// Building DOM without HTML strings: every string becomes a text node, so nothing a peer
// reports (ids, model names, error messages) can inject markup into the page.

const SVG_NS = "http://www.w3.org/2000/svg";

function setAttrs(el, attrs) {
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") el.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key === "value" || key === "checked" || key === "disabled" || key === "selected") el[key] = value;
    else el.setAttribute(key, value === true ? "" : String(value));
  }
}

function appendAll(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
}

/** An HTML element: h("td", {class: "num"}, "42"). */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  setAttrs(el, attrs);
  appendAll(el, children);
  return el;
}

/** An SVG element, same signature as h(). */
export function s(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  setAttrs(el, attrs);
  appendAll(el, children);
  return el;
}

export function fill(el, ...children) {
  el.replaceChildren();
  appendAll(el, children);
  return el;
}

/** The last characters of a peer or node id: the common "12D3KooW" prefix says nothing. */
export function shortId(id) {
  const text = String(id || "");
  return text.length > 10 ? "…" + text.slice(-6) : text;
}

export function fmtNumber(n, digits = 0) {
  if (typeof n !== "number" || !Number.isFinite(n)) return "–";
  return n.toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

export function fmtBytes(n) {
  if (typeof n !== "number" || !Number.isFinite(n)) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i += 1; }
  return `${n.toFixed(i && n < 10 ? 1 : 0)} ${units[i]}`;
}

export function fmtDuration(seconds) {
  if (typeof seconds !== "number" || !Number.isFinite(seconds)) return "–";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

export function fmtTime(ms) {
  return new Date(ms).toLocaleTimeString("en-GB", { hour: "2-digit", minute: "2-digit" });
}

export function stateBadge(state, idle = false) {
  const label = idle && state === "Ready" ? "Idle" : state;
  return h("span", { class: `badge state-${label}`, "data-state": state }, label);
}

/** A placeholder while the first answer is on its way (tests wait for it to go). */
export function loading(text) {
  return h("div", { class: "message info loading", role: "status" }, text);
}

/** A message box: kind is "error", "info" or "ok". */
export function message(kind, text) {
  return h("div", { class: `message ${kind}`, role: kind === "error" ? "alert" : "status" }, text);
}

/** A button that asks for a second click before running a destructive action. */
export function confirmButton(label, confirmLabel, action, attrs = {}) {
  let armed = false;
  let timer = null;
  const button = h("button", { type: "button", class: "danger", ...attrs }, label);
  button.addEventListener("click", () => {
    if (!armed) {
      armed = true;
      button.textContent = confirmLabel;
      button.classList.add("armed");
      timer = setTimeout(() => { armed = false; button.textContent = label; button.classList.remove("armed"); }, 4000);
      return;
    }
    clearTimeout(timer);
    armed = false;
    button.textContent = label;
    button.classList.remove("armed");
    action();
  });
  return button;
}

/** The message for an optional part of the API this peer does not serve or has not configured. */
export function unavailable(err, what) {
  if (err && err.status && (err.status === 404 || err.status === 405)) {
    return message("info", `${what} is not available on this peer: it does not serve ${err.path.split("?")[0]}. ` +
      "Peers built without the media API still serve everything else.");
  }
  if (err && err.status === 503) return message("info", `${what} is not configured on this peer: ${err.message}`);
  return message("error", err && err.describe ? err.describe() : String((err && err.message) || err));
}
