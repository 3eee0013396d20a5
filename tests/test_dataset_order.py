"""The one read order and the loader core: properties over random snapshots and resizes.

The arithmetic (orders, steps, ranks, workers, tails, resumes) is checked on positions
alone, over many random cases; a smaller property reads real samples through
:class:`~chunkd.client.datasets.Loader` over a snapshot of fixed records held in memory.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkd.client.datasets import Dataset
from chunkd.client.datasets.columns import Units
from chunkd.client.datasets.loader import (
    TAILS,
    Loader,
    Steps,
    read_steps,
    step_sample_ids,
    warm,
)
from chunkd.client.datasets.order import (
    DEFAULT_WINDOW,
    DEFAULT_WINDOW_BYTES,
    Order,
    Permutation,
    quality,
)
from chunkd.client.datasets.state import MAX_STATE_BYTES, STATE_FORMAT, LoaderState
from chunkd.errors import InvalidRequestError, ResumeStateError
from chunkd.snapshot import Member, Snapshot

SNAPSHOT = "ab" * 32
RECORD = 4

counts_st = st.lists(
    st.one_of(st.just(0), st.integers(1, 12), st.integers(13, 60)), min_size=0, max_size=24
)
windows_st = st.one_of(st.none(), st.integers(1, 6))
tails_st = st.sampled_from(TAILS)
#: a resize: (world size, batch size, workers per rank, steps to run before the next)
segment_st = st.tuples(st.integers(1, 9), st.integers(1, 7), st.integers(1, 5), st.integers(0, 12))


# -- the order ---------------------------------------------------------------------------


@given(size=st.integers(0, 3000), key=st.text(max_size=10))
@settings(max_examples=60, deadline=None)
def test_a_permutation_is_a_bijection(size: int, key: str) -> None:
    out = Permutation(size, key)(np.arange(size, dtype=np.int64))
    assert sorted(out.tolist()) == list(range(size))


#: members' units: per member, its units' sample counts (None: one unit, as most formats)
units_st = st.lists(
    st.one_of(
        st.none(),
        st.lists(st.one_of(st.just(0), st.integers(1, 9), st.integers(10, 40)), max_size=6),
    ),
    max_size=16,
)


def unit_counts(units: list[list[int] | None], fill: int = 7) -> list[int]:
    """Members' counts for ``units`` (a member that is one unit holds ``fill + i`` samples)."""
    return [fill + i if u is None else sum(u) for i, u in enumerate(units)]


def check_epoch(
    order: Order, counts: list[int], window: int | None, window_bytes: int | None = None
) -> None:
    """Every sample once, a pure function, and the window's bounds on units and bytes."""
    total = sum(counts)
    assert order.total == len(order) == total
    index = order.indices(np.arange(total, dtype=np.int64))
    assert sorted(index.tolist()) == list(range(total))  # every sample, once
    member, sample = order.locate(np.arange(total, dtype=np.int64))
    assert all(0 <= s < counts[m] for m, s in zip(member.tolist(), sample.tolist(), strict=True))
    starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    assert (starts[member] + sample).tolist() == index.tolist()
    unit, offset = order.locate_units(np.arange(total, dtype=np.int64))
    assert (order.unit_member[unit] == member).all()
    assert ((offset >= 0) & (offset < order.unit_sizes[unit])).all()
    filled = order.unit_order.tolist()
    firsts = order.window_firsts.tolist()
    assert firsts == sorted(set(firsts))
    assert firsts[:1] == ([0] if filled else [])
    lasts = [*firsts[1:], len(filled)] if firsts else []
    runs = [filled[a:b] for a, b in zip(firsts, lasts, strict=True)]
    for r, run in enumerate(runs):
        cost = int(order.unit_bytes[run].sum())
        # at most `window` units and `window_bytes` decoded bytes (but a unit alone)
        assert len(run) >= 1
        assert window is None or len(run) <= window
        assert window_bytes is None or cost <= window_bytes or len(run) == 1
        # greedy: the next window's first unit would not have fit
        if r + 1 < len(runs):
            more = cost + int(order.unit_bytes[runs[r + 1][0]])
            assert (window is not None and len(run) == window) or (
                window_bytes is not None and more > window_bytes
            )
    if window is None and window_bytes is None:
        assert len(runs) <= 1
    if window is None:
        return
    q = quality(order)
    # units open at once: never more than a window's
    assert q.units_held <= window
    # the units of each window are read together, one window after the other: each
    # window touches at most `window` units and members
    run_of = {u: i for i, run in enumerate(runs) for u in run}
    seen = [run_of[u] for u in unit.tolist()]
    assert seen == sorted(seen)
    edges = [0]
    for run in runs:
        edges.append(edges[-1] + int(order.unit_sizes[run].sum()))
    for w in range(len(runs)):
        inside = quality(order, edges[w], edges[w + 1])
        assert inside.units_touched <= window
        assert inside.members_touched <= window
        # across a window's edge (the run of the next window with it): twice that
        across = quality(order, edges[w], edges[min(w + 2, len(runs))])
        assert across.units_touched <= 2 * window
        assert across.units_held <= window


