// Ramjet dashboard. Polls GET admin/dashboard/state once a second while the tab is visible
// (ramjet/balancer/edge/dashboard.py says what it answers); no library, no external resource.
"use strict";

const API = "admin/";   // relative to /dashboard: a path prefix in front of the operator listener still works
const POLL_MS = 1000;
const SHOWN = 30;       // recent requests on the page
let key = null;         // the operator's key: in memory only, never in a URL, a cookie or the browser's storage
let cursor = 0;         // the tick of the last answer: the next poll asks only for what is newer
let series = [];        // samples, oldest first
let recent = [];        // recent requests, newest first
let timer = null, polling = false, needKey = false, routesShown = false;

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c !== null && c !== undefined && c !== false) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

const nf = new Intl.NumberFormat("en-US", {maximumFractionDigits: 1});
const cf = new Intl.NumberFormat("en-US", {notation: "compact", maximumFractionDigits: 1});
const num = (x) => (x === null || x === undefined ? "—" : nf.format(x));
const compact = (x) => (x === null || x === undefined ? "—" : cf.format(x));
const pct = (x) => (x === null || x === undefined ? "—" : (100 * x).toFixed(1) + "%");
const secs = (s) => (s === null || s === undefined ? "—" : s < 1 ? Math.round(s * 1000) + " ms" : s.toFixed(2) + " s");
const badge = (text, cls) => el("span", {class: "badge " + (cls || text)}, text);
const sub = (...text) => el("span", {class: "sub"}, ...text);

// --- talking to the operator API ------------------------------------------------------------------
class KeyNeeded extends Error {}

async function api(path, options = {}) {
  const headers = Object.assign({"Accept": "application/json"}, options.headers || {});
  if (key) headers["Authorization"] = "Bearer " + key;
  const r = await fetch(API + path, Object.assign({}, options, {headers, cache: "no-store", credentials: "omit"}));
  if (r.status === 401) {
    askKey(key ? "That key was refused." : "");
    throw new KeyNeeded("an admin key is needed");
  }
  let body = null;
  try { body = await r.json(); } catch (e) { body = null; }
  if (!r.ok) throw new Error(`HTTP ${r.status}: ${errorText(body)}`);
  return body;
}

function errorText(body) {
  if (!body) return "no JSON answer";
  if (body.error && body.error.message) return body.error.message;
  if (typeof body.detail === "string") return body.detail;
  if (Array.isArray(body.detail)) return body.detail.map((d) => d.msg).join("; ");
  return JSON.stringify(body);
}

function askKey(why) {
  needKey = true;
  key = null;
  $("key-form").hidden = false;
  $("key-error").textContent = why;
  $("key-input").focus();
  setConn("an admin key is needed", true);
}

function setConn(text, bad) {
  $("conn").textContent = text;
  $("conn").className = bad ? "error" : "muted";
}

async function poll() {
  if (polling) return;
  polling = true;
  clearTimeout(timer);
  timer = null;
  try {
    const s = await api("dashboard/state?after=" + cursor);
    if (s.tick < cursor) { series = []; recent = []; }  // the balancer restarted: its history did too
    cursor = s.tick;
    series = series.concat(s.samples).slice(-s.history);
    recent = s.requests.concat(recent).slice(0, SHOWN);
    render(s);
    setConn("updated " + new Date().toLocaleTimeString(), false);
  } catch (e) {
    if (!(e instanceof KeyNeeded)) setConn("no answer: " + e.message, true);
  } finally {
    polling = false;
  }
  if (!document.hidden && !needKey) timer = setTimeout(poll, POLL_MS);  // nobody looking: no polls
}

// --- rendering ----------------------------------------------------------------------------------------
function render(s) {
  $("status").textContent = s.status;
  $("status").className = "badge " + s.status;
  const precise = s.precise === null ? "approximate routing (precise mode off)"
    : `precise on ${s.precise} of ${s.total}`;
  $("overview").textContent = `${s.serving} of ${s.total} serving · ${s.drained} drained · policy ${s.policy} · ${precise}`;
  if (!routesShown) {
    $("explain-path").replaceChildren(...s.routes.map((r) => el("option", {}, r)));
    routesShown = true;
  }
  renderCards(s);
  renderCharts(s.history);
  renderReplicas(s.replicas);
  renderRequests();
}

