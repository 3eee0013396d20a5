"""The lmdb index: batching, persistence, LRU order, chunk maps, schema migrations."""

from __future__ import annotations

import gzip
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from chunkd.cache import (
    ChunkId,
    ChunkRecord,
    Codec,
    Index,
    Locator,
    ObjectInfo,
    ObjectVersion,
    ValidatedVersion,
)
from chunkd.cache.index import SCHEMA_VERSION
from chunkd.errors import CacheClosedError, IndexSchemaError


@pytest.fixture
def index(tmp_path: Path) -> Iterator[Index]:
    ix = Index(tmp_path / "index", flush_interval=3600)  # flush only when asked
    yield ix
    ix.close()


def cid(n: int) -> ChunkId:
    return ChunkId.of(n.to_bytes(8, "little"))


def test_writes_are_visible_before_they_are_committed(index: Index) -> None:
    index.put_chunk(cid(1), ChunkRecord(100, 60, Codec.ZSTD))
    assert index.commits == 0
    record = index.lookup(cid(1))
    assert record is not None
    assert (record.size, record.stored_size, record.codec) == (100, 60, Codec.ZSTD)
    assert record.last_use > 0
    assert index.disk_bytes == 60
    assert index.disk_chunks == 1
    index.flush()
    assert index.commits == 1
    assert index.lookup(cid(1)) == record


def test_background_flush_commits_batches(tmp_path: Path) -> None:
    ix = Index(tmp_path / "ix", flush_interval=0.01, flush_ops=10_000)
    try:
        for n in range(500):
            ix.put_chunk(cid(n), ChunkRecord(10, 10))
        for _ in range(200):
            if ix.commits:
                break
            time.sleep(0.01)
        assert 1 <= ix.commits < 500  # batched, not one commit per write
    finally:
        ix.close()


def test_records_and_totals_survive_reopen(tmp_path: Path) -> None:
    ix = Index(tmp_path / "ix")
    for n in range(10):
        ix.put_chunk(cid(n), ChunkRecord(1000, 500 + n))
    ix.delete_chunks([cid(0), cid(1)])
    ix.close()
    again = Index(tmp_path / "ix")
    try:
        assert again.lookup(cid(0)) is None
        record = again.lookup(cid(5))
        assert record is not None
        assert (record.size, record.stored_size) == (1000, 505)
        assert again.disk_chunks == 8
        assert again.disk_bytes == sum(500 + n for n in range(2, 10))
    finally:
        again.close()


def test_replacing_a_record_does_not_double_count(index: Index) -> None:
    index.put_chunk(cid(1), ChunkRecord(100, 100))
    index.put_chunk(cid(1), ChunkRecord(100, 40, Codec.ZSTD))
    assert index.disk_bytes == 40
    assert index.disk_chunks == 1
    index.flush()
    index.put_chunk(cid(1), ChunkRecord(100, 100))
    assert index.disk_bytes == 100


def test_delete_commits_at_once_and_returns_what_existed(index: Index) -> None:
    index.put_chunk(cid(1), ChunkRecord(10, 10))
    index.put_chunk(cid(2), ChunkRecord(10, 10))
    gone = index.delete_chunks([cid(1), cid(3)])
    assert [r.size for r in gone] == [10]
    assert index.commits == 1
    assert index.lookup(cid(1)) is None
    assert index.lookup(cid(2)) is not None
    assert index.disk_chunks == 1


def test_oldest_follows_last_use_and_touch(tmp_path: Path) -> None:
    now = [1000.0]
    ix = Index(tmp_path / "ix", touch_interval=10, clock=lambda: now[0])
    try:
        for n in range(5):
            now[0] += 1
            ix.put_chunk(cid(n), ChunkRecord(10, 10))
        assert [c for c, _ in ix.oldest(10)] == [cid(n) for n in range(5)]
        now[0] += 5
        ix.touch(cid(0))  # too soon: ignored
        assert ix.oldest(1)[0][0] == cid(0)
        now[0] += 30
        ix.touch(cid(0))
        ix.touch(cid(2))
        assert [c for c, _ in ix.oldest(10)] == [cid(1), cid(3), cid(4), cid(0), cid(2)]
        ix.delete_chunks([cid(1)])
        assert ix.oldest(1)[0][0] == cid(3)
    finally:
        ix.close()


