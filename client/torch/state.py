"""ShardDataset states: their format, their checks, and a rank's global state.

A state is a plain, JSON-able dict (the class docstring of
:class:`~chunkd.client.torch.ShardDataset` says what each field means): the fields
in :data:`GLOBAL_KEYS`, and in a DataLoader worker's state the
:data:`WORKER_KEYS` too. :func:`checked_state` checks one; :func:`global_state`
finds the states inside what a DataLoader saved and turns them into one rank's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Final

__all__ = [
    "GLOBAL_KEYS",
    "STATE_FORMAT",
    "WORKER_KEYS",
    "checked_state",
    "find_states",
    "global_state_of",
]

#: the ``format`` of every ShardDataset state; bumped if the state's meaning changes
STATE_FORMAT: Final = "chunkd.ShardDataset/1"
#: keys only a DataLoader worker's state has (see ShardDataset.global_state)
WORKER_KEYS: Final = ("worker_id", "num_workers", "batch_size", "origin", "yielded")
#: the keys of a rank's (global) state, in the order a state lists them
GLOBAL_KEYS: Final = ("format", "order", "epoch", "position", "world_size", "rank", "done")


def global_state_of(state: Any) -> dict[str, Any]:
    """The global state of a rank: see :meth:`ShardDataset.global_state
    <chunkd.client.torch.ShardDataset.global_state>`."""
    if isinstance(state, Mapping) and state.get("_steps_since_snapshot", 0):
        raise ValueError(
            "the StatefulDataLoader's state was taken between worker snapshots, so "
            "its workers' positions are behind it; make the loader with "
            "snapshot_every_n_steps=1 (its default)"
        )
    found = [checked_state(s) for s in find_states(state)]
    if not found:
        raise ValueError("no ShardDataset state found in what was given")
    first = found[0]
    for other in found[1:]:
        keys = ("order", "epoch", "world_size", "rank")
        if any(other[key] != first[key] for key in keys):
            raise ValueError(
                "the states are of different orders, epochs or ranks: "
                + "; ".join(str({key: s[key] for key in keys}) for s in (first, other))
                + "; pass the states of one rank's loader"
            )
    workers = [s for s in found if "worker_id" in s]
    if not workers:
        positions = {(s["position"], s["done"]) for s in found}
        if len(positions) != 1:
            raise ValueError(f"the states disagree on the position: {sorted(positions)}")
        return {key: first[key] for key in GLOBAL_KEYS}
    count = workers[0]["num_workers"]
    ids = sorted(s["worker_id"] for s in workers)
    if ids != list(range(count)) or any(s["num_workers"] != count for s in workers):
        raise ValueError(f"need the states of all {count} workers once each; got workers {ids}")
    position = min(s["position"] for s in workers)
    done = all(s["done"] for s in workers)
    return {key: first[key] for key in GLOBAL_KEYS} | {"position": position, "done": done}


def checked_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a ShardDataset state, its fields checked."""
    if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
        raise ValueError(
            f"not a ShardDataset state (its format is not {STATE_FORMAT!r}): {state!r:.200}"
        )
    keys = [key for key in GLOBAL_KEYS if key not in ("format", "order", "done")]
    if "worker_id" in state:
        keys += WORKER_KEYS
    done = state.get("done")
    if type(done) is not bool:  # a malformed state is a ValueError, as any other
        raise ValueError(f"a ShardDataset state needs 'done', True or False; got {done!r}")
    checked: dict[str, Any] = {
        "format": STATE_FORMAT,
        "order": str(state.get("order")),
        "done": done,
    }
    for key in keys:
        value = state.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(
                f"a ShardDataset state needs {key!r}, a whole number >= 0; got {value!r}"
            )
        checked[key] = value
    return checked


def find_states(state: Any) -> Iterator[Mapping[str, Any]]:
    if isinstance(state, Mapping):
        if state.get("format") == STATE_FORMAT:
            yield state
            return
        for value in state.values():
            yield from find_states(value)
    elif isinstance(state, list | tuple):
        for value in state:
            yield from find_states(value)
