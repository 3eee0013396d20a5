// The chunkd dashboard: one snapshot (/v1/dashboard), then one sample a second from
// /v1/dashboard/stream (docs/dashboard.md). The page only formats: every rate, ratio and
// percentile comes from the daemon as it is. Every server value reaches the DOM as
// text (textContent), charts are SVG built node by node, and the page keeps a fixed set
// of nodes: rows are reused, never added per sample, and every list is bounded.

const SVG = "http://www.w3.org/2000/svg";
const HISTORY = 300; // samples kept: five minutes at 1 s, as the daemon keeps
const RETRY_MIN_MS = 1000;
const RETRY_MAX_MS = 5000;
// No sample for this many intervals and the figures are stale: the daemon stopped
// answering without closing the stream (stopped, or its loop stalled).
const STALE_INTERVALS = 3.5;

// -- formatting ---------------------------------------------------------------------

const UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];

function bytes(value) {
  if (value === null || value === undefined) return "–";
  let size = Number(value);
  let unit = 0;
  while (Math.abs(size) >= 1024 && unit < UNITS.length - 1) {
    size /= 1024;
    unit += 1;
  }
  return unit === 0 ? `${size.toFixed(0)} B` : `${size.toFixed(1)} ${UNITS[unit]}`;
}

function byteRate(value) {
  return value === null || value === undefined ? "–" : `${bytes(value)}/s`;
}

// A rate as precise as it needs to be to never read as zero when it is not: "0/s" is
// nothing at all, "0.05/s" a read every 20 s (an object read once, in a decayed rate).
// The daemon sends rates to three decimals, so a smaller one arrives as 0.
function rate(value) {
  if (value === null || value === undefined) return "–";
  const n = Number(value);
  if (n === 0) return "0/s";
  if (n >= 100) return `${n.toFixed(0)}/s`;
  if (n >= 1) return `${n.toFixed(1)}/s`;
  if (n >= 0.001) return `${Number(n.toPrecision(2))}/s`;
  return "<0.001/s";
}

function ratio(value) {
  return value === null || value === undefined ? "–" : `${(Number(value) * 100).toFixed(1)} %`;
}

function millis(value) {
  if (value === null || value === undefined) return "–";
  const n = Number(value);
  return n >= 1000 ? `${(n / 1000).toFixed(2)} s` : `${n.toFixed(1)} ms`;
}

function count(value) {
  return value === null || value === undefined ? "–" : Number(value).toLocaleString("en-US");
}

function seconds(value) {
  if (value === null || value === undefined) return "–";
  const s = Math.floor(Number(value));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
}

function clock(unixSeconds) {
  const d = new Date(Number(unixSeconds) * 1000);
  const pad = (n) => String(n).padStart(2, "0");
  return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

function text(id, value) {
  const node = document.getElementById(id);
  if (node.textContent !== value) node.textContent = value;
}

// -- charts -------------------------------------------------------------------------

function svg(name, attrs = {}) {
  const node = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
  return node;
}

// Round ticks for a value axis: steps of 1, 2 or 5 times a power of ten, in one unit
// of `units` ([name, size] from the smallest), the largest whose figures stay under
// 1000 (700 MiB/s, not 0.7 GiB/s; 1.5 GiB/s, not 1536 MiB/s). `max` is the largest value
// drawn; the axis' top is the first tick at or above it.
function niceAxis(max, units) {
  let unit = units[0];
  for (const candidate of units) {
    if (max / candidate[1] >= 1) unit = candidate;
  }
  if (max / unit[1] >= 1000 && unit !== units[units.length - 1]) {
    unit = units[units.indexOf(unit) + 1];
  }
  const scaled = max / unit[1];
  let step = 1;
  if (scaled > 0) {
    const raw = scaled / 4; // two to four ticks above zero
    const magnitude = 10 ** Math.floor(Math.log10(raw));
    const mantissa = raw / magnitude;
    step = (mantissa <= 1 ? 1 : mantissa <= 2 ? 2 : mantissa <= 5 ? 5 : 10) * magnitude;
  }
  const count = Math.max(1, Math.ceil(scaled / step - 1e-9));
  const decimals = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
  const ticks = [];
  for (let i = 0; i <= count; i += 1) {
    ticks.push({ value: i * step * unit[1], label: `${(i * step).toFixed(decimals)} ${unit[0]}` });
  }
  return { top: count * step * unit[1], ticks };
}

const BYTE_RATE_UNITS = UNITS.map((name, i) => [`${name}/s`, 1024 ** i]);
const MILLIS_UNITS = [["ms", 1], ["s", 1000]];

// Round steps for the time axis, in seconds: at most five ticks back from the newest.
const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600];

function ago(s) {
  return s < 60 ? `\u2212${s} s` : `\u2212${s / 60} min`;
}

