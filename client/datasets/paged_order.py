"""The order of a schema-2 (paged) snapshot's epoch: order version 2, :class:`PagedOrder`.

Version 1's order (:class:`~chunkd.client.datasets.order.Order`) needs every unit, so
every member, of the snapshot: arrays over all units, built in O(units) by every process
each epoch (6 s and 1.7 GiB at 10M row groups). A schema-2 snapshot is a root naming
member pages (``chunkd.snapshot``), and its order is built from the root alone, in O(pages)::

    chunkd.order:{snapshot}:{seed}:{epoch}:pages                the pages' order
    chunkd.order:{snapshot}:{seed}:{epoch}:group:{g}:units      group g's units' order
    chunkd.order:{snapshot}:{seed}:{epoch}:group:{g}:window:{w} the samples of its window w

The pages holding samples are permuted (:class:`Permutation`), then cut greedily
into **groups** of consecutive pages of that order: at most :data:`GROUP_PAGES` (4)
pages and at most :data:`GROUP_MEMBERS` (32,768) members, one page at least (so
every group but the last has two pages at least: a page holds at most 16,384). The
root gives each page's samples, so where each group starts in the epoch is a prefix
sum over the pages. Inside a group everything is as in version 1, over the group's units
alone: its units (the formats' own, from its pages' members) permuted, cut into
windows of at most ``window`` units and ``window_bytes`` decoded, the samples of a
window permuted. So the epoch reads group 0's windows, then group 1's, and so on; a
window's units come from the group's 2 to 4 pages, which the pages' order draws
from anywhere in the dataset. ``shuffle=False``: pages, units and samples in order
(positions are snapshot indices). ``window=None`` and ``window_bytes=None``: a
group's samples mixed whole (no uniform shuffle of the whole epoch: that needs every
unit).

A position's group is a binary search over the groups; the group is built when a
position of it is first asked for: its pages are loaded (checked against their ids
and the root), its members' units worked out (kept a process, by page id, within
:data:`PAGE_UNITS_BYTES`), permuted and windowed. An order keeps :data:`GROUPS_HELD`
(2) groups built. Memory: the root's arrays (a few per page) and two groups' units;
the pages themselves are the snapshot's (its page cache, ``PAGE_CACHE`` pages), and
two groups' pages fit it, so a reader crossing from one group to the next loads each
page once an epoch (groups of 16 pages made a reader reload a page for nearly every
unit: 4,862 loads and 340 s for 200 steps where 4 loads took 0.8 s). The version
(:data:`ORDER_VERSION`, :func:`order_version`) is recorded in a loader state's
format (:mod:`chunkd.client.datasets.state`); schema-1 snapshots keep version 1.

Measured (``bench/order_bench.py``; Parquet-like members of 8 row groups of 125
rows): at 10M units, building the order and locating a first run of positions takes
0.2-0.4 s and 27-46 MiB in a fresh process, against 5.9-6.5 s and 1.7 GiB for
version 1 from the lists in hand; at 100M units, 0.1 s (version 1 does not fit). In
runs of 50,000 rows of 100,000 such members a reader holds 16 row groups open (a
full shuffle: about 800); adjacent samples lie 0.35-0.5 as far apart in the
snapshot as under a full shuffle, where version 1's windows give 0.95: a window's
units come from the 2-4 pages of a group, not from 16 places (groups of 16 pages:
0.6-0.9, but a reader then holds 16 pages, twice the snapshot's page cache).

The order's definition (units, windows, the keys, the defaults) is
:mod:`chunkd.client.datasets.order`'s; what both versions give the loader is
:mod:`chunkd.client.datasets.epoch`'s. This module needs numpy only: no torch, no jax,
no client.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, NamedTuple, Protocol

import numpy as np
from numpy.typing import NDArray

from chunkd.client.datasets.epoch import (
    DEFAULT_WINDOW,
    DEFAULT_WINDOW_BYTES,
    ORDER_VERSION,
    Located,
    order_version,
    window_starts,
)
from chunkd.client.datasets.formats import Format, format_of
from chunkd.client.datasets.permutation import Permutation
from chunkd.errors import ManifestError

if TYPE_CHECKING:
    from chunkd.snapshot import Member

__all__ = [
    "GROUPS_HELD",
    "GROUP_MEMBERS",
    "GROUP_PAGES",
    "PAGE_UNITS_BYTES",
    "PageEntry",
    "PageUnits",
    "PagedOrder",
    "PagedSnapshot",
    "page_units",
]

#: the most pages whose units an order of version 2 mixes together: a group (see the
#: module docstring; part of the version's definition: changing it changes every
#: order). Two groups' pages fit a snapshot's page cache (``chunkd.snapshot.PAGE_CACHE``,
#: 8), so a reader crossing from one group to the next loads each page once
GROUP_PAGES: Final = 4
#: the most members of a group, unless it is one page: two pages' most (a page holds at
#: most 16,384), so every group but an epoch's last has two pages at least, and what a
#: reader holds of the manifest is bounded in members whatever the pages' sizes
GROUP_MEMBERS: Final = 32_768
#: groups a :class:`PagedOrder` keeps built (a step may cross from one to the next)
GROUPS_HELD: Final = 2
#: the most bytes of pages' unit tables a process keeps (:func:`page_units`), shared by
#: every order: a page's units depend on its content alone
PAGE_UNITS_BYTES: Final = 4 << 20


class PageEntry(Protocol):
    """What an order reads of a root's entry for a page (``chunkd.snapshot.PageRef``)."""

    @property
    def id(self) -> str: ...

    @property
    def members(self) -> int: ...

    @property
    def samples(self) -> int: ...


