// The data inspector's page (docs/inspector.md). One ES module, no framework, no build.
//
// Safety: every value the daemon sends goes into the DOM as text (textContent,
// createElement), never as HTML. The only URLs put into src/href are this page's own
// links (built here from URLSearchParams), the daemon's /v1/inspect/media/... route,
// and data:/blob: URLs built from a `$bytes` value whose sniffed type is on the
// allowlist below. The page runs under a CSP without inline scripts or styles.

const MEDIA = {
  "image/png": "image", "image/jpeg": "image", "image/webp": "image", "image/gif": "image",
  "audio/wav": "audio", "audio/flac": "audio", "audio/mpeg": "audio", "audio/ogg": "audio",
  "video/webm": "video", "video/mp4": "video",
};
const B64 = /^[A-Za-z0-9+/]*={0,2}$/;

const PAGE_ROWS = 20;        // rows a page of a table shows (one request a page)
const LIST_PAGE = 200;       // listing entries a "more" fetches
const DATASETS_PAGE = 100;
const SNAPSHOT_PAGE = 100;   // members a "more" fetches
const RL_PAGE = 64;          // rows an RL page covers (the daemon completes groups)
const STEP_SAMPLES = 16;     // samples of one rank fetched at a time
const STEP_PARALLEL = 4;     // sample requests in flight at once
const FOLD_CHARS = 300;      // a longer string shows its start and a "show all"
const FOLD_ITEMS = 100;      // a longer list shows its start and a "show all"
const HEX_PREVIEW = 64;      // bytes of a non-media binary shown as hex
const SIG_DIGITS = 4;        // a float in a table shows this many significant digits
const REWARD_LEVELS = ["very low", "low", "middle", "high", "very high"]; // reward-0 .. reward-4

const view = document.getElementById("view");
let generation = 0;          // bumped by every navigation: late answers are dropped
let controller = null;       // aborts the requests of the view navigated away from
let blobUrls = [];           // revoked when the view they belong to goes

// -- DOM -------------------------------------------------------------------------------

/** An element with a class and text content (never HTML). */
function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

/** Append children: nodes as they are, anything else as text. */
function add(parent, ...kids) {
  for (const kid of kids) {
    if (kid === null || kid === undefined || kid === false) continue;
    parent.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return parent;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
}

function button(text, onClick, cls = "") {
  const b = el("button", cls, text);
  b.type = "button";
  b.addEventListener("click", onClick);
  return b;
}

function section(title, ...kids) {
  const s = el("section", "panel");
  add(s, el("h2", "", title), ...kids);
  return s;
}

/** A definition list of [label, value] pairs (values: nodes or text). */
function facts(pairs) {
  const dl = el("dl", "facts");
  for (const [k, v] of pairs) {
    if (v === undefined) continue;
    const div = el("div");
    add(div, el("dt", "", k), add(el("dd", "mono"), v === null ? "—" : v));
    dl.append(div);
  }
  return dl;
}

function table(headers, cls = "") {
  const t = el("table", `data-table ${cls}`);
  const tr = el("tr");
  for (const h of headers) tr.append(el("th", "", h));
  add(t, add(el("thead"), tr));
  const body = el("tbody");
  t.append(body);
  return { table: t, body };
}

function row(cells) {
  const tr = el("tr");
  for (const c of cells) tr.append(add(el("td"), c));
  return tr;
}

// -- formatting ------------------------------------------------------------------------

function fmtBytes(n) {
  if (typeof n !== "number") return n === null || n === undefined ? "—" : String(n);
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let v = n;
  let u = 0;
  while (v >= 1024 && u < units.length - 1) { v /= 1024; u += 1; }
  return u === 0 ? `${n} B` : `${v.toFixed(v < 10 ? 2 : 1)} ${units[u]}`;
}

/** Seconds as 2.50 s, or 3:05.2 past a minute, or 1:02:03 past an hour. */
function fmtDuration(t) {
  if (typeof t !== "number" || !Number.isFinite(t)) return "—";
  if (t < 60) return `${t.toFixed(t < 10 ? 2 : 1)} s`;
  const h = Math.floor(t / 3600);
  const m = Math.floor((t % 3600) / 60);
  const sec = t % 60;
  const ss = h ? String(Math.floor(sec)).padStart(2, "0") : sec.toFixed(1).padStart(4, "0");
  return h ? `${h}:${String(m).padStart(2, "0")}:${ss}` : `${m}:${ss}`;
}

function fmtRate(hz) {
  if (typeof hz !== "number") return "—";
  return hz % 1000 === 0 || hz >= 10000 ? `${+(hz / 1000).toFixed(2)} kHz` : `${fmtCount(hz)} Hz`;
}

function fmtChannels(n) {
  if (typeof n !== "number") return "—";
  return n === 1 ? "1 (mono)" : n === 2 ? "2 (stereo)" : String(n);
}

/** What an audio header says, in one line: "2.50 s · 44.1 kHz · stereo · pcm 16-bit". */
function audioLine(a) {
  if (!a || typeof a !== "object") return "";
  const parts = [];
  if (typeof a.duration === "number") parts.push(fmtDuration(a.duration));
  if (typeof a.sample_rate === "number") parts.push(fmtRate(a.sample_rate));
  if (typeof a.channels === "number") parts.push(a.channels === 1 ? "mono" : a.channels === 2 ? "stereo" : `${a.channels} channels`);
  if (typeof a.codec === "string") parts.push(typeof a.bits === "number" ? `${a.codec} ${a.bits}-bit` : a.codec);
  return parts.join(" · ");
}

function fmtCount(n) {
  return typeof n === "number" ? n.toLocaleString("en-US") : (n ?? "—");
}

function fmtTime(t) {
  if (typeof t === "number") return new Date(t * 1000).toISOString().replace(".000Z", "Z");
  return t ?? "—";
}

/** A float to SIG_DIGITS significant digits (never rounding away whole digits: 12345.678
    is 12345.7); tiny and huge ones in exponent form. Integers stay whole. */
function fmtFloat(n) {
  if (typeof n !== "number" || !Number.isFinite(n) || Number.isInteger(n)) return String(n);
  const a = Math.abs(n);
  if (a < 1e-3 || a >= 1e15) return n.toExponential(SIG_DIGITS - 1).replace(/\.?0+e/, "e");
  const whole = Math.floor(Math.log10(a)) + 1;
  const text = n.toFixed(Math.max(1, SIG_DIGITS - whole)).replace(/0+$/, "");
  return text.endsWith(".") ? `${text}0` : text;
}

/** A number as a span: rounded where `round` (its whole value in the tooltip). */
function numberNode(n, round = true) {
  const shown = round ? fmtFloat(n) : String(n);
  const span = el("span", "j-num", shown);
  if (shown !== String(n)) span.title = String(n);
  return span;
}

function fmtNumber(n) {
  if (typeof n === "number") return fmtFloat(n);
  if (n && typeof n === "object" && "$float" in n) return String(n.$float);
  if (n && typeof n === "object" && "$decimal" in n) return String(n.$decimal);
  return n === null || n === undefined ? "—" : String(n);
}

// -- names and URLs --------------------------------------------------------------------

const SNAPSHOT_ID = /^[0-9a-f]{64}$/;

/** The first row of the page a URL asks for: `start`, else the page that holds `row`. */
function pageStart(q) {
  if (q.has("start")) return Math.max(0, Number.parseInt(q.get("start") ?? "0", 10) || 0);
  const r = q.get("row");
  return r !== null && /^[0-9]+$/.test(r) ? Math.floor(Number(r) / PAGE_ROWS) * PAGE_ROWS : 0;
}

/** Whether `text` can only be a dataset's reference (NAME@V, NAME@TAG, a snapshot id),
    never a backend or an object (those are BACKEND or BACKEND/KEY, with no '@'). */
function isDatasetRef(text) {
  const t = String(text);
  return SNAPSHOT_ID.test(t) || (!t.includes("/") && t.includes("@"));
}

/** `BACKEND/KEY` as a URL path: each segment encoded, the slashes kept. */
function namePath(name) {
  return String(name).split("/").map(encodeURIComponent).join("/");
}

function splitName(name) {
  const s = String(name);
  const i = s.indexOf("/");
  return i < 0 ? [s, ""] : [s.slice(0, i), s.slice(i + 1)];
}

/** The daemon's media route for bytes `offset .. offset+length` of `name`. */
function mediaUrl(name, offset, length) {
  const url = new URL(`/v1/inspect/media/${namePath(name)}`, location.origin);
  if (Number.isSafeInteger(offset) && Number.isSafeInteger(length)) {
    url.searchParams.set("offset", String(offset));
    url.searchParams.set("length", String(length));
  }
  return url.pathname + url.search;
}

/** This page's URL for a view. */
function pageUrl(params) {
  const qs = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v !== undefined && v !== null && v !== "") qs.set(k, String(v));
  }
  const text = qs.toString();
  return text ? `/inspect/?${text}` : "/inspect/";
}

/** A link to another view of this page: a real href (open in a new tab works), and a
    plain click navigates in place. */
function link(text, params, cls = "") {
  const a = el("a", cls, text);
  a.href = pageUrl(params);
  a.dataset.route = "";
  return a;
}

