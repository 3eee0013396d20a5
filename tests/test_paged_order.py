"""Order version 2: the order of a schema-2 (paged) snapshot, built from its root and
the pages it touches, and the loader over it; states of both order versions.

Pages are cut where the test says (a key that ends a page is searched for), so a few
hundred members make many pages and many groups.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from typing import Any

import blake3
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkd.client.datasets import Dataset
from chunkd.client.datasets.formats import format_of
from chunkd.client.datasets.loader import Loader, order_of, step_sample_ids
from chunkd.client.datasets.order import (
    GROUP_MEMBERS,
    GROUP_PAGES,
    Order,
    PagedOrder,
    order_version,
    quality,
)
from chunkd.client.datasets.state import MAX_STATE_BYTES, STATE_FORMATS, LoaderState
from chunkd.errors import DatasetNotFoundError, ManifestError, ResumeStateError
from chunkd.snapshot import PAGE_TARGET, Member, MemoryPages, Snapshot

from .test_dataset_order import MemorySource

RECORD = 4


# -- snapshots cut into the pages a test asks for --------------------------------------


def _cuts(key: str) -> bool:
    """Whether a page ends after ``key`` (the snapshot's content-defined rule)."""
    return int.from_bytes(blake3.blake3(key.encode()).digest(length=8), "little") % PAGE_TARGET == 0


_KEYS: dict[tuple[int, int, bool], str] = {}


def page_key(page: int, member: int, last: bool) -> str:
    """A key of page ``page``'s member ``member`` that ends the page iff ``last``; keys
    sort by (page, member)."""
    found = _KEYS.get((page, member, last))
    if found is None:
        for salt in range(1 << 30):
            key = f"p{page:04d}/{'z' if last else 'm'}{member:05d}-{salt}"
            if _cuts(key) == last:
                found = _KEYS[page, member, last] = key
                break
    assert found is not None
    return found


def fixed_member(key: str, samples: int) -> Member:
    return Member(key, samples * RECORD, "v1", "fixed", samples=samples, meta={"record_bytes": 4})


def parquet_member(key: str, groups: list[int], decoded: int = 1 << 20) -> Member:
    """A Parquet member as its manifest records it (no file: the order reads none)."""
    rows, start = [], 4
    for n in groups:
        rows.append([n, start, 1000, decoded])
        start += 1000
    meta = {"footer": [start, 100], "row_groups": rows}
    return Member(key, start + 108, "v1", "parquet", samples=sum(groups), meta=meta)


def paged(pages: list[list[Any]], *, kind: str = "fixed") -> tuple[Snapshot, MemoryPages]:
    """A schema-2 snapshot of ``pages``: each a list of members' sample counts (``fixed``)
    or row-group row counts (``parquet``)."""
    members = []
    for p, page in enumerate(pages):
        for j, spec in enumerate(page):
            key = page_key(p, j, j == len(page) - 1)
            made = fixed_member(key, spec) if kind == "fixed" else parquet_member(key, spec)
            members.append(made)
    store = MemoryPages()
    snapshot = Snapshot.build(
        backend="mem", prefix="", format=kind, members=members, pages=store, schema=2
    )
    assert len(snapshot.pages) == len(pages)
    return snapshot, store


class CountingPages:
    """A page source over a dict that counts what it serves."""

    def __init__(self, store: MemoryPages) -> None:
        self.store = store
        self.served: Counter[str] = Counter()

    def page(self, page_id: str) -> bytes:
        self.served[page_id] += 1
        return self.store.page(page_id)


def reopened(snapshot: Snapshot, store: MemoryPages) -> tuple[Snapshot, CountingPages]:
    """The snapshot as a reader opens it: its root, its pages from a counted source."""
    source = CountingPages(store)
    return Snapshot.parse(snapshot.data, snapshot.id, pages=source), source


def fixed_dataset(pages: list[list[int]]) -> tuple[Dataset, dict[str, bytes], CountingPages]:
    snapshot, store = paged(pages)
    blobs: dict[str, bytes] = {}
    expected: dict[str, bytes] = {}
    for i, member in enumerate(snapshot.iter_members()):
        n = member.samples
        records = [bytes([i % 256, j % 256, (i * 7 + j) % 256, 0xCD]) for j in range(n)]
        blobs[member.key] = b"".join(records)
        expected.update({f"{member.key}#{j}": r for j, r in enumerate(records)})
    opened, source = reopened(snapshot, store)
    return Dataset(opened, MemorySource(blobs)), expected, source


# -- the order ---------------------------------------------------------------------------

pages_st = st.lists(
    st.lists(st.one_of(st.just(0), st.integers(1, 9), st.integers(10, 40)), min_size=1, max_size=5),
    min_size=0,
    max_size=14,
)
row_groups_st = st.lists(
    st.lists(st.lists(st.integers(0, 30), min_size=0, max_size=4), min_size=1, max_size=4),
    min_size=1,
    max_size=12,
)


def _check_epoch(order: PagedOrder, snapshot: Snapshot) -> None:
    """Every sample once; each position where the snapshot and the formats say; windows
    contiguous, of whole units, within ``window`` units and ``window_bytes``."""
    total = len(snapshot)
    assert len(order) == order.total == total
    positions = np.arange(total, dtype=np.int64)
    found = order.located(positions)
    assert sorted(found.indices.tolist()) == list(range(total))
    if not order.shuffle:
        assert found.indices.tolist() == list(range(total))
    windows, at = order.locate_windows(positions)
    assert (np.diff(windows) >= 0).all()  # a window's positions are one run
    assert [a.tolist() for a in order.rows_at(windows, at)] == [a.tolist() for a in found[:4]]
    assert order.locate(positions)[0].tolist() == found.members.tolist()
    members = list(snapshot.iter_members())
    starts = np.cumsum([0] + [m.samples for m in members])
    by_window: dict[int, list[tuple[int, int]]] = {}
    for p in range(total):
        m, s, u, r, i = (int(a[p]) for a in found)
        assert snapshot.locate(i) == (m, s)
        assert starts[m] + s == i
        counts = format_of(members[m].format).units(members[m])
        assert sum(counts[:u]) + r == s
        assert 0 <= r < counts[u]
        keys = by_window.setdefault(int(windows[p]), [])
        if (m, u) not in keys:
            keys.append((m, u))
    seen: set[tuple[int, int]] = set()
    for w, keys in by_window.items():
        assert sorted(order.window_keys(w)) == sorted(keys)
        assert not seen & set(keys)  # a unit is in one window
        seen |= set(keys)
        if order.window is not None:
            assert len(keys) <= order.window
        costs = [format_of(members[m].format).unit_bytes(members[m])[u] for m, u in keys]
        if order.window_bytes is not None and len(keys) > 1:
            assert sum(costs) <= order.window_bytes


@given(
    pages=pages_st,
    seed=st.integers(0, 2**64 - 1),
    epoch=st.integers(0, 5),
    shuffle=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 6)),
)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@pytest.mark.timeout(60)
def test_an_epoch_of_a_paged_order_reads_every_sample_once_in_bounded_windows(
    pages: list[list[int]], seed: int, epoch: int, shuffle: bool, window: int | None
) -> None:
    snapshot, store = paged(pages)
    opened, _ = reopened(snapshot, store)
    order = PagedOrder(opened, seed=seed, epoch=epoch, shuffle=shuffle, window=window)
    assert order.version == 2 == order_version(opened)
    filled = sum(1 for p in pages if sum(p))
    assert order.groups == math.ceil(filled / GROUP_PAGES)
    _check_epoch(order, opened)


