"""Paged snapshots at scale: opening one, a cluster opening one, and registering on Ray,
each against what a user had (or would use) instead.

1. **Open and first batch at 10M members.** A snapshot of Parquet-like members (3 row
   groups of 100 rows each; no member file exists, and nothing here reads one) is
   written straight into a ``file://`` registry as :mod:`chunkd.gateway.datasets.layout`
   lays it out: its pages by :class:`~chunkd.snapshot.PageWriter` under ``pages/``, its
   root under ``manifests/``, a version pointer and the name's hint. A **fresh process**
   then opens it by name through a real daemon (``Dataset.open``), builds the epoch's
   order (``order_of``), locates the loader's first batch of rank 0 of 8 at batch 256
   (``step_positions`` then ``order.locate``) and loads the pages of those members (the
   batch's bytes are the time-to-first-batch bench's, ``ttfb``). The figures: seconds
   from before the open to the pages in hand, and the RSS the process added after its
   imports (its peak, VmHWM, over its VmRSS before the open; bound 100 MiB, the scale
   test's). Baseline: the same of a schema-1 manifest (one JSON document, every member
   inline: what chunkd wrote before pages) at 1M members. Rows: schema 2 at 1M and at
   10M against schema 1 at 1M. 3 rounds a side, alternating, after one warm-up open
   each (the daemon's own parse of a schema-1 manifest is then cached, as it is for
   every rank after the first). ``--quick``: 20,000 members, both schemas.
2. **Registry reads per cluster open, in the peers lab.** Three daemons peered on
   loopback, the registry in moto's S3 server (requests counted on moto's side, its
   recorder), a schema-2 snapshot of 200,000 small members committed once; then 4
   readers per node (threads, each its own client) open it by name and load every page.
   Page GETs a page, against the same three daemons without ``[peers]`` (each node
   fetches for itself). Fresh daemons (empty caches) each round, 3 rounds.
   ``--quick``: 10,000 members, 2 readers a node, 1 round.
3. **Registration on Ray.** ``chunkd dataset register --ray`` of 100,000 small Parquet
   files on a local Ray cluster of two nodes (``ray.cluster_utils.Cluster``), each with
   its own peered daemon, in a network namespace (loopback only), against the local
   registration of the same files by node 0's daemon; 3 rounds alternating.
   ``--quick``: 1,000 files, 1 round. The full bench registers 1,000,000 files once
   more on both engines when the disk has room. Skipped (a note on stdout) without
   Ray, root or ``ip``.

On a machine of few cores, the Ray cluster's two nodes, both daemons and the driver
share them: that row measures what Ray costs (or gives) a registration on one machine,
not a cluster's speed-up.

It is one job at ~800 lines: paged snapshots at scale, one scenario family (opening one,
a cluster opening one, registering one on Ray), each against its baseline (a schema-1
manifest, daemons without peers, a local registration), sharing the snapshot writer and
the labs of daemons that family needs; the daemons are :class:`bench.daemon.BenchDaemon`
and the kit's launcher (:class:`~chunkd.testing.daemon.DaemonProcess`), and the rows go
to :class:`bench.report.Report`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chunkd.testing.daemon import DaemonProcess

from .daemon import BenchDaemon
from .report import Report, Result, Rounds

__all__ = ["run"]

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MiB = 1 << 20
#: the RSS a fresh process may add to open a snapshot and locate a batch (the test's)
MAX_ADDED_RSS = 100 << 20
#: the loader's first batch: rank 0 of WORLD at BATCH
WORLD, BATCH = 8, 256
TOKEN = "a-shared-secret-for-the-scale-bench"
#: the full bench's second registration on Ray, once (0: none)
RAY_LARGE = 1_000_000

# -- 1. open and first batch -------------------------------------------------------------


def _member(i: int) -> Any:
    from chunkd.snapshot import Member

    groups = [[100, 4 + g * 5000, 5000, 40_000] for g in range(3)]
    meta = {"footer": [15_004, 100], "row_groups": groups}
    return Member(f"data/part-{i:09d}.parquet", 15_108, "1733400000-15108", "parquet", 300, meta)


class _DirPages:
    """Pages read from the registry's ``pages/`` folder (what ``from_pages`` asks for)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def page(self, page_id: str) -> bytes:
        return (self.folder / f"{page_id}.json").read_bytes()


