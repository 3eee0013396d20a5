"""Scale shown, not assumed: a snapshot of a million members, opened and read at random
by a fresh process within a bound on its time and its memory.

The pages are written with the snapshot's own :class:`~chunkd.snapshot.PageWriter` into
a directory (one file a page, named by its id): no member file exists, and nothing
needs one, since the order reads only the manifest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chunkd.errors import DatasetNotFoundError
from chunkd.snapshot import Member, PageRef, PageWriter, Snapshot

#: members of the snapshot
MEMBERS = 1_000_000
#: RSS a process may add to open the snapshot and resolve positions across its epoch
MAX_ADDED_RSS = 100 << 20
#: seconds a fresh process may take to open it (resolve the root, build the order)
MAX_OPEN_SECONDS = 1.0


class DirPages:
    """A page source reading ``DIR/<id>.json`` (the test's process and the fresh one
    both read through it; the daemon's ``ds_page`` serves the same bytes), counting
    the pages it serves."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.served = 0

    def page(self, page_id: str) -> bytes:
        try:
            data = (self.root / f"{page_id}.json").read_bytes()
        except FileNotFoundError:
            raise DatasetNotFoundError(f"page {page_id} is not in {self.root}") from None
        self.served += 1
        return data


#: the fresh process: imports first (not counted), then the open and the positions
READER = """
import importlib.util, json, sys, time
from pathlib import Path
import numpy as np
from chunkd.snapshot import Snapshot
from chunkd.client.datasets.formats import format_of
from chunkd.client.datasets.loader import order_of
from chunkd.client.datasets.state import LoaderState

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise LookupError(field)

folder, snapshot_id, here = sys.argv[1:4]
spec = importlib.util.spec_from_file_location("scale", here)
scale = importlib.util.module_from_spec(spec)
spec.loader.exec_module(scale)
DirPages = scale.DirPages
format_of("parquet")  # the format's module: an import too
before = rss("VmRSS")
started = time.perf_counter()
source = DirPages(folder)
root = (Path(folder) / "root.json").read_bytes()
snapshot = Snapshot.parse(root, snapshot_id, pages=source)
order = order_of(snapshot, LoaderState(snapshot_id, 1234, 7, 0))
opened = time.perf_counter() - started
pages_at_open = source.served
rng = np.random.default_rng(5)
positions = rng.integers(0, len(order), 6).tolist()
checked = []
t = time.perf_counter()
for p in positions:  # each where the snapshot says it is
    (m,), (s,) = order.locate([p])
    member = snapshot.members[m]
    index = int(order.indices([p])[0])
    checked.append(bool(0 <= s < member.samples and snapshot.start_of(m) + s == index))
first = int(rng.integers(0, len(order) - 4096))
run_members, run_samples = order.locate(np.arange(first, first + 4096))
located = time.perf_counter() - t
print(json.dumps({
    "open_s": opened,
    "locate_s": located,
    "added_rss": rss("VmRSS") - before,
    "added_peak": rss("VmHWM") - before,
    "pages_at_open": pages_at_open,
    "pages_served": source.served,
    "pages": len(snapshot.pages),
    "samples": len(snapshot),
    "total": len(order),
    "checked": checked,
    "run_members": len(set(run_members.tolist())),
}))
"""


def write_snapshot(folder: Path) -> Snapshot:
    """A million Parquet-like members of 3 row groups, paged into ``folder``."""

    def sink(page_id: str, data: bytes) -> None:
        (folder / f"{page_id}.json").write_bytes(data)

    writer = PageWriter(sink)
    groups = [[100, 4 + g * 5000, 5000, 40_000] for g in range(3)]
    meta = {"footer": [15_004, 100], "row_groups": groups}
    for i in range(MEMBERS):
        key = f"data/part-{i:07d}.parquet"
        writer.add(Member(key, 15_108, "1733400000-15108", "parquet", samples=300, meta=meta))
    refs: list[PageRef] = writer.finish()
    snapshot = Snapshot.from_pages(
        backend="data", prefix="data/", format="parquet", pages=refs, source=DirPages(folder)
    )
    (folder / "root.json").write_bytes(snapshot.data)
    return snapshot


@pytest.mark.timeout(90)  # writing a million members' pages: 12-35 s; the reader's part: ~3 s
def test_a_million_member_snapshot_opens_in_a_second_and_resolves_any_position_in_100_mb(
    tmp_path: Path,
) -> None:
    snapshot = write_snapshot(tmp_path)
    assert len(snapshot) == 300 * MEMBERS
    assert len(snapshot.pages) >= MEMBERS // 16_384
    env = os.environ | {"PYTHONHASHSEED": "0"}
    out = subprocess.run(
        [sys.executable, "-c", READER, str(tmp_path), snapshot.id, __file__],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env=env,
    )
    found = json.loads(out.stdout)
    assert found["open_s"] <= MAX_OPEN_SECONDS, found
    assert found["pages_at_open"] == 0, found  # the root alone
    assert found["samples"] == found["total"] == 300 * MEMBERS
    assert all(found["checked"]), found
    # 6 positions and a run: at most 7 groups of 4 pages, and the pages of the checks
    assert found["pages_served"] <= 7 * 4 + 6, found
    # a run of 4,096 reads the windows it crosses: of 16 row groups of 100 rows each
    assert found["run_members"] <= 16 * (4096 // 1600 + 2), found
    assert found["added_peak"] <= MAX_ADDED_RSS, found
    assert found["added_rss"] <= MAX_ADDED_RSS, found