class PagedSnapshot(Protocol):
    """What a :class:`PagedOrder` reads of a snapshot (``chunkd.snapshot.Snapshot`` of
    schema 2): its id, its root's pages, and a page's members when a group needs them."""

    @property
    def id(self) -> str: ...

    @property
    def pages(self) -> Sequence[PageEntry]: ...

    def page_members(self, page: int) -> Sequence[Member]: ...


class PageUnits(NamedTuple):
    """A page's units, in member order: each one's member (in the page), its number in
    its member, its first sample in its member, its samples, its decoded bytes, and
    its first sample in the page."""

    member: NDArray[np.int64]
    unit: NDArray[np.int64]
    first: NDArray[np.int64]
    size: NDArray[np.int64]
    cost: NDArray[np.int64]
    start: NDArray[np.int64]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self)


def page_units(snapshot: PagedSnapshot, page: int) -> PageUnits:
    """Page ``page``'s units (:class:`PageUnits`), from its members' formats
    (:func:`~chunkd.client.datasets.formats.units_of`,
    :func:`~chunkd.client.datasets.formats.unit_bytes_of`); kept by page id, at most
    :data:`PAGE_UNITS_BYTES` of them a process.

    Raises:
        ManifestError: a member's units do not add up to its samples, or its decoded
            bytes are not one per unit, or negative.
        DatasetNotFoundError: the page source has no such page.
    """
    page_id = snapshot.pages[page].id
    found = _PAGE_UNITS.get(page_id)
    if found is not None:
        return found
    members = snapshot.page_members(page)
    formats: dict[str, Format] = {}
    sizes: list[int] = []
    costs: list[int] = []
    lengths: list[int] = []
    for member in members:
        fmt = formats.get(member.format)
        if fmt is None:
            fmt = formats[member.format] = format_of(member.format)
        counts = fmt.units(member)
        spent = fmt.unit_bytes(member)
        if len(spent) != len(counts) or sum(counts) != member.samples:
            raise ManifestError(
                f"member {member.key!r} (page {page_id}): its format cuts it into units of "
                f"{sum(counts)} samples with {len(spent)} decoded sizes for {len(counts)} "
                f"units, where it holds {member.samples}: its metadata is damaged"
            )
        sizes.extend(counts)
        costs.extend(spent)
        lengths.append(len(counts))
    size = np.asarray(sizes, dtype=np.int64).reshape(-1)
    cost = np.asarray(costs, dtype=np.int64).reshape(-1)
    if (size < 0).any() or (cost < 0).any():
        raise ManifestError(f"page {page_id}: a unit's samples or decoded bytes are negative")
    per = np.asarray(lengths, dtype=np.int64).reshape(-1)
    member_of = np.repeat(np.arange(len(per), dtype=np.int64), per)
    firsts = np.cumsum(per) - per  # each member's first unit
    cum = np.concatenate(([0], np.cumsum(size))).astype(np.int64)
    start = cum[:-1]
    found = PageUnits(
        member_of,
        np.arange(len(size), dtype=np.int64) - firsts[member_of],
        start - cum[firsts][member_of],
        size,
        cost,
        start,
    )
    _PAGE_UNITS.put(page_id, found)
    return found