// A multi-line chart of the samples in its window: one <path> per series, grid lines at
// round values with their labels at the left, and round times below. The window is the
// history's own span while it is shorter than WINDOW (the chart fits its data), then
// the last WINDOW seconds, sliding. Drawn again from the history on each sample, with a
// fixed set of nodes.
class LineChart {
  constructor(container, series, { axis, height = 160 }) {
    this.series = series;
    this.axis = axis; // max -> {top, ticks}
    this.height = height;
    this.windowS = HISTORY;
    this.width = Math.max(container.clientWidth, 200);
    this.root = svg("svg", { class: "plot", role: "img", height });
    this.grid = [];
    for (let i = 0; i < 6; i += 1) {
      const line = svg("line", { class: "gridline" });
      const label = svg("text", { class: "axis y" });
      this.root.append(line, label);
      this.grid.push({ line, label });
    }
    this.times = [];
    for (let i = 0; i < 6; i += 1) {
      const line = svg("line", { class: "gridline time" });
      const label = svg("text", { class: "axis x" });
      this.root.append(line, label);
      this.times.push({ line, label });
    }
    this.now = svg("text", { class: "axis end" });
    this.now.textContent = "now";
    this.root.append(this.now);
    this.paths = series.map((s) => {
      const path = svg("path", { class: `line ${s.cls}` });
      this.root.append(path);
      return path;
    });
    container.append(this.root);
    this.samples = [];
    new ResizeObserver(() => {
      const width = Math.max(container.clientWidth, 200);
      if (width !== this.width) {
        this.width = width;
        this.draw(this.samples);
      }
    }).observe(container);
  }

  draw(samples) {
    this.samples = samples;
    const w = this.width;
    const h = this.height;
    const top = 8;
    const bottom = h - 16; // room for the time axis below
    this.root.setAttribute("width", w);
    this.root.setAttribute("viewBox", `0 0 ${w} ${h}`);

    // the window: from the first sample (or WINDOW back from the last) to the last
    const to = samples.length ? Number(samples[samples.length - 1].t) : 0;
    const from = samples.length ? Math.max(Number(samples[0].t), to - this.windowS) : 0;
    const span = Math.max(to - from, 1);
    const shown = samples.filter((sample) => Number(sample.t) >= from);
    this.root.dataset.from = String(from);
    this.root.dataset.to = String(to);

    let max = 0;
    for (const sample of shown) {
      for (const s of this.series) {
        const v = s.value(sample);
        if (v !== null && v > max) max = v;
      }
    }
    const { top: axisTop, ticks } = this.axis(max);
    const left = 10 + 6.1 * Math.max(...ticks.map((t) => t.label.length));
    const right = w - 2;
    this.grid.forEach(({ line, label }, i) => {
      const tick = ticks[i];
      line.style.display = tick ? "" : "none";
      label.style.display = tick ? "" : "none";
      if (!tick) return;
      const y = bottom - (axisTop > 0 ? tick.value / axisTop : 0) * (bottom - top);
      line.setAttribute("x1", left);
      line.setAttribute("x2", right);
      line.setAttribute("y1", y);
      line.setAttribute("y2", y);
      label.setAttribute("x", left - 5);
      label.setAttribute("y", y + 3.5);
      label.textContent = tick.label;
    });

    const xOf = (t) => left + ((Number(t) - from) / span) * (right - left);
    const step = TIME_STEPS.find((s) => span / s <= 5) ?? TIME_STEPS[TIME_STEPS.length - 1];
    this.times.forEach(({ line, label }, i) => {
      const back = (i + 1) * step;
      const x = xOf(to - back);
      const room = back <= span && x - left >= 24 && right - x >= 30;
      line.style.display = room ? "" : "none";
      label.style.display = room ? "" : "none";
      if (!room) return;
      line.setAttribute("x1", x);
      line.setAttribute("x2", x);
      line.setAttribute("y1", top);
      line.setAttribute("y2", bottom);
      label.setAttribute("x", x);
      label.setAttribute("y", h - 3);
      label.textContent = ago(back);
    });
    this.now.setAttribute("x", right);
    this.now.setAttribute("y", h - 3);

    this.series.forEach((s, index) => {
      const parts = [];
      let pen = "M";
      let previous = null;
      for (const sample of shown) {
        const v = s.value(sample);
        if (v === null || (previous !== null && sample.seq !== previous + 1)) {
          pen = "M"; // a gap: nothing to measure, or samples missed
        }
        previous = sample.seq;
        if (v === null) continue;
        const y = bottom - (axisTop > 0 ? (v / axisTop) * (bottom - top) : 0);
        parts.push(`${pen}${xOf(sample.t).toFixed(1)},${y.toFixed(1)}`);
        pen = "L";
      }
      this.paths[index].setAttribute("d", parts.join(""));
    });
  }
}

// -- tables -------------------------------------------------------------------------

// The rows of one table body, reused from sample to sample. At most `limit` rows ever
// exist; `render` fills each from one item with text only. `columns` are the cells'
// classes, as the table's head has them ("name" wraps, "num" never does, "minor" goes
// where the panel is narrow, "text" wraps).
class Rows {
  constructor(tableId, columns, limit, render) {
    this.body = document.getElementById(tableId).tBodies[0];
    this.columns = columns;
    this.limit = limit;
    this.render = render;
    this.rows = [];
    this.empty = document.createElement("tr");
    const cell = document.createElement("td");
    cell.colSpan = columns.length;
    cell.className = "empty";
    this.empty.append(cell);
    this.body.append(this.empty);
  }

  // `total`: how many there are when the daemon sent only the first of them
  update(items, emptyText = "none", total = items.length) {
    const shown = items.slice(0, this.limit);
    while (this.rows.length < shown.length) {
      const row = document.createElement("tr");
      const cells = [];
      for (const cls of this.columns) {
        const cell = document.createElement("td");
        if (cls) cell.className = cls;
        row.append(cell);
        cells.push(cell);
      }
      this.body.append(row);
      this.rows.push({ row, cells, extra: {} });
    }
    this.rows.forEach((entry, i) => {
      entry.row.hidden = i >= shown.length;
      if (i < shown.length) this.render(entry, shown[i]);
    });
    const more = Math.max(total, items.length) - shown.length;
    this.empty.hidden = shown.length > 0 && more <= 0;
    this.empty.cells[0].textContent = more > 0 && shown.length > 0 ? `and ${more} more` : emptyText;
  }
}

