"""The inspector's speed in a real headless browser, against pyarrow in a notebook.

The fixture (in the bench's work dir, never committed): one Parquet file written by
pyarrow, 1,048,576 rows (``--quick``: 20,000) in row groups of 10,000 rows
(``--quick``: 8,000), snappy, statistics on (pyarrow's defaults), dictionary encoding
for ``label`` only. Columns: ``id`` int64 (the row's index), ``caption`` string
(40-120 ASCII chars, ending with the row's index), ``label`` int32 (``id * 7919 %
1000``) and ``image`` binary: a real PNG per row, 18x18 RGB noise (about 1.1 KB),
drawn from a pool of 4,096 distinct images (``--quick``: 256) made
with Pillow, each row's copy carrying its index in a ``tEXt`` chunk so no two values are
equal. A pool of 4,096 rather than 64: snappy matches repeats inside its 64 KiB blocks,
and 64 images would repeat there so often that the file would shrink below 1 GiB while
real image bytes do not compress. The full-size file comes out at 1.05 GiB
(1,125,441,701 bytes), 105 row groups (the last of 8,576 rows).

The file lies under the ``local`` (``file://``) backend of a ``chunkd serve``
(:class:`~bench.daemon.BenchDaemon`, its embedded default, RAM tier 4 GiB) and is warmed:
read whole once through ``GET /v1/objects`` (so every chunk is in RAM), then two
``/v1/inspect/open`` at once, so the pool has started both its workers (it starts one
per request that finds none idle, and the page sends ``open`` and ``rows`` at once).

Contenders:

- **chunkd**: Debian's Chromium (``chunkd.testing.browser``), a fresh browser context
  per run, opens ``/inspect/?open=local/KEY``. An init script stamps
  ``performance.now()`` (milliseconds from navigation start) when the rows table holds
  rows 0 and 19 and every ``img`` in it has loaded (``complete`` and ``naturalWidth >
  0``): the first page with its images. It then clicks the page's own ``last »``
  button and stamps the time until row 1,048,575 is in the table with every image
  loaded: the jump to the last row. One warm-up, then 3 runs (``--quick``: 1);
  median and spread. A third figure opens a deep link ``?open=...&start=S`` at the
  first row of a row group no run has touched, so the worker decodes it afresh (the
  repeat runs above may find row group 0 decoded in a worker already).
- **pyarrow**, the notebook-style script a user runs instead, a fresh process each run
  on the same file straight from disk (page cache warm): ``pq.ParquetFile(path)``,
  ``read_row_group(0).slice(0, 20).to_pylist()`` for the first page and
  ``read_row_group(last).slice(n - 1).to_pylist()`` for the last row. Timed with and
  without ``import pyarrow.parquet``; the ratio uses the time without it (a notebook
  has pyarrow imported already). Also, once (not at ``--quick`` size),
  ``pandas.read_parquet(path)`` of the whole file: what people often do.

Bytes: ``chunkd_read_chunk_bytes_total`` (all sources; whole 4 MiB chunks) from
``/metrics`` before and after the first ever page load (no worker has read row group 0
yet), against the bytes the pyarrow process read (``rchar`` of ``/proc/self/io``) for
the same page. A worker's client keeps a small chunk cache of its own, so a chunk it read
before (the first, to sniff the format, and the footer's, at the warm-up) is not served
again. Both must be far below the
file's size: no request reads the whole file (the full run fails if a page load read
half of it).

The notes give where a first page's time went (from the page's Resource Timing: the
document, ``inspect.js``, the requests sent, the ``open`` and ``rows`` answers, the
render), the machine's load average (this bench shares its CPUs), and the layout.

It is one job at ~700 lines: one scenario (the inspector's first page, last row and a
cold row group in a real browser) and its notebook baseline over one fixture; most of
the lines write that fixture and time the page; the daemon is
:class:`bench.daemon.BenchDaemon`, and the rows go to :class:`bench.report.Report`.
"""

from __future__ import annotations

import functools
import io
import json
import os
import random
import shutil
import statistics
import struct
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .daemon import BenchDaemon
from .report import Report, Result, Rounds

