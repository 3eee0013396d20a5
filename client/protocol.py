"""The local socket protocol between trainers and the daemon of their node.

This module is the only one the client and the gateway share; it needs nothing but
the standard library.

Transport: a Unix stream socket (``server.socket``; the client looks at
``$CHUNKD_SOCKET``, then ``/run/chunkd/chunkd.sock``, then ``./chunkd.sock``).

Framing, both ways::

    u32 header_length  (big-endian)
    u32 payload_length (big-endian)
    header             JSON object, UTF-8, at most MAX_HEADER bytes
    payload            raw bytes, at most MAX_PAYLOAD bytes (inline read data)

File descriptors travel with SCM_RIGHTS on the ``sendmsg`` that carries a frame's
first byte; the receiver takes them with the ``recvmsg`` that reads the 8-byte
prefix. A response names how many it carries (``"fds": n``); at most MAX_FDS.

Every request has ``"op"`` and a client-chosen ``"id"`` that its response echoes.
A connection carries one request at a time, and starts with ``hello``: a daemon
answers nothing else before it, and refuses a client of another version (whose
requests it might otherwise answer differently than that client expects, for
example a listing cut to its first page).

Each op, with its request's fields (type, bounds, whether required), its answer and
its errors, is declared once in :data:`OPS`; the list of ops at the end of this
docstring is generated from it. The daemon checks every request against it
(:meth:`Op.check`) and the client builds every request from it
(:func:`request_header`): there is no second list of fields anywhere.

Bounds: every number, count and length a request can name has one, named below
(``MAX_*``); JSON nested deeper than :data:`MAX_DEPTH`, and the non-numbers
``NaN`` and ``Infinity``, are refused.

Errors. Any request may instead get ``{"ok": false, "error": KIND, "message": TEXT}``
(and ``"chunk": ID`` when the error names a chunk): KIND is the name of a class of
the :mod:`chunkd.errors` family, which the client raises (:func:`error_of`). There
is no HTTP status on the socket; that mapping belongs to the HTTP edge alone. A
request with arguments of the wrong type or out of bounds, or a header that is not
a JSON object chunkd takes, gets ``InvalidRequestError``; the connection stays.

A frame that breaks the framing rules is a :class:`~chunkd.errors.ProtocolError`,
and what becomes of the connection depends on whether the stream is still in step:

* **answered, the connection stays** (the whole frame was read, so the next one
  starts where it should): a request that carries a payload, fds on an op that takes
  none (or more than it takes), more than :data:`MAX_FDS` fds (the kernel cut the
  rest). The answer is an error frame of kind ``ProtocolError`` (``"id"`` echoed
  when the header could be read), and the fds that came are closed.
* **the connection is closed** (there is no telling where the next frame starts):
  a prefix whose lengths are over the limits (or a header length of 0), a frame cut
  off by the end of the stream. Nothing else is affected.
"""

from __future__ import annotations

import array
import asyncio
import json
import math
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, NamedTuple

from chunkd.errors import (
    ChunkdError,
    InvalidKeyError,
    InvalidRangeError,
    InvalidRequestError,
    ProtocolError,
    error_class,
)
from chunkd.memfd import close_all

__all__ = [
    "DURABILITY_LEVELS",
    "INLINE_MAX",
    "LIST_PAGE",
    "MAX_DEPTH",
    "MAX_FDS",
    "MAX_HEADER",
    "MAX_LAYOUT",
    "MAX_LIST_PAGE",
    "MAX_NAME_BYTES",
    "MAX_PAYLOAD",
    "MAX_PREFETCH_QUEUED",
    "MAX_RANGES",
    "MAX_SECONDS",
    "MAX_STEP",
    "MAX_WORLD_SIZE",
    "OPS",
    "PREFIX",
    "VERSION",
    "Field",
    "Frame",
    "Op",
    "ProtocolError",
    "RawFrame",
    "check_prefix",
    "decode_header",
    "default_socket_paths",
    "encode_frame",
    "error_answer",
    "error_of",
    "loads",
    "recv_frame",
    "recv_raw",
    "recv_raw_async",
    "request_header",
    "send_frame",
    "send_frame_async",
]