@given(counts=counts_st, seed=st.integers(0, 2**64 - 1), epoch=st.integers(0, 5), window=windows_st)
@settings(max_examples=80, deadline=None)
def test_an_epoch_reads_every_sample_once_in_windows_of_members(
    counts: list[int], seed: int, epoch: int, window: int | None
) -> None:
    order = Order(counts, snapshot=SNAPSHOT, seed=seed, epoch=epoch, window=window)
    total = sum(counts)
    check_epoch(order, counts, window)
    index = order.indices(np.arange(total, dtype=np.int64))
    # a pure function of its inputs: another call, another object, the same order
    again = Order(list(counts), snapshot=SNAPSHOT, seed=seed, epoch=epoch, window=window)
    assert again.indices(np.arange(total)).tolist() == index.tolist()
    # members of one unit each: units are members; saying so changes nothing
    said = Order(
        counts, snapshot=SNAPSHOT, seed=seed, epoch=epoch, window=window, units=[None] * len(counts)
    )
    assert said.indices(np.arange(total)).tolist() == index.tolist()
    # a position at a time answers what the whole epoch did (nothing built per epoch)
    probe = sorted({0, total // 3, total - 1}) if total else []
    assert [int(order.indices([p])[0]) for p in probe] == [int(index[p]) for p in probe]
    if window is not None:
        # members open at once: never more than a window's (each member is one unit)
        assert quality(order).members_held <= window


@given(units=units_st, seed=st.integers(0, 2**64 - 1), epoch=st.integers(0, 3), window=windows_st)
@settings(max_examples=120, deadline=None)
def test_members_of_several_units_are_read_in_windows_of_units(
    units: list[list[int] | None], seed: int, epoch: int, window: int | None
) -> None:
    counts = unit_counts(units)
    order = Order(counts, snapshot=SNAPSHOT, seed=seed, epoch=epoch, window=window, units=units)
    check_epoch(order, counts, window)
    total = sum(counts)
    again = Order(counts, snapshot=SNAPSHOT, seed=seed, epoch=epoch, window=window, units=units)
    assert again.indices(np.arange(total)).tolist() == order.indices(np.arange(total)).tolist()
    # units holding no sample take no place in the order
    assert all(order.unit_sizes[u] > 0 for u in order.unit_order.tolist())
    # each unit's samples are its member's consecutive samples
    for u, (m, first, size) in enumerate(
        zip(order.unit_member, order.unit_first, order.unit_sizes, strict=True)
    ):
        assert first >= 0
        assert first + size <= counts[m]
        assert u == 0 or order.unit_starts[u] == order.unit_starts[u - 1] + order.unit_sizes[u - 1]


def test_units_that_do_not_add_up_to_their_member_are_refused() -> None:
    with pytest.raises(ValueError, match="one entry per member"):
        Order([4, 4], snapshot=SNAPSHOT, seed=1, epoch=0, units=[[4]])
    with pytest.raises(ValueError, match="add up to 3 samples, not its 4"):
        Order([4, 4], snapshot=SNAPSHOT, seed=1, epoch=0, units=[None, [1, 2]])
    with pytest.raises(ValueError, match="negative"):
        Order([4], snapshot=SNAPSHOT, seed=1, epoch=0, units=[[5, -1]])


def test_the_order_depends_on_the_snapshot_seed_and_epoch_only() -> None:
    counts = [50] * 40
    base = Order(counts, snapshot=SNAPSHOT, seed=7, epoch=0).indices(np.arange(2000)).tolist()
    for other in (
        {"snapshot": "cd" * 32, "seed": 7, "epoch": 0},
        {"snapshot": SNAPSHOT, "seed": 8, "epoch": 0},
        {"snapshot": SNAPSHOT, "seed": 7, "epoch": 1},
    ):
        assert Order(counts, **other).indices(np.arange(2000)).tolist() != base  # type: ignore[arg-type]
    # unshuffled: members in key order, samples as stored
    flat = Order(counts, snapshot=SNAPSHOT, seed=7, epoch=3, shuffle=False)
    assert flat.indices(np.arange(2000)).tolist() == list(range(2000))
    with pytest.raises(IndexError):
        flat.locate([2000])
    with pytest.raises(ValueError, match="window"):
        Order(counts, snapshot=SNAPSHOT, seed=7, epoch=0, window=0)


def test_windowed_orders_hold_few_members_and_stay_close_against_a_full_shuffle() -> None:
    counts = [1000] * 64
    windowed = quality(Order(counts, snapshot=SNAPSHOT, seed=1, epoch=0, window=8))
    full = quality(Order(counts, snapshot=SNAPSHOT, seed=1, epoch=0, window=None))
    assert windowed.positions == full.positions == 64_000
    assert windowed.members_held <= 8 < full.members_held == 64
    assert windowed.members_touched == full.members_touched == 64
    assert full.mean_gap > 0.25 * 64_000  # about N / 3
    # adjacent samples lie about as far apart as in a full shuffle (the members of a
    # window are drawn from all of them), from 8 members held instead of all 64
    assert windowed.mean_gap > 0.75 * full.mean_gap
    in_order = quality(Order(counts, snapshot=SNAPSHOT, seed=1, epoch=0, shuffle=False))
    assert in_order.mean_gap == 1.0
    assert in_order.members_held == 1
    part = quality(Order(counts, snapshot=SNAPSHOT, seed=1, epoch=0, window=8), 100, 600)
    assert part.positions == 500
    assert part.members_touched <= 8


def test_row_group_windows_mix_nearly_as_a_full_shuffle_from_few_row_groups() -> None:
    # 64 Parquet-like members of 8 row groups (units) of 1000 rows each
    counts, units = [8000] * 64, [[1000] * 8] * 64
    windowed = Order(counts, snapshot=SNAPSHOT, seed=1, epoch=0, units=units)
    assert windowed.window == DEFAULT_WINDOW == 16
    full = Order(counts, snapshot=SNAPSHOT, seed=1, epoch=0, units=units, window=None)
    w, f = quality(windowed), quality(full)
    assert w.positions == f.positions == 512_000
    assert w.units_touched == f.units_touched == 512
    assert w.units_held <= 16 < 512 == f.units_held
    # the windows' units are drawn from the whole dataset: adjacent samples lie about as
    # far apart as in a full shuffle, from 16 row groups held instead of all 512
    assert w.mean_gap > 0.9 * f.mean_gap
    # a batch of 1024 rows draws from about 16 row groups and 15 members (a full
    # shuffle: ~440 row groups, all 64 members); at window 8, about 9 and 8.5
    batches = [quality(windowed, s, s + 1024) for s in range(0, 512_000, 1024 * 25)]
    assert all(16 <= b.units_touched <= 32 for b in batches)
    assert np.mean([b.members_touched for b in batches]) > 12
    narrow = Order(counts, snapshot=SNAPSHOT, seed=1, epoch=0, units=units, window=8)
    assert quality(narrow, 0, 1024).units_touched <= 16
    # the order is by units, not members: the same counts as one unit per member differ
    by_members = Order(counts, snapshot=SNAPSHOT, seed=1, epoch=0)
    assert (
        by_members.indices(np.arange(1000)).tolist() != windowed.indices(np.arange(1000)).tolist()
    )


def test_resuming_far_into_a_huge_epoch_costs_nothing_per_position_before_it() -> None:
    counts = [1 << 40] * 1000  # about 10**15 samples: no table of them could be built
    order = Order(counts, snapshot=SNAPSHOT, seed=3, epoch=0)
    steps = Steps(order.total, order.total - 100, 16, 8)
    began = time.perf_counter()
    positions, padding = steps.positions(0, 7)
    _member, sample = order.locate(positions)
    assert time.perf_counter() - began < 1.0
    assert len(positions) == 12  # 100 left over 8 ranks: 13 13 13 13 12 12 12 12
    assert padding == 0
    assert (sample < (1 << 40)).all()


# -- steps, ranks, workers, tails, resumes (on positions) --------------------------------


def worker_batches(steps: Steps, rank: int, workers: int) -> list[list[int]]:
    """Steps as a DataLoader with ``workers`` workers yields them: a batch from each
    worker in turn (torch's in-order round robin), each worker taking steps k, k+K, ..."""
    own = [
        [s for s in range(k, len(steps), workers) if len(steps.positions(s, rank)[0])]
        for k in range(workers)
    ]
    merged: list[int] = []
    queues = [list(q) for q in own]
    while any(queues):
        for q in queues:
            if q:
                merged.append(q.pop(0))
    return [[s] for s in merged]


@dataclass
class Tally:
    """What the trainer consumed over an epoch, with its resizes."""

    read: Counter[int] = field(default_factory=Counter)
    padding: int = 0
    #: what the step size of the segment that reached the epoch's end says is left
    #: out (tail="drop") or padded (tail="pad")
    dropped: int = 0
    padded: int = 0
    end_step_size: int = 0


def run_epoch(
    total: int, tail: str, segments: Sequence[tuple[int, int, int, int]]
) -> tuple[Tally, list[int]]:
    """Run an epoch through ``segments`` (each resumes the cursor the one before left),
    the last to the end; return what was consumed and each segment's cursor."""
    tally = Tally()
    cursor = 0
    cursors = []
    for i, (world, batch, workers, run) in enumerate(segments):
        steps = Steps(total, cursor, batch, world, tail)  # type: ignore[arg-type]
        last = i == len(segments) - 1
        todo = len(steps) if last else min(run, len(steps))
        for rank in range(world):
            yielded = [s for [s] in worker_batches(steps, rank, workers)]
            # the rank's batches come in step order, whatever the workers
            assert yielded == sorted(yielded)
            for step in yielded:
                if step >= todo:
                    break
                positions, padding = steps.positions(step, rank)
                assert len(positions) <= batch
                if tail != "uneven":
                    assert len(positions) == batch
                start, stop, _ = steps.share(step, rank)
                assert stop - start == len(positions)  # a contiguous slice
                tally.read.update(positions[: len(positions) - padding].tolist())
                tally.padding += padding
                assert all(p < total for p in positions.tolist())
        if todo == len(steps) and steps.cursor < total:  # this segment ends the epoch
            end = steps.cursor + len(steps) * steps.size
            tally.dropped = max(0, total - end)
            tally.padded = max(0, end - total) if tail == "pad" else 0
            tally.end_step_size = steps.size
        cursor = steps.cursor_after(todo)
        cursors.append(cursor)
        state = LoaderState(SNAPSHOT, 1, 0, cursor)
        assert len(state.to_json()) <= MAX_STATE_BYTES
        if last:
            assert cursor == total
    return tally, cursors


@given(
    counts=counts_st,
    tail=tails_st,
    segments=st.lists(segment_st, min_size=1, max_size=5),
)
@settings(max_examples=300, deadline=None)
def test_any_resizes_and_resume_points_read_every_sample_once(
    counts: list[int], tail: str, segments: list[tuple[int, int, int, int]]
) -> None:
    total = sum(counts)
    tally, _ = run_epoch(total, tail, segments)
    assert all(n == 1 for n in tally.read.values())  # 0 repeats
    consumed = set(tally.read)
    # 0 skips: every position is read, but the short last step that "drop" leaves out
    assert consumed == set(range(total - tally.dropped))
    assert tally.dropped < max(1, tally.end_step_size)
    if tail != "drop":
        assert tally.dropped == 0
    # padding, counted apart from repeats: only "pad" pads, only the last step
    assert tally.padding == tally.padded
    assert tally.padded < max(1, tally.end_step_size)


@given(
    total=st.integers(0, 200),
    world=st.integers(1, 9),
    batch=st.integers(1, 9),
    tail=tails_st,
)
@settings(max_examples=200, deadline=None)
def test_a_step_splits_over_ranks_in_contiguous_even_slices(
    total: int, world: int, batch: int, tail: str
) -> None:
    steps = Steps(total, 0, batch, world, tail)  # type: ignore[arg-type]
    for step in range(len(steps)):
        start, stop = steps.span(step)
        shares = [steps.share(step, r) for r in range(world)]
        assert shares[0].start == start
        assert shares[-1].stop == stop
        assert all(a.stop == b.start for a, b in itertools.pairwise(shares))
        sizes = [s.stop - s.start for s in shares]
        assert max(sizes) - min(sizes) <= 1  # even, in the short last step too
        if not steps.is_last(step):
            assert sizes == [batch] * world
            assert all(s.padding == 0 for s in shares)
        # padding is the end of a rank's batch, and only past the epoch's end
        for s in shares:
            assert s.padding == max(0, s.stop - max(s.start, total))


def test_tails_by_example() -> None:
    # 10 samples, 2 ranks of 3: steps of 6 positions; 4 are left for the second step
    uneven = Steps(10, 0, 3, 2, "uneven")
    assert len(uneven) == 2
    assert [uneven.share(1, r) for r in (0, 1)] == [(6, 8, 0), (8, 10, 0)]
    pad = Steps(10, 0, 3, 2, "pad")
    assert [pad.positions(1, r)[0].tolist() for r in (0, 1)] == [[6, 7, 8], [9, 0, 1]]
    assert pad.positions(1, 1)[1] == 2
    drop = Steps(10, 0, 3, 2, "drop")
    assert len(drop) == 1
    assert drop.cursor_after(1) == 10  # the epoch is done: the dropped tail with it
    # 3 left for 4 ranks of 2: one rank gets none
    small = Steps(3, 0, 2, 4, "uneven")
    assert [small.share(0, r)[:2] for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 3)]
    assert len(Steps(0, 0, 2, 2, "pad")) == 0
    # a tiny epoch pads by wrapping around it
    assert Steps(2, 0, 5, 1, "pad").positions(0, 0)[0].tolist() == [0, 1, 0, 1, 0]


#: a window's bound on decoded bytes (None: no bound)
window_bytes_st = st.one_of(st.none(), st.integers(0, 400))


@given(
    units=units_st,
    costs=st.lists(
        st.one_of(st.just(0), st.integers(1, 100), st.integers(101, 600)),
        min_size=200,
        max_size=200,
    ),
    seed=st.integers(0, 2**64 - 1),
    window=windows_st,
    window_bytes=window_bytes_st,
)
@settings(max_examples=150, deadline=None)
def test_windows_are_bounded_by_units_and_by_decoded_bytes(
    units: list[list[int] | None],
    costs: list[int],
    seed: int,
    window: int | None,
    window_bytes: int | None,
) -> None:
    counts = unit_counts(units)
    per = [1 if u is None else len(u) for u in units]
    given_costs: list[list[int] | None] = []
    at = 0
    for i, n in enumerate(per):
        given_costs.append(None if i % 5 == 4 else costs[at : at + n])  # None: all 0
        at += n

    def make() -> Order:
        return Order(
            counts,
            snapshot=SNAPSHOT,
            seed=seed,
            epoch=1,
            window=window,
            window_bytes=window_bytes,
            units=units,
            unit_bytes=given_costs,
        )

    order = make()
    check_epoch(order, counts, window, window_bytes)
    total = sum(counts)
    # a pure function of (snapshot, seed, epoch, shuffle, window, window_bytes)
    assert make().indices(np.arange(total)).tolist() == order.indices(np.arange(total)).tolist()
    # no decoded bytes anywhere: window_bytes bounds nothing
    if window is not None:
        free = Order(counts, snapshot=SNAPSHOT, seed=seed, epoch=1, window=window, units=units)
        bare = Order(
            counts,
            snapshot=SNAPSHOT,
            seed=seed,
            epoch=1,
            window=window,
            window_bytes=None,
            units=units,
        )
        assert free.indices(np.arange(total)).tolist() == bare.indices(np.arange(total)).tolist()


def test_unit_bytes_are_checked_and_default_to_the_decode_caches_bound() -> None:
    from chunkd.client.datasets.formats import DECODED_CACHE_BYTES, jsonl, mds, parquet

    assert DEFAULT_WINDOW_BYTES == DECODED_CACHE_BYTES == 256 << 20
    assert (
        parquet.ROW_GROUP_CACHE_BYTES == jsonl.CACHE_BYTES == mds.CACHE_BYTES == DECODED_CACHE_BYTES
    )
    assert Order([3], snapshot=SNAPSHOT, seed=1, epoch=0).window_bytes == DEFAULT_WINDOW_BYTES
    assert LoaderState(SNAPSHOT, 1, 0, 0).window_bytes == DEFAULT_WINDOW_BYTES
    with pytest.raises(ValueError, match="one per unit"):
        Order([4], snapshot=SNAPSHOT, seed=1, epoch=0, units=[[2, 2]], unit_bytes=[[1]])
    with pytest.raises(ValueError, match="one entry per member"):
        Order([4, 1], snapshot=SNAPSHOT, seed=1, epoch=0, unit_bytes=[[1]])
    with pytest.raises(ValueError, match="negative"):
        Order([4], snapshot=SNAPSHOT, seed=1, epoch=0, unit_bytes=[[-1]])
    with pytest.raises(ValueError, match="window_bytes"):
        Order([4], snapshot=SNAPSHOT, seed=1, epoch=0, window_bytes=-1)
    # a unit bigger than the bound is a window alone; small ones share one
    order = Order(
        [1] * 6,
        snapshot=SNAPSHOT,
        seed=1,
        epoch=0,
        shuffle=False,
        window_bytes=100,
        unit_bytes=[[500], [10], [10], [90], [0], [500]],
    )
    assert order.window_firsts.tolist() == [0, 1, 3, 5]


def test_the_formats_name_their_units_decoded_bytes_from_the_manifest() -> None:
    from chunkd.client.datasets.formats import format_of

    def units(member: Member) -> tuple[list[int], list[int]]:
        fmt = format_of(member.format)
        return fmt.units(member), fmt.unit_bytes(member)

    rg = Member(
        "a.parquet",
        10,
        "v",
        "parquet",
        samples=5,
        meta={"row_groups": [[2, 4, 3, 700], [3, 7, 2, 900]]},
    )
    assert units(rg) == ([2, 3], [700, 900])  # a row group's uncompressed size
    zst = Member(
        "a.jsonl.zst",
        10,
        "v",
        "jsonl",
        samples=5,
        meta={"seekable": False, "bytes": 12345, "index": [[0, 0]]},
    )
    lines, decoded = units(zst)
    assert lines == [5]
    assert decoded[0] >= 12345  # what decompresses, and the lines' offsets
    records = Member("a.bin", 40, "v", "fixed", samples=5, meta={"record_bytes": 8})
    assert units(records) == ([5], [40])  # records read in place still make a table


def test_the_longest_state_fits() -> None:
    longest = LoaderState(SNAPSHOT, 2**64 - 1, 2**32 - 1, 2**63 - 1, False, 2**32 - 1, 2**63 - 1)
    assert len(longest.to_json().encode()) == 253 <= MAX_STATE_BYTES
    assert LoaderState.parse(longest.to_json()) == longest


def test_bad_states_are_refused_with_what_is_wrong() -> None:
    good = LoaderState(SNAPSHOT, 5, 1, 10).to_dict()
    cases: list[tuple[Any, str]] = [
        ("{not json", "does not parse"),
        (json.dumps(good)[:-9], "does not parse"),
        ("x" * (MAX_STATE_BYTES + 1), "at most 256 bytes"),
        ([1, 2], "JSON object"),
        (good | {"format": "chunkd.loader/9"}, "not a loader state"),
        (good | {"extra": 1}, "exactly the fields"),
        ({k: v for k, v in good.items() if k != "seed"}, "lacks"),
        (good | {"cursor": -1}, "'cursor' is a whole number"),
        (good | {"cursor": 1.5}, "'cursor' is a whole number"),
        (good | {"seed": True}, "'seed' is a whole number"),
        (good | {"snapshot": "xyz"}, "snapshot id"),
        (good | {"window": 0}, "'window'"),
        (good | {"window_bytes": -1}, "'window_bytes'"),
        (good | {"window_bytes": 2**63}, "'window_bytes'"),
        (good | {"shuffle": 1}, "'shuffle'"),
        (
            {"format": "chunkd.ShardDataset/1", "order": "ab", "epoch": 2, "position": 7},
            "row groups",
        ),
        # the order before units: its cursor is a place in another order
        (good | {"format": "chunkd.loader/1"}, r"loader/1 state \(epoch 1, cursor 10\).*units"),
        # windows bounded by units only: its cursor is a place in another order
        (
            {k: v for k, v in good.items() if k != "window_bytes"} | {"format": "chunkd.loader/2"},
            r"loader/2 state \(epoch 1, cursor 10\).*window_bytes",
        ),
    ]
    for state, message in cases:
        with pytest.raises(ResumeStateError, match=message):
            LoaderState.parse(state)
    assert issubclass(ResumeStateError, ValueError)

    assert good["format"] == STATE_FORMAT
    state = LoaderState.parse(good)
    order = {
        "snapshot": SNAPSHOT,
        "seed": 5,
        "shuffle": True,
        "window": 16,
        "window_bytes": DEFAULT_WINDOW_BYTES,
        "total": 100,
    }
    state.check(**order)  # type: ignore[arg-type]
    for change, message in (
        ({"snapshot": "cd" * 32}, "of snapshot"),
        ({"seed": 6}, "of seed 5"),
        ({"window": None}, "window=16"),
        ({"window_bytes": None}, "window_bytes=268435456"),
        ({"shuffle": False}, "shuffle=True"),
        ({"total": 9}, "past the end"),
    ):
        with pytest.raises(ResumeStateError, match=message):
            state.check(**(order | change))  # type: ignore[arg-type]


# -- through real reads: a snapshot of fixed records in memory ---------------------------


class MemorySource:
    """Member bytes from a dict (a :class:`~chunkd.client.datasets.source.Source`)."""

    def __init__(self, blobs: dict[str, bytes]) -> None:
        self.blobs = blobs
        self.reads = 0

    def name(self, member: Member) -> str:
        return f"mem/{member.key}"

    def read(self, member: Member, offset: int, length: int) -> memoryview:
        self.reads += 1
        return memoryview(self.blobs[member.key])[offset : offset + length].toreadonly()

    def file(self, member: Member) -> BinaryIO:
        raise NotImplementedError


class Prefetcher:
    """A client that records what it was asked to prefetch."""

    def __init__(self, *, ranges: bool = True) -> None:
        self.asked: list[list[tuple[str, int, int]]] = []
        self.names: list[list[str]] = []
        self.reported: list[tuple[str, dict[str, Any]]] = []
        if not ranges:
            self.prefetch_ranges = None  # type: ignore[assignment]

    def prefetch_ranges(self, ranges: list[tuple[str, int, int]]) -> int:
        self.asked.append(list(ranges))
        return len(ranges)

    def prefetch(self, names: list[str]) -> int:
        self.names.append(list(names))
        return len(names)

    def request(self, op: str, fields: dict[str, Any]) -> Any:
        self.reported.append((op, fields))
        return io.BytesIO()


def memory_dataset(counts: Sequence[int]) -> tuple[Dataset, dict[str, bytes]]:
    """A snapshot of fixed records, one member per count, and the bytes of each sample."""
    blobs: dict[str, bytes] = {}
    members = []
    expected: dict[str, bytes] = {}
    for i, n in enumerate(counts):
        key = f"part-{i:03d}.bin"
        records = [bytes([i % 256, j % 256, (i * 7 + j) % 256, 0xAB]) for j in range(n)]
        blobs[key] = b"".join(records)
        expected.update({f"{key}#{j}": r for j, r in enumerate(records)})
        members.append(
            Member(key, n * RECORD, "v1", "fixed", samples=n, meta={"record_bytes": RECORD})
        )
    snapshot = Snapshot.build(backend="mem", prefix="", format="fixed", members=members)
    return Dataset(snapshot, MemorySource(blobs)), expected


@given(
    counts=st.lists(st.integers(0, 15), min_size=1, max_size=8),
    tail=tails_st,
    seed=st.integers(0, 1000),
    segments=st.lists(
        st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(0, 4)),
        min_size=1,
        max_size=4,
    ),
)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_loaders_resized_through_states_read_every_sample_once(
    counts: list[int], tail: str, seed: int, segments: list[tuple[int, int, int]]
) -> None:
    dataset, expected = memory_dataset(counts)
    seen: Counter[str] = Counter()
    padding = 0
    end_size = 1
    state: dict[str, Any] | None = None
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
                if b is None:
                    continue
                assert [bytes(s) for s in b.samples] == [expected[x] for x in b.ids]
                seen.update(b.ids[: len(b.ids) - b.padding])
                padding += b.padding
            step += 1
        states = [loader.state() for loader in loaders]
        # ranks in step hold one state, of at most 256 bytes, whatever their geometry
        assert all(s == states[0] for s in states)
        assert len(json.dumps(states[0], separators=(",", ":"))) <= MAX_STATE_BYTES
        if states[0]["cursor"] == len(dataset) and (
            state is None or state["cursor"] < len(dataset)
        ):
            end_size = world * batch  # the step size of the segment that ended the epoch
        state = states[0]
    assert state is not None
    assert state["cursor"] == len(dataset)
    assert max(seen.values(), default=1) == 1
    if tail == "drop":
        assert set(seen) <= set(expected)
        assert len(expected) - len(seen) < end_size
    else:
        assert set(seen) == set(expected)
    if tail != "pad":
        assert padding == 0


