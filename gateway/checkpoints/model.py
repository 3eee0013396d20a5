"""The checkpoint format's model: where things live in a backend, and the values that
describe a save (``docs/checkpoints.md`` is the format itself).

Layout under a backend's prefix::

    chunks/<id>                                      one chunk's bytes
    checkpoints/<PATH>/manifest.json                 the commit point of BACKEND/PATH
    checkpoints/<PATH>/parts/<save_id>/<rank>.json   one rank's part of a save
    intents/<save_id>.<rank>.json                    a save's chunk ids
    gc/<run>.json                                    a garbage collection's barrier
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import mmap
import re
import time
import uuid
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Final

from chunkd.cache import ChunkId
from chunkd.canonical import canonical
from chunkd.client.protocol import (
    COMMIT_MODES,
    DURABILITY_LEVELS,
    MAX_REPLICAS,
    MAX_STEP,
    MAX_WORLD_SIZE,
)
from chunkd.errors import ChunkdError, InvalidRequestError
from chunkd.gateway import arguments as arg
from chunkd.gateway.chunkstore import CHUNKS
from chunkd.gateway.names import checkpoint_name

__all__ = [
    "CHECKPOINTS",
    "CHUNKS",
    "GC_BARRIERS",
    "INTENTS",
    "MANIFEST",
    "MANIFEST_KEYS",
    "MAX_SEGMENTS",
    "MAX_STAGED_BYTES",
    "MAX_STEP",
    "PART_RE",
    "SAVE_ID_RE",
    "SCHEMA",
    "Durability",
    "SaveJob",
    "SaveRequest",
    "check_save_id",
    "dumps",
    "is_manifest",
    "manifest_key",
    "part_rank",
    "parts_prefix",
    "path_of_manifest",
    "step_of",
]

SCHEMA: Final = 1
CHECKPOINTS: Final = "checkpoints/"
INTENTS: Final = "intents/"
MANIFEST: Final = "manifest.json"
GC_BARRIERS: Final = "gc/"
#: the top-level keys of a manifest that chunkd writes (extra fields may not replace them)
MANIFEST_KEYS: Final = frozenset(
    {
        "format",
        "schema",
        "name",
        "save_id",
        "world_size",
        "step",
        "created",
        "logical_bytes",
        "new_bytes",
        "parts",
        "owner",
    }
)
#: the key of a part, from its ``/parts/`` on
PART_RE: Final = re.compile(r"/parts/[A-Za-z0-9_-]{1,64}/(0|[1-9][0-9]{0,5})\.json$")
SAVE_ID_RE: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")
_STEP_RE: Final = re.compile(r"(\d+)\D*$")
#: segments one save request may name
MAX_SEGMENTS: Final = 1 << 20
#: the largest offset or size a segment may name (256 TiB)
MAX_STAGED_BYTES: Final = 1 << 48


def manifest_key(path: str) -> str:
    """The key of checkpoint ``PATH``'s manifest: its commit point."""
    return f"{CHECKPOINTS}{path}/{MANIFEST}"


def is_manifest(key: str) -> bool:
    """Whether backend key ``key`` is a checkpoint's manifest."""
    return key.startswith(CHECKPOINTS) and key.endswith("/" + MANIFEST)


def path_of_manifest(key: str) -> str:
    """The checkpoint ``PATH`` whose manifest is at ``key``."""
    return key[len(CHECKPOINTS) : -len("/" + MANIFEST)]


def parts_prefix(path: str, save_id: str) -> str:
    """Where the parts of save ``save_id`` of checkpoint ``PATH`` go."""
    return f"{CHECKPOINTS}{path}/parts/{save_id}/"


class Durability(IntEnum):
    """How safe a save is; each level includes the ones below it.

    The wire names are :data:`~chunkd.client.protocol.DURABILITY_LEVELS`, weakest
    first; the members are written out (so that a type checker sees them) and
    checked against that list when this module loads.
    """

    STAGED = 1  # in the daemon's memory
    LOCAL = 2  # fsynced on this node's disk; survives a daemon kill -9
    REPLICATED = 3  # local, and pushed to K peers' RAM (docs/replicas.md)
    REMOTE = 4  # committed in the backend (includes replicated)

    @classmethod
    def parse(cls, text: object) -> Durability:
        """A wire name of :data:`~chunkd.client.protocol.DURABILITY_LEVELS`."""
        if isinstance(text, str) and text in DURABILITY_LEVELS:
            return cls(DURABILITY_LEVELS.index(text) + 1)
        names = ", ".join(repr(n) for n in DURABILITY_LEVELS)
        raise InvalidRequestError(f"durability must be one of {names}; got {str(text)[:40]!r}")

    @property
    def wire_name(self) -> str:
        """The level's name on the wire and in manifests."""
        return DURABILITY_LEVELS[self - 1]