if TYPE_CHECKING:
    from playwright.sync_api import Browser

__all__ = ["Fixture", "run", "write_fixture"]

MiB = 1 << 20
GiB = 1 << 30
KEY = "inspect/images.parquet"
NAME = f"local/{KEY}"
#: rows a page of the inspector shows (``PAGE_ROWS`` in ``inspect.js``)
PAGE_ROWS = 20
FIRST_PAGE_TARGET_MS = 300.0
JUMP_TARGET_MS = 1000.0
_VOCABULARY = (
    "a red cat sits on the mat beside two green apples while blue birds fly over "
    "quiet hills under grey clouds and small dogs run across wet grass near old "
    "stone walls at dawn with bright yellow flowers in tall glass jars"
)
_WORDS = _VOCABULARY.split()


@dataclass(frozen=True)
class Fixture:
    """The Parquet file both sides open, and how it is laid out."""

    path: Path
    rows: int
    group_rows: int
    groups: int
    size: int
    codec: str
    image_bytes: float  # mean bytes of an image value
    distinct: int  # distinct images in the pool the rows draw from
    seconds: float  # how long writing it took

    def layout(self) -> str:
        """The layout, as the report's notes state it."""
        last = self.rows - (self.groups - 1) * self.group_rows
        return (
            f"{self.rows:,} rows in {self.groups} row groups of {self.group_rows:,} "
            f"(the last {last:,}), {self.size:,} bytes ({self.size / GiB:.2f} GiB), "
            f"{self.codec}, pyarrow's statistics; columns id int64, caption string, "
            f"label int32 (dictionary), image binary (PNG, {self.image_bytes:.0f} B mean, "
            f"{self.distinct:,} distinct images, each row's copy tagged with its index)"
        )


def _image_pool(count: int, side: int, seed: int) -> list[bytes]:
    """``count`` distinct PNGs of ``side`` x ``side`` RGB noise (incompressible, as
    real image bytes are)."""
    from PIL import Image

    rng = random.Random(seed)
    pool = []
    for _ in range(count):
        image = Image.frombytes("RGB", (side, side), rng.randbytes(side * side * 3))
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        pool.append(buffer.getvalue())
    return pool


def _tagged(png: bytes, index: int) -> bytes:
    """``png`` with a ``tEXt`` chunk holding ``index`` after its IHDR (still a valid PNG)."""
    data = b"row\x00" + str(index).encode()
    chunk = struct.pack(">I", len(data)) + b"tEXt" + data
    chunk += struct.pack(">I", zlib.crc32(b"tEXt" + data))
    return png[:33] + chunk + png[33:]  # 8 bytes of signature + the 25 of IHDR