function renderCards(s) {
  const lastN = series.slice(-10), latest = series[series.length - 1] || {};
  const sum = (rows, k) => rows.reduce((a, x) => a + x[k], 0);
  const fenced = s.replicas.filter((r) => r.state === "fenced").length;
  const minutes = Math.round(s.history / 60);
  const card = (value, label, bad, name) => el("div", {class: "card" + (bad ? " bad" : ""), "data-card": name},
    el("div", {class: "v"}, value), el("div", {class: "l"}, label));
  $("cards").replaceChildren(
    card(lastN.length ? num(sum(lastN, "requests") / lastN.length) : "—", "requests/s, last 10 s", false, "rps"),
    card(pct(latest.cache_ratio), `cache ratio, ${s.window} s`, false, "cache"),
    card(secs(latest.ttft_p50), `TTFT p50, ${s.window} s`, false, "p50"),
    card(secs(latest.ttft_p99), `TTFT p99, ${s.window} s`, false, "p99"),
    card(num(s.replicas.reduce((a, r) => a + r.in_flight, 0)), "in flight", false, "in-flight"),
    card(num(s.totals.sessions), "sessions (10 min)", false, "sessions"),
    card(`${sum(series, "failovers")} / ${s.totals.failovers}`, `failovers, ${minutes} min / total`,
      sum(series, "failovers") > 0, "failovers"),
    card(`${fenced} / ${s.totals.fences}`, "fenced now / fences", fenced > 0, "fences"),
    card(`${sum(series, "errors")} / ${s.totals.errors}`, `errors, ${minutes} min / total`,
      sum(series, "errors") > 0, "errors"),
    card(s.precise === null ? "off" : `${s.precise} / ${s.total}`, "event streams trusted",
      s.precise !== null && s.precise < s.total, "streams"),
    card(s.draining ? "draining" : num(s.drained), s.draining ? "shutting down (SIGTERM)" : "drained by the operator",
      s.draining, "drain"));
}

function renderCharts(history) {
  const end = series.length ? series[series.length - 1].t : 0;
  const span = Math.min(history, Math.max(end - (series.length ? series[0].t : end), 10));  // a young balancer: zoomed in
  const rps = series.map((x) => [x.t, x.requests]);
  chart($("chart-rps"), [{cls: "rps", points: rps}], end, span, null, num);
  chart($("chart-cache"), [{cls: "cache", points: series.map((x) => [x.t, x.cache_ratio])}], end, span, 1, pct);
  chart($("chart-ttft"), ["p50", "p90", "p99"].map((p) => ({cls: p, points: series.map((x) => [x.t, x["ttft_" + p]])})),
    end, span, null, secs);
}

