"""The registry's small documents (version pointers, tag entries, hints, frozen
records), read at a cost bounded before the read.

A document of at most a bound's bytes is read (:func:`read_document`: a ranged read,
or the size a listing gave, before any read), its shape checked before it is parsed
(:func:`load_document`); one over the bound, or not the JSON chunkd writes, is a
:class:`~chunkd.errors.ManifestError` that names it (*damaged*), never more read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from chunkd.errors import ManifestError, RangeNotSatisfiableError, VersionChangedError
from chunkd.ranges import ByteRange
from chunkd.snapshot import check_json_shape, load_json

if TYPE_CHECKING:
    from chunkd.gateway.backends import Backend, ObjectMeta

__all__ = ["DOCUMENT_BYTES", "load_document", "read_document"]

#: the most bytes of a version pointer or tag entry read (chunkd writes 200-600)
DOCUMENT_BYTES: Final = 4096
#: how deep a pointer or tag entry may nest (chunkd writes flat objects)
_DOCUMENT_DEPTH: Final = 4
# Reads of a document replaced while it was being read, before the error is the caller's.
_REREADS: Final = 4


async def read_document(
    backend: Backend, key: str, *, limit: int = DOCUMENT_BYTES, meta: ObjectMeta | None = None
) -> memoryview | None:
    """The bytes of a registry document of at most ``limit`` bytes (None: there is no
    such object), never more: one over the bound is refused without being read whole.

    ``meta``: what a listing said of the object; one over the bound is then refused
    before any read, and one within it is read at that version (one request). Without
    it, the first ``limit + 1`` bytes are read (a ranged read).

    Raises:
        ManifestError: the object holds more than ``limit`` bytes.
        BackendUnavailableError, BackendForbiddenError
    """
    if meta is not None and meta.size > limit:
        raise _oversized(key, f"{meta.size} bytes", limit)
    if meta is not None:
        try:
            raw = await backend.get(key, version=meta)
        except VersionChangedError:
            raw = None  # rewritten since it was listed: read it again, by range
        if raw is not None:
            return raw
    for attempt in range(_REREADS):
        try:
            raw = await backend.get(key, ByteRange(0, limit + 1))
            break
        except RangeNotSatisfiableError:  # an empty object
            return memoryview(b"")
        except VersionChangedError:
            # Replaced while it was read (a hint rewritten by a commit on another node):
            # each read is of one whole version, so reading again is all there is to do.
            if attempt == _REREADS - 1:
                raise
    if raw is not None and len(raw) > limit:
        raise _oversized(key, f"more than {limit} bytes", limit)
    return raw


def _oversized(key: str, held: str, limit: int) -> ManifestError:
    return ManifestError(
        f"the registry's {key} is damaged: it holds {held}, and no document chunkd writes "
        f"there is over {limit}; it was not read: register (or tag) again"
    )


def load_document(
    raw: memoryview | bytes,
    key: str,
    required: tuple[str, ...] = (),
    *,
    max_depth: int = _DOCUMENT_DEPTH,
) -> dict[str, Any]:
    """A registry document's JSON object, which must hold ``required``: its shape
    checked before it is parsed (an object, nested at most ``max_depth`` deep: no
    ``RecursionError``, whatever the bytes), and any failure a
    :class:`~chunkd.errors.ManifestError` naming ``key``.

    The caller bounds the bytes first (:func:`read_document`). For a frozen record,
    whose chunk lists nest 2 deep: ``load_document(raw, key, ("members",),
    max_depth=4)``, in a thread (it may be megabytes).

    Raises:
        ManifestError: it is not the JSON object chunkd writes.
    """
    data = bytes(raw)
    try:
        check_json_shape(data, f"the registry's {key}", max_depth=max_depth, top=b"{")
        doc = load_json(data, f"the registry's {key}", max_depth=max_depth, checked=True)
    except ManifestError:
        doc = None
    if not isinstance(doc, dict) or any(k not in doc for k in required):
        raise ManifestError(
            f"the registry's {key} is damaged (not the JSON chunkd wrote); nothing was read "
            "from it: register or tag again"
        )
    if "id" in doc and not (isinstance(doc["id"], str) and len(doc["id"]) == 64):
        raise ManifestError(f"the registry's {key} names no snapshot id; register again")
    return doc