def write_fixture(
    path: Path, *, rows: int, group_rows: int, side: int, distinct: int = 4096
) -> Fixture:
    """Write the bench's Parquet file (see the module docstring) a row group at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    started = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(13)
    pool = _image_pool(distinct, side, seed=13)
    captions = []
    for _ in range(distinct * 2):
        words: list[str] = []
        goal = rng.randint(30, 105)  # the " #INDEX" suffix brings it to 40-120
        while len(" ".join(words)) < goal:
            words.append(rng.choice(_WORDS))
        captions.append(" ".join(words))
    schema = pa.schema(
        [
            ("id", pa.int64()),
            ("caption", pa.string()),
            ("label", pa.int32()),
            ("image", pa.binary()),
        ]
    )
    image_total = 0
    with pq.ParquetWriter(path, schema, compression="snappy", use_dictionary=["label"]) as out:
        for begin in range(0, rows, group_rows):
            ids = range(begin, min(rows, begin + group_rows))
            picks = [rng.randrange(distinct) for _ in ids]
            images = [_tagged(pool[p], i) for p, i in zip(picks, ids, strict=True)]
            image_total += sum(map(len, images))
            table = pa.table(
                {
                    "id": pa.array(ids, pa.int64()),
                    "caption": pa.array(
                        [
                            f"{captions[(p + i) % len(captions)]} #{i}"
                            for p, i in zip(picks, ids, strict=True)
                        ]
                    ),
                    "label": pa.array([i * 7919 % 1000 for i in ids], pa.int32()),
                    "image": pa.array(images, pa.binary()),
                },
                schema=schema,
            )
            out.write_table(table, row_group_size=group_rows)
    meta = pq.read_metadata(path)
    assert meta.num_rows == rows, meta
    return Fixture(
        path=path,
        rows=rows,
        group_rows=group_rows,
        groups=meta.num_row_groups,
        size=path.stat().st_size,
        codec="snappy",
        image_bytes=image_total / rows,
        distinct=distinct,
        seconds=time.perf_counter() - started,
    )


# -- chunkd: the page in Chromium ---------------------------------------------------------

#: Installed before the page's own module runs: stamps performance.now() once the rows
#: table shows every index in ``want`` and each image in it has loaded. Image loads do
#: not bubble, so the listener captures them on the document.
_CLOCK = """
(() => {
  const b = (window.__bench = { want: WANT, at: null, t0: 0, rows: 0, images: 0 });
  const check = () => {
    if (b.at !== null) return;
    const t = document.querySelector("table.rows-table");
    if (!t) return;
    for (const w of b.want) if (!t.querySelector(`tr[data-index="${w}"]`)) return;
    const rows = t.querySelectorAll("tr[data-index]");
    const imgs = t.querySelectorAll("img");
    if (imgs.length < rows.length) return;
    for (const i of imgs) if (!i.complete || i.naturalWidth === 0) return;
    b.at = performance.now();
    b.rows = rows.length;
    b.images = imgs.length;
  };
  b.check = check;
  new MutationObserver(check).observe(document, { subtree: true, childList: true });
  document.addEventListener("load", check, true);
})();
"""

#: What the test waits on: the stamp, or the page's error box if it shows one.
_DONE = """() => {
  const b = window.__bench;
  if (!b) return false;
  b.check();
  if (b.at !== null) return true;
  const e = document.getElementById("error");
  return e && !e.hidden ? "error: " + e.textContent.trim() : false;
}"""

#: Arms the clock for the last row and clicks the page's own "last »".
_JUMP = """(want) => {
  const b = window.__bench;
  const go = document.querySelector('button[data-page="last"]');
  if (!go || go.disabled) return "no enabled 'last' button";
  b.want = [want];
  b.at = null;
  b.t0 = performance.now();
  go.click();
  return null;
}"""


_STAMP = """() => {
  const b = window.__bench;
  return { at: b.at, t0: b.t0, rows: b.rows, images: b.images };
}"""

#: The first page's phases from the page's own Resource Timing entries.
_PHASES = """() => {
  const nav = performance.getEntriesByType("navigation")[0];
  const res = performance.getEntriesByType("resource");
  const end = (part) => res.find((e) => e.name.includes(part))?.responseEnd ?? null;
  const sent = res.find((e) => e.name.includes("/v1/inspect/"))?.startTime ?? null;
  return {
    document: nav ? nav.responseEnd : null,
    "inspect.js": end("/static/inspect.js"),
    "requests sent": sent,
    open: end("/v1/inspect/open"),
    rows: end("/v1/inspect/rows"),
    "rows requests": res.filter((e) => e.name.includes("/v1/inspect/rows"))
      .map((e) => [e.startTime, e.responseEnd]),
  };
}"""


@dataclass(frozen=True)
class PageRun:
    """One page load (and jump) in the browser, in milliseconds."""

    first_page_ms: float
    rows: int
    images: int
    jump_ms: float | None
    served_bytes: float  # chunkd_read_chunk_bytes_total across the page load
    jump_bytes: float  # and across the jump
    #: where the first page's time went: ms from navigation start to the end of the
    #: document, of inspect.js, of the open and rows answers; "jump rows": the jump's
    #: rows request, start to end
    phases: dict[str, float | None]


def _chunk_bytes(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("chunkd_read_chunk_bytes_total")
    )


def _page_run(
    browser: Browser, daemon: BenchDaemon, fixture: Fixture, *, start: int = 0, jump: bool
) -> PageRun:
    """Open the file's page (at row ``start``) in a fresh context; time it, and the jump."""
    query = {"open": NAME} | ({"start": str(start)} if start else {})
    url = f"{daemon.url}/inspect/?{urllib.parse.urlencode(query)}"
    want = [str(start), str(min(start + PAGE_ROWS, fixture.rows) - 1)]
    context = browser.new_context()
    try:
        context.add_init_script(_CLOCK.replace("WANT", json.dumps(want)))
        page = context.new_page()
        before = _chunk_bytes(daemon.url)
        page.goto(url, wait_until="commit")
        done = page.wait_for_function(_DONE, timeout=60_000, polling=25).json_value()
        if done is not True:
            raise RuntimeError(f"the inspector page at {url} showed an error: {done}")
        clock = page.evaluate(_STAMP)
        phases = page.evaluate(_PHASES)
        del phases["rows requests"]
        served = _chunk_bytes(daemon.url) - before
        jump_ms, jump_bytes = None, 0.0
        if jump:
            last = str(fixture.rows - 1)
            failed = page.evaluate(_JUMP, last)
            if failed:
                raise RuntimeError(f"cannot jump to the last row on {url}: {failed}")
            done = page.wait_for_function(_DONE, timeout=60_000, polling=25).json_value()
            if done is not True:
                raise RuntimeError(f"the jump to row {last} on {url} showed an error: {done}")
            after = page.evaluate(_STAMP)
            jump_ms = after["at"] - after["t0"]
            rows = page.evaluate(_PHASES)["rows requests"]
            phases["jump rows"] = rows[-1][1] - rows[-1][0]
            jump_bytes = _chunk_bytes(daemon.url) - before - served
    finally:
        context.close()
    if clock["images"] != clock["rows"]:
        raise RuntimeError(f"{clock['rows']} rows but {clock['images']} images on {url}")
    return PageRun(clock["at"], clock["rows"], clock["images"], jump_ms, served, jump_bytes, phases)