def test_a_loader_warms_its_next_steps_before_reading() -> None:
    dataset, _ = memory_dataset([6, 6, 6, 6])
    client = Prefetcher()
    loader = Loader(dataset, batch_size=2, seed=1, world_size=2, rank=1, prefetch=2, client=client)
    steps = loader.steps()
    order = loader.order()
    it = iter(loader)
    first = next(it)
    # before the first batch: what its own step and the 2 after it need, each unit's
    # range once (a member of 6 records is one unit): the units of those steps' window,
    # which the reader lays out whole (here all four members are one window)
    assert len(client.asked) == 1
    assert len(client.asked[0]) == len(set(client.asked[0]))
    wanted = []
    for s in range(3):
        members, samples = order.locate(steps.positions(s, 1)[0])
        wanted += dataset.ranges(zip(members.tolist(), samples.tolist(), strict=True))
    assert set(wanted) <= set(client.asked[0])
    every = dataset.ranges((m, 0) for m in range(4))
    assert set(client.asked[0]) <= set(every)
    assert first.ids == [dataset.sample_id(*pair) for pair in _pairs(order, steps, 0, 1)]
    next(it)
    # the next step's units were all warmed already: a unit is warmed once, not a step
    assert len(client.asked) == 1
    assert len(list(it)) == 4  # 24 samples, 2 ranks of 2: 6 steps, 2 of them read

    once = Prefetcher()
    assert warm(once, [("mem/a", 0, 9), ("mem/a", 0, 9), ("mem/b", 0, 4)]) == 2
    assert once.asked == [[("mem/a", 0, 9), ("mem/b", 0, 4)]]
    assert warm(None, [("mem/a", 0, 4)]) == 0

    class Refusing:
        def prefetch_ranges(self, ranges: Any) -> int:
            raise InvalidRequestError("no such field")

    assert warm(Refusing(), [("mem/a", 0, 4)]) == 0  # a hint refused costs nothing


