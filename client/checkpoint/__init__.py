"""Checkpoints through chunkd: save, async_save, load and load_into.

::

    from chunkd.client import checkpoint

    handle = checkpoint.async_save(model.state_dict(), "ckpt/run1/step-100")
    ...                                   # training goes on; tensors may change at once
    handle.wait()                         # committed in the backend (durability="remote")
    state = checkpoint.load("ckpt/run1/step-100")
    checkpoint.load_into(model.state_dict(), "ckpt/run1/step-100")   # in place

The trainer's only blocking cost is a copy of its tensors into one memfd, which is
then sealed and handed to the daemon with its layout. The daemon chunks, hashes,
deduplicates, writes to disk, uploads and commits (see
:mod:`chunkd.gateway.checkpoints.save` for the commit protocol and
``docs/checkpoints.md`` for the format). The trainer may exit, or be killed, once
:func:`async_save` has returned: the daemon holds the bytes.

What a state dict may hold: dicts (``str`` or ``int`` keys), lists, tuples, ``None``,
``bool``, ``int``, ``float``, ``str``, ``bytes``, ``torch.dtype``, torch tensors of any
dtype on any device (strided, not quantized; they load on the CPU unless
``map_location`` says otherwise), numpy arrays and numpy scalars (not of object or
structured dtypes). Anything else fails before a byte is staged, naming its key path.
The same tensor reached twice (tied weights: same storage, offset, shape, strides and
dtype) is stored once and loads as one tensor; other views are saved as their own
values.

Layout staged for the daemon: tensors of at least :data:`OWN_SEGMENT_BYTES` get a
segment each (a changed tensor changes only its own chunks, so a step that changes
a quarter of the weights uploads about a quarter); smaller values are packed
together, 64-byte aligned, into shared segments of up to ``chunk_bytes``.

The rooms, each one job, none importing a room after it in this list:

- :mod:`.process`: the process's default connection to the daemon and its rank under
  ``torch.distributed``;
- :mod:`.views`: tensors and arrays as bytes;
- :mod:`.encode`: a state dict into a tree and the arrays to stage, checked;
- :mod:`.staging`: the layout of the staged memfd, the copy into it, the spare memfd;
- :mod:`.saving`: :func:`async_save`, :func:`save`, :func:`commit`, :class:`SaveHandle`;
- :mod:`.catalog`: :func:`manifest`, :func:`list`, :func:`pages`, :func:`gc`, :func:`scrub`,
  :func:`delete`;
- :mod:`.reader`: a part's bytes, copied out of the daemon's chunks;
- :mod:`.decode`: a part's tree into new values or into a state dict in place;
- :mod:`.loading`: :func:`load`, :func:`load_into`, :class:`CheckpointReader`.

Callers use only the names exported here. (The rooms are not named ``save.py`` or
``load.py``: a submodule of that name would share its attribute on this package with
the function :func:`save` or :func:`load`.)
"""

from __future__ import annotations

from chunkd.client.checkpoint.catalog import delete, gc, list, manifest, pages, scrub
from chunkd.client.checkpoint.loading import CheckpointReader, load, load_into
from chunkd.client.checkpoint.saving import (
    SaveHandle,
    SaveResult,
    async_save,
    commit,
    save,
)
from chunkd.client.checkpoint.staging import OWN_SEGMENT_BYTES

__all__ = [
    "OWN_SEGMENT_BYTES",
    "CheckpointReader",
    "SaveHandle",
    "SaveResult",
    "async_save",
    "commit",
    "delete",
    "gc",
    "list",
    "load",
    "load_into",
    "manifest",
    "pages",
    "save",
    "scrub",
]