#: 2: listings come in pages (``start_after``, ``next``); ``readv``; hello first
VERSION: Final = 2
PREFIX: Final = struct.Struct(">II")
MAX_HEADER: Final = 64 * 1024
MAX_PAYLOAD: Final = 1 << 20
MAX_FDS: Final = 250  # Linux passes at most 253 fds per message (SCM_MAX_FD)
#: reads up to this many bytes may be answered inline rather than with fds
INLINE_MAX: Final = 64 * 1024
#: entries in a listing page when the request names no limit, and the most it may name
LIST_PAGE: Final = 1000
MAX_LIST_PAGE: Final = 10_000
#: ranges in one ``readv``
MAX_RANGES: Final = 256
#: names of one user of the node waiting to be prefetched
MAX_PREFETCH_QUEUED: Final = 100_000
#: ranks of one checkpoint save
MAX_WORLD_SIZE: Final = 1 << 16
#: JSON nesting (objects and arrays) in a header
MAX_DEPTH: Final = 32
#: a name a request carries: a backend name, a slash and a key of at most 1024 bytes
MAX_NAME_BYTES: Final = 1200
#: the largest layout or JSON fd a checkpoint request may carry
MAX_LAYOUT: Final = 256 << 20
#: the longest duration a request may name (a grace period, a timeout): ten years
MAX_SECONDS: Final = 10 * 365 * 86400.0
#: a checkpoint's step is a signed 64-bit integer: from ``-MAX_STEP - 1`` to this
MAX_STEP: Final = (1 << 63) - 1
#: the durability levels of a checkpoint save, weakest first: held in the daemon's
#: memory, fsynced on the node's disk, committed in the backend. Each includes the
#: ones before it.
DURABILITY_LEVELS: Final = ("staged", "local", "remote")
_MAX_OFFSET: Final = (1 << 63) - 1
_ID_BYTES: Final = 64

# -- the ops -------------------------------------------------------------------------

FieldType = Literal["text", "whole", "number", "flag", "choice", "texts", "ranges"]
_NO_DEFAULT: Final[Any] = object()


@dataclass(frozen=True, slots=True)
class Field:
    """One field of a request: its name, type, bounds and whether it is required.

    ``high`` bounds a ``whole`` or ``number`` (with ``low``), the UTF-8 bytes of a
    ``text``, and the items of a ``texts`` or ``ranges`` list. A ``choice`` is one
    of ``choices``. A field is required when it has no ``default``; a null counts as
    absent. A wrong value raises ``error`` (:class:`~chunkd.errors.InvalidRequestError`
    unless the field names another).
    """

    name: str
    kind: FieldType
    doc: str
    low: float = 0
    high: float = 0
    default: Any = _NO_DEFAULT
    choices: tuple[str, ...] = ()
    error: type[ChunkdError] = InvalidRequestError

    @property
    def required(self) -> bool:
        """Whether a request must carry this field."""
        return self.default is _NO_DEFAULT

    def check(self, header: Mapping[str, Any]) -> Any:
        """The field's value in ``header``, checked; its default when absent or null."""
        value = header.get(self.name)
        if value is None:
            if self.required:
                raise self.error(f"{_show_op(header)} wants {self.name!r}")
            return self.default
        checker = _CHECKS[self.kind]
        return checker(self, value)

    def describe(self) -> str:
        """One line for the docs: name, type, bounds, required or default."""
        if self.kind == "text":
            what = f"string of at most {int(self.high)} bytes"
        elif self.kind == "whole":
            what = f"whole number {_num(self.low)}..{_num(self.high)}"
        elif self.kind == "number":
            what = f"number {_num(self.low)}..{_num(self.high)}"
        elif self.kind == "flag":
            what = "true|false"
        elif self.kind == "choice":
            what = "|".join(f'"{c}"' for c in self.choices)
        elif self.kind == "texts":
            what = f"list of at most {int(self.high)} strings"
        else:
            what = f"list of 1..{int(self.high)} [name, offset, length]"
        need = "required" if self.required else f"default {json.dumps(self.default)}"
        return f"``{self.name}``: {what}, {need}; {self.doc}"

    def _fail(self, what: str, value: object) -> ChunkdError:
        return self.error(f"{self.name} must be {what}; got {_show(value)}")


def _check_text(field: Field, value: object) -> str:
    if not isinstance(value, str):
        raise field._fail("a string", value)
    limit = int(field.high)
    if len(value) > limit or len(value.encode("utf-8", "surrogatepass")) > limit:
        raise field.error(f"{field.name} is longer than {limit} bytes")
    return value


def _is_whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_whole(field: Field, value: object) -> int:
    if not _is_whole(value):
        raise field._fail("a whole number", value)
    assert isinstance(value, int)
    if not field.low <= value <= field.high:
        raise field.error(
            f"{field.name} must be from {_num(field.low)} to {_num(field.high)}; got {value}"
        )
    return value