if tuple(level.name.lower() for level in Durability) != DURABILITY_LEVELS:
    raise AssertionError("Durability's members must be protocol.DURABILITY_LEVELS, in order")


def step_of(path: str) -> int | None:
    """The step a checkpoint's path names: the trailing number of its last component."""
    found = _STEP_RE.search(path.rsplit("/", 1)[-1])
    if not found or len(found.group(1)) > 19:
        return None
    step = int(found.group(1))
    return step if step <= MAX_STEP else None


def check_save_id(save_id: str) -> str:
    """Return ``save_id`` if it is 1-64 of ``[A-Za-z0-9_-]``; InvalidRequestError otherwise.

    A save id is a path component of the part keys, so nothing else may be in it.
    """
    if not SAVE_ID_RE.fullmatch(save_id):
        raise InvalidRequestError(f"save_id {save_id[:80]!r} must be 1-64 of [A-Za-z0-9_-]")
    return save_id


@dataclass
class SaveRequest:
    """One rank's part of a checkpoint, as the client described it."""

    backend: str
    path: str
    save_id: str
    rank: int
    world_size: int
    durability: Durability
    overwrite: bool
    #: one of :data:`~chunkd.client.protocol.COMMIT_MODES`. "auto": the coordinator
    #: commits once every part is in; "none": a separate commit request does
    #: (torch.distributed.checkpoint's ``finish``)
    commit: str
    step: int | None
    #: (offset, size) of each segment in the staged memfd
    segments: list[tuple[int, int]]
    #: the state tree (opaque to the daemon; the client encodes and decodes it)
    tree: Any
    #: the uid of the process that asked for the save (the kernel's word, never the
    #: client's): the manifest's ``owner``; None for a save journaled before owners
    uid: int | None = None
    #: whether that process was an admin (docs/security.md): it may replace a
    #: checkpoint another user made
    admin: bool = False
    #: peers whose RAM gets a copy of the part's chunks (docs/replicas.md); None: the
    #: daemon's ``[peers] replicas`` (the saver sets it); a journal without it: 0
    replicas: int | None = None
    #: the saving node's peer address (the part's ``node``), where there are peers
    node: str | None = None
    #: the order of this node's saves (ns since the epoch when it was asked for; the
    #: saver sets it, the journal keeps it): a replica holder lets a save go only
    #: for a later one; 0: journaled before replicas (the oldest)
    seq: int = 0

    @property
    def name(self) -> str:
        """``BACKEND/PATH``."""
        return f"{self.backend}/{self.path}"

    @property
    def prefix(self) -> str:
        """The checkpoint's directory in the backend."""
        return f"{CHECKPOINTS}{self.path}/"

    @property
    def manifest_key(self) -> str:
        """Where the checkpoint's manifest goes."""
        return manifest_key(self.path)

    @property
    def part_key(self) -> str:
        """Where this rank's part manifest goes."""
        return f"{parts_prefix(self.path, self.save_id)}{self.rank}.json"

    @property
    def intent_key(self) -> str:
        """Where this rank's intent goes while the save is in flight."""
        return f"{INTENTS}{self.save_id}.{self.rank}.json"

    def to_json(self) -> dict[str, Any]:
        """The request as the journal keeps it."""
        return {
            "backend": self.backend,
            "path": self.path,
            "save_id": self.save_id,
            "rank": self.rank,
            "world_size": self.world_size,
            "durability": self.durability.wire_name,
            "overwrite": self.overwrite,
            "commit": self.commit,
            "step": self.step,
            "segments": [list(s) for s in self.segments],
            "tree": self.tree,
            "uid": self.uid,
            "admin": self.admin,
            "replicas": self.replicas,
            "node": self.node,
            "seq": self.seq,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> SaveRequest:
        """Parse and check a request (from the client or the journal).

        Every number and count is bounded: ``world_size`` by
        :data:`~chunkd.client.protocol.MAX_WORLD_SIZE`, the segments by
        :data:`MAX_SEGMENTS` and :data:`MAX_STAGED_BYTES`, ``step`` by :data:`MAX_STEP`.

        Raises:
            InvalidRequestError, InvalidKeyError: the request is malformed or out of bounds.
        """
        backend, path = checkpoint_name(f"{doc.get('backend')}/{doc.get('path')}")
        save_id = arg.optional_text(doc, "save_id", max_bytes=64) or uuid.uuid4().hex
        world = arg.whole(doc, "world_size", low=1, high=MAX_WORLD_SIZE, default=1)
        rank = arg.whole(doc, "rank", low=0, high=MAX_WORLD_SIZE - 1, default=0)
        if rank >= world:
            raise InvalidRequestError(f"rank {rank} is outside world_size {world}")
        commit = doc.get("commit", "auto")
        if commit not in COMMIT_MODES:
            modes = " or ".join(repr(m) for m in COMMIT_MODES)
            raise InvalidRequestError(f"commit must be {modes}; got {str(commit)[:40]!r}")
        step = doc.get("step")
        return cls(
            backend=backend,
            path=path,
            save_id=check_save_id(save_id),
            rank=rank,
            world_size=world,
            durability=Durability.parse(doc.get("durability", "remote")),
            overwrite=arg.flag(doc, "overwrite"),
            commit=str(commit),
            step=step_of(path)
            if step is None
            else arg.whole(doc, "step", low=-MAX_STEP - 1, high=MAX_STEP),
            segments=_segments(doc.get("segments")),
            tree=doc.get("tree"),
            # Only the journal holds these: the local socket sets them from the kernel.
            uid=None
            if doc.get("uid") is None
            else arg.whole(doc, "uid", low=0, high=(1 << 32) - 1),
            admin=arg.flag(doc, "admin"),
            replicas=None
            if doc.get("replicas") is None
            else arg.whole(doc, "replicas", low=0, high=MAX_REPLICAS),
            node=arg.optional_text(doc, "node", max_bytes=300),
            seq=arg.whole(doc, "seq", low=0, high=(1 << 63) - 1, default=0),
        )


def _segments(raw: object) -> list[tuple[int, int]]:
    """The (offset, size) pairs of a request, checked against their bounds."""
    if not isinstance(raw, list) or len(raw) > MAX_SEGMENTS:
        raise InvalidRequestError(
            f"a save's segments are a list of at most {MAX_SEGMENTS} [offset, size] pairs"
        )
    segments = []
    for item in raw:
        if (
            not isinstance(item, list | tuple)
            or len(item) != 2
            or any(
                isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_STAGED_BYTES
                for n in item
            )
        ):
            raise InvalidRequestError(
                f"a segment is [offset, size], whole numbers from 0 to {MAX_STAGED_BYTES}; "
                f"got {str(item)[:60]}"
            )
        segments.append((int(item[0]), int(item[1])))
    return segments


@dataclass
class SaveJob:
    """One rank's save as it moves through the commit protocol."""

    id: str
    request: SaveRequest
    #: chunk ids and sizes of each segment, once hashed
    chunks: list[list[tuple[ChunkId, int]]] = field(default_factory=list)
    level: int = 0
    state: str = "staged"
    error: ChunkdError | None = None
    logical: int = 0
    new: int = 0
    #: bytes of the part's distinct chunks, and of those how many are in the backend
    unique_bytes: int = 0
    remote_bytes: int = 0
    manifest_id: str | None = None
    started: float = field(default_factory=time.time)
    finished: float | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    data: mmap.mmap | None = None
    #: where each chunk lies in the staged bytes (offset, size)
    where: dict[ChunkId, tuple[int, int]] = field(default_factory=dict)
    #: chunk ids this job pinned in the disk tier (unpinned when it ends)
    pinned: set[ChunkId] = field(default_factory=set)
    #: what became of the part's replicas (docs/replicas.md), once pushed
    replicas: dict[str, Any] | None = None
    #: the push's own report (a PushReport), for the note that the save is remote
    replica_report: Any = None
    #: the push in flight (a task), which the commit's level waits for a while
    pushing: Any = None
    #: whether the save is committed (its manifest is in): with commit="none" the
    #: part reaches remote before that, and its replicas' note waits for it
    committed: bool = False

    @property
    def unique(self) -> dict[ChunkId, int]:
        """Each distinct chunk id of the part, with its size."""
        return {cid: size for seg in self.chunks for cid, size in seg}

    def meets(self, level: Durability) -> bool:
        """Whether the job is at ``level``: reached it, or, for ``replicated``, is local
        with no replicas asked (a save without replicas is never said to be
        replicated, and a wait for it ends at local)."""
        if self.level >= level:
            return True
        return (
            level == Durability.REPLICATED
            and self.level >= Durability.LOCAL
            and not self.request.replicas
        )

    def reach(self, level: Durability, state: str | None = None) -> None:
        """Record progress and wake the waiters."""
        self.level = max(self.level, int(level))
        if state is not None:
            self.state = state
        self.changed.set()
        self.changed = asyncio.Event()

    def fail(self, error: ChunkdError) -> None:
        """Record a failure and wake the waiters."""
        self.error = error
        self.finished = time.time()
        self.state = "failed"
        self.changed.set()
        self.changed = asyncio.Event()

    def forget_parts(self) -> None:
        """Drop what only a job in flight needs (the state tree, its segments, its
        chunks and where they lay): a finished job is remembered for its waiters'
        answer, :meth:`describe`, which needs none of it."""
        if self.request.tree is not None or self.request.segments:
            self.request = dataclasses.replace(self.request, tree=None, segments=[])
        self.chunks = []
        self.where = {}

    def describe(self) -> dict[str, Any]:
        """What a waiter is told."""
        out: dict[str, Any] = {
            "job": self.id,
            "name": self.request.name,
            "rank": self.request.rank,
            "world_size": self.request.world_size,
            "save_id": self.request.save_id,
            "commit": self.request.commit,
            "state": self.state,
            "durability": Durability(self.level).wire_name if self.level else None,
            "logical_bytes": self.logical,
            "new_bytes": self.new,
            "dedup_bytes": self.logical - self.new,
            "unique_bytes": self.unique_bytes,
            "remote_bytes": self.remote_bytes,
            "age_s": round(time.time() - self.started, 1),
            "manifest_id": self.manifest_id,
        }
        if self.replicas is not None:
            out["replicas"] = self.replicas
        if self.error is not None:
            out["error"] = type(self.error).__name__
            out["message"] = str(self.error)
        return out

    def part_doc(self) -> dict[str, Any]:
        """The part object of this rank (``docs/checkpoints.md``, "A part")."""
        request = self.request
        return {
            "format": "chunkd-checkpoint-part",
            "schema": SCHEMA,
            "name": request.name,
            "save_id": request.save_id,
            "rank": request.rank,
            "world_size": request.world_size,
            "step": request.step,
            "created": time.time(),
            "segments": [
                {"size": size, "chunks": [[str(cid), n] for cid, n in seg]}
                for (_, size), seg in zip(request.segments, self.chunks, strict=True)
            ],
            "logical_bytes": self.logical,
            "new_bytes": self.new,
            "tree": request.tree,
        } | (
            ({} if request.uid is None else {"uid": request.uid})
            # Where a restore finds the part's replicas (docs/replicas.md); a part
            # without them (older, or saved without peers) is read as before.
            | ({} if request.node is None else {"node": request.node})
            | ({"replicas": request.replicas} if request.node and request.replicas else {})
        )

    def release_data(self) -> None:
        """Give up the staged bytes (unless a view of them is still in use)."""
        if self.data is not None:
            with contextlib.suppress(BufferError):
                self.data.close()
                self.data = None


def part_rank(name: str, world_size: int) -> int | None:
    """The rank of part file ``name`` (``"<rank>.json"``) if it is below ``world_size``."""
    digits = name.removesuffix(".json")
    if digits == name or not digits.isdigit() or not digits.isascii() or len(digits) > 6:
        return None
    if digits != "0" and digits.startswith("0"):
        return None
    rank = int(digits)
    return rank if rank < world_size else None


#: the old name of the checkpoint documents' writer, one function now for every stored
#: document (:func:`chunkd.canonical.canonical`)
dumps = canonical
