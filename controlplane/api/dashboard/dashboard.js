// epd ops dashboard: polls /dashboard/api/state and draws everything itself (no libraries, no CDN).
"use strict";

const REFRESH_MS = 2000;
const COLORS = ["#2f6fde", "#e07b22", "#1d8a4e", "#8a3ffc", "#c8372d", "#0f9fb0", "#9a6b00", "#d0479b"];
const WINDOW_LABELS = { 300: "-5 min", 3600: "-1 h", 21600: "-6 h" };
const TOKEN_KEY = "epd-admin-token";
const STAGES = ["queue", "reserve", "encode", "prefill", "kv_transfer", "decode", "complete", "stream"];
const dash = (window.epdDashboard = { state: null, polls: 0, errors: 0, window: 300 });
// api.ops_token: the page was opened as /dashboard?token=...; its data requests send it as a header
const opsToken = new URLSearchParams(window.location.search).get("token");
const opsHeaders = () => (opsToken ? { Authorization: `Bearer ${opsToken}` } : {});

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "style") node.style.cssText = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

const fmtMs = (s) => (s === null || s === undefined ? "–" : `${(s * 1e3).toFixed(1)} ms`);

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function setupCanvas(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || canvas.width, h = canvas.clientHeight || canvas.height;
  if (canvas.width !== Math.round(w * ratio)) { canvas.width = Math.round(w * ratio); canvas.height = Math.round(h * ratio); }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, w, h);
  ctx.font = "11px system-ui, sans-serif";
  return { ctx, w, h };
}

// A line chart of several series over the same x (null = no data: the line breaks there).
function lineChart(canvas, legend, series, unit) {
  const { ctx, w, h } = setupCanvas(canvas);
  const values = series.flatMap((s) => s.values.filter((v) => v !== null && v !== undefined));
  const max = niceMax(Math.max(0, ...values));
  const tick = (v) => (v >= 100 ? v.toFixed(0) : v.toPrecision(2));
  // the y axis is as wide as its widest label, so no label is cut off
  const labelW = Math.max(...[0, 1, 2, 3, 4].map((g) => ctx.measureText(tick((max * g) / 4)).width));
  const pad = { l: Math.ceil(labelW) + 10, r: 8, t: 8, b: 18 };
  const n = Math.max(1, ...series.map((s) => s.values.length));
  const x = (i) => pad.l + (i / Math.max(1, n - 1)) * (w - pad.l - pad.r);
  const y = (v) => h - pad.b - (v / max) * (h - pad.t - pad.b);
  ctx.strokeStyle = "#e3e6ec"; ctx.fillStyle = "#6b7383"; ctx.lineWidth = 1;
  for (let g = 0; g <= 4; g++) {
    const v = (max * g) / 4, yy = Math.round(y(v)) + 0.5;
    ctx.beginPath(); ctx.moveTo(pad.l, yy); ctx.lineTo(w - pad.r, yy); ctx.stroke();
    ctx.fillText(tick(v), 4, yy + 4);
  }
  ctx.fillText(WINDOW_LABELS[dash.window] || "", pad.l, h - 4);
  ctx.fillText("now", w - pad.r - ctx.measureText("now").width, h - 4);
  let points = 0;
  series.forEach((s, k) => {
    ctx.strokeStyle = ctx.fillStyle = COLORS[k % COLORS.length]; ctx.lineWidth = 2;
    let open = false;
    ctx.beginPath();
    s.values.forEach((v, i) => {
      if (v === null || v === undefined) { open = false; return; }
      points++;
      if (open) ctx.lineTo(x(i), y(v)); else ctx.moveTo(x(i), y(v));
      open = true;
    });
    ctx.stroke();
    s.values.forEach((v, i) => { if (v !== null && v !== undefined) ctx.fillRect(x(i) - 1.5, y(v) - 1.5, 3, 3); });
  });
  canvas.dataset.points = String(points);
  canvas.dataset.max = String(Math.max(0, ...values));
  legend.replaceChildren(...series.map((s, k) => {
    const last = [...s.values].reverse().find((v) => v !== null && v !== undefined);
    return el("span", { class: "key", style: `color:${COLORS[k % COLORS.length]}` },
      `${s.name} ${last === undefined ? "–" : last.toFixed(2) + " " + unit}`);
  }));
}