def test_scan_chunks_pages_through_everything(index: Index) -> None:
    ids = sorted(cid(n) for n in range(25))
    for c in ids:
        index.put_chunk(c, ChunkRecord(1, 1))
    index.flush()
    seen: list[ChunkId] = []
    after: bytes | None = None
    while page := index.scan_chunks(after, 7):
        seen += [c for c, _ in page]
        after = page[-1][0]
    assert seen == ids


def test_lookup_many_mixes_pending_and_committed(index: Index) -> None:
    index.put_chunk(cid(1), ChunkRecord(1, 1))
    index.flush()
    index.put_chunk(cid(2), ChunkRecord(2, 2))
    got = index.lookup_many([cid(1), cid(2), cid(3)])
    assert [r.size if r else None for r in got] == [1, 2, None]


locators = st.builds(
    Locator,
    backend=st.sampled_from(["data", "ckpt", "ünïcode"]),
    key=st.text(min_size=1, max_size=600),  # beyond lmdb's 511-byte key limit
    version=st.text(max_size=40),
    index=st.integers(0, 2**31),
)


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries=st.lists(locators, max_size=30, unique_by=lambda loc: loc))
def test_chunk_maps_round_trip_through_reopen(
    tmp_path_factory: Any, entries: list[Locator]
) -> None:
    root = tmp_path_factory.mktemp("maps")
    ix = Index(root, chunk_bytes=1 << 20)
    expected = {loc: (cid(i), i + 1) for i, loc in enumerate(entries)}
    for loc, (c, length) in expected.items():
        ix.record(loc, c, length)
    for loc, (c, length) in expected.items():
        assert ix.resolve(loc) == (c, length)  # before the commit
    ix.close()
    again = Index(root, chunk_bytes=1 << 20)
    try:
        for loc, (c, length) in expected.items():
            assert again.resolve(loc) == (c, length)
    finally:
        again.close()
    other_geometry = Index(root, chunk_bytes=2 << 20)
    try:
        for loc in expected:
            assert other_geometry.resolve(loc) is None  # chunk maps are per chunk size
    finally:
        other_geometry.close()


def test_a_new_version_has_its_own_chunk_map(index: Index) -> None:
    v1 = ObjectVersion("data", "shard-0", "etag-1")
    v2 = ObjectVersion("data", "shard-0", "etag-2")
    index.record(v1.locator(0), cid(1), 10)
    index.record(v1.locator(1), cid(2), 5)
    assert index.resolve_many(v1, [0, 1, 2]) == [(cid(1), 10), (cid(2), 5), None]
    assert index.resolve_many(v2, [0, 1]) == [None, None]
    index.put_object(ObjectInfo("data", "shard-0", "etag-1", 15, index.chunk_bytes))
    info = index.get_object(v1)
    assert info is not None
    assert (info.size, info.chunks) == (15, 1)
    assert index.get_object(v2) is None


def test_schema_version_is_written_and_checked(tmp_path: Path) -> None:
    Index(tmp_path / "ix").close()
    ix = Index(tmp_path / "ix")
    assert ix.schema_version == SCHEMA_VERSION
    ix.close()
    with pytest.raises(IndexSchemaError, match="newer than this chunkd"):
        Index(tmp_path / "ix", schema_version=SCHEMA_VERSION - 1)