@given(
    pages=row_groups_st,
    seed=st.integers(0, 1000),
    window=st.one_of(st.none(), st.integers(1, 5)),
    window_bytes=st.one_of(st.none(), st.integers(0, 5 << 20)),
)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@pytest.mark.timeout(60)
def test_row_groups_are_the_units_of_a_paged_order_and_windows_keep_their_bytes(
    pages: list[list[list[int]]], seed: int, window: int | None, window_bytes: int | None
) -> None:
    snapshot, store = paged(pages, kind="parquet")
    opened, _ = reopened(snapshot, store)
    order = PagedOrder(opened, seed=seed, epoch=1, window=window, window_bytes=window_bytes)
    _check_epoch(order, opened)


@pytest.mark.timeout(60)
def test_the_paged_order_is_a_pure_function_of_the_snapshot_seed_epoch_and_settings() -> None:
    pages = [[5, 9, 3], [12], [7, 7], [1, 2, 3, 4], [20, 1], [8], [6, 6, 6], [9], [4, 11]]
    snapshot, store = paged(pages)
    positions = np.arange(len(snapshot), dtype=np.int64)

    def indices(**given: Any) -> list[int]:
        opened, _ = reopened(snapshot, store)  # a reader of its own
        settings = {"seed": 3, "epoch": 1} | given
        return (
            order_of(opened, LoaderState(snapshot.id, **settings, cursor=0))
            .indices(positions)
            .tolist()
        )

    first = indices()
    assert first == indices()
    assert first != sorted(first)
    for change in ({"seed": 4}, {"epoch": 2}, {"window": 2}, {"window_bytes": 0}):
        assert indices(**change) != first
    assert indices(shuffle=False) == sorted(first)
    # the same members registered again: the same pages, the same snapshot, the same order
    again, again_store = paged(pages)
    assert again.id == snapshot.id
    assert (
        PagedOrder(reopened(again, again_store)[0], seed=3, epoch=1).indices(positions).tolist()
        == first
    )
    # another process, another interpreter: the same order
    script = (
        "import json, sys, numpy as np\n"
        "from chunkd.snapshot import Snapshot, MemoryPages\n"
        "from chunkd.client.datasets.order import PagedOrder\n"
        "root, pages = json.loads(sys.stdin.read())\n"
        "s = Snapshot.parse(root.encode(), pages=MemoryPages("
        "{k: v.encode() for k, v in pages.items()}))\n"
        "print(json.dumps(PagedOrder(s, seed=3, epoch=1).indices(np.arange(len(s))).tolist()))\n"
    )
    sent = json.dumps([snapshot.data.decode(), {k: v.decode() for k, v in store.pages.items()}])
    out = subprocess.run(
        [sys.executable, "-c", script], input=sent, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == first


@pytest.mark.timeout(30)
def test_a_paged_order_is_built_from_the_root_and_loads_only_the_pages_it_touches() -> None:
    pages = [[3, 4]] * 12 + [[0]] + [[5]] * 7  # 20 pages, one without a sample
    snapshot, store = paged(pages)
    opened, source = reopened(snapshot, store)
    order = PagedOrder(opened, seed=1, epoch=0)
    assert sum(source.served.values()) == 0  # the root alone
    assert order.groups == math.ceil(19 / GROUP_PAGES)
    # a run of positions of one group: that group's pages, once each
    group = 2
    start = int(order.group_starts[group])
    order.locate(np.arange(start, start + 5))
    wanted = {snapshot.pages[p].id for p in order.pages_of(group).tolist()}
    assert set(source.served) == wanted
    assert max(source.served.values()) == 1
    assert len(wanted) <= GROUP_PAGES
    # the empty page is never asked for, however much of the epoch is read
    order.locate(np.arange(len(order)))
    assert snapshot.pages[12].id not in source.served


@pytest.mark.timeout(30)
def test_a_group_holds_at_most_four_pages_and_32768_members() -> None:
    # what a reader holds of the manifest is bounded in members, whatever the pages' sizes
    sizes = [9000, 300, 16_000, 16_384, 200, 200, 200, 200, 200, 5000, 12_000, 16_384]
    snapshot, store = paged([[1] * n for n in sizes])
    opened, source = reopened(snapshot, store)
    for seed in range(4):
        order = PagedOrder(opened, seed=seed, epoch=0)
        seen = []
        for g in range(order.groups):
            pages = order.pages_of(g).tolist()
            members = sum(sizes[p] for p in pages)
            assert len(pages) <= GROUP_PAGES
            assert members <= GROUP_MEMBERS
            assert len(pages) >= 2 or g == order.groups - 1  # two pages at least
            seen += pages
        assert sorted(seen) == list(range(len(sizes)))
        assert order.groups < len(sizes)  # small pages share a group
    assert sum(source.served.values()) == 0


@pytest.mark.timeout(30)
def test_a_paged_order_mixes_nearly_as_a_full_shuffle_from_few_units_at_a_time() -> None:
    # 32 pages of 16 Parquet members of 4 row groups of 50 rows: 102,400 samples
    pages = [[[50] * 4] * 16] * 32
    snapshot, store = paged(pages, kind="parquet")
    opened, _ = reopened(snapshot, store)
    members = list(opened.iter_members())
    counts = [m.samples for m in members]
    full = Order(counts, snapshot=snapshot.id, seed=1, epoch=0, window=None, window_bytes=None)
    baseline = quality(full)
    paged_order = PagedOrder(opened, seed=1, epoch=0)
    mixed = quality(paged_order)
    assert mixed.mean_gap > 0.8 * baseline.mean_gap
    for start in range(0, len(paged_order) - 1024, 20_000):
        run = quality(paged_order, start, start + 1024)
        assert run.units_held <= 2 * 16  # a window, twice across its edge
        assert run.units_touched <= 2 * 16
        assert quality(full, start, start + 1024).members_touched > 300


# -- the loader over a paged snapshot ----------------------------------------------------


@pytest.mark.timeout(60)
def test_a_loader_reads_a_paged_snapshot_loading_each_page_about_once_an_epoch() -> None:
    # 24 pages: 6 groups. A group's pages must stay held while its windows are read:
    # groups of more pages than the snapshot holds reloaded a page for nearly every
    # unit (4,862 loads for 200 steps of 17 pages, 340 s, where 4 loads took 0.8 s)
    pages = [[6, 3, 9, 2, 5]] * 24
    dataset, expected, source = fixed_dataset(pages)
    for world in (1, 3):
        seen: Counter[str] = Counter()
        source.served.clear()
        for rank in range(world):
            loader = Loader(dataset, batch_size=4, seed=7, rank=rank, world_size=world)
            assert loader.order().version == 2
            for batch in loader:
                assert [bytes(s) for s in batch.samples] == [expected[i] for i in batch.ids]
                seen.update(batch.ids)
        assert seen == Counter(expected.keys())
        # each page once an epoch a rank (and a group's again where a step crosses)
        assert sum(source.served.values()) <= world * (len(pages) + GROUP_PAGES)


@given(
    pages=st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=4), min_size=1, max_size=10),
    tail=st.sampled_from(["uneven", "pad", "drop"]),
    seed=st.integers(0, 1000),
    segments=st.lists(
        st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(0, 4)),
        min_size=1,
        max_size=4,
    ),
)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@pytest.mark.timeout(90)
def test_loaders_resized_through_states_read_every_sample_of_a_paged_snapshot_once(
    pages: list[list[int]], tail: str, seed: int, segments: list[tuple[int, int, int]]
) -> None:
    dataset, expected, _ = fixed_dataset(pages)
    seen: Counter[str] = Counter()
    state: dict[str, Any] | None = None
    end_size = 1
    for i, (world, batch, run) in enumerate(segments):
        last = i == len(segments) - 1
        loaders = [
            Loader(dataset, batch_size=batch, seed=seed, rank=r, world_size=world, tail=tail)  # type: ignore[arg-type]
            for r in range(world)
        ]
        for loader in loaders:
            if state is not None:
                loader.restore(json.dumps(state))
        iters = [iter(loader) for loader in loaders]
        step = 0
        while last or step < run:
            got = [next(it, None) for it in iters]
            if all(b is None for b in got):
                break
            for b in got:
                if b is not None:
                    assert [bytes(s) for s in b.samples] == [expected[x] for x in b.ids]
                    seen.update(b.ids[: len(b.ids) - b.padding])
            step += 1
        states = [loader.state() for loader in loaders]
        assert all(s == states[0] for s in states)
        assert states[0]["format"] == "chunkd.loader/4"
        assert len(json.dumps(states[0], separators=(",", ":"))) <= MAX_STATE_BYTES
        if states[0]["cursor"] == len(dataset) and (
            state is None or state["cursor"] < len(dataset)
        ):
            end_size = world * batch
        state = states[0]
    assert state is not None
    assert state["cursor"] == len(dataset)
    assert max(seen.values(), default=1) == 1
    if tail == "drop":
        assert len(expected) - len(seen) < end_size
    else:
        assert set(seen) == set(expected)


