"""Checkpoints saved through the daemon, committed atomically, loaded back, listed and
garbage-collected. ``docs/checkpoints.md`` is the format and the commit protocol.

The rooms, each one job, none importing a room above it:

- :mod:`.model`: the layout in a backend, :class:`Durability`, :class:`SaveRequest`
  and :class:`SaveJob`;
- :mod:`.jobs`: the jobs a daemon knows, their background tasks, the retry of a step
  whose backend is down, the bounded fan-out of backend reads;
- :mod:`.journal`: the jobs' journal on the node's disk;
- :mod:`.barrier`: the barrier between a collection and the saves;
- :mod:`.save`: the commit protocol from staged bytes to the part (steps 1-7, 9);
- :mod:`.commit`: the coordinator's manifest (step 8);
- :mod:`.wait`: how far a save is, also after a restart;
- :mod:`.restore`: manifests and chunks read back;
- :mod:`.catalog`: listing and deleting;
- :mod:`.gc`: retention, mark and sweep;
- :mod:`.store`: :class:`Checkpoints`, which composes them.

The daemon's doors (the local socket's ``ckpt_*`` ops, the HTTP routes) use only the
names exported here.
"""

from __future__ import annotations

from chunkd.gateway.checkpoints.model import (
    MAX_SEGMENTS,
    MAX_STAGED_BYTES,
    MAX_STEP,
    SCHEMA,
    Durability,
    SaveJob,
    SaveRequest,
    check_save_id,
)
from chunkd.gateway.checkpoints.store import Checkpoints

__all__ = [
    "MAX_SEGMENTS",
    "MAX_STAGED_BYTES",
    "MAX_STEP",
    "SCHEMA",
    "Checkpoints",
    "Durability",
    "SaveJob",
    "SaveRequest",
    "check_save_id",
]
