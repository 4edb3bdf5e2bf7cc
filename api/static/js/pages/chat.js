// Chat: a playground against any model the swarm serves. Streams over SSE from
// /v1/chat/completions, shows reasoning apart from the answer, the route the session took
// (GET /sessions/:id on this peer) and tokens/s; Stop ends the generation on every stage.

import { ApiError, errorMessage, get, isAbort, request } from "../api.js";
import { fill, fmtNumber, h, message, shortId } from "../dom.js";
import { sseData } from "../sse.js";

const SESSION_HEADER = "x-dppan-session-id";

function routeText(route) {
  if (!route || !route.length) return "route: not known yet";
  return "route: " + route.map((hop) => `${shortId(hop.peer_id)} [${hop.start_layer}–${hop.end_layer})`).join(" → ");
}

export function mount(root, page) {
  const history = [];
  let running = null; // {controller, sessionId}

  const modelSelect = h("select", { id: "chat-model", "aria-label": "model" });
  const system = h("input", { type: "text", placeholder: "optional system prompt", id: "chat-system" });
  const maxTokens = h("input", { type: "number", min: 1, max: 4096, value: 256, id: "chat-max-tokens" });
  const temperature = h("input", { type: "number", min: 0, max: 2, step: 0.1, value: 0.7, id: "chat-temperature" });
  const log = h("div", { class: "chat-log", id: "chat-log" });
  const input = h("textarea", { id: "chat-input", rows: 3, placeholder: "Ask something… (Enter sends, Shift+Enter for a new line)" });
  const send = h("button", { type: "button", class: "primary", id: "chat-send", onclick: () => submit() }, "Send");
  const stop = h("button", { type: "button", id: "chat-stop", disabled: true, onclick: () => stopRunning() }, "Stop");
  const clear = h("button", { type: "button", onclick: () => { if (!running) { history.length = 0; log.replaceChildren(); } } }, "Clear");
  input.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); submit(); }
  });

  root.append(
    h("div", { class: "page-head" }, h("h1", {}, "Chat"), h("span", { class: "muted" }, "streams from the swarm through this peer")),
    h("section", { class: "card chat-settings" },
      h("label", { class: "field" }, h("span", {}, "Model"), modelSelect),
      h("label", { class: "field grow" }, h("span", {}, "System"), system),
      h("label", { class: "field small" }, h("span", {}, "Max tokens"), maxTokens),
      h("label", { class: "field small" }, h("span", {}, "Temperature"), temperature)),
    h("section", { class: "card chat-card" }, log,
      h("div", { class: "chat-input" }, input, h("div", { class: "buttons" }, send, stop, clear))));

  get("/v1/models", { signal: page.signal }).then((body) => {
    const ids = (body.data || []).map((m) => m.id);
    fill(modelSelect, ids.map((id) => h("option", { value: id }, id)));
    if (!ids.length) page.showError("No model is served by the swarm right now: start peers that cover a model's layers.");
  }, (err) => page.showError(err));

  page.onLeave(() => stopRunning());

  function bubble(role, text) {
    const el = h("div", { class: `msg ${role}` }, h("div", { class: "who" }, role), h("div", { class: "text" }, text));
    log.append(el);
    log.scrollTop = log.scrollHeight;
    return el;
  }

  function setRunning(value) {
    running = value;
    send.disabled = Boolean(value);
    stop.disabled = !value;
  }

  async function stopRunning() {
    if (!running) return;
    const { controller, sessionId } = running;
    running.stopped = true;
    if (sessionId) {
      // Frees the KV cache on every stage now; the stream then ends with a 409 chunk.
      request("DELETE", `/sessions/${encodeURIComponent(sessionId)}`).catch(() => {});
    }
    setTimeout(() => controller.abort(), 1500);
  }

  async function showRoute(sessionId, el) {
    try {
      const info = await get(`/sessions/${encodeURIComponent(sessionId)}`, { signal: page.signal });
      el.textContent = routeText(info.route);
      el.title = (info.route || []).map((hop) => `${hop.peer_id} layers ${hop.start_layer}-${hop.end_layer}`).join("\n");
    } catch (err) {
      if (!isAbort(err)) el.textContent = err instanceof ApiError && err.notServed ? "route: not reported by this peer" : `route: ${err.message}`;
    }
  }

  async function submit() {
    const text = input.value.trim();
    if (!text || running) return;
    const model = modelSelect.value;
    if (!model) { page.showError("Pick a model first (none is served right now?)."); return; }
    page.clearError();
    input.value = "";
    history.push({ role: "user", content: text });
    bubble("user", text);

    const reasoningBody = h("div", { class: "reasoning-text" });
    const reasoning = h("details", { class: "reasoning", hidden: true, open: true }, h("summary", {}, "Reasoning"), reasoningBody);
    const answer = h("div", { class: "text answer" });
    const routeEl = h("span", { class: "route" }, "route: …");
    const speedEl = h("span", { class: "speed" });
    const statusEl = h("span", { class: "finish" });
    const el = h("div", { class: "msg assistant streaming" }, h("div", { class: "who" }, model), reasoning, answer,
      h("div", { class: "meta" }, routeEl, speedEl, statusEl));
    log.append(el);

    const controller = new AbortController();
    const state = { controller, sessionId: null, stopped: false };
    setRunning(state);
    page.signal.addEventListener("abort", () => controller.abort(), { once: true });
    const messages = [...(system.value.trim() ? [{ role: "system", content: system.value.trim() }] : []), ...history];
    let content = "", chunks = 0, usage = null, finish = null, first = 0, routeAsked = false;
    const started = performance.now();
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({
          model, messages, stream: true, stream_options: { include_usage: true },
          max_tokens: Number(maxTokens.value) || 256, temperature: Number(temperature.value),
        }),
        signal: controller.signal,
      });
      if (!response.ok) throw new ApiError(response.status, await errorMessage(response), "/v1/chat/completions");
      state.sessionId = response.headers.get(SESSION_HEADER);
      for await (const data of sseData(response)) {
        if (data === "[DONE]") break;
        const event = JSON.parse(data);
        if (event.error) {
          const text = typeof event.error === "string" ? event.error : event.error.message;
          if (!state.stopped) el.append(message("error", `${text} (HTTP ${event.status || "?"})`));
          continue;
        }
        if (event.usage) usage = event.usage;
        const choice = (event.choices || [])[0];
        if (!choice) continue;
        const delta = choice.delta || {};
        if (delta.reasoning_content || delta.content) {
          if (!first) first = performance.now();
          chunks += 1;
          if (!routeAsked && state.sessionId) { routeAsked = true; showRoute(state.sessionId, routeEl); }
        }
        if (delta.reasoning_content) { reasoning.hidden = false; reasoningBody.append(delta.reasoning_content); }
        if (delta.content) { content += delta.content; answer.append(delta.content); }
        if (choice.finish_reason) finish = choice.finish_reason;
        log.scrollTop = log.scrollHeight;
      }
    } catch (err) {
      if (!isAbort(err)) el.append(message("error", err instanceof ApiError ? err.describe() : `the stream broke: ${err.message}`));
    } finally {
      const end = performance.now();
      const tokens = usage ? usage.completion_tokens : chunks;
      if (first && tokens > 1 && end > first) {
        speedEl.textContent = `${fmtNumber((tokens - 1) / ((end - first) / 1000), 1)} tok/s · ${tokens} tokens · first token ${fmtNumber((first - started) / 1000, 2)} s`;
      }
      statusEl.textContent = state.stopped ? "stopped" : finish ? `finish: ${finish}` : "";
      if (state.sessionId) showRoute(state.sessionId, routeEl);
      else routeEl.textContent = "route: not known";
      el.classList.remove("streaming");
      el.dataset.done = "true";
      if (content) history.push({ role: "assistant", content });
      else history.pop(); // nothing came back: the question leaves the history, as if unasked
      log.scrollTop = log.scrollHeight;
      if (running === state) setRunning(null);
    }
  }
}