function navigate(url, { replace = false } = {}) {
  if (replace) history.replaceState(null, "", url);
  else history.pushState(null, "", url);
  route();
}

/** Change the URL to say where a view now is, without loading the view again. */
function remember(params, { replace = false } = {}) {
  const url = pageUrl(params);
  if (url === location.pathname + location.search) return;
  if (replace) history.replaceState(null, "", url);
  else history.pushState(null, "", url);
}

// -- the API ---------------------------------------------------------------------------

class ApiError extends Error {
  constructor(kind, message, status) {
    super(message);
    this.kind = kind;
    this.status = status;
  }
}

async function api(path, params = {}, signal = controller?.signal) {
  const url = new URL(path, location.origin);
  for (const [k, v] of Object.entries(params)) {
    if (v !== undefined && v !== null && v !== "") url.searchParams.set(k, String(v));
  }
  let response;
  try {
    response = await fetch(url, { signal, headers: { Accept: "application/json" } });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError("NetworkError", `could not reach the daemon for ${url.pathname}: ${err.message}`, 0);
  }
  const text = await response.text();
  let body = null;
  try { body = JSON.parse(text); } catch { body = null; }
  if (!response.ok) {
    const kind = body?.error ?? `HTTP ${response.status}`;
    const message = body?.message ?? (text.slice(0, 500) || response.statusText);
    throw new ApiError(String(kind), String(message), response.status);
  }
  if (body === null) throw new ApiError("BadAnswer", `${url.pathname} did not answer JSON`, response.status);
  return body;
}

const inspect = (op, params, signal) => api(`/v1/inspect/${op}`, params, signal);

// -- the error box ---------------------------------------------------------------------

function showError(err) {
  const box = document.getElementById("error");
  document.getElementById("error-kind").textContent = err instanceof ApiError ? err.kind : "Error";
  document.getElementById("error-message").textContent = err?.message ?? String(err);
  box.hidden = false;
}

function clearError() {
  document.getElementById("error").hidden = true;
}

/** Run `work`, showing what goes wrong in the error box; the page stays usable. */
async function guarded(work) {
  try {
    return await work();
  } catch (err) {
    if (err?.name !== "AbortError") showError(err);
    return undefined;
  }
}

// -- values ----------------------------------------------------------------------------

function isDollar(v) {
  return v !== null && typeof v === "object" && !Array.isArray(v)
    && Object.keys(v).some((k) => k.startsWith("$"));
}

function b64ToBytes(b64) {
  const text = atob(b64);
  const bytes = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i += 1) bytes[i] = text.charCodeAt(i);
  return bytes;
}

function hexLines(bytes, limit) {
  const lines = [];
  const n = Math.min(bytes.length, limit);
  for (let off = 0; off < n; off += 16) {
    const chunk = bytes.slice(off, Math.min(off + 16, n));
    const hex = Array.from(chunk, (b) => b.toString(16).padStart(2, "0")).join(" ");
    const ascii = Array.from(chunk, (b) => (b >= 0x20 && b < 0x7f ? String.fromCharCode(b) : ".")).join("");
    lines.push(`${off.toString(16).padStart(8, "0")}  ${hex.padEnd(47)}  ${ascii}`);
  }
  return lines.join("\n");
}

/** An <img>, <audio controls> or <video controls> for `src` (already checked). */
function mediaElement(kind, src, cls = "media") {
  let node;
  if (kind === "image") {
    node = el("img", cls);
    node.alt = "";
    node.decoding = "async";
    // Any image enlarges on a click (or Enter): see the lightbox below.
    node.classList.add("zoomable");
    node.tabIndex = 0;
    node.title = "click to enlarge";
  } else {
    node = el(kind, cls);
    node.controls = true;
    node.preload = "metadata";
  }
  node.src = src;
  return node;
}

/** A `$bytes` value: inline media when its sniffed type is allowed, else hex. */
function renderBytes(v, cls) {
  const type = typeof v.media_type === "string" ? v.media_type : null;
  const kind = type ? MEDIA[type] : undefined;
  const heard = audioLine(v.audio);
  const label = el("span", "bytes-label", `${fmtBytes(v.$bytes)}${type ? ` ${type}` : " binary"}${heard ? ` · ${heard}` : ""}`);
  const box = el("span", "bytes");
  if (typeof v.b64 === "string" && B64.test(v.b64)) {
    if (kind === "image") {
      add(box, mediaElement("image", `data:${type};base64,${v.b64}`, cls), label);
      return box;
    }
    if (kind === "audio" || kind === "video") {
      const url = URL.createObjectURL(new Blob([b64ToBytes(v.b64)], { type }));
      blobUrls.push(url);
      add(box, mediaElement(kind, url, cls), label);
      return box;
    }
    const bytes = b64ToBytes(v.b64.slice(0, Math.ceil(HEX_PREVIEW / 3) * 4));
    add(box, label, el("pre", "hex", hexLines(bytes, HEX_PREVIEW)));
    return box;
  }
  const ref = v.ref;
  if (ref && typeof ref === "object" && typeof ref.name === "string" && kind) {
    add(box, mediaElement(kind, mediaUrl(ref.name, ref.offset, ref.length), cls), label);
    return box;
  }
  if (ref && typeof ref === "object" && typeof ref.sample === "string") {
    add(box, label, " in ", link(ref.sample, { sample: ref.sample }));
    return box;
  }
  add(box, label);
  return box;
}

/** A `$media` value: the element pointed at the daemon's media route. */
function renderMedia(m, cls) {
  const box = el("span", "bytes");
  if (!m || typeof m.name !== "string") return add(box, "(media without a name)");
  const kind = MEDIA[m.media_type];
  const src = mediaUrl(m.name, m.offset, m.length);
  const heard = audioLine(m.audio);
  const label = el("span", "bytes-label", `${fmtBytes(m.length)} ${m.media_type ?? "binary"}${heard ? ` · ${heard}` : ""}`);
  if (kind) return add(box, mediaElement(kind, src, cls), label);
  // Not an allowed type: the daemon serves it as an attachment, never as a page.
  const a = el("a", "", "download");
  a.href = src;
  a.download = "";
  return add(box, label, " ", a);
}

function renderDollar(v, cls = "media") {
  if ("$bytes" in v) return renderBytes(v, cls);
  if ("$media" in v) return renderMedia(v.$media, cls);
  if ("$float" in v) return el("span", "j-num", String(v.$float));
  if ("$datetime" in v) return el("span", "j-date", String(v.$datetime));
  if ("$decimal" in v) return el("span", "j-num", String(v.$decimal));
  return null;
}

/** A string that shows its first FOLD_CHARS characters and a toggle for the rest:
    nothing is cut for good. `quote`: show it as JSON does (escapes, quotes). */
function foldedString(s, quote) {
  const full = quote ? JSON.stringify(s) : s;
  const span = el("span", quote ? "j-str" : "text");
  if (s.length <= FOLD_CHARS) {
    span.textContent = full;
    return span;
  }
  const head = quote ? `${JSON.stringify(s.slice(0, FOLD_CHARS)).slice(0, -1)}…"` : `${s.slice(0, FOLD_CHARS)}…`;
  const text = el("span", "", head);
  const toggle = button(`show all (${fmtCount(s.length)} characters)`, () => {
    const open = toggle.dataset.open === "1";
    text.textContent = open ? head : full;
    toggle.dataset.open = open ? "0" : "1";
    toggle.textContent = open ? `show all (${fmtCount(s.length)} characters)` : "fold";
  }, "fold-toggle");
  toggle.dataset.open = "0";
  add(span, text, " ", toggle);
  return span;
}

/** A value as pretty JSON (a <pre>): long strings and lists folded, binary and media
    inline. */
function renderJson(value, { round = true } = {}) {
  const pre = el("pre", "json");
  writeJson(pre, value, "", round);
  return pre;
}

function writeJson(parent, v, indent, round = true) {
  if (v === null) return add(parent, el("span", "j-null", "null"));
  if (typeof v === "boolean") return add(parent, el("span", "j-bool", String(v)));
  if (typeof v === "number") return add(parent, numberNode(v, round));
  if (typeof v === "string") return add(parent, foldedString(v, true));
  if (Array.isArray(v)) {
    if (v.length === 0) return add(parent, "[]");
    const inner = `${indent}  `;
    const flat = v.every((x) => typeof x === "number" || x === null || typeof x === "boolean");
    add(parent, "[");
    const items = (list, start) => {
      const frag = document.createDocumentFragment();
      list.forEach((x, i) => {
        const last = start + i === v.length - 1;
        if (flat) {
          writeJson(frag, x, inner, round);
          if (!last) add(frag, ", ");
        } else {
          add(frag, `\n${inner}`);
          writeJson(frag, x, inner, round);
          if (!last) add(frag, ",");
        }
      });
      return frag;
    };
    parent.append(items(v.slice(0, FOLD_ITEMS), 0));
    if (v.length > FOLD_ITEMS) {
      const rest = el("span", "folded");
      const toggle = button(`show all ${fmtCount(v.length)} items`, () => {
        rest.replaceChildren(items(v.slice(FOLD_ITEMS), FOLD_ITEMS));
        toggle.remove();
      }, "fold-toggle");
      add(parent, " ", toggle, rest);
    }
    return add(parent, flat ? "]" : `\n${indent}]`);
  }
  if (typeof v === "object") {
    if (isDollar(v)) {
      const node = renderDollar(v);
      if (node) return add(parent, node);
    }
    const keys = Object.keys(v);
    if (keys.length === 0) return add(parent, "{}");
    const inner = `${indent}  `;
    add(parent, "{");
    keys.forEach((k, i) => {
      add(parent, `\n${inner}`, el("span", "j-key", JSON.stringify(k)), ": ");
      writeJson(parent, v[k], inner, round);
      if (i < keys.length - 1) add(parent, ",");
    });
    return add(parent, `\n${indent}}`);
  }
  return add(parent, String(v));
}