def _check_number(field: Field, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise field._fail("a number", value)
    # A whole number is compared as it is: it may be too large for a float.
    if not ((isinstance(value, int) or math.isfinite(value)) and field.low <= value <= field.high):
        raise field.error(
            f"{field.name} must be from {field.low:g} to {field.high:g}; got {_show(value)}"
        )
    return float(value)


def _check_flag(field: Field, value: object) -> bool:
    if not isinstance(value, bool):
        raise field._fail("true or false", value)
    return value


def _check_choice(field: Field, value: object) -> str:
    if not isinstance(value, str) or value not in field.choices:
        raise field._fail(" or ".join(repr(c) for c in field.choices), value)
    return value


def _check_texts(field: Field, value: object) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise field._fail("a list of strings", value)
    if len(value) > field.high:
        raise field.error(f"{field.name} holds {len(value)} items; at most {int(field.high)}")
    return value


def _check_ranges(field: Field, value: object) -> list[tuple[str, int, int]]:
    if not isinstance(value, list) or not 0 < len(value) <= field.high:
        raise field.error(
            f"{field.name} must be a list of 1 to {int(field.high)} [name, offset, length]"
        )
    out = []
    for item in value:
        if (
            not isinstance(item, list | tuple)
            or len(item) != 3
            or not isinstance(item[0], str)
            or not all(_is_whole(n) and 0 <= n <= _MAX_OFFSET for n in item[1:])
        ):
            raise field.error(
                f"each of {field.name} is [name, offset, length] with whole numbers >= 0; "
                f"got {_show(item)}"
            )
        out.append((item[0], int(item[1]), int(item[2])))
    return out


_CHECKS: Final[Mapping[str, Any]] = {
    "text": _check_text,
    "whole": _check_whole,
    "number": _check_number,
    "flag": _check_flag,
    "choice": _check_choice,
    "texts": _check_texts,
    "ranges": _check_ranges,
}


@dataclass(frozen=True, slots=True)
class Op:
    """One op of the local socket: its request fields, its answer and its errors.

    ``fds`` is how many fds its request may carry (low, high); ``waits`` says that
    the daemon may hold it long, and stops it if its client goes away meanwhile.
    """

    name: str
    doc: str
    fields: tuple[Field, ...]
    answer: str
    errors: tuple[str, ...] = ()
    fds: tuple[int, int] = (0, 0)
    waits: bool = False

    def check(self, header: Mapping[str, Any]) -> dict[str, Any]:
        """Every field of the request, checked, by name (defaults filled in).

        Raises:
            InvalidRequestError: (or the field's own error) a field is wrong.
        """
        return {field.name: field.check(header) for field in self.fields}

    def field(self, name: str) -> Field:
        """The field called ``name``."""
        return next(f for f in self.fields if f.name == name)

    def describe(self) -> str:
        """This op's entry in the module's docs."""
        lines = [f"``{self.name}``", f"    {self.doc}", ""]
        if self.fields:
            lines += ["    Request fields:", ""]
            lines += [f"    - {f.describe()}" for f in self.fields]
            lines.append("")
        if self.fds != (0, 0):
            low, high = self.fds
            count = str(low) if low == high else f"{low} to {high}"
            lines += [f"    Carries {count} fds (see above).", ""]
        lines += [f"    Answer: {self.answer}", ""]
        if self.errors:
            lines += ["    Errors: " + ", ".join(f"``{e}``" for e in self.errors) + ".", ""]
        return "\n".join(lines)


def _name(doc: str, *, error: type[ChunkdError] = InvalidRequestError) -> Field:
    return Field("name", "text", doc, high=MAX_NAME_BYTES, error=error)


_SAVE_ID = Field("save_id", "text", "the save's id, shared by its ranks", high=_ID_BYTES)
_RANK = Field("rank", "whole", "this rank", high=MAX_WORLD_SIZE - 1, default=0)
_WORLD = Field("world_size", "whole", "ranks in the save", low=1, high=MAX_WORLD_SIZE, default=1)
_COMMIT = Field(
    "commit",
    "choice",
    '"auto": the daemon commits once every rank is in; "none": the trainer calls ckpt_commit',
    choices=("auto", "none"),
    default="auto",
)
_OVERWRITE = Field(
    "overwrite", "flag", "replace a committed checkpoint of that name", default=False
)
_CKPT_NAME = _name("the checkpoint, ``BACKEND/PATH``")
_OBJECT_NAME = _name("the object, ``BACKEND/KEY``", error=InvalidKeyError)
_LIMIT = Field("limit", "whole", "entries in the page", low=1, high=MAX_LIST_PAGE, default=None)
_JOB = (
    '``{"ok": true, "job": JOB, "state": STATE, "durability": LEVEL_REACHED, ...}``: the '
    "save job as the daemon sees it"
)
_NAMING = ("UnknownBackendError", "InvalidKeyError", "ReadOnlyBackendError")

#: every op of the local socket, by name: the one definition of what each takes
OPS: Final[Mapping[str, Op]] = {
    op.name: op
    for op in (
        Op(
            "hello",
            "The first request of every connection.",
            (Field("version", "whole", "the client's protocol version", high=1 << 31),),
            '``{"ok": true, "version": 2, "chunk_bytes": N, "daemon": "chunkd X"}``',
            ("ProtocolVersionError: a version other than :data:`VERSION`",),
        ),
        Op(
            "stat",
            "What the daemon knows of an object's current version.",
            (_OBJECT_NAME,),
            '``{"ok": true, "size": S, "version": V, "chunk_bytes": N, "revalidate": '
            'SECONDS|null, "modified": T|null, "stale": SECONDS|null}``; ``modified`` is when '
            "the object was written (seconds since the epoch), ``stale`` is set when the "
            "backend could not re-check the version and the daemon serves the one it "
            "checked that long ago.",
            (
                "ObjectNotFoundError",
                "UnknownBackendError",
                "InvalidKeyError",
                "BackendUnavailableError",
                "BackendForbiddenError",
            ),
        ),
        Op(
            "read",
            "Bytes of an object, as sealed memfds of whole chunks or inline.",
            (
                _OBJECT_NAME,
                Field(
                    "offset",
                    "whole",
                    "where to start",
                    high=_MAX_OFFSET,
                    default=0,
                    error=InvalidRangeError,
                ),
                Field(
                    "length",
                    "whole",
                    "bytes wanted; null: to the end",
                    high=_MAX_OFFSET,
                    default=None,
                    error=InvalidRangeError,
                ),
                Field("inline", "flag", "false: always chunks, never inline bytes", default=True),
            ),
            'the stat fields and ``"offset": O, "length": L, "spans": [{"chunk": ID, '
            '"index": I, "size": CHUNK_SIZE, "start": A, "stop": B}], "fds": K`` where span '
            "``j`` is bytes ``A..B`` of chunk ``I`` (whose id is ``ID``, ``CHUNK_SIZE`` bytes "
            "long), carried by the ``j``-th fd: a sealed memfd holding the whole chunk, to "
            "be mapped read-only. Small reads (up to :data:`INLINE_MAX`) answer inline "
            'instead (``"fds": 0, "inline": true`` and the bytes as the payload), unless '
            'the request says ``"inline": false`` (a client that caches mappings wants the '
            "chunk). A read covers at most :data:`MAX_FDS` chunks.",
            (
                "InvalidRangeError",
                "RangeNotSatisfiableError: offset past the end",
                "VersionChangedError",
                "IntegrityError",
                "and those of stat",
            ),
        ),
        Op(
            "readv",
            "Several small ranges in one round trip, answered inline.",
            (Field("ranges", "ranges", "``[BACKEND/KEY, OFFSET, LENGTH]`` each", high=MAX_RANGES),),
            '``{"ok": true, "answered": K, "ranges": [{"size": S, "version": V, "offset": O, '
            '"length": L} | {"error": KIND, "message": TEXT}]}`` and the payload holds the '
            "bytes of the first ``K`` ranges, one after the other. ``K`` is as many as fit "
            "in :data:`MAX_PAYLOAD` (at least one, whose length the daemon then cuts to "
            "fit); the client asks again for the rest. A range's own failure is its entry.",
            ("InvalidRequestError",),
        ),
        Op(
            "list",
            "One page of a listing, in key order: one level (objects, and the directories "
            "that hold more), or every object below when recursive.",
            (
                _name("``BACKEND[/PREFIX]``"),
                Field("recursive", "flag", "every object below, not one level", default=False),
                Field(
                    "start_after",
                    "text",
                    "the page token (``next``) of the page before",
                    high=MAX_NAME_BYTES + 8,
                    default=None,
                ),
                Field(
                    "limit",
                    "whole",
                    "entries in the page",
                    low=1,
                    high=MAX_LIST_PAGE,
                    default=LIST_PAGE,
                ),
            ),
            '``{"ok": true, "count": N, "next": KEY|null}`` and a payload, one JSON object '
            'with the entries by column: ``{"backend": B, "keys": [KEY, ...], "sizes": [S, '
            '...], "versions": [V, ...], "modified": [T, ...], "dirs": [I, ...]}``, where '
            "entry ``i`` is ``BACKEND/keys[i]``, ``dirs`` lists the positions of the "
            "directories (whose size is 0 and version and time null), and ``modified`` is "
            "seconds since the epoch. A page may hold fewer entries than ``limit``, to fit "
            "the payload. ``next`` is the page token: send it back as ``start_after`` for "
            "the next page; null on the last page (a full page may be followed by an empty "
            "last one). It is a key of the backend, after which the listing resumes (a "
            "directory's key ends in ``/``).",
            ("UnknownBackendError", "InvalidKeyError", "BackendUnavailableError"),
            waits=True,
        ),
        Op(
            "prefetch",
            "Load objects into the cache in the background.",
            (Field("names", "texts", "``BACKEND/KEY`` each", high=MAX_PREFETCH_QUEUED),),
            '``{"ok": true, "started": N}``: the daemon loads the objects a few at a time '
            "(``[server] prefetch_per_client`` for the user the connection comes from, and "
            "``prefetch_in_flight`` for all); at most :data:`MAX_PREFETCH_QUEUED` names of "
            "one user wait at once.",
            ("UnknownBackendError", "InvalidKeyError"),
        ),
        Op(
            "ckpt_save",
            "Stage one rank's part of a checkpoint. Fd 1 is the layout, JSON "
            '``{"segments": [[OFFSET, SIZE], ...], "tree": ...}`` (at most '
            ":data:`MAX_LAYOUT` bytes); fd 2 the staged bytes. Both are memfds sealed "
            "against writes and resizes (:data:`chunkd.memfd.IMMUTABLE`).",
            (
                _CKPT_NAME,
                Field(
                    "save_id",
                    "text",
                    "the save's id, shared by its ranks; default: a new one",
                    high=_ID_BYTES,
                    default=None,
                ),
                _RANK,
                _WORLD,
                Field(
                    "durability",
                    "choice",
                    "the level the save is done at",
                    choices=DURABILITY_LEVELS,
                    default="remote",
                ),
                _OVERWRITE,
                _COMMIT,
                Field(
                    "step",
                    "whole",
                    "the training step; default: the number in the name",
                    low=-MAX_STEP - 1,
                    high=MAX_STEP,
                    default=None,
                ),
            ),
            _JOB + ", as soon as the bytes are staged.",
            (
                "InvalidRequestError: a rank outside world_size, a layout that is not sealed "
                "JSON or names more than the staged bytes",
                "CheckpointExistsError",
                *_NAMING,
            ),
            fds=(2, 2),
        ),
        Op(
            "ckpt_wait",
            "Wait for a save job to reach a level. A daemon that does not know ``job`` (it "
            "restarted, or forgot the job an hour after it ended) looks for the save that "
            "``name``, ``save_id`` and ``rank`` describe in the backend and answers what "
            "became of it: committed, its part there, or lost.",
            (
                Field("job", "text", "the job a ckpt_save answered", high=_ID_BYTES),
                Field(
                    "level",
                    "choice",
                    "the level to wait for",
                    choices=DURABILITY_LEVELS,
                    default="remote",
                ),
                Field(
                    "timeout",
                    "number",
                    "seconds to wait at most (the daemon holds a "
                    "request 10 s at most: the client asks again)",
                    high=MAX_SECONDS,
                    default=0,
                ),
                Field(
                    "name",
                    "text",
                    "the save's checkpoint, to find it without its job",
                    high=MAX_NAME_BYTES,
                    default=None,
                ),
                Field("save_id", "text", "the save's id (with name)", high=_ID_BYTES, default=None),
                Field(
                    "rank",
                    "whole",
                    "the save's rank (with name)",
                    high=MAX_WORLD_SIZE - 1,
                    default=None,
                ),
                Field(
                    "world_size",
                    "whole",
                    "the save's ranks (with name)",
                    low=1,
                    high=MAX_WORLD_SIZE,
                    default=None,
                ),
                Field(
                    "commit",
                    "choice",
                    "the save's commit mode (with name)",
                    choices=("auto", "none"),
                    default=None,
                ),
            ),
            _JOB + ", once it reached ``level`` or failed, or after the timeout. A job that "
            'failed answers ``"ok": false`` with its error, and ``"job"``.',
            ("CheckpointError: the save failed or was lost", "BackendUnavailableError"),
            waits=True,
        ),
        Op(
            "ckpt_commit",
            "Commit a save whose every rank is in (a save staged with ``commit: none``). An "
            "optional fd holds extra manifest fields: a sealed memfd, a JSON object.",
            (
                _CKPT_NAME,
                _SAVE_ID,
                Field("world_size", "whole", "ranks in the save", low=1, high=MAX_WORLD_SIZE),
                _OVERWRITE,
            ),
            '``{"ok": true, "manifest_id": ID}``, once committed.',
            ("CheckpointError: a rank's part is missing", "CheckpointExistsError", *_NAMING),
            fds=(0, 1),
            waits=True,
        ),
        Op(
            "ckpt_manifest",
            "A committed checkpoint's manifest.",
            (_CKPT_NAME,),
            '``{"ok": true, "fds": 1}`` and the fd: a sealed memfd holding the manifest, JSON.',
            ("CheckpointNotFoundError", "UnknownBackendError", "InvalidKeyError"),
        ),
        Op(
            "ckpt_chunks",
            "Chunks of checkpoints, by id, for a restore.",
            (
                Field("backend", "text", "the backend the checkpoints are in", high=64),
                Field("ids", "texts", "chunk ids, 64 hex digits each", high=MAX_FDS),
            ),
            '``{"ok": true, "sizes": [SIZE, ...]}`` and one sealed memfd per chunk, in order.',
            ("ChunkNotFoundError", "IntegrityError", "UnknownBackendError"),
        ),
        Op(
            "ckpt_list",
            "One page of the checkpoints under a prefix, in the order of their manifest keys.",
            (
                Field("prefix", "text", "``BACKEND[/PREFIX]``", high=MAX_NAME_BYTES),
                Field(
                    "start_after",
                    "text",
                    "the page token (``next``) of the page before",
                    high=MAX_NAME_BYTES + 32,
                    default=None,
                ),
                _LIMIT,
            ),
            '``{"ok": true, "count": N, "next": KEY|null}``, payload: a JSON array of '
            "entries (name, step, sizes, dedup ratio, durability, state, created). A page "
            "holds at most ``limit`` (default :data:`LIST_PAGE`) entries, maybe fewer (even "
            "none) to fit the payload or to bound the work of one request; ``next`` is the "
            "token to send back as ``start_after``, null on the last page. A request "
            "without ``limit`` (an older client, which reads one page) is refused when "
            "there is more than one page, rather than answered in part.",
            ("InvalidRequestError: more than one page and no limit", "UnknownBackendError"),
            waits=True,
        ),
        Op(
            "ckpt_delete",
            "Delete a committed checkpoint (its manifest; gc sweeps its chunks).",
            (_CKPT_NAME,),
            '``{"ok": true, "removed": N}``',
            ("ReadOnlyBackendError", "UnknownBackendError", "InvalidKeyError"),
        ),
        Op(
            "ckpt_gc",
            "Retention, then mark-and-sweep of the chunks no checkpoint references.",
            (
                Field("target", "text", "``BACKEND[/PREFIX]``", high=MAX_NAME_BYTES),
                Field(
                    "keep_last",
                    "whole",
                    "keep the N newest checkpoints under target (by step); null: retire none",
                    high=1 << 31,
                    default=None,
                ),
                Field(
                    "grace",
                    "number",
                    "sweep only chunks older than this (seconds)",
                    high=MAX_SECONDS,
                    default=3600,
                ),
                Field("dry_run", "flag", "report, delete nothing", default=False),
            ),
            '``{"ok": true, "fds": 1}``, the fd a sealed memfd with the JSON report, '
            "whatever the number of checkpoints it retired; payload: the report without "
            'the names (``"retired"``).',
            ("ReadOnlyBackendError", "UnknownBackendError", "BackendUnavailableError"),
            waits=True,
        ),
    )
}


def request_header(op: str, fields: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The header of an ``op`` request with ``fields``, checked against :data:`OPS`.

    Nulls are left out (a null is an absent field). The ``id`` is the sender's.

    Raises:
        InvalidRequestError: (or a field's own error) an unknown op or field, or a
            field that the daemon would refuse.
    """
    spec = OPS.get(op)
    if spec is None:
        raise InvalidRequestError(f"{op!r} is not an op of the local protocol")
    given = {k: v for k, v in (fields or {}).items() if v is not None}
    known = {f.name for f in spec.fields}
    unknown = sorted(set(given) - known)
    if unknown:
        raise InvalidRequestError(f"{op} takes no field {unknown[0]!r}")
    header = {"op": op} | given
    spec.check(header)
    return header


def error_answer(exc: BaseException) -> dict[str, Any]:
    """The error answer to a request that failed with ``exc``: its kind (the class
    name, ``ChunkdError`` for what is not of the family), its message, and the chunk
    id when the error names one."""
    kind = type(exc).__name__ if isinstance(exc, ChunkdError) else "ChunkdError"
    out: dict[str, Any] = {"ok": False, "error": kind, "message": str(exc)}
    chunk = getattr(exc, "chunk_id", None)
    if chunk is not None:
        out["chunk"] = str(chunk)
    return out


def error_of(answer: Mapping[str, Any], what: str) -> ChunkdError:
    """The :mod:`chunkd.errors` exception an error answer (or readv entry) names, with
    the daemon's message (``what`` was asked says it when there is none)."""
    kind = answer.get("error")
    message = answer.get("message") or f"the chunkd daemon refused {what} ({kind})"
    error = error_class(kind)(str(message))
    if isinstance(answer.get("chunk"), str):
        error.chunk_id = answer["chunk"]  # type: ignore[attr-defined]
    return error


def _render() -> str:
    return "\n\nThe ops\n-------\n\n" + "\n".join(op.describe() for op in OPS.values())


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _show_op(header: Mapping[str, Any]) -> str:
    op = header.get("op")
    return op[:40] if isinstance(op, str) else "the request"


# -- framing ---------------------------------------------------------------------------


class RawFrame(NamedTuple):
    """A frame as it came: the header undecoded, and whether the kernel cut its fds."""

    header: bytes
    payload: bytes
    fds: list[int]
    fds_cut: bool


class Frame(NamedTuple):
    """A frame: its header, payload and the fds that came with it (the receiver's)."""

    header: dict[str, Any]
    payload: bytes
    fds: list[int]


def default_socket_paths() -> list[Path]:
    """Where a client looks for the daemon, in order."""
    paths = []
    env = os.environ.get("CHUNKD_SOCKET")
    if env:
        paths.append(Path(env))
    paths += [Path("/run/chunkd/chunkd.sock"), Path("chunkd.sock")]
    return paths


def encode_frame(header: dict[str, Any], payload: bytes | memoryview = b"") -> bytes:
    """One frame: prefix, JSON header, payload."""
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if len(body) > MAX_HEADER:
        raise ProtocolError(f"header of {len(body)} bytes exceeds {MAX_HEADER}")
    if len(payload) > MAX_PAYLOAD:
        raise ProtocolError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return PREFIX.pack(len(body), len(payload)) + body + bytes(payload)


def decode_header(raw: bytes) -> dict[str, Any]:
    """Parse a frame's header.

    Raises:
        ProtocolError: it is not a JSON object, nests deeper than :data:`MAX_DEPTH`,
            or holds ``NaN``, ``Infinity`` or a number too large for a float.
    """
    header = loads(raw)
    if not isinstance(header, dict):
        raise ProtocolError("frame header is not a JSON object")
    # Only a header with many brackets can nest deep; most have a handful.
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and _depth(header) > MAX_DEPTH:
        raise ProtocolError(f"frame header nests JSON deeper than {MAX_DEPTH} levels")
    return header


def loads(raw: bytes) -> Any:
    """JSON as chunkd takes it: numbers are finite (no ``NaN``, ``Infinity``, ``1e400``).

    Raises:
        ProtocolError: ``raw`` is not such JSON (or nests deeper than the parser goes).
    """
    try:
        return json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"not JSON chunkd takes: {exc}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number chunkd takes")


def _finite(text: str) -> float:
    value = float(text)
    if value in (math.inf, -math.inf):
        raise ValueError(f"{text[:20]} is out of range of a number chunkd takes")
    return value


def _depth(value: Any) -> int:
    """How deep objects and arrays nest in ``value`` (counted to MAX_DEPTH + 1 at most)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                break
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


def check_prefix(header_length: int, payload_length: int) -> None:
    """Raise :class:`ProtocolError` for lengths beyond the limits (the stream is lost)."""
    if not 0 < header_length <= MAX_HEADER:
        raise ProtocolError(f"header length {header_length} outside 1..{MAX_HEADER}")
    if not 0 <= payload_length <= MAX_PAYLOAD:
        raise ProtocolError(f"payload length {payload_length} outside 0..{MAX_PAYLOAD}")


def send_frame(
    sock: socket.socket,
    header: dict[str, Any],
    payload: bytes | memoryview = b"",
    fds: list[int] | None = None,
) -> None:
    """Send one frame on a blocking socket, with ``fds`` on its first byte."""
    data = memoryview(encode_frame(header, payload))
    if fds:
        if len(fds) > MAX_FDS:
            raise ProtocolError(f"{len(fds)} fds exceed {MAX_FDS}")
        sent = sock.sendmsg([data], _ancillary(fds))
        data = data[sent:]
    if data:
        sock.sendall(data)


async def send_frame_async(
    sock: socket.socket, frame: bytes, fds: list[int], *, stall_limit: float
) -> None:
    """Send an encoded ``frame`` on a non-blocking socket, with ``fds`` on its first
    byte; :class:`TimeoutError` when the peer reads nothing for ``stall_limit`` s."""
    loop = asyncio.get_running_loop()
    view = memoryview(frame)
    ancillary = _ancillary(fds) if fds else []
    while view:
        try:
            sent = sock.sendmsg([view], ancillary)
        except BlockingIOError:
            await _ready(loop, sock, write=True, limit=stall_limit)
            continue
        ancillary = []  # the fds went with the first bytes
        view = view[sent:]


def recv_frame(sock: socket.socket) -> Frame:
    """Receive one frame on a blocking socket: header, payload, fds.

    Raises:
        ConnectionError: the peer closed the connection.
        ProtocolError: the frame breaks the protocol.
    """
    raw = recv_raw(sock)
    if raw.fds_cut:
        close_all(raw.fds)
        raise ProtocolError(f"more than {MAX_FDS} fds came with a frame", in_sync=True)
    try:
        return Frame(decode_header(raw.header), raw.payload, raw.fds)
    except BaseException:
        close_all(raw.fds)
        raise


def recv_raw(sock: socket.socket) -> RawFrame:
    """Receive one frame on a blocking socket, its header undecoded.

    Raises:
        ConnectionError: the peer closed the connection (before or inside the frame).
        ProtocolError: the prefix breaks the limits (the stream is lost).
    """
    fds: list[int] = []
    cut = False
    try:
        prefix = b""
        while len(prefix) < PREFIX.size:
            data, ancillary, flags, _ = sock.recvmsg(PREFIX.size - len(prefix), _FD_SPACE)
            cut |= _take_fds(ancillary, flags, fds)
            if not data:
                raise ConnectionError("the peer closed the connection")  # noqa: TRY301
            prefix += data
        header_length, payload_length = PREFIX.unpack(prefix)
        check_prefix(header_length, payload_length)
        header = _recv_exact(sock, header_length)
        payload = _recv_exact(sock, payload_length) if payload_length else b""
    except BaseException:
        close_all(fds)
        raise
    return RawFrame(header, payload, fds, cut)


async def recv_raw_async(sock: socket.socket) -> RawFrame | None:
    """:func:`recv_raw` on a non-blocking socket in the running loop; None when the
    peer closed the connection cleanly, between frames."""
    loop = asyncio.get_running_loop()
    fds: list[int] = []
    cut = False
    try:
        prefix = b""
        while len(prefix) < PREFIX.size:
            try:
                data, ancillary, flags, _ = sock.recvmsg(PREFIX.size - len(prefix), _FD_SPACE)
            except BlockingIOError:
                await _ready(loop, sock, write=False, limit=None)
                continue
            cut |= _take_fds(ancillary, flags, fds)
            if not data:
                if prefix:
                    raise ConnectionError("the peer closed the connection mid-frame")  # noqa: TRY301
                close_all(fds)
                return None
            prefix += data
        header_length, payload_length = PREFIX.unpack(prefix)
        check_prefix(header_length, payload_length)
        header = await _recv_exact_async(loop, sock, header_length)
        payload = await _recv_exact_async(loop, sock, payload_length) if payload_length else b""
    except BaseException:
        close_all(fds)
        raise
    return RawFrame(header, payload, fds, cut)


_FD_SPACE: Final = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)


def _ancillary(fds: list[int]) -> list[tuple[int, int, array.array[int]]]:
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]


def _take_fds(ancillary: list[tuple[int, int, bytes]], flags: int, into: list[int]) -> bool:
    """Add the fds of one ``recvmsg`` to ``into``; True if the kernel cut some off."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(data[: len(data) - len(data) % got.itemsize])
            into.extend(got)
    return bool(flags & socket.MSG_CTRUNC)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection mid-frame")
        got += n
    return bytes(buf)


async def _recv_exact_async(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, size: int
) -> bytes:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection mid-frame")
        got += n
    return bytes(buf)


async def _ready(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, *, write: bool, limit: float | None
) -> None:
    """Wait until ``sock`` is writable (or readable); TimeoutError after ``limit`` s."""
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    fd = sock.fileno()
    if write:
        loop.add_writer(fd, wake)
    else:
        loop.add_reader(fd, wake)
    try:
        async with asyncio.timeout(limit):
            await ready
    except TimeoutError:
        raise TimeoutError(f"the peer read nothing for {limit:g}s; it was dropped") from None
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


__doc__ = (__doc__ or "") + _render()