// Horizontal bars: KV blocks used / total per worker of a pool. The label and value columns are as wide as
// their widest text, so worker ids and figures are drawn whole.
function kvBars(canvas, legend, workers, pool) {
  const { ctx, w, h } = setupCanvas(canvas);
  const rowH = Math.min(28, (h - 8) / Math.max(1, workers.length));
  const value = (wk) => `${wk.kv_used}/${wk.kv_total} (${(100 * (wk.kv_total ? wk.kv_used / wk.kv_total : 0)).toFixed(1)}%)`;
  const labelW = Math.max(0, ...workers.map((wk) => ctx.measureText(wk.worker_id).width)) + 12;
  const valueW = Math.max(0, ...workers.map((wk) => ctx.measureText(value(wk)).width)) + 8;
  const barW = Math.max(20, w - labelW - valueW - 8);
  workers.forEach((wk, i) => {
    const yy = 4 + i * rowH, frac = wk.kv_total ? wk.kv_used / wk.kv_total : 0;
    ctx.fillStyle = "#6b7383"; ctx.fillText(wk.worker_id, 4, yy + rowH / 2 + 4);
    ctx.fillStyle = "#e3e6ec"; ctx.fillRect(labelW, yy + 4, barW, rowH - 8);
    ctx.fillStyle = COLORS[0]; ctx.fillRect(labelW, yy + 4, barW * frac, rowH - 8);
    ctx.fillStyle = "#1d2330"; ctx.fillText(value(wk), labelW + barW + 8, yy + rowH / 2 + 4);
  });
  canvas.dataset.points = String(workers.length);
  canvas.dataset.labelsFit = String(labelW + barW + valueW <= w + 1);
  legend.textContent = workers.length ? `${workers.length} ${pool} worker(s)` : `no ${pool} workers`;
}

function workerChip(wk) {
  const frac = wk.kv_total ? (100 * wk.kv_used) / wk.kv_total : 0;
  return el("span", { class: "worker", title: wk.worker_id },
    el("span", { class: `badge ${wk.draining ? "draining" : "serving"}` }, wk.draining ? "draining" : "serving"),
    ` ${wk.worker_id} · ${wk.running} · ${wk.queued_tokens}`,
    ...(wk.preemptions ? [el("span", { class: "preempted", title: "sequences its engine preempted (KV pool full) since it started" },
      ` · ${wk.preemptions} preempted`)] : []),
    ...(wk.kv_total ? [el("span", { class: "kvbar", title: `${wk.kv_used}/${wk.kv_total} KV blocks` },
      el("span", { style: `width:${frac.toFixed(1)}%` }))] : []));
}

const poolRows = new Map(); // pool -> {row, cells}: built once, so a scale input keeps its value

function renderPools(pools, error) {
  const errBox = document.getElementById("pools-error");
  errBox.hidden = !error; errBox.textContent = error || "";
  const body = document.querySelector("#pools tbody");
  for (const p of pools) {
    let entry = poolRows.get(p.pool);
    if (!entry) {
      const input = el("input", { type: "number", min: "0", max: "1000", value: String(p.target ?? p.ready), "data-pool": p.pool, "aria-label": `${p.pool} replicas` });
      const button = el("button", { "data-pool": p.pool, type: "button" }, "Scale");
      button.addEventListener("click", () => scale(p.pool, input.value));
      const kv = el("td", { class: "kv-use" });
      const cells = [el("td", {}, p.pool), el("td", { class: "desired" }), el("td", { class: "ready" }), kv,
        el("td", { class: "workers" }), el("td", { class: "scale" }, input, " ", button)];
      const row = el("tr", { "data-pool": p.pool }, ...cells);
      body.append(row);
      entry = { row, cells, kv };
      poolRows.set(p.pool, entry);
    }
    entry.cells[1].textContent = p.target === null ? "–" : String(p.target);
    entry.cells[2].textContent = String(p.ready);
    entry.cells[4].replaceChildren(
      ...(p.workers.length ? p.workers.map(workerChip)
        : [el("span", { class: "muted not-needed" }, p.not_needed || "none")]),
      ...(p.pending || []).map((r) => el("div", { class: `pending ${r.placed ? "placed" : "waiting"}`, title: r.name },
        `${r.name}: pending ${Math.round(r.waiting_s)} s, ${r.reason}`)),
      ...(p.problem ? [el("div", { class: "pending waiting" }, p.problem)] : []));
    entry.cells[1].title = p.problem || "";
    entry.kv.textContent = p.kv_usage === null || p.kv_usage === undefined ? "–" : `${(100 * p.kv_usage).toFixed(1)}%`;
  }
}

