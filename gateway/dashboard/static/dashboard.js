// The chunkd dashboard: one snapshot (/v1/dashboard), then one sample a second from
// /v1/dashboard/stream (docs/dashboard.md). The page only formats: every rate, ratio and
// percentile comes from the daemon as it is. Every server value reaches the DOM as
// text (textContent), charts are SVG built node by node, and the page keeps a fixed set
// of nodes: rows are reused, never added per sample, and every list is bounded.

const SVG = "http://www.w3.org/2000/svg";
const HISTORY = 300; // samples kept: five minutes at 1 s, as the daemon keeps
const RETRY_MIN_MS = 1000;
const RETRY_MAX_MS = 5000;

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

function rate(value) {
  if (value === null || value === undefined) return "–";
  const n = Number(value);
  return `${n >= 100 ? n.toFixed(0) : n.toFixed(1)}/s`;
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

// A multi-line chart of the last HISTORY samples: one <path> per series, three grid
// lines with their labels, drawn again from the history on each sample.
class LineChart {
  constructor(container, series, { format, fixedMax = null, height = 160, base = 10 }) {
    this.series = series;
    this.base = base;
    this.format = format;
    this.fixedMax = fixedMax;
    this.height = height;
    this.width = Math.max(container.clientWidth, 200);
    this.root = svg("svg", { class: "plot", role: "img", height });
    this.grid = [];
    for (let i = 0; i < 3; i += 1) {
      const line = svg("line", { class: "gridline" });
      const label = svg("text", { class: "axis", x: 4 });
      this.root.append(line, label);
      this.grid.push({ line, label });
    }
    this.since = svg("text", { class: "axis" });
    this.since.textContent = "5 min ago";
    this.now = svg("text", { class: "axis end" });
    this.now.textContent = "now";
    this.root.append(this.since, this.now);
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
    this.since.setAttribute("x", 4);
    this.since.setAttribute("y", h - 3);
    this.now.setAttribute("x", w - 4);
    this.now.setAttribute("y", h - 3);
    this.root.setAttribute("width", w);
    this.root.setAttribute("viewBox", `0 0 ${w} ${h}`);
    let max = this.fixedMax;
    if (max === null) {
      max = 0;
      for (const sample of samples) {
        for (const s of this.series) {
          const v = s.value(sample);
          if (v !== null && v > max) max = v;
        }
      }
      max = niceCeiling(max, this.base);
    }
    this.grid.forEach(({ line, label }, i) => {
      const fraction = (3 - i) / 3;
      const y = bottom - fraction * (bottom - top);
      line.setAttribute("x1", 0);
      line.setAttribute("x2", w);
      line.setAttribute("y1", y);
      line.setAttribute("y2", y);
      label.setAttribute("y", y + 12);
      label.textContent = this.format(max * fraction);
    });
    const last = samples.length ? samples[samples.length - 1].seq : 0;
    const step = w / (HISTORY - 1);
    this.series.forEach((s, index) => {
      const parts = [];
      let pen = "M";
      for (const sample of samples) {
        const v = s.value(sample);
        if (v === null) {
          pen = "M"; // a gap: the sample had nothing to measure
          continue;
        }
        const x = w - (last - sample.seq) * step;
        const y = bottom - (max > 0 ? (v / max) * (bottom - top) : 0);
        parts.push(`${pen}${x.toFixed(1)},${y.toFixed(1)}`);
        pen = "L";
      }
      this.paths[index].setAttribute("d", parts.join(""));
    });
  }
}

// A round top for a chart's scale; `base` 1024 rounds in KiB, MiB, ... as bytes() prints.
function niceCeiling(value, base = 10) {
  if (!(value > 0)) return 1;
  if (base === 1024) {
    const unit = 1024 ** Math.max(0, Math.floor(Math.log(value) / Math.log(1024)));
    const top = niceCeiling(value / unit);
    return (top >= 1000 ? 1024 : top) * unit; // 1.0 GiB, not 1000.0 MiB
  }
  const magnitude = 10 ** Math.floor(Math.log10(value));
  for (const m of [1, 2, 2.5, 5, 10]) {
    if (value <= m * magnitude) return m * magnitude;
  }
  return 10 * magnitude;
}

// -- tables -------------------------------------------------------------------------

// The rows of one table body, reused from sample to sample. At most `limit` rows ever
// exist; `render` fills each from one item with text only.
class Rows {
  constructor(tableId, columns, limit, render) {
    this.body = document.getElementById(tableId).tBodies[0];
    this.columns = columns;
    this.limit = limit;
    this.render = render;
    this.rows = [];
    this.empty = document.createElement("tr");
    const cell = document.createElement("td");
    cell.colSpan = columns;
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
      for (let i = 0; i < this.columns; i += 1) {
        const cell = document.createElement("td");
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

function setCells(cells, values) {
  values.forEach((value, i) => {
    if (cells[i].textContent !== value) {
      cells[i].textContent = value;
      cells[i].title = value; // a cell cut short by its column shows whole on hover
    }
  });
}

const LEVELS = new Set(["debug", "info", "warning", "error", "critical"]);
const DURABILITY = ["staged", "local", "remote"];

// A bar through staged → local → remote: a segment for each level, the ones reached
// filled; the remote segment fills as the new bytes upload.
function durabilityBar(extra) {
  if (!extra.bar) {
    const root = svg("svg", { class: "durability", width: 150, height: 14, viewBox: "0 0 150 14" });
    extra.segments = DURABILITY.map((level, i) => {
      const back = svg("rect", { class: "segment", x: i * 50 + 1, y: 1, width: 48, height: 12, rx: 2 });
      const fill = svg("rect", { class: `reached ${level}`, x: i * 50 + 1, y: 1, width: 0, height: 12, rx: 2 });
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
  extra.segments.forEach((fill, i) => {
    let width = i <= reached ? 48 : 0;
    if (i === 2 && reached === 1 && job.unique_bytes > 0) {
      width = 48 * Math.min(1, job.remote_bytes / job.unique_bytes);
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
};

const charts = {};
const tables = {};

function setConnection(kind, message) {
  const node = document.getElementById("connection");
  node.dataset.state = kind;
  text("connection", message);
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
  showNode(node);
  redraw();
}

function addSample(boot, sample) {
  if (boot !== state.boot) return;
  const history = state.history;
  if (history.length && sample.seq <= history[history.length - 1].seq) return; // replayed
  history.push(sample);
  if (history.length > HISTORY) history.splice(0, history.length - HISTORY);
  redraw();
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
    text("peers-summary", "not configured");
    tables.peers.update([], "no [peers] section in the config");
  } else {
    const members = s.peers.members;
    text("peers-summary", `${s.peers.healthy} of ${members.length} up · self ${s.peers.self}`);
    tables.peers.update(members, "no members");
  }
  tables.checkpoints.update(s.checkpoints, "no saves in flight", s.checkpoints_total);
  tables.hotObjects.update(s.hot.objects, "no reads in the last minute");
  tables.hotDatasets.update(s.hot.datasets, "no dataset reads in the last minute");
  text("errors-total", `${count(s.errors_total)} since the start`);
  tables.errors.update(s.errors.slice().reverse(), "none");
}

function setupTables() {
  tables.backends = new Rows("backends", 5, 64, ({ row, cells }, b) => {
    setCells(cells, [b.name, rate(b.requests), rate(b.errors), byteRate(b.bytes), b.circuit_open ? "open" : "closed"]);
    row.classList.toggle("bad", Boolean(b.circuit_open));
  });
  tables.tiers = new Rows("tiers", 5, 8, ({ row, cells }, t) => {
    setCells(cells, [t.name, bytes(t.bytes), bytes(t.budget_bytes), count(t.chunks), t.degraded ? `degraded: ${t.degraded}` : "ok"]);
    row.classList.toggle("bad", Boolean(t.degraded));
  });
  tables.peers = new Rows("peers", 4, 64, ({ row, cells }, p) => {
    setCells(cells, [p.address, p.healthy ? "up" : "down", byteRate(p.in), byteRate(p.out)]);
    row.classList.toggle("bad", !p.healthy);
  });
  tables.checkpoints = new Rows("checkpoints", 6, 50, ({ cells, extra }, c) => {
    setCells(cells, [
      c.name,
      `${c.rank} of ${c.world_size}`,
      c.state,
      "",
      `${bytes(c.remote_bytes)} of ${bytes(c.unique_bytes)} in the backend · ${bytes(c.logical_bytes)} logical`,
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
  tables.hotObjects = new Rows("hot-objects", 3, 10, ({ cells }, o) => {
    setCells(cells, [o.name, byteRate(o.bytes), rate(o.reads)]);
  });
  tables.hotDatasets = new Rows("hot-datasets", 3, 10, ({ cells }, o) => {
    setCells(cells, [o.name, byteRate(o.bytes), rate(o.reads)]);
  });
  tables.errors = new Rows("errors", 4, 20, ({ row, cells }, e) => {
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
    { format: byteRate, height: 170, base: 1024 },
  );
  charts.ratio = new LineChart(
    document.getElementById("ratio-chart"),
    ["ram", "disk"].map((key) => ({ cls: `series-${key}`, value: (s) => nonNull(s.hit_ratio[key]) })),
    { format: ratio, fixedMax: 1, height: 80 },
  );
  charts.latency = new LineChart(
    document.getElementById("latency-chart"),
    ["p50", "p90", "p99"].map((key) => ({
      cls: `series-${key}`,
      value: (s) => nonNull(s.backend.latency_ms ? s.backend.latency_ms[key] : null),
    })),
    { format: millis, height: 80 },
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
setupCharts();
start();
