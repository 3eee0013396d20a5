"""The states of a loader's workers, and the one chunkd state they make.

In the trainer's process, a reader's state is the ``chunkd.loader/4`` state itself
(``chunkd.loader/3`` for a schema-1 snapshot: :mod:`chunkd.client.datasets.state`): at
most 256 bytes, the same on every rank, resumable at any world size, batch size and
worker count.

A **worker** ``k`` of ``K`` (a torch DataLoader worker, a Grain ``mp_prefetch``
process) knows only its own steps (``k, k+K, ...``), so its state is a
:data:`WORKER_FORMAT` dict: the
``chunkd.loader/4`` (or ``/3``) state its iteration started from (``start``), the geometry
(``total``, ``rank``, ``world_size``, ``batch_size``, ``tail``, ``worker``,
``workers``), ``yielded``, the batches it produced that the loader handed on (torchdata's
``StatefulDataLoader`` and Grain's prefetch record a worker's state with each batch they
hand on, never with one their workers only read ahead), and ``finished``. Both keep
one per worker and restore each into the same worker of a loader with as many
workers; that resumes exactly.

:func:`global_state` turns them into the chunkd state, for any other loader: a
loader that takes a batch from each worker in turn (torch's ``in_order=True``, its
default; Grain's interleave of its prefetch processes) yielded the rank's steps in
order, so the steps consumed are ``S = sum(yielded)`` and the cursor is the start's
plus ``S`` steps (:meth:`Steps.cursor_after
<chunkd.client.datasets.loader.Steps.cursor_after>`), or the epoch's end once a worker
finished (then every step of the rank was passed) or the loader did.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

from chunkd.client.datasets.loader import TAILS, Steps, Tail
from chunkd.client.datasets.state import LEGACY_FORMATS, STATE_FORMATS, LoaderState
from chunkd.errors import ResumeStateError

__all__ = [
    "WORKER_FORMAT",
    "WorkerState",
    "global_state",
    "reader_state",
]

#: the ``format`` of a DataLoader worker's state
WORKER_FORMAT: Final = "chunkd.loader.worker/1"

_WHOLE: Final = ("total", "rank", "world_size", "batch_size", "worker", "workers", "yielded")


@dataclass(frozen=True, slots=True)
class WorkerState:
    """One DataLoader worker's place in an iteration (see the module docstring)."""

    start: LoaderState
    total: int
    rank: int
    world_size: int
    batch_size: int
    tail: Tail
    worker: int
    workers: int
    yielded: int
    finished: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The state as the worker's ``state_dict()``."""
        return {
            "format": WORKER_FORMAT,
            "start": self.start.to_dict(),
            "total": self.total,
            "rank": self.rank,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "tail": self.tail,
            "worker": self.worker,
            "workers": self.workers,
            "yielded": self.yielded,
            "finished": self.finished,
        }

    @classmethod
    def parse(cls, state: Mapping[str, Any]) -> WorkerState:
        """A worker's state from its dict.

        Raises:
            ResumeStateError: it is malformed.
        """
        if state.get("format") != WORKER_FORMAT:
            raise ResumeStateError(f"not a DataLoader worker's state of {WORKER_FORMAT}")
        values: dict[str, int] = {}
        for key in _WHOLE:
            value = state.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ResumeStateError(
                    f"a worker's state needs {key!r}, a whole number; got {value!r:.40}"
                )
            values[key] = value
        tail = state.get("tail")
        finished = state.get("finished")
        if tail not in TAILS or type(finished) is not bool:
            raise ResumeStateError(
                f"a worker's state needs 'tail' (one of {', '.join(TAILS)}) and 'finished' "
                f"(true or false); got {tail!r:.20} and {finished!r:.20}"
            )
        start = state.get("start")
        if not isinstance(start, Mapping):
            raise ResumeStateError("a worker's state needs 'start', a chunkd.loader/4 state")
        return cls(start=LoaderState.parse(start), tail=tail, finished=finished, **values)

    def geometry(self) -> tuple[int, ...]:
        """What must match for the state to resume a worker: the world, the batch, the
        tail, the worker and the workers, the epoch's size."""
        return (
            self.total,
            self.rank,
            self.world_size,
            self.batch_size,
            TAILS.index(self.tail),
            self.worker,
            self.workers,
        )

    def steps(self) -> Steps:
        """The steps of the iteration the worker is in."""
        return Steps(self.total, self.start.cursor, self.batch_size, self.world_size, self.tail)