# -- states of both order versions -------------------------------------------------------

#: A chunkd.loader/3 state of a schema-1 snapshot saved by chunkd before schema 2 (main
#: at 3be8b39), and what the next steps read after it there: 3 ranks of batch 2
V1_SNAPSHOT = "9d5c66f4f21faf7ba8d1e597e080f47ad7b0f2a6cb6d72cb89c5aa97acb4eeb4"
V1_STATE = (
    '{"format":"chunkd.loader/3","snapshot":"' + V1_SNAPSHOT + '","seed":11,"epoch":5,'
    '"cursor":12,"shuffle":true,"window":2,"window_bytes":268435456}'
)
V1_NEXT = {
    0: [
        ["part-004.bin#7", "part-002.bin#10"],
        ["part-002.bin#1", "part-004.bin#4"],
        ["part-005.bin#4", "part-001.bin#0"],
        ["part-006.bin#7", "part-006.bin#0"],
        ["part-006.bin#9", "part-000.bin#6"],
        ["part-000.bin#4", "part-006.bin#8"],
        ["part-007.bin#0"],
    ],
    1: [
        ["part-002.bin#2", "part-004.bin#1"],
        ["part-001.bin#1", "part-005.bin#3"],
        ["part-001.bin#2", "part-005.bin#0"],
        ["part-000.bin#1", "part-000.bin#3"],
        ["part-006.bin#1", "part-000.bin#5"],
        ["part-006.bin#3", "part-006.bin#6"],
        ["part-007.bin#1"],
    ],
}