// A panel with nothing to list folds to its title line; `summary` says why there, or
// what the open panel lists.
function fold(panelId, folded, summaryId, summary) {
  document.getElementById(panelId).classList.toggle("folded", folded);
  text(summaryId, summary);
}

function setCells(cells, values) {
  values.forEach((value, i) => {
    if (cells[i].textContent !== value) {
      cells[i].textContent = value;
      cells[i].title = value; // a cell cut short by its column shows whole on hover
    }
  });
}

// A job whose data stall is this share or more is shown in trouble (the alert's line:
// deploy/prometheus's ChunkdDataStall fires past 0.1 for 10 minutes).
const STALL_BAD = 0.1;
const LEVELS = new Set(["debug", "info", "warning", "error", "critical"]);
const DURABILITY = ["staged", "local", "replicated", "remote"];
const SEGMENT = 40; // px a level takes in the bar
const REMOTE = DURABILITY.length - 1;

// A bar through staged → local → replicated → remote: a segment for each level, the
// ones reached filled; the remote segment fills as the new bytes upload.
function durabilityBar(extra) {
  if (!extra.bar) {
    const wide = SEGMENT * DURABILITY.length;
    const root = svg("svg", { class: "durability", width: wide, height: 14, viewBox: `0 0 ${wide} 14` });
    extra.segments = DURABILITY.map((level, i) => {
      const back = svg("rect", { class: "segment", x: i * SEGMENT + 1, y: 1, width: SEGMENT - 2, height: 12, rx: 2 });
      const fill = svg("rect", { class: `reached ${level}`, x: i * SEGMENT + 1, y: 1, width: 0, height: 12, rx: 2 });
      const title = svg("title");
      title.textContent = level;
      back.append(title);
      root.append(back, fill);
      return fill;
    });
    extra.bar = root;
  }
  return extra.bar;
}

function fillDurability(extra, job) {
  const reached = DURABILITY.indexOf(job.durability);
  const full = SEGMENT - 2;
  extra.segments.forEach((fill, i) => {
    let width = i <= reached ? full : 0;
    if (i === REMOTE && reached >= 1 && reached < REMOTE && job.unique_bytes > 0) {
      width = full * Math.min(1, job.remote_bytes / job.unique_bytes); // uploading
    }
    fill.setAttribute("width", width.toFixed(1));
  });
}

// -- the page -----------------------------------------------------------------------

const state = {
  boot: null,
  node: null,
  history: [],
  source: null,
  retryMs: RETRY_MIN_MS,
  retryTimer: null,
  reloading: false,
  intervalS: 1,
  lastArrival: 0, // performance.now() when the last fresh figures came
  stale: false,
  job: null, // the job /#jobs=NAME selects, or null
  scrollToJobs: false, // /#jobs asked for the jobs panel before the page had figures
};

const charts = {};
const tables = {};

function setConnection(kind, message) {
  const node = document.getElementById("connection");
  node.dataset.state = kind;
  text("connection", message);
}

// Stale: the figures shown are the last sample's and the daemon is not sending more.
// They dim and the bar says since when; the next sample brings them back.
function setStale(stale) {
  const history = state.history;
  const last = history.length ? history[history.length - 1] : null;
  if (stale && last === null) return; // nothing shown yet: nothing to dim
  state.stale = stale;
  document.querySelector("main").classList.toggle("stale", stale);
  const badge = document.getElementById("stale");
  badge.hidden = !stale;
  if (stale) {
    badge.textContent = `stale since ${clock(last.t)}`;
    badge.title = "the daemon has sent no sample since then: the figures are from that second";
  }
}

function fresh() {
  state.lastArrival = performance.now();
  if (state.stale) setStale(false);
}

function watchFreshness() {
  setInterval(() => {
    if (state.stale || !state.history.length || state.source === null) return;
    const silentS = (performance.now() - state.lastArrival) / 1000;
    if (silentS > STALE_INTERVALS * state.intervalS) {
      setStale(true);
      setConnection("down", "not answering");
    }
  }, 500);
}

function showNode(node) {
  const self = node.self ? ` · peer ${node.self}` : "";
  text(
    "node",
    `${node.listen} · chunkd ${node.version} · started ${clock(node.started)} · backends ${node.backends.join(", ")}${self}`,
  );
}

function showRestart(node) {
  const restart = document.getElementById("restart");
  restart.hidden = false;
  restart.textContent = `daemon restarted at ${clock(node.started)}`;
}

function adopt(snapshot) {
  const node = snapshot.node;
  let history = snapshot.history.slice(-HISTORY);
  if (state.boot === node.boot && history.length) {
    // samples that came on the stream while the snapshot was on its way
    const newest = history[history.length - 1].seq;
    history = history.concat(state.history.filter((s) => s.seq > newest)).slice(-HISTORY);
  } else if (state.boot === node.boot) {
    history = state.history;
  }
  state.boot = node.boot;
  state.node = node;
  state.history = history;
  if (Number(snapshot.interval_s) > 0) state.intervalS = Number(snapshot.interval_s);
  for (const chart of Object.values(charts)) chart.windowS = HISTORY * state.intervalS;
  showNode(node);
  redraw();
}

