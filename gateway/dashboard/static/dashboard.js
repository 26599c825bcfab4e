// Parrot's dashboard: polls the gateway's JSON API (the same endpoints any client reads) once a second and
// draws the key's sessions, the selected session's DAG and the engines. The API key is asked for on the page,
// kept in this tab's sessionStorage only, and sent as "Authorization: Bearer KEY" (never in a URL).
// Every text from the gateway goes into the DOM as text (values are user content): no innerHTML.
"use strict";

const POLL_MS = 1000;
const KEY_STORAGE = "parrot.dashboard.key";
const SVG = "http://www.w3.org/2000/svg";
const CALL_W = 220, CALL_H = 74, VALUE_W = 170, VALUE_H = 40, GAP_X = 110, GAP_Y = 22, PAD = 24;

const view = { key: sessionStorage.getItem(KEY_STORAGE), selected: location.hash.slice(1) || null,
               picked: null, graph: null, timer: null, engineNames: new Map() };

class ApiError extends Error {
  constructor(status, message) { super(`${status}: ${message}`); this.status = status; }
}

async function api(path) {
  const headers = view.key ? { Authorization: `Bearer ${view.key}` } : {};
  const response = await fetch(path, { headers, cache: "no-store" });
  if (!response.ok) {
    let message = response.statusText;
    try { message = (await response.json()).error.message; } catch (_) { /* not an error object */ }
    throw new ApiError(response.status, message);
  }
  return response.json();
}

// ------------------------------------------------------------------ small DOM helpers

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  for (const child of children) node.append(child);
  return node;
}

function svg(tag, attrs = {}, parent = null) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  if (parent) parent.append(node);
  return node;
}

function text(parent, x, y, content, cls) {
  const node = svg("text", { x, y, class: cls || "" }, parent);
  node.textContent = content;
  return node;
}

const clip = (s, n) => (s.length > n ? s.slice(0, n - 1) + "…" : s);
const short = (id) => (id ? clip(id, 14) : "");
const seconds = (s) => (s < 10 ? s.toFixed(2) : s < 100 ? s.toFixed(1) : s.toFixed(0)) + " s";
const clock = (t) => (t ? new Date(t * 1000).toLocaleTimeString() : "–");

function setStatus(message, error = false) {
  const status = document.getElementById("status");
  status.textContent = message;
  status.classList.toggle("error", error);
}

// ------------------------------------------------------------------ sessions

function renderSessions(list) {
  const ul = document.getElementById("sessions");
  ul.replaceChildren();
  document.getElementById("sessions-empty").hidden = list.length > 0;
  if (!view.selected || !list.some((s) => s.id === view.selected)) {
    const busy = list.find((s) => s.pending_calls > 0) || list.find((s) => !s.default) || list[0];
    select(busy ? busy.id : null);
  }
  for (const s of list) {
    const meta = `${s.pending_calls} pending · ${s.finished_calls} finished · ${s.variables} variables`;
    const li = el("li", { "data-session-id": s.id },
      el("div", { class: "sid" }, (s.default ? "default · " : "") + s.id),
      el("div", { class: "meta" }, meta),
      el("div", { class: "meta" }, `created ${clock(s.created)} · key ${s.owner}`));
    if (s.id === view.selected) li.classList.add("selected");
    li.addEventListener("click", () => { select(s.id); poll(); });
    ul.append(li);
  }
}

function select(id) {
  if (id !== view.selected) view.picked = null;
  view.selected = id;
  history.replaceState(null, "", id ? `#${id}` : location.pathname);  // a fragment: never sent to the server
}

// ------------------------------------------------------------------ the DAG: a small layered layout

// Calls are nodes; a variable is an edge from its producer to each consumer. A variable nobody produces
// (a value the client gives) or nobody consumes (a result) is drawn as a small value node at its end.
function buildGraph(graph) {
  const nodes = new Map(), edges = [];
  for (const call of graph.calls) nodes.set(call.id, { id: call.id, kind: "call", call });
  const known = new Set(nodes.keys());
  for (const v of graph.variables) {
    const producer = v.producer && known.has(v.producer) ? v.producer : null;
    const consumers = v.consumers.filter((c) => known.has(c));
    if (!producer || consumers.length === 0) nodes.set(`var:${v.id}`, { id: `var:${v.id}`, kind: "value", variable: v });
    const from = producer || `var:${v.id}`;
    if (consumers.length === 0 && producer) edges.push({ from, to: `var:${v.id}`, variable: v, label: false });
    for (const to of consumers) edges.push({ from, to, variable: v, label: Boolean(producer) });
  }
  return { nodes, edges };
}

