// miles dashboard: polls the JSON routes every 2 s and draws SVG charts. No library, so the page
// works on a machine with no network.
"use strict";
const COLORS = ["#2563eb", "#ea580c", "#16a34a", "#9333ea", "#dc2626", "#0891b2", "#ca8a04", "#db2777"];
const SPAN_COLORS = {rollout: "#60a5fa", generate: "#2563eb", reward: "#16a34a", filter: "#a3e635",
  train: "#ea580c", weight_sync: "#9333ea", eval: "#eab308"};
const FIRST = ["reward_mean", "eval_accuracy", "eval_reward_mean", "loss", "pg_loss", "kl", "clip_fraction",
  "staleness_mean", "staleness_max", "train_rollout_logprob_abs_diff", "mfu", "tokens_per_gpu_per_s",
  "rollout_tokens_per_s", "step_seconds", "rollout_seconds", "train_seconds"];
const state = {runs: [], metrics: {}, selected: 0, tlStep: null, timelines: [], samples: null, sampleStep: null};
const $ = (id) => document.getElementById(id);
const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
const fmt = (v) => v == null ? "–" : Math.abs(v) >= 1e4 || (Math.abs(v) < 1e-3 && v !== 0) ? v.toExponential(2)
  : (+v.toPrecision(4)).toString();

async function getJSON(url) {
  const r = await fetch(url, {credentials: "same-origin"});
  if (!r.ok) throw new Error(url + ": " + r.status);
  return r.json();
}

// --- runs and their metric rows (only new rows are fetched) -------------------------------------
async function pollRuns() {
  state.runs = await getJSON("/api/runs");
  for (const run of state.runs) {
    const m = state.metrics[run.id] || (state.metrics[run.id] = {generation: -1, rows: []});
    const d = await getJSON(`/api/runs/${run.id}/metrics?generation=${m.generation}&after=${m.rows.length}`);
    if (d.generation !== m.generation || d.start === 0) m.rows = [];
    m.generation = d.generation;
    m.rows = m.rows.concat(d.rows);
  }
  drawRuns();
  drawCharts();
}

function drawRuns() {
  $("runs").innerHTML = state.runs.map((r, i) => `<div class="run" style="--c:${COLORS[i % COLORS.length]}"
    data-run="${i}"><b>${esc(r.name)}</b> <span class="state ${r.state}">${r.state}</span>
    <div>step ${r.last_step ?? "–"}${r.total_steps ? " / " + r.total_steps : ""}
    ${r.mode ? " · " + esc(r.mode) : ""}</div>
    <div class="muted">${esc(Object.entries(r.components || {}).map(([k, v]) => k + ": " + v).join(", "))}</div>
    <div class="muted">${esc(r.folder)}</div>
    ${r.problems.length ? `<ul class="problems">${r.problems.map((p) => `<li>${esc(p)}</li>`).join("")}</ul>` : ""}
    </div>`).join("");
  const sel = $("run-select");
  if (sel.options.length !== state.runs.length) {
    sel.innerHTML = state.runs.map((r, i) => `<option value="${i}">${esc(r.name)}</option>`).join("");
    sel.value = state.selected;
  }
}

function numericKeys() {
  const seen = new Set();
  for (const m of Object.values(state.metrics))
    for (const row of m.rows) for (const [k, v] of Object.entries(row)) if (typeof v === "number" && k !== "step") seen.add(k);
  const rest = [...seen].filter((k) => !FIRST.includes(k)).sort();
  return FIRST.filter((k) => seen.has(k)).concat(rest);
}

function latestPerStep(rows) {  // a resumed run rewrites steps: the last row of a step wins
  const by = new Map();
  for (const r of rows) if (typeof r.step === "number") by.set(r.step, r);
  return [...by.values()].sort((a, b) => a.step - b.step);
}