function timeline(journal) {
  const bar = el("div", { class: "timeline" });
  if (journal.length < 2) return bar;
  const t0 = journal[0].at, span = Math.max(1e-6, journal[journal.length - 1].at - t0);
  journal.slice(0, -1).forEach((e, i) => {
    const left = ((e.at - t0) / span) * 100, width = Math.max(0.5, ((journal[i + 1].at - e.at) / span) * 100);
    bar.append(el("span", { class: `st-${e.state}`, style: `left:${left}%;width:${width}%`,
      title: `${e.state} ${((journal[i + 1].at - e.at) * 1e3).toFixed(1)} ms ${e.detail}` }));
  });
  bar.title = journal.map((e) => `${e.state} +${((e.at - t0) * 1e3).toFixed(1)} ms`).join(" → ");
  return bar;
}

function renderRecent(recent, totals) {
  document.getElementById("totals").textContent =
    `${totals.requests} answered in the last ${WINDOW_LABELS[dash.window].slice(1)}, ${totals.errors} failed`;
  const body = document.querySelector("#recent tbody");
  body.replaceChildren(...recent.map((r) => el("tr", { "data-request": r.request_id },
    el("td", { title: r.request_id }, r.request_id.slice(0, 8)),
    el("td", {}, r.status || "…"),
    el("td", {}, fmtMs(r.ttft_s)), el("td", {}, fmtMs(r.tpot_s)), el("td", {}, fmtMs(r.e2e_s)),
    el("td", {}, `${r.prompt_tokens}/${r.completion_tokens}`),
    el("td", {}, timeline(r.journal), el("div", { class: "stages" }, r.journal.map((e) => e.state).join(" → "))),
    el("td", { class: "stages" }, STAGES.filter((k) => k in r.stages).map((k) => `${k} ${(r.stages[k] * 1e3).toFixed(1)} ms`).join(" · ")))));
}

function render(state) {
  renderPools(state.pools, state.pools_error);
  const s = state.series;
  const errPct = [...s.error_pct].reverse().find((v) => v !== null);
  lineChart(document.getElementById("rate-chart"), document.getElementById("rate-legend"),
    [{ name: "requests", values: s.requests_per_s }, { name: "errors", values: s.errors_per_s }], "/s");
  document.getElementById("error-pct").textContent = errPct === undefined ? "" : `errors ${errPct.toFixed(1)}% of answers`;
  lineChart(document.getElementById("queue-chart"), document.getElementById("queue-legend"),
    [{ name: "waiting", values: s.waiting }, { name: "in flight", values: s.in_flight }], "");
  const stages = STAGES.filter((k) => k in s.stages);
  lineChart(document.getElementById("stage-chart"), document.getElementById("stage-legend"),
    stages.map((k) => ({ name: k, values: s.stages[k].p50_ms })), "ms");
  lineChart(document.getElementById("ttft-chart"), document.getElementById("ttft-legend"),
    [{ name: "p50", values: s.ttft_p50_ms }, { name: "p90", values: s.ttft_p90_ms }], "ms");
  lineChart(document.getElementById("tpot-chart"), document.getElementById("tpot-legend"),
    [{ name: "p50", values: s.tpot_p50_ms }], "ms");
  lineChart(document.getElementById("kv-chart"), document.getElementById("kv-legend"),
    [{ name: "logical", values: s.kv_logical_mb_s }, { name: "wire", values: s.kv_wire_mb_s }], "MB/s");
  const decode = state.pools.find((p) => p.pool === "decode"), prefill = state.pools.find((p) => p.pool === "prefill");
  kvBars(document.getElementById("kvutil-chart"), document.getElementById("kvutil-legend"), decode ? decode.workers : [], "decode");
  kvBars(document.getElementById("prefill-kv-chart"), document.getElementById("prefill-kv-legend"),
    prefill ? prefill.workers : [], "prefill");
  renderRecent(state.recent, state.totals);
}