/** One table cell's value: scalars as text, binary and media inline, the rest as JSON. */
function renderCell(v) {
  if (v === null || v === undefined) return el("span", "j-null", "null");
  if (typeof v === "string") return foldedString(v, false);
  if (typeof v === "number") return numberNode(v);
  if (typeof v === "boolean") return el("span", "j-num", String(v));
  if (isDollar(v)) {
    const node = renderDollar(v, "cell-media");
    if (node) return node;
  }
  return renderJson(v);
}

// -- browse: backends, listings, datasets ----------------------------------------------

/** The landing page: the configured backends (whatever they are called), the first one
    offered to browse, and the datasets where a registry is configured. */
async function viewHome() {
  // Both asked at once; the datasets panel wants the backends' names only to explain a
  // registry whose backend is not configured.
  const asked = api("/v1/stats");
  const names = asked.then((v) => (v.backends ?? []).map((b) => String(b.name)), () => []);
  const [stats, datasets] = await Promise.all([
    asked.then((v) => ({ ok: v }), (err) => ({ err })),
    datasetsPanel(names).then((v) => ({ ok: v }), (err) => ({ err })),
  ]);
  if (stats.err?.name === "AbortError") throw stats.err;
  const configured = (stats.ok?.backends ?? []).map((b) => String(b.name));
  const frag = document.createDocumentFragment();
  const backends = section("Backends");
  backends.classList.add("backends");
  if (stats.ok) {
    const { table: t, body } = table(["backend", "kind", "circuit"]);
    for (const b of stats.ok.backends ?? []) {
      body.append(row([
        link(b.name, { list: b.name }),
        b.scheme ?? "—",
        b.circuit_open ? el("span", "bad", "open: failing") : el("span", "good", "closed"),
      ]));
    }
    if (configured.length) {
      add(backends, add(el("p", "start-here"), "Start by browsing ", link(`${configured[0]}/`, { list: configured[0] }, "first-backend"),
        configured.length > 1 ? `, the first of ${configured.length} backends.` : ", the configured backend."));
    } else {
      backends.append(el("p", "muted", "no backend is configured"));
    }
    backends.append(t);
  } else {
    showError(stats.err);
  }
  frag.append(backends);
  if (datasets.ok) frag.append(datasets.ok);
  else if (datasets.err?.name === "AbortError") throw datasets.err;
  else frag.append(section("Datasets", el("p", "muted", `could not list datasets: ${datasets.err?.message}`)));
  return frag;
}

/** The datasets, a page at a time. Where the registry's backend is not configured (the
    default registry is local/datasets, and a config need not have a backend `local`),
    it says how to point the registry at one instead of failing. */
async function datasetsPanel(configured = Promise.resolve([])) {
  const s = section("Datasets");
  s.classList.add("datasets");
  const { table: t, body } = table(["dataset", "latest", "created", "tags"]);
  const more = button("more", () => guarded(() => load(more.dataset.next)), "more");
  const load = async (startAfter) => {
    const page = await inspect("datasets", { limit: DATASETS_PAGE, start_after: startAfter });
    for (const d of page.datasets ?? []) {
      body.append(row([
        link(d.name, { dataset: d.name }),
        d.latest === null || d.latest === undefined ? "—" : link(String(d.latest), { snapshot: `${d.name}@${d.latest}` }),
        fmtTime(d.created),
        tagsText(d.tags),
      ]));
    }
    more.hidden = !page.next;
    more.dataset.next = page.next ?? "";
    if (!body.firstChild) body.append(row([el("span", "muted", "no datasets registered")]));
  };
  try {
    await load(undefined);
  } catch (err) {
    if (!(err instanceof ApiError) || err.kind !== "UnknownBackendError") throw err;
    const note = el("div", "registry-missing");
    const first = (await configured)[0];
    add(note, el("p", "", "No dataset registry on this node: the registry is kept in a backend this config does not have."),
      el("p", "muted", err.message));
    if (first) {
      add(note, el("p", "", "To register datasets, point the registry at a writable backend of this config, e.g.:"),
        el("pre", "toml", `[datasets]\nregistry = "${first}/datasets"`));
    }
    add(s, note);
    return s;
  }
  add(s, t, more);
  return s;
}

function tagsText(tags) {
  if (!tags) return "";
  if (Array.isArray(tags)) return tags.join(", ");
  if (typeof tags === "object") return Object.entries(tags).map(([k, v]) => `${k}→${v}`).join(", ");
  return String(tags);
}

/** A listing of BACKEND/PREFIX; a dataset's reference (NAME, NAME@V, NAME@TAG, an id,
    and a name with '/' such as text/web@2) lists the folder its snapshot was registered
    from. A name is a dataset's where its first segment is no configured backend; one
    whose first segment is a backend is that backend's folder, unless it has '@' and a
    dataset has that name, or the folder is empty and a dataset has that name. */
async function viewList(target, recursive) {
  const name = String(target);
  if (isDatasetRef(name)) return listSnapshotFolder(name, recursive);
  const stats = await api("/v1/stats");
  const backends = new Set((stats.backends ?? []).map((b) => String(b.name)));
  if (!backends.has(splitName(name)[0])) {
    return listSnapshotFolder(name, recursive).catch((err) => {
      if (err instanceof ApiError && (err.kind === "DatasetNotFoundError" || err.kind === "InvalidRequestError")) {
        const what = name.includes("/") ? `${splitName(name)[0]} is not a backend (configured: ${[...backends].join(", ") || "none"}) and ${name} is not a dataset` : `${name} is neither a backend (configured: ${[...backends].join(", ") || "none"}) nor a dataset`;
        throw new ApiError("UnknownBackendError", what, 404);
      }
      throw err;
    });
  }
  if (name.includes("@")) {
    // BACKEND/KEY@X: a dataset's where one is so named (text/web@2 with a backend `text`)
    try {
      return await listSnapshotFolder(name, recursive);
    } catch (err) {
      if (!(err instanceof ApiError) || (err.kind !== "DatasetNotFoundError" && err.kind !== "InvalidRequestError")) throw err;
    }
  }
  // BACKEND/PREFIX: its folder, or a dataset's where the folder is empty and one is so
  // named (local/pets, with no key below local/pets/)
  const listing = await listFolder(name, recursive);
  if (listing.dataset?.empty !== "true") return listing;
  try {
    return await listSnapshotFolder(name, recursive);
  } catch (err) {
    if (!(err instanceof ApiError) || (err.kind !== "DatasetNotFoundError" && err.kind !== "InvalidRequestError")) throw err;
    return listing;
  }
}

async function listSnapshotFolder(ref, recursive) {
  const snap = await inspect("snapshot", { ref, start: 0, count: 1 });
  const folder = snap.prefix ? `${snap.backend}/${String(snap.prefix).replace(/\/+$/, "")}` : snap.backend;
  const listing = await listFolder(folder, recursive);
  const note = el("p", "muted snapshot-folder");
  const named = snapshotRef(snap);
  add(note, "the folder of ", link(named, { snapshot: named }),
    named === snap.snapshot ? "" : ` (snapshot ${String(snap.snapshot).slice(0, 12)}…)`,
    ": what it lists now, which may have changed since");
  listing.querySelector("h2")?.after(note);
  return listing;
}

/** A snapshot's reference to show and link: NAME@V where the registry named it, else its id. */
function snapshotRef(snap, dsName = snap.name) {
  return dsName && typeof snap.version === "number" ? `${dsName}@${snap.version}` : String(snap.snapshot);
}

async function listFolder(target, recursive) {
  const [backend, rawPrefix] = splitName(target);
  const prefix = rawPrefix.replace(/\/+$/, "");
  const s = section("Objects");
  const crumbs = el("p", "crumbs mono");
  add(crumbs, link(backend, { list: backend }));
  let acc = "";
  for (const part of prefix ? prefix.split("/") : []) {
    acc = acc ? `${acc}/${part}` : part;
    add(crumbs, " / ", link(part, { list: `${backend}/${acc}` }));
  }
  const { table: t, body } = table(["name", "size", "modified"], "listing");
  const count = el("span", "muted");
  const more = button("more", () => guarded(() => load(more.dataset.next)), "more");
  let shown = 0;
  const base = prefix ? `${backend}/${prefix}/` : `${backend}/`;
  const load = async (startAfter) => {
    const path = prefix ? `/v1/list/${namePath(backend)}/${namePath(prefix)}` : `/v1/list/${namePath(backend)}`;
    const page = await api(path, { limit: LIST_PAGE, start_after: startAfter, recursive: recursive ? "true" : undefined });
    const frag = document.createDocumentFragment();
    for (const e of page.entries ?? []) {
      const name = String(e.name);
      const short = name.startsWith(base) ? name.slice(base.length) : name;
      frag.append(e.type === "directory"
        ? row([link(`${short}/`, { list: name }, "dir"), "", ""])
        : row([link(short, { open: name }), fmtBytes(e.size), fmtTime(e.modified)]));
    }
    body.append(frag);
    shown += (page.entries ?? []).length;
    count.textContent = `${fmtCount(shown)} entries${page.next ? " so far" : ""}`;
    more.hidden = !page.next;
    more.dataset.next = page.next ?? "";
  };
  await load(undefined);
  if (shown === 0) s.dataset.empty = "true";  // viewList then asks if a dataset is so named
  const deep = el("label", "recursive");
  const box = el("input");
  box.type = "checkbox";
  box.checked = recursive;
  box.addEventListener("change", () => navigate(pageUrl({ list: target, recursive: box.checked ? "true" : undefined })));
  add(deep, box, " every key below (recursive)");
  add(s, add(crumbs, " ", deep), t, add(el("p", "pager"), more, " ", count));
  return s;
}

