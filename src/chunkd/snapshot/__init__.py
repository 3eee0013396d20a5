"""The dataset snapshot format: a manifest of members, its id, and dataset names.

Written down once, here; the client (registration, readers) and the daemon (the
registry, freeze, migrate, the garbage collector's roots) both read it. ``docs/datasets.md``
is the prose.

A snapshot (schema 2): a root and member pages
    An immutable manifest of a dataset's **members** (the objects that hold its
    samples), in key order. It is a small **root** plus **member pages**, bounded
    pieces of the member table. Its **id** is the blake3 (256 bits, 64 hex digits) of
    the root's canonical bytes: JSON with sorted keys, no spaces, UTF-8, no NaN. The
    root names each page by its id, the blake3 of the page's own canonical bytes (a
    Merkle tree of one level), so a snapshot id names one immutable content, and a
    reader checks whatever it reads by hashing it: a torn or forged root or page does
    not hash to the id it is read for.

    A **page** is ``{"kind": "chunkd-dataset-page", "schema": 2, "members": [member,
    ...]}``: at most :data:`PAGE_MAX_MEMBERS` members and :data:`PAGE_MAX_BYTES` bytes,
    keys strictly increasing. Where a page ends depends on the members alone
    (:class:`PageWriter`): after a member whose key's blake3 (its first 8 bytes,
    little-endian) is 0 modulo :data:`PAGE_TARGET`, or before one that would take the
    page past a bound. So a registration split over many workers and one done alone
    make the same pages, and a new version that adds or changes a few members writes
    a few pages and a root: versions share every other page.

    The root's fields: ``schema`` (2), ``source``, ``format``, ``totals``,
    ``schema_of``, ``excluded`` (at most :data:`MAX_EXCLUDED`) and ``origin`` as below,
    ``claims`` (``["content"]`` where a member carries ``content``; absent otherwise:
    a page whose member carries it under a root that does not claim it is refused), and
    ``pages``: ``[[id, members, samples, bytes, first key, last key], ...]`` in key
    order. A page read is checked against its entry: its hash is the id, and its
    members' count, samples, bytes, first and last keys are the entry's, so a root
    cannot name a page of another snapshot unless it is that very content. Opening a
    snapshot reads its root; a member is read with its page (held parsed, the
    :data:`PAGE_CACHE` most recently used); finding sample ``i`` is a binary search
    over the root's pages, then one over the page. At 4096 members a page on average a
    root takes about 200 bytes a page: 50 KiB at a million members, 5 MiB at 100
    million.

    Schema 1, what chunkd wrote before: one document, the fields below and ``members``
    inline. It is still read, with its id unchanged; nothing writes it any more (but
    :meth:`Snapshot.build` with ``schema=1``, for tests of it).

    Fields (a schema-1 manifest's top level; a root's, less ``members``)::

        schema      the format's version (:data:`SCHEMA`); newer code reads older ones
                    (:func:`upgrade`), older code refuses newer ones by name
        source      {"backend": B, "prefix": P}: where the members were listed
        format      the members' format (:data:`FORMATS`, or a plug-in's name)
        totals      {"members": N, "samples": N, "bytes": N}
        schema_of   the dataset's schema: Parquet, a list of [column, type] pairs; MDS,
                    the columns and their encodings; WebDataset, the member extensions;
                    JSON lines and fixed records, null
        excluded    [{"key": K, "error": TEXT}, ...]: files registration could not read,
                    left out with --skip-bad
        members     [member, ...], in key order
        origin      (optional) the id of the snapshot this one is a verified copy of
                    (``migrate``): each member's ``content`` is then also the hash of
                    the origin's member of the same relative key, at its recorded
                    version; absent otherwise. Only the daemon's own migrate writes
                    it: a client's ``ds_commit`` that carries it is refused

    A member::

        key         the key in the source backend (not a name: the backend is source's)
        size        bytes
        version     the version token the registration read (ETag, version id, or size
                    and mtime): reads are pinned to it
        format      a format's name: one of FORMATS, or a plug-in's
                    (``chunkd.client.datasets.formats``); a reader that does not know
                    it refuses the member when it reads it, not the manifest
        samples     how many samples it holds
        meta        per format (the format's module documents its fields), e.g. Parquet's
                    row groups with their rows and byte ranges
        content     (optional) the blake3 of the member's whole bytes, 64 hex digits,
                    where chunkd read every byte (a migrated copy); absent when
                    unknown, so that a manifest without it keeps its id. Like
                    ``origin``, chunkd's own record (:attr:`Snapshot.claims`): a
                    client's ``ds_commit`` that carries it is refused

    A member's **samples** are numbered from 0 in the member, and a snapshot's samples
    from 0 over its members in order (:meth:`Snapshot.locate`).

    Its **shape** is checked before it is parsed (:func:`check_manifest_shape`): one
    JSON object, nested at most :data:`MAX_DEPTH` deep, with at most one object or list
    in :data:`CONTAINER_BYTES` bytes. What a parse costs grows with the count of JSON
    values, not with the bytes: ``[{}, {}, ...]`` takes 26 times its size in Python
    objects, a real manifest about 11 (measured on Parquet, JSON lines, WebDataset and
    MDS registrations), so a shape no manifest has is refused before it costs that.

Names
    ``NAME`` is one or more ``/``-separated segments of letters, digits, ``.``, ``_`` and
    ``-`` (each starting with a letter or digit). A reference (:class:`Ref`) is
    ``NAME@N`` (version N, from 1), ``NAME@latest`` (also plain ``NAME``), ``NAME@TAG``,
    or a snapshot id alone.

The package's rooms
    :mod:`.names` (names, tags, ids, references), :mod:`.shape` (JSON read at a
    bounded cost: the shape checked before the parse, a manifest parsed one member's
    entry at a time), :mod:`.member` (a member's entry), :mod:`.pages` (schema 2's
    member pages: cut, checked, held), :mod:`.upgrades` (the format's version and the
    chain that reads older roots), :mod:`.manifest` (:class:`Snapshot` and its id),
    :mod:`.compare` (content evidence and :func:`diff`) and :mod:`.worker` (a large
    manifest's check in a process of its own: ``python -m chunkd.snapshot``). Every
    name is importable from ``chunkd.snapshot``.
"""