def reader_state(
    start: LoaderState,
    steps: Steps,
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    tail: Tail,
    worker: int,
    workers: int,
    yielded: int,
    finished: bool,
    in_worker: bool,
) -> dict[str, Any]:
    """What a reader that started at ``start`` and yielded ``yielded`` batches saves: the
    chunkd state in the trainer's process, its :class:`WorkerState` in a worker's."""
    if in_worker:
        return WorkerState(
            start=start,
            total=steps.total,
            rank=rank,
            world_size=world_size,
            batch_size=batch_size,
            tail=tail,
            worker=worker,
            workers=workers,
            yielded=yielded,
            finished=finished,
        ).to_dict()
    cursor = steps.total if finished else steps.cursor_after(yielded)
    return replace(start, cursor=cursor).to_dict()


def global_state(state: Any) -> dict[str, Any]:
    """The ``chunkd.loader/4`` (or ``/3``) state of what DataLoaders saved (see the
    module docstring).

    ``state``: a ``StatefulDataLoader.state_dict()``, a dataset's ``state_dict()``, or
    any nesting of dicts, lists and tuples of them, such as a list of every rank's
    loader state. The ranks' states must agree (ranks in step hold one state).

    Raises:
        ResumeStateError: no chunkd state in ``state``; a ``StatefulDataLoader`` state
            taken between worker snapshots (make it with ``snapshot_every_n_steps=1``,
            its default); workers' states missing, twice, or of different iterations;
            ranks not in step; or a state of a format chunkd no longer resumes.
    """
    if isinstance(state, Mapping) and state.get("_steps_since_snapshot", 0):
        raise ResumeStateError(
            "the StatefulDataLoader's state was taken between worker snapshots, so its "
            "workers' states are behind it; make the loader with snapshot_every_n_steps=1 "
            "(its default)"
        )
    found = list(_find(state, finished=False))
    if not found:
        raise ResumeStateError("no chunkd loader state found in what was given")
    results: dict[str, LoaderState] = {}
    workers: dict[int, list[tuple[WorkerState, bool]]] = {}
    for doc, finished in found:
        if doc.get("format") == WORKER_FORMAT:
            parsed = WorkerState.parse(doc)
            workers.setdefault(parsed.rank, []).append((parsed, finished))
        else:
            loaded = LoaderState.parse(doc)
            results[loaded.to_json()] = loaded
    for rank, states in sorted(workers.items()):
        loaded = _of_workers(rank, states)
        results[loaded.to_json()] = loaded
    if len(results) > 1:
        raise ResumeStateError(
            "the loader states are not in step (different cursors, epochs or orders): "
            + "; ".join(sorted(results)[:4])
            + "; save every rank at the same step, or pass one rank's state"
        )
    return next(iter(results.values())).to_dict()


def _of_workers(rank: int, states: list[tuple[WorkerState, bool]]) -> LoaderState:
    first = states[0][0]
    count = first.workers
    ids = sorted(s.worker for s, _ in states)
    if ids != list(range(count)):
        raise ResumeStateError(
            f"need the states of all {count} DataLoader workers of rank {rank} once each; "
            f"got workers {ids}"
        )
    shared = (first.start, first.total, first.world_size, first.batch_size, first.tail)
    for s, _ in states:
        if (s.start, s.total, s.world_size, s.batch_size, s.tail) != shared or s.workers != count:
            raise ResumeStateError(
                f"the DataLoader workers' states of rank {rank} are of different iterations; "
                "pass the states of one loader"
            )
    steps = first.steps()
    if any(s.finished or finished for s, finished in states):
        # a worker ends only once every step before its next is yielded, and the next
        # is the epoch's last or past it: the rank passed every step
        return replace(first.start, cursor=steps.total)
    return replace(first.start, cursor=steps.cursor_after(sum(s.yielded for s, _ in states)))


def _find(state: Any, *, finished: bool) -> Iterator[tuple[Mapping[str, Any], bool]]:
    if isinstance(state, Mapping):
        fmt = state.get("format")
        if fmt == WORKER_FORMAT or fmt in STATE_FORMATS.values():
            yield state, finished
            return
        if fmt in LEGACY_FORMATS:
            LoaderState.parse(state)  # raises, saying why
        finished = finished or state.get("_iterator_finished") is True
        for value in state.values():
            yield from _find(value, finished=finished)
    elif isinstance(state, list | tuple):
        for value in state:
            yield from _find(value, finished=finished)