def schema1_dataset() -> Dataset:
    counts = [7, 3, 11, 0, 9, 5, 13, 2]
    members = [fixed_member(f"part-{i:03d}.bin", n) for i, n in enumerate(counts)]
    snapshot = Snapshot.build(backend="mem", prefix="", format="fixed", members=members, schema=1)
    blobs = {m.key: bytes(m.size) for m in members}
    return Dataset(snapshot, MemorySource(blobs))


@pytest.mark.timeout(30)
def test_a_stored_state_of_a_schema_1_snapshot_resumes_exactly() -> None:
    dataset = schema1_dataset()
    assert dataset.snapshot.schema == 1
    assert dataset.id == V1_SNAPSHOT
    for rank, steps in V1_NEXT.items():
        loader = Loader(dataset, batch_size=2, seed=11, world_size=3, rank=rank, window=2)
        assert isinstance(loader.order(), Order)
        loader.restore(V1_STATE)
        assert [b.ids for b in loader] == steps
        assert loader.state()["format"] == "chunkd.loader/3"
    fresh = Loader(dataset, batch_size=2, seed=11, window=2)
    assert fresh.state()["format"] == "chunkd.loader/3"
    answer = step_sample_ids(dataset, V1_STATE, step=0, batch_size=2, world_size=3)
    assert [answer[r].ids for r in (0, 1)] == [V1_NEXT[0][0], V1_NEXT[1][0]]


