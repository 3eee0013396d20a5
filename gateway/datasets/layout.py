"""The dataset registry's layout in its backend, and its protocols (commit, tags, freeze).

The registry is ``[datasets] registry = "BACKEND/PREFIX"`` (default ``local/datasets``):
one writable backend and a key prefix, shared by every node of the cluster. The data
backends the members live in may stay read-only. Every key below is under PREFIX::

    manifests/<id>.json                        a snapshot's canonical manifest bytes: a
                                               schema-2 root, or a whole schema-1
                                               manifest (chunkd.snapshot); id = blake3
    pages/<id>.json                            a member page of schema-2 snapshots (its
                                               canonical bytes; id = blake3 of them),
                                               shared by every snapshot that names it
    names/<NAME>/_versions/<n:012d>.json       version n of NAME: {"id", "created", ...}
    names/<NAME>/_latest.json                  the hint: {"version": n}, the highest
                                               version a commit saw (written after it)
    names/<NAME>/_tags/<TAG>/<seq:012d>.json   one move of tag TAG of NAME:
                                               {"version", "id", "seq", "created", ...}
    names/<NAME>/_tags/<TAG>/_latest.json      the tag's hint: {"seq": s}
    frozen/<id>.json                           a frozen snapshot's chunk lists

and, at the root of the registry's backend, shared with checkpoints::

    chunks/<chunk id>                          the chunks of frozen snapshots
    intents/ds-<run>.<batch>.json              a freeze's chunk ids (kept a day)

``_versions`` and ``_tags`` start with ``_``, which no segment of a dataset name may
(:func:`chunkd.snapshot.check_dataset_name`): the keys of a name never pass for those
of another (``a/_tags/versions/...`` cannot be a version of ``a/_tags``, nor
``a/b/...`` a key of ``a``). Numbers are written with 12 digits so that key order is
number order. All JSON but the manifests (whose bytes are their canonical form) is
UTF-8 with sorted keys and no spaces. Other keys (a file backend's temporary files,
``<key>#<n>``) are ignored.

Commit (``ds_commit``): a version is committed as a checkpoint is.

1. The daemon checks the manifest whole (:meth:`.Registry.check_manifest`: its shape
   before anything is parsed, then the parse :meth:`Snapshot.parse` does, in a thread or
   a worker process by its size) and takes its id from its bytes, never from the
   client. What that may cost is bounded: :mod:`.registry`. A client's manifest may
   not carry a member's ``content`` or an ``origin`` (``diff`` trusts them): chunkd
   records those itself, and only the daemon's own migrate commits them.
2. ``manifests/<id>.json`` is put if absent. If one is there it is read and must hash
   to the id; one that does not (torn, or altered) is replaced by these bytes.
3. The highest version of NAME is listed. If its pointer names the same id, that
   version is the answer (registering the same snapshot twice in a row makes no new
   version). Otherwise the pointer of version highest + 1 is put **if absent**: this
   one PUT is the commit. If it is taken (a concurrent registration won that
   number), the next number is tried, up to :data:`COMMIT_TRIES` times; then the
   registration fails with a :class:`~chunkd.errors.DatasetError` and nothing of it
   is visible. So two concurrent registrations both get a version, with different
   numbers, or one fails cleanly; neither overwrites the other.

A pointer is never written before its manifest: a registration cut short (kill -9)
leaves at most a manifest no version names, which is harmless, and the next
registration of the name takes the next free number. A damaged highest pointer (not
the JSON chunkd wrote) is passed over the same way: the commit takes the next number,
and until then resolving NAME is a :class:`~chunkd.errors.ManifestError` naming it,
never an older version.

Tags (``ds_tag``): a tag is an append-only history of put-if-absent entries, and the
entry with the highest ``seq`` is the tag's value. Moving a tag puts entry highest + 1
if absent (retried with the next number when taken, like a commit); the highest is
taken from the listing, so a damaged entry does not block a move. So a move needs
no compare-and-swap, which a file backend lacks: two concurrent moves both land, one
after the other, and the later number wins. A tag's history stays (``ds_versions``
shows only the current value of each tag).

Pages (``ds_page_put``, then ``ds_commit`` of the root): a schema-2 snapshot is a root
plus member pages (:mod:`chunkd.snapshot`). A registration puts each page first
(``pages/<id>.json``, put if absent: the daemon checks its shape and takes its id from
its bytes; a copy there that does not hash to its id is replaced), then commits the
root, which the daemon checks and whose pages it checks are all there (known from its
own puts, else a HEAD each, a few at a time) before the manifest and the pointer are
written. A page is never read by a commit or a resolve: a reader fetches the pages it
touches (``ds_page``), and checks each against its id and the root's entry. A page
put by a registration cut short, that no root names, is harmless (as a manifest no
version names is).

The hints. ``_latest.json`` holds the highest version a commit saw; a commit writes it
after its pointer, before it answers. Finding the highest version reads the hint and
then probes forward, ``n + 1``, ``n + 2``, ... until one is absent: pointers are put
if absent at highest + 1 only, so they have no gaps, and the last one found is the
highest. A hint behind (two commits wrote theirs out of order, or a daemon died
between its pointer and its hint) costs a probe per version it is behind, never a
wrong answer; a name with no hint (registered before hints, or a damaged hint) is
listed once, as before. So a resolve never returns a version older than a commit
that had finished before the resolve began, with reads independent of the number of
versions. Tags keep their hint (``_tags/<TAG>/_latest.json``, the highest ``seq``)
the same way.

Resolve (``ds_resolve``): ``NAME@N`` reads pointer N; ``NAME`` and ``NAME@latest`` the
highest pointer (the hint, then probes); ``NAME@TAG`` the tag's highest entry (its
hint, then probes); a snapshot id reads ``manifests/<id>.json`` directly (for a
schema-2 snapshot: its root only). The manifest is checked against the id (its blake3)
when it is parsed: a torn or forged one is a :class:`~chunkd.errors.ManifestError`, and
nothing else is touched. Parsed snapshots are kept by id (immutable: the id names the
bytes), within the bounds of :mod:`.registry`. A tag move reads the version's pointer
for the snapshot id and HEADs its manifest; it never parses the manifest. A name,
version or tag that does not exist, or one whose manifest is missing, is a
:class:`~chunkd.errors.DatasetNotFoundError`.

Freeze (``ds_freeze``): the members' bytes go into the registry backend's
content-addressed ``chunks/``, as checkpoint chunks do, by the checkpoints' GC-safe
protocol (docs/checkpoints.md, "Why a save and a collection never lose a chunk"):

1. each member is read through the daemon's read path at its recorded version (a
   member that changed or vanished is a :class:`~chunkd.errors.SnapshotDriftError`
   that names it, and nothing of the freeze is committed); its chunk ids are noted;
2. per batch of at most :data:`INTENT_CHUNKS` chunk ids: the intent
   ``intents/ds-<run>.<batch>.json`` naming them is written, then the barriers of
   running collections are waited for (:func:`~chunkd.gateway.checkpoints.barrier.
   await_collections`), then each chunk is HEADed and put if absent when missing.
   A collection deletes intents older than its ``intent_ttl`` (a day) and stops
   counting their chunks, and a freeze may run longer: until its record is written,
   each of its intents is put again once it is an hour old (``intent_refresh``);
3. every chunk the record will name is HEADed once more: one missing (a collection
   took it while the freeze stalled) fails the freeze, with no record written, and
   freezing again sends it again. Then ``frozen/<id>.json`` is written last: the
   snapshot is frozen from this PUT on.

The frozen record::

    {"format": "chunkd-dataset-frozen", "schema": 1, "id": ID, "chunk_bytes": N,
     "backend": B, "created": T, "members": [[chunk id, ...], ...],
     "content": [blake3 hex | null, ...]}

``members[i]`` are member i's chunks in order (every one but the last exactly
``chunk_bytes`` long), in the chunk store of backend ``B``; a reader checks each
chunk's blake3. ``content`` (optional; absent in records written before it) is the
blake3 of each member's whole bytes: ``chunkd dataset diff`` compares members by it, and
by the chunk ids (:func:`chunkd.snapshot.content_evidence`).

Pointers and tag entries are read bounded (at most
:data:`~chunkd.gateway.datasets.registry.DOCUMENT_BYTES`, their shape checked before
they are parsed: :func:`~chunkd.gateway.datasets.registry.read_document`,
:func:`~chunkd.gateway.datasets.registry.load_document`); a damaged one is named by a
listing, which goes on around it. Freezing again is harmless (chunks present are not sent again, and
the record is the same but its time); a damaged record, or one that does not fit the
snapshot, is written anew. ``chunkd gc`` on the registry's backend marks
every chunk a frozen record names (the roots :class:`.FrozenRoots` gives the
collector), and the intents cover a freeze in flight.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = [
    "COMMIT_TRIES",
    "FROZEN",
    "HINT",
    "INTENT_CHUNKS",
    "MANIFESTS",
    "NAMES",
    "PAGES",
    "SCHEMA",
    "Layout",
    "number_of",
]

#: the frozen record's schema
SCHEMA: Final = 1
MANIFESTS: Final = "manifests/"
PAGES: Final = "pages/"
#: the hint's file name, beside a name's ``_versions`` and in each tag's folder
HINT: Final = "_latest.json"
NAMES: Final = "names/"
FROZEN: Final = "frozen/"
_VERSIONS: Final = "/_versions/"
_TAGS: Final = "/_tags/"
#: how many version (or tag) numbers one registration tries before it gives up
COMMIT_TRIES: Final = 64
#: chunk ids one intent of a freeze names at most
INTENT_CHUNKS: Final = 256
_NUMBER_RE: Final = re.compile(r"([0-9]{12})\.json")
_DIGITS: Final = 12
#: the highest version or tag sequence number the layout can write
MAX_NUMBER: Final = 10**_DIGITS - 1


def number_of(name: str) -> int | None:
    """The number of a pointer or tag entry file ``<n:012d>.json`` (None: not one)."""
    found = _NUMBER_RE.fullmatch(name)
    return int(found.group(1)) if found else None


class Layout:
    """The keys of one registry: ``PREFIX/...`` in its backend.

    Args:
        prefix: the registry's prefix in its backend, without outer slashes.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix.strip("/")
        self._root = f"{self.prefix}/" if self.prefix else ""

    def manifest(self, snapshot_id: str) -> str:
        """The key of a snapshot's manifest."""
        return f"{self._root}{MANIFESTS}{snapshot_id}.json"

    def page(self, page_id: str) -> str:
        """The key of a member page."""
        return f"{self._root}{PAGES}{page_id}.json"

    def hint(self, name: str) -> str:
        """The key of ``name``'s hint: the highest version a commit saw."""
        return f"{self._root}{NAMES}{name}/{HINT}"

    def tag_hint(self, name: str, tag: str) -> str:
        """The key of tag ``tag``'s hint: its highest ``seq`` a move saw."""
        return f"{self._root}{NAMES}{name}{_TAGS}{tag}/{HINT}"

    def frozen(self, snapshot_id: str) -> str:
        """The key of a snapshot's frozen record."""
        return f"{self._root}{FROZEN}{snapshot_id}.json"

    @property
    def frozen_prefix(self) -> str:
        """Where the frozen records are (a scan prefix)."""
        return f"{self._root}{FROZEN}".rstrip("/")

    @property
    def names_prefix(self) -> str:
        """Where the names are (a scan prefix)."""
        return f"{self._root}{NAMES}".rstrip("/")

    def names_under(self, prefix: str) -> str:
        """The scan prefix of the names under dataset-name prefix ``prefix``."""
        prefix = prefix.strip("/")
        return f"{self._root}{NAMES}{prefix}" if prefix else self.names_prefix

    def versions(self, name: str) -> str:
        """The scan prefix of ``name``'s version pointers."""
        return f"{self._root}{NAMES}{name}{_VERSIONS}".rstrip("/")

    def version(self, name: str, number: int) -> str:
        """The key of ``name``'s version ``number``."""
        return f"{self._root}{NAMES}{name}{_VERSIONS}{number:0{_DIGITS}d}.json"

    def tags(self, name: str) -> str:
        """The scan prefix of every tag of ``name``."""
        return f"{self._root}{NAMES}{name}{_TAGS}".rstrip("/")

    def tag(self, name: str, tag: str) -> str:
        """The scan prefix of tag ``tag`` of ``name``."""
        return f"{self._root}{NAMES}{name}{_TAGS}{tag}"

    def tag_entry(self, name: str, tag: str, seq: int) -> str:
        """The key of entry ``seq`` of tag ``tag`` of ``name``."""
        return f"{self._root}{NAMES}{name}{_TAGS}{tag}/{seq:0{_DIGITS}d}.json"

    def parse_version_key(self, key: str) -> tuple[str, int] | None:
        """``(name, number)`` of a version pointer's key; None for any other key."""
        head = f"{self._root}{NAMES}"
        if not key.startswith(head):
            return None
        rest = key[len(head) :]
        name, found, tail = rest.rpartition(_VERSIONS)
        if not found or not name or "/" in tail:
            return None
        number = number_of(tail)
        return None if number is None else (name, number)

    def parse_tag_key(self, key: str) -> tuple[str, str, int] | None:
        """``(name, tag, seq)`` of a tag entry's key; None for any other key."""
        head = f"{self._root}{NAMES}"
        if not key.startswith(head):
            return None
        name, found, tail = key[len(head) :].rpartition(_TAGS)
        tag, _, entry = tail.partition("/")
        if not found or not name or not tag or "/" in entry:
            return None
        seq = number_of(entry)
        return None if seq is None else (name, tag, seq)

    def parse_frozen_key(self, key: str) -> str | None:
        """The snapshot id of a frozen record's key; None for any other key."""
        head = f"{self._root}{FROZEN}"
        if not key.startswith(head) or not key.endswith(".json"):
            return None
        ident = key[len(head) : -len(".json")]
        return ident if re.fullmatch(r"[0-9a-f]{64}", ident) else None