function layout({ nodes, edges }) {
  const incoming = new Map([...nodes.keys()].map((id) => [id, []]));
  const outgoing = new Map([...nodes.keys()].map((id) => [id, []]));
  for (const e of edges) { outgoing.get(e.from).push(e.to); incoming.get(e.to).push(e.from); }
  // Layers: the longest path from a source (Kahn's order; a DAG by construction, the gateway refuses cycles).
  const layer = new Map(), pending = new Map([...nodes.keys()].map((id) => [id, incoming.get(id).length]));
  const queue = [...nodes.keys()].filter((id) => pending.get(id) === 0);
  queue.forEach((id) => layer.set(id, 0));
  while (queue.length) {
    const id = queue.shift();
    for (const next of outgoing.get(id)) {
      layer.set(next, Math.max(layer.get(next) || 0, layer.get(id) + 1));
      pending.set(next, pending.get(next) - 1);
      if (pending.get(next) === 0) queue.push(next);
    }
  }
  // Results sit right after their producer, not in the last column.
  for (const [id, node] of nodes) if (node.kind === "value" && incoming.get(id).length) layer.set(id, layer.get(incoming.get(id)[0]) + 1);
  const columns = [];
  for (const id of nodes.keys()) (columns[layer.get(id) || 0] ||= []).push(id);
  // Order within a column: a few barycenter sweeps, so edges cross little.
  const rank = new Map();
  const place = () => columns.forEach((col) => col.forEach((id, i) => rank.set(id, i)));
  place();
  const mean = (ids) => (ids.length ? ids.reduce((a, id) => a + rank.get(id), 0) / ids.length : null);
  for (let sweep = 0; sweep < 4; sweep++) {
    const forward = sweep % 2 === 0;
    const order = forward ? columns.slice(1) : columns.slice(0, -1).reverse();
    for (const col of order) {
      const key = new Map(col.map((id) => [id, mean(forward ? incoming.get(id) : outgoing.get(id)) ?? rank.get(id)]));
      col.sort((a, b) => key.get(a) - key.get(b));
      place();
    }
  }
  const heightOf = (id) => (nodes.get(id).kind === "call" ? CALL_H : VALUE_H);
  const colHeight = (col) => col.reduce((h, id) => h + heightOf(id) + GAP_Y, -GAP_Y);
  const tallest = Math.max(0, ...columns.map(colHeight));
  const pos = new Map();
  let x = PAD;
  for (const col of columns) {
    if (!col) continue;
    const width = Math.max(...col.map((id) => (nodes.get(id).kind === "call" ? CALL_W : VALUE_W)));
    let y = PAD + 18 + (tallest - colHeight(col)) / 2;
    for (const id of col) {
      const w = nodes.get(id).kind === "call" ? CALL_W : VALUE_W;
      pos.set(id, { x: x + (width - w) / 2, y, w, h: heightOf(id) });
      y += heightOf(id) + GAP_Y;
    }
    x += width + GAP_X;
  }
  return { pos, width: x - GAP_X + PAD, height: tallest + 2 * PAD + 18 };
}

function callCaption(call, graph) {
  const outs = Object.keys(call.outputs);
  const names = outs.map((name) => graph.variableById.get(call.outputs[name])?.name || name);
  return clip(names.join(", ") || call.id, 24);
}

function callTiming(call, now) {
  if (call.state === "waiting") return `waiting ${seconds(now - call.submitted)}`;
  if (call.state === "running") return `running ${seconds(now - call.started)}`;
  const ran = call.started ? `ran ${seconds(call.finished - call.started)}` : "never ran";
  return call.started ? `${ran} · waited ${seconds(call.started - call.submitted)}` : ran;
}