function chart(svg, lines, end, history, fixedMax, fmt) {
  const W = 320, H = 96, L = 36, T = 6, B = 14;
  const values = lines.flatMap((l) => l.points.map((p) => p[1])).filter((v) => v !== null && v !== undefined);
  const max = fixedMax || Math.max(...values, 0) * 1.15 || 1;
  const x = (t) => L + (W - L - 2) * (1 - (end - t) / history);
  const y = (v) => T + (H - T - B) * (1 - v / max);
  const ns = "http://www.w3.org/2000/svg";
  const node = (tag, attrs, text) => {
    const e = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const parts = [];
  for (const f of [0, 0.5, 1]) {
    parts.push(node("line", {class: "grid", x1: L, x2: W - 2, y1: y(max * f), y2: y(max * f)}));
    parts.push(node("text", {class: "axis", x: L - 4, y: y(max * f) + 3, "text-anchor": "end"}, fmt(max * f)));
  }
  const ago = history >= 120 ? `−${Math.round(history / 60)} min` : `−${Math.round(history)} s`;
  parts.push(node("text", {class: "axis", x: L, y: H - 2}, ago));
  parts.push(node("text", {class: "axis", x: W - 2, y: H - 2, "text-anchor": "end"}, "now"));
  for (const line of lines) {
    let run = [];
    const flush = () => {
      if (run.length) parts.push(node("polyline", {class: line.cls, points: run.join(" ")}));
      run = [];
    };
    for (const [t, v] of line.points) {
      if (v === null || v === undefined || end - t > history) { flush(); continue; }
      run.push(`${x(t).toFixed(1)},${y(v).toFixed(1)}`);
    }
    flush();
  }
  svg.replaceChildren(...parts);
}

function renderReplicas(replicas) {
  $("replicas").tBodies[0].replaceChildren(...replicas.map((r) => {
    const kv = r.kv;
    const blocks = kv.gpu_blocks !== undefined
      ? [`GPU ${num(kv.gpu_blocks)} · host ${num(kv.host_blocks)}`, sub(`index ${num(kv.index_blocks)}`)]
      : [num(kv.index_blocks), sub("balancer's index")];
    const action = r.drained
      ? el("button", {class: "undrain", type: "button", onclick: () => setDrain(r, false)}, "Undrain")
      : el("button", {class: "drain", type: "button", onclick: () => setDrain(r, true)}, "Drain");
    return el("tr", {"data-upstream": r.upstream, class: [r.state, r.drained ? "drained" : ""].join(" ")},
      el("td", {}, `#${r.upstream}`, sub(`node ${r.node} · rank ${r.rank ?? "—"}`)),
      el("td", {class: "state"}, badge(r.state), r.drained ? [" ", badge("drained")] : null,
        r.reason ? sub(r.reason) : null),
      el("td", {class: "mode"}, badge(r.mode), sub(r.mode_reason || "engine's KV events")),
      el("td", {class: "n in-flight"}, num(r.in_flight)),
      el("td", {class: "n"}, `${num(r.load_units)} + ${num(r.engine_load_units)}`),
      el("td", {class: "n"}, ...blocks),
      el("td", {class: "n sessions"}, num(r.sessions)),
      el("td", {class: "n requests"}, el("span", {class: "v"}, num(r.requests)), sub(`${num(r.ring_requests)} lately`)),
      el("td", {class: "n"}, compact(r.prompt_tokens), sub(`${compact(r.cached_tokens)} cached`)),
      el("td", {class: "n cache"}, pct(r.cache_ratio)),
      el("td", {}, action));
  }));
}

async function setDrain(r, drain) {
  const verb = drain ? "Drain" : "Undrain";
  const what = drain
    ? "It takes no new requests; what it runs finishes. Its sessions move once to their next-best replica."
    : "It returns to rotation; new sessions may land on it again.";
  if (!confirm(`${verb} replica ${r.upstream} (node ${r.node}, rank ${r.rank ?? "—"})?\n\n${what}`)) return;
  try {
    await api(`replicas/${r.upstream}/${drain ? "drain" : "undrain"}`, {method: "POST"});
  } catch (e) {
    if (!(e instanceof KeyNeeded)) alert(`${verb} failed: ${e.message}`);
    return;
  }
  poll();
}

function terms(t, alpha) {
  return t ? `#${t.upstream}: ${num(t.credit)} − ${num(alpha)}×${num(t.load_units)} = ${num(t.score)}` : "—";
}

function renderRequests() {
  $("requests").tBodies[0].replaceChildren(...recent.map((q) => {
    const time = new Date(q.ts * 1000).toLocaleTimeString();
    const answer = [`${q.status ?? "—"} ${q.outcome}`, sub(`TTFB ${q.ttfb_ms === null ? "—" : num(q.ttfb_ms) + " ms"}`)];
    if (!q.routed) {
      return el("tr", {"data-id": q.id}, el("td", {}, time), el("td", {class: "mono"}, q.id), el("td", {}, q.route),
        el("td", {}, q.upstream === null ? "—" : `#${q.upstream}`), el("td", {}, "—"), el("td", {}, "not routed"),
        el("td", {}, "—"), el("td", {}, "—"), el("td", {}, ...answer), el("td", {}));
    }
    const p = q.pick, depth = [`${num(p.overlap_blocks)} / ${num(q.blocks)} blocks`];
    if (p.held_tokens !== null) depth.push(sub(`engine: ${num(p.held_tokens)} / ${num(q.engine_prompt_tokens)} tokens`));
    if (q.prompt_tokens !== undefined) depth.push(sub(`${num(q.cached_tokens)} / ${num(q.prompt_tokens)} cached`));
    const replica = q.upstream === null ? "none" : `#${q.upstream}`;
    return el("tr", {"data-id": q.id},
      el("td", {}, time), el("td", {class: "mono"}, q.id), el("td", {}, q.route),
      el("td", {class: "replica"}, replica, q.upstream !== p.upstream ? sub(`picked #${p.upstream}`) : null),
      el("td", {}, q.runner_up ? `#${q.runner_up.upstream}` : "—"),
      el("td", {}, q.reason, q.new_session ? sub("new session") : null,
        q.failovers ? sub(`${q.failovers} failover${q.failovers > 1 ? "s" : ""}`) : null),
      el("td", {class: "mono"}, terms(p, q.alpha), sub(terms(q.runner_up, q.alpha))),
      el("td", {}, ...depth),
      el("td", {}, ...answer),
      el("td", {}, el("button", {class: "explain", type: "button", onclick: () => explainRecent(q.id)}, "Explain")));
  }));
}

// --- explanations ----------------------------------------------------------------------------------------
async function explainRecent(id) {
  let e;
  try {
    e = await api("dashboard/requests/" + encodeURIComponent(id));
  } catch (err) {
    if (!(err instanceof KeyNeeded)) alert(`Explain failed: ${err.message}`);
    return;
  }
  showExplanation(`Request ${id}: ${e.route}, answered by ${e.upstream === null ? "none" : "#" + e.upstream}`, e,
    "The decision as it was made when the request arrived (kept with it; its body is not kept).");
}

function showExplanation(title, e, note) {
  $("explain-title").textContent = title;
  const head = ["Replica", "Routable", "Overlap blocks", "Held by", "Covered bytes", "Credit", "Load", "Score",
    "Reserves"].map((h) => el("th", {}, h));
  const rows = e.replicas.map((r) => el("tr", {class: r.upstream === e.pick ? "pick" : null},
    el("td", {}, `#${r.upstream}`, sub(`node ${r.node} · rank ${r.rank ?? "—"}`)), el("td", {}, r.routable ? "yes" : "no"),
    el("td", {class: "n"}, num(r.overlap_blocks)), el("td", {}, r.held_by), el("td", {class: "n"}, num(r.covered_bytes)),
    el("td", {class: "n"}, num(r.credit)), el("td", {class: "n"}, num(r.load_units)), el("td", {class: "n"}, num(r.score)),
    el("td", {class: "n"}, num(r.reserves_units))));
  $("explain-content").replaceChildren(
    el("p", {class: "muted"}, note),
    el("p", {}, `Pick #${e.pick} (${e.reason}); order ${e.order.map((o) => "#" + o).join(" > ")}.`),
    el("p", {}, `Policy ${e.policy}: ${e.policy_rule.replace(/\.+$/, "")}. Score = credit − α × load, α = ${num(e.alpha)}. `,
      `${num(e.blocks)} blocks, ${num(e.prompt_bytes)} prompt bytes${e.new_session ? "; placed as a new session" : ""}.`),
    el("table", {id: "explain-table"}, el("thead", {}, el("tr", {}, ...head)), el("tbody", {}, ...rows)));
  if (!$("explain").open) $("explain").showModal();
}

async function explainBody(ev) {
  ev.preventDefault();
  const path = $("explain-path").value, text = $("explain-text").value;
  let e;
  try {
    e = await api("explain?path=" + encodeURIComponent(path),
      {method: "POST", headers: {"Content-Type": "application/json"}, body: text});
  } catch (err) {
    if (!(err instanceof KeyNeeded)) alert(`Explain failed: ${err.message}`);
    return;
  }
  showExplanation(`How ${path} with this body would be routed now`, e, "Nothing was forwarded and nothing changed.");
}

// --- start ----------------------------------------------------------------------------------------------
$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  key = $("key-input").value.trim() || null;
  $("key-input").value = "";
  $("key-form").hidden = true;
  needKey = false;
  poll();
});
$("key-button").addEventListener("click", () => {
  $("key-form").hidden = !$("key-form").hidden;
  if (!$("key-form").hidden) $("key-input").focus();
});
$("explain-form").addEventListener("submit", explainBody);
document.addEventListener("visibilitychange", () => {
  if (document.hidden) { clearTimeout(timer); timer = null; } else if (!needKey) poll();
});
poll();
