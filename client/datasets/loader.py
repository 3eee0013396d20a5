"""The loader core: steps after a cursor, their split over ranks and workers, the
epoch's tail, cache-aware reading, and the plain Python :class:`Loader`.

One implementation; the torch (:mod:`chunkd.client.torch`) and Grain
(:mod:`chunkd.client.grain`) adapters are thin layers over it. It needs numpy only.

Steps
    An iteration starts at a state's ``cursor`` (:mod:`~chunkd.client.datasets.state`),
    a place in the epoch's order (:mod:`~chunkd.client.datasets.order`) of ``N``
    samples. With ``W`` ranks of batch size ``B``, a step takes ``G = W * B``
    positions: global step ``s`` (counted from the cursor) takes positions
    ``[cursor + s*G, cursor + (s+1)*G)``.

Ranks: contiguous slices
    Rank ``r`` takes the contiguous slice ``[base + r*B, base + (r+1)*B)`` of its
    step (``base = cursor + s*G``), so the ranks of a step read neighbouring positions
    of the order, from the same window of units (row groups, for Parquet; a window
    holds at most ``window`` units and ``window_bytes`` of their decoded bytes, so it
    fits the formats' decode caches). A short
    last step (``tail = "uneven"``, ``n < G`` positions) is split as evenly as
    contiguous slices go: with ``q, m = divmod(n, W)``, rank ``r`` takes ``q + (r <
    m)`` positions starting at ``base + r*q + min(r, m)``; a rank may get none (when
    ``n < W``).

Workers: whole steps in turn
    The ``K`` workers of a rank take turns by whole steps: worker ``k`` produces the
    rank's batches of steps ``k, k+K, k+2K, ...`` of the iteration. A DataLoader
    that takes a batch from each worker in turn (torch's, ``in_order=True``) therefore
    yields the rank's batches in step order, whatever ``K`` is.

The epoch's tail (``tail``), explicit
    ``"uneven"`` (the default): the last step is short when ``G`` does not divide
    what is left: each rank gets its even share (above), possibly none; a rank with
    none has one batch fewer in the epoch, the shape DDP's ``join`` handles. Every
    sample is read once. A rank's batch says whether it is its step's last
    (:attr:`Batch.last`), and it is short (``len(samples) < B``).
    ``"pad"``: the last step is filled to ``G`` positions with positions of the
    epoch's start again (``N, N+1, ...`` read positions ``0, 1, ...``, wrapping), so
    every rank gets ``B``; those are **padding**, always at the end of a rank's batch,
    and :attr:`Batch.padding` counts them (their ids are the repeated samples' ids).
    ``"drop"``: the last step is left out when it is short; its samples are not read.

Resuming, exactly and elastically
    After ``S`` steps of an iteration that started at cursor ``c``, the trainer has
    consumed positions ``[c, min(N, c + S*G))`` and nothing else, whatever the ranks,
    workers and batch size were, and at any step boundary the consumed positions
    are a prefix of the epoch's order. So the state at a step boundary is that
    cursor (:meth:`Steps.cursor_after`; ``N`` once every step is passed, the drop
    policy's dropped tail included), and an iteration resumed from it at any ``W``,
    ``K`` and ``B`` reads every position after it exactly once: nothing repeated,
    nothing skipped, nothing re-read to get there (resuming computes positions; it
    costs O(1)).

Cache-aware reading
    A reader knows its next positions: before it reads a step, it asks the daemon to
    load what its next ``prefetch`` steps (of its own) need (:func:`warm`: the byte
    ranges the members' formats name, :meth:`Dataset.ranges
    <chunkd.client.datasets.Dataset.ranges>`), so their reads hit the cache. An
    iteration, resumed or not, warms its first ``prefetch + 1`` steps before it reads
    the first one.

What did step N see?
    :func:`step_sample_ids` answers it from a state (or from the snapshot, seed and
    epoch of a run that never resized, as a state with cursor 0) and the geometry: a
    pure function of them, no reading.

It is one job at ~1,250 lines: a snapshot and a cursor become one rank's batches
(:class:`Loader`, :class:`Batch`); the order, the shared decoder, the columns and the
state are modules of their own below it, the pinning of a batch is
:mod:`chunkd.client.datasets.pinning`, and the loader's settings and reading speed
are the loader-speed work's.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final, Literal, NamedTuple, Protocol, TypedDict, Unpack

import numpy as np
from numpy.typing import NDArray

from chunkd.client.datasets.columns import (
    DECODE_THREADS,
    Rows,
    Units,
    Window,
    Windows,
    take,
    take_laid,
)
from chunkd.client.datasets.formats import (
    DECODED_CACHE_BYTES,
    snapshot_unit_bytes,
    snapshot_units,
)
from chunkd.client.datasets.order import (
    DEFAULT_WINDOW,
    DEFAULT_WINDOW_BYTES,
    ORDER_VERSION,
    EpochOrder,
    Order,
    PagedOrder,
    order_version,
)
from chunkd.client.datasets.shared import SharedDecoder
from chunkd.client.datasets.state import DEFAULT_ORDER, LoaderState
from chunkd.client.jobs import FOR_DATASET
from chunkd.client.protocol import MAX_SECONDS
from chunkd.client.stalls import (
    MIN_WINDOW,
    REPORT_WINDOW,
    StallMeter,
    in_grain_worker,
    in_loader_worker,
    job_of,
    measured_outside,
)
from chunkd.errors import ChunkdError

if TYPE_CHECKING:
    from chunkd.client.core import Client
    from chunkd.snapshot import Snapshot

__all__ = [
    "DEFAULT_PREFETCH",
    "TAILS",
    "Batch",
    "Loader",
    "ReadOptions",
    "ReadSettings",
    "Share",
    "StepIds",
    "Steps",
    "Tail",
    "read_steps",
    "step_positions",
    "step_sample_ids",
    "warm",
]

log = logging.getLogger(__name__)

#: how the epoch's last, incomplete step is dealt (see the module docstring)
Tail = Literal["uneven", "pad", "drop"]
TAILS: Final = ("uneven", "pad", "drop")
#: steps a reader warms ahead of the one it reads, by default
DEFAULT_PREFETCH: Final = 2
#: the most steps a reader warms ahead
MAX_PREFETCH: Final = 16


class Readable(Protocol):
    """What the core reads from: a :class:`~chunkd.client.datasets.Dataset`."""

    @property
    def snapshot(self) -> Snapshot: ...

    @property
    def metadata_seconds(self) -> float: ...

    def read(self, member: int, sample: int) -> Any: ...

    def fetch(self, pairs: Iterable[tuple[int, int]]) -> int: ...

    def ranges(self, pairs: Iterable[tuple[int, int]]) -> list[tuple[str, int, int]]: ...

    def sample_id(self, member: int, sample: int) -> str: ...


# -- steps -------------------------------------------------------------------------------


class Share(NamedTuple):
    """A rank's slice of a step: positions ``start .. stop``, the last ``padding`` of
    them past the epoch's end (padding, ``tail="pad"`` only)."""

    start: int
    stop: int
    padding: int