async function viewDatasets() {
  return datasetsPanel(api("/v1/stats").then((v) => (v.backends ?? []).map((b) => String(b.name)), () => []));
}

/** A dataset's versions; a reference (NAME@V, NAME@TAG, an id) shows its dataset with
    that version marked. */
async function viewDataset(ref) {
  // The daemon finds the dataset of a version or an id, and says which one it named.
  const d = await inspect("dataset", { name: ref });
  const marked = typeof d.marked === "number" ? d.marked : null;
  const versions = d.versions ?? [];
  const s = section(`Dataset ${d.name}`);
  const { table: t, body } = table(["version", "snapshot", "created", "samples", "bytes", "tags", ""]);
  for (const v of versions) {
    const ref = `${d.name}@${v.version}`;
    const prev = versions.filter((w) => w.version < v.version).sort((x, y) => y.version - x.version)[0];
    const tr = row([
      link(String(v.version), { snapshot: ref }),
      el("span", "mono", v.snapshot ?? "—"),
      fmtTime(v.created),
      fmtCount(v.samples),
      fmtBytes(v.bytes),
      tagsText(v.tags),
      prev ? link(`diff with ${prev.version}`, { diff: `${d.name}@${prev.version}..${ref}` }) : "",
    ]);
    tr.dataset.version = String(v.version);
    if (v.version === marked) tr.classList.add("focus");
    body.append(tr);
  }
  add(s, t);
  if (versions.length >= 2) {
    const form = el("form", "inline-form");
    const pick = (selected) => {
      const sel = el("select");
      for (const v of versions) {
        const o = el("option", "", String(v.version));
        o.value = String(v.version);
        sel.append(o);
      }
      sel.value = String(selected);
      return sel;
    };
    const a = pick(versions[0].version);
    const b = pick(versions[versions.length - 1].version);
    const go = el("button", "", "diff");
    go.type = "submit";
    add(form, "diff ", a, " .. ", b, " ", go);
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      navigate(pageUrl({ diff: `${d.name}@${a.value}..${d.name}@${b.value}` }));
    });
    s.append(form);
  }
  return s;
}

/** A snapshot (`?snapshot=REF` or `?open=REF`, REF a dataset's NAME, NAME@V, NAME@TAG or
    a snapshot id): its summary and a tab each for its members (the default), its samples
    as rows (by global index: `start`, `row`) and, where its schema is RL data, its
    rollouts or episodes. `key` is the parameter that named it, kept in its links. */
async function viewSnapshot(ref, q = new URLSearchParams(), key = "snapshot", opened = null) {
  const map = q.get("map") ?? undefined;
  const first = opened ?? (String(ref).includes("/")
    ? await inspect("snapshot", { ref, start: 0, count: SNAPSHOT_PAGE })
    : await inspect("open", { name: ref, map }));
  // `open` answers `name` as asked and `dataset` as registered; an id has neither.
  const dsName = first.kind === "snapshot" ? first.dataset : first.name;
  const shown = snapshotRef(first, dsName);
  const frag = document.createDocumentFragment();
  const tabs = ["members", "rows"];
  if (first.rl === "rollouts" || first.rl === "episodes") tabs.push("rl");
  let tab = q.get("tab");
  if (!tabs.includes(tab)) tab = q.has("row") || q.has("start") ? "rows" : "members";
  const bar = el("div", "tabbar");
  for (const t of tabs) {
    const label = t === "rl" ? `RL ${first.rl}` : t;
    const a = link(label, { [key]: ref, map, tab: t === "members" ? undefined : t }, t === tab ? "active" : "");
    a.dataset.tab = t;
    bar.append(a);
  }
  const s = section(`Snapshot ${shown}`);
  s.classList.add("snapshot-head");
  frag.append(s, bar);
  if (tab === "rows") {
    const start = pageStart(q);
    const info = { kind: "snapshot", format: first.format, schema: first.schema };
    frag.append(await rowsPanel(ref, info, start, q, null, { [key]: ref, map, tab: "rows" }));
  } else if (tab === "rl") {
    frag.append(await rlPanel(ref, { rl: first.rl }, q));
  }
  const excluded = Array.isArray(first.excluded) ? first.excluded : [];
  add(s, facts([
    ["ref", first.ref],
    ["snapshot", first.snapshot],
    ["where", `${first.backend}/${first.prefix ?? ""}`],
    ["format", first.format],
    ["samples", fmtCount(first.samples)],
    ["bytes", fmtBytes(first.bytes)],
    ["members", fmtCount(first.members_total)],
    ["frozen", first.frozen ? "yes" : "no"],
    ["excluded", fmtCount(excluded.length)],
    ["dataset", link(dsName ?? "find it", { dataset: shown })],
  ]));
  if (tab !== "members") return frag;
  if (first.schema) add(s, add(el("details"), el("summary", "", "schema"), renderJson(first.schema)));
  if (excluded.length) add(s, add(el("details"), el("summary", "", "excluded members"), renderJson(excluded)));
  const sampleRef = shown;
  const members = section("Members");
  const { table: t, body } = table(["member", "size", "samples", "first sample"], "members");
  const more = button("more", () => guarded(() => load(Number(more.dataset.next))), "more");
  const count = el("span", "muted");
  const put = (page) => {
    const frag = document.createDocumentFragment();
    for (const m of page.members ?? []) {
      frag.append(row([
        link(m.key, { open: `${page.backend}/${m.key}` }),
        fmtBytes(m.size),
        fmtCount(m.samples),
        typeof m.first === "number" ? link(`#${m.first}`, { sample: `${sampleRef}#${m.first}` }) : "—",
      ]));
    }
    body.append(frag);
    const next = typeof page.next === "number" ? page.next : (page.start ?? 0) + (page.members ?? []).length;
    const total = page.members_total ?? 0;
    more.hidden = page.next === null || next >= total || (page.members ?? []).length === 0;
    more.dataset.next = String(next);
    count.textContent = `${fmtCount(Math.min(next, total))} of ${fmtCount(total)} members`;
  };
  const load = async (start) => {
    const page = await inspect("snapshot", { ref, start, count: SNAPSHOT_PAGE });
    put({ ...page, start });
  };
  put({ ...first, start: 0 });
  add(members, t, add(el("p", "pager"), more, " ", count));
  frag.append(members);
  return frag;
}

async function viewDiff(spec) {
  const at = spec.indexOf("..");
  if (at < 0) throw new ApiError("InvalidRequestError", `diff wants A..B (two refs); got ${JSON.stringify(spec)}`, 400);
  const a = spec.slice(0, at);
  const b = spec.slice(at + 2);
  const d = await inspect("diff", { a, b });
  const s = section(`Diff ${d.a ?? a} .. ${d.b ?? b}`);
  const more = d.more && typeof d.more === "object" ? d.more : {};
  add(s, facts([
    ["added", fmtCount((d.added ?? []).length + (more.added ?? 0))],
    ["removed", fmtCount((d.removed ?? []).length + (more.removed ?? 0))],
    ["changed", fmtCount((d.changed ?? []).length + (more.changed ?? 0))],
    ["same", fmtCount(d.same)],
  ]));
  for (const kind of ["added", "removed", "changed"]) {
    const items = d[kind] ?? [];
    const list = el("ul", `diff-list diff-${kind}`);
    for (const item of items) {
      const li = el("li", "mono");
      if (item && typeof item === "object") {
        add(li, String(item.key ?? ""));
        const rest = Object.fromEntries(Object.entries(item).filter(([k]) => k !== "key"));
        if (Object.keys(rest).length) add(li, " ", el("span", "muted", JSON.stringify(rest)));
      } else {
        add(li, String(item));
      }
      list.append(li);
    }
    if (more[kind]) list.append(el("li", "muted", `and ${fmtCount(more[kind])} more`));
    if (!items.length) list.append(el("li", "muted", "none"));
    add(s, el("h3", "", kind), list);
  }
  return s;
}

// -- one object ------------------------------------------------------------------------

const ROW_KINDS = new Set(["parquet", "jsonl", "text", "wds", "mds"]);
const ROW_SUFFIX = /\.(parquet|pq|jsonl|ndjson|jsonl\.zst|txt|tar|mds)$/i;