def _pairs(order: Order, steps: Steps, step: int, rank: int) -> list[tuple[int, int]]:
    members, samples = order.locate(steps.positions(step, rank)[0])
    return list(zip(members.tolist(), samples.tolist(), strict=True))


def test_workers_take_whole_steps_in_turn() -> None:
    dataset, _ = memory_dataset([5, 0, 9, 7])
    steps = Steps(len(dataset), 0, 3, 2)
    order = Order(dataset.snapshot.counts, snapshot=dataset.id, seed=4, epoch=0)
    for rank in (0, 1):
        alone = list(read_steps(dataset, order, steps, rank=rank, prefetch=0))
        per_worker = [
            list(read_steps(dataset, order, steps, rank=rank, first=k, every=3, prefetch=0))
            for k in range(3)
        ]
        assert [[b.step for b in w] for w in per_worker] == [[0, 3], [1], [2]]
        merged = sorted((b for w in per_worker for b in w), key=lambda b: b.step)
        assert [b.ids for b in merged] == [b.ids for b in alone]
        last = alone[-1]
        assert last.last
        assert last.position == 18
        assert len(last.samples) == 2 - rank  # 21 samples: 3 left over 2 ranks: 2 and 1


def test_the_samples_of_a_step_are_a_pure_function_of_the_state() -> None:
    dataset, _ = memory_dataset([7, 3, 11, 0, 9])
    seen = [
        [b.ids for b in Loader(dataset, batch_size=2, seed=9, rank=r, world_size=3)]
        for r in range(3)
    ]
    start = LoaderState(dataset.id, 9, 0, 0)
    for step in range(len(seen[0])):
        answer = step_sample_ids(dataset, start, step=step, batch_size=2, world_size=3)
        assert [answer[r].ids for r in range(3)] == [
            seen[r][step] if step < len(seen[r]) else [] for r in range(3)
        ]
    # after a resume: steps count from the state's cursor
    loader = Loader(dataset, batch_size=3, seed=9, world_size=2, rank=1)
    it = iter(loader)
    next(it)
    saved = loader.state()
    following = next(it)
    answer = step_sample_ids(dataset, saved, step=0, batch_size=3, world_size=2, rank=1)
    assert answer == {1: (following.ids, 0)}
    with pytest.raises(IndexError):
        step_sample_ids(dataset, saved, step=99, batch_size=3, world_size=2)
    with pytest.raises(ResumeStateError, match="of snapshot"):
        step_sample_ids(
            dataset, start.to_dict() | {"snapshot": "0" * 64}, step=0, batch_size=1, world_size=1
        )


