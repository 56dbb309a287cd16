// The obd web view: the run list and a run's page, kept current by server-sent events.
// Everything from the daemon is shown with textContent, never as HTML.
// Every URL here is relative: the page lives under its view's secret prefix (/<prefix>/), the only
// path its cookie is sent to (see daemon/cli/ui/server.py).
"use strict";

const FINAL = new Set(["stopped", "succeeded", "failed", "cancelled"]);
const LOG_KEEP = 200000; // characters of log kept on the page
const state = { token: null, runs: new Map(), listEvents: null, runEvents: null, run: null, chart: null };

function $(id) { return document.getElementById(id); }

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  const s = Math.floor(seconds);
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s`;
  return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
}

function clock(ts) {
  if (!ts) return "-";
  const d = new Date(ts * 1000);
  const pad = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

// The plugin's phases other than training, as `status` says them (daemon/cli/render.py PHASE_WORDS).
const PHASES = { evaluating: "evaluating", saving: "saving a checkpoint", loading_data: "loading data", after_train: "after training" };

function progressText(p) {
  p = p || {};
  if (p.step === null || p.step === undefined) return "-";
  return p.max_steps ? `step ${p.step}/${p.max_steps}` : `step ${p.step}`;
}

function podText(pod) {
  if (!pod) return "-";
  const parts = [];
  if (typeof pod.spend_usd === "number") parts.push(`$${pod.spend_usd.toFixed(2)}`);
  if (typeof pod.cost_per_hr === "number") parts.push(`($${pod.cost_per_hr.toFixed(2)}/h)`);
  if (!parts.length) parts.push(pod.state || "?");
  return parts.join(" ");
}

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function stateBadge(s, paused) {
  // A run paused by obd (a preemption, a drain) waits queued to resume on its own: said so.
  const span = document.createElement("span");
  span.className = paused ? `state ${s} paused` : `state ${s}`;
  span.textContent = paused ? "paused" : s;
  if (paused) span.title = paused.by ? `paused for run ${paused.by}; it resumes on its own` : "paused by a drain; it resumes on its own";
  return span;
}

function setDaemon(error) {
  const el = $("daemon");
  el.textContent = error ? `daemon: ${error}` : "live";
  el.classList.toggle("down", Boolean(error));
}

// --- the run list --------------------------------------------------------------------------

function renderList() {
  const body = $("runs").tBodies[0];
  const runs = [...state.runs.values()].sort((a, b) => (b.created || 0) - (a.created || 0) || (a.id < b.id ? 1 : -1));
  const rows = runs.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.run = r.id;
    tr.addEventListener("click", () => { location.hash = `#run/${encodeURIComponent(r.id)}`; });
    tr.appendChild(cell(r.name ? `${r.id} (${r.name})` : r.id, "mono"));
    const st = document.createElement("td");
    st.className = "run-state";
    st.appendChild(stateBadge(r.state, r.paused));
    tr.appendChild(st);
    const prog = document.createElement("td");
    const p = r.progress || {};
    if (p.step !== null && p.step !== undefined && p.max_steps) {
      const bar = document.createElement("span");
      bar.className = "bar";
      const fill = document.createElement("span");
      fill.style.width = `${Math.min(100, (100 * p.step) / p.max_steps)}%`;
      bar.appendChild(fill);
      prog.appendChild(bar);
    }
    prog.appendChild(document.createTextNode(progressText(p)));
    tr.appendChild(prog);
    tr.appendChild(cell(p.loss === null || p.loss === undefined ? "-" : Number(p.loss).toPrecision(4)));
    tr.appendChild(cell(FINAL.has(r.state) ? "-" : duration(p.eta_seconds)));
    tr.appendChild(cell(r.target || "-"));
    tr.appendChild(cell(podText(r.pod)));
    tr.appendChild(cell(clock(r.created)));
    tr.appendChild(cell(r.message || "", "message"));
    return tr;
  });
  body.replaceChildren(...rows);
  $("no-runs").hidden = rows.length > 0;
}

function openList() {
  if (state.listEvents) return;
  const es = new EventSource("api/events");
  state.listEvents = es;
  es.addEventListener("runs", (e) => {
    const data = JSON.parse(e.data);
    state.runs = new Map(data.runs.map((r) => [r.id, r]));
    setDaemon(data.error);
    renderList();
  });
  es.addEventListener("changed", (e) => {
    const data = JSON.parse(e.data);
    for (const r of data.runs) state.runs.set(r.id, r);
    setDaemon(data.error);
    renderList();
  });
  es.onerror = () => setDaemon("obd ui is not answering (retrying)");
}

// --- a run's page --------------------------------------------------------------------------

