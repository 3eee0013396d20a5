"""Schema-2 snapshots: a root and member pages (chunkd.snapshot).

Page boundaries depend on the members alone, pages are checked against their ids and
their root's entries, versions share pages, and ``diff`` reads only the pages whose ids
differ. Each case builds real snapshots; no daemon is needed for the format itself.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import blake3
import pytest

from chunkd.errors import DatasetNotFoundError, ManifestError
from chunkd.snapshot import (
    PAGE_MAX_BYTES,
    PAGE_MAX_MEMBERS,
    Member,
    MemoryPages,
    PageWriter,
    Snapshot,
    canonical,
    diff,
    page_bytes,
)


def _members(count: int, *, start: int = 0, version: str = "v1") -> list[Member]:
    return [
        Member(
            key=f"d/part-{i:08d}.parquet",
            size=1000 + i,
            version=version,
            format="parquet",
            samples=1 + i % 7,
            meta={"row_groups": [[0, 1 + i % 7, 4, 900]]},
        )
        for i in range(start, start + count)
    ]


def _build(members: Sequence[Member], pages: MemoryPages | None = None) -> Snapshot:
    return Snapshot.build(
        backend="local", prefix="d/", format="parquet", members=members, pages=pages, schema=2
    )


class CountingPages(MemoryPages):
    """Pages in memory that count what was asked of them."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []

    def page(self, page_id: str) -> bytes:
        self.asked.append(page_id)
        return super().page(page_id)


@pytest.mark.timeout(30)
def test_a_root_names_pages_and_reads_each_member_through_its_page() -> None:
    members = _members(20_000)
    store = CountingPages()
    snap = _build(members, store)
    assert snap.schema == 2
    assert len(snap.pages) > 2
    assert len(snap.data) < 64 * len(snap.pages) + 4096  # the root stays small
    assert sum(p.members for p in snap.pages) == len(members)
    reread = Snapshot.parse(snap.data, snap.id, pages=store)
    assert reread.id == snap.id
    assert len(reread) == sum(m.samples for m in members)
    assert reread.page_loads == 0  # opening reads the root only
    total = 0
    for i, m in enumerate(members):
        if i % 997 == 0:
            assert reread.members[i] == m
            assert reread.locate(reread.start_of(i)) == (i, 0)
        total += m.samples
    assert len(reread) == total
    assert reread.locate(total - 1) == (len(members) - 1, members[-1].samples - 1)
    assert list(reread.iter_members(len(members) - 3)) == members[-3:]
    with pytest.raises(IndexError):
        reread.locate(total)


@pytest.mark.timeout(30)
def test_page_boundaries_depend_on_the_members_alone() -> None:
    members = _members(30_000)
    whole = _build(members)
    # Fed in two halves to two writers and merged in key order: the same pages.
    store = MemoryPages()
    writer = PageWriter(store.put)
    for member in members[:15_000] + members[15_000:]:
        writer.add(member)
    assert [p.id for p in writer.finish()] == [p.id for p in whole.pages]
    # Ten members added among 30,000 change a few pages, not the table.
    added = _members(30_000)[:5] + members + _members(10, start=30_000)[5:]
    grown = _build(sorted({m.key: m for m in added}.values(), key=lambda m: m.key))
    changed = {p.id for p in grown.pages} - {p.id for p in whole.pages}
    assert 1 <= len(changed) <= 3, (len(changed), len(grown.pages))


@pytest.mark.timeout(30)
def test_a_page_holds_at_most_its_bounds() -> None:
    pages = MemoryPages()
    writer = PageWriter(pages.put)
    fat = {"index": ["x" * 200] * 200}  # about 40 KiB of meta each
    for i in range(400):
        writer.add(Member(key=f"k{i:05d}", size=1, version="v", format="wds", samples=1, meta=fat))
    refs = writer.finish()
    assert all(len(pages.pages[r.id]) <= PAGE_MAX_BYTES for r in refs)
    assert len(refs) >= 4
    assert all(r.members <= PAGE_MAX_MEMBERS for r in refs)
    with pytest.raises(ManifestError, match="entry takes"):
        PageWriter(pages.put).add(
            Member(key="huge", size=1, version="v", format="wds", meta={"x": "y" * PAGE_MAX_BYTES})
        )
    twice = PageWriter(pages.put)
    twice.add(_members(1)[0])
    with pytest.raises(ManifestError, match="twice"):
        twice.add(_members(1)[0])
    backwards = PageWriter(pages.put)
    backwards.add(_members(2)[1])
    with pytest.raises(ManifestError, match="key order"):
        backwards.add(_members(2)[0])


@pytest.mark.timeout(30)
def test_a_missing_or_damaged_page_is_a_clear_error() -> None:
    store = MemoryPages()
    snap = _build(_members(12_000), store)
    first = snap.pages[0].id
    missing = MemoryPages({k: v for k, v in store.pages.items() if k != first})
    with pytest.raises(DatasetNotFoundError, match=first):
        _ = Snapshot.parse(snap.data, pages=missing).members[0]
    damaged = MemoryPages(dict(store.pages))
    damaged.pages[first] = damaged.pages[first].replace(b"v1", b"v2", 1)
    with pytest.raises(ManifestError, match="torn or was altered"):
        _ = Snapshot.parse(snap.data, pages=damaged).members[0]
    # Other pages still read.
    assert Snapshot.parse(snap.data, pages=damaged).members[-1].key == _members(12_000)[-1].key
    nothing = Snapshot.parse(snap.data)
    with pytest.raises(ManifestError, match="not loaded"):
        _ = nothing.members[0]
    nothing.offer_page(first, store.pages[first])
    assert nothing.members[0].key == _members(1)[0].key