function addSample(boot, sample) {
  if (boot !== state.boot) return;
  const history = state.history;
  if (history.length && sample.seq <= history[history.length - 1].seq) return; // replayed
  // A hole: a sample went out between the snapshot and the stream's first (a browser's
  // first EventSource sends no Last-Event-ID). The snapshot has it; adopt() merges.
  if (history.length && sample.seq > history[history.length - 1].seq + 1) reload();
  history.push(sample);
  if (history.length > HISTORY) history.splice(0, history.length - HISTORY);
  redraw();
  fresh();
  if (state.source !== null && state.source.readyState === EventSource.OPEN) {
    setConnection("live", "live");
  }
}

function redraw() {
  const history = state.history;
  charts.throughput.draw(history);
  charts.ratio.draw(history);
  charts.latency.draw(history);
  const sample = history.length ? history[history.length - 1] : null;
  if (sample) showSample(sample);
}

function showSample(s) {
  text("updated", `sample ${s.seq} at ${clock(s.t)}`);
  text("tp-ram", byteRate(s.throughput.ram));
  text("tp-disk", byteRate(s.throughput.disk));
  text("tp-peer", byteRate(s.throughput.peer));
  text("tp-backend", byteRate(s.throughput.backend));

  text("ratio-ram", ratio(s.hit_ratio.ram));
  text("ratio-disk", ratio(s.hit_ratio.disk));
  text("hits-ram", rate(s.hits.ram));
  text("hits-disk", rate(s.hits.disk));
  text("hits-miss", rate(s.hits.miss));
  text("sf-waits", rate(s.singleflight_waits));
  text("req-http", rate(s.requests.http));
  text("req-local", rate(s.requests.local));
  text("req-s3", rate(s.requests.s3));
  text("req-clients", count(s.local_clients));

  text("be-requests", rate(s.backend.requests));
  text("be-errors", rate(s.backend.errors));
  text("be-bytes", byteRate(s.backend.bytes));
  const latency = s.backend.latency_ms || { p50: null, p90: null, p99: null };
  text("be-p50", millis(latency.p50));
  text("be-p90", millis(latency.p90));
  text("be-p99", millis(latency.p99));
  tables.backends.update(s.backends, "no backends");
  tables.tiers.update(s.tiers, "no tiers");

  if (s.peers === null) {
    fold("peers-panel", true, "peers-summary", "not configured");
    tables.peers.update([], "no [peers] section in the config");
  } else {
    const members = s.peers.members;
    fold(
      "peers-panel",
      members.length === 0,
      "peers-summary",
      members.length ? `${s.peers.healthy} of ${members.length} up · self ${s.peers.self}` : `no members · self ${s.peers.self}`,
    );
    // this node is a member too: its row says so (it exchanges nothing with itself)
    tables.peers.update(members.map((m) => ({ ...m, self: m.address === s.peers.self })), "no members");
    const replicas = s.peers.replicas;
    text("rep-bytes", bytes(replicas.bytes));
    text("rep-budget", bytes(replicas.budget_bytes));
    text("rep-stored", count(replicas.received.stored));
    text("rep-refused-full", count(replicas.received.full));
    text("rep-invalid", count(replicas.received.invalid));
    text("rep-pushed", count(replicas.pushes.ok));
    text("rep-pushes-full", count(replicas.pushes.full));
    text("rep-pushes-failed", count(replicas.pushes.failed));
    text("rep-saves-full", count(replicas.saves.full));
    text("rep-saves-partial", count(replicas.saves.partial));
    text("own-served", count(s.peers.holder_answers.served));
    text("own-holders", count(s.peers.holder_answers.holders));
    text("own-direct", count(s.peers.holder_answers.direct));
    text("own-tracked", count(s.peers.holders_tracked));
  }
  const saves = Math.max(s.checkpoints_total, s.checkpoints.length);
  fold("checkpoints-panel", saves === 0, "checkpoints-summary", saves ? `${count(saves)} in flight` : "none in flight");
  tables.checkpoints.update(s.checkpoints, "no saves in flight", s.checkpoints_total);
  const objects = s.hot.objects;
  fold("hot-objects-panel", objects.length === 0, "hot-objects-summary", objects.length ? "last minute" : "no reads in the last minute");
  tables.hotObjects.update(objects, "no reads in the last minute");
  const datasets = s.hot.datasets;
  fold("hot-datasets-panel", datasets.length === 0, "hot-datasets-summary", datasets.length ? "last minute" : "no dataset reads in the last minute");
  tables.hotDatasets.update(datasets, "no dataset reads in the last minute");
  showJobs(s);
  showCost(s.cost);
  fold("errors-panel", s.errors.length === 0, "errors-total", s.errors_total ? `${count(s.errors_total)} since the start` : "none since the start");
  tables.errors.update(s.errors.slice().reverse(), "none");
}

// -- jobs and cost --------------------------------------------------------------------

const PHASES = ["metadata", "worker_start", "first_chunk", "decode"];
const PHASE_NAMES = { metadata: "metadata", worker_start: "worker start", first_chunk: "first chunk", decode: "decode" };
const SOURCES = ["ram", "disk", "peer", "backend"];
const SOURCE_NAMES = { ram: "RAM", disk: "disk", peer: "peer", backend: "backend" };
const BAR_WIDTH = 160; // px of a time-to-first-batch bar in the table
const DETAIL_BAR_WIDTH = 480;