def _write_registered(registry: Path, name: str, members: int, schema: int) -> tuple[str, int]:
    """Snapshot ``name`` of ``members`` generated members, written into the registry
    folder as a commit lays it out (pages, manifest, pointer, hint): its id and its
    manifest's (root's) size."""
    from chunkd.canonical import canonical
    from chunkd.snapshot import PageWriter, Snapshot

    pages = registry / "pages"
    pages.mkdir(parents=True, exist_ok=True)
    if schema == 2:

        def sink(page_id: str, data: bytes) -> None:
            (pages / f"{page_id}.json").write_bytes(data)

        writer = PageWriter(sink)
        for i in range(members):
            writer.add(_member(i))
        snapshot = Snapshot.from_pages(
            backend="data",
            prefix="data/",
            format="parquet",
            pages=writer.finish(),
            source=_DirPages(pages),
        )
    else:
        snapshot = Snapshot.build(
            backend="data",
            prefix="data/",
            format="parquet",
            members=[_member(i) for i in range(members)],
            schema=1,
        )
    (registry / "manifests").mkdir(parents=True, exist_ok=True)
    (registry / "manifests" / f"{snapshot.id}.json").write_bytes(snapshot.data)
    versions = registry / "names" / name / "_versions"
    versions.mkdir(parents=True, exist_ok=True)
    pointer = {
        "format": "chunkd-dataset-version",
        "schema": 1,
        "name": name,
        "version": 1,
        "id": snapshot.id,
        "created": time.time(),
    }
    (versions / f"{1:012d}.json").write_bytes(canonical(pointer))
    (registry / "names" / name / "_latest.json").write_bytes(canonical({"version": 1}))
    return snapshot.id, len(snapshot.data)


#: the fresh process: imports first (not counted), then the open, the order, the first
#: batch's positions and their members' pages
_OPENER = """
import json, sys, time
import numpy as np
from chunkd.client import Client
from chunkd.client.datasets.dataset import Dataset
from chunkd.client.datasets.formats import format_of
from chunkd.client.datasets.loader import order_of, step_positions
from chunkd.client.datasets.state import LoaderState

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise LookupError(field)

name, world, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
format_of("parquet")  # the format's module: an import too
client = Client()
before = status("VmRSS")
started = time.perf_counter()
dataset = Dataset.open(name, client)
snapshot = dataset.snapshot
opened = time.perf_counter() - started
order = order_of(snapshot, LoaderState(snapshot.id, 1234, 0, 0))
positions, _ = step_positions(0, rank=0, batch_size=batch, world_size=world, total=len(order))
members, samples = order.locate(positions)
held = [snapshot.members[int(m)] for m in members]  # their pages, loaded and checked
done = time.perf_counter() - started
assert all(0 <= int(s) < h.samples for s, h in zip(samples, held))
print(json.dumps({
    "open_s": opened,
    "first_s": done,
    "added_rss": status("VmRSS") - before,
    "added_peak": status("VmHWM") - before,
    "page_loads": snapshot.page_loads,
    "pages": len(snapshot.pages),
    "schema": snapshot.schema,
    "members": len(set(int(m) for m in members)),
}))
"""


