"""What every epoch's order is to its reader, whichever its version.

An epoch's order (:mod:`chunkd.client.datasets.order`) comes in two versions, one per
snapshot schema: :class:`~chunkd.client.datasets.order.Order` (version 1, over every
unit of a schema-1 snapshot) and :class:`~chunkd.client.datasets.paged_order.PagedOrder`
(version 2, from a paged snapshot's root). Both give the loader the same things, written
here once: the :class:`EpochOrder` protocol and its :class:`Located` answer, the window
bounds' defaults, the greedy cut of a units' order into windows (:func:`window_starts`),
and which version a snapshot's order is (:func:`order_version`).

This module needs numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, NamedTuple, Protocol

import numpy as np
from numpy.typing import NDArray

from chunkd.client.datasets.formats import DECODED_CACHE_BYTES

__all__ = [
    "DEFAULT_WINDOW",
    "DEFAULT_WINDOW_BYTES",
    "ORDER_VERSION",
    "EpochOrder",
    "Located",
    "order_version",
    "window_starts",
]

#: units whose samples are mixed together, by default (see :mod:`chunkd.client.datasets.order`)
DEFAULT_WINDOW: Final = 16
#: decoded bytes a window's units hold at most, by default: the formats' decode caches'
#: bound, so that a window's units fit them (see :mod:`chunkd.client.datasets.order`)
DEFAULT_WINDOW_BYTES: Final = DECODED_CACHE_BYTES
#: the order of a schema-2 (paged) snapshot; a schema-1 snapshot's is version 1
#: (:class:`~chunkd.client.datasets.order.Order`)
ORDER_VERSION: Final = 2


def order_version(snapshot: object) -> int:
    """The version of ``snapshot``'s order: 2 for a schema-2 (paged) snapshot
    (:class:`~chunkd.client.datasets.paged_order.PagedOrder`), 1 for a schema-1 one
    (:class:`~chunkd.client.datasets.order.Order`)."""
    return ORDER_VERSION if int(getattr(snapshot, "schema", 2)) >= 2 else 1


class Located(NamedTuple):
    """Where positions of an order are: each one's member, its sample in the member,
    its unit in the member (what the member's format decodes whole), its row in that
    unit, and its snapshot index."""

    members: NDArray[np.int64]
    samples: NDArray[np.int64]
    units: NDArray[np.int64]
    rows: NDArray[np.int64]
    indices: NDArray[np.int64]


class EpochOrder(Protocol):
    """What the loader reads of an epoch's order: :class:`~chunkd.client.datasets.order.Order`
    (version 1) and :class:`~chunkd.client.datasets.paged_order.PagedOrder` (version 2)
    both are one."""

    @property
    def version(self) -> int: ...

    @property
    def total(self) -> int: ...

    @property
    def shuffle(self) -> bool: ...

    @property
    def by_units(self) -> bool: ...

    def __len__(self) -> int: ...

    def locate(
        self, positions: NDArray[np.int64] | Sequence[int]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]: ...

    def located(self, positions: NDArray[np.int64] | Sequence[int]) -> Located: ...

    def locate_windows(
        self, positions: NDArray[np.int64] | Sequence[int]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]: ...

    def window_keys(self, window: int) -> list[tuple[int, int]]: ...

    def rows_at(
        self, windows: NDArray[np.int64], at: NDArray[np.int64]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]: ...

    def indices(self, positions: NDArray[np.int64] | Sequence[int]) -> NDArray[np.int64]: ...


def window_starts(
    costs: NDArray[np.int64], window: int | None, window_bytes: int | None
) -> NDArray[np.int64]:
    """Where each window starts in a units' order whose units decode to ``costs`` bytes:
    greedily, each window the longest run from where the last ended of at most
    ``window`` units and ``window_bytes`` bytes (None: no such bound), and at least one
    unit (a unit of more than ``window_bytes`` is a window alone). O(units)."""
    n = len(costs)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if window_bytes is None:
        return np.arange(0, n, n if window is None else window, dtype=np.int64)
    here = np.arange(n, dtype=np.int64)
    ends = np.full(n, n, dtype=np.int64) if window is None else np.minimum(here + window, n)
    cum = np.concatenate(([0], np.cumsum(costs))).astype(np.int64)
    # where the longest run from each unit of at most window_bytes ends (one unit at least)
    fits = np.searchsorted(cum, cum[:-1] + window_bytes, side="right") - 1
    ends = np.minimum(ends, np.maximum(fits, here + 1))
    following = ends.tolist()
    firsts: list[int] = []
    at = 0
    while at < n:
        firsts.append(at)
        at = following[at]
    return np.asarray(firsts, dtype=np.int64)