// Seconds of a phase: "350 ms" under a second, "1.25 s" from one.
function duration(value) {
  if (value === null || value === undefined) return "–";
  const n = Number(value);
  return n < 1 ? `${(n * 1000).toFixed(0)} ms` : `${n.toFixed(2)} s`;
}

// An amount in the price table's currency, with as many decimals as it needs to never
// read as zero when it is not: "0.00040 USD" (one GET), "12.35 USD".
function money(value, currency) {
  if (value === null || value === undefined) return "–";
  const n = Number(value);
  let figure = "0.00";
  if (n !== 0) {
    const decimals = Math.min(10, Math.max(2, 1 - Math.floor(Math.log10(Math.abs(n)))));
    figure = n.toFixed(decimals);
  }
  return currency ? `${figure} ${currency}` : figure;
}

// A figure whose exact value the daemon sent rides along in data-value (a test, or a
// person's devtools, reads the number itself, not its rounding).
function figure(id, shown, value) {
  text(id, shown);
  const node = document.getElementById(id);
  const exact = value === null || value === undefined ? "" : String(value);
  if (node.dataset.value !== exact) node.dataset.value = exact;
}

// The part of the hash that names a view: "#jobs" is the jobs panel, "#jobs=NAME" the
// jobs panel with NAME selected.
function jobFromHash() {
  const hash = window.location.hash;
  if (hash === "#jobs") return { jobs: true, job: null };
  if (!hash.startsWith("#jobs=")) return { jobs: false, job: null };
  const raw = hash.slice("#jobs=".length);
  let name = raw;
  try {
    name = decodeURIComponent(raw);
  } catch {
    // not percent-encoded UTF-8: the name as it is written
  }
  return { jobs: true, job: name || null };
}

function followHash() {
  const { jobs, job } = jobFromHash();
  state.job = job;
  if (jobs) state.scrollToJobs = true;
  const history = state.history;
  if (history.length) showJobs(history[history.length - 1]);
}

// A bar of the time to first batch: one segment per phase, its width the phase's share
// of the whole, in the phases' order; each says its phase and seconds on hover.
function firstBatchBar(extra, width) {
  if (!extra.firstBatch) {
    const root = svg("svg", { class: "first-batch-bar", width, height: 12, viewBox: `0 0 ${width} 12` });
    extra.phases = PHASES.map((phase) => {
      const rect = svg("rect", { class: `phase phase-${phase}`, x: 0, y: 0, width: 0, height: 12 });
      const title = svg("title");
      rect.append(title);
      root.append(rect);
      return { rect, title };
    });
    extra.firstBatch = root;
    extra.barWidth = width;
  }
  return extra.firstBatch;
}

function fillFirstBatch(extra, fb) {
  const values = PHASES.map((p) => (fb && fb[p] !== null && fb[p] !== undefined ? Math.max(0, Number(fb[p])) : 0));
  const whole = values.reduce((a, b) => a + b, 0);
  let x = 0;
  extra.phases.forEach(({ rect, title }, i) => {
    const w = whole > 0 ? (values[i] / whole) * extra.barWidth : 0;
    rect.setAttribute("x", x.toFixed(1));
    rect.setAttribute("width", w.toFixed(1));
    rect.dataset.seconds = String(values[i]);
    const hover = `${PHASE_NAMES[PHASES[i]]} ${duration(values[i])}`;
    if (title.textContent !== hover) title.textContent = hover;
    x += w;
  });
}

// The sample always carries first_batch.total (the telemetry makes it): shown as it is.
function firstBatchTotal(fb) {
  return fb && fb.total !== null && fb.total !== undefined ? Number(fb.total) : null;
}

function worstRanks(job) {
  const worst = job.worst_ranks || [];
  return worst.length ? worst.map((r) => `${r.rank}: ${ratio(r.stall)}`).join(", ") : "–";
}

function ranksOf(job) {
  if (job.ranks === null || job.ranks === undefined) return "–";
  return job.world_size ? `${count(job.ranks)} of ${count(job.world_size)}` : count(job.ranks);
}

// The selected job's figures, a fixed set of nodes made once: [id, label, value(job)].
const JOB_FIGURES = [
  ["stall", "data stall", (j) => ratio(j.stall)],
  ["recent", "recent stall", (j) => ratio(j.recent_stall)],
  ["ranks", "ranks reporting", ranksOf],
  ["steps", "steps", (j) => count(j.steps)],
  ["wait", "waited for data", (j) => duration(j.wait_seconds)],
  ["step", "step time", (j) => duration(j.step_seconds)],
  ...SOURCES.map((src) => [`tp-${src}`, `${SOURCE_NAMES[src]} now`, (j) => byteRate(j.throughput ? j.throughput[src] : null)]),
  ...SOURCES.map((src) => [`served-${src}`, `${SOURCE_NAMES[src]} since the start`, (j) => bytes(j.served_bytes ? j.served_bytes[src] : null)]),
  ["first", "time to first batch", (j) => duration(firstBatchTotal(j.first_batch))],
  ["first-rank", "slowest first batch", (j) => (j.first_batch && j.first_batch.rank !== undefined && j.first_batch.rank !== null ? `rank ${j.first_batch.rank}` : "–")],
  ["started", "seen since", (j) => (j.started ? clock(j.started) : "–")],
];