async function viewOpen(name, q) {
  const signal = controller.signal;
  // A row-like file's first page is asked for beside `open`, not after it: one round
  // trip to the first rows (the speed target), one request for the whole page.
  const start = pageStart(q);
  const format = q.get("format") ?? undefined;
  const early = (format ? ROW_KINDS.has(format) : ROW_SUFFIX.test(name)) && (q.get("tab") ?? "rows") === "rows"
    ? inspect("rows", { name, start, count: PAGE_ROWS, format }, signal)
    : null;
  early?.catch(() => {});
  const info = await inspect("open", { name, format, map: q.get("map") ?? undefined });
  if (info.kind === "snapshot") return viewSnapshot(name, q, "open", info);
  const frag = document.createDocumentFragment();
  const head = section(String(info.name ?? name));
  head.classList.add("object-head");
  add(head, facts([
    ["kind", info.kind],
    ["size", fmtBytes(info.size)],
    ["version", info.version],
    ["media type", info.media_type ?? undefined],
    ["rows", info.num_rows !== undefined ? fmtCount(info.num_rows)
      : info.samples_total !== undefined ? (info.samples_total === null ? `${fmtCount(info.samples_indexed ?? 0)}+ (indexed as far as read)` : fmtCount(info.samples_total))
        : info.lines !== undefined ? (info.lines === null ? "not counted yet" : fmtCount(info.lines)) : undefined],
    ["encoding", info.encoding],
    ["RL data", info.rl ?? undefined],
  ]));
  const [backend, key] = splitName(info.name ?? name);
  const parent = key.includes("/") ? `${backend}/${key.slice(0, key.lastIndexOf("/"))}` : backend;
  add(head, add(el("p", "crumbs"), link(`← ${parent}/`, { list: parent })));
  frag.append(head);

  const kind = info.kind;
  if (kind === "image" || kind === "audio" || kind === "video") {
    const panel = section(kind, mediaOf(info, name));
    if (kind === "audio") panel.append(audioFacts(info.audio));
    frag.append(panel);
    return frag;
  }
  if (kind === "binary" || !ROW_KINDS.has(kind)) {
    frag.append(binaryPanel(info));
    return frag;
  }
  const tabs = ["rows"];
  if (kind === "parquet" || kind === "mds" || kind === "wds") tabs.push("structure");
  if (info.rl === "rollouts" || info.rl === "episodes") tabs.push("rl");
  // Rows are the default view (the first page was asked for beside `open`); an RL
  // file gets its RL tab beside them.
  let tab = q.get("tab");
  if (!tabs.includes(tab)) tab = "rows";
  const bar = el("div", "tabbar");
  for (const t of tabs) {
    const label = t === "rl" ? `RL ${info.rl}` : t;
    const a = link(label, { open: name, format, tab: t === "rows" ? undefined : t }, t === tab ? "active" : "");
    a.dataset.tab = t;
    bar.append(a);
  }
  frag.append(bar);
  if (tab === "structure") frag.append(structurePanel(info));
  else if (tab === "rl") frag.append(await rlPanel(name, info, q));
  else frag.append(await rowsPanel(name, info, start, q, early));
  return frag;
}

function mediaOf(info, name) {
  const m = info.$media ?? info.media?.$media ?? info.media;
  const kind = MEDIA[info.media_type];
  if (!kind) return el("p", "muted", `${info.media_type ?? "this type"} is not shown inline`);
  const src = m && typeof m.name === "string" ? mediaUrl(m.name, m.offset, m.length) : mediaUrl(name);
  const node = mediaElement(kind, src, "media whole");
  return node;
}

/** The audio header's facts (the worker read them: docs/inspector.md, "Audio"). */
function audioFacts(a) {
  if (!a || typeof a !== "object") {
    return el("p", "muted audio-facts", "its header does not say its duration, rate and channels (the player may still)");
  }
  const dl = facts([
    ["duration", fmtDuration(a.duration)],
    ["sample rate", fmtRate(a.sample_rate)],
    ["channels", fmtChannels(a.channels)],
    ["codec", a.codec ?? "—"],
    ["bits", typeof a.bits === "number" ? String(a.bits) : undefined],
  ]);
  dl.classList.add("audio-facts");
  return dl;
}

function binaryPanel(info) {
  const s = section("bytes");
  if (typeof info.hex === "string") {
    const clean = info.hex.replace(/[^0-9a-fA-F]/g, "");
    const bytes = new Uint8Array(clean.length >> 1);
    for (let i = 0; i < bytes.length; i += 1) bytes[i] = Number.parseInt(clean.slice(i * 2, i * 2 + 2), 16);
    add(s, el("h3", "", `first ${fmtBytes(bytes.length)} as hex`), el("pre", "hex", hexLines(bytes, bytes.length)));
  }
  if (typeof info.text === "string") add(s, el("h3", "", "as text"), el("pre", "text-block", info.text));
  return s;
}

function structurePanel(info) {
  const frag = document.createDocumentFragment();
  if (Array.isArray(info.schema)) {
    const { table: t, body } = table(["column", "type"], "schema");
    for (const c of info.schema) body.append(row([el("span", "mono", c.name), el("span", "mono", c.type)]));
    frag.append(section("Schema", t));
  }
  if (Array.isArray(info.columns)) {
    const { table: t, body } = table(["column", "encoding"], "schema");
    for (const c of info.columns) body.append(row([el("span", "mono", c.name), el("span", "mono", c.encoding)]));
    frag.append(section("Columns", t));
  }
  if (Array.isArray(info.row_groups)) {
    const s = section(`Row groups (${fmtCount(info.row_groups_total ?? info.row_groups.length)})`);
    for (const g of info.row_groups) {
      const d = el("details", "row-group");
      add(d, el("summary", "mono", `#${g.index}: ${fmtCount(g.rows)} rows from row ${fmtCount(g.first_row)}, ${fmtBytes(g.bytes)}`));
      const { table: t, body } = table(["column", "min", "max", "nulls", "compressed"], "stats");
      for (const c of g.columns ?? []) {
        body.append(row([el("span", "mono", c.name), renderCell(c.min), renderCell(c.max), fmtCount(c.nulls), fmtBytes(c.compressed_bytes)]));
      }
      d.append(t);
      s.append(d);
    }
    if ((info.row_groups_total ?? 0) > info.row_groups.length) {
      s.append(el("p", "muted", `the first ${fmtCount(info.row_groups.length)} groups of ${fmtCount(info.row_groups_total)}`));
    }
    frag.append(s);
  }
  if (info.metadata && typeof info.metadata === "object" && Object.keys(info.metadata).length) {
    frag.append(section("Metadata", renderJson(info.metadata)));
  }
  if (info.shards !== undefined) frag.append(section("Shards", renderJson(info.shards)));
  if (!frag.firstChild) frag.append(el("p", "muted", "no structure to show"));
  return frag;
}

