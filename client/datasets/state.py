"""A loader's saved state: where an epoch's consumption stands, at any world size.

The state (formats ``chunkd.loader/4`` and ``chunkd.loader/3``)
    A JSON object of exactly these fields, at most :data:`MAX_STATE_BYTES` (256)
    bytes as compact JSON, whatever the world size, workers or batch size::

        format        "chunkd.loader/4": a place in order version 2, the order of a
                      schema-2 (paged) snapshot (:class:`~chunkd.client.datasets.order.PagedOrder`);
                      "chunkd.loader/3": a place in order version 1, the order of a
                      schema-1 snapshot (:class:`~chunkd.client.datasets.order.Order`)
        snapshot      the snapshot id (64 hex digits): the order's samples
        seed          the run's seed (0 <= seed < 2**64)
        epoch         the epoch (0 <= epoch < 2**32)
        cursor        how many positions of the epoch's order the trainer has
                      consumed, at a step boundary (0 <= cursor <= the epoch's
                      samples; equal to them: the epoch is done)
        shuffle       whether the order is shuffled
        window        the most units (what a format decodes whole, a Parquet row
                      group, else a member) a window of the order mixes
                      (1 <= window < 2**32; null: no bound)
        window_bytes  the most decoded bytes of a window's units (0 <= window_bytes
                      < 2**63; null: no bound)

    The longest state (every number at its largest) is 253 bytes. The format names
    the order's version (:attr:`LoaderState.order`), so that a state never resumes in
    another order: a field for it would take the longest state past 256 bytes.
    ``snapshot``, ``seed``, ``epoch``, ``shuffle``, ``window`` and ``window_bytes`` fix
    the epoch's order
    (:mod:`chunkd.client.datasets.order`); ``cursor`` is a place in it. The cursor counts
    what the trainer **consumed** (batches handed to it), never what workers read
    ahead. Nothing in it depends on ranks, workers or batch sizes, so a state saved by
    any number of ranks resumes on any other (:mod:`chunkd.client.datasets.loader`
    says how the positions after the cursor are split).

Checks
    :meth:`LoaderState.parse` refuses anything else with a
    :class:`~chunkd.errors.ResumeStateError` saying what is wrong: not JSON, too long,
    another format, a missing, extra or out-of-range field. :meth:`LoaderState.check`
    refuses a state of another snapshot, seed, order version or order settings, or a
    cursor past the epoch's end.

States of ``chunkd.loader/3`` (order version 1)
    still resume exactly: they name schema-1 snapshots, whose order is version 1
    unchanged (:class:`~chunkd.client.datasets.order.Order`, the same keys and the same
    windows). A ``chunkd.loader/3`` state against a schema-2 snapshot (or a
    ``chunkd.loader/4`` one against a schema-1 snapshot) is refused with a
    ResumeStateError naming both versions: its cursor is a place in another order.

States of ``chunkd.loader/2`` (windows bounded by units only)
    are refused with a ResumeStateError that says why. Their order's windows held
    ``window`` units whatever their decoded size; windows are now bounded by decoded
    bytes too (``window_bytes``, by default the decode caches' 256 MiB), so with the
    same snapshot, seed, epoch and window other samples come before the same cursor
    wherever a window's units decode to more than that: resuming one would repeat
    some samples and skip others, silently. The message names the epoch and cursor
    it reached.

States of ``chunkd.loader/1`` (the order before units)
    are refused with a ResumeStateError that says why. Their cursor is a place in the
    order that shuffled members and mixed samples within windows of members; the
    order now shuffles units (Parquet row groups) and mixes within windows of units
    (:mod:`chunkd.client.datasets.order`), so the same snapshot, seed, epoch and
    window put other samples before the same cursor: resuming one would repeat some
    samples and skip others, silently. The message names the epoch and cursor it
    reached.

States of ``chunkd.ShardDataset/1`` (chunkd's torch dataset before snapshots)
    are refused with a ResumeStateError that says why, and are not migrated: their
    positions counted Parquet **row groups** where a sample is now a row, and their
    order was keyed by a hash of the shard list, not by a snapshot, so no cursor in
    the new order holds exactly the samples the old one had consumed. A migration
    would have to keep the old order alive beside the new one (two implementations
    of the order); the message names the epoch and position the old run reached.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from chunkd.client.datasets.epoch import DEFAULT_WINDOW, DEFAULT_WINDOW_BYTES, ORDER_VERSION
from chunkd.errors import ResumeStateError
from chunkd.snapshot import WRITE_SCHEMA

__all__ = [
    "DEFAULT_ORDER",
    "LEGACY_FORMATS",
    "MAX_STATE_BYTES",
    "STATE_FORMAT",
    "STATE_FORMATS",
    "LoaderState",
]

#: the format of a state of each order version (1: schema-1 snapshots; 2: schema-2,
#: paged ones); a new format if a state's meaning changes
STATE_FORMATS: Final = {1: "chunkd.loader/3", 2: "chunkd.loader/4"}
#: the order version of the snapshots chunkd writes (:data:`chunkd.snapshot.WRITE_SCHEMA`):
#: a :class:`LoaderState`'s unless told
DEFAULT_ORDER: Final = ORDER_VERSION if WRITE_SCHEMA >= 2 else 1
#: the ``format`` of a loader state of that order
STATE_FORMAT: Final = STATE_FORMATS[DEFAULT_ORDER]
_VERSIONS: Final = {fmt: version for version, fmt in STATE_FORMATS.items()}
#: the longest a state is, as compact JSON
MAX_STATE_BYTES: Final = 256
#: formats of states chunkd wrote before, refused by name (see the module docstring)
LEGACY_FORMATS: Final = ("chunkd.loader/2", "chunkd.loader/1", "chunkd.ShardDataset/1")

_FIELDS: Final = (
    "format",
    "snapshot",
    "seed",
    "epoch",
    "cursor",
    "shuffle",
    "window",
    "window_bytes",
)
_ID_RE: Final = re.compile(r"[0-9a-f]{64}")
_LIMITS: Final = {
    "seed": 1 << 64,
    "epoch": 1 << 32,
    "cursor": 1 << 63,
    "window": 1 << 32,
    "window_bytes": 1 << 63,
}


@dataclass(frozen=True, slots=True)
class LoaderState:
    """Where an epoch's consumption stands (see the module docstring)."""

    snapshot: str
    seed: int
    epoch: int
    cursor: int
    shuffle: bool = True
    window: int | None = DEFAULT_WINDOW
    window_bytes: int | None = DEFAULT_WINDOW_BYTES
    #: the order's version (:func:`~chunkd.client.datasets.order.order_version`): 2 for
    #: a schema-2 snapshot, 1 for a schema-1 one; the format says it
    order: int = DEFAULT_ORDER

    def __post_init__(self) -> None:
        if not isinstance(self.snapshot, str) or not _ID_RE.fullmatch(self.snapshot):
            raise ResumeStateError(
                f"a loader state's 'snapshot' is a snapshot id (64 lowercase hex digits); "
                f"got {self.snapshot!r:.80}"
            )
        for key in ("seed", "epoch", "cursor"):
            _whole(key, getattr(self, key), 0)
        if self.window is not None:
            _whole("window", self.window, 1)
        if self.window_bytes is not None:
            _whole("window_bytes", self.window_bytes, 0)
        if type(self.shuffle) is not bool:
            raise ResumeStateError(
                f"a loader state's 'shuffle' is true or false; got {self.shuffle!r:.40}"
            )
        if type(self.order) is not int or self.order not in STATE_FORMATS:
            raise ResumeStateError(
                f"a loader state's order version is one of {sorted(STATE_FORMATS)}; got "
                f"{self.order!r:.40}"
            )

    def to_dict(self) -> dict[str, Any]:
        """The state as a JSON-able dict (what ``state_dict()`` methods return)."""
        return {
            "format": STATE_FORMATS[self.order],
            "snapshot": self.snapshot,
            "seed": self.seed,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "shuffle": self.shuffle,
            "window": self.window,
            "window_bytes": self.window_bytes,
        }

    def to_json(self) -> str:
        """The state as compact JSON (at most :data:`MAX_STATE_BYTES` bytes)."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def parse(cls, state: Mapping[str, Any] | str | bytes) -> LoaderState:
        """A state from its dict or its JSON.

        Raises:
            ResumeStateError: ``state`` is not a ``chunkd.loader/4`` or
                ``chunkd.loader/3`` state, or is malformed (the message says how), or is
                one of a format chunkd no longer resumes (``chunkd.loader/2``,
                ``chunkd.loader/1``, ``chunkd.ShardDataset/1``: see the module
                docstring).
        """
        if isinstance(state, str | bytes | bytearray):
            if len(state) > MAX_STATE_BYTES:
                raise ResumeStateError(
                    f"a loader state is at most {MAX_STATE_BYTES} bytes; this one is "
                    f"{len(state)}: it is not a {STATE_FORMAT} state, or was corrupted"
                )
            try:
                state = json.loads(state)
            except (ValueError, UnicodeDecodeError) as exc:
                raise ResumeStateError(
                    f"a loader state is JSON; this one does not parse ({exc}): it was "
                    "corrupted or truncated"
                ) from None
        if not isinstance(state, Mapping):
            raise ResumeStateError(
                f"a loader state is a JSON object, not {type(state).__name__}: {state!r:.80}"
            )
        fmt = state.get("format")
        if fmt in LEGACY_FORMATS:
            raise ResumeStateError(_legacy_message(state))
        version = _VERSIONS.get(fmt) if isinstance(fmt, str) else None
        if version is None:
            raise ResumeStateError(
                f"not a loader state: its format is {fmt!r:.60}, not "
                f"{' or '.join(repr(f) for f in reversed(STATE_FORMATS.values()))}"
            )
        extra = sorted(str(key) for key in state if key not in _FIELDS)
        missing = [key for key in _FIELDS if key not in state]
        if extra or missing:
            raise ResumeStateError(
                f"a {fmt} state has exactly the fields {', '.join(_FIELDS)}; this "
                f"one lacks {missing or 'none'} and has {extra[:5] or 'none'} besides"
            )
        parsed = cls(
            snapshot=state["snapshot"],
            seed=state["seed"],
            epoch=state["epoch"],
            cursor=state["cursor"],
            shuffle=state["shuffle"],
            window=state["window"],
            window_bytes=state["window_bytes"],
            order=version,
        )
        size = len(parsed.to_json())
        if size > MAX_STATE_BYTES:  # only reachable through a change of the fields' bounds
            raise ResumeStateError(f"a loader state of {size} bytes; at most {MAX_STATE_BYTES}")
        return parsed

    def check(
        self,
        *,
        snapshot: str,
        seed: int,
        shuffle: bool,
        window: int | None,
        window_bytes: int | None,
        total: int,
        order: int | None = None,
    ) -> None:
        """Refuse this state unless it is of the order a loader deals (``order``: that
        order's version, :func:`~chunkd.client.datasets.order.order_version`; None: not
        checked).

        Raises:
            ResumeStateError: it is of another snapshot, seed, order version, shuffle,
                window or window_bytes, or its cursor is past the epoch's ``total``
                samples.
        """
        if self.snapshot != snapshot:
            # Whole ids: two snapshots may share any prefix, and the state's is the id
            # to open it by.
            raise ResumeStateError(
                f"this loader state is of snapshot {self.snapshot}, not of the dataset "
                f"being read (snapshot {snapshot}): resume with the snapshot that saved it "
                "(open it by its id), or start the epoch afresh"
            )
        if order is not None and self.order != order:
            raise ResumeStateError(
                f"this loader state ({STATE_FORMATS[self.order]}) is a place in order "
                f"version {self.order}, and snapshot {snapshot} is read in order version "
                f"{order} (version 1 for a schema-1 snapshot, 2 for a schema-2 one): its "
                "cursor would name other samples. Resume with a state this snapshot's "
                "loader saved, or start the epoch afresh"
            )
        if self.seed != seed:
            raise ResumeStateError(
                f"this loader state is of seed {self.seed}, not {seed}: its cursor is a "
                "place in another order; resume with the seed that saved it"
            )
        if (self.shuffle, self.window, self.window_bytes) != (shuffle, window, window_bytes):
            raise ResumeStateError(
                f"this loader state is of an order with shuffle={self.shuffle}, "
                f"window={self.window}, window_bytes={self.window_bytes}, not "
                f"shuffle={shuffle}, window={window}, window_bytes={window_bytes}: resume "
                "with the order settings that saved it"
            )
        if self.cursor > total:
            raise ResumeStateError(
                f"this loader state's cursor {self.cursor} is past the end of the epoch "
                f"({total} samples): it was corrupted"
            )


def _whole(key: str, value: object, least: int) -> None:
    limit = _LIMITS[key]
    if not isinstance(value, int) or isinstance(value, bool) or not least <= value < limit:
        raise ResumeStateError(
            f"a loader state's {key!r} is a whole number, {least} <= {key} < 2**"
            f"{limit.bit_length() - 1}; got {value!r:.40}"
        )


def _legacy_message(state: Mapping[str, Any]) -> str:
    if state.get("format") == "chunkd.loader/2":
        return (
            f"this is a chunkd.loader/2 state (epoch {state.get('epoch')!r:.20}, cursor "
            f"{state.get('cursor')!r:.20}); chunkd no longer resumes it: its cursor is a "
            "place in the order whose windows were bounded by units only, and windows "
            "are now bounded by decoded bytes too (window_bytes), so the same cursor of "
            "the same snapshot, seed and epoch would repeat some samples and skip others "
            f"wherever row groups or shards decode to more than a few MiB. Start that "
            f"epoch afresh (set_epoch; {STATE_FORMAT} states are saved from then on), or "
            "finish it with the chunkd that saved it"
        )
    if state.get("format") == "chunkd.loader/1":
        return (
            f"this is a chunkd.loader/1 state (epoch {state.get('epoch')!r:.20}, cursor "
            f"{state.get('cursor')!r:.20}); chunkd no longer resumes it: its cursor is a "
            "place in the order that mixed samples within windows of members, and the "
            "order now mixes them within windows of units (Parquet row groups), so the "
            "same cursor of the same snapshot, seed and epoch would repeat some samples "
            f"and skip others. Start that epoch afresh (set_epoch; {STATE_FORMAT} states "
            "are saved from then on), or finish it with the chunkd that saved it"
        )
    return (
        f"this is a {state.get('format')} state (the torch ShardDataset of chunkd "
        f"before snapshots, epoch {state.get('epoch')!r:.20}, position "
        f"{state.get('position')!r:.20}); chunkd no longer resumes it: its positions "
        "counted Parquet row groups where a sample is now a row, and its order is not "
        f"the snapshot order {STATE_FORMAT} states are places in. Start that epoch "
        "afresh (set_epoch), or finish it with the chunkd that saved it"
    )
