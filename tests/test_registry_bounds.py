"""What one request to the dataset registry may cost a real daemon, and damaged registry
documents listed around (issue 24).

* ``ds_commit`` of hostile manifests up to the layout limit (256 MiB), sent as a client
  sends one (a sealed memfd over the local socket): each is refused by its shape before
  a full parse, with a ``ManifestError`` (or ``InvalidRequestError`` past the limit),
  while the daemon's RSS stays within :data:`RSS_BOUND` of where it started and
  ``/healthz`` answers within a second; concurrent commits are checked
  :data:`~chunkd.gateway.datasets.registry.COMMIT_CHECKS` at a time.
* Version pointers and tag entries planted straight into the registry's files (a 60 MB
  pointer, one of 100,000 ``[``, a torn one): resolving each says which file is
  damaged, ``chunkd dataset ls`` lists every other dataset and warns of them, and
  ``/v1/inspect/datasets`` answers 200.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest

from chunkd import memfd
from chunkd.client import Client
from chunkd.client.protocol import MAX_LAYOUT
from chunkd.errors import InvalidRequestError, ManifestError
from chunkd.gateway.datasets.registry import COMMIT_CHECKS, DOCUMENT_BYTES
from chunkd.snapshot import Member, Snapshot

from .conftest import Daemon, dataset_cli

#: how much the daemon's resident memory may grow while hostile manifests of up to
#: 256 MiB each are refused (their pages are the client's memfd's, mapped, and a large
#: one is checked by a worker process): a full parse of one would take 6.5 GiB
RSS_BOUND = 64 << 20
#: the slowest /healthz answer allowed meanwhile
HEALTHZ_SECONDS = 1.0
RECORD = 16


# -- helpers -----------------------------------------------------------------------------


def rss(pid: int) -> int:
    """A process's resident memory (VmRSS), bytes."""
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"VmRSS:\s+(\d+) kB", status)
    assert found is not None
    return int(found.group(1)) * 1024