// The selected job's words, which may be long (a label is a job name, up to 128
// characters): a line of text under its title, not figures.
function jobMeta(j) {
  const label = j.label === null || j.label === undefined ? "–" : String(j.label);
  const uids = (j.uids || []).length ? j.uids.join(", ") : "–";
  return `label in /metrics ${label} · uids ${uids}`;
}

const jobDetail = { extra: {}, phaseFigures: [] };

function setupJobDetail() {
  const dl = document.getElementById("job-figures");
  for (const [id, label] of JOB_FIGURES) {
    const div = document.createElement("div");
    const dt = document.createElement("dt");
    dt.textContent = label;
    const dd = document.createElement("dd");
    dd.id = `job-${id}`;
    dd.textContent = "–";
    div.append(dt, dd);
    dl.append(div);
  }
  const box = document.getElementById("job-first-batch");
  box.append(firstBatchBar(jobDetail.extra, DETAIL_BAR_WIDTH));
  const legend = document.createElement("ul");
  legend.className = "legend phases";
  for (const phase of PHASES) {
    const li = document.createElement("li");
    li.className = `phase-${phase}`;
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    const name = document.createTextNode(`${PHASE_NAMES[phase]} `);
    const value = document.createElement("b");
    value.className = "figure";
    value.id = `job-phase-${phase}`;
    value.textContent = "–";
    li.append(swatch, name, value);
    legend.append(li);
  }
  box.append(legend);
}

function showJobs(s) {
  const jobs = Array.isArray(s.jobs) ? s.jobs : [];
  const total = Math.max(Number(s.jobs_total) || 0, jobs.length);
  fold("jobs", total === 0, "jobs-summary", total ? `${count(total)} ${total === 1 ? "job" : "jobs"} · the highest data stall first` : "no jobs seen");
  tables.jobs.update(jobs, "no jobs seen", total);
  const detail = document.getElementById("job-detail");
  if (state.job === null) {
    detail.hidden = true;
  } else {
    detail.hidden = false;
    const job = jobs.find((j) => j.name === state.job);
    text("job-detail-title", job ? `Job ${job.name}${job.ended ? " (ended)" : ""}` : `Job ${state.job}: not among the jobs this node lists now`);
    document.getElementById("job-figures").hidden = !job;
    document.getElementById("job-first-batch").hidden = !job || !job.first_batch;
    text("job-meta", job ? jobMeta(job) : "");
    if (job) {
      for (const [id, , value] of JOB_FIGURES) text(`job-${id}`, value(job));
      fillFirstBatch(jobDetail.extra, job.first_batch);
      for (const phase of PHASES) {
        text(`job-phase-${phase}`, duration(job.first_batch ? job.first_batch[phase] : null));
      }
    }
    tables.jobRanks.update(job ? job.worst_ranks || [] : [], "no rank has reported");
  }
  if (state.scrollToJobs && s === state.history[state.history.length - 1]) {
    state.scrollToJobs = false;
    document.getElementById("jobs").scrollIntoView({ block: "start" });
  }
}

function showCost(cost) {
  const panel = document.getElementById("cost");
  if (cost === null || cost === undefined) {
    panel.classList.add("folded");
    text("cost-summary", "no cost ledger");
    return;
  }
  panel.classList.remove("folded");
  const currency = cost.currency || "";
  text("cost-summary", cost.since ? `since ${clock(cost.since)}${currency ? ` · ${currency}` : ""}` : currency);
  const totals = cost.totals || {};
  const saved = totals.saved || {};
  figure("cost-spent", money(totals.spent, currency), totals.spent);
  figure("cost-direct", money(totals.direct, currency), totals.direct);
  figure("cost-saved-cache", money(saved.cache, currency), saved.cache);
  figure("cost-saved-peer", money(saved.peer, currency), saved.peer);
  const requests = totals.backend_requests_total === undefined ? null : totals.backend_requests_total;
  figure("cost-requests", count(requests), requests);
  const read = totals.backend_bytes ? totals.backend_bytes.read : null;
  figure("cost-read", bytes(read), read);
  const written = totals.written_total === undefined ? null : totals.written_total;
  figure("cost-written", bytes(written), written);
  tables.costJobs.update(
    (cost.jobs || []).map((j) => ({ ...j, currency })),
    "nothing spent yet",
    Math.max(Number(cost.jobs_total) || 0, (cost.jobs || []).length),
  );
  showStorage(cost.storage, currency);
}

// Storage when the ledger knows it: its figures as it sends them (bytes by their name,
// amounts in the currency), at most STORAGE_FIGURES of them.
const STORAGE_FIGURES = 12;

function showStorage(storage, currency) {
  const box = document.getElementById("cost-storage-box");
  const known = storage && typeof storage === "object" && !Array.isArray(storage);
  box.hidden = !known;
  if (!known) return;
  const entries = Object.entries(storage)
    .filter(([, v]) => typeof v === "number" || typeof v === "string" || typeof v === "boolean")
    .slice(0, STORAGE_FIGURES);
  const dl = document.getElementById("cost-storage");
  while (dl.children.length < entries.length) {
    const div = document.createElement("div");
    div.append(document.createElement("dt"), document.createElement("dd"));
    dl.append(div);
  }
  Array.from(dl.children).forEach((div, i) => {
    div.hidden = i >= entries.length;
    if (i >= entries.length) return;
    const [key, value] = entries[i];
    let shown = String(value);
    if (typeof value === "number" && /bytes/.test(key)) shown = bytes(value);
    else if (typeof value === "number" && /(month|cost|dollars|price)/.test(key)) shown = money(value, currency);
    else if (typeof value === "number") shown = count(value);
    const label = key.replaceAll("_", " ");
    if (div.children[0].textContent !== label) div.children[0].textContent = label;
    if (div.children[1].textContent !== shown) div.children[1].textContent = shown;
    div.children[1].dataset.value = String(value);
  });
}