function drawGraph(graph) {
  const root = document.getElementById("graph");
  root.replaceChildren();
  const built = buildGraph(graph);
  const { pos, width, height } = layout(built);
  root.setAttribute("width", width);
  root.setAttribute("height", height);
  root.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg("defs", {}, root).append(arrowHead());
  drawGroups(root, graph, pos);
  const edgeLayer = svg("g", { class: "edges" }, root), labelLayer = svg("g", { class: "labels" }, root);
  for (const edge of built.edges) drawEdge(edgeLayer, labelLayer, edge, pos);
  const nodeLayer = svg("g", { class: "nodes" }, root);
  for (const node of built.nodes.values()) {
    if (node.kind === "call") drawCall(nodeLayer, node.call, pos.get(node.id), graph);
    else drawValue(nodeLayer, node.variable, pos.get(node.id));
  }
}

function arrowHead() {
  const marker = svg("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" });
  svg("path", { d: "M 0 0 L 10 5 L 0 10 z", fill: "#52606d" }, marker);
  return marker;
}

function drawGroups(root, graph, pos) {
  const groups = new Map();
  for (const call of graph.calls) if (call.group) (groups.get(call.group) || groups.set(call.group, []).get(call.group)).push(call.id);
  for (const [group, members] of groups) {
    const boxes = members.map((id) => pos.get(id)).filter(Boolean);
    if (!boxes.length) continue;
    const x0 = Math.min(...boxes.map((b) => b.x)) - 10, y0 = Math.min(...boxes.map((b) => b.y)) - 22;
    const x1 = Math.max(...boxes.map((b) => b.x + b.w)) + 10, y1 = Math.max(...boxes.map((b) => b.y + b.h)) + 10;
    const g = svg("g", { class: "group", "data-group": group }, root);
    svg("rect", { x: x0, y: y0, width: x1 - x0, height: y1 - y0, rx: 8, class: "group-box" }, g);
    const consumer = graph.calls.find((c) => c.id === group);
    const label = `task group of ${members.length}${consumer ? ` → ${callCaption(consumer, graph)}` : ""}`;
    text(g, x0 + 8, y0 + 14, clip(label, Math.floor((x1 - x0) / 6.5)), "group-label");
  }
}

function drawEdge(edgeLayer, labelLayer, edge, pos) {
  const a = pos.get(edge.from), b = pos.get(edge.to);
  const x1 = a.x + a.w, y1 = a.y + a.h / 2, x2 = b.x - 2, y2 = b.y + b.h / 2, bend = (x2 - x1) / 2;
  const path = svg("path", { d: `M ${x1} ${y1} C ${x1 + bend} ${y1}, ${x2 - bend} ${y2}, ${x2} ${y2}`,
                             class: `edge${edge.variable.ready ? " ready" : ""}`, "marker-end": "url(#arrow)",
                             "data-variable-id": edge.variable.id }, edgeLayer);
  svg("title", {}, path).textContent = `${edge.variable.name || edge.variable.id}: ${edge.variable.preview ?? "(not ready)"}`;
  if (!edge.label) return;
  // The label sits near the producer's end, where edges from different producers are still apart.
  const t = 0.3, mt = 1 - t;
  const lx = mt ** 3 * x1 + 3 * mt * mt * t * (x1 + bend) + 3 * mt * t * t * (x2 - bend) + t ** 3 * x2;
  const ly = mt ** 3 * y1 + 3 * mt * mt * t * y1 + 3 * mt * t * t * y2 + t ** 3 * y2;
  const v = edge.variable;
  const label = clip(`${v.name || short(v.id)}${v.ready ? ` = "${(v.preview ?? "").replace(/\s+/g, " ")}"` : ""}`, 26);
  const bg = svg("rect", { class: "edge-label-bg", x: lx - 3, y: ly - 11, width: label.length * 6.2 + 6, height: 15, rx: 3 }, labelLayer);
  text(labelLayer, lx, ly, label, "edge-label");
  bg.setAttribute("data-for", v.id);
}

function drawCall(layer, call, p, graph) {
  const g = svg("g", { class: `node call state-${call.state}`, "data-call-id": call.id, "data-state": call.state,
                       transform: `translate(${p.x},${p.y})` }, layer);
  if (view.picked === call.id) g.classList.add("selected");
  svg("rect", { width: p.w, height: p.h, rx: 7 }, g);
  text(g, 10, 18, call.state.toUpperCase(), "badge");
  text(g, p.w - 10, 18, call.criteria, "sub").setAttribute("text-anchor", "end");
  text(g, 10, 36, callCaption(call, graph), "title");
  text(g, 10, 52, clip(callTiming(call, graph.now), 36), "sub");
  if (call.engine) text(g, 10, 66, clip(`on ${view.engineNames.get(call.engine) || call.engine}`, 36), "sub");
  svg("title", {}, g).textContent = `${call.id}${call.error ? `\n${call.error}` : ""}`;
  g.addEventListener("click", () => { view.picked = call.id; drawGraph(view.graph); showDetails(); });
}