from __future__ import annotations

from chunkd.canonical import canonical
from chunkd.snapshot.compare import content_evidence, diff
from chunkd.snapshot.manifest import MAX_EXCLUDED, WRITE_SCHEMA, Snapshot, snapshot_id
from chunkd.snapshot.member import FORMATS, Member
from chunkd.snapshot.names import (
    MAX_NAME_BYTES,
    MAX_TAG_BYTES,
    Ref,
    check_dataset_name,
    check_snapshot_id,
    check_tag,
    parse_ref,
)
from chunkd.snapshot.pages import (
    PAGE_CACHE,
    PAGE_CACHE_MEMBERS,
    PAGE_KIND,
    PAGE_MAX_BYTES,
    PAGE_MAX_MEMBERS,
    PAGE_SCHEMA,
    PAGE_TARGET,
    Members,
    MemoryPages,
    PageRef,
    PageSource,
    PageWriter,
    page_bytes,
    parse_page,
)
from chunkd.snapshot.pages import _cuts_after as _cuts_after
from chunkd.snapshot.shape import (
    CONTAINER_BYTES,
    MAX_DEPTH,
    check_json_shape,
    check_manifest_shape,
    load_json,
)
from chunkd.snapshot.upgrades import SCHEMA, upgrade
from chunkd.snapshot.worker import manifest_check_main

__all__ = [
    "CONTAINER_BYTES",
    "FORMATS",
    "MAX_DEPTH",
    "MAX_EXCLUDED",
    "MAX_NAME_BYTES",
    "MAX_TAG_BYTES",
    "PAGE_CACHE",
    "PAGE_CACHE_MEMBERS",
    "PAGE_KIND",
    "PAGE_MAX_BYTES",
    "PAGE_MAX_MEMBERS",
    "PAGE_SCHEMA",
    "PAGE_TARGET",
    "SCHEMA",
    "WRITE_SCHEMA",
    "Member",
    "Members",
    "MemoryPages",
    "PageRef",
    "PageSource",
    "PageWriter",
    "Ref",
    "Snapshot",
    "canonical",
    "check_dataset_name",
    "check_json_shape",
    "check_manifest_shape",
    "check_snapshot_id",
    "check_tag",
    "content_evidence",
    "diff",
    "load_json",
    "manifest_check_main",
    "page_bytes",
    "parse_page",
    "parse_ref",
    "snapshot_id",
    "upgrade",
]