// The reads beside bytes that moved: the daemon rounds a rate to three decimals, so an
// object read long enough ago has bytes and a rate of 0, which is less than 0.001.
function reads(item) {
  return Number(item.reads) === 0 && Number(item.bytes) > 0 ? "<0.001/s" : rate(item.reads);
}

function setupTables() {
  tables.backends = new Rows("backends", ["name", "num", "num", "num", "minor"], 64, ({ row, cells }, b) => {
    setCells(cells, [b.name, rate(b.requests), rate(b.errors), byteRate(b.bytes), b.circuit_open ? "open" : "closed"]);
    row.classList.toggle("bad", Boolean(b.circuit_open));
  });
  tables.tiers = new Rows("tiers", ["name", "num", "num", "num minor", "text"], 8, ({ row, cells }, t) => {
    setCells(cells, [t.name, bytes(t.bytes), bytes(t.budget_bytes), count(t.chunks), t.degraded ? `degraded: ${t.degraded}` : "ok"]);
    row.classList.toggle("bad", Boolean(t.degraded));
  });
  const role = "num role";
  tables.peers = new Rows("peers", ["name", "", "num", "num", role, role, role, role, role, role], 64, ({ row, cells }, p) => {
    const got = p.role_bytes.in;
    const gave = p.role_bytes.out;
    setCells(cells, [
      p.address,
      p.self ? "self" : p.healthy ? "up" : "down",
      byteRate(p.in),
      byteRate(p.out),
      bytes(got.owner),
      bytes(got.holder),
      bytes(got.replica),
      bytes(gave.owner),
      bytes(gave.holder),
      bytes(gave.replica),
    ]);
    // the role's rate in the last second, on hover: the cell shows the bytes since the start
    ["in", "out"].forEach((direction, d) => {
      ["owner", "holder", "replica"].forEach((name, r) => {
        const cell = cells[4 + d * 3 + r];
        const hover = `${bytes(p.role_bytes[direction][name])} since the start, ${byteRate(p.roles[direction][name])} now`;
        if (cell.title !== hover) cell.title = hover;
      });
    });
    row.classList.toggle("bad", !p.healthy);
  });
  tables.checkpoints = new Rows("checkpoints", ["name", "minor", "text", "bar", "num", "num minor", "num"], 50, ({ cells, extra }, c) => {
    setCells(cells, [
      c.name,
      `${c.rank} of ${c.world_size}`,
      c.state,
      "",
      `${bytes(c.remote_bytes)} of ${bytes(c.unique_bytes)}`,
      bytes(c.logical_bytes),
      seconds(c.age_s),
    ]);
    const bar = durabilityBar(extra);
    if (!extra.label) {
      extra.label = document.createElement("span");
      extra.label.className = "durability-label";
    }
    if (bar.parentNode !== cells[3]) cells[3].replaceChildren(bar, extra.label);
    extra.label.textContent = c.durability === null ? "not yet staged" : c.durability;
    fillDurability(extra, c);
  });
  tables.hotObjects = new Rows("hot-objects", ["name", "num", "num"], 10, ({ cells }, o) => {
    setCells(cells, [o.name, byteRate(o.bytes), reads(o)]);
  });
  tables.hotDatasets = new Rows("hot-datasets", ["name", "num", "num"], 10, ({ cells }, o) => {
    setCells(cells, [o.name, byteRate(o.bytes), reads(o)]);
  });
  tables.jobs = new Rows(
    "jobs-table",
    ["name", "num", "num minor", "num", "text", "num source", "num source", "num source", "num source", "bar minor"],
    64,
    ({ row, cells, extra }, j) => {
      const tp = j.throughput || {};
      setCells(cells.slice(1, 9), [
        ratio(j.stall),
        ratio(j.recent_stall),
        ranksOf(j),
        worstRanks(j),
        byteRate(tp.ram),
        byteRate(tp.disk),
        byteRate(tp.peer),
        byteRate(tp.backend),
      ]);
      if (!extra.link) {
        extra.link = document.createElement("a");
        extra.ended = document.createElement("span");
        extra.ended.className = "muted";
        cells[0].replaceChildren(extra.link, extra.ended);
      }
      const name = String(j.name);
      if (extra.link.textContent !== name) {
        extra.link.textContent = name;
        extra.link.href = `#jobs=${encodeURIComponent(name)}`;
      }
      extra.ended.textContent = j.ended ? " ended" : "";
      row.dataset.job = name;
      row.classList.toggle("selected", name === state.job);
      row.classList.toggle("bad", j.stall !== null && j.stall !== undefined && Number(j.stall) >= STALL_BAD);
      const bar = firstBatchBar(extra, BAR_WIDTH);
      if (!extra.firstLabel) {
        extra.firstLabel = document.createElement("span");
        extra.firstLabel.className = "first-batch-label";
      }
      if (bar.parentNode !== cells[9]) cells[9].replaceChildren(bar, extra.firstLabel);
      bar.style.visibility = j.first_batch ? "" : "hidden";
      fillFirstBatch(extra, j.first_batch);
      extra.firstLabel.textContent = duration(firstBatchTotal(j.first_batch));
    },
  );
  tables.jobRanks = new Rows("job-ranks", ["name", "num", "num"], 64, ({ cells }, r) => {
    setCells(cells, [`rank ${r.rank}`, ratio(r.stall), duration(r.wait_max)]);
  });
  tables.costJobs = new Rows("cost-jobs", ["name", "num", "num minor", "num", "num minor"], 64, ({ cells }, j) => {
    const saved = j.saved || {};
    setCells(cells, [
      j.job === null || j.job === undefined ? String(j.label ?? "none") : String(j.job),
      money(j.spent, j.currency),
      money(j.direct, j.currency),
      money(saved.cache, j.currency),
      money(saved.peer, j.currency),
    ]);
    cells[1].dataset.value = String(j.spent);
  });
  tables.errors = new Rows("errors", ["time", "level", "logger text", "message text"], 20, ({ row, cells }, e) => {
    setCells(cells, [clock(e.t), e.level, e.logger, e.message]);
    const level = String(e.level).toLowerCase();
    row.dataset.level = LEVELS.has(level) ? level : "warning";
  });
}