/** Rows of a row-like object, a page at a time: first/prev/next/last and "go to row". */
async function rowsPanel(name, info, start, q, early, here = null) {
  // A snapshot's rows are its samples: asked by its reference, with no format (a format
  // would make the name an object's), shown as its members' format shows them.
  const rowKind = info.kind === "snapshot" ? (info.format ?? "jsonl") : info.kind;
  const rowFormat = info.kind === "snapshot" ? undefined : info.kind;
  const base = here ?? { open: name, format: q.get("format") ?? undefined };
  const s = section("Rows");
  s.classList.add("rows-panel");
  const status = el("span", "status muted");
  const nav = el("div", "pager");
  const go = {};
  for (const [id, label] of [["first", "« first"], ["prev", "‹ prev"], ["next", "next ›"], ["last", "last »"]]) {
    go[id] = button(label, () => guarded(() => turn(id)));
    go[id].dataset.page = id;
  }
  const form = el("form", "goto");
  const input = el("input");
  input.id = "goto-row";
  input.type = "number";
  input.min = "0";
  input.placeholder = "row";
  const submit = el("button", "", "go to row");
  submit.type = "submit";
  add(form, input, " ", submit);
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const n = Number.parseInt(input.value, 10);
    guarded(async () => {
      if (!Number.isSafeInteger(n) || n < 0) throw new ApiError("InvalidRequestError", `a row number is a whole number from 0; got ${JSON.stringify(input.value)}`, 400);
      if (typeof page.total === "number" && n >= page.total) {
        throw new ApiError("InvalidRequestError", `row ${n} is past the end: the object has ${fmtCount(page.total)} rows (0 to ${fmtCount(page.total - 1)})`, 400);
      }
      await load(Math.floor(n / PAGE_ROWS) * PAGE_ROWS, n);
    });
  });
  add(nav, go.first, go.prev, status, go.next, go.last, form);
  const holder = el("div", "rows-holder");
  add(s, nav, holder);
  let page = { start, total: null, next: null, rows: [] };

  const columnsOf = (rows) => {
    const names = Array.isArray(info.schema)
      ? info.schema.map((c) => (Array.isArray(c) ? String(c[0]) : c && typeof c === "object" ? String(c.name) : String(c)))
      : Array.isArray(info.columns) ? info.columns.map((c) => c.name) : [];
    const seen = new Set(names);
    for (const r of rows) {
      if (r.value && typeof r.value === "object" && !Array.isArray(r.value) && !isDollar(r.value)) {
        for (const k of Object.keys(r.value)) if (!seen.has(k)) { seen.add(k); names.push(k); }
      }
    }
    return names;
  };

  const render = (answer, focus) => {
    const rows = answer.rows ?? [];
    let body;
    if (rowKind === "parquet" || rowKind === "mds") {
      const cols = columnsOf(rows);
      const { table: t, body: tb } = table(["#", ...cols], "rows-table");
      for (const r of rows) {
        const tr = el("tr");
        tr.dataset.index = String(r.index);
        tr.append(el("td", "index mono", r.index));
        const value = r.value && typeof r.value === "object" ? r.value : {};
        for (const c of cols) tr.append(add(el("td"), renderCell(value[c])));
        tb.append(tr);
      }
      body = t;
    } else if (rowKind === "text") {
      const t = el("table", "data-table lines rows-table");
      const tb = el("tbody");
      for (const r of rows) {
        const tr = el("tr");
        tr.dataset.index = String(r.index);
        add(tr, el("td", "index mono", r.index), add(el("td", "line"), typeof r.value === "string" ? foldedString(r.value, false) : renderJson(r.value)));
        tb.append(tr);
      }
      t.append(tb);
      body = t;
    } else {
      body = el("div", "records rows-table");
      for (const r of rows) {
        const card = el("article", "record");
        card.dataset.index = String(r.index);
        add(card, add(el("header", "record-head mono"), link(`#${r.index}`, { sample: `${name}#${r.index}` })), renderJson(r.value));
        body.append(card);
      }
    }
    if (!rows.length) body = el("p", "muted", "no rows here");
    holder.replaceChildren(body);
    const last = rows.length ? rows[rows.length - 1].index : answer.start;
    const total = typeof answer.total === "number" ? answer.total : null;
    status.textContent = rows.length
      ? `rows ${fmtCount(rows[0].index)}–${fmtCount(last)} of ${total === null ? "?" : fmtCount(total)}`
      : `no rows from ${fmtCount(answer.start)} (of ${total === null ? "?" : fmtCount(total)})`;
    go.first.disabled = answer.start === 0;
    go.prev.disabled = answer.start === 0;
    go.next.disabled = answer.next === null || answer.next === undefined;
    go.last.disabled = total === null || (answer.next === null || answer.next === undefined);
    if (focus !== undefined) {
      const target = holder.querySelector(`[data-index="${focus}"]`);
      if (target) {
        target.classList.add("focus");
        requestAnimationFrame(() => target.scrollIntoView({ block: "center" }));
      }
    }
  };

  const load = async (at, focus, { replace = false } = {}, ready = null) => {
    const answer = await (ready ?? inspect("rows", { name, start: at, count: PAGE_ROWS, format: rowFormat }));
    page = { ...answer, start: answer.start ?? at };
    render(page, focus);
    remember({ ...base, start: page.start || undefined, row: focus }, { replace });
  };

  const turn = async (id) => {
    if (id === "first") return load(0);
    if (id === "prev") return load(Math.max(0, page.start - PAGE_ROWS));
    if (id === "next") return page.next === null ? undefined : load(page.next);
    const total = page.total;
    return load(Math.max(0, Math.floor((total - 1) / PAGE_ROWS) * PAGE_ROWS));
  };

  const rowParam = q.get("row");
  const focus = rowParam !== null && /^[0-9]+$/.test(rowParam) ? Number(rowParam) : undefined;
  let ready = early;
  if (ready) ready = ready.catch(() => null).then((a) => a ?? inspect("rows", { name, start, count: PAGE_ROWS, format: rowFormat }));
  await load(start, focus, { replace: true }, ready);
  return s;
}

// -- RL --------------------------------------------------------------------------------

async function rlPanel(name, info, q) {
  const s = section(info.rl === "episodes" ? "Episodes" : "Rollouts");
  s.classList.add("rl-panel");
  const nav = el("div", "pager");
  const status = el("span", "status muted");
  const starts = [];
  const holder = el("div");
  const legend = el("div", "rl-legend");
  const prev = button("‹ prev", () => guarded(() => load(starts.length >= 2 ? starts[starts.length - 2] : 0, true)));
  const next = button("next ›", () => guarded(() => load(Number(next.dataset.next))));
  add(nav, prev, status, next);
  add(s, nav, legend, holder);
  const load = async (start, back = false) => {
    const answer = await inspect("rl", { name, start, count: RL_PAGE, map: q.get("map") ?? undefined });
    if (back) starts.pop(); else if (starts[starts.length - 1] !== start) starts.push(start);
    if (answer.kind === "episodes") {
      legend.hidden = true;
      holder.replaceChildren(renderEpisodes(answer));
    } else {
      const scale = rewardScale(answer.groups ?? []);
      legend.hidden = false;
      legend.replaceChildren(rewardLegend(scale), logprobLegend());
      holder.replaceChildren(renderRollouts(name, answer, scale));
    }
    const n = answer.kind === "episodes" ? (answer.episodes ?? []).length : (answer.groups ?? []).length;
    status.textContent = `${answer.kind === "episodes" ? "episodes" : "groups"}: ${n}, from row ${fmtCount(answer.start ?? start)}`;
    prev.disabled = (answer.start ?? start) === 0;
    next.disabled = answer.next === null || answer.next === undefined;
    next.dataset.next = String(answer.next ?? "");
  };
  await load(0);
  return s;
}

/** The page's rewards, lowest and highest: the scale the rollouts are coloured on. */
function rewardScale(groups) {
  const rewards = [];
  for (const g of groups) for (const r of g.rollouts ?? []) if (typeof r.reward === "number" && Number.isFinite(r.reward)) rewards.push(r.reward);
  return rewards.length
    ? { low: rewards.reduce((a, b) => Math.min(a, b)), high: rewards.reduce((a, b) => Math.max(a, b)) }
    : null;
}

/** Which of the REWARD_LEVELS a reward is at on the page's scale (2, the middle, when
    every reward is the same or it is not a number). */
function rewardLevel(reward, scale) {
  if (!scale || typeof reward !== "number" || !Number.isFinite(reward) || scale.high === scale.low) return 2;
  const at = (reward - scale.low) / (scale.high - scale.low);
  return Math.min(REWARD_LEVELS.length - 1, Math.floor(at * REWARD_LEVELS.length));
}

function rewardLegend(scale) {
  const box = el("div", "legend reward-legend");
  add(box, el("span", "label", "reward"), " ");
  if (scale) add(box, el("span", "mono", fmtFloat(scale.low)), " ");
  REWARD_LEVELS.forEach((word, i) => add(box, el("span", `rl-key reward-${i}`, word)));
  if (scale) add(box, " ", el("span", "mono", fmtFloat(scale.high)));
  add(box, el("span", "muted", " · lowest to highest on this page"));
  return box;
}

function logprobLegend() {
  const box = el("div", "legend logprob-legend");
  add(box, el("span", "label", "logprobs"), " one bar per token, its height the token's probability (e",
    el("sup", "", "logprob"), "; full height: 1) · ",
    el("span", "rl-key lp-key"), " p ≥ 0.5 · ", el("span", "rl-key lp-key low"), " p < 0.5");
  return box;
}

function renderRollouts(name, answer, scale) {
  const frag = document.createDocumentFragment();
  for (const g of answer.groups ?? []) {
    const box = el("article", "rl-group");
    const rollouts = g.rollouts ?? []; // sorted by reward by the daemon's worker
    const head = el("header", "rl-group-head");
    add(head, el("strong", "", g.group === null || g.group === undefined ? "group (by prompt)" : `group ${typeof g.group === "string" ? g.group : JSON.stringify(g.group)}`),
      el("span", "muted", ` · ${rollouts.length} rollouts`));
    const prompt = el("div", "rl-prompt");
    add(prompt, el("div", "label", "prompt"), wholeValue(g.prompt));
    // The group's rollouts side by side where the width allows (a grid), best first.
    const grid = el("div", "rollouts");
    add(box, head, prompt, grid);
    rollouts.forEach((r, rank) => {
      const level = rewardLevel(r.reward, scale);
      const card = el("div", `rollout reward-${level}`);
      card.dataset.reward = String(r.reward);
      card.dataset.index = String(r.index);
      card.dataset.level = REWARD_LEVELS[level];
      if (rank === 0) card.classList.add("best");
      const line = el("div", "rollout-head");
      const badge = el("strong", `reward-badge reward-${level}`);
      add(badge, el("span", "reward mono", fmtNumber(r.reward)), el("span", "reward-level", ` ${REWARD_LEVELS[level]}`));
      if (typeof r.reward === "number") badge.title = `reward ${r.reward}: ${REWARD_LEVELS[level]} on this page's scale`;
      add(line,
        el("span", "rollout-rank", `#${rank + 1}`),
        el("span", "", " reward "), badge,
        r.advantage !== undefined && r.advantage !== null ? add(el("span"), " advantage ", el("span", "advantage mono", fmtNumber(r.advantage))) : null,
        el("span", "muted", " · row "), link(String(r.index), { sample: `${name}#${r.index}` }));
      add(card, line, add(el("div", "completion"), wholeValue(r.completion)));
      if (Array.isArray(r.logprobs) && r.logprobs.length) card.append(logprobsView(r.logprobs));
      if (r.fields && typeof r.fields === "object" && Object.keys(r.fields).length) {
        add(card, add(el("details", "fields"), el("summary", "", "other fields"), renderJson(r.fields)));
      }
      grid.append(card);
    });
    frag.append(box);
  }
  if (!frag.firstChild) frag.append(el("p", "muted", "no rollouts here"));
  return frag;
}