def _open_fresh(socket: str, name: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
    env["CHUNKD_SOCKET"] = socket
    done = subprocess.run(
        [sys.executable, "-c", _OPENER, name, str(WORLD), str(BATCH)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"opening {name} failed: {done.stderr[-3000:]}")
    found: dict[str, float] = json.loads(done.stdout.splitlines()[-1])
    return found


def _open_at_scale(report: Report, work: Path, *, quick: bool) -> None:
    """Schema 2 at 1M and 10M members against schema 1 at 1M (``--quick``: both at
    100k), each opened in fresh processes through one daemon."""
    small, large = (20_000, None) if quick else (1_000_000, 10_000_000)
    data = work / "data"
    registry = data / "registry"
    written: dict[str, tuple[int, int, float]] = {}
    plan = [("flat", small, 1), ("paged", small, 2)]
    if large is not None:
        plan.append(("paged-large", large, 2))
    for name, members, schema in plan:
        print(f"scale: writing {members:,} members (schema {schema})", flush=True)
        started = time.perf_counter()
        _, size = _write_registered(registry, f"scale/{name}", members, schema)
        written[name] = (members, size, time.perf_counter() - started)
    config = work / "chunkd.toml"
    config.write_text(
        f"""
[cache]
dir = "{work / "cache"}"
ram_bytes = "512MiB"
disk_bytes = "2GiB"
disk_min_free_bytes = 0
fsync = "never"

[[backends]]
name = "data"
url = "file://{data}"
writable = true

[datasets]
registry = "data/registry"
"""
    )
    daemon = BenchDaemon(work / "daemon", {}, config=config)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in plan}
    try:
        for name, _, _ in [] if quick else plan:  # warm-up: the daemon's first resolve
            _open_fresh(daemon.socket, f"scale/{name}")
        for r in range(report.rounds_for(1 if quick else 3)):
            for name, _, _ in plan if r % 2 == 0 else plan[::-1]:
                runs[name].append(_open_fresh(daemon.socket, f"scale/{name}"))
    finally:
        daemon.stop()

    def pick(name: str, key: str, scale: float = 1.0) -> list[float]:
        return [max(run[key] * scale, 1e-6) for run in runs[name]]

    def med(name: str, key: str, scale: float = 1.0) -> float:
        return statistics.median(pick(name, key, scale))

    flat_members, flat_size, _ = written["flat"]
    baseline = f"schema 1 (one JSON manifest) at {flat_members / 1e6:g}M members"
    flat_note = (
        f"schema 1: a manifest of {flat_size / MiB:.0f} MiB, open "
        f"{med('flat', 'open_s'):.2f} s, added RSS peak "
        f"{med('flat', 'added_peak', 1 / MiB):.0f} MiB"
    )
    for name in [n for n, _, _ in plan if n != "flat"]:
        members, size, wrote = written[name]
        label = f"{members / 1e6:g}M members"
        first = runs[name][0]
        common = (
            f"a fresh process each round ({len(runs[name])} a side"
            f"{', the first of each cold' if quick else ', after a warm-up each'}), through "
            "one daemon: "
            f"Dataset.open by name, order_of, step_positions of rank 0 of {WORLD} at batch "
            f"{BATCH}, order.locate, and the pages of the batch's {int(first['members'])} "
            f"members (the batch's bytes: the ttfb bench); schema 2: a root of "
            f"{size / 1024:.0f} KiB naming {int(first['pages']):,} pages, open "
            f"{med(name, 'open_s') * 1e3:.0f} ms, {int(first['page_loads'])} pages loaded "
            f"(written once in {wrote:.0f} s by PageWriter); {flat_note}"
        )
        report.add(
            Result(
                f"open + first batch positions, schema 2 at {label}",
                med(name, "first_s"),
                med("flat", "first_s"),
                "s",
                baseline,
                samples=Rounds.of(pick(name, "first_s"), pick("flat", "first_s")),
                better="lower",
                note=common,
            )
        )
        report.add(
            Result(
                f"open + first batch: added RSS, schema 2 at {label}",
                med(name, "added_peak", 1 / MiB),
                med("flat", "added_peak", 1 / MiB),
                "MiB",
                baseline,
                target_max=MAX_ADDED_RSS / MiB,
                samples=Rounds.of(
                    pick(name, "added_peak", 1 / MiB), pick("flat", "added_peak", 1 / MiB)
                ),
                better="lower",
                note=(
                    "the fresh process's peak RSS (VmHWM) over its RSS after the imports; "
                    f"its RSS at the end: {med(name, 'added_rss', 1 / MiB):.0f} MiB added "
                    f"(schema 1: {med('flat', 'added_rss', 1 / MiB):.0f} MiB); the bound is "
                    "the scale test's, 100 MiB"
                ),
            )
        )


# -- 2. registry reads per cluster open ---------------------------------------------------


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
        body = answer.read().decode()
    total = 0.0
    for line in body.splitlines():
        head, _, value = line.rpartition(" ")
        if head.partition("{")[0] == name:
            total += float(value)
    return total


def _lab_toml(work: Path, node: int, ports: list[int], endpoint: str, *, peered: bool) -> str:
    from chunkd.testing import s3_backend

    folder = work / f"n{node}"
    folder.mkdir(parents=True, exist_ok=True)
    members = ", ".join(f'"127.0.0.1:{p}"' for p in ports)
    peers = (
        f"""
[peers]
self = "127.0.0.1:{ports[node]}"
members = [{members}]
token_file = "{work / "token"}"
timeout = "2s"
health_interval = "300ms"
down_after = 4
up_after = 1
"""
        if peered
        else ""
    )
    return f"""
[server]
listen = "127.0.0.1:{ports[node]}"
socket = "{folder / "chunkd.sock"}"

[cache]
dir = "{folder / "cache"}"
ram_bytes = "256MiB"
disk_bytes = "1GiB"
disk_min_free_bytes = 0
fsync = "never"
{peers}
{s3_backend("ckpt", "s3://scale-lab/pre", endpoint, writable=True, retries=1)}

[datasets]
registry = "ckpt/datasets"
"""


@contextlib.contextmanager
def _lab_nodes(
    work: Path, endpoint: str, *, peered: bool, count: int = 3
) -> Iterator[list[BenchDaemon]]:
    """``count`` fresh daemons (empty caches) on loopback, peered or each alone."""
    from chunkd.testing import free_port

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "token").write_text(TOKEN)
    (work / "token").chmod(0o600)
    ports = [free_port() for _ in range(count)]
    nodes: list[BenchDaemon] = []
    try:
        for node in range(count):
            config = work / f"n{node}.toml"
            config.write_text(_lab_toml(work, node, ports, endpoint, peered=peered))
            nodes.append(
                BenchDaemon(
                    work / f"n{node}",
                    {"CHUNKD_SERVER_SOCKET": str(work / f"n{node}" / "chunkd.sock")},
                    config=config,
                    port=ports[node],
                )
            )
        deadline = time.monotonic() + 30
        while peered and any(_metric(n.url, "chunkd_peer_healthy") < count for n in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the lab's nodes never all saw each other up")
            time.sleep(0.1)
        yield nodes
    finally:
        for daemon in nodes:
            daemon.stop()


def _recorded_page_gets(recording: Path) -> tuple[int, int, int, int]:
    """(page GETs, distinct pages got, page HEADs, requests in all) moto recorded."""
    gets: list[str] = []
    heads = total = 0
    for line in recording.read_text().splitlines():
        entry = json.loads(line)
        total += 1
        path = entry["url"].split("?")[0]
        if "/datasets/pages/" in path:
            if entry["method"] == "GET":
                gets.append(path)
            elif entry["method"] == "HEAD":
                heads += 1
    return len(gets), len(set(gets)), heads, total


def _cluster_open(report: Report, work: Path, *, quick: bool) -> None:
    """Page GETs a page when 3 nodes x N readers open one snapshot: peered daemons
    against daemons each alone."""
    from chunkd.client import Client
    from chunkd.client.datasets.dataset import resolve
    from chunkd.client.datasets.pages import commit_snapshot
    from chunkd.snapshot import Member, MemoryPages, Snapshot
    from chunkd.testing import CountingProxy, S3Server

    members, readers = (10_000, 2) if quick else (200_000, 4)
    recording = work / "moto-recording.jsonl"
    work.mkdir(parents=True, exist_ok=True)
    saved = {k: os.environ.get(k) for k in ("MOTO_ENABLE_RECORDING", "MOTO_RECORDER_FILEPATH")}
    os.environ |= {"MOTO_ENABLE_RECORDING": "true", "MOTO_RECORDER_FILEPATH": str(recording)}
    try:
        server = S3Server.start()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    proxy = CountingProxy(server.port)
    per_page: tuple[list[float], list[float]] = ([], [])
    heads: tuple[list[int], list[int]] = ([], [])
    requests: tuple[list[float], list[float]] = ([], [])
    other: tuple[list[int], list[int]] = ([], [])
    try:
        server.client().create_bucket(Bucket="scale-lab")
        pages = MemoryPages()
        snapshot = Snapshot.build(
            backend="ckpt",
            prefix="data/",
            format="fixed",
            members=[
                Member(f"m/{i:07d}.bin", 64, f"v{i}", "fixed", 4, {"record_bytes": 16})
                for i in range(members)
            ],
            pages=pages,
            schema=2,
        )
        count = len({ref.id for ref in snapshot.pages})
        with (
            _lab_nodes(work / "commit", proxy.endpoint, peered=False, count=1) as nodes,
            Client(nodes[0].socket, timeout=120) as client,
        ):
            commit_snapshot(client, "scale/lab", snapshot, pages)
        del pages

        def open_all(nodes: list[BenchDaemon]) -> None:
            failures: list[BaseException] = []

            def reader(node: BenchDaemon) -> None:
                try:
                    with Client(node.socket, timeout=120) as client:
                        got, _, _ = resolve(client, "scale/lab")
                        loaded = sum(len(got.page_members(p)) for p in range(len(got.pages)))
                except BaseException as exc:  # raised below, on the bench's thread
                    failures.append(exc)
                    return
                if loaded != members:
                    failures.append(RuntimeError(f"read {loaded} members of {members}"))

            threads = [
                threading.Thread(target=reader, args=(node,))
                for node in nodes
                for _ in range(readers)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=300)
            if failures:
                raise RuntimeError(f"a reader failed: {failures[0]!r}") from failures[0]

        for r in range(report.rounds_for(1 if quick else 3)):
            for peered in (True, False) if r % 2 == 0 else (False, True):
                with _lab_nodes(work / "lab", proxy.endpoint, peered=peered) as nodes:
                    recording.write_text("")  # only the opens are counted
                    open_all(nodes)
                    gets, distinct, head, total = _recorded_page_gets(recording)
                if distinct != count:
                    raise RuntimeError(f"{distinct} distinct pages got of {count}")
                side = 0 if peered else 1
                per_page[side].append(gets / count)
                heads[side].append(head)
                requests[side].append((gets + head) / count)
                other[side].append(total - gets - head)
    finally:
        proxy.close()
        server.stop()
    report.add(
        Result(
            f"cluster open: registry page GETs a page, 3 nodes x {readers} readers",
            statistics.median(per_page[0]),
            statistics.median(per_page[1]),
            "GETs/page",
            "the same 3 daemons without [peers] (each node fetches for itself)",
            samples=Rounds.of(*per_page),
            better="lower",
            note=(
                f"moto's S3 server as the registry, every request it served recorded; a "
                f"schema-2 snapshot of {members:,} members in {count} pages; each of "
                f"{3 * readers} readers (threads, a client each) opens it by name and loads "
                f"every page; fresh daemons each round; page HEADs (a node learns a page "
                f"object's version once): {statistics.median(heads[0]):.0f} peered, "
                f"{statistics.median(heads[1]):.0f} alone; the registry's other requests "
                f"(pointer, hint, manifest): {statistics.median(other[0]):.0f} peered, "
                f"{statistics.median(other[1]):.0f} alone; the issue's aim: about 1 GET a "
                "page for the cluster"
            ),
        )
    )
    report.add(
        Result(
            f"cluster open: registry page requests a page (GET + HEAD), 3 nodes x {readers}",
            statistics.median(requests[0]),
            statistics.median(requests[1]),
            "req/page",
            "the same 3 daemons without [peers] (each node fetches for itself)",
            samples=Rounds.of(*requests),
            better="lower",
            note=(
                "every request for a page the registry served, HEADs too: a peered node "
                "that gets a page from its owner still HEADs the page's object once for "
                "its version, so the requests a page grow with the nodes (1 + nodes) "
                "where the bytes do not; alone, each node's GET is all (nodes)"
            ),
        )
    )


# -- 3. registration on Ray --------------------------------------------------------------

# The cluster, in a process of its own inside the namespace (as tests/test_ray_bulk.py):
# two nodes, each of whose workers reaches its own node's daemon through CHUNKD_SOCKET;
# the address on stdout; shut down by its handle when stdin closes.
_CLUSTER = """
import json, sys
from ray.cluster_utils import Cluster
sockets = json.loads(sys.argv[1])
common = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 200 << 20}
cluster = Cluster(
    initialize_head=True,
    head_node_args={**common, "include_dashboard": False,
                    "env_vars": {"CHUNKD_SOCKET": sockets[0]}},
)
try:
    for socket in sockets[1:]:
        cluster.add_node(**common, env_vars={"CHUNKD_SOCKET": socket})
    cluster.wait_for_nodes()
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On
    ray.init(address=cluster.address, log_to_driver=False)
    warm = ray.remote(num_cpus=1)(lambda: None)
    ray.get([warm.options(scheduling_strategy=On(n["NodeID"], soft=False)).remote()
             for n in ray.nodes() if n["Alive"]])
    ray.shutdown()
    print(json.dumps({"address": cluster.address}), flush=True)
    sys.stdin.read()
finally:
    cluster.shutdown()
"""


def _ray_toml(root: Path, node: int, ports: list[int]) -> str:
    members = ", ".join(f'"127.0.0.1:{p}"' for p in ports)
    return f"""
[server]
listen = "127.0.0.1:{ports[node]}"
socket = "{root / f"n{node}" / "chunkd.sock"}"

[cache]
dir = "{root / f"n{node}" / "cache"}"
ram_bytes = "256MiB"
disk_bytes = "1GiB"
disk_min_free_bytes = 0
fsync = "never"

[[backends]]
name = "data"
url = "file://{root / "data"}"
writable = true

[datasets]
registry = "data/registry"

[peers]
self = "127.0.0.1:{ports[node]}"
members = [{members}]
token_file = "{root / "token"}"
timeout = "2s"
health_interval = "300ms"
up_after = 1
"""


class _RayLab:
    """A network namespace holding two peered daemons and a two-node Ray cluster; all
    stopped by their own handles and the namespace removed on :meth:`close`."""

    def __init__(self, root: Path) -> None:
        from chunkd.testing import free_port

        self.root = root
        self.ns = f"chunkd-scale{os.getpid()}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("CHUNKD_", "RAY_"))}
        self.env["RAY_TMPDIR"] = str(root / "ray")
        (root / "ray").mkdir(parents=True, exist_ok=True)
        (root / "token").write_text(TOKEN)
        (root / "token").chmod(0o600)
        self.daemons: list[subprocess.Popen[bytes]] = []
        self.cluster: subprocess.Popen[bytes] | None = None
        self.address = ""
        added = subprocess.run(["ip", "netns", "add", self.ns], capture_output=True, check=False)
        if added.returncode != 0:
            raise OSError(f"cannot make a network namespace: {added.stderr.decode().strip()}")
        try:
            self._start(free_port(), free_port())
        except BaseException:
            self.close()
            raise

    def _exec(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]

    def _start(self, *ports: int) -> None:
        subprocess.run(self._exec("ip", "link", "set", "lo", "up"), check=True)
        launched = []
        for node in range(2):
            launched.append(
                DaemonProcess(
                    _ray_toml(self.root, node, list(ports)),
                    cwd=self.root / f"n{node}",
                    base_env=self.env,
                    prefix=self._exec(),
                    log=self.root / f"daemon-{node}.log",
                    config_path=self.root / f"n{node}.toml",
                )
            )
            self.daemons.append(launched[-1].process)
        for node, daemon in enumerate(launched):
            daemon.wait_socket(self.root / f"n{node}" / "chunkd.sock", timeout=60.0)
        sockets = json.dumps([str(self.root / f"n{n}" / "chunkd.sock") for n in range(2)])
        with (self.root / "cluster.log").open("ab") as sink:
            self.cluster = subprocess.Popen(
                self._exec(sys.executable, "-c", _CLUSTER, sockets),
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=sink,
                start_new_session=True,
            )
        assert self.cluster.stdout is not None
        ready, _, _ = select.select([self.cluster.stdout], [], [], 120)
        line = self.cluster.stdout.readline() if ready else b""
        if not line:
            tail = (self.root / "cluster.log").read_text()[-3000:]
            raise RuntimeError(f"the Ray cluster did not start:\n{tail}")
        self.address = json.loads(line)["address"]
        time.sleep(2)  # the peers' health checks (300 ms apart) see each other up

    def register(self, name: str, prefix: str, *, ray: int) -> dict[str, Any]:
        """``chunkd dataset register`` inside the namespace, as node 0's client; on Ray
        in tasks of ``ray`` files when not 0."""
        env = {**self.env, "CHUNKD_SOCKET": str(self.root / "n0" / "chunkd.sock")}
        argv = [str(BIN / "chunkd"), "dataset", "register", name, prefix, "--json", "--quiet"]
        if ray:
            argv += ["--ray", self.address, "--batch", str(ray)]
        done = subprocess.run(
            self._exec(*argv), env=env, capture_output=True, text=True, timeout=3600, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"registering {name} failed: {done.stderr[-3000:]}")
        found: dict[str, Any] = json.loads(done.stdout)
        return found

    def close(self) -> None:
        if self.cluster is not None:
            if self.cluster.stdin is not None:
                self.cluster.stdin.close()  # the cluster shuts itself down by its handle
            if self.cluster.stdout is not None:
                self.cluster.stdout.close()
            try:
                self.cluster.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.cluster.pid, signal.SIGKILL)  # its own session: ours alone
                self.cluster.wait(timeout=10)
        for process in self.daemons:
            process.terminate()
        for process in self.daemons:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, check=False)