@dataclass(frozen=True, slots=True)
class Steps:
    """The steps of an iteration from ``cursor`` (see the module docstring).

    Args:
        total: the epoch's samples (``N``).
        cursor: where the iteration starts (``0 <= cursor <= total``).
        batch_size: ``B``, per rank.
        world_size: ``W``.
        tail: ``"uneven"``, ``"pad"`` or ``"drop"``.

    Raises:
        ValueError: an argument out of its range.
    """

    total: int
    cursor: int
    batch_size: int
    world_size: int
    tail: Tail = "uneven"

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.world_size < 1:
            raise ValueError(
                f"batch_size and world_size are >= 1; got {self.batch_size}, {self.world_size}"
            )
        if not 0 <= self.cursor <= self.total:
            raise ValueError(f"cursor {self.cursor} outside an epoch of {self.total} samples")
        if self.tail not in TAILS:
            raise ValueError(f"tail is one of {', '.join(TAILS)}; got {self.tail!r}")

    @property
    def size(self) -> int:
        """Positions per (full) step: ``G = world_size * batch_size``."""
        return self.world_size * self.batch_size

    def __len__(self) -> int:
        left = self.total - self.cursor
        if self.tail == "drop" or left == 0:
            return left // self.size
        return -(-left // self.size)

    def span(self, step: int) -> tuple[int, int]:
        """Global step ``step``'s positions ``start .. stop`` (``stop`` past the epoch's
        end by the padding of a ``"pad"`` tail)."""
        self._check(step)
        start = self.cursor + step * self.size
        stop = start + self.size
        return start, stop if self.tail == "pad" else min(stop, self.total)

    def share(self, step: int, rank: int) -> Share:
        """Rank ``rank``'s slice of global step ``step``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        start, stop = self.span(step)
        q, m = divmod(stop - start, self.world_size)
        first = start + rank * q + min(rank, m)
        last = first + q + (rank < m)
        return Share(first, last, max(0, last - max(first, self.total)))

    def positions(self, step: int, rank: int) -> tuple[NDArray[np.int64], int]:
        """The order positions rank ``rank`` reads at step ``step``, and how many of
        them (at the end) are padding (read from the epoch's start again)."""
        start, stop, padding = self.share(step, rank)
        positions = np.arange(start, stop, dtype=np.int64)
        if padding:  # positions N, N+1, ... read 0, 1, ... again (wrapping)
            positions %= self.total
        return positions, padding

    def cursor_after(self, steps: int) -> int:
        """The cursor once the first ``steps`` steps are consumed (``total`` once all
        are: the epoch is done, a dropped tail included)."""
        if steps >= len(self):
            return self.total
        return self.cursor + max(0, steps) * self.size

    def is_last(self, step: int) -> bool:
        """Whether ``step`` is the iteration's last."""
        return step == len(self) - 1

    def _check(self, step: int) -> None:
        if not 0 <= step < len(self):
            raise IndexError(f"step {step} of an iteration of {len(self)} steps")


def step_positions(
    step: int,
    *,
    rank: int,
    batch_size: int,
    world_size: int,
    total: int,
    cursor: int = 0,
    tail: Tail = "uneven",
) -> tuple[NDArray[np.int64], int]:
    """The order positions rank ``rank`` reads at step ``step`` after ``cursor``, and how
    many of them are padding: :meth:`Steps.positions`, as one call."""
    return Steps(total, cursor, batch_size, world_size, tail).positions(step, rank)


# -- reading -----------------------------------------------------------------------------


class Batch:
    """One rank's batch of one step.

    Attributes:
        columns: the batch's columns, ``{name: array}``, taken straight from the decoded
            units (:func:`~chunkd.client.datasets.columns.arrays`: numpy arrays, read-only
            views where the type allows; Arrow arrays for strings, lists, nested types
            and columns with nulls); a ``batch_transform``'s result where one is set.
        samples: the samples, in order: a list of per-sample values (``Dataset[i]``'s),
            built on first use; a ``transform`` applies to each; an adapter's collate
            may replace the list (the torch adapter's default: tensors of the columns).
        ids: their ids, ``KEY#i`` (:meth:`Dataset.sample_id`), stable whatever the order.
        table: the batch's rows as one ``pyarrow.Table`` (None where the batch was not
            read by columns, or mixes formats).
        step: the step, counted from the cursor the iteration started at.
        position: where the step starts in the epoch's order.
        padding: how many of the last samples are padding (``tail="pad"``): repeats
            of the epoch's first samples, to be masked out of the loss.
        last: this is the epoch's last step (short under ``tail="uneven"``).
    """

    __slots__ = (
        "_columns",
        "_convert",
        "_ids",
        "_names",
        "_rows",
        "_samples",
        "last",
        "padding",
        "position",
        "step",
    )

    def __init__(
        self,
        samples: Any = None,
        ids: list[str] | None = None,
        step: int = 0,
        position: int = 0,
        padding: int = 0,
        last: bool = False,
        *,
        columns: Any = None,
        rows: Rows | None = None,
        names: Callable[[], list[str]] | None = None,
        convert: Callable[[Any], Any] | None = None,
    ) -> None:
        self._samples = samples
        self._ids = ids
        self._columns = columns
        self._rows = rows
        self._names = names
        self._convert = convert
        self.step = step
        self.position = position
        self.padding = padding
        self.last = last

    @property
    def samples(self) -> Any:
        if self._samples is None:
            if self._rows is None:
                return []
            found = self._rows.samples
            if self._convert is not None:
                found = [self._convert(sample) for sample in found]
            self._samples = found
        return self._samples

    @property
    def columns(self) -> Any:
        if self._columns is None:
            if self._rows is None:
                raise ValueError(
                    "this batch was read sample by sample: it has no columns (read it "
                    "through a chunkd Dataset)"
                )
            self._columns = self._rows.columns
        return self._columns

    @property
    def ids(self) -> list[str]:
        if self._ids is None:
            self._ids = self._names() if self._names is not None else []
        return self._ids

    @property
    def table(self) -> Any:
        return None if self._rows is None else self._rows.table

    @property
    def rows(self) -> Rows | None:
        """The decoded rows the batch was taken as (None where it was read by sample)."""
        return self._rows

    def __len__(self) -> int:
        if self._rows is not None:
            return len(self._rows)
        return len(self.ids)

    def __repr__(self) -> str:
        return (
            f"<chunkd Batch step {self.step} at {self.position}: {len(self)} samples"
            f"{f', {self.padding} padding' if self.padding else ''}{', last' if self.last else ''}>"
        )

    def _replace(self, **changes: Any) -> Batch:
        """A copy with ``changes`` (``samples``, ``columns``, ``ids``, ``step``, ...)."""
        fields = {
            "samples": self._samples,
            "ids": self._ids,
            "step": self.step,
            "position": self.position,
            "padding": self.padding,
            "last": self.last,
            "columns": self._columns,
            "rows": self._rows,
            "names": self._names,
            "convert": self._convert,
        }
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"a Batch has no field {', '.join(sorted(unknown))}")
        fields.update(changes)
        return Batch(**fields)

    def pin_memory(self) -> Batch:
        """The batch with its tensors in pinned (page-locked) memory, for
        ``tensor.to(device, non_blocking=True)``: what torch's ``DataLoader(pin_memory=True)``
        calls. Needs torch; without an accelerator, the batch as it is."""
        from chunkd.client.datasets.pinning import pinned_values

        has_columns = self.rows is not None or self._columns is not None
        changes = pinned_values(self.samples, self.columns if has_columns else None)
        return self if changes is None else self._replace(**changes)

    def __reduce__(self) -> tuple[Any, ...]:
        # Sent from a DataLoader or Grain worker: what was built goes as it is; the rows
        # go where the samples were not built yet (then the receiver builds them).
        built = self._samples is not None
        return (
            _rebuilt,
            (
                self._samples,
                self.ids,
                self.step,
                self.position,
                self.padding,
                self.last,
                self._columns,
                None if built else self._rows,
                None if built else self._convert,
            ),
        )


def _rebuilt(
    samples: Any,
    ids: list[str],
    step: int,
    position: int,
    padding: int,
    last: bool,
    columns: Any,
    rows: Rows | None,
    convert: Callable[[Any], Any] | None,
) -> Batch:
    return Batch(
        samples, ids, step, position, padding, last, columns=columns, rows=rows, convert=convert
    )


def warm(
    client: Client | None, ranges: Sequence[tuple[str, int, int]], dataset: str | None = None
) -> int:
    """Ask ``client``'s daemon to load byte ranges into its cache, in the background
    (``Client.prefetch_ranges``: only the chunks the ranges lie in), for ``dataset``
    (its name: the daemon accounts the cost to it). A hint: a daemon that refuses it
    costs the reader nothing but the cache hit (logged at debug level).

    Returns:
        How many loads the daemon started (0 without a client).
    """
    if client is None or not ranges:
        return 0
    # rows of one Parquet row group, lines of one zstd frame: one range, asked once
    ranges = list(dict.fromkeys(ranges))
    token = FOR_DATASET.set(dataset)
    try:
        return int(client.prefetch_ranges(ranges))
    except ChunkdError as exc:
        log.debug("prefetch of %d ranges refused: %s", len(ranges), exc)
        return 0
    finally:
        FOR_DATASET.reset(token)


def read_steps(
    dataset: Readable,
    order: EpochOrder,
    steps: Steps,
    *,
    rank: int,
    first: int = 0,
    every: int = 1,
    prefetch: int = DEFAULT_PREFETCH,
    client: Client | None = None,
    convert: Callable[[Any], Any] | None = None,
    timings: dict[str, float] | None = None,
    units: Units | None = None,
    batch_transform: Callable[[dict[str, Any]], Any] | None = None,
    train_job: str | None = None,
    started: float | None = None,
) -> Iterator[Batch]:
    """Rank ``rank``'s batches of steps ``first, first + every, ...`` of ``steps``.

    What a worker ``k`` of ``K`` runs with ``first=k, every=K``; the plain
    :class:`Loader` with ``first=0, every=1``. A step whose share for the rank is
    empty (the last, under ``tail="uneven"``) yields nothing. Before it reads a
    step, it warms the next ``prefetch`` steps of its own (the first ``prefetch + 1``
    before the first read) through ``client`` (:func:`warm`).

    With ``units`` (:class:`~chunkd.client.datasets.columns.Units`), a batch is taken by
    columns from decoded units, and the units of this step and of the next
    ``prefetch`` are asked for ahead; ``batch_transform`` then makes the batch's
    ``columns`` of them. Without, each sample is read by itself (``dataset.read``).
    ``convert`` is applied to each sample (lazily, with ``units``).

    The time to its first batch is measured by phase (:class:`FirstBatch`), reported to
    the daemon's metrics through ``client`` with ``rank`` and ``train_job`` (None: the
    client's), and written into ``timings`` if given; ``started``: when the trainer
    began the iteration (``time.monotonic()``), which a worker's ``worker_start`` runs
    from.
    """
    count = len(steps)
    own = range(first, count, max(1, every))
    warmed = 0
    warmed_units: set[tuple[int, int]] = set()  # a unit serves many steps: warmed once
    timer: FirstBatch | None = FirstBatch(dataset, rank=rank, train_job=train_job, started=started)
    plans: dict[int, _Plan] = {}  # the located positions of the steps asked for ahead
    laid = None if units is None else Windows(units, order)
    name = getattr(getattr(dataset, "source", None), "dataset", None)
    name = name if isinstance(name, str) else None  # the dataset the warming is for
    for i, step in enumerate(own):
        if units is not None and laid is not None:
            for ahead in own[i : i + prefetch + 1]:
                if ahead not in plans:
                    plans[ahead] = _Plan(units, order, laid, steps.positions(ahead, rank)[0])
        if prefetch and client is not None:
            upto = min(len(own), i + prefetch + 1)
            if warmed < upto:
                if units is not None:  # the steps' units' ranges, each once
                    keys = [
                        k for s in own[warmed:upto] for k in plans[s].needs if k not in warmed_units
                    ]
                    if keys:  # a request only for units not warmed before: most steps none
                        warm(client, units.ranges(keys), name)
                        warmed_units.update(keys)
                        if len(warmed_units) > 1 << 16:  # long past: forgotten
                            warmed_units = set(keys)
                else:
                    pairs = [p for s in own[warmed:upto] for p in _pairs(order, steps, s, rank)]
                    warm(client, dataset.ranges(pairs), name)
                warmed = upto
        positions, padding = steps.positions(step, rank)
        if not len(positions):
            plans.pop(step, None)
            continue
        span = steps.span(step)[0]
        if units is not None:
            plan = plans.pop(step)
            units.ahead(
                plan.needs + [k for s in own[i + 1 : i + prefetch + 1] for k in plans[s].needs]
            )
            if timer is not None:
                timer.first_unit(units, plan.needs[0])
            rows = plan.take()
            batch = Batch(
                step=step,
                position=span,
                padding=padding,
                last=step == count - 1,
                rows=rows,
                names=functools.partial(_plan_ids, dataset, plan),
                convert=convert,
            )
            if batch_transform is not None:
                batch = batch._replace(columns=batch_transform(rows.columns))
        else:
            members, samples = order.locate(positions)
            pairs = list(zip(members.tolist(), samples.tolist(), strict=True))
            if timer is not None:
                timer.fetched(pairs[:1])
            read = [dataset.read(m, s) for m, s in pairs]
            if convert is not None:
                read = [convert(sample) for sample in read]
            batch = Batch(
                read,
                [dataset.sample_id(m, s) for m, s in pairs],
                step,
                span,
                padding,
                step == count - 1,
            )
        if timer is not None:
            timer.done(client, timings)
            timer = None
        yield batch


def _ids(dataset: Readable, members: NDArray[np.int64], samples: NDArray[np.int64]) -> list[str]:
    return [
        dataset.sample_id(m, s) for m, s in zip(members.tolist(), samples.tolist(), strict=True)
    ]


class _Plan:
    """A step's positions, located as far as its reading needs: where the order's units
    are the formats' (as :func:`order_of` makes it), its window and places in it, and a
    step of one laid-out window (:class:`~chunkd.client.datasets.columns.Window`) needs
    nothing more to be taken; ``(member, sample)`` and ``(unit, row)`` of each position
    are made when first asked for (other columns, the ids)."""

    __slots__ = (
        "_keys",
        "_located",
        "_window",
        "at",
        "laid",
        "order",
        "positions",
        "units",
        "windows",
    )

    def __init__(
        self, units: Units, order: EpochOrder, laid: Windows, positions: NDArray[np.int64]
    ) -> None:
        self.units = units
        self.order = order
        self.laid = laid
        self.positions = positions
        self.windows: NDArray[np.int64] | None = None
        self.at: NDArray[np.int64] | None = None
        if order.by_units and len(positions):
            self.windows, self.at = order.locate_windows(positions)
        self._located: tuple[NDArray[np.int64], ...] | None = None
        self._keys: list[tuple[int, int]] | None = None
        self._window: Window | bool | None = False  # False: not looked up yet

    @property
    def located(self) -> tuple[NDArray[np.int64], ...]:
        """``(members, samples, units, rows)``: each position's member and sample, and its
        unit (in its member) and row."""
        if self._located is None:
            order = self.order
            if self.windows is not None and self.at is not None:
                # the order's units are the formats' (order_of)
                self._located = order.rows_at(self.windows, self.at)
            else:
                members, samples = order.locate(self.positions)
                unit_of, row = self.units.locate(members, samples)
                self._located = (members, samples, unit_of, row)
        return self._located

    @property
    def window(self) -> Window | None:
        """The one laid-out window all the step's positions are of, if any."""
        if self._window is False:
            found = None
            # an unshuffled step is a run of one unit or two: taken as it is (a slice)
            if self.order.shuffle and self.windows is not None and len(self.windows):
                first = int(self.windows[0])
                if bool(np.all(self.windows == first)):
                    found = self.laid.window(first)
            self._window = found
        return self._window if isinstance(self._window, Window) else None

    @property
    def needs(self) -> list[tuple[int, int]]:
        """The units the step needs, in the order of need, each once: a laid-out
        window's (all of them: it is laid out whole), else the step's own."""
        if self._keys is None:
            window = self.window
            if window is not None:
                self._keys = window.keys
            else:
                members, _, unit_of, _ = self.located
                codes = (members << 32) | unit_of
                _, first = np.unique(codes, return_index=True)
                self._keys = [(int(c >> 32), int(c & 0xFFFFFFFF)) for c in codes[np.sort(first)]]
        return self._keys

    def take(self) -> Rows:
        """The step's rows (:func:`~chunkd.client.datasets.columns.take`)."""
        window = self.window
        if window is not None and self.at is not None:
            rows = take_laid(window, self.at)
            if rows is not None:
                return rows
        members, samples, unit_of, row = self.located
        laid = None if window is None or self.at is None else (window, self.at)
        return take(self.units, members, samples, (unit_of, row), laid)


def _plan_ids(dataset: Readable, plan: _Plan) -> list[str]:
    members, samples, _, _ = plan.located
    return _ids(dataset, members, samples)


#: the worker process whose start was reported (its first iteration's ``worker_start``)
_WORKER_STARTED: int | None = None


class FirstBatch:
    """How long a reader took to its first batch, by phase.

    ``metadata``: resolving the snapshot (:attr:`Dataset.metadata_seconds
    <chunkd.client.datasets.Dataset.metadata_seconds>`: the ``ds_resolve``, or the scan
    of a snapshot built in memory); ``worker_start``: in a worker process (a torch
    DataLoader's, by ``torch.utils.data.get_worker_info()``, or Grain's ``mp_prefetch``
    one, by Grain's own test; never a trainer started by ``mp.spawn``, a
    ``multiprocessing.Process`` or a pool, which has a parent process but is no
    worker), from the process's start to its first read, on the process's first
    iteration only (a persistent worker's later epochs leave it out);
    ``first_chunk``: from the reader's start (the prefetch of its first steps included) to the first
    sample's bytes in hand; ``decode``: the rest of the first batch, read and decoded;
    ``total``: all of them. The daemon keeps them as the histogram
    ``chunkd_dataset_first_batch_seconds{phase}`` (``ds_first_batch``), so a real job's
    breakdown is seen as the bench's is, and per job (the slowest ``rank``'s, in the
    jobs view) for ``train_job`` (None: the client's). ``started``: when the trainer
    began the iteration (``time.monotonic()``, one clock for every process of the
    host; :func:`chunkd.client.torch.measured` passes it): a worker's ``worker_start``
    then runs from it, else from the worker process's start.
    """

    def __init__(
        self,
        dataset: Readable,
        *,
        rank: int | None = None,
        train_job: str | None = None,
        started: float | None = None,
    ) -> None:
        self.dataset = dataset
        self.rank = rank
        self.train_job = train_job
        self.started = time.perf_counter()
        self.worker_start: float | None = None
        global _WORKER_STARTED
        if (in_loader_worker() or in_grain_worker()) and os.getpid() != _WORKER_STARTED:
            # A worker by the loaders' own tests, never by "has a parent process": a
            # trainer started by mp.spawn, a Pool or Ray has one, and its age (the
            # model's setup) is no worker's start. A worker's start is its first
            # iteration's: a persistent worker's later epochs leave the phase out.
            _WORKER_STARTED = os.getpid()
            self.worker_start = (
                _process_age() if started is None else max(0.0, time.monotonic() - started)
            )
        self.first_chunk = 0.0

    def first_unit(self, units: Units, key: tuple[int, int]) -> None:
        """Get the first sample's unit (decoded: its bytes in hand), and note when."""
        units.get(key)
        self.first_chunk = time.perf_counter() - self.started

    def fetched(self, pairs: list[tuple[int, int]]) -> None:
        """Read the first sample's bytes (into the client's cache), and note when."""
        self.dataset.fetch(pairs)
        self.first_chunk = time.perf_counter() - self.started

    def done(self, client: Client | None, timings: dict[str, float] | None) -> None:
        """The first batch is read: report the phases."""
        decode = time.perf_counter() - self.started - self.first_chunk
        phases = {
            "metadata": float(self.dataset.metadata_seconds),
            "first_chunk": self.first_chunk,
            "decode": decode,
        }
        if self.worker_start is not None:
            phases["worker_start"] = self.worker_start
        phases["total"] = sum(phases.values())
        if timings is not None:
            timings.update(phases)
        if client is None:
            return
        fields: dict[str, Any] = {**phases, "rank": self.rank, "train_job": self.train_job}
        try:
            client.request("ds_first_batch", fields).close()
        except ChunkdError as exc:  # a hint: an older daemon, or one going away
            log.debug("the first batch's timings were not taken: %s", exc)


def _process_age() -> float | None:
    """Seconds since this process started (Linux; None where that cannot be read)."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime", "rb") as uptime:
            now = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, now - started)


def _pairs(order: EpochOrder, steps: Steps, step: int, rank: int) -> list[tuple[int, int]]:
    positions, _ = steps.positions(step, rank)
    if not len(positions):
        return []
    members, samples = order.locate(positions)
    return list(zip(members.tolist(), samples.tolist(), strict=True))


# -- the plain Python loader -------------------------------------------------------------


class ReadSettings:
    """How a rank reads a snapshot: the one value :class:`Loader`, the torch
    ``SnapshotDataset`` and the Grain ``ChunkdIterDataset`` take (``settings=``); each
    also takes these as keyword arguments, which override a ``settings`` given with them.

    Args:
        batch_size: ``B``, this rank's batch size.
        seed: the run's seed, the same on every rank.
        rank: this rank, ``0 <= rank < world_size``.
        world_size: ``W``.
        shuffle: shuffle (else members in order, samples as stored).
        window: the most units whose samples are mixed together (None: no bound; a
            unit is what the format decodes whole: a Parquet row group, a run of lines,
            records or tar samples).
        window_bytes: the most decoded bytes of a window's units (None: no bound;
            default: :data:`~chunkd.client.datasets.formats.DECODED_CACHE_BYTES`).
        tail: ``"uneven"``, ``"pad"`` or ``"drop"``.
        prefetch: steps warmed and decoded ahead of the one read (0: none).
        columns: the columns read and decoded (None: all); the batch's ``columns`` and
            samples hold only these.
        decode_ahead: the most decoded bytes of units a reader holds, the ones decoded
            ahead included (0: none ahead; a batch's own units are always held).
        shared_decode: have the node's daemon decode each unit once for every reader
            of the node (where it can; else the reader decodes it).

    Raises:
        ValueError: a setting out of its range (:func:`check_settings`), or columns
            that are not distinct names.
    """

    __slots__ = (
        "batch_size",
        "columns",
        "decode_ahead",
        "prefetch",
        "rank",
        "seed",
        "shared_decode",
        "shuffle",
        "tail",
        "window",
        "window_bytes",
        "world_size",
    )

    def __init__(
        self,
        batch_size: int,
        seed: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        window: int | None = DEFAULT_WINDOW,
        window_bytes: int | None = DEFAULT_WINDOW_BYTES,
        tail: Tail = "uneven",
        prefetch: int = DEFAULT_PREFETCH,
        columns: Sequence[str] | None = None,
        decode_ahead: int = DECODED_CACHE_BYTES,
        shared_decode: bool = True,
    ) -> None:
        check_settings(
            rank=rank,
            world_size=world_size,
            batch_size=batch_size,
            seed=seed,
            window=window,
            window_bytes=window_bytes,
            tail=tail,
            prefetch=prefetch,
        )
        if columns is not None:
            if isinstance(columns, str | bytes) or not all(isinstance(c, str) for c in columns):
                raise ValueError(f"columns is a list of column names, or None; got {columns!r}")
            if not columns or len(set(columns)) != len(columns):
                raise ValueError(f"columns names at least one column, each once; got {columns!r}")
        if not isinstance(decode_ahead, int) or not 0 <= decode_ahead < 1 << 63:
            raise ValueError(f"decode_ahead is a number of bytes >= 0; got {decode_ahead!r}")
        self.batch_size = batch_size
        self.seed = int(seed)
        self.rank = rank
        self.world_size = world_size
        self.shuffle = bool(shuffle)
        self.window = window
        self.window_bytes = window_bytes
        self.tail: Tail = tail
        self.prefetch = prefetch
        self.columns: tuple[str, ...] | None = None if columns is None else tuple(columns)
        self.decode_ahead = decode_ahead
        self.shared_decode = bool(shared_decode)

    def replace(self, **changes: Any) -> ReadSettings:
        """A copy with ``changes``, checked."""
        fields = {name: getattr(self, name) for name in self.__slots__}
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"ReadSettings has no setting {', '.join(sorted(unknown))}")
        fields.update(changes)
        return ReadSettings(**fields)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ReadSettings):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in self.__slots__)

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, n) for n in self.__slots__))

    def __repr__(self) -> str:
        shown = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__)
        return f"ReadSettings({shown})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_settings, ({n: getattr(self, n) for n in self.__slots__},))

    @classmethod
    def merged(cls, settings: ReadSettings | None, given: ReadOptions) -> ReadSettings:
        """``settings`` with the ``given`` keyword arguments over it; without
        ``settings``, ``batch_size`` and ``seed`` must be given.

        Raises:
            TypeError: neither ``settings`` nor both of ``batch_size`` and ``seed``, or
                a keyword that is not a setting.
            ValueError: a setting out of its range.
        """
        chosen: dict[str, Any] = dict(given)
        if settings is not None:
            return settings.replace(**chosen) if chosen else settings
        if "batch_size" not in chosen or "seed" not in chosen:
            raise TypeError("give batch_size and seed, or settings=ReadSettings(...)")
        batch_size, seed = chosen.pop("batch_size"), chosen.pop("seed")
        return cls(batch_size, seed, **chosen)

    def state(
        self, snapshot: str, epoch: int = 0, cursor: int = 0, *, order: int = DEFAULT_ORDER
    ) -> LoaderState:
        """The loader state at ``cursor`` of ``epoch`` of this order (``order``: the
        snapshot's order version, :func:`~chunkd.client.datasets.order.order_version`)."""
        return LoaderState(
            snapshot,
            self.seed,
            epoch,
            cursor,
            shuffle=self.shuffle,
            window=self.window,
            window_bytes=self.window_bytes,
            order=order,
        )


def _settings(fields: dict[str, Any]) -> ReadSettings:
    return ReadSettings(**fields)


class ReadOptions(TypedDict, total=False):
    """:class:`ReadSettings`' settings as keyword arguments (what the adapters take
    with ``**options``)."""

    batch_size: int
    seed: int
    rank: int
    world_size: int
    shuffle: bool
    window: int | None
    window_bytes: int | None
    tail: Tail
    prefetch: int
    columns: Sequence[str] | None
    decode_ahead: int
    shared_decode: bool


def open_units(dataset: Readable, settings: ReadSettings) -> Units | None:
    """The decoded units a reader of ``dataset`` takes its batches from (None: a
    dataset that is not a chunkd :class:`~chunkd.client.datasets.Dataset`, read by
    sample)."""
    source = getattr(dataset, "source", None)
    if source is None:
        return None
    client = client_of(dataset)
    shared = SharedDecoder(client) if settings.shared_decode and client is not None else None
    return Units(
        dataset.snapshot,
        source,
        columns=settings.columns,
        shared=shared,
        held_bytes=settings.decode_ahead,
        threads=DECODE_THREADS if settings.decode_ahead and settings.prefetch else 0,
    )


class Loader:
    """One rank's batches of a dataset, in chunkd's order, resumable anywhere.

    Iterating yields :class:`Batch` es of steps from the current cursor on (see the
    module docstring for steps, ranks and the tail): by columns
    (:attr:`Batch.columns`), with the per-sample list built when asked for
    (:attr:`Batch.samples`). :meth:`state` is the
    ``chunkd.loader/4`` state after the last batch yielded (a step boundary);
    :meth:`restore` makes the next iteration start at a state's cursor, whatever
    the ranks, batch size or workers that saved it.

    Epochs: :meth:`set_epoch` before each epoch; setting the epoch a restored state
    is of keeps its cursor, another epoch starts at 0. An iteration runs to the
    epoch's end; iterating a finished epoch again yields nothing until the epoch is
    set anew.

    Args:
        dataset: the dataset (:class:`~chunkd.client.datasets.Dataset`).
        settings: the reading's settings (:class:`ReadSettings`); or each as a keyword
            argument below (``batch_size`` and ``seed`` are then needed).
        epoch: the first epoch.
        client: whose daemon warms the next steps' bytes (default: the dataset
            source's client).
        transform: applied to each sample (of :attr:`Batch.samples`).
        batch_transform: makes a batch's :attr:`~Batch.columns` of its columns (the
            fast way to transform: whole columns at once).
        options: the settings as keyword arguments (:class:`ReadOptions`:
            ``batch_size``, ``seed``, ``rank``, ``world_size``, ``shuffle``,
            ``window``, ``window_bytes``, ``tail``, ``prefetch``, ``columns``,
            ``decode_ahead``, ``shared_decode``), over ``settings``.
        measure: time the trainer's waits for each batch and report them to the
            daemon (:attr:`meter`, a :class:`~chunkd.client.StallMeter` made here and
            kept for all epochs: one ``loader_report`` per window of ``stall_window``
            seconds and one at each iteration's end; the rank's end at the process's
            exit or ``loader.meter.close()``, which may be called before any
            iteration). Never in a torch DataLoader's worker, where the trainer is
            not, nor inside another meter's iteration (torch's ``measured``,
            ``StallMeter.wrap``), which measures the same steps: there the meter
            stays unused. False: :attr:`meter` is None.
        train_job: the job the waits and the first batch's timings are accounted to;
            None: the client's (``Client(train_job=)``), else
            :func:`~chunkd.client.job_name`'s (the environment's).
        stall_window: seconds between two of the meter's reports.

    Raises:
        ValueError: an argument out of its range, or a ``train_job`` that is no job
            name.
    """

    def __init__(
        self,
        dataset: Readable,
        settings: ReadSettings | None = None,
        *,
        epoch: int = 0,
        client: Client | None = None,
        transform: Callable[[Any], Any] | None = None,
        batch_transform: Callable[[dict[str, Any]], Any] | None = None,
        measure: bool = True,
        train_job: str | None = None,
        stall_window: float = REPORT_WINDOW,
        **options: Unpack[ReadOptions],
    ) -> None:
        self.measure = bool(measure)
        if not MIN_WINDOW <= stall_window <= MAX_SECONDS:
            raise ValueError(
                f"stall_window is {MIN_WINDOW} to {MAX_SECONDS:g} seconds; got {stall_window!r}"
            )
        self.stall_window = float(stall_window)
        self.settings = ReadSettings.merged(settings, options)
        chosen = self.settings
        self.dataset = dataset
        self.batch_size = chosen.batch_size
        self.rank = chosen.rank
        self.world_size = chosen.world_size
        self.tail: Tail = chosen.tail
        self.prefetch = chosen.prefetch
        self.transform = transform
        self.batch_transform = batch_transform
        self.client = client if client is not None else client_of(dataset)
        self.train_job = job_of(train_job, self.client)
        #: the stall meter of its iterations, all epochs, made here (so that
        #: ``loader.meter.close()`` works before any iteration); None: ``measure=False``
        self.meter: StallMeter | None = (
            StallMeter(
                self.client,
                train_job=self.train_job,
                rank=self.rank,
                world_size=self.world_size,
                window=self.stall_window,
            )
            if self.measure
            else None
        )
        self._state = chosen.state(
            dataset.snapshot.id, epoch, order=order_version(dataset.snapshot)
        )
        self._order: EpochOrder | None = None
        self._order_epoch = -1
        self._units: Units | None = None
        #: the phases of the latest iteration's time to its first batch (:class:`FirstBatch`)
        self.first_batch: dict[str, float] = {}

    def __repr__(self) -> str:
        s = self._state
        return (
            f"<chunkd Loader epoch {s.epoch} at {s.cursor}/{len(self.dataset.snapshot)}, "
            f"rank {self.rank}/{self.world_size}, batch {self.batch_size}>"
        )

    @property
    def epoch(self) -> int:
        """The epoch dealt."""
        return self._state.epoch

    def set_epoch(self, epoch: int) -> None:
        """Deal epoch ``epoch`` next: from its start, unless it is the epoch already set
        (a restored state's cursor holds)."""
        if not 0 <= epoch < 1 << 32:
            raise ValueError(f"epoch is 0 <= epoch < 2**32; got {epoch!r}")
        if epoch != self._state.epoch:
            self._state = replace(self._state, epoch=epoch, cursor=0)

    def order(self) -> EpochOrder:
        """The current epoch's order (:class:`~chunkd.client.datasets.order.PagedOrder`
        for a schema-2 snapshot, :class:`~chunkd.client.datasets.order.Order` for a
        schema-1 one)."""
        if self._order is None or self._order_epoch != self._state.epoch:
            self._order = order_of(self.dataset.snapshot, self._state)
            self._order_epoch = self._state.epoch
        return self._order

    def state(self) -> dict[str, Any]:
        """The ``chunkd.loader/4`` state after the last batch yielded (``chunkd.loader/3``
        for a schema-1 snapshot; JSON-able, at most 256 bytes;
        :mod:`~chunkd.client.datasets.state`)."""
        return self._state.to_dict()

    def restore(self, state: Mapping[str, Any] | str | bytes) -> None:
        """Start the next iteration at ``state``'s epoch and cursor.

        Raises:
            ResumeStateError: ``state`` is malformed, or of another snapshot, seed,
                order version or order settings (the message says which).
        """
        loaded = LoaderState.parse(state)
        s = self._state
        loaded.check(
            snapshot=s.snapshot,
            seed=s.seed,
            shuffle=s.shuffle,
            window=s.window,
            window_bytes=s.window_bytes,
            total=len(self.dataset.snapshot),
            order=s.order,
        )
        self._state = loaded

    def steps(self) -> Steps:
        """The steps of an iteration from the current cursor."""
        return Steps(
            len(self.dataset.snapshot),
            self._state.cursor,
            self.batch_size,
            self.world_size,
            self.tail,
        )

    def units(self) -> Units | None:
        """The decoded units this loader takes its batches from (made on first use)."""
        if self._units is None:
            self._units = open_units(self.dataset, self.settings)
        return self._units

    def close(self) -> None:
        """Stop decoding ahead and drop the units held (the next iteration starts anew)."""
        units, self._units = self._units, None
        if units is not None:
            units.close()

    def __iter__(self) -> Iterator[Batch]:
        asked = time.perf_counter()  # the first wait runs from here: the order included
        steps = self.steps()
        batches = read_steps(
            self.dataset,
            self.order(),
            steps,
            rank=self.rank,
            prefetch=self.prefetch,
            client=self.client,
            convert=self.transform,
            timings=self.first_batch,
            units=self.units(),
            batch_transform=self.batch_transform,
            train_job=self.train_job,
        )
        consumed = self._consumed(steps, batches)
        if self.meter is None or in_loader_worker() or measured_outside():
            # in a DataLoader's worker the trainer is not here; inside another meter's
            # wrap (torch's measured, a StallMeter) the trainer's wait is measured there
            return consumed
        # one meter for all epochs: an epoch's end is no job's end. Its window begins
        # here, not at the Loader's making (nothing is sent: an iteration's end sent
        # the last window's steps)
        self.meter.flush()
        return self.meter.wrap(consumed, asked=asked)

    def _consumed(self, steps: Steps, batches: Iterator[Batch]) -> Iterator[Batch]:
        for batch in batches:
            # before the yield: a state taken while the trainer holds the batch counts it
            self._state = replace(self._state, cursor=steps.cursor_after(batch.step + 1))
            yield batch
        self._state = replace(self._state, cursor=steps.total)


# -- what the adapters share -------------------------------------------------------------


def check_settings(
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    seed: int,
    window: int | None,
    window_bytes: int | None,
    tail: str,
    prefetch: int,
) -> None:
    """Refuse a reader's settings out of their ranges (every adapter's arguments).

    Raises:
        ValueError: a rank outside the world, a batch size below 1, a seed outside
            ``0 <= seed < 2**64``, a window below 1, a window_bytes below 0 (or
            2**63 and more), an unknown tail, or a prefetch
            outside ``0 .. MAX_PREFETCH``.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size; got rank {rank}, world_size {world_size}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 64:
        raise ValueError(f"seed is a whole number, 0 <= seed < 2**64; got {seed!r}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 unit, or None for all; got {window!r}")
    if window_bytes is not None and not 0 <= window_bytes < 1 << 63:
        raise ValueError(
            f"window_bytes is 0 <= window_bytes < 2**63, or None for no bound; got {window_bytes!r}"
        )
    if tail not in TAILS:
        raise ValueError(f"tail is one of {', '.join(TAILS)}; got {tail!r}")
    if not 0 <= prefetch <= MAX_PREFETCH:
        raise ValueError(f"prefetch is 0 to {MAX_PREFETCH} steps; got {prefetch!r}")


def client_of(dataset: Any) -> Client | None:
    """The client whose daemon a dataset's reads go through, if it has one."""
    from chunkd.client.core import Client

    client = getattr(getattr(dataset, "source", None), "client", None)
    return client if isinstance(client, Client) else None


def order_of(snapshot: Snapshot, state: LoaderState) -> EpochOrder:
    """The order of ``state``'s epoch over ``snapshot``: every reader builds its order
    here, so all of them deal the same one.

    A schema-2 (paged) snapshot's is a :class:`~chunkd.client.datasets.order.PagedOrder`
    (order version 2), built from the root alone: its groups load their pages when a
    position of theirs is asked for, so nothing here reads every member or every unit.
    A schema-1 snapshot's is an :class:`~chunkd.client.datasets.order.Order` (version 1)
    by its members' units (what their formats decode whole:
    :func:`~chunkd.client.datasets.formats.snapshot_units`) and their decoded bytes
    (:func:`~chunkd.client.datasets.formats.snapshot_unit_bytes`), worked out once per
    process for the last four such snapshots (a process forked after that, a
    DataLoader worker, inherits them). The order's version is the snapshot's, whatever
    ``state`` says (:meth:`LoaderState.check
    <chunkd.client.datasets.state.LoaderState.check>` refuses a state of another)."""
    if order_version(snapshot) == ORDER_VERSION:
        return PagedOrder(
            snapshot,
            seed=state.seed,
            epoch=state.epoch,
            shuffle=state.shuffle,
            window=state.window,
            window_bytes=state.window_bytes,
        )
    found = _SNAPSHOT_UNITS.get(snapshot.id)
    if found is None:  # two threads at once both work it out: the same, kept once
        found = (snapshot_units(snapshot), snapshot_unit_bytes(snapshot))
        while len(_SNAPSHOT_UNITS) >= 4:
            _SNAPSHOT_UNITS.pop(next(iter(_SNAPSHOT_UNITS)), None)
        _SNAPSHOT_UNITS[snapshot.id] = found
    return Order(
        snapshot.counts,
        snapshot=snapshot.id,
        seed=state.seed,
        epoch=state.epoch,
        shuffle=state.shuffle,
        window=state.window,
        window_bytes=state.window_bytes,
        units=found[0],
        unit_bytes=found[1],
    )


#: each schema-1 snapshot's units and their decoded bytes (order_of), by its id: the
#: last four
_SNAPSHOT_UNITS: dict[str, tuple[list[list[int] | None], list[list[int] | None]]] = {}


# -- what did step N see -----------------------------------------------------------------


class StepIds(NamedTuple):
    """The sample ids a rank read at a step, and how many of the last are padding."""

    ids: list[str]
    padding: int


def step_sample_ids(
    dataset: Readable,
    state: LoaderState | Mapping[str, Any] | str | bytes,
    *,
    step: int,
    batch_size: int,
    world_size: int,
    rank: int | None = None,
    tail: Tail = "uneven",
) -> dict[int, StepIds]:
    """What global step ``step`` after ``state`` read, per rank (or rank ``rank`` only).

    ``state``: a saved loader state (its cursor, epoch, seed and order settings), and
    ``step`` counts from its cursor (0: the first step after it). For a run that
    never resized, ``LoaderState(snapshot_id, seed, epoch, 0)`` (with its shuffle,
    window and window_bytes) and the step since the epoch's start. Pure: no reading.

    Raises:
        ResumeStateError: ``state`` is malformed or of another snapshot.
        IndexError: the epoch has no such step.
        ValueError: a bad batch size, world size, rank or tail.
    """
    loaded = state if isinstance(state, LoaderState) else LoaderState.parse(state)
    snapshot = dataset.snapshot
    loaded.check(
        snapshot=snapshot.id,
        seed=loaded.seed,
        shuffle=loaded.shuffle,
        window=loaded.window,
        window_bytes=loaded.window_bytes,
        total=len(snapshot),
        order=order_version(snapshot),
    )
    steps = Steps(len(snapshot), loaded.cursor, batch_size, world_size, tail)
    order = order_of(snapshot, loaded)
    ranks = range(world_size) if rank is None else [rank]
    found: dict[int, StepIds] = {}
    for r in ranks:
        positions, padding = steps.positions(step, r)
        if len(positions):
            members, samples = order.locate(positions)
            pairs = zip(members.tolist(), samples.tolist(), strict=True)
            found[r] = StepIds([dataset.sample_id(m, s) for m, s in pairs], padding)
        else:
            found[r] = StepIds([], 0)
    return found
