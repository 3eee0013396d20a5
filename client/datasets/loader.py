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
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final, Literal, NamedTuple, Protocol

import numpy as np
from numpy.typing import NDArray

from chunkd.client.datasets.formats import snapshot_unit_bytes, snapshot_units
from chunkd.client.datasets.order import DEFAULT_WINDOW, DEFAULT_WINDOW_BYTES, Order
from chunkd.client.datasets.state import LoaderState
from chunkd.errors import ChunkdError

if TYPE_CHECKING:
    from chunkd.snapshot import Snapshot

__all__ = [
    "DEFAULT_PREFETCH",
    "TAILS",
    "Batch",
    "Loader",
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

    def read(self, member: int, sample: int) -> Any: ...

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


class Batch(NamedTuple):
    """One rank's batch of one step.

    Attributes:
        samples: the samples, in order (a list; the torch adapter collates them).
        ids: their ids, ``KEY#i`` (:meth:`Dataset.sample_id`), stable whatever the order.
        step: the step, counted from the cursor the iteration started at.
        position: where the step starts in the epoch's order.
        padding: how many of the last samples are padding (``tail="pad"``): repeats
            of the epoch's first samples, to be masked out of the loss.
        last: this is the epoch's last step (short under ``tail="uneven"``).
    """

    samples: Any
    ids: list[str]
    step: int
    position: int
    padding: int
    last: bool


def warm(client: Any, ranges: Sequence[tuple[str, int, int]]) -> int:
    """Ask ``client``'s daemon to load byte ranges into its cache, in the background.

    ``Client.prefetch_ranges`` where the client has it (only the chunks the ranges
    lie in), else ``Client.prefetch`` of their objects. A hint: a daemon that refuses
    it costs the reader nothing but the cache hit (logged at debug level).

    Returns:
        How many loads the daemon started (0 without a client).
    """
    if client is None or not ranges:
        return 0
    # rows of one Parquet row group, lines of one zstd frame: one range, asked once
    ranges = list(dict.fromkeys(ranges))
    try:
        by_range = getattr(client, "prefetch_ranges", None)
        if by_range is not None:
            return int(by_range(ranges))
        return int(client.prefetch(sorted({name for name, _, _ in ranges})))
    except ChunkdError as exc:
        log.debug("prefetch of %d ranges refused: %s", len(ranges), exc)
        return 0


def read_steps(
    dataset: Readable,
    order: Order,
    steps: Steps,
    *,
    rank: int,
    first: int = 0,
    every: int = 1,
    prefetch: int = DEFAULT_PREFETCH,
    client: Any = None,
    convert: Callable[[Any], Any] | None = None,
    timings: dict[str, float] | None = None,
) -> Iterator[Batch]:
    """Rank ``rank``'s batches of steps ``first, first + every, ...`` of ``steps``.

    What a worker ``k`` of ``K`` runs with ``first=k, every=K``; the plain
    :class:`Loader` with ``first=0, every=1``. A step whose share for the rank is
    empty (the last, under ``tail="uneven"``) yields nothing. Before it reads a
    step, it warms the next ``prefetch`` steps of its own (the first ``prefetch + 1``
    before the first read) through ``client`` (:func:`warm`). ``convert`` is applied
    to each sample as read.

    The time to its first batch is measured by phase (:class:`FirstBatch`), reported to
    the daemon's metrics through ``client``, and written into ``timings`` if given.
    """
    count = len(steps)
    own = range(first, count, max(1, every))
    warmed = 0
    timer: FirstBatch | None = FirstBatch(dataset)
    for i, step in enumerate(own):
        if prefetch and client is not None:
            upto = min(len(own), i + prefetch + 1)
            if warmed < upto:
                pairs = [p for s in own[warmed:upto] for p in _pairs(order, steps, s, rank)]
                warm(client, dataset.ranges(pairs))
                warmed = upto
        positions, padding = steps.positions(step, rank)
        if not len(positions):
            continue
        members, samples = order.locate(positions)
        pairs = list(zip(members.tolist(), samples.tolist(), strict=True))
        if timer is not None:
            timer.fetched(pairs[:1])
        read = [dataset.read(m, s) for m, s in pairs]
        if convert is not None:
            read = [convert(sample) for sample in read]
        if timer is not None:
            timer.done(client, timings)
            timer = None
        yield Batch(
            samples=read,
            ids=[dataset.sample_id(m, s) for m, s in pairs],
            step=step,
            position=steps.span(step)[0],
            padding=padding,
            last=step == count - 1,
        )


class FirstBatch:
    """How long a reader took to its first batch, by phase.

    ``metadata``: resolving the snapshot (:attr:`Dataset.metadata_seconds
    <chunkd.client.datasets.Dataset.metadata_seconds>`: the ``ds_resolve``, or the scan
    of a snapshot built in memory); ``worker_start``: in a worker process (a
    DataLoader's or Grain's), from the process's start to its first read; ``first_chunk``:
    from the reader's start (the prefetch of its first steps included) to the first
    sample's bytes in hand; ``decode``: the rest of the first batch, read and decoded;
    ``total``: all of them. The daemon keeps them as the histogram
    ``chunkd_dataset_first_batch_seconds{phase}`` (``ds_first_batch``), so a real job's
    breakdown is seen as the bench's is.
    """

    def __init__(self, dataset: Readable) -> None:
        self.dataset = dataset
        self.started = time.perf_counter()
        self.worker_start = _process_age() if multiprocessing.parent_process() else None
        self.first_chunk = 0.0

    def fetched(self, pairs: list[tuple[int, int]]) -> None:
        """Read the first sample's bytes (into the client's cache), and note when."""
        fetch = getattr(self.dataset, "fetch", None)
        if fetch is not None:
            fetch(pairs)
        self.first_chunk = time.perf_counter() - self.started

    def done(self, client: Any, timings: dict[str, float] | None) -> None:
        """The first batch is read: report the phases."""
        decode = time.perf_counter() - self.started - self.first_chunk
        phases = {
            "metadata": float(getattr(self.dataset, "metadata_seconds", 0.0)),
            "first_chunk": self.first_chunk,
            "decode": decode,
        }
        if self.worker_start is not None:
            phases["worker_start"] = self.worker_start
        phases["total"] = sum(phases.values())
        if timings is not None:
            timings.update(phases)
        request = getattr(client, "request", None)
        if request is None:
            return
        try:
            request("ds_first_batch", phases).close()
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


def _pairs(order: Order, steps: Steps, step: int, rank: int) -> list[tuple[int, int]]:
    positions, _ = steps.positions(step, rank)
    if not len(positions):
        return []
    members, samples = order.locate(positions)
    return list(zip(members.tolist(), samples.tolist(), strict=True))


# -- the plain Python loader -------------------------------------------------------------


class Loader:
    """One rank's batches of a dataset, in chunkd's order, resumable anywhere.

    Iterating yields :class:`Batch` es of steps from the current cursor on (see the
    module docstring for steps, ranks and the tail). :meth:`state` is the
    ``chunkd.loader/3`` state after the last batch yielded (a step boundary);
    :meth:`restore` makes the next iteration start at a state's cursor, whatever
    the ranks, batch size or workers that saved it.

    Epochs: :meth:`set_epoch` before each epoch; setting the epoch a restored state
    is of keeps its cursor, another epoch starts at 0. An iteration runs to the
    epoch's end; iterating a finished epoch again yields nothing until the epoch is
    set anew.

    Args:
        dataset: the dataset (:class:`~chunkd.client.datasets.Dataset`).
        batch_size: ``B``, this rank's batch size.
        seed: the run's seed, the same on every rank.
        rank: this rank, ``0 <= rank < world_size``.
        world_size: ``W``.
        epoch: the first epoch.
        shuffle: shuffle (else members in order, samples as stored).
        window: the most units whose samples are mixed together (None: no bound; a
            unit is what the format decodes whole: a Parquet row group, else a member).
        window_bytes: the most decoded bytes of a window's units (None: no bound;
            default: the formats' decode caches' bound, so a window's units fit them).
        tail: ``"uneven"``, ``"pad"`` or ``"drop"``.
        prefetch: steps warmed ahead of the one read (0: none).
        client: whose daemon warms them (default: the dataset source's client).
        transform: applied to each sample as read.

    Raises:
        ValueError: an argument out of its range.
    """

    def __init__(
        self,
        dataset: Readable,
        *,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        epoch: int = 0,
        shuffle: bool = True,
        window: int | None = DEFAULT_WINDOW,
        window_bytes: int | None = DEFAULT_WINDOW_BYTES,
        tail: Tail = "uneven",
        prefetch: int = DEFAULT_PREFETCH,
        client: Any = None,
        transform: Callable[[Any], Any] | None = None,
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
        self.dataset = dataset
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.tail: Tail = tail
        self.prefetch = prefetch
        self.transform = transform
        self.client = client if client is not None else client_of(dataset)
        self._state = LoaderState(
            dataset.snapshot.id,
            seed,
            epoch,
            0,
            shuffle=bool(shuffle),
            window=window,
            window_bytes=window_bytes,
        )
        self._order: Order | None = None
        self._order_epoch = -1
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

    def order(self) -> Order:
        """The current epoch's order."""
        if self._order is None or self._order_epoch != self._state.epoch:
            self._order = order_of(self.dataset.snapshot, self._state)
            self._order_epoch = self._state.epoch
        return self._order

    def state(self) -> dict[str, Any]:
        """The ``chunkd.loader/3`` state after the last batch yielded (JSON-able, at most
        256 bytes; :mod:`~chunkd.client.datasets.state`)."""
        return self._state.to_dict()

    def restore(self, state: Mapping[str, Any] | str | bytes) -> None:
        """Start the next iteration at ``state``'s epoch and cursor.

        Raises:
            ResumeStateError: ``state`` is malformed, or of another snapshot, seed or
                order settings (the message says which).
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

    def __iter__(self) -> Iterator[Batch]:
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
        )
        return self._consumed(steps, batches)

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


def client_of(dataset: Any) -> Any:
    """The client whose daemon a dataset's reads go through, if it has one."""
    return getattr(getattr(dataset, "source", None), "client", None)


def order_of(snapshot: Snapshot, state: LoaderState) -> Order:
    """The order of ``state``'s epoch over ``snapshot``, by its members' units (what
    their formats decode whole: :func:`~chunkd.client.datasets.formats.snapshot_units`)
    and their decoded bytes (:func:`~chunkd.client.datasets.formats.snapshot_unit_bytes`).
    Every reader builds its order here, so all of them deal the same one."""
    return Order(
        snapshot.counts,
        snapshot=snapshot.id,
        seed=state.seed,
        epoch=state.epoch,
        shuffle=state.shuffle,
        window=state.window,
        window_bytes=state.window_bytes,
        units=snapshot_units(snapshot),
        unit_bytes=snapshot_unit_bytes(snapshot),
    )


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