class _PageUnitsCache:
    """Pages' units by page id, the most recently used last, within a byte bound."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._held: OrderedDict[str, PageUnits] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, page_id: str) -> PageUnits | None:
        with self._lock:
            found = self._held.get(page_id)
            if found is not None:
                self._held.move_to_end(page_id)
            return found

    def put(self, page_id: str, units: PageUnits) -> None:
        size = units.nbytes
        if size > self.bound:
            return
        with self._lock:
            old = self._held.pop(page_id, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._held[page_id] = units
            self._bytes += size
            while self._bytes > self.bound:
                _, gone = self._held.popitem(last=False)
                self._bytes -= gone.nbytes

    def clear(self) -> None:
        with self._lock:
            self._held.clear()
            self._bytes = 0


_PAGE_UNITS: Final = _PageUnitsCache(PAGE_UNITS_BYTES)


class _Group:
    """One group's units in its units' order (units holding no sample left out), where
    each starts in the group's samples, and where its windows start."""

    __slots__ = ("cum", "first", "firsts", "index", "member", "starts", "unit")

    def __init__(
        self,
        member: NDArray[np.int64],
        unit: NDArray[np.int64],
        first: NDArray[np.int64],
        index: NDArray[np.int64],
        cum: NDArray[np.int64],
        firsts: NDArray[np.int64],
    ) -> None:
        self.member = member
        self.unit = unit
        self.first = first
        self.index = index
        self.cum = cum
        self.firsts = firsts
        self.starts: NDArray[np.int64] = np.concatenate((cum[firsts], cum[-1:])).astype(np.int64)

    def window_span(self, w: int) -> tuple[int, int]:
        """Window ``w``'s units: positions ``first .. stop`` of the units' order."""
        stop = int(self.firsts[w + 1]) if w + 1 < len(self.firsts) else len(self.member)
        return int(self.firsts[w]), stop


def _group_firsts(members: NDArray[np.int64], most: int) -> NDArray[np.int64]:
    """Where each group starts in a pages' order whose pages hold ``members``, and their
    end: greedily, each group the longest run from where the last ended of at most
    ``most`` pages and :data:`GROUP_MEMBERS` members, and one page at least. O(pages)."""
    count = len(members)
    firsts = [0]
    held = pages = 0
    for at, size in enumerate(members.tolist()):
        if pages and (pages >= most or held + size > GROUP_MEMBERS):
            firsts.append(at)
            held = pages = 0
        held += size
        pages += 1
    if count:
        firsts.append(count)
    return np.asarray(firsts, dtype=np.int64)


#: a window of a :class:`PagedOrder` is numbered ``group << _WINDOW_BITS | window in group``
_WINDOW_BITS: Final = 32