function drawValue(layer, v, p) {
  const g = svg("g", { class: `node value${v.ready ? "" : " unset"}`, "data-variable-id": v.id,
                       transform: `translate(${p.x},${p.y})` }, layer);
  if (view.picked === `var:${v.id}`) g.classList.add("selected");
  svg("rect", { width: p.w, height: p.h, rx: p.h / 2 }, g);
  text(g, 14, 16, clip(v.name || short(v.id), 22), "title");
  const shown = v.error ? `failed: ${v.error}` : v.ready ? `"${(v.preview ?? "").replace(/\s+/g, " ")}"` : "no value yet";
  text(g, 14, 31, clip(shown, 26), "sub");
  g.addEventListener("click", () => { view.picked = `var:${v.id}`; drawGraph(view.graph); showDetails(); });
}

function showDetails() {
  const box = document.getElementById("details");
  const graph = view.graph;
  if (!graph || !view.picked) { box.hidden = true; return; }
  const rows = [];
  const varById = graph.variableById;
  const describe = (id) => { const v = varById.get(id); return v ? `${v.name || id} = ${v.ready ? JSON.stringify(v.preview) : v.error ? `failed: ${v.error}` : "(not ready)"}` : id; };
  if (view.picked.startsWith("var:")) {
    const v = varById.get(view.picked.slice(4));
    if (!v) { box.hidden = true; return; }
    rows.push(["variable", v.id], ["name", v.name ?? "–"], ["producer", v.producer ?? "the client"],
              ["consumers", v.consumers.join("\n") || "–"], ["size", `${v.size} bytes`],
              ["value", v.ready ? v.preview : v.error ? `failed: ${v.error}` : "(not ready)"]);
  } else {
    const call = graph.calls.find((c) => c.id === view.picked);
    if (!call) { box.hidden = true; return; }
    rows.push(["call", call.id], ["state", call.state], ["engine", call.engine ?? "–"], ["criteria", call.criteria],
              ["task group", call.group ?? "–"], ["submitted", clock(call.submitted)],
              ["started", clock(call.started)], ["finished", clock(call.finished)],
              ["timing", callTiming(call, graph.now)],
              ["inputs", Object.entries(call.inputs).sort().map(([n, id]) => `{{${n}}} ← ${describe(id)}`).join("\n") || "–"],
              ["outputs", Object.entries(call.outputs).map(([n, id]) => `${n} → ${describe(id)}`).join("\n")]);
    if (call.error) rows.push(["error", call.error]);
  }
  box.replaceChildren(el("dl", {}, ...rows.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, String(v))])));
  box.hidden = false;
}

function renderGraph(graph) {
  graph.variableById = new Map(graph.variables.map((v) => [v.id, v]));
  view.graph = graph;
  const counts = {};
  for (const call of graph.calls) counts[call.state] = (counts[call.state] || 0) + 1;
  const summary = Object.entries(counts).map(([state, n]) => `${n} ${state}`).join(" · ") || "no calls";
  document.getElementById("graph-title").textContent = `Session ${graph.session_id} — ${summary}`;
  document.getElementById("graph-empty").hidden = true;
  drawGraph(graph);
  showDetails();
}

function clearGraph(message) {
  view.graph = null;
  document.getElementById("graph").replaceChildren();
  document.getElementById("graph-title").textContent = "Session graph";
  const empty = document.getElementById("graph-empty");
  empty.textContent = message;
  empty.hidden = false;
  document.getElementById("details").hidden = true;
}

// ------------------------------------------------------------------ engines and benchmarks