# -- pyarrow: the notebook-style script ---------------------------------------------------

_NOTEBOOK = r"""
import json, sys, time
t0 = time.perf_counter()

def rchar():
    with open("/proc/self/io") as f:
        return int(next(l for l in f if l.startswith("rchar:")).split()[1])

import pyarrow.parquet as pq
t1 = time.perf_counter()
r1 = rchar()
path, group, at = sys.argv[1], int(sys.argv[2]), sys.argv[3]
f = pq.ParquetFile(path)
group = f.num_row_groups - 1 if group < 0 else group
table = f.read_row_group(group)
rows = table.slice(table.num_rows - 1) if at == "last" else table.slice(0, 20)
rows = rows.to_pylist()
t2 = time.perf_counter()
r2 = rchar()
print(json.dumps({"ms": (t2 - t1) * 1e3, "with_import_ms": (t2 - t0) * 1e3,
                  "bytes": r2 - r1, "rows": len(rows), "first": rows[0]["id"]}))
"""

_PANDAS = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import pandas as pd
t1 = time.perf_counter()
frame = pd.read_parquet(sys.argv[1])
t2 = time.perf_counter()
print(json.dumps({"ms": (t2 - t1) * 1e3, "with_import_ms": (t2 - t0) * 1e3,
                  "rows": len(frame),
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def _script(code: str, *args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the pyarrow baseline failed: {done.stderr[-2000:]}")
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


def _notebook(fixture: Fixture, group: int, at: str) -> dict[str, Any]:
    got = _script(_NOTEBOOK, str(fixture.path), str(group), at)
    want = fixture.rows - 1 if at == "last" else max(group, 0) * fixture.group_rows
    assert got["first"] == want, (got, want)
    return got


# -- the scenario -------------------------------------------------------------------------


def _spread(values: list[float]) -> str:
    return f"median of {len(values)}, {min(values):.0f}-{max(values):.0f} ms"


def _phases_text(runs: list[PageRun]) -> str:
    names = ["document", "inspect.js", "requests sent", "open", "rows"]
    parts = []
    for name in names:
        got = [p.phases[name] for p in runs if p.phases.get(name) is not None]
        if got:
            parts.append(f"{name} {statistics.median(v for v in got if v is not None):.0f}")
    rendered = statistics.median(p.first_page_ms for p in runs)
    return ", ".join([*parts, f"rendered with its images {rendered:.0f}"])


def run(report: Report, work: Path, *, quick: bool) -> None:
    """The inspector scenario (``quick``: 20,000 rows, one run, to check it works)."""
    from chunkd.testing.browser import chromium_missing

    missing = chromium_missing()
    if missing:
        print(f"inspector: unavailable ({missing})", flush=True)
        return
    work.mkdir(parents=True, exist_ok=True)
    try:
        if quick:
            # Row group 0 spans more than the first chunk, which the worker's client
            # holds from its format sniff at the warm-up: the page still reads some.
            shape = {"rows": 20_000, "group_rows": 8_000, "side": 18, "distinct": 256}
        else:
            shape = {"rows": 1 << 20, "group_rows": 10_000, "side": 18, "distinct": 4096}
        fixture = write_fixture(work / "chunkd-data" / KEY, **shape)
        print(f"inspector: {fixture.layout()}; written in {fixture.seconds:.1f}s", flush=True)
        daemon = BenchDaemon(
            work,
            {
                # the whole file fits in RAM, so a run is served from memory
                "CHUNKD_CACHE_RAM_BYTES": "4GiB",
                "CHUNKD_CACHE_FSYNC": "never",
                "CHUNKD_CACHE_DISK_MIN_FREE_BYTES": "0",
            },
        )
        try:
            _measure(report, daemon, fixture, quick=quick)
        finally:
            daemon.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _warm(daemon: BenchDaemon, fixture: Fixture) -> float:
    """Read the file whole through the daemon and start its inspector pool; seconds."""
    started = time.perf_counter()
    got = daemon.stream(NAME)
    if got != fixture.size:
        raise RuntimeError(f"GET /v1/objects/{NAME} gave {got:,} bytes, not {fixture.size:,}")
    seconds = time.perf_counter() - started
    query = urllib.parse.urlencode({"name": NAME})

    def open_it(_: int) -> None:
        with urllib.request.urlopen(f"{daemon.url}/v1/inspect/open?{query}", timeout=60) as r:
            opened = json.loads(r.read())
        if opened.get("num_rows") != fixture.rows:
            raise RuntimeError(f"the inspector opened {NAME} as {str(opened)[:500]}")

    # The pool starts a worker when a request finds none idle, and the page sends its
    # `open` and `rows` at once: two requests at once start both workers (server.
    # inspect_workers), each then holding the file's footer.
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(open_it, range(2)))
    # the page cache, warm for pyarrow's side (the daemon's read went through it too)
    with fixture.path.open("rb") as f:
        while f.read(16 * MiB):
            pass
    return seconds


def _measure(report: Report, daemon: BenchDaemon, fixture: Fixture, *, quick: bool) -> None:
    from chunkd.testing.browser import chromium

    rounds = report.rounds_for(1 if quick else 3)
    warmed = _warm(daemon, fixture)
    load_before = os.getloadavg()[0]
    # Row groups no other run touches (neither the first nor the last): pages that a
    # worker decodes afresh. The first is the warm-up's.
    fresh = [1 + (k + 1) * (fixture.groups - 2) // (rounds + 2) for k in range(rounds + 1)]
    gr = fixture.group_rows
    first: list[PageRun] = []
    fresh_runs: list[PageRun] = []
    first_nb: list[dict[str, Any]] = []
    last_nb: list[dict[str, Any]] = []
    fresh_nb: list[dict[str, Any]] = []

    def page(group: int, *, jump: bool) -> PageRun:
        return _page_run(browser, daemon, fixture, start=group * gr, jump=jump)

    with chromium() as browser:
        # The warm-ups: the first ever page (and jump) for chunkd, and (not at --quick
        # size, where the figures mean little) a fresh group's page and pyarrow's runs.
        cold = page(0, jump=True)
        cold_fresh = None if quick else page(fresh[0], jump=False)
        if not quick:
            for group, at in ((0, "first"), (-1, "last"), (fresh[0], "first")):
                _notebook(fixture, group, at)
        for r in range(rounds):
            group = fresh[r + 1]
            sides: list[Callable[[], object]] = [
                lambda: first.append(page(0, jump=True)),
                lambda: first_nb.append(_notebook(fixture, 0, "first")),
                lambda: last_nb.append(_notebook(fixture, -1, "last")),
                functools.partial(lambda g: fresh_runs.append(page(g, jump=False)), group),
                functools.partial(lambda g: fresh_nb.append(_notebook(fixture, g, "first")), group),
            ]
            # rotate the order, so neither side always runs just after the other
            for side in sides[r % 2 :] + sides[: r % 2]:
                side()
    load_after = os.getloadavg()[0]
    log = (daemon.work / "daemon.log").read_text(errors="replace")
    workers = log.count('"inspector worker started"')
    machine = (
        f"{len(os.sched_getaffinity(0))} CPUs, 1-min load average {load_before:.1f} before the "
        f"browser runs and {load_after:.1f} after; {workers} inspector workers started"
    )
    # What people often do; one run (seconds and GiB of memory), not at --quick size.
    pandas_run = None if quick else _script(_PANDAS, str(fixture.path))
    if pandas_run is not None and pandas_run["rows"] != fixture.rows:
        raise RuntimeError(f"pandas read {pandas_run['rows']:,} rows, not {fixture.rows:,}")
    _rows(
        report,
        fixture,
        quick=quick,
        warmed=warmed,
        fresh=fresh,
        cold=cold,
        cold_fresh=cold_fresh,
        first=first,
        fresh_runs=fresh_runs,
        first_nb=first_nb,
        last_nb=last_nb,
        fresh_nb=fresh_nb,
        pandas_run=pandas_run,
        machine=machine,
    )


def _rows(
    report: Report,
    fixture: Fixture,
    *,
    quick: bool,
    warmed: float,
    fresh: list[int],
    cold: PageRun,
    cold_fresh: PageRun | None,
    first: list[PageRun],
    fresh_runs: list[PageRun],
    first_nb: list[dict[str, Any]],
    last_nb: list[dict[str, Any]],
    fresh_nb: list[dict[str, Any]],
    pandas_run: dict[str, Any] | None,
    machine: str,
) -> None:
    median = statistics.median
    if quick:
        size_label = f"{fixture.rows:,} rows, {fixture.size / MiB:.0f} MiB Parquet"
    else:
        size_label = f"{fixture.rows / 1e6:.0f}M rows, {fixture.size / GiB:.2f} GiB Parquet"
    ours = [p.first_page_ms for p in first]
    jumps = [p.jump_ms for p in first if p.jump_ms is not None]
    theirs = [n["ms"] for n in first_nb]
    theirs_last = [n["ms"] for n in last_nb]
    ours_fresh = [p.first_page_ms for p in fresh_runs]
    theirs_fresh = [n["ms"] for n in fresh_nb]
    jump_rows = [p.phases["jump rows"] for p in first if p.phases.get("jump rows") is not None]
    pandas_text = (
        "not run at --quick size"
        if pandas_run is None
        else f"{pandas_run['ms']:.0f} ms ({pandas_run['with_import_ms']:.0f} ms with its "
        f"import), peak RSS {pandas_run['peak_rss'] / GiB:.1f} GiB"
    )
    report.add(
        Result(
            f"inspector: first page with images ({size_label})",
            median(ours),
            median(theirs),
            "ms",
            "pyarrow ParquetFile + read_row_group(0).slice(0, 20).to_pylist(), fresh process",
            target_max=FIRST_PAGE_TARGET_MS,
            samples=Rounds.of(ours, theirs),
            note=(
                f"Chromium headless, a fresh context a run, navigation start to rows 0-"
                f"{PAGE_ROWS - 1} in the DOM with all {first[0].images} images loaded, the "
                f"file warm in the daemon (read whole once through GET /v1/objects in "
                f"{warmed:.1f}s); chunkd {_spread(ours)}; ms from navigation start: "
                f"{_phases_text(first)}. The warm-up (the first ever page: row group 0 not "
                f"yet decoded in a worker) took {cold.first_page_ms:.0f} ms "
                f"({_phases_text([cold])})."
                f" pyarrow {_spread(theirs)} without its import, "
                f"{median(n['with_import_ms'] for n in first_nb):.0f} ms with "
                f"`import pyarrow.parquet` (interpreter start not counted); the ratio uses the "
                f"time without the import (a notebook has it imported). pandas.read_parquet "
                f"of the whole file, one run: {pandas_text}. Machine: {machine}. "
                f"Fixture: {fixture.layout()}"
            ),
        )
    )
    report.add(
        Result(
            f"inspector: jump to the last row (row {fixture.rows - 1:,})",
            median(jumps),
            median(theirs_last),
            "ms",
            "pyarrow ParquetFile + read_row_group(last).slice(n - 1).to_pylist(), fresh process",
            target_max=JUMP_TARGET_MS,
            samples=Rounds.of(jumps, theirs_last),
            note=(
                f"the page's own 'last »' button, from the click to row {fixture.rows - 1:,} "
                f"in the DOM with its page's images loaded; chunkd {_spread(jumps)}, of which "
                f"the rows request {median(v for v in jump_rows if v is not None):.0f} ms; the "
                f"warm-up (its row group not yet decoded) {cold.jump_ms or 0:.0f} ms; pyarrow "
                f"{_spread(theirs_last)} without its import, "
                f"{median(n['with_import_ms'] for n in last_nb):.0f} ms with it"
            ),
        )
    )
    warm_up = (
        "no warm-up at --quick size"
        if cold_fresh is None
        else f"warm-up: {fresh[0]}, {cold_fresh.first_page_ms:.0f} ms"
    )
    report.add(
        Result(
            "inspector: first page of a row group not yet decoded (deep link ?start=)",
            median(ours_fresh),
            median(theirs_fresh),
            "ms",
            "pyarrow read_row_group(g).slice(0, 20).to_pylist() of the same groups",
            samples=Rounds.of(ours_fresh, theirs_fresh),
            note=(
                f"row groups {', '.join(map(str, fresh[1:]))} ({warm_up}): the worker reads "
                f"and decodes the whole "
                f"row group, as pyarrow does; chunkd {_spread(ours_fresh)} "
                f"({_phases_text(fresh_runs)}), pyarrow {_spread(theirs_fresh)}"
            ),
        )
    )
    served = [cold.served_bytes, cold.jump_bytes]
    served += [p.served_bytes for p in ([cold_fresh] if cold_fresh else []) + fresh_runs]
    report.add(
        Result(
            "inspector: bytes the daemon served for the first page",
            cold.served_bytes / MiB,
            first_nb[0]["bytes"] / MiB,
            "MiB",
            "bytes the pyarrow process read from the file (rchar) for the same page",
            # --quick's file is about one chunk: whole chunks are all of it
            target_max=None if quick else fixture.size / MiB / 10,
            note=(
                f"chunkd_read_chunk_bytes_total (every source; whole 4 MiB chunks) across "
                f"the first ever page load (open + rows, a worker's caches cold), against a "
                f"{fixture.size / MiB:,.0f} MiB file (target: under a tenth of it; no "
                f"request reads the whole file); the first jump to the last row "
                f"{cold.jump_bytes / MiB:.1f} MiB; a page of a fresh row group: "
                f"{', '.join(f'{b / MiB:.1f}' for b in served[2:])} MiB; a repeat open "
                f"(row groups decoded in a worker already): "
                f"{', '.join(f'{p.served_bytes / MiB:.1f}' for p in first)} MiB"
            ),
        )
    )
    if not quick and max(served) >= fixture.size / 2:
        raise RuntimeError(
            f"an inspector page load read {max(served):,.0f} bytes of a {fixture.size:,}-byte "
            "file: a request read (nearly) the whole file"
        )