/** A value shown whole: text as text (no folding), anything else as JSON. */
function wholeValue(v) {
  if (typeof v === "string") return el("pre", "whole", v);
  if (v !== null && typeof v === "object" && isDollar(v)) return renderDollar(v) ?? renderJson(v);
  return renderJson(v);
}

/** Per-token logprobs: a strip of bars (taller: more likely), and every value. */
function logprobsView(values) {
  const box = el("div", "logprobs");
  const n = values.length;
  const w = 4;
  const strip = svg("svg", { class: "logprob-strip", viewBox: `0 0 ${n * w} 40`, preserveAspectRatio: "none", role: "img" });
  strip.style.width = `${Math.min(100, Math.max(25, n * 2))}%`;
  values.forEach((lp, i) => {
    const p = typeof lp === "number" && Number.isFinite(lp) ? Math.min(1, Math.exp(lp)) : 0;
    const h = Math.max(1, p * 40);
    const bar = svg("rect", { x: i * w, y: 40 - h, width: w - 0.6, height: h, class: p < 0.5 ? "lp low" : "lp" });
    add(bar, add(svg("title"), `token ${i}: ${fmtNumber(lp)}`));
    strip.append(bar);
  });
  const finite = values.filter((v) => typeof v === "number" && Number.isFinite(v));
  const mean = finite.length ? finite.reduce((a, b) => a + b, 0) / finite.length : null;
  const low = finite.filter((v) => Math.exp(v) < 0.5).length;
  const summary = [`${fmtCount(n)} tokens`];
  if (mean !== null) summary.push(`mean ${fmtFloat(mean)}`, `min ${fmtFloat(finite.reduce((a, b) => Math.min(a, b)))}`, `${fmtCount(low)} below p 0.5`);
  const list = el("details", "logprob-list");
  add(list, el("summary", "", `logprobs (${summary.join(" · ")})`), el("pre", "json", values.map(fmtNumber).join(", ")));
  add(box, strip, list);
  return box;
}

function renderEpisodes(answer) {
  const frag = document.createDocumentFragment();
  for (const ep of answer.episodes ?? []) frag.append(episodeView(ep));
  if (!frag.firstChild) frag.append(el("p", "muted", "no episodes here"));
  return frag;
}

function episodeView(ep) {
  const box = el("article", "episode");
  box.dataset.episode = typeof ep.episode === "string" ? ep.episode : JSON.stringify(ep.episode);
  const steps = ep.steps ?? [];
  add(box, add(el("header", "episode-head"),
    el("strong", "", `episode ${typeof ep.episode === "string" ? ep.episode : JSON.stringify(ep.episode)}`),
    el("span", "muted", ` · ${fmtCount(ep.length ?? steps.length)} steps · return `),
    el("span", "mono", fmtNumber(ep.return))));
  const timeline = timelineView(steps, (i) => select(i));
  const detail = el("div", "step-detail");
  const { table: t, body } = table(["step", "reward", "done", "action"], "steps");
  const trs = steps.map((st, i) => {
    const tr = row([String(st.step ?? i), fmtNumber(st.reward), st.done ? "done" : "", compact(st.action)]);
    tr.dataset.step = String(i);
    tr.addEventListener("click", () => select(i));
    body.append(tr);
    return tr;
  });
  let current = -1;
  const select = (i) => {
    if (i < 0 || i >= steps.length) return;
    current = i;
    const st = steps[i];
    for (const r of timeline.querySelectorAll(".tl-step.selected")) r.classList.remove("selected");
    timeline.querySelector(`.tl-step[data-step="${i}"]`)?.classList.add("selected");
    for (const tr of trs) tr.classList.remove("focus");
    trs[i]?.classList.add("focus");
    detail.dataset.step = String(i);
    const nav = el("div", "pager");
    const p = button("‹ step", () => select(current - 1));
    const n = button("step ›", () => select(current + 1));
    p.dataset.go = "prev";
    n.dataset.go = "next";
    p.disabled = i === 0;
    n.disabled = i === steps.length - 1;
    add(nav, p, el("span", "status", `step ${st.step ?? i} (${i + 1} of ${steps.length})`), n);
    detail.replaceChildren(nav, facts([
      ["reward", fmtNumber(st.reward)],
      ["done", st.done ? "yes" : "no"],
      ["row", st.index ?? "—"],
    ]), add(el("div", "obs"), el("div", "label", "observation"), wholeValue(st.observation)),
    add(el("div", "act"), el("div", "label", "action"), wholeValue(st.action)));
  };
  add(box, timeline, detail, add(el("details", "step-table"), el("summary", "", "all steps"), t));
  if (steps.length) select(0);
  return box;
}

function compact(v) {
  if (v === null || v === undefined) return "—";
  const text = typeof v === "string" ? v : JSON.stringify(v);
  return text.length > 80 ? `${text.slice(0, 80)}…` : text;
}

/** An SVG strip: one bar of reward per step (up: positive), a mark where done. A click
    on a step selects it. */
function timelineView(steps, onSelect) {
  const n = Math.max(steps.length, 1);
  const w = 10;
  const top = 6;
  const mid = 34;
  const half = 26;
  const rewards = steps.map((s) => (typeof s.reward === "number" ? s.reward : 0));
  const scale = Math.max(1e-12, ...rewards.map(Math.abs));
  const strip = svg("svg", { class: "timeline", viewBox: `0 0 ${n * w} 68`, preserveAspectRatio: "none", role: "img" });
  add(strip, add(svg("title"), "reward per step; a red mark where the episode is done"));
  strip.append(svg("line", { x1: 0, x2: n * w, y1: mid, y2: mid, class: "tl-axis" }));
  steps.forEach((s, i) => {
    const r = rewards[i];
    const h = Math.max(0.8, (Math.abs(r) / scale) * half);
    const g = svg("g", { class: "tl-step", "data-step": i });
    g.append(svg("rect", { x: i * w, y: 0, width: w, height: 68, class: "tl-hit" }));
    g.append(svg("rect", { x: i * w + 1, y: r >= 0 ? mid - h : mid, width: w - 2, height: h, class: r >= 0 ? "tl-bar pos" : "tl-bar neg" }));
    if (s.done) g.append(svg("rect", { x: i * w, y: top - 6, width: w, height: 5, class: "tl-done" }));
    add(g, add(svg("title"), `step ${s.step ?? i}: reward ${fmtNumber(s.reward)}${s.done ? ", done" : ""}`));
    g.addEventListener("click", () => onSelect(i));
    strip.append(g);
  });
  strip.style.minWidth = `${Math.min(n * 6, 4000)}px`;
  const box = el("div", "timeline-box");
  box.append(strip);
  return box;
}

// -- samples and steps -----------------------------------------------------------------

async function viewSample(id) {
  const s = await inspect("sample", { id });
  return sampleCard(s, true);
}

function sampleCard(s, full) {
  const box = section(`Sample ${s.id}`);
  box.classList.add("sample");
  box.dataset.index = String(s.index);
  const start = typeof s.index === "number" ? Math.floor(s.index / PAGE_ROWS) * PAGE_ROWS : undefined;
  // A snapshot's sample: `dataset` says which snapshot and its global index there.
  const ds = s.dataset && typeof s.dataset === "object" ? s.dataset : null;
  if (ds && typeof ds.index === "number") box.dataset.global = String(ds.index);
  const dsRef = ds ? (ds.ref ?? `${ds.name}@${ds.version}`) : (typeof s.dataset === "string" ? s.dataset : null);
  add(box, facts([
    ["object", s.name ? link(s.name, { open: s.name, start: start || undefined, row: s.index }) : null],
    ["index in the object", fmtCount(s.index)],
    ["kind", s.kind],
    ["dataset", dsRef === null ? undefined : link(dsRef, { snapshot: dsRef })],
    ["sample in the snapshot", ds && typeof ds.index === "number" ? fmtCount(ds.index) : undefined],
    ["member", s.member === undefined || s.member === null ? undefined : (typeof s.member === "string" ? s.member : JSON.stringify(s.member))],
  ]));
  if (!full) box.classList.add("compact");
  // The sample's own view shows every number whole; tables round them.
  box.append(renderJson(s.value, { round: !full }));
  return box;
}

const STEP_ARGS = ["ref", "step", "batch_size", "world_size", "seed", "epoch", "rank", "shuffle", "window", "window_bytes", "tail", "state"];

// The dashboard's jobs view, where a step's wait for data shows: the job the inspector
// was opened for (?job=NAME, as the jobs view names it) selected, else the whole list.
// A plain link: the dashboard is another page.
function jobsLink(job) {
  const a = el("a", "jobs-link", job ? `job ${job}'s data stall on the dashboard` : "jobs' data stall on the dashboard");
  a.href = job ? `/#jobs=${encodeURIComponent(job)}` : "/#jobs";
  return a;
}

