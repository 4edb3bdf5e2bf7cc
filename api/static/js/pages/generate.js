// Generate: speech and transcription jobs through /v1/generations, live progress from each
// job's SSE events, an audio player for results. Peers without the media API answer 404:
// the page says so instead of showing an empty form.

import { ApiError, get, request } from "../api.js";
import { fill, fmtNumber, h, loading, message, unavailable } from "../dom.js";

const TERMINAL = new Set(["completed", "failed", "cancelled", "expired"]);
const TRANSCRIBE_PROMPT = "Transcribe this audio clip word for word.";

function isSpeech(g) {
  return g.modality === "audio" && g.kind !== "understand";
}

function readsAudio(g) {
  return g.kind === "understand" && (g.input_modalities || []).includes("audio");
}

export function mount(root, page) {
  const body = h("div", {}, loading("Asking this peer what it can generate…"));
  root.append(h("div", { class: "page-head" }, h("h1", {}, "Generate"), h("span", { class: "muted" }, "speech and transcription jobs")), body);
  const jobsBox = h("div", { id: "jobs" });
  const watching = new Map(); // job id -> EventSource
  page.onLeave(() => { for (const source of watching.values()) source.close(); });

  get("/v1/generations/capabilities", { signal: page.signal }).then((caps) => {
    const generators = caps.generators || [];
    const speech = generators.filter(isSpeech), listen = generators.filter(readsAudio);
    if (!speech.length && !listen.length) {
      fill(body, message("info", "This peer has no speech or transcription generator configured."));
      return;
    }
    fill(body, speech.length ? speechForm(speech) : null, listen.length ? transcribeForm(listen) : null,
      h("section", { class: "card" }, h("h2", {}, "Jobs"), jobsBox));
    loadJobs();
  }, (err) => fill(body, unavailable(err, "Media generation")));

  function speechForm(generators) {
    const model = h("select", { "aria-label": "speech model" }, generators.map((g) => h("option", { value: g.model }, g.model)));
    const voice = h("select", { "aria-label": "voice" });
    const text = h("textarea", { rows: 3, placeholder: "Text to speak" });
    const status = h("div", {});
    const pickVoices = () => {
      const g = generators.find((x) => x.model === model.value) || {};
      const voices = [...(g.voices || []), ...(g.builtin_voices || [])];
      fill(voice, g.requires_speaker ? null : h("option", { value: "" }, "(default)"), voices.map((v) => h("option", { value: v }, v)));
      voice.disabled = !voices.length;
    };
    model.addEventListener("change", pickVoices);
    pickVoices();
    const submit = async () => {
      if (!text.value.trim()) { fill(status, message("error", "Write something to speak.")); return; }
      const params = { text: text.value.trim() };
      if (voice.value) params.voice = voice.value;
      try {
        const job = await request("POST", "/v1/generations", { body: { model: model.value, modality: "audio", params }, signal: page.signal });
        fill(status, message("ok", `Job ${job.id} queued.`));
        watch(job);
      } catch (err) {
        fill(status, message("error", err.describe ? err.describe() : err.message));
      }
    };
    return h("section", { class: "card" }, h("h2", {}, "Speech"),
      h("div", { class: "row" }, h("label", { class: "field" }, h("span", {}, "Model"), model), h("label", { class: "field" }, h("span", {}, "Voice"), voice)),
      text, h("div", { class: "row" }, h("button", { type: "button", class: "primary", onclick: submit }, "Speak")), status);
  }

  function transcribeForm(generators) {
    const model = h("select", { "aria-label": "transcription model" }, generators.map((g) => h("option", { value: g.model, disabled: g.ready === false }, g.model + (g.ready === false ? " (not up)" : ""))));
    const file = h("input", { type: "file", accept: "audio/wav,audio/x-wav,audio/mpeg" });
    const status = h("div", {});
    const submit = async () => {
      const clip = file.files && file.files[0];
      if (!clip) { fill(status, message("error", "Choose a WAV or MP3 clip.")); return; }
      try {
        const artifact = await request("POST", "/v1/artifacts", { body: clip, signal: page.signal });
        const job = await request("POST", "/v1/generations", {
          body: { model: model.value, modality: "text", input_artifacts: [artifact.id], params: { prompt: TRANSCRIBE_PROMPT } },
          signal: page.signal,
        });
        fill(status, message("ok", `Job ${job.id} queued.`));
        watch(job);
      } catch (err) {
        fill(status, message("error", err.describe ? err.describe() : err.message));
      }
    };
    return h("section", { class: "card" }, h("h2", {}, "Transcription"),
      h("div", { class: "row" }, h("label", { class: "field" }, h("span", {}, "Model"), model), file,
        h("button", { type: "button", class: "primary", onclick: submit }, "Transcribe")), status);
  }

  function jobCard(job) {
    const fraction = typeof job.progress_fraction === "number" ? job.progress_fraction : null;
    const outputs = job.output_artifacts || [];
    const result = [];
    if (job.state === "completed" && outputs.length) {
      if (job.modality === "audio") result.push(...outputs.map((id) => h("audio", { controls: true, preload: "none", src: `/v1/artifacts/${encodeURIComponent(id)}` })));
      else result.push(h("pre", { class: "transcript", "data-artifact": outputs[0] }, "…"));
    }
    const card = h("div", { class: `job state-${job.state}`, "data-job": job.id },
      h("div", { class: "job-head" }, h("strong", {}, job.model), h("span", { class: "badge" }, job.state),
        h("span", { class: "muted" }, job.created_at || ""),
        TERMINAL.has(job.state) ? null : h("button", { type: "button", onclick: () => cancel(job.id) }, "Cancel")),
      TERMINAL.has(job.state) ? null : h("div", { class: "progress" },
        h("div", { class: "progress-bar", "data-fraction": fraction ?? 0 }),
        h("span", {}, `${job.progress_stage || job.state}${fraction !== null ? ` ${fmtNumber(fraction * 100)}%` : ""}`)),
      job.error_message ? message("error", `${job.error_code || "failed"}: ${job.error_message}`) : null,
      result);
    // The bar's width is set from script: the CSP allows no inline style attributes.
    const bar = card.querySelector(".progress-bar");
    if (bar) bar.style.width = `${Math.round((fraction || 0) * 100)}%`;
    const transcript = card.querySelector(".transcript");
    if (transcript) {
      get(`/v1/artifacts/${encodeURIComponent(transcript.dataset.artifact)}`, { signal: page.signal })
        .then((text) => { transcript.textContent = String(text); }, (err) => { transcript.textContent = err.message; });
    }
    return card;
  }

  function show(job) {
    const old = jobsBox.querySelector(`[data-job="${CSS.escape(job.id)}"]`);
    const card = jobCard(job);
    for (const placeholder of jobsBox.querySelectorAll(":scope > .message")) placeholder.remove();
    if (old) old.replaceWith(card);
    else jobsBox.prepend(card);
  }

  function watch(job) {
    show(job);
    if (TERMINAL.has(job.state) || watching.has(job.id)) return;
    const source = new EventSource(`/v1/generations/${encodeURIComponent(job.id)}/events`);
    watching.set(job.id, source);
    source.onmessage = (event) => {
      if (event.data === "[DONE]") { source.close(); watching.delete(job.id); return; }
      try { show(JSON.parse(event.data)); } catch (_) { /* a malformed event: wait for the next */ }
    };
    source.onerror = () => {
      // The stream broke (or the peer lacks events): fall back to polling the job.
      source.close();
      watching.delete(job.id);
      poll(job.id);
    };
  }

  async function poll(id) {
    for (let i = 0; i < 600 && page.alive; i += 1) {
      try {
        const job = await get(`/v1/generations/${encodeURIComponent(id)}`, { signal: page.signal });
        show(job);
        if (TERMINAL.has(job.state)) return;
      } catch (err) {
        if (!(err instanceof ApiError)) return;
        page.showError(err);
        return;
      }
      await new Promise((resolve) => setTimeout(resolve, 1000));
    }
  }

  async function cancel(id) {
    try {
      show(await request("DELETE", `/v1/generations/${encodeURIComponent(id)}`, { signal: page.signal }));
    } catch (err) {
      page.showError(err);
    }
  }

  async function loadJobs() {
    try {
      const list = await get("/v1/generations?limit=50", { signal: page.signal });
      const jobs = Array.isArray(list) ? list : list.generations || list.data || list.jobs || [];
      // Completed jobs whose audio was deleted are listed under Storage, not here.
      const shown = jobs.filter((j) => !(j.artifacts_deleted > 0 && !(j.output_artifacts || []).length));
      fill(jobsBox, shown.length ? null : message("info", "No job yet."));
      for (const job of shown.reverse()) watch(job);
    } catch (err) {
      fill(jobsBox, unavailable(err, "The job list"));
    }
  }
}