function renderRecord(r) {
  state.run = r;
  $("run-title").textContent = r.name ? `${r.id} (${r.name})` : r.id;
  const st = $("run-state");
  st.className = `state ${r.state}`;
  st.textContent = r.state;
  $("run-message").textContent = r.message || "";
  const p = r.progress || {};
  let prog = progressText(p);
  if (p.loss !== null && p.loss !== undefined) prog += `, loss ${Number(p.loss).toPrecision(4)}`;
  if (!FINAL.has(r.state) && p.eta_seconds !== null && p.eta_seconds !== undefined) prog += `, ETA ${duration(p.eta_seconds)}`;
  if (!FINAL.has(r.state) && PHASES[p.phase]) prog += `, ${PHASES[p.phase]}`;
  // What a stop costs now: the nearest safe point plus the last save (daemon/progress.py).
  if (!FINAL.has(r.state) && typeof p.stop_seconds === "number") prog += `, stop ~${duration(p.stop_seconds)}`;
  $("run-progress").textContent = prog;
  $("run-target").textContent = `${r.target || "-"} ${r.remote_dir || ""}`;
  const info = r.target_info || {};
  const pod = r.pod || {};
  $("run-pod").textContent = info.pod_id ? `${info.pod_id} ${pod.state || info.phase || ""} ${podText({ ...pod, cost_per_hr: pod.cost_per_hr ?? info.cost_per_hr })}` : "-";
  const snap = r.snapshot;
  $("run-snapshot").textContent = snap ? `${snap.checkpoint} at step ${snap.step} (${snap.reason})` : "-";
  $("run-resumed").textContent = r.resumed_from ? `${r.resumed_from} (${r.resume_checkpoint || ""})` : "-";
  $("run-command").textContent = (r.command || []).join(" ") || "-";
  const rows = (r.history || []).map((h) => {
    const tr = document.createElement("tr");
    tr.append(cell(clock(h.time)), cell(h.state), cell(h.reason || ""));
    return tr;
  });
  $("history").tBodies[0].replaceChildren(...rows);
  const active = !FINAL.has(r.state);
  $("stop-button").disabled = !active || !r.snapshots;
  $("stop-button").title = r.snapshots ? "save a checkpoint at the end of this step, then stop" : "this job has not announced obd's snapshot plugin: it can only be cancelled";
  $("cancel-button").disabled = !active;
  if (snap && state.chart) state.chart.markSnapshot(snap.step);
}

function appendLog(text, reset) {
  const log = $("log");
  const atBottom = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
  let all = (reset ? "" : log.textContent) + text;
  if (all.length > LOG_KEEP) all = all.slice(all.length - LOG_KEEP);
  log.textContent = all;
  if (atBottom || reset) log.scrollTop = log.scrollHeight;
}

function openRun(runId) {
  closeRun();
  $("log").textContent = "";
  $("action-result").textContent = "";
  $("chart-note").textContent = "";
  state.chart = new window.LossChart($("chart"), "loss");
  state.chart.draw();
  const es = new EventSource(`api/runs/${encodeURIComponent(runId)}/events`);
  state.runEvents = es;
  es.addEventListener("record", (e) => renderRecord(JSON.parse(e.data)));
  es.addEventListener("curve", (e) => {
    const data = JSON.parse(e.data);
    state.chart.set(data);
    const parents = data.runs.slice(0, -1);
    let note = parents.length ? `continues ${parents.join(" → ")}` : "";
    if (data.note) note += ` (${data.note})`;
    $("chart-note").textContent = note;
    if (state.run && state.run.snapshot) state.chart.markSnapshot(state.run.snapshot.step);
  });
  es.addEventListener("points", (e) => state.chart.add(JSON.parse(e.data).points));
  es.addEventListener("log", (e) => {
    const data = JSON.parse(e.data);
    appendLog(data.text, data.reset);
  });
  es.addEventListener("error", (e) => {
    if (!e.data) return; // a dropped connection: EventSource reconnects by itself
    const data = JSON.parse(e.data);
    $("run-message").textContent = data.message;
    if (data.fatal) es.close();
  });
}

function closeRun() {
  if (state.runEvents) state.runEvents.close();
  state.runEvents = null;
  state.run = null;
}

async function act(action) {
  const r = state.run;
  if (!r) return;
  const question = action === "stop"
    ? `Stop run ${r.id}? It saves a checkpoint at the end of the current step (a snapshot), then stops; you can resume it later.`
    : `Cancel run ${r.id}? The job is terminated now, without a snapshot.`;
  if (!window.confirm(question)) return;
  const result = $("action-result");
  result.textContent = action === "stop" ? "asking for a snapshot…" : "cancelling…";
  try {
    const reply = await fetch(`api/runs/${encodeURIComponent(r.id)}/${action}`, {
      method: "POST",
      headers: { "X-OBD-Token": state.token },
    });
    const body = await reply.json();
    result.textContent = reply.ok
      ? (action === "stop" ? "snapshot requested: the run stops at the end of this step" : "cancel requested")
      : `refused: ${body.error}`;
    if (reply.ok) renderRecord(body);
  } catch (err) {
    result.textContent = `could not reach obd ui: ${err}`;
  }
}

// --- routing -------------------------------------------------------------------------------

function route() {
  const m = location.hash.match(/^#run\/(.+)$/);
  if (m) {
    $("list-view").hidden = true;
    $("run-view").hidden = false;
    openRun(decodeURIComponent(m[1]));
  } else {
    closeRun();
    $("run-view").hidden = true;
    $("list-view").hidden = false;
  }
}

async function start() {
  const session = await (await fetch("api/session")).json();
  state.token = session.token;
  $("who").textContent = `runs of ${session.user}`;
  $("stop-button").addEventListener("click", () => act("stop"));
  $("cancel-button").addEventListener("click", () => act("cancel"));
  window.addEventListener("hashchange", route);
  openList();
  route();
}

start();