class Watch:
    """In a thread, ``/healthz``'s slowest answer and the daemon's peak RSS, sampled
    every 50 ms until stopped."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.slowest = 0.0
        self.base = rss(daemon.process.pid)
        self.peak = self.base
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                with urllib.request.urlopen(f"{self.daemon.url}/healthz", timeout=10) as answer:
                    assert answer.status == 200
            except OSError as exc:
                self.failures.append(repr(exc))
            self.slowest = max(self.slowest, time.monotonic() - started)
            self.peak = max(self.peak, rss(self.daemon.process.pid))
            self._stop.wait(0.05)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)


def sealed_pattern(head: bytes, unit: bytes, tail: bytes, size: int) -> int:
    """A sealed memfd of ``size`` bytes: ``head``, ``unit`` repeated, ``tail`` (written
    in pieces: the test never holds the whole in its heap)."""
    fd = memfd.create("hostile", size)
    body = size - len(head) - len(tail)
    block = unit * max(1, (8 << 20) // len(unit))
    memfd.write_at(fd, head, 0)
    at = len(head)
    while at < len(head) + body - len(block):
        memfd.write_at(fd, block, at)
        at += len(block)
    rest = len(head) + body - at
    memfd.write_at(fd, (unit * (rest // len(unit) + 1))[:rest], at)
    memfd.write_at(fd, tail, size - len(tail))
    memfd.seal(fd)
    return fd


def commit_fd(client: Client, fd: int, name: str, timeout: float = 60) -> dict[str, Any]:
    try:
        return dict(client.request("ds_commit", {"name": name}, fds=[fd], timeout=timeout).header)
    finally:
        os.close(fd)


def snapshot_of(client: Client, keys: list[str], prefix: str = "data/") -> Snapshot:
    members = []
    for key in keys:
        stat = client.stat(f"local/{key}")
        members.append(
            Member(
                key, stat.size, stat.version, "fixed", stat.size // RECORD, {"record_bytes": RECORD}
            )
        )
    return Snapshot.build(schema=1, backend="local", prefix=prefix, format="fixed", members=members)


def commit(client: Client, snapshot: Snapshot, name: str) -> dict[str, Any]:
    return commit_fd(client, memfd.sealed(snapshot.data), name)


def large_snapshot(client: Client, target: int, tag: str) -> Snapshot:
    """A legitimate manifest of about ``target`` bytes: one real object listed many times
    under other keys (the manifest is checked, its members are not read)."""
    stat = client.stat("local/data/a.bin")
    meta = {"index": [[i * 1024, i * 111_111] for i in range(40)]}
    one = len(json.dumps(Member("x" * 24, 1, stat.version, "jsonl", 1, meta).to_json()))
    members = [
        Member(f"data/{tag}/{i:08d}.jsonl", stat.size, stat.version, "jsonl", 40_960, meta)
        for i in range(target // one)
    ]
    return Snapshot.build(
        schema=1, backend="local", prefix="data/", format="jsonl", members=members
    )


def workers_of(pid: int) -> int:
    """How many manifest-check workers (``python -m chunkd.snapshot``) ``pid`` runs."""
    count = 0
    for child in Path(f"/proc/{pid}/task").glob("*/children"):
        for kid in child.read_text().split():
            try:
                cmdline = Path(f"/proc/{kid}/cmdline").read_bytes()
            except OSError:
                continue
            count += b"chunkd.snapshot" in cmdline
    return count


@pytest.fixture
def node(start_daemon: Callable[..., Daemon], tmp_path: Path) -> Iterator[tuple[Daemon, Client]]:
    """A daemon on the embedded default (a writable file backend 'local' at
    ./chunkd-data, the registry at local/datasets), with two small objects."""
    daemon = start_daemon(cwd=tmp_path / "node")
    data = daemon.cwd / "chunkd-data" / "data"
    data.mkdir(parents=True)
    (data / "a.bin").write_bytes(os.urandom(RECORD * 64))
    (data / "b.bin").write_bytes(os.urandom(RECORD * 32))
    with Client(daemon.cwd / "chunkd.sock") as client:
        yield daemon, client


# -- ds_commit ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_hostile_manifests_up_to_the_layout_limit_are_refused_before_a_full_parse(
    node: tuple[Daemon, Client],
) -> None:
    daemon, client = node
    limit = MAX_LAYOUT
    deep = b"[" + b" " * (6 * 32)  # nested past 32 at one list per 6 bytes
    cases = [
        # (what, memfd, the refusal's words)
        ("[{}, ...] at the limit", lambda: sealed_pattern(b"[", b"{},", b"{}]", limit), "not JSON"),
        (
            '{"members": [{}, ...]} at the limit',
            lambda: sealed_pattern(b'{"members":[', b"{},", b"{}]}", limit),
            "more than one in 6 bytes",
        ),
        ("[[[[... at the limit", lambda: sealed_pattern(b"", b"[", b"", limit), "not JSON"),
        (
            '{"a": [[[[... at the limit',
            lambda: sealed_pattern(b'{"a":', b"[", b"", limit),
            "more than one in 6 bytes",
        ),
        (
            "nested 10,000 deep, one list per 6 bytes",
            lambda: sealed_pattern(b'{"a":', deep, b"]" * 10_000 + b"}", 10_000 * (len(deep) + 1)),
            "more than 32 deep",
        ),
        ("[ x 100,000", lambda: memfd.sealed(b"[" * 100_000), "not JSON"),
    ]
    with Watch(daemon) as watch:
        for what, make, words in cases:
            started = time.monotonic()
            with pytest.raises(ManifestError, match="refused before it was parsed") as refused:
                commit_fd(client, make(), "hostile")
            took = time.monotonic() - started
            assert words in str(refused.value), (what, str(refused.value))
            # A full parse of 256 MiB of [{}, ...] takes tens of seconds and 6.5 GiB.
            assert took < 20, (what, took)
        # One byte past the limit: refused by its size, nothing read.
        with pytest.raises(InvalidRequestError, match="exceeds"):
            commit_fd(client, sealed_pattern(b"{", b" ", b"}", limit + 1), "hostile")
    assert not watch.failures, watch.failures
    assert watch.slowest < HEALTHZ_SECONDS, f"/healthz took {watch.slowest:.2f}s"
    grew = watch.peak - watch.base
    assert grew < RSS_BOUND, f"the daemon grew {grew >> 20} MiB"
    # Nothing was registered, nothing went to the log as a failure, and the daemon
    # still registers a real manifest.
    log = daemon.log.read_text(errors="replace")
    assert "Traceback" not in log
    assert "the daemon failed" not in log
    good = snapshot_of(client, ["data/a.bin", "data/b.bin"])
    assert commit(client, good, "hostile")["version"] == 1


@pytest.mark.timeout(60)
def test_concurrent_commits_are_checked_a_few_at_a_time_in_workers(
    node: tuple[Daemon, Client],
) -> None:
    daemon, client = node
    snapshots = [large_snapshot(client, 4 << 20, f"set{i}") for i in range(3 * COMMIT_CHECKS)]
    answers: list[dict[str, Any]] = []
    errors: list[BaseException] = []

    def register(snapshot: Snapshot, name: str) -> None:
        try:
            with Client(daemon.cwd / "chunkd.sock") as own:
                answers.append(commit(own, snapshot, name))
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=register, args=(s, f"big/{i}")) for i, s in enumerate(snapshots)
    ]
    most = 0
    with Watch(daemon) as watch:
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads):
            most = max(most, workers_of(daemon.process.pid))
            time.sleep(0.02)
    assert not errors, errors
    assert sorted(a["snapshot"] for a in answers) == sorted(s.id for s in snapshots)
    assert 1 <= most <= COMMIT_CHECKS, most
    assert watch.slowest < HEALTHZ_SECONDS, f"/healthz took {watch.slowest:.2f}s"
    assert watch.peak - watch.base < RSS_BOUND
    assert "checked in a worker" in daemon.log.read_text(errors="replace")


# -- registry documents ------------------------------------------------------------------


def cli(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return dataset_cli(daemon, *args, check=False)


@pytest.mark.timeout(60)
def test_damaged_registry_documents_are_bounded_named_and_listed_around(
    node: tuple[Daemon, Client],
) -> None:
    daemon, client = node
    good = snapshot_of(client, ["data/a.bin", "data/b.bin"])
    for name in ("alpha", "big", "deep", "mid", "torn", "zeta"):
        commit(client, good, name)
    client.request("ds_tag", {"name": "mid", "tag": "prod", "ref": "1"})
    names = daemon.cwd / "chunkd-data" / "datasets" / "names"
    planted = {
        "big": b'{"id": "' + b"a" * (60 << 20) + b'"}',  # 60 MB
        "deep": b"[" * 100_000,
        "torn": b"torn{",
    }
    for name, body in planted.items():
        (names / name / "_versions" / "000000000002.json").write_bytes(body)
    (names / "mid" / "_tags" / "prod" / "000000000002.json").write_bytes(b"{" * 100_000)

    with Watch(daemon) as watch:
        for name in planted:
            started = time.monotonic()
            with pytest.raises(ManifestError, match=f"names/{name}/_versions/000000000002.json"):
                client.request("ds_resolve", {"ref": name})
            assert time.monotonic() - started < 2
        with pytest.raises(ManifestError, match="more than 4096 bytes"):
            client.request("ds_resolve", {"ref": "big@2"})
        with pytest.raises(ManifestError, match="damaged"):
            client.request("ds_resolve", {"ref": "mid@prod"})
        # Their first versions, and the other datasets, are untouched.
        with client.request("ds_resolve", {"ref": "big@1"}) as reply:  # its fds closed
            assert reply.header["snapshot"] == good.id

        listed = cli(daemon, "ls")
        assert listed.returncode == 0, listed.stderr
        rows = [line.split()[0] for line in listed.stdout.splitlines()[1:]]
        assert rows == ["alpha", "mid", "zeta"]
        for name in planted:
            warned = rf"warning: dataset {name} is damaged: .*{name}/_versions"
            assert re.search(warned, listed.stderr), listed.stderr
        as_json = json.loads(cli(daemon, "ls", "--json").stdout)
        damaged = {e["name"]: e["damaged"] for e in as_json if "damaged" in e}
        assert sorted(damaged) == sorted(planted)
        assert damaged["big"]["key"] == "datasets/names/big/_versions/000000000002.json"
        assert re.search(r"holds \d+ bytes, and no document .* over 4096", damaged["big"]["error"])
        with client.request("ds_versions", {"name": "deep"}) as reply:
            versions = json.loads(reply.payload)
        assert [v["version"] for v in versions] == [1, 2]
        assert versions[0]["snapshot"] == good.id
        assert versions[1]["snapshot"] is None
        assert "damaged" in versions[1]

        status, _, body = daemon.get("/v1/inspect/datasets")
        assert status == 200, body[:500]
        shown = {d["name"] for d in json.loads(body)["datasets"]}
        assert {"alpha", "mid", "zeta"} <= shown
        # One dataset's page shows its damaged version as damaged, not a failure.
        status, _, body = daemon.get("/v1/inspect/dataset?name=deep")
        assert status == 200, body[:500]
        pages = json.loads(body)["versions"]
        assert [v["version"] for v in pages] == [1, 2]
        assert pages[1]["snapshot"] is None
        assert "000000000002.json" in pages[1]["damaged"]["key"]
    assert watch.slowest < HEALTHZ_SECONDS, f"/healthz took {watch.slowest:.2f}s"
    assert DOCUMENT_BYTES == 4096
    log = daemon.log.read_text(errors="replace")
    assert "Traceback" not in log
    assert "RecursionError" not in log
    # Registering again repairs each: the next number is taken.
    for name in planted:
        assert commit(client, good, name)["version"] == 3


# -- resolving ---------------------------------------------------------------------------

#: how much the daemon may grow while 16 clients resolve one 16 MiB manifest at once: the
#: one parse it makes and keeps (about 15 times the manifest's size), with room to spare;
#: a parse per request would take several times that
RESOLVE_RSS_BOUND = 400 << 20
#: what a tag move or a hostile manifest's refusal may cost the daemon: neither is parsed
UNPARSED_RSS_BOUND = 48 << 20


def parses_of(daemon: Daemon, ident: str) -> int:
    """How many times the daemon's log says it parsed snapshot ``ident``'s manifest."""
    return daemon.log.read_text(errors="replace").count(f"snapshot {ident} parsed")


@pytest.mark.timeout(60)
def test_concurrent_resolves_of_a_large_manifest_parse_it_once(
    node: tuple[Daemon, Client],
) -> None:
    daemon, client = node
    wide = large_snapshot(client, 16 << 20, "wide")
    assert commit(client, wide, "wide")["version"] == 1
    answers: list[str] = []
    errors: list[BaseException] = []

    def open_it() -> None:
        try:
            with (
                Client(daemon.cwd / "chunkd.sock") as own,
                own.request("ds_resolve", {"ref": "wide"}, timeout=50) as reply,
            ):
                answers.append(reply.header["snapshot"])
                assert os.fstat(reply.fds[0]).st_size == len(wide.data)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_it) for _ in range(16)]
    with Watch(daemon) as watch:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(50)
    assert not errors, errors
    assert answers == [wide.id] * 16
    assert parses_of(daemon, wide.id) == 1
    assert not watch.failures, watch.failures
    assert watch.slowest < HEALTHZ_SECONDS, f"/healthz took {watch.slowest:.2f}s"
    grew = watch.peak - watch.base
    assert grew < RESOLVE_RSS_BOUND, f"the daemon grew {grew >> 20} MiB"
    # Kept: the next resolve parses nothing.
    with client.request("ds_resolve", {"ref": "wide@1"}) as reply:  # its fds closed
        assert reply.header["snapshot"] == wide.id
    assert parses_of(daemon, wide.id) == 1

    # A tag move reads the version pointer, never the manifest.
    other = large_snapshot(client, 16 << 20, "other")
    assert commit(client, other, "other")["version"] == 1
    with Watch(daemon) as watch:
        moved = client.request("ds_tag", {"name": "other", "tag": "prod", "ref": "1"}).header
    assert (moved["snapshot"], moved["version"]) == (other.id, 1)
    assert parses_of(daemon, other.id) == 0
    assert watch.peak - watch.base < UNPARSED_RSS_BOUND, (watch.peak - watch.base) >> 20


@pytest.mark.timeout(60)
def test_a_hostile_manifest_in_the_registry_is_refused_by_a_worker_when_resolved(
    node: tuple[Daemon, Client],
) -> None:
    daemon, client = node
    # Planted straight into the registry's files under its own hash (as a writer of the
    # backend, or a daemon before the shape check, could): 64 MiB of [{}, ...].
    size = 64 << 20
    body = b'{"members":[' + b"{}," * ((size - 16) // 3) + b"{}]}"
    ident = blake3.blake3(body).hexdigest()
    manifests = daemon.cwd / "chunkd-data" / "datasets" / "manifests"
    manifests.mkdir(parents=True, exist_ok=True)
    (manifests / f"{ident}.json").write_bytes(body)
    del body
    with (
        Watch(daemon) as watch,
        pytest.raises(ManifestError, match="refused before it was parsed"),
    ):
        client.request("ds_resolve", {"ref": ident}, timeout=50)
    assert watch.slowest < HEALTHZ_SECONDS, f"/healthz took {watch.slowest:.2f}s"
    grew = watch.peak - watch.base
    assert grew < UNPARSED_RSS_BOUND, f"the daemon grew {grew >> 20} MiB"
    log = daemon.log.read_text(errors="replace")
    assert "checked in a worker" in log
    assert "Traceback" not in log