async function poll() {
  try {
    const resp = await fetch(`/dashboard/api/state?window=${dash.window}`, { cache: "no-store", headers: opsHeaders() });
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    const state = await resp.json();
    if (state.window_s !== dash.window) return; // an answer for the window before a switch
    dash.state = state; dash.polls++;
    render(state);
    document.getElementById("updated").textContent = `updated ${new Date(state.now * 1000).toLocaleTimeString()}`;
  } catch (err) {
    dash.errors++;
    document.getElementById("updated").textContent = `cannot reach the control plane: ${err.message}`;
  } finally {
    clearTimeout(dash.timer);
    dash.timer = setTimeout(poll, REFRESH_MS);
  }
}

// Asks for the admin token in a dialog (kept for this tab only); resolves null on cancel.
function askToken() {
  const saved = sessionStorage.getItem(TOKEN_KEY);
  if (saved) return Promise.resolve(saved);
  const dialog = document.getElementById("token-dialog"), input = document.getElementById("token-input");
  input.value = "";
  return new Promise((resolve) => {
    const done = (value) => { dialog.close(); cleanup(); resolve(value); };
    const onSubmit = (ev) => { ev.preventDefault(); if (input.value) { sessionStorage.setItem(TOKEN_KEY, input.value); done(input.value); } };
    const onCancel = () => done(null);
    const form = document.getElementById("token-form"), cancel = document.getElementById("token-cancel");
    const cleanup = () => { form.removeEventListener("submit", onSubmit); cancel.removeEventListener("click", onCancel); };
    form.addEventListener("submit", onSubmit);
    cancel.addEventListener("click", onCancel);
    dialog.showModal();
    input.focus();
  });
}

async function scale(pool, value) {
  const status = document.getElementById("scale-status");
  const replicas = Number(value);
  if (!Number.isInteger(replicas) || replicas < 0 || replicas > 1000) {
    status.textContent = `replicas must be a whole number from 0 to 1000, not "${value}"`;
    return;
  }
  const token = await askToken();
  if (!token) { status.textContent = "scaling cancelled"; return; }
  const resp = await fetch(`/admin/pools/${encodeURIComponent(pool)}`, {
    method: "PUT", headers: { "Content-Type": "application/json", Authorization: `Bearer ${token}` },
    body: JSON.stringify({ replicas }) });
  if (resp.status === 401) sessionStorage.removeItem(TOKEN_KEY);
  let detail = "";
  try { const body = await resp.json(); detail = body.detail || (body.error && body.error.message) || ""; } catch (e) { detail = ""; }
  status.textContent = resp.ok ? `${pool}: target set to ${replicas} replicas; the pool manager reconciles within a few seconds`
    : `scaling ${pool} failed: HTTP ${resp.status} ${detail}`;
  status.dataset.result = resp.ok ? "ok" : "error";
}

// the window buttons: 5 min, 1 h, 6 h; the next poll (started at once) draws the new window
for (const button of document.querySelectorAll("#window button")) {
  button.addEventListener("click", () => {
    dash.window = Number(button.dataset.window);
    for (const b of document.querySelectorAll("#window button")) b.setAttribute("aria-pressed", String(b === button));
    clearTimeout(dash.timer);
    poll();
  });
}

poll();