@pytest.mark.timeout(30)
def test_a_state_of_another_order_version_is_refused_saying_so() -> None:
    old = schema1_dataset()
    new, _, _ = fixed_dataset([[4, 4], [5]])
    as_v1 = LoaderState(new.id, 1, 0, 0, order=1).to_json()
    as_v2 = LoaderState.parse(V1_STATE).to_dict() | {"format": "chunkd.loader/4"}
    for dataset, state, message in (
        (new, as_v1, r"chunkd.loader/3\) is a place in order version 1.*order version 2"),
        (old, json.dumps(as_v2), r"chunkd.loader/4\) is a place in order version 2.*version 1"),
    ):
        loader = Loader(dataset, batch_size=2, seed=1 if dataset is new else 11, window=2)
        with pytest.raises(ResumeStateError, match=message):
            loader.restore(state)
        with pytest.raises(ResumeStateError, match="order version"):
            step_sample_ids(dataset, state, step=0, batch_size=1, world_size=1)
    assert LoaderState.parse(as_v1).order == 1
    assert LoaderState.parse(as_v2).order == 2
    assert STATE_FORMATS == {1: "chunkd.loader/3", 2: "chunkd.loader/4"}
    most = 2**64 - 1, 2**32 - 1, 2**63 - 1, False, 2**32 - 1, 2**63 - 1
    longest = LoaderState("ab" * 32, *most, order=2)  # type: ignore[arg-type]
    assert longest.to_dict()["format"] == "chunkd.loader/4"
    assert len(longest.to_json()) == 253 <= MAX_STATE_BYTES
    assert LoaderState.parse(longest.to_json()) == longest
    for bad in (0, 3, True):
        with pytest.raises(ResumeStateError, match="order version"):
            LoaderState("ab" * 32, 1, 0, 0, order=bad)


