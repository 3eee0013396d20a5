"""What differs between two snapshots, and what is known of each member's bytes.

:func:`content_evidence` gathers the hashes a member's bytes are known by (a migrated
copy's ``content``, a frozen record's hashes and chunk ids); :func:`diff` matches two
snapshots' members by relative key and says of each pair whether it is the same,
different or unknown, and how that is known (``chunkd dataset diff``, the inspector).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import blake3

from chunkd.snapshot.manifest import Snapshot
from chunkd.snapshot.member import Member
from chunkd.snapshot.names import _ID_RE

__all__ = ["content_evidence", "diff"]


def content_evidence(
    snapshot: Snapshot, frozen: Mapping[str, Any] | None = None, *, claims: bool = True
) -> list[dict[str, str]]:
    """What is known of each member's bytes, in member order, by kind of evidence.

    ``{"blake3": HEX}``: the blake3 of the member's whole bytes, from its ``content``
    field (a migrated copy's) or from the frozen record's ``"content"`` list (one hash
    or null per member). ``{"chunks/N": DIGEST}``: from the frozen record's chunk ids
    at chunk size N (each id is its chunk's blake3, so the same ids at the same size
    are the same bytes); DIGEST stands for the whole list. A record that does not fit
    the snapshot gives nothing. Every hash is of the bytes chunkd read at the member's
    recorded version (a freeze, a migrate).

    Args:
        snapshot: the snapshot.
        frozen: its frozen record (as ``ds_resolve`` sends it), if it is frozen.
        claims: whether the manifest's own ``content`` fields count (False: only the
            frozen record, which the daemon writes apart from any manifest).
    """
    return _evidence(list(snapshot.members), frozen, claims=claims)


def _evidence(
    members: Sequence[Member], frozen: Mapping[str, Any] | None, *, claims: bool
) -> list[dict[str, str]]:
    """:func:`content_evidence` of ``members`` (a snapshot's, all of them when a frozen
    record is given, whose lists are by member index)."""
    found: list[dict[str, str]] = [
        {"blake3": m.content} if claims and m.content is not None else {} for m in members
    ]
    if not isinstance(frozen, Mapping):
        return found
    count = len(found)
    contents = frozen.get("content")
    if isinstance(contents, list) and len(contents) == count:
        for known, digest in zip(found, contents, strict=True):
            if isinstance(digest, str) and _ID_RE.fullmatch(digest):
                known.setdefault("blake3", digest)
    chunks, size = frozen.get("members"), frozen.get("chunk_bytes")
    if isinstance(chunks, list) and len(chunks) == count and isinstance(size, int):
        for known, ids in zip(found, chunks, strict=True):
            if isinstance(ids, list) and all(isinstance(c, str) for c in ids):
                known[f"chunks/{size}"] = blake3.blake3("\n".join(ids).encode()).hexdigest()
    return found


def _agree(x: Mapping[str, str], y: Mapping[str, str]) -> bool | None:
    """Whether two members' evidence says their bytes are equal (True), differ
    (False), or nothing (None: no kind of evidence on both sides)."""
    kinds = x.keys() & y.keys()
    if not kinds:
        return None
    return all(x[k] == y[k] for k in kinds)


def _members_to_compare(
    a: Snapshot,
    b: Snapshot,
    frozen: tuple[Mapping[str, Any] | None, Mapping[str, Any] | None],
) -> tuple[list[Member], list[Member], int]:
    """The members of ``a`` and ``b`` that :func:`diff` must compare, and how many
    more it may count as the same without reading them.

    Two schema-2 snapshots of the same source share every page whose id is on both
    sides: a page's id names its members' every field (key, version, size, format,
    samples, meta, content), and its keys are on both sides, in no other page. Those
    members are the same object at the same version token: the same, by ``version``.
    So only the pages whose ids differ are read. With a frozen record on either side
    (whose lists go by member index) every member is compared.
    """
    if not (
        a.schema >= 2
        and b.schema >= 2
        and a.backend == b.backend
        and a.prefix == b.prefix
        and frozen == (None, None)
    ):
        return list(a.members), list(b.members), 0
    common = {p.id for p in a.pages} & {p.id for p in b.pages}
    xs = [m for i, p in enumerate(a.pages) if p.id not in common for m in a.page_members(i)]
    ys = [m for i, p in enumerate(b.pages) if p.id not in common for m in b.page_members(i)]
    return xs, ys, sum(p.members for p in a.pages if p.id in common)


def diff(
    a: Snapshot,
    b: Snapshot,
    *,
    frozen: tuple[Mapping[str, Any] | None, Mapping[str, Any] | None] = (None, None),
) -> dict[str, Any]:
    """What differs between two snapshots (``chunkd dataset diff`` and the inspector's
    ``diff``).

    Members are matched by their key below each snapshot's prefix (so a migrated copy,
    at another backend and prefix, is matched member for member). A member present in
    both is "different" only when it is known to differ, "the same" only when it is
    known to be, and otherwise "unknown". What is known of its bytes is their hash
    (:func:`content_evidence`: a member's ``content``, which only migrate writes, and
    a copy's hashes are its ``origin``'s too; a frozen record's hashes and chunk ids),
    always of the bytes chunkd read at the recorded version.

    * Its size, format, sample count or format metadata differ: **different**.
    * Both sides read **the same object** (same backend and key): the version tokens
      decide.

      - The same token: **the same** (``version``), unless hashes on both sides differ
        (then the token was faked: **different**, ``content``).
      - Other tokens: the object was rewritten in between: **different**
        (``version``; with ``content`` too where hashes on both sides differ). Only
        the frozen records of both sides, the daemon's own reads at each version,
        can show that the rewrite kept the bytes: equal there, **the same**
        (``content``). A manifest's ``content`` claim never outweighs the tokens.
    * Other objects (a copy at another backend or key): hashes on both sides decide:
      equal, **the same** (``content``); not, **different** (``content``); none on
      one side, **unknown**. Never "the same".

    A ``file://`` version token is the file's inode, mtime and size: a rewrite that
    keeps all three (``cp -p``, ``rsync -t`` onto the same inode) is not seen by it,
    nor by a hash recorded after it (read at the same, faked token).

    Args:
        a, b: the snapshots.
        frozen: their frozen records (as ``ds_resolve`` sends them), where frozen.

    Returns:
        ``a`` and ``b`` (the ids), ``added`` and ``removed`` (keys), ``changed``
        (``[{"key", "fields", "samples"}]``: ``fields`` names what differs, among
        ``size``, ``format``, ``samples``, ``meta``, ``content`` and ``version``),
        ``unknown`` (keys), ``unchanged`` (how many members are known to be the same)
        and ``same_by`` (``{"content": N, "version": N}``: how each was known),
        ``samples`` and ``bytes`` (``[a's, b's]``), ``schema_changed``, and ``same``:
        true only when no member was added, removed, changed or unknown and the schema
        is the same.
    """
    xs, ys, shared = _members_to_compare(a, b, frozen)
    left = {m.relative(a.prefix): i for i, m in enumerate(xs)}
    right = {m.relative(b.prefix): i for i, m in enumerate(ys)}
    known_a = _evidence(xs, frozen[0], claims=True)
    known_b = _evidence(ys, frozen[1], claims=True)
    # The daemon's own reads at each recorded version, apart from any manifest's claim.
    read_a = _evidence(xs, frozen[0], claims=False)
    read_b = _evidence(ys, frozen[1], claims=False)
    # A verified copy's hashes are its origin's too (the bytes it copied, read at the
    # origin's recorded versions).
    for origin, copy, known_origin, known_copy, at_origin, at_copy in (
        (a, b, known_a, known_b, left, right),
        (b, a, known_b, known_a, right, left),
    ):
        if copy.origin == origin.id:
            for key in at_origin.keys() & at_copy.keys():
                digest = known_copy[at_copy[key]].get("blake3")
                if digest is not None:
                    known_origin[at_origin[key]].setdefault("blake3", digest)
    changed: list[dict[str, Any]] = []
    unknown: list[str] = []
    same_by = {"content": 0, "version": 0}
    for key in sorted(left.keys() & right.keys()):
        i, j = left[key], right[key]
        x, y = xs[i], ys[j]
        fields = [
            f
            for f, u, v in (
                ("size", x.size, y.size),
                ("format", x.format, y.format),
                ("samples", x.samples, y.samples),
                ("meta", x.meta, y.meta),
            )
            if u != v
        ]
        agree = _agree(known_a[i], known_b[j])
        if agree is False:
            fields.append("content")
        basis: str | None = None
        if a.backend == b.backend and x.key == y.key:
            if x.version == y.version:
                basis = "version"
            elif agree is not False and _agree(read_a[i], read_b[j]):
                basis = "content"
            else:
                fields.append("version")
        elif agree:
            basis = "content"
        if fields:
            changed.append({"key": key, "fields": fields, "samples": [x.samples, y.samples]})
        elif basis is None:
            unknown.append(key)
        else:
            same_by[basis] += 1
    added = sorted(right.keys() - left.keys())
    removed = sorted(left.keys() - right.keys())
    same_by["version"] += shared
    schema_changed = a.schema_of != b.schema_of
    return {
        "a": a.id,
        "b": b.id,
        "added": added,
        "removed": removed,
        "changed": changed,
        "unknown": unknown,
        "unchanged": sum(same_by.values()),
        "same_by": same_by,
        "samples": [len(a), len(b)],
        "bytes": [a.total_bytes, b.total_bytes],
        "schema_changed": schema_changed,
        "same": not (added or removed or changed or unknown or schema_changed),
    }