function lineChart(id, title, series, opts = {}) {
  // series: [{color, xs, ys}] -> an SVG chart with min/max labels
  const W = opts.w || 300, H = opts.h || 150, L = 44, B = 18, T = 16;
  const xs = series.flatMap((s) => s.xs), ys = series.flatMap((s) => s.ys).filter((v) => v != null && isFinite(v));
  const points = series.map((s) => s.ys.filter((v) => v != null).length);
  if (!ys.length) return "";
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y1 += Math.abs(y0) * 0.1 || 1; y0 -= Math.abs(y0) * 0.1 || 1; }
  const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - 6), sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const paths = series.map((s) => {
    const pts = s.xs.map((x, i) => [x, s.ys[i]]).filter(([, y]) => y != null && isFinite(y));
    const d = pts.map(([x, y], i) => `${i ? "L" : "M"}${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join("");
    const dot = pts.length === 1 ? `<circle cx="${sx(pts[0][0])}" cy="${sy(pts[0][1])}" r="3" fill="${s.color}"/>` : "";
    return `<path d="${d}" fill="none" stroke="${s.color}" stroke-width="2"/>${dot}`;
  }).join("");
  const last = series.map((s) => s.ys.filter((v) => v != null).slice(-1)[0]).filter((v) => v != null);
  return `<div class="chart" id="${id}" data-points="${points.join(",")}"><div class="t">${esc(title)}
    <span class="muted">${last.map(fmt).join(" · ")}</span></div>
    <svg width="${W}" height="${H}"><rect x="${L}" y="${T}" width="${W - L - 6}" height="${H - T - B}" fill="#fafafa"/>
    <text x="2" y="${T + 8}" font-size="10">${fmt(y1)}</text><text x="2" y="${H - B}" font-size="10">${fmt(y0)}</text>
    <text x="${L}" y="${H - 4}" font-size="10">${fmt(x0)}</text>
    <text x="${W - 6}" y="${H - 4}" font-size="10" text-anchor="end">${fmt(x1)}${opts.xunit || ""}</text>${paths}</svg></div>`;
}

function drawCharts() {
  const filter = $("filter").value.trim().toLowerCase();
  const keys = numericKeys().filter((k) => !filter || k.toLowerCase().includes(filter));
  const html = keys.map((k) => lineChart("chart-" + k, k, state.runs.map((r, i) => {
    const rows = latestPerStep((state.metrics[r.id] || {rows: []}).rows).filter((row) => k in row);
    return {color: COLORS[i % COLORS.length], xs: rows.map((row) => row.step), ys: rows.map((row) => row[k])};
  }))).join("");
  $("charts").innerHTML = html || '<span class="muted">no metrics yet</span>';
}

// --- timeline of one step ------------------------------------------------------------------------
function lanesOf(tl) {
  // each lane's spans, nested ones (generate inside rollout) one row further down
  const lanes = new Map();
  for (const [name, lane, a, b, attrs] of tl.spans) {
    if (!lanes.has(lane)) lanes.set(lane, []);
    lanes.get(lane).push({name, a, b, attrs: attrs || {}});
  }
  const rows = [];
  for (const [lane, spans] of lanes) {
    spans.sort((p, q) => p.a - q.a || (q.b - q.a) - (p.b - p.a));
    const depthRows = [];
    for (const s of spans) {
      let d = 0;
      while (depthRows[d] && depthRows[d].some((o) => o.a < s.b - 1e-6 && s.a < o.b - 1e-6 && !(o.a <= s.a && s.b <= o.b))) d++;
      const parents = spans.filter((o) => o !== s && o.a <= s.a && s.b <= o.b && (o.b - o.a) > (s.b - s.a));
      d = Math.max(d, parents.length);
      (depthRows[d] = depthRows[d] || []).push(s);
    }
    depthRows.forEach((r, d) => rows.push({label: d ? "" : lane, spans: r || []}));
  }
  return rows;
}

function drawTimeline() {
  const tls = state.timelines;
  if (!tls.length) { $("tl-chart").innerHTML = '<span class="muted">no timeline recorded</span>'; $("tl-recent").innerHTML = ""; return; }
  let idx = tls.findIndex((t) => t.step === state.tlStep);
  if ($("tl-follow").checked || idx < 0) idx = tls.length - 1;
  const tl = tls[idx];
  state.tlStep = tl.step;
  $("tl-step").textContent = ` step ${tl.step} (${(tl.end - tl.start).toFixed(3)} s) `;
  const rows = lanesOf(tl), W = 900, L = 130, RH = 22;
  const t0 = Math.min(tl.start, ...tl.spans.map((s) => s[2])), t1 = Math.max(tl.end, ...tl.spans.map((s) => s[3]));
  const sx = (t) => L + (t - t0) / Math.max(t1 - t0, 1e-6) * (W - L - 10);
  const totals = {};
  let body = "";
  rows.forEach((r, i) => {
    body += `<text x="4" y="${i * RH + 15}" font-size="11">${esc(r.label)}</text>`;
    for (const s of r.spans) {
      totals[s.name] = (totals[s.name] || 0) + (s.b - s.a);
      const x = sx(s.a), w = Math.max(sx(s.b) - x, 1.5), c = SPAN_COLORS[s.name] || "#94a3b8";
      const tip = `${s.name}: ${(s.b - s.a).toFixed(4)} s` + (s.attrs.tokens ? `, ${s.attrs.tokens} tokens` : "");
      body += `<rect class="span" data-name="${esc(s.name)}" x="${x}" y="${i * RH + 3}" width="${w}" height="${RH - 6}"
        fill="${c}"><title>${esc(tip)}</title></rect>`;
      if (w > 50) body += `<text x="${x + 3}" y="${i * RH + 15}" font-size="10" fill="#fff">${esc(s.name)}</text>`;
    }
  });
  const H = rows.length * RH + 20;
  body += `<text x="${L}" y="${H - 4}" font-size="10">0 s</text><text x="${W - 10}" y="${H - 4}" font-size="10"
    text-anchor="end">${(t1 - t0).toFixed(3)} s</text>`;
  $("tl-chart").innerHTML = `<svg width="${W}" height="${H}">${body}</svg><div class="legend">` +
    Object.entries(totals).map(([n, v]) => `<span><i class="sw" style="background:${SPAN_COLORS[n] || "#94a3b8"}"></i>${esc(n)}
    ${v.toFixed(3)} s</span>`).join("") + "</div>";
  drawRecent(tls);
}

function drawRecent(tls) {
  // the trainer lane's top-level spans of the last steps, stacked: what bounds the step
  const top = ["rollout", "train", "weight_sync", "eval"], W = 900, L = 60, RH = 12;
  const recent = tls.slice(-20), longest = Math.max(...recent.map((t) => t.end - t.start), 1e-6);
  let body = "";
  recent.forEach((t, i) => {
    let x = L;
    body += `<text x="2" y="${i * RH + 10}" font-size="9">step ${t.step}</text>`;
    for (const n of top) {
      const d = t.spans.filter((s) => s[0] === n && s[1] === "trainer").reduce((a, s) => a + s[3] - s[2], 0);
      const w = d / longest * (W - L - 10);
      if (w > 0) body += `<rect x="${x}" y="${i * RH + 2}" width="${w}" height="${RH - 3}" fill="${SPAN_COLORS[n]}"><title>${n} ${d.toFixed(3)} s</title></rect>`;
      x += w;
    }
  });
  $("tl-recent").innerHTML = `<svg width="${W}" height="${recent.length * RH + 4}">${body}</svg>`;
}

// --- samples ---------------------------------------------------------------------------------------
function mismatch(s, i) {
  const r = s.rollout_logprobs?.[i], t = s.train_logprobs?.[i];
  return r == null || t == null ? null : Math.abs(r - t);
}

function drawSamples() {
  const d = state.samples;
  if (!d || !d.samples.length) { $("s-list").innerHTML = '<span class="muted">no samples recorded</span>'; return; }
  const sel = $("s-step");
  const opts = d.steps.map((s) => `<option value="${s}">${s}</option>`).join("");
  if (sel.innerHTML !== opts) sel.innerHTML = opts;
  sel.value = d.step;
  const num = (id) => $(id).value.trim() === "" ? null : +$(id).value;
  const [rmin, rmax, lmin] = [num("s-rmin"), num("s-rmax"), num("s-len")];
  let list = d.samples.map((s) => ({...s, maxd: Math.max(0, ...s.token_ids.map((_, i) => mismatch(s, i) ?? 0))}))
    .filter((s) => (rmin == null || s.reward >= rmin) && (rmax == null || s.reward <= rmax) && (lmin == null || s.token_ids.length >= lmin));
  const key = $("s-sort").value;
  list.sort((a, b) => key === "mismatch" ? b.maxd - a.maxd : key === "reward" ? b.reward - a.reward
    : key === "length" ? b.token_ids.length - a.token_ids.length : a.index - b.index);
  $("s-list").innerHTML = list.map((s) => `<div class="sample" data-index="${s.index}">
    <b>#${s.index}</b> reward <b>${fmt(s.reward)}</b> · advantage ${fmt(s.advantage)} · ${s.token_ids.length} tokens ·
    max |Δ log-prob| ${fmt(s.maxd)} · ${esc(s.status)} · weights v${s.weight_version}
    <div class="muted">prompt</div><pre>${esc(s.prompt)}</pre>
    <div class="muted">response${s.train_logprobs ? "" : " (no training log-probs: not trained on rank 0)"}</div>
    <div class="tokens">${s.token_ids.map((id, i) => tokenHTML(s, id, i)).join("")}</div></div>`).join("")
    || '<span class="muted">no sample passes the filters</span>';
}

function tokenHTML(s, id, i) {
  const text = s.tokens ? s.tokens[i] : `[${id}]`, m = mismatch(s, i), tool = s.loss_mask && s.loss_mask[i] === 0;
  // log scale: |Δ| 1e-4 is white, 1 nat and more full red
  const a = m == null ? 0 : Math.min(1, Math.max(0.08, (Math.log10(Math.max(m, 1e-6)) + 4) / 4));
  const style = tool || m == null ? "" : `background:rgba(220,38,38,${a.toFixed(2)});${a > 0.6 ? "color:#fff" : ""}`;
  const tip = `token ${JSON.stringify(text)} (id ${id}) rollout ${fmt(s.rollout_logprobs?.[i])} training ${fmt(s.train_logprobs?.[i])}`;
  return `<span class="tok${tool ? " tool" : m == null ? " notrain" : ""}" style="${style}" title="${esc(tip)}">${esc(text)}</span>`;
}

// --- engines and devices ----------------------------------------------------------------------------
function drawDevices(rows) {
  if (!rows.length) { $("devices-body").innerHTML = '<span class="muted">no device readings recorded</span>'; $("engines-body").innerHTML = ""; return; }
  const t0 = rows[0].time, xs = rows.map((r) => r.time - t0), opt = {xunit: " s"};
  let html = lineChart("dev-cpu", "process CPU %", [{color: COLORS[0], xs, ys: rows.map((r) => r.cpu_percent)}], opt)
    + lineChart("dev-rss", "resident memory (GiB)", [{color: COLORS[1], xs, ys: rows.map((r) => r.rss_bytes / 2 ** 30)}], opt);
  const gpus = Math.max(0, ...rows.map((r) => (r.gpus || []).length));
  for (let g = 0; g < gpus; g++) {
    html += lineChart(`dev-gpu${g}-util`, `GPU ${g} utilisation %`, [{color: COLORS[2], xs, ys: rows.map((r) => r.gpus?.[g]?.util_percent ?? null)}], opt)
      + lineChart(`dev-gpu${g}-mem`, `GPU ${g} memory (GiB)`, [{color: COLORS[3], xs, ys: rows.map((r) => (r.gpus?.[g]?.mem_used_bytes ?? NaN) / 2 ** 30)}], opt);
  }
  $("devices-body").innerHTML = html;
  const withEngines = rows.filter((r) => r.engines && r.engines.length);
  const m = latestPerStep((state.metrics[state.selected] || {rows: []}).rows);
  const rate = lineChart("eng-rate", "rollout tokens/s (while generating)", [{color: COLORS[0], xs: m.filter((r) => "rollout_tokens_per_s" in r).map((r) => r.step),
    ys: m.filter((r) => "rollout_tokens_per_s" in r).map((r) => r.rollout_tokens_per_s)}]);
  const failed = rows.filter((r) => r.engines_error).slice(-1)[0];
  const error = failed ? `<div class="problems">engine readings failed: ${esc(failed.engines_error)}</div>` : "";
  if (!withEngines.length) {
    $("engines-body").innerHTML = `<div class="grid">${rate}</div>${error}<span class="muted">this run's engine reports no load readings
      (running/queued requests, KV cache): miles.protocols.EngineStats</span>`;
    return;
  }
  const names = [...new Set(withEngines.flatMap((r) => r.engines.map(engineName)))];
  $("engines-body").innerHTML = `<div class="grid">${rate}${engineCharts(withEngines, names, t0)}</div>${error}` +
    engineTable(withEngines.slice(-1)[0].engines, names);
}

// per engine (server), over time: tokens/s, running and queued sequences, KV cache use, acceptance
const ENGINE_CHARTS = [["tokens", "tokens_per_s", "engine tokens/s", 1], ["running", "running", "running sequences", 1],
  ["queued", "queued", "queued sequences", 1], ["kv", "kv_cache_usage", "KV cache use %", 100],
  ["spec", "spec_accept_rate", "speculative acceptance %", 100]];
const engineName = (e, i) => e.name ?? "engine " + i;

function engineCharts(rows, names, t0) {
  const xs = rows.map((r) => r.time - t0);
  return ENGINE_CHARTS.map(([id, key, title, scale]) => lineChart("eng-" + id, title, names.map((n, j) => ({
    color: COLORS[j % COLORS.length], xs, ys: rows.map((r) => {
      const e = r.engines.find((x, i) => engineName(x, i) === n);
      return e && typeof e[key] === "number" ? e[key] * scale : null;
    })})), {xunit: " s"})).join("");
}

function engineTable(last, names) {
  // the latest reading of each engine (in its charts' colour): the known columns first, then the rest
  const known = ["name", "tokens_per_s", "running", "queued", "kv_cache_usage", "spec_accept_rate", "generated_tokens"];
  const keys = [...new Set([...known.filter((k) => last.some((e) => k in e)), ...last.flatMap((e) => Object.keys(e))])];
  const cell = (k, v) => typeof v !== "number" ? esc(v ?? "") : k === "kv_cache_usage" || k === "spec_accept_rate"
    ? (100 * v).toFixed(1) + " %" : esc(fmt(v));
  return `<table id="eng-table"><tr>${keys.map((k) => `<th>${esc(k)}</th>`).join("")}</tr>` +
    last.map((e, i) => `<tr>${keys.map((k) => k !== "name" ? `<td>${cell(k, e[k])}</td>` : `<td><i class="sw"
      style="background:${COLORS[names.indexOf(engineName(e, i)) % COLORS.length]}"></i>${esc(engineName(e, i))}</td>`).join("")}</tr>`).join("") + "</table>";
}

// --- the selected run's details ---------------------------------------------------------------------
async function pollDetails() {
  const id = state.selected;
  if (!state.runs[id]) return;
  state.timelines = await getJSON(`/api/runs/${id}/timeline?last=50`);
  drawTimeline();
  const q = state.sampleStep == null ? "" : `?step=${state.sampleStep}`;
  state.samples = await getJSON(`/api/runs/${id}/samples${q}`);
  drawSamples();
  drawDevices(await getJSON(`/api/runs/${id}/devices?last=600`));
}

async function tick() {
  try {
    await pollRuns();
    await pollDetails();
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.polls = (+(document.body.dataset.polls || 0) + 1).toString();
  } catch (e) {
    $("updated").textContent = "cannot reach the dashboard server: " + e.message;
  }
  setTimeout(tick, 2000);
}

$("filter").addEventListener("input", drawCharts);
$("run-select").addEventListener("change", (e) => { state.selected = +e.target.value; state.sampleStep = null; pollDetails(); });
$("tl-prev").addEventListener("click", () => { $("tl-follow").checked = false; const i = state.timelines.findIndex((t) => t.step === state.tlStep); if (i > 0) state.tlStep = state.timelines[i - 1].step; drawTimeline(); });
$("tl-next").addEventListener("click", () => { const i = state.timelines.findIndex((t) => t.step === state.tlStep); if (i >= 0 && i < state.timelines.length - 1) state.tlStep = state.timelines[i + 1].step; drawTimeline(); });
$("s-step").addEventListener("change", (e) => { state.sampleStep = +e.target.value; pollDetails(); });
for (const id of ["s-rmin", "s-rmax", "s-len", "s-sort"]) $(id).addEventListener("input", drawSamples);
tick();