class PagedOrder:
    """One epoch's order of a schema-2 (paged) snapshot's samples: order version 2
    (see the module docstring).

    Built from the root alone (O(pages)): the pages are permuted and taken in groups of
    :data:`GROUP_PAGES`; a group's units are loaded, permuted and cut into windows
    when a position of the group is first asked for (at most :data:`GROUPS_HELD`
    groups are kept built).

    Args:
        snapshot: the snapshot (its root's pages, and its page source for the members).
        seed: the run's seed.
        epoch: the epoch.
        shuffle: permute (else: members in key order, samples as stored).
        window: the most units whose samples are mixed together (None: no bound; a
            group's units at most).
        window_bytes: the most decoded bytes of a window's units (None: no bound; a
            unit of more is a window alone).
        group_pages: pages a group mixes (:data:`GROUP_PAGES`, which order version 2
            is defined with; another makes another order, which no loader state
            names: for measuring only).

    Raises:
        ValueError: a window below 1, window_bytes below 0, group_pages below 1, or a
            snapshot of schema 1 (its order is :class:`Order`).
    """

    #: the order's version (:data:`ORDER_VERSION`)
    version: Final = ORDER_VERSION
    #: units are the formats' own (a Parquet row group), always
    by_units: Final = True

    def __init__(
        self,
        snapshot: PagedSnapshot,
        *,
        seed: int,
        epoch: int,
        shuffle: bool = True,
        window: int | None = DEFAULT_WINDOW,
        window_bytes: int | None = DEFAULT_WINDOW_BYTES,
        group_pages: int = GROUP_PAGES,
    ) -> None:
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 unit, or None for all; got {window!r}")
        if window_bytes is not None and window_bytes < 0:
            raise ValueError(
                f"window_bytes must be >= 0, or None for no bound; got {window_bytes!r}"
            )
        if group_pages < 1:
            raise ValueError(f"group_pages must be >= 1; got {group_pages!r}")
        if order_version(snapshot) != ORDER_VERSION:
            raise ValueError(
                f"snapshot {snapshot.id} is of schema 1: its order is version 1 (Order), "
                "not a paged order"
            )
        self.snapshot = snapshot
        self.group_pages = group_pages
        self.shuffle = bool(shuffle)
        self.window = window
        self.window_bytes = window_bytes
        self._key = f"chunkd.order:{snapshot.id}:{seed}:{epoch}"
        refs = snapshot.pages
        count = len(refs)
        samples = np.fromiter((r.samples for r in refs), dtype=np.int64, count=count)
        members = np.fromiter((r.members for r in refs), dtype=np.int64, count=count)
        #: each page's first member, and its first sample (snapshot indices)
        self.page_member_starts: NDArray[np.int64] = np.concatenate(
            ([0], np.cumsum(members))
        ).astype(np.int64)
        self.page_sample_starts: NDArray[np.int64] = np.concatenate(
            ([0], np.cumsum(samples))
        ).astype(np.int64)
        filled = np.flatnonzero(samples > 0).astype(np.int64)
        if self.shuffle:
            filled = filled[
                Permutation(len(filled), f"{self._key}:pages")(
                    np.arange(len(filled), dtype=np.int64)
                )
            ]
        #: the page at each place of the pages' order (pages holding no sample left out)
        self.page_order: NDArray[np.int64] = filled
        cum = np.concatenate(([0], np.cumsum(samples[filled]))).astype(np.int64)
        #: where each group starts in the pages' order, and their end
        self.group_firsts: NDArray[np.int64] = _group_firsts(members[filled], group_pages)
        #: where each group starts in the epoch, and the epoch's end
        self.group_starts: NDArray[np.int64] = cum[self.group_firsts]
        #: samples in the epoch
        self.total = int(cum[-1])
        self._groups: OrderedDict[int, _Group] = OrderedDict()
        self._permutations: OrderedDict[tuple[int, int], Permutation] = OrderedDict()
        self._lock = threading.Lock()
        #: groups built so far (each loads its pages' units)
        self.groups_built = 0

    def __len__(self) -> int:
        return self.total

    @property
    def groups(self) -> int:
        """How many groups the epoch has."""
        return len(self.group_starts) - 1

    def pages_of(self, group: int) -> NDArray[np.int64]:
        """The pages of group ``group``, in the pages' order."""
        return self.page_order[int(self.group_firsts[group]) : int(self.group_firsts[group + 1])]

    def locate(
        self, positions: NDArray[np.int64] | Sequence[int]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """The ``(member, sample in member)`` at each position (``0 <= p < total``).

        Raises:
            IndexError: a position outside the epoch.
            ManifestError, DatasetNotFoundError: a page the positions need is damaged or
                missing.
        """
        found = self.located(positions)
        return found.members, found.samples

    def located(self, positions: NDArray[np.int64] | Sequence[int]) -> Located:
        """Everything about each position (:class:`Located`).

        Raises:
            IndexError: a position outside the epoch.
        """
        windows, at = self.locate_windows(positions)
        members, samples, units, rows, indices = self._rows(windows, at, True)
        return Located(members, samples, units, rows, indices)

    def indices(self, positions: NDArray[np.int64] | Sequence[int]) -> NDArray[np.int64]:
        """The snapshot index of the sample at each position."""
        return self.located(positions).indices

    def locate_windows(
        self, positions: NDArray[np.int64] | Sequence[int]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """The window of each position (numbered ``group << 32 | window in group``), and
        where its sample is in that window's samples laid out unit after unit in the
        units' order (:meth:`window_keys`).

        Raises:
            IndexError: a position outside the epoch.
        """
        index = np.asarray(positions, dtype=np.int64).reshape(-1)
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= self.total):
            raise IndexError(f"positions outside an epoch of {self.total} samples")
        windows = np.empty_like(index)
        at = np.empty_like(index)
        if not len(index):
            return windows, at
        groups = np.searchsorted(self.group_starts, index, side="right") - 1
        first = int(groups[0])
        if bool(np.all(groups == first)):  # a step's run: one group, most often
            windows[:], at[:] = self._group_windows(first, index - self.group_starts[first])
            return windows, at
        for g in np.unique(groups).tolist():
            chosen = groups == g
            windows[chosen], at[chosen] = self._group_windows(
                g, index[chosen] - self.group_starts[g]
            )
        return windows, at

    def window_keys(self, window: int) -> list[tuple[int, int]]:
        """The units of window ``window`` as ``(member, unit in member)``, in the units'
        order."""
        g, w = int(window) >> _WINDOW_BITS, int(window) & ((1 << _WINDOW_BITS) - 1)
        group = self._group(g)
        first, stop = group.window_span(w)
        return list(
            zip(group.member[first:stop].tolist(), group.unit[first:stop].tolist(), strict=True)
        )

    def rows_at(
        self, windows: NDArray[np.int64], at: NDArray[np.int64]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
        """``(member, sample in member, unit in member, row in unit)`` of places ``at``
        of ``windows`` (:meth:`locate_windows`)."""
        members, samples, units, rows, _ = self._rows(windows, at, False)
        return members, samples, units, rows

    def _rows(
        self, windows: NDArray[np.int64], at: NDArray[np.int64], indices: bool
    ) -> tuple[NDArray[np.int64], ...]:
        members = np.empty_like(at)
        samples = np.empty_like(at)
        units = np.empty_like(at)
        rows = np.empty_like(at)
        index = np.empty_like(at) if indices else at
        if not len(at):
            return members, samples, units, rows, index
        groups = windows >> _WINDOW_BITS
        inner = windows & ((1 << _WINDOW_BITS) - 1)
        touched = np.unique(groups).tolist()
        for g in touched:
            chosen: slice | NDArray[np.bool_] = slice(None) if len(touched) == 1 else groups == g
            group = self._group(g)
            where = at[chosen] + group.starts[inner[chosen]]
            place = np.searchsorted(group.cum, where, side="right") - 1
            row = where - group.cum[place]
            members[chosen] = group.member[place]
            samples[chosen] = group.first[place] + row
            units[chosen] = group.unit[place]
            rows[chosen] = row
            if indices:
                index[chosen] = group.index[place] + row
        return members, samples, units, rows, index

    def _group_windows(
        self, g: int, local: NDArray[np.int64]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        group = self._group(g)
        w = np.searchsorted(group.starts, local, side="right") - 1
        at = local - group.starts[w]
        if self.shuffle:
            for one in np.unique(w).tolist():
                chosen = w == one
                at[chosen] = self._permutation(g, one, group)(at[chosen])
        return (np.int64(g) << _WINDOW_BITS) | w.astype(np.int64), at

    def _group(self, g: int) -> _Group:
        with self._lock:
            found = self._groups.get(g)
            if found is not None:
                self._groups.move_to_end(g)
                return found
        found = self._build(g)
        with self._lock:
            self._groups[g] = found
            self._groups.move_to_end(g)
            while len(self._groups) > GROUPS_HELD:
                self._groups.popitem(last=False)
            self.groups_built += 1
        return found

    def _build(self, g: int) -> _Group:
        if not 0 <= g < self.groups:
            raise IndexError(f"group {g} of an epoch of {self.groups} groups")
        pages = self.pages_of(g).tolist()
        parts = [page_units(self.snapshot, p) for p in pages]
        member = np.concatenate(
            [u.member + self.page_member_starts[p] for p, u in zip(pages, parts, strict=True)]
        )
        index = np.concatenate(
            [u.start + self.page_sample_starts[p] for p, u in zip(pages, parts, strict=True)]
        )
        size = np.concatenate([u.size for u in parts])
        filled = np.flatnonzero(size > 0).astype(np.int64)
        if self.shuffle:
            filled = filled[
                Permutation(len(filled), f"{self._key}:group:{g}:units")(
                    np.arange(len(filled), dtype=np.int64)
                )
            ]
        cum = np.concatenate(([0], np.cumsum(size[filled]))).astype(np.int64)
        expected = int(self.group_starts[g + 1] - self.group_starts[g])
        if int(cum[-1]) != expected:  # page_units checks each member; belt and braces
            raise ManifestError(
                f"the units of group {g}'s pages hold {int(cum[-1])} samples, where the "
                f"root says {expected}: a page is damaged"
            )
        cost = np.concatenate([u.cost for u in parts])[filled]
        return _Group(
            member[filled],
            np.concatenate([u.unit for u in parts])[filled],
            np.concatenate([u.first for u in parts])[filled],
            index[filled],
            cum,
            window_starts(cost, self.window, self.window_bytes),
        )

    def _permutation(self, g: int, w: int, group: _Group) -> Permutation:
        with self._lock:
            found = self._permutations.get((g, w))
            if found is not None:
                self._permutations.move_to_end((g, w))
                return found
        size = int(group.starts[w + 1] - group.starts[w])
        found = Permutation(size, f"{self._key}:group:{g}:window:{w}")
        with self._lock:
            self._permutations[g, w] = found
            while len(self._permutations) > 4:
                self._permutations.popitem(last=False)
        return found