def test_migration_hook_upgrades_an_old_index(tmp_path: Path) -> None:
    old = Index(tmp_path / "ix")
    old.put_chunk(cid(1), ChunkRecord(7, 7))
    old.close()
    calls: list[int] = []

    def to_next(env: Any, txn: Any) -> None:
        calls.append(1)
        txn.put(b"migrated", b"yes")

    upgraded = Index(
        tmp_path / "ix", schema_version=SCHEMA_VERSION + 1, migrations={SCHEMA_VERSION: to_next}
    )
    try:
        assert calls == [1]
        assert upgraded.schema_version == SCHEMA_VERSION + 1
        assert upgraded.lookup(cid(1)) is not None  # data kept
    finally:
        upgraded.close()
    again = Index(tmp_path / "ix", schema_version=SCHEMA_VERSION + 1, migrations={})
    again.close()  # already migrated: no hook needed
    assert calls == [1]
    with pytest.raises(IndexSchemaError, match="no migration"):
        Index(tmp_path / "ix", schema_version=SCHEMA_VERSION + 2, migrations={})


def test_a_schema_1_index_is_upgraded_with_its_data_intact(tmp_path: Path) -> None:
    # Written by chunkd at schema 1 (commit d7e0023, before the names database):
    # three chunk records, a three-chunk map and an object size, at chunk size 1 MiB.
    fixture = Path(__file__).parent / "data" / "index-schema-1.mdb.gz"
    root = tmp_path / "ix"
    root.mkdir()
    (root / "data.mdb").write_bytes(gzip.decompress(fixture.read_bytes()))
    version = ObjectVersion("data", "shards/000.bin", '"etag-1"')

    upgraded = Index(root, chunk_bytes=1 << 20)
    try:
        assert upgraded.schema_version == SCHEMA_VERSION == 2
        records = upgraded.lookup_many([cid(0), cid(1), cid(2)])
        assert [(r.size, r.stored_size, r.codec) for r in records if r] == [
            (1 << 20, 1000, Codec.RAW),
            (1 << 20, 1001, Codec.ZSTD),
            (1 << 20, 1002, Codec.ZSTD),
        ]
        assert (upgraded.disk_chunks, upgraded.disk_bytes) == (3, 3003)
        assert sorted(c for c, _ in upgraded.oldest(10)) == sorted([cid(0), cid(1), cid(2)])
        assert upgraded.resolve_many(version, range(4)) == [
            (cid(0), 1 << 20),
            (cid(1), 1 << 20),
            (cid(2), 1 << 20),
            None,
        ]
        info = upgraded.get_object(version)
        assert info is not None
        assert (info.size, info.chunks) == (3 << 20, 3)
        # The new database is there, empty, and takes writes.
        assert upgraded.get_validated("data", "shards/000.bin") is None
        upgraded.put_validated(
            ValidatedVersion("data", "shards/000.bin", '"etag-1"', "etag-1", 3 << 20, 0.0, 5.0)
        )
    finally:
        upgraded.close()
    again = Index(root, chunk_bytes=1 << 20, migrations={})  # already at 2: no step runs
    try:
        got = again.get_validated("data", "shards/000.bin")
        assert got is not None
        assert got.checked == 5.0
        assert again.stat()["names_entries"] == 1
    finally:
        again.close()
    with pytest.raises(IndexSchemaError, match="has schema 2, newer"):
        Index(root, schema_version=1)  # a chunkd from before the upgrade refuses it