def test_a_loader_refuses_a_state_of_another_order_and_knows_its_epoch() -> None:
    dataset, _ = memory_dataset([4, 4])
    loader = Loader(dataset, batch_size=2, seed=1)
    assert loader.state() == LoaderState(dataset.id, 1, 0, 0).to_dict()
    other, _ = memory_dataset([4, 5])
    for state, message in (
        (LoaderState(other.id, 1, 0, 0), "of snapshot"),
        (LoaderState(dataset.id, 2, 0, 0), "of seed"),
        (LoaderState(dataset.id, 1, 0, 0, window=None), "window"),
        (LoaderState(dataset.id, 1, 0, 9), "past the end"),
    ):
        with pytest.raises(ResumeStateError, match=message):
            loader.restore(state.to_dict())
    loader.restore(LoaderState(dataset.id, 1, 3, 4).to_json())
    assert loader.epoch == 3
    loader.set_epoch(3)  # the restored cursor holds
    assert len(list(loader)) == 2
    assert loader.state()["cursor"] == 8
    assert list(loader) == []  # the epoch is done until another is set
    loader.set_epoch(4)
    assert loader.state()["cursor"] == 0
    assert len(list(loader)) == 4
    with pytest.raises(ValueError, match="rank < world_size"):
        Loader(dataset, batch_size=2, seed=1, rank=2, world_size=2)
    with pytest.raises(ValueError, match="tail"):
        Loader(dataset, batch_size=2, seed=1, tail="wrap")  # type: ignore[arg-type]
    for bad in ({"seed": -1}, {"window": 0}, {"prefetch": 99}, {"batch_size": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Loader(dataset, **({"batch_size": 2, "seed": 1} | bad))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="epoch"):
        loader.set_epoch(-1)


# -- through real reads: Parquet row groups, decoded once a window ---------------------


def parquet_dataset(files: int, groups: int, rows: int) -> Dataset:
    """A snapshot of ``files`` Parquet members of ``groups`` row groups of ``rows``, in memory."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from chunkd.client.datasets.formats import format_of, settle

    blobs: dict[str, bytes] = {}
    for f in range(files):
        sink = io.BytesIO()
        first = f * groups * rows
        table = pa.table({"id": list(range(first, first + groups * rows))})
        pq.write_table(table, sink, row_group_size=rows)
        blobs[f"part-{f:03d}.parquet"] = sink.getvalue()
    source = MemorySource(blobs)
    fmt = format_of("parquet")
    # a version per content: the formats' caches are keyed by name and version
    members = [
        fmt.scan(source, Member(key, len(blob), hashlib.sha256(blob).hexdigest(), "parquet"), {})
        for key, blob in blobs.items()
    ]
    schema, members = settle(fmt, members)
    snapshot = Snapshot.build(
        backend="mem", prefix="", format="parquet", members=members, schema_of=schema
    )
    return Dataset(snapshot, source)


def test_parquet_row_groups_are_decoded_once_an_epoch_though_they_outnumber_what_a_reader_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dataset = parquet_dataset(files=8, groups=16, rows=20)  # 128 row groups, 2560 rows
    from chunkd.client.datasets.formats import parquet, snapshot_unit_bytes, snapshot_units

    assert snapshot_units(dataset.snapshot) == [[20] * 16] * 8
    per = max(c for costs in snapshot_unit_bytes(dataset.snapshot) for c in costs or ())
    decodes: Counter[tuple[str, int]] = Counter()
    decode = parquet.ParquetRows.decode

    def counted(self: Any, source: Any, member: Member, unit: int, columns: Any) -> Any:
        decodes[member.key, unit] += 1
        return decode(self, source, member, unit, columns)

    monkeypatch.setattr(parquet.ParquetRows, "decode", counted)
    held = 2 * DEFAULT_WINDOW * per  # two windows of units: 32 of the 128

    # each rank's reader decodes each row group it reads from once an epoch
    for world in (1, 3):
        for rank in range(world):
            decodes.clear()
            loader = Loader(
                dataset, batch_size=24, seed=5, rank=rank, world_size=world, decode_ahead=held
            )
            ids = [int(i) for b in loader for i in b.columns["id"].tolist()]
            assert len(ids) == len(set(ids))
            assert max(decodes.values()) == 1
            if world == 1:
                assert sorted(ids) == list(range(2560))
                assert len(decodes) == 128

    # the order before units, members shuffled and rows mixed within windows of 8
    # members (128 row groups a window), thrashes what the same reader holds
    decodes.clear()
    units = Units(dataset.snapshot, dataset.source, held_bytes=held, threads=0)
    by_members = Order(dataset.snapshot.counts, snapshot=dataset.id, seed=5, epoch=0, window=8)
    steps = Steps(len(dataset), 0, 24, 1)
    read = read_steps(dataset, by_members, steps, rank=0, units=units, prefetch=0)
    assert sum(len(b) for b in read) == 2560
    assert sum(decodes.values()) > 5 * 128

    # Row groups large against what a reader holds (Spark's 128 MiB groups against 256
    # MiB): windows cut to its bytes (window_bytes) decode each group once; windows of
    # 16 units whatever their bytes (the order before window_bytes) thrash
    bound = 4 * per
    for window_bytes, once in ((bound, True), (None, False)):
        decodes.clear()
        loader = Loader(
            dataset, batch_size=24, seed=5, window_bytes=window_bytes, decode_ahead=2 * bound
        )
        assert loader.state()["window"] == DEFAULT_WINDOW == 16
        ids = [int(i) for b in loader for i in b.columns["id"].tolist()]
        assert sorted(ids) == list(range(2560))
        if once:
            assert len(decodes) == 128
            assert max(decodes.values()) == 1
        else:
            assert sum(decodes.values()) > 3 * 128