def _ray_missing() -> str:
    if importlib.util.find_spec("ray") is None:
        return "ray is not installed (pip install 'chunkd[ray]')"
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "the Ray cluster runs in a network namespace: that needs root and iproute2"
    return ""


def _ray_registration(report: Report, *, quick: bool) -> None:
    """``register --ray`` on two nodes against the local registration, same files."""
    from .dataset_bench import _write_parquet

    missing = _ray_missing()
    if missing:
        print(f"scale: registration on Ray skipped: {missing}", flush=True)
        return
    # Short: Ray's socket paths live below it.
    root = Path(tempfile.mkdtemp(prefix="ckscale-"))
    try:
        sizes = [1_000] if quick else [100_000]
        if not quick and RAY_LARGE:
            # ~4 KiB of disk a file with its inode, and room for the registry's pages
            free = shutil.disk_usage(root).free
            if free > RAY_LARGE * (16 << 10):
                sizes.append(RAY_LARGE)
            else:
                print(f"scale: 1M files on Ray skipped: {free >> 30} GiB free", flush=True)
        for files in sizes:
            print(f"scale: writing {files:,} Parquet files", flush=True)
            shutil.rmtree(root / "data", ignore_errors=True)
            _write_parquet(root / "data" / f"pq{files}", files)
            lab = _RayLab(root)
            try:
                rounds = 1 if quick or files > 100_000 else report.rounds_for(3)
                batch = min(1024, max(1, files // 8))  # a few tasks on each node at least
                on_ray: list[float] = []
                local: list[float] = []
                runs: list[dict[str, Any]] = []
                for r in range(rounds):
                    for ray in (True, False) if r % 2 == 0 else (False, True):
                        name = f"scale/{'ray' if ray else 'local'}{files}-{r}"
                        found = lab.register(name, f"data/pq{files}/", ray=batch if ray else 0)
                        if found["members"] != files:
                            raise RuntimeError(f"{name}: {found['members']} of {files} files")
                        (on_ray if ray else local).append(float(found["files_per_second"]))
                        runs.append(found)
            finally:
                lab.close()
            ids = {found["snapshot"] for found in runs}
            ray_run = next(found["ray"] for found in runs if "ray" in found)
            report.add(
                Result(
                    f"register {files:,} small Parquet files on Ray (2 nodes)",
                    statistics.median(on_ray),
                    statistics.median(local),
                    "files/s",
                    "the local registration of the same files (one node's daemon)",
                    samples=Rounds.of(on_ray, local),
                    note=(
                        f"a Ray cluster of two nodes of 1 CPU each (ray.cluster_utils) with a "
                        f"peered daemon each, in a network namespace; {ray_run['tasks']} "
                        f"tasks of {batch} files at most on "
                        f"{ray_run['nodes']} nodes; "
                        f"{'the same snapshot id on both' if len(ids) == 1 else 'IDS DIFFER'}; "
                        f"the machine's {os.cpu_count()} cores are shared by both nodes, both "
                        "daemons and the driver: what Ray costs (or gives) on one machine, "
                        "not a cluster's speed-up"
                    ),
                )
            )
            shutil.rmtree(root / "data", ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(report: Report, work: Path, *, quick: bool) -> None:
    """The scenarios (see the module docstring)."""
    work.mkdir(parents=True, exist_ok=True)
    try:
        _open_at_scale(report, work / "open", quick=quick)
        _cluster_open(report, work / "peers", quick=quick)
        _ray_registration(report, quick=quick)
    finally:
        shutil.rmtree(work, ignore_errors=True)