function stepForm(q) {
  const form = el("form", "step-form panel");
  add(form, el("h2", "", "What did a training step see?"));
  const job = q.get("job") || null;
  add(form, add(el("p", "muted jobs-line"), "How long the trainers waited for it: ", jobsLink(job)));
  const inputs = {};
  for (const k of STEP_ARGS) {
    const label = el("label", "", k);
    const input = el(k === "state" ? "textarea" : "input");
    input.name = k;
    if (k !== "state") input.type = "text";
    input.value = q.get(k) ?? "";
    if (k === "ref") input.placeholder = "NAME@VERSION";
    if (k === "epoch") input.placeholder = "0";
    if (k === "shuffle") input.placeholder = "true";
    if (k === "tail") input.placeholder = "uneven";
    inputs[k] = input;
    add(form, add(label, input));
  }
  const go = el("button", "", "show the step");
  go.type = "submit";
  form.append(go);
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const params = {};
    for (const k of STEP_ARGS) params[k] = inputs[k].value.trim() || undefined;
    params.job = job ?? undefined; // the job the page was opened for stays
    navigate(pageUrl(params));
  });
  return form;
}

async function viewStep(q) {
  const frag = document.createDocumentFragment();
  frag.append(stepForm(q));
  if (!q.get("step") || !q.get("ref")) return frag;
  const args = {};
  for (const k of STEP_ARGS) if (q.get(k) !== null && q.get(k) !== "") args[k] = q.get(k);
  const answer = await inspect("step", args);
  // The ids are keys in the snapshot's backend; an answer without it is asked again.
  const backend = answer.backend ?? (await inspect("snapshot", { ref: q.get("ref"), start: 0, count: 1 })).backend;
  const head = section(`Step ${answer.step} of ${answer.ref ?? q.get("ref")}`);
  add(head, facts([["snapshot", answer.snapshot], ["backend", backend], ["ranks", Object.keys(answer.ranks ?? {}).length]]));
  frag.append(head);
  const ranks = Object.entries(answer.ranks ?? {}).sort((a, b) => Number(a[0]) - Number(b[0]));
  for (const [rank, r] of ranks) {
    const ids = r.ids ?? [];
    const s = section(`rank ${rank}`);
    s.classList.add("rank");
    s.dataset.rank = rank;
    add(s, el("p", "muted", `${fmtCount(ids.length)} samples${r.padding ? `, ${fmtCount(r.padding)} of them padding` : ""}`));
    const list = el("ol", "ids mono");
    list.start = 0;
    for (const id of ids) add(list, add(el("li"), link(id, { sample: `${backend}/${id}` })));
    const samples = el("div", "samples");
    const more = button("more samples", () => guarded(() => fill()), "more");
    let next = 0;
    const fill = async () => {
      const batch = ids.slice(next, next + STEP_SAMPLES);
      next += batch.length;
      more.hidden = next >= ids.length;
      const cards = await pooled(batch, STEP_PARALLEL, async (id) => {
        try {
          return sampleCard(await inspect("sample", { id: `${backend}/${id}` }), false);
        } catch (err) {
          if (err?.name === "AbortError") throw err;
          return add(el("p", "error-box"), `${id}: ${err.kind ?? "Error"}: ${err.message}`);
        }
      });
      for (const c of cards) samples.append(c);
    };
    add(s, add(el("details", "id-list"), el("summary", "", "ids"), list), samples, more);
    frag.append(s);
    await fill();
  }
  return frag;
}

/** Map `fn` over `items`, at most `limit` at a time; the results in order. */
async function pooled(items, limit, fn) {
  const out = new Array(items.length);
  let i = 0;
  const workers = Array.from({ length: Math.min(limit, items.length) }, async () => {
    while (i < items.length) {
      const at = i;
      i += 1;
      out[at] = await fn(items[at]);
    }
  });
  await Promise.all(workers);
  return out;
}

// -- routing ---------------------------------------------------------------------------

function activeNav(name) {
  for (const a of document.querySelectorAll("[data-nav]")) a.classList.toggle("active", a.dataset.nav === name);
}

async function route() {
  controller?.abort();
  controller = new AbortController();
  const mine = ++generation;
  for (const url of blobUrls) URL.revokeObjectURL(url);
  blobUrls = [];
  clearError();
  if (lightbox.open) lightbox.close();
  const q = new URLSearchParams(location.search);
  let nav = "home";
  let title = "chunkd inspector";
  let work;
  if (q.has("open")) {
    title = `${q.get("open")} · chunkd inspector`;
    work = () => viewOpen(q.get("open"), q);
  } else if (q.has("sample")) {
    title = `${q.get("sample")} · chunkd inspector`;
    work = () => viewSample(q.get("sample"));
  } else if (q.has("dataset")) {
    nav = "datasets";
    work = () => viewDataset(q.get("dataset"));
  } else if (q.has("snapshot")) {
    nav = "datasets";
    work = () => viewSnapshot(q.get("snapshot"), q, "snapshot");
  } else if (q.has("diff")) {
    nav = "datasets";
    work = () => viewDiff(q.get("diff"));
  } else if (q.has("step") || q.get("view") === "step") {
    nav = "step";
    work = () => viewStep(q);
  } else if (q.has("list")) {
    work = () => viewList(q.get("list"), q.get("recursive") === "true");
  } else if (q.get("view") === "datasets") {
    nav = "datasets";
    work = () => viewDatasets();
  } else {
    work = () => viewHome();
  }
  document.title = title;
  activeNav(nav);
  view.setAttribute("aria-busy", "true");
  try {
    const node = await work();
    if (mine !== generation) return;
    view.replaceChildren(node);
  } catch (err) {
    if (err?.name === "AbortError" || mine !== generation) return;
    showError(err);
    const what = q.get("open") ?? q.get("sample") ?? q.get("dataset") ?? q.get("snapshot") ?? q.get("diff") ?? q.get("list");
    const fallback = el("section", "panel failed");
    add(fallback, el("p", "", what ? `Could not show ${what}.` : "Could not show this view."), link("Back to the backends", {}));
    if (q.get("open")) {
      const [backend, key] = splitName(q.get("open"));
      const parent = key.includes("/") ? `${backend}/${key.slice(0, key.lastIndexOf("/"))}` : backend;
      add(fallback, " · ", link(`the listing of ${parent}/`, { list: parent }));
      if (q.get("format") !== "binary") add(fallback, " · ", link("its first bytes", { open: q.get("open"), format: "binary" }));
    }
    view.replaceChildren(fallback);
  } finally {
    if (mine === generation) {
      view.removeAttribute("aria-busy");
      view.dataset.ready = String(mine);
    }
  }
}

/** What the header's box opens: `A#N` a sample, `NAME@V` a snapshot, `B/P/` a
    listing, `B/KEY` an object. */
function openTarget(text) {
  const t = text.trim();
  if (!t) return null;
  if (t.includes("#")) return { sample: t };
  if (!t.includes("/") && t.includes("@")) return { snapshot: t };
  if (!t.includes("/")) return { list: t };
  if (t.endsWith("/")) return { list: t.replace(/\/+$/, "") };
  return { open: t };
}

document.addEventListener("click", (ev) => {
  const a = ev.target instanceof Element ? ev.target.closest("a[data-route]") : null;
  if (!a || ev.defaultPrevented || ev.button !== 0 || ev.metaKey || ev.ctrlKey || ev.shiftKey || ev.altKey) return;
  const url = new URL(a.href);
  if (url.origin !== location.origin || url.pathname !== "/inspect/") return;
  ev.preventDefault();
  navigate(url.pathname + url.search);
});

document.getElementById("open-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const target = openTarget(document.getElementById("open-name").value);
  if (target) navigate(pageUrl(target));
});

document.getElementById("error-close").addEventListener("click", clearError);

// -- the lightbox: an image of the view, enlarged -----------------------------------------
// A <dialog>: Escape closes it (the browser's own), so do a click on the backdrop, on the
// image or on ×. The image is the same src (a data: URL or the media route): no new fetch
// of anything but what the thumbnail showed.

const lightbox = document.getElementById("lightbox");
const lightboxImg = document.getElementById("lightbox-img");

function enlarge(img) {
  lightboxImg.src = img.src;
  const label = img.closest(".bytes")?.querySelector(".bytes-label")?.textContent ?? "";
  const size = img.naturalWidth ? `${img.naturalWidth} × ${img.naturalHeight} px` : "";
  document.getElementById("lightbox-caption").textContent = [size, label].filter(Boolean).join(" · ");
  lightbox.classList.toggle("small", img.naturalWidth > 0 && img.naturalWidth < 256);
  lightbox.showModal();
}

view.addEventListener("click", (ev) => {
  const img = ev.target instanceof Element ? ev.target.closest("img.zoomable") : null;
  if (img && !ev.defaultPrevented) enlarge(img);
});
view.addEventListener("keydown", (ev) => {
  const img = ev.target instanceof Element ? ev.target.closest("img.zoomable") : null;
  if (img && (ev.key === "Enter" || ev.key === " ")) {
    ev.preventDefault();
    enlarge(img);
  }
});
lightbox.addEventListener("click", (ev) => {
  if (ev.target === lightbox || ev.target === lightboxImg) lightbox.close();
});
document.getElementById("lightbox-close").addEventListener("click", () => lightbox.close());
lightbox.addEventListener("close", () => lightboxImg.removeAttribute("src"));
window.addEventListener("popstate", () => route());

route();
