"""What one ``ds_migrate`` costs the daemon's event loop, whatever the number of members.

The migration runs in-process over a real cache, a real read path and real file://
backends. Every destination key is checked before anything is copied: at a million
members that is seconds of work, which must not stall the loop (every other request of
the node waits on it). And the members are copied by a few tasks in turn, not by a task
each.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from chunkd.errors import ReservedKeyError
from chunkd.gateway.backends import Backends
from chunkd.gateway.config import BackendConfig
from chunkd.gateway.datasets.migrate import Migrator
from chunkd.gateway.datasets.registry import Registry
from chunkd.gateway.metrics import Metrics
from chunkd.gateway.readpath import ReadPath
from chunkd.snapshot import Member, Snapshot, page_bytes

from .conftest import OpenCache

RECORD = 16


@pytest.fixture
async def migrator(open_cache: OpenCache, tmp_path: Path) -> AsyncIterator[Migrator]:
    """A migrator from backend ``src`` (``tmp_path/src``) to ``dst`` (the registry's)."""
    for name in ("src", "dst"):
        (tmp_path / name).mkdir()
    metrics = Metrics()
    backends = Backends.from_config(
        [
            BackendConfig("src", f"file://{tmp_path / 'src'}"),
            BackendConfig("dst", f"file://{tmp_path / 'dst'}", writable=True),
        ],
        metrics,
    )
    read_path = ReadPath(await open_cache(), backends, metrics)
    try:
        yield Migrator(Registry(backends, "dst/datasets"), read_path, backends)
    finally:
        await read_path.close()
        await backends.close()


@contextlib.asynccontextmanager
async def loop_watch() -> AsyncIterator[dict[str, float]]:
    """The longest the loop went without running a 1 ms timer, and the most tasks at
    once, while the block runs."""
    seen = {"stall": 0.0, "tasks": 0.0}

    async def tick() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.001)
            now = time.monotonic()
            seen["stall"] = max(seen["stall"], now - last)
            seen["tasks"] = max(seen["tasks"], len(asyncio.all_tasks()))
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    try:
        yield seen
    finally:
        await asyncio.sleep(0.01)  # the ticker sees a stall that lasted until now
        ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticker


async def registered(migrator: Migrator, snapshot: Snapshot) -> Snapshot:
    """``snapshot`` with its member pages put in the registry, where migrate (daemon
    code) loads them from."""
    for page in range(len(snapshot.pages)):
        await migrator.registry.put_page(page_bytes(snapshot.page_members(page)))
    return snapshot


@pytest.mark.timeout(60)
async def test_destination_keys_are_checked_off_the_event_loop(migrator: Migrator) -> None:
    # 100,000 members, the last of which (in key order) lands in the chunk store: every
    # key is checked (about 0.8 s of work here) and the migration is refused before any
    # copy.
    members = [
        Member(f"a/{i:07d}.bin", RECORD, "v", "fixed", 1, {"record_bytes": RECORD})
        for i in range(100_000)
    ]
    members[-1] = Member("chunks/" + "ab" * 32, RECORD, "v", "fixed", 1, {"record_bytes": RECORD})
    snapshot = await registered(
        migrator,
        await asyncio.to_thread(
            Snapshot.build, backend="src", prefix="", format="fixed", members=members
        ),
    )
    async with loop_watch() as seen:
        started = time.monotonic()
        with pytest.raises(ReservedKeyError, match="ds_migrate would write dst/chunks/abab"):
            await migrator.copy(snapshot, "dst", None)
        took = time.monotonic() - started
    print(f"checked 100,000 keys in {took:.2f}s; the loop's longest stall {seen['stall']:.3f}s")
    # On the loop, the check would stall it for nearly all of ``took``; off it, the
    # longest stall is a few ms (a GC pass or a busy CI machine can make it ~0.3 s, so
    # the bound is relative to the work, not an absolute time).
    assert seen["stall"] < took / 2, (seen, took)
    dst = Path(migrator.backends.get("dst").config.prefix)
    # nothing copied (the registry's own folder holds the snapshot's pages)
    assert await asyncio.to_thread(lambda: [p.name for p in dst.iterdir()]) == ["datasets"]


@pytest.mark.timeout(60)
async def test_members_are_copied_by_a_bounded_number_of_tasks(
    migrator: Migrator, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    members = []
    for i in range(300):
        path = src / f"m/{i:04d}.bin"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(i.to_bytes(2, "big") * (RECORD // 2))
        meta = await migrator.backends.get("src").head(f"m/{i:04d}.bin")
        assert meta is not None
        members.append(
            Member(f"m/{i:04d}.bin", RECORD, meta.version, "fixed", 1, {"record_bytes": RECORD})
        )
    snapshot = await registered(
        migrator, Snapshot.build(backend="src", prefix="m/", format="fixed", members=members)
    )
    async with loop_watch() as seen:
        copy, counts = await migrator.copy(snapshot, "dst/copy", None)
    assert counts["copied"] == 300
    assert [m.key for m in copy.members] == [f"copy/{i:04d}.bin" for i in range(300)]
    for i in (0, 299):
        assert (tmp_path / f"dst/copy/{i:04d}.bin").read_bytes() == (
            src / f"m/{i:04d}.bin"
        ).read_bytes()
    print(f"at most {seen['tasks']:g} tasks at once for 300 members")
    assert seen["tasks"] < 60, seen
