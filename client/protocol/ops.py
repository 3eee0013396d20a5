"""The op table of the local socket: every op, its request fields, answer and errors.

:data:`OPS` is the one definition of what each op takes: the daemon checks every
request against it (:meth:`Op.check`), the client builds every request from it
(:func:`request_header`), and the package's docs list it (:func:`describe_ops`).
The bounds a request can name, and the names of the durability levels and commit
modes, are defined here with it.

One job in ~950 lines: the module is the table, declarations only (each op's fields,
bounds, fds, answer and errors, most of its lines the prose the docs are generated
from); the mechanism that reads it (:meth:`Op.check`, :func:`request_header`,
:func:`describe_ops`) is a few dozen lines. Cut by family, the one list the daemon,
the client and the docs read would be several. An op's handler lives in the daemon
(:mod:`chunkd.gateway.localsock`, one module per family).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from chunkd.client.protocol.fields import MAX_OFFSET, Field
from chunkd.client.protocol.frames import MAX_FDS
from chunkd.errors import (
    ChunkdError,
    InvalidKeyError,
    InvalidRangeError,
    InvalidRequestError,
    ProtocolVersionError,
)

__all__ = [
    "COMMIT_MODES",
    "DURABILITY_LEVELS",
    "FIRST_BATCH_PHASES",
    "INLINE_MAX",
    "JOB_NAME",
    "LIST_PAGE",
    "LOADER_BUCKETS",
    "MAX_DECODED_BYTES",
    "MAX_DECODE_CHUNKS",
    "MAX_DECODE_COLUMNS",
    "MAX_DECODE_FORMAT",
    "MAX_DECODE_INDEX",
    "MAX_DECODE_META",
    "MAX_ID_BYTES",
    "MAX_JOB_BYTES",
    "MAX_LAYOUT",
    "MAX_LIST_PAGE",
    "MAX_NAME_BYTES",
    "MAX_PREFETCH_QUEUED",
    "MAX_PREFETCH_RANGES",
    "MAX_RANGES",
    "MAX_REPLICAS",
    "MAX_REPORT_STEPS",
    "MAX_SCRUB_PAGE",
    "MAX_SECONDS",
    "MAX_STEP",
    "MAX_WORLD_SIZE",
    "OPS",
    "RESERVED_JOB_NAMES",
    "VERSION",
    "Op",
    "check_job_name",
    "describe_ops",
    "request_header",
]

#: 2: listings come in pages (``start_after``, ``next``); ``readv``; hello first
VERSION: Final = 2
#: reads up to this many bytes may be answered inline rather than with fds
INLINE_MAX: Final = 64 * 1024
#: entries in a listing page when the request names no limit, and the most it may name
LIST_PAGE: Final = 1000
MAX_LIST_PAGE: Final = 10_000
#: ranges in one ``readv``
MAX_RANGES: Final = 256
#: names of one user of the node waiting to be prefetched
MAX_PREFETCH_QUEUED: Final = 100_000
#: ranges of one prefetch request (a data loader's next few steps)
MAX_PREFETCH_RANGES: Final = 4096
#: the phases of a data loader's time to its first batch (``ds_first_batch``)
FIRST_BATCH_PHASES: Final = ("metadata", "worker_start", "first_chunk", "decode", "total")
#: ranks of one checkpoint save
MAX_WORLD_SIZE: Final = 1 << 16
#: the longest job name (``train_job``): accounting labels, not identities
MAX_JOB_BYTES: Final = 128
#: what a job name is made of: a letter or digit, then letters, digits and ``._:@/+-``
JOB_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+-]{0,127}")
#: label values the daemon gives jobs itself: ``other`` (jobs past the top K, folded)
#: and ``none`` (work no job claimed)
RESERVED_JOB_NAMES: Final = ("other", "none")
#: the upper bounds (seconds) of the buckets of ``chunkd_loader_wait_seconds`` and
#: ``chunkd_loader_step_seconds``; a ``loader_report`` counts its steps into these
#: and one more, +Inf
LOADER_BUCKETS: Final = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
#: the most steps one ``loader_report`` may count (a window is seconds, not hours)
MAX_REPORT_STEPS: Final = 1 << 20
#: chunks one ``ckpt_scrub`` request reads (up to a GiB at 4 MiB chunks)
MAX_SCRUB_PAGE: Final = 256
#: the request's ``id``, as JSON: the answer echoes it, so it must leave the answer room
MAX_ID_BYTES: Final = 1024
#: a name a request carries: a backend name, a slash and a key of at most 1024 bytes
MAX_NAME_BYTES: Final = 1200
#: the largest layout or JSON fd a checkpoint request may carry
MAX_LAYOUT: Final = 256 << 20
#: the longest duration a request may name (a grace period, a timeout): ten years
MAX_SECONDS: Final = 10 * 365 * 86400.0
#: a checkpoint's step is a signed 64-bit integer: from ``-MAX_STEP - 1`` to this
MAX_STEP: Final = (1 << 63) - 1
#: the durability levels of a checkpoint save, weakest first: held in the daemon's
#: memory, fsynced on the node's disk, copied to K peers' RAM in other failure
#: domains (``docs/replicas.md``), committed in the backend. Each includes the ones
#: before it (a save already remote counts as replicated).
DURABILITY_LEVELS: Final = ("staged", "local", "replicated", "remote")
#: how a checkpoint save is committed: "auto", by the daemon once every rank is in;
#: "none", by the trainer's own ``ckpt_commit``
COMMIT_MODES: Final = ("auto", "none")
_ID_BYTES: Final = 64
#: a member's address (``host:port``, IPv6 in brackets)
_NODE_BYTES: Final = 300
#: the most replicas a save may ask for
MAX_REPLICAS: Final = 16


def check_job_name(name: str) -> str:
    """``name`` if it is a job name (:data:`JOB_NAME`, not one of
    :data:`RESERVED_JOB_NAMES`).

    Raises:
        InvalidRequestError: it is not, saying why.
    """
    if not JOB_NAME.fullmatch(name):
        raise InvalidRequestError(
            f"train_job {name[:140]!r} is no job name: 1 to {MAX_JOB_BYTES} characters, a "
            "letter or digit first, then letters, digits and ._:@/+-"
        )
    if name in RESERVED_JOB_NAMES:
        raise InvalidRequestError(
            f"train_job {name!r} is a name the daemon gives jobs itself; choose another"
        )
    return name


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
    choices=COMMIT_MODES,
    default="auto",
)
_OVERWRITE = Field(
    "overwrite", "flag", "replace a committed checkpoint of that name", default=False
)
_CKPT_NAME = _name("the checkpoint, ``BACKEND/PATH``")
_OBJECT_NAME = _name("the object, ``BACKEND/KEY``", error=InvalidKeyError)
_TRAIN_JOB = Field(
    "train_job",
    "text",
    "the job this connection's work is accounted to (:data:`JOB_NAME`; a claim for "
    "accounting, not an identity: the daemon records the caller's uid beside it); null: "
    "none",
    high=MAX_JOB_BYTES,
    default=None,
)
_REPORT_JOB = Field(
    "train_job",
    "text",
    "the job reported on (:data:`JOB_NAME`); null: the connection's ``train_job``",
    high=MAX_JOB_BYTES,
    default=None,
)
_FOR_DATASET = Field(
    "dataset",
    "text",
    "the dataset (its name, no version) this read is made for: the daemon accounts its "
    "cost to that name (a hint)",
    high=MAX_NAME_BYTES,
    default=None,
)
_LIMIT = Field("limit", "whole", "entries in the page", low=1, high=MAX_LIST_PAGE, default=None)
_JOB = (
    '``{"ok": true, "job": JOB, "state": STATE, "durability": LEVEL_REACHED, ...}``: the '
    "save job as the daemon sees it"
)
_NAMING = ("UnknownBackendError", "InvalidKeyError", "ReadOnlyBackendError")
#: the longest dataset name (``chunkd.snapshot.MAX_NAME_BYTES``), and dataset version
MAX_DATASET_NAME: Final = 256
MAX_DATASET_VERSION: Final = 10**12 - 1
_DATASET = Field("name", "text", "the dataset, ``NAME``", high=MAX_DATASET_NAME)
#: ``ds_decode``: a format's name; a member's ``meta`` as JSON; columns; a frozen
#: member's chunks (a member of more is decoded in-process: 3 GiB at 4 MiB chunks);
#: a unit index and a decoder version
MAX_DECODE_FORMAT: Final = 32
MAX_DECODE_META: Final = 32 << 10
MAX_DECODE_COLUMNS: Final = 1024
MAX_DECODE_CHUNKS: Final = 768
MAX_DECODE_INDEX: Final = (1 << 31) - 1
#: the largest decoded unit (Arrow IPC bytes) the daemon hands out; a worker writes none
#: larger, and the reader decodes such a unit itself
MAX_DECODED_BYTES: Final = 256 << 20
_REF = Field(
    "ref",
    "text",
    "``NAME``, ``NAME@N``, ``NAME@latest``, ``NAME@TAG`` or a snapshot id",
    high=MAX_DATASET_NAME + 80,
)
_REGISTRY_WRITES = (
    "AccessDeniedError: the name is another user's (docs/security.md)",
    "ReadOnlyBackendError: the registry's backend takes no writes",
    "BackendUnavailableError: the registry cannot be reached",
    "UnknownBackendError",
)

#: every op of the local socket, by name: the one definition of what each takes
OPS: Final[Mapping[str, Op]] = {
    op.name: op
    for op in (
        Op(
            "hello",
            "The first request of every connection.",
            (
                Field(
                    "version",
                    "whole",
                    "the client's protocol version",
                    high=1 << 31,
                    # A client without a version, or with one of another form, is of
                    # another protocol: the same answer as a version other than ours.
                    error=ProtocolVersionError,
                ),
                _TRAIN_JOB,
            ),
            '``{"ok": true, "version": 2, "chunk_bytes": N, "daemon": "chunkd X"}``',
            (
                "ProtocolVersionError: no version, or one other than :data:`VERSION` (or "
                "not a whole number)",
                "InvalidRequestError: a ``train_job`` that is no job name",
            ),
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
                    high=MAX_OFFSET,
                    default=0,
                    error=InvalidRangeError,
                ),
                Field(
                    "length",
                    "whole",
                    "bytes wanted; null: to the end",
                    high=MAX_OFFSET,
                    default=None,
                    error=InvalidRangeError,
                ),
                Field("inline", "flag", "false: always chunks, never inline bytes", default=True),
                Field(
                    "version",
                    "text",
                    "the version the bytes must be of (a pinned read): a daemon that knows "
                    "another version checks the object again first; the answer's "
                    "``version`` says which it read",
                    high=MAX_NAME_BYTES,
                    default=None,
                ),
                Field(
                    "keep",
                    "flag",
                    "false: a metadata read (registration's footers): the bytes are not kept "
                    "in the RAM and disk tiers",
                    default=True,
                ),
                _FOR_DATASET,
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
            (
                Field(
                    "ranges", "ranges", "``[BACKEND/KEY, OFFSET, LENGTH]`` each", high=MAX_RANGES
                ),
                Field(
                    "keep",
                    "flag",
                    "false: a metadata read (registration's footers): the bytes are not kept "
                    "in the RAM and disk tiers",
                    default=True,
                ),
                _FOR_DATASET,
            ),
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
                    "fresh",
                    "flag",
                    "read the backend's listing now, not one the daemon holds (what a "
                    "dataset registration wants)",
                    default=False,
                ),
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
            "Load objects, or byte ranges of them, into the cache in the background.",
            (
                Field(
                    "names", "texts", "``BACKEND/KEY`` each", high=MAX_PREFETCH_QUEUED, default=()
                ),
                Field(
                    "ranges",
                    "ranges",
                    "``[BACKEND/KEY, OFFSET, LENGTH]`` each: the chunks that hold the range",
                    high=MAX_PREFETCH_RANGES,
                    default=(),
                ),
                _FOR_DATASET,
            ),
            '``{"ok": true, "started": N}``: the daemon loads the objects (and the chunks of '
            "each range) a few at a time (``[server] prefetch_per_client`` for the user the "
            "connection comes from, and ``prefetch_in_flight`` for all); at most "
            ":data:`MAX_PREFETCH_QUEUED` names and ranges of one user wait at once.",
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
                Field(
                    "replicas",
                    "whole",
                    "peers in other failure domains whose RAM gets a copy of this part's "
                    "chunks (docs/replicas.md); default: the daemon's [peers] replicas",
                    low=0,
                    high=MAX_REPLICAS,
                    default=None,
                ),
            ),
            _JOB + ", as soon as the bytes are staged.",
            (
                "InvalidRequestError: a rank outside world_size, a layout that is not sealed "
                "JSON or names more than the staged bytes",
                "CheckpointExistsError",
                "AccessDeniedError: overwrite of another user's checkpoint",
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
                    choices=COMMIT_MODES,
                    default=None,
                ),
            ),
            _JOB + ", once it reached ``level`` or failed, or after the timeout, with "
            '``"met": true`` when it is at ``level`` (a save without replicas meets '
            '"replicated" at "local"). A job that failed answers ``"ok": false`` with '
            'its error, and ``"job"``.',
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
            (
                "CheckpointError: a rank's part is missing",
                "CheckpointExistsError",
                "AccessDeniedError: overwrite of another user's checkpoint",
                *_NAMING,
            ),
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
                Field(
                    "save",
                    "text",
                    "the save id of the part the chunks belong to (with node: its replicas "
                    "are asked first)",
                    high=_ID_BYTES,
                    default=None,
                ),
                Field(
                    "node",
                    "text",
                    "the address of the node that saved that part (the part's node)",
                    high=_NODE_BYTES,
                    default=None,
                ),
                Field(
                    "replicas",
                    "whole",
                    "the replicas that part was saved with (the part's replicas)",
                    low=0,
                    high=MAX_REPLICAS,
                    default=None,
                ),
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
            (
                "AccessDeniedError: another user's checkpoint (docs/security.md)",
                "ReadOnlyBackendError",
                "UnknownBackendError",
                "InvalidKeyError",
            ),
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
            (
                "AccessDeniedError: retention would retire another user's checkpoint",
                "ReadOnlyBackendError",
                "UnknownBackendError",
                "BackendUnavailableError",
            ),
            waits=True,
        ),
        Op(
            "ckpt_scrub",
            "Read a page of a backend's chunk store (``chunks/<id>``) and check each chunk "
            "against its name; with ``remove``, delete the damaged ones (the next save or "
            "freeze holding their bytes sends them again). Only an admin may remove.",
            (
                Field("backend", "text", "the backend", high=MAX_NAME_BYTES),
                Field(
                    "start_after",
                    "text",
                    "the key to go on after (the ``next`` of the page before)",
                    high=MAX_NAME_BYTES,
                    default=None,
                ),
                Field(
                    "limit",
                    "whole",
                    "chunks read in this page",
                    low=1,
                    high=MAX_SCRUB_PAGE,
                    default=MAX_SCRUB_PAGE,
                ),
                Field("remove", "flag", "delete the damaged chunks found", default=False),
            ),
            '``{"ok": true, "checked": N, "bytes": N, "damaged": [{"key", "problem"}], '
            '"removed": N, "next": KEY|null}``: ``next`` is the key to send back as '
            "``start_after``, null once the store is done. A key under ``chunks/`` that is no "
            "chunk id is reported, never removed.",
            ("UnknownBackendError", "AccessDeniedError: remove, asked by a non-admin"),
            waits=True,
        ),
        Op(
            "ds_commit",
            "Register a dataset snapshot as the next version of a name. The fd is a memfd "
            "sealed against writes and resizes holding the manifest's canonical bytes (at "
            "most :data:`MAX_LAYOUT`); the daemon takes the snapshot's id from them.",
            (_DATASET,),
            '``{"ok": true, "snapshot": ID, "name": NAME, "version": N, "created": true|false}``; '
            '``"created": false`` when the latest version was this snapshot already (no '
            "new version is made).",
            (
                "ManifestError: the bytes are not a manifest this daemon reads (a shape no "
                "manifest has is refused before it is parsed)",
                "DatasetError: concurrent registrations took every number tried",
                *_REGISTRY_WRITES,
            ),
            fds=(1, 1),
            waits=True,
        ),
        Op(
            "ds_page_put",
            "Store one member page of a schema-2 snapshot in the registry (put if absent; "
            "a damaged copy there is replaced). The fd is a memfd sealed against writes and "
            "resizes holding the page's canonical bytes, at most "
            ":data:`chunkd.snapshot.PAGE_MAX_BYTES`; the daemon checks its shape, takes its "
            "id from its blake3 and refuses a page whose members carry ``content`` (a claim "
            "only the daemon's migrate writes).",
            (),
            '``{"ok": true, "page": ID, "created": true|false}``; ``"created": false`` when '
            "the registry held the page already.",
            (
                "ManifestError: the bytes are not a page (a shape no page has is refused "
                "before it is parsed), or a member claims ``content``",
                "InvalidRequestError: an fd that is not a sealed memfd, or larger than the bound",
                *_REGISTRY_WRITES,
            ),
            fds=(1, 1),
            waits=True,
        ),
        Op(
            "ds_page",
            "One member page of a schema-2 snapshot, by id, held by the daemon like a chunk "
            "(fetched once a node, shared by its readers, served by peers). The daemon does "
            "not check that the page fits a snapshot: the reader does.",
            (
                Field("page", "text", "the page's id, 64 hex digits", high=64),
                Field(
                    "registry",
                    "text",
                    "``BACKEND/PREFIX`` of the registry (``ds_resolve``'s ``registry``); "
                    "default: this daemon's",
                    high=MAX_NAME_BYTES,
                    default=None,
                ),
            ),
            '``{"ok": true, "page": ID, "size": N, "fds": 1}``; the fd is a sealed memfd with '
            "the page's bytes, whose blake3 is ``ID``.",
            (
                "DatasetNotFoundError: no such page in the registry (it names the page)",
                "ManifestError: the registry's copy does not hash to its id",
                "InvalidRequestError: not a page id, or a registry this daemon does not serve",
                "BackendUnavailableError",
            ),
            waits=True,
        ),
        Op(
            "ds_resolve",
            "A snapshot by reference: ``NAME``, ``NAME@N``, ``NAME@latest``, ``NAME@TAG`` or "
            "a snapshot id. Its manifest is checked against its id.",
            (_REF,),
            '``{"ok": true, "snapshot": ID, "name": NAME|null, "version": N|null, "tags": [TAG, '
            '...], "created": T|null, "frozen": true|false, "chunks_backend": B|null, '
            '"registry": "BACKEND/PREFIX", "fds": 1|2}``; fd 1 is a sealed memfd with the '
            "manifest's canonical bytes, and for a frozen snapshot fd 2 one with its frozen "
            'record, JSON ``{"chunk_bytes": N, "backend": B, "members": [[CHUNK_ID, ...], '
            "...]}`` (read the chunks with ``ckpt_chunks`` from backend B). ``name`` and "
            "``version`` are null for an id.",
            (
                "DatasetNotFoundError: no such name, version, tag or snapshot, or its "
                "manifest is missing",
                "ManifestError: the manifest is torn or forged",
                "BackendUnavailableError",
            ),
            waits=True,
        ),
        Op(
            "ds_list",
            "One page of the registered dataset names, in key order, each with its latest version.",
            (
                Field(
                    "prefix",
                    "text",
                    "only names under this one (whole segments)",
                    high=MAX_DATASET_NAME,
                    default=None,
                ),
                Field(
                    "start_after",
                    "text",
                    "the page token (``next``) of the page before",
                    high=MAX_NAME_BYTES + 64,
                    default=None,
                ),
                Field(
                    "limit", "whole", "names in the page", low=1, high=LIST_PAGE, default=LIST_PAGE
                ),
            ),
            '``{"ok": true, "count": N, "next": TOKEN|null}``, payload: a JSON array of '
            '``{"name": NAME, "latest": N, "snapshot": ID, "created": T}``; a name whose latest '
            'pointer is damaged has ``"damaged": {"key": KEY, "error": TEXT}`` and null '
            "``snapshot`` and ``created`` (the page goes on around it). A page may hold fewer "
            "than ``limit`` names, to bound the work of one request; ``next`` is null on "
            "the last page.",
            ("BackendUnavailableError", "UnknownBackendError"),
            waits=True,
        ),
        Op(
            "ds_versions",
            "One page of a dataset's versions, oldest first, with the tags at each.",
            (
                _DATASET,
                Field(
                    "start_after",
                    "whole",
                    "the version number (``next``) the page before ended with",
                    low=1,
                    high=MAX_DATASET_VERSION,
                    default=None,
                ),
                Field(
                    "limit",
                    "whole",
                    "versions in the page",
                    low=1,
                    high=LIST_PAGE,
                    default=LIST_PAGE,
                ),
            ),
            '``{"ok": true, "count": N, "next": N|null}``, payload: a JSON array of '
            '``{"version": N, "snapshot": ID, "created": T, "tags": [TAG, ...]}``; a version '
            'whose pointer is damaged has ``"damaged": {"key": KEY, "error": TEXT}`` and null '
            "``snapshot`` and ``created`` (the page goes on around it).",
            ("DatasetNotFoundError", "BackendUnavailableError"),
            waits=True,
        ),
        Op(
            "ds_tag",
            "Point a tag of a dataset at one of its versions (an append-only history of "
            "put-if-absent entries; the newest wins).",
            (
                _DATASET,
                Field("tag", "text", "the tag: a letter, then letters, digits, . _ -", high=64),
                Field(
                    "ref",
                    "text",
                    "the version: ``N``, ``NAME@N``, ``NAME@TAG`` or ``NAME``",
                    high=MAX_DATASET_NAME + 80,
                ),
            ),
            '``{"ok": true, "name": NAME, "tag": TAG, "seq": S, "version": N, "snapshot": ID}``',
            ("DatasetNotFoundError", "DatasetError", *_REGISTRY_WRITES),
            waits=True,
        ),
        Op(
            "ds_freeze",
            "Copy a snapshot's member bytes into the registry's chunk store, so that it reads "
            "bit-exact after its sources change (idempotent).",
            (_REF,),
            '``{"ok": true, "snapshot": ID, "members": N, "chunks": N, "bytes": N, "uploaded": N, '
            '"uploaded_bytes": N, "already": true|false}``; ``already``: it was frozen, '
            "every chunk there.",
            (
                "SnapshotDriftError: a member changed or vanished (it names the member)",
                "DatasetNotFoundError",
                "ManifestError",
                *_REGISTRY_WRITES,
            ),
            waits=True,
        ),
        Op(
            "ds_migrate",
            "Copy a snapshot to another backend, verify each chunk read back from it, and "
            "register the copy as the next version of the dataset (a frozen snapshot is "
            "copied from its chunks).",
            (
                _REF,
                Field(
                    "to", "text", "``BACKEND/PREFIX`` of a writable backend", high=MAX_NAME_BYTES
                ),
                Field(
                    "name",
                    "text",
                    "the dataset to register the copy under; default: the reference's",
                    high=MAX_DATASET_NAME,
                    default=None,
                ),
            ),
            '``{"ok": true, "snapshot": NEW_ID, "name": NAME, "version": N, "created": true|false, '
            '"from": ID, "frozen": true|false, "members": N, "bytes": N, "copied": N, '
            '"kept": N}``; ``kept``: members already at the destination with the same bytes.',
            (
                "SnapshotDriftError",
                "IntegrityError: a copy read back does not match its source",
                "DatasetNotFoundError",
                "ReservedKeyError: a destination key under chunkd's own prefixes",
                "InvalidKeyError: a destination key that is no key",
                *_REGISTRY_WRITES,
            ),
            waits=True,
        ),
        Op(
            "ds_decode",
            "Unit ``unit`` of a dataset member decoded by the daemon's decode workers, once "
            "per node: the answer carries the unit's table as an Arrow IPC file in a sealed "
            "memfd (docs/decoding.md). The request names every input of the entry's key: the "
            "format and its decoder version, the member record as the manifest holds it, the "
            "unit, the columns, and the source (pinned: ``backend``; frozen: ``registry``, "
            "``chunk_bytes`` and the member's ``chunks``). Where the daemon does not decode it "
            "(its decode pool is off or full, another decoder version, an entry too large), "
            "the answer says so and the reader decodes in-process.",
            (
                Field("format", "text", "the member's format", high=MAX_DECODE_FORMAT),
                Field(
                    "decoder",
                    "whole",
                    "the format's decoder version (``Format.version``)",
                    low=1,
                    high=MAX_DECODE_INDEX,
                ),
                Field("key", "text", "the member's key in its backend", high=MAX_NAME_BYTES),
                Field("size", "whole", "the member's size, bytes", high=MAX_OFFSET),
                Field("version", "text", "the member's version token", high=MAX_NAME_BYTES),
                Field("samples", "whole", "the member's samples", high=MAX_OFFSET),
                Field(
                    "meta",
                    "text",
                    "the member's ``meta`` as a JSON object (``{}`` for none)",
                    high=MAX_DECODE_META,
                ),
                Field("unit", "whole", "the unit (0-based)", high=MAX_DECODE_INDEX),
                Field(
                    "columns",
                    "texts",
                    "the columns, in order; null: all",
                    high=MAX_DECODE_COLUMNS,
                    default=None,
                ),
                Field(
                    "backend",
                    "text",
                    "a pinned member's backend (the member is read at ``version``)",
                    high=MAX_NAME_BYTES,
                    default=None,
                ),
                Field(
                    "registry",
                    "text",
                    "a frozen member's chunk backend (the registry's)",
                    high=MAX_NAME_BYTES,
                    default=None,
                ),
                Field(
                    "chunk_bytes",
                    "whole",
                    "a frozen member's chunk size",
                    low=1,
                    high=1 << 30,
                    default=None,
                ),
                Field(
                    "chunks",
                    "texts",
                    "a frozen member's chunk ids, in order",
                    high=MAX_DECODE_CHUNKS,
                    default=None,
                ),
                _FOR_DATASET,
            ),
            '``{"ok": true, "decoded": true, "key": HEX, "rows": N, "bytes": N, "columns": '
            '[NAME, ...], "from": "decoded"|"held"|"waited", "fds": 1}``: fd 1 is a sealed '
            "memfd holding the table as an Arrow IPC file of ``bytes`` bytes; or "
            '``{"ok": true, "decoded": false, "reason": "off"|"busy"|"format"|"size"|"failed", '
            '"message": TEXT, "fds": 0}``: decode it in-process.',
            (
                "InvalidRequestError: a field out of its bounds, meta that is no JSON object "
                "(or nested too deep), a unit the member does not have, no source or two, "
                "chunks that do not cover the size",
                "DatasetFormatError: the bytes are not what was registered, or a column is "
                "not the member's",
                "SnapshotDriftError: the member's object changed",
                "IntegrityError: a frozen chunk does not match its id",
            ),
            waits=True,
        ),
        Op(
            "ds_decode_report",
            "Count a reader's in-process decodes (its own, where the daemon did not decode "
            'for it) in ``chunkd_dataset_decodes_total{where="reader"}``. A hint, sent at '
            "most once a second by a reader.",
            (Field("decodes", "whole", "units decoded in-process", low=1, high=MAX_DECODE_INDEX),),
            '``{"ok": true}``',
            (),
        ),
        Op(
            "ds_first_batch",
            "Report how long a data loader took to its first batch, by phase, for the "
            "daemon's metrics (``chunkd_dataset_first_batch_seconds``). A hint: it changes "
            "nothing else.",
            (
                *(
                    Field(phase, "number", f"seconds of {phase}", high=MAX_SECONDS, default=None)
                    for phase in FIRST_BATCH_PHASES
                ),
                Field(
                    "rank",
                    "whole",
                    "the trainer's rank whose loader this is: the jobs view shows the "
                    "slowest rank's phases",
                    high=MAX_WORLD_SIZE - 1,
                    default=None,
                ),
                _REPORT_JOB,
            ),
            '``{"ok": true}``',
            (),
        ),
        Op(
            "loader_report",
            "Report how long one rank's trainer waited for data over a window of steps, for "
            "the job it names, else the connection's ``train_job`` (``none`` without one): "
            "``chunkd_loader_wait_seconds`` and ``chunkd_loader_step_seconds``, the worst "
            "ranks, the jobs view (docs/jobs.md). A step's wait runs from the trainer "
            "asking for the next batch to getting it; a step is the time from one batch to "
            "the next. Sent by the loaders' stall meter once a window (seconds), never per "
            "sample. A hint: it changes nothing else.",
            (
                Field("rank", "whole", "the trainer's rank", high=MAX_WORLD_SIZE - 1),
                Field(
                    "world_size",
                    "whole",
                    "the job's ranks",
                    low=1,
                    high=MAX_WORLD_SIZE,
                    default=None,
                ),
                Field("steps", "whole", "steps in the window", high=MAX_REPORT_STEPS),
                Field("wait", "number", "seconds waited for data, all steps", high=MAX_SECONDS),
                Field("step", "number", "seconds of all steps", high=MAX_SECONDS),
                Field(
                    "wait_max",
                    "number",
                    "the longest wait of one step",
                    high=MAX_SECONDS,
                    default=0.0,
                ),
                Field(
                    "wait_buckets",
                    "counts",
                    "the steps whose wait was at most each of :data:`LOADER_BUCKETS`, "
                    "not cumulative, and the rest last",
                    high=len(LOADER_BUCKETS) + 1,
                ),
                Field(
                    "step_buckets",
                    "counts",
                    "the same, of the steps' own times",
                    high=len(LOADER_BUCKETS) + 1,
                ),
                _REPORT_JOB,
                Field(
                    "end",
                    "flag",
                    "this rank's iteration ended (the job ends when all its ranks on the "
                    "node have, or after ``[jobs] idle``)",
                    default=False,
                ),
            ),
            '``{"ok": true, "train_job": LABEL}``: ``LABEL`` is the job\'s label in '
            "``/metrics``: its name, or ``other`` when the top ``[jobs] top`` were "
            "taken at its start",
            (
                "InvalidRequestError: a field out of its bounds, bucket counts that do not "
                "add up to ``steps``, a ``rank`` not below ``world_size``, a ``train_job`` "
                "that is no job name",
            ),
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


def describe_ops() -> str:
    """The list of ops for the protocol's docs, one entry per op of :data:`OPS`."""
    return "\n\nThe ops\n-------\n\n" + "\n".join(op.describe() for op in OPS.values())