function renderEngines(engines) {
  view.engineNames = new Map(engines.map((e) => [e.id, e.name]));
  const body = document.querySelector("#engines tbody");
  body.replaceChildren();
  for (const e of engines) {
    const kv = Math.round(e.kv_use * 100);
    const fill = el("span");
    fill.style.width = `${kv}%`;  // through the CSSOM: the page's CSP allows no inline style attributes
    const bar = el("span", { class: "bar" }, fill);
    body.append(el("tr", { "data-engine-id": e.id },
      el("td", { title: e.id }, `${e.name} (${short(e.id)})`),
      el("td", {}, e.models.join(", ")),
      el("td", { class: e.healthy ? "ok" : "bad" }, e.healthy ? "healthy" : "out of rotation"),
      el("td", { class: "num" }, `${e.load} (${e.in_flight} ours)`),
      el("td", { class: "num" }, bar, `${kv}%`),
      el("td", { class: "num" }, String(e.prefix_contexts)),
      el("td", { class: "num" }, e.held_prefix_tokens.toLocaleString()),
      el("td", { class: "num" }, `${Math.round(e.prefix_hit_rate * 100)}%`),
      el("td", { class: "num" }, e.requests_per_s.toFixed(1))));
  }
  if (!engines.length) body.append(el("tr", {}, el("td", { colspan: 9, class: "muted" }, "No engine registered.")));
}

function renderBatches(batches) {
  const body = document.querySelector("#batches tbody");
  body.replaceChildren();
  for (const b of batches) {
    const c = b.request_counts;
    body.append(el("tr", { "data-batch-id": b.id },
      el("td", { title: b.id }, short(b.id)),
      el("td", {}, b.endpoint),
      el("td", { class: b.status === "failed" ? "bad" : b.status === "completed" ? "ok" : "" }, b.status),
      el("td", { class: "num" }, `${c.completed} / ${c.failed} / ${c.total}`)));
  }
  if (!batches.length) body.append(el("tr", {}, el("td", { colspan: 4, class: "muted" }, "No batch.")));
}

async function loadBenchmarks() {
  const box = document.getElementById("benchmarks");
  try {
    const plots = (await api("/dashboard/benchmarks")).data;
    box.replaceChildren(...plots.map((p) => el("figure", {},
      ...(p.url ? [el("a", { href: p.url, target: "_blank", rel: "noopener" }, el("img", { src: p.url, alt: p.name, loading: "lazy" }))] : []),
      el("figcaption", {}, ...p.results.map((r) => el("div", { class: "result" },
        el("strong", {}, r.ratio), ` ${r.what}, vs ${r.vs} (${r.host}, ${r.date})`))))));
    if (!plots.length) box.append(el("p", { class: "muted" }, "No current benchmark results (docs/benchmarks/current.json in the checkout, written by python -m benchmarks.report, or [dashboard] benchmarks_dir)."));
  } catch (err) {
    box.replaceChildren(el("p", { class: "muted" }, `Benchmark results unavailable: ${err.message}`));
  }
}

// ------------------------------------------------------------------ polling

async function poll() {
  clearTimeout(view.timer);
  if (view.key === null) { setStatus("enter an API key (or none, on an open gateway) and connect"); return; }
  if (document.hidden) { view.timer = setTimeout(poll, POLL_MS); return; }  // nobody looks: no requests
  try {
    const [sessions, engines, batches] = await Promise.all([api("/v1/sessions"), api("/v1/engines"),
                                                           api("/v1/batches?limit=20")]);
    renderEngines(engines);
    renderBatches(batches.data);
    renderSessions(sessions.data);
    if (view.selected) {
      try { renderGraph(await api(`/v1/sessions/${encodeURIComponent(view.selected)}/graph`)); }
      catch (err) { if (err.status === 404) clearGraph("That session is gone."); else throw err; }
    } else clearGraph("No session to show yet: sessions appear here as soon as this key makes one.");
    const who = view.key ? `key …${view.key.slice(-4)}` : "no key";
    setStatus(`${who} · updated ${new Date().toLocaleTimeString()} · every ${POLL_MS / 1000} s`);
  } catch (err) {
    setStatus(err.status === 401 ? `${err.message} Enter a valid key.` : `error: ${err.message}`, true);
  }
  view.timer = setTimeout(poll, POLL_MS);
}

function connect(key) {
  view.key = key;
  sessionStorage.setItem(KEY_STORAGE, key);
  view.selected = location.hash.slice(1) || null;
  poll();
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const input = document.getElementById("api-key");
    connect(input.value.trim());
    input.value = "";
  });
  document.getElementById("forget-key").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORAGE);
    view.key = null;
    clearTimeout(view.timer);
    document.getElementById("sessions").replaceChildren();
    clearGraph("Connect with a key to see its sessions.");
    setStatus("not connected");
  });
  loadBenchmarks();
  poll();
});