function setupCharts() {
  const nonNull = (v) => (v === null || v === undefined ? null : Number(v));
  charts.throughput = new LineChart(
    document.getElementById("throughput-chart"),
    ["ram", "disk", "peer", "backend"].map((key) => ({
      cls: `series-${key}`,
      value: (s) => nonNull(s.throughput[key]),
    })),
    { axis: (max) => niceAxis(max, BYTE_RATE_UNITS), height: 190 },
  );
  charts.ratio = new LineChart(
    document.getElementById("ratio-chart"),
    ["ram", "disk"].map((key) => ({ cls: `series-${key}`, value: (s) => nonNull(s.hit_ratio[key]) })),
    // a share from 0 to 1, always the whole of it: 0 % to 100 % by 50 %
    { axis: () => niceAxis(1, [["%", 0.01]]), height: 150 },
  );
  charts.latency = new LineChart(
    document.getElementById("latency-chart"),
    ["p50", "p90", "p99"].map((key) => ({
      cls: `series-${key}`,
      value: (s) => nonNull(s.backend.latency_ms ? s.backend.latency_ms[key] : null),
    })),
    { axis: (max) => niceAxis(max, MILLIS_UNITS), height: 150 },
  );
}

async function loadSnapshot() {
  const response = await fetch("/v1/dashboard", { cache: "no-store", credentials: "same-origin" });
  if (response.status === 401) {
    // from another host the daemon wants its token: the login page trades it for a cookie
    window.location.assign(`/login?next=${encodeURIComponent(window.location.pathname)}`);
    throw new Error("the daemon wants its token: signing in at /login");
  }
  if (response.status === 403) throw new Error("the daemon refused this page (HTTP 403)");
  if (!response.ok) throw new Error(`/v1/dashboard answered HTTP ${response.status}`);
  const snapshot = await response.json();
  if (!snapshot.node || !Array.isArray(snapshot.history)) {
    throw new Error("/v1/dashboard did not answer a dashboard snapshot");
  }
  if (state.boot !== null && snapshot.node.boot !== state.boot) restarted(snapshot.node);
  adopt(snapshot);
  if (snapshot.history.length) fresh(); // the daemon answered just now: its figures are current
}

// The daemon came back as another process: its history starts again, and so do the charts.
function restarted(node) {
  showRestart(node);
  state.boot = node.boot;
  state.node = node;
  state.history = [];
  showNode(node);
  redraw();
}

function reload() {
  if (state.reloading) return;
  state.reloading = true;
  loadSnapshot()
    .catch((error) => setConnection("down", `snapshot: ${error.message}`))
    .finally(() => {
      state.reloading = false;
    });
}

function connect() {
  const source = new EventSource("/v1/dashboard/stream", { withCredentials: true });
  state.source = source;
  source.addEventListener("open", () => {
    state.retryMs = RETRY_MIN_MS;
    setConnection("live", "live");
  });
  source.addEventListener("restarted", (event) => {
    restarted(JSON.parse(event.data));
    reload();
  });
  source.addEventListener("sample", (event) => {
    const [boot] = event.lastEventId.split(":");
    if (boot !== state.boot) {
      // another boot without a restarted event: the snapshot says when it started
      reload();
      return;
    }
    addSample(boot, JSON.parse(event.data));
  });
  source.addEventListener("error", () => {
    setStale(true);
    if (source.readyState === EventSource.CLOSED) {
      // refused outright (a 503 or a 401): EventSource gives up, so we start again
      source.close();
      retryLater();
    } else {
      setConnection("down", "disconnected, retrying");
    }
  });
}

function retryLater() {
  if (state.retryTimer !== null) return;
  const wait = state.retryMs;
  state.retryMs = Math.min(state.retryMs * 2, RETRY_MAX_MS);
  setConnection("down", `disconnected, retrying in ${Math.round(wait / 1000)} s`);
  state.retryTimer = setTimeout(() => {
    state.retryTimer = null;
    start();
  }, wait);
}

async function start() {
  try {
    await loadSnapshot();
  } catch (error) {
    setConnection("down", `disconnected, retrying (${error.message})`);
    retryLater();
    return;
  }
  connect();
}

setupTables();
setupJobDetail();
setupCharts();
watchFreshness();
window.addEventListener("hashchange", followHash);
followHash();
start();