@pytest.mark.timeout(30)
def test_a_root_naming_a_page_of_another_snapshot_is_refused() -> None:
    store = MemoryPages()
    a = _build(_members(12_000), store)
    b = _build(_members(12_000, start=50_000), store)
    root = json.loads(a.data)
    root["pages"][0][0] = b.pages[0].id  # b's page under a's entry
    forged = Snapshot.parse(canonical(root), pages=store)
    with pytest.raises(ManifestError, match="does not fit its root's entry"):
        _ = forged.members[0]
    with pytest.raises(ManifestError, match="not one of the snapshot's pages"):
        a.offer_page(b.pages[0].id, store.pages[b.pages[0].id])


@pytest.mark.timeout(30)
def test_a_page_carrying_a_content_claim_its_root_does_not_make_is_refused() -> None:
    store = MemoryPages()
    snap = _build(_members(3), store)
    forged_members = [
        Member(m.key, m.size, m.version, m.format, m.samples, m.meta, "ab" * 32)
        for m in _members(3)
    ]
    data = page_bytes(forged_members)
    ident = blake3.blake3(data).hexdigest()
    root = json.loads(snap.data)
    root["pages"] = [[ident, *root["pages"][0][1:]]]
    store.put(ident, data)
    forged = Snapshot.parse(canonical(root), pages=store)
    assert forged.claims == ()
    with pytest.raises(ManifestError, match="does not claim"):
        _ = forged.members[0]


@pytest.mark.timeout(60)
def test_diff_of_a_one_member_change_reads_only_the_changed_pages() -> None:
    members = _members(40_000)
    changed = list(members)
    changed[20_000] = Member(
        changed[20_000].key, 5, "v2", "parquet", changed[20_000].samples, changed[20_000].meta
    )
    store_a, store_b = CountingPages(), CountingPages()
    a = Snapshot.parse(_build(members, store_a).data, pages=store_a)
    b = Snapshot.parse(_build(changed, store_b).data, pages=store_b)
    report = diff(a, b)
    assert [c["key"] for c in report["changed"]] == [members[20_000].relative("d/")]
    assert report["unchanged"] == len(members) - 1
    assert not report["added"]
    assert not report["removed"]
    assert not report["same"]
    assert len(store_a.asked) == 1
    assert len(store_b.asked) == 1
    assert len(a.pages) >= 4


@pytest.mark.timeout(30)
def test_schema_one_snapshots_read_as_before() -> None:
    members = _members(50)
    old = Snapshot.build(backend="local", prefix="d/", format="parquet", members=members, schema=1)
    assert old.schema == 1
    assert old.pages == ()
    doc = json.loads(old.data)
    assert doc["schema"] == 1
    assert len(doc["members"]) == 50
    again = Snapshot.parse(old.data, old.id)
    assert list(again.members) == members
    assert again.id == old.id
    new = _build(members)
    assert new.id != old.id
    assert list(new.members) == members
    report = diff(again, new)
    assert report["same"]
    assert report["unchanged"] == 50


@pytest.mark.timeout(30)
def test_a_member_is_found_by_its_key_reading_one_page() -> None:
    members = _members(30_000)
    store = CountingPages()
    snap = Snapshot.parse(_build(members, store).data, pages=store)
    assert snap.member_index(members[17_321].key) == 17_321
    assert len(store.asked) == 1
    assert snap.member_index(members[0].key) == 0
    assert snap.member_index(members[-1].key) == len(members) - 1
    assert snap.member_index("d/part-00017321.parquetx") is None
    assert snap.member_index("a") is None
    assert snap.member_index("z") is None
    old = Snapshot.build(backend="local", prefix="d/", format="parquet", members=members, schema=1)
    assert old.member_index(members[17_321].key) == 17_321
    assert old.member_index("z") is None


@pytest.mark.timeout(30)
def test_a_snapshot_pickles_as_its_root_and_its_pages_in_memory() -> None:
    import pickle

    members = _members(9_000)
    snap = _build(members)
    moved = pickle.loads(pickle.dumps(snap))
    assert moved.id == snap.id
    assert moved.members[8_999] == members[8_999]
    without = pickle.loads(pickle.dumps(Snapshot.parse(snap.data)))
    assert without.id == snap.id
    with pytest.raises(ManifestError, match="not loaded"):
        _ = without.members[0]


@pytest.mark.timeout(60)
def test_the_pages_held_are_bounded_by_members_too() -> None:
    from chunkd.snapshot import PAGE_CACHE_MEMBERS

    store = CountingPages()
    big = [
        Member(f"k{i:07d}", 1, "v", "fixed", samples=1, meta={"record_bytes": 1})
        for i in range(120_000)
    ]
    snap = Snapshot.parse(_build(big, store).data, pages=store)
    assert sum(p.members for p in snap.pages[:4]) <= PAGE_CACHE_MEMBERS
    for page in range(len(snap.pages)):
        snap.page_members(page)
    held = snap._paged._held  # type: ignore[union-attr]
    assert sum(len(m) for m, _ in held.values()) <= PAGE_CACHE_MEMBERS
    assert len(held) >= 1