def test_validated_versions_are_batched_persisted_and_forgotten(tmp_path: Path) -> None:
    ix = Index(tmp_path / "ix", flush_interval=3600)
    record = ValidatedVersion("data", "dir/ünï.bin", '"e1"', '"e1"', 10, 1.5, 1000.25)
    ix.put_validated(record)
    assert ix.commits == 0
    assert ix.get_validated("data", "dir/ünï.bin") == record  # before the commit
    assert ix.get_validated("data", "dir/other.bin") is None
    assert ix.get_validated("other", "dir/ünï.bin") is None
    ix.put_validated(ValidatedVersion("data", "gone.bin", "v", None, 1, 0.0, 1.0))
    ix.close()
    ix = Index(tmp_path / "ix", flush_interval=3600)
    try:
        assert ix.get_validated("data", "dir/ünï.bin") == record
        ix.forget_validated("data", "gone.bin")
        assert ix.get_validated("data", "gone.bin") is None  # the delete is read back too
        newer = ValidatedVersion("data", "dir/ünï.bin", '"e2"', '"e2"', 12, 2.0, 2000.0)
        ix.put_validated(newer)
        ix.flush()
        assert ix.get_validated("data", "dir/ünï.bin") == newer
        assert ix.get_validated("data", "gone.bin") is None
        assert ix.stat()["names_entries"] == 1
    finally:
        ix.close()


def test_failed_commits_lose_nothing(tmp_path: Path) -> None:
    # A map this small fills up: the commit fails, the writes stay queued and visible.
    ix = Index(tmp_path / "ix", map_size=64 << 10, flush_interval=3600)
    try:
        for n in range(2000):
            ix.put_chunk(cid(n), ChunkRecord(n, n))
        with pytest.raises(Exception, match="MDB_MAP_FULL"):
            ix.flush()
        assert ix.commit_errors == 1
        assert all(ix.lookup(cid(n)) is not None for n in range(0, 2000, 97))
        assert ix.disk_chunks == 2000
    finally:
        ix.close()  # logs the lost batch; shutdown itself does not fail


def test_closed_index_raises_a_clear_error(tmp_path: Path) -> None:
    ix = Index(tmp_path / "ix")
    ix.close()
    ix.close()
    with pytest.raises(CacheClosedError, match="closed"):
        ix.lookup(cid(1))
    with pytest.raises(CacheClosedError, match="closed"):
        ix.put_chunk(cid(1), ChunkRecord(1, 1))


class IndexMachine(RuleBasedStateMachine):
    """The index against a dict: puts, deletes, touches, flushes and reopens in any order."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="chunkd-index-"))
        self.now = [1_000.0]
        self.index = self._open()
        self.model: dict[ChunkId, tuple[int, int]] = {}

    def _open(self) -> Index:
        return Index(self.root, flush_interval=3600, touch_interval=1, clock=lambda: self.now[0])

    @rule(n=st.integers(0, 40), size=st.integers(0, 1 << 22), stored=st.integers(0, 1 << 22))
    def put(self, n: int, size: int, stored: int) -> None:
        self.index.put_chunk(cid(n), ChunkRecord(size, stored))
        self.model[cid(n)] = (size, stored)

    @rule(ns=st.lists(st.integers(0, 40), max_size=5))
    def delete(self, ns: list[int]) -> None:
        gone = self.index.delete_chunks([cid(n) for n in ns])
        expected = {cid(n) for n in ns if cid(n) in self.model}
        assert len(gone) == len(expected)
        for c in expected:
            del self.model[c]

    @rule(n=st.integers(0, 40), later=st.floats(0, 5))
    def touch(self, n: int, later: float) -> None:
        self.now[0] += later
        self.index.touch(cid(n))

    @rule()
    def flush(self) -> None:
        self.index.flush()

    @rule()
    def reopen(self) -> None:
        self.index.close()
        self.index = self._open()

    @invariant()
    def agrees_with_the_model(self) -> None:
        for n in range(41):
            record = self.index.lookup(cid(n))
            want = self.model.get(cid(n))
            assert (None if record is None else (record.size, record.stored_size)) == want
        assert self.index.disk_chunks == len(self.model)
        assert self.index.disk_bytes == sum(stored for _, stored in self.model.values())
        oldest = self.index.oldest(100)
        assert sorted(c for c, _ in oldest) == sorted(self.model)
        uses = [r.last_use for _, r in oldest]
        assert uses == sorted(uses)

    def teardown(self) -> None:
        self.index.close()
        shutil.rmtree(self.root, ignore_errors=True)


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