@pytest.mark.timeout(30)
def test_a_damaged_or_missing_page_is_a_clear_error_where_the_order_reaches_it() -> None:
    # a member whose row groups do not add up to its samples: its page is consistent
    # (the snapshot's checks pass) but its units are not what the root counts
    good = [[[10, 10]] * 3] * 8
    snapshot, store = paged(good, kind="parquet")
    members = list(reopened(snapshot, store)[0].iter_members())
    broken = members[5]
    wrong = dict(broken.meta) | {"row_groups": [[10, 4, 1000, 1 << 20], [11, 1004, 1000, 1]]}
    members[5] = Member(broken.key, broken.size, "v2", "parquet", 20, wrong)
    damaged_store = MemoryPages()
    damaged = Snapshot.build(
        backend="mem", prefix="", format="parquet", members=members, pages=damaged_store, schema=2
    )
    order = PagedOrder(reopened(damaged, damaged_store)[0], seed=1, epoch=0)
    with pytest.raises(ManifestError, match=broken.key):
        order.locate(np.arange(len(order)))
    # a missing page: the page source's error, when (and only when) its group is read
    # (pages never seen: a page's units are kept by its id, a content's name)
    snapshot, store = paged([[[9, 9]] * 3] * 8, kind="parquet")
    missing = MemoryPages(dict(store.pages))
    gone = snapshot.pages[0].id
    del missing.pages[gone]
    order = PagedOrder(reopened(snapshot, missing)[0], seed=1, epoch=0)
    group = next(g for g in range(order.groups) if 0 in order.pages_of(g).tolist())
    other = (group + 1) % order.groups
    order.locate([int(order.group_starts[other])])
    with pytest.raises(DatasetNotFoundError):
        order.locate([int(order.group_starts[group])])
    # a page whose bytes are not what the root names: the snapshot's check
    altered = MemoryPages(dict(store.pages))
    altered.pages[gone] = store.pages[snapshot.pages[1].id]
    order = PagedOrder(reopened(snapshot, altered)[0], seed=1, epoch=0)
    with pytest.raises(ManifestError, match=gone):
        order.locate(np.arange(len(order)))


@pytest.mark.timeout(30)
def test_a_paged_order_refuses_what_is_not_one() -> None:
    with pytest.raises(ValueError, match="schema 1"):
        PagedOrder(schema1_dataset().snapshot, seed=1, epoch=0)
    snapshot, _ = paged([[3]])
    for bad in ({"window": 0}, {"window_bytes": -1}, {"group_pages": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PagedOrder(snapshot, seed=1, epoch=0, **bad)
    order = PagedOrder(snapshot, seed=1, epoch=0)
    for outside in ([-1], [3]):
        with pytest.raises(IndexError):
            order.locate(outside)
    empty = Snapshot.build(
        backend="mem", prefix="", format="fixed", members=[], pages=MemoryPages(), schema=2
    )
    nothing = PagedOrder(empty, seed=1, epoch=0)
    assert len(nothing) == 0
    assert nothing.groups == 0
    assert [len(a) for a in nothing.located([])] == [0] * 5
