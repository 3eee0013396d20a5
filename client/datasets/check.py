"""The storage-format expectations of a snapshot, checked: :func:`check`.

``chunkd dataset check`` prints what this finds and exits non-zero when it finds an
**error**: something that makes samples wrong or unreadable. A **warning** is a layout
that reads correctly but slowly, or that is probably a mistake. ``docs/datasets.md``
says what to do about each.

The rules of every dataset (``empty-member``, ``many-tiny-files``, ``excluded``) are
here. Each format's own rules are its
:meth:`~chunkd.client.datasets.formats.Format.check`, in its module, which :func:`check`
calls once per format with that format's members (a plug-in's too); a format with no
rules of its own inherits one that finds nothing. The rules, by code:

Errors
    ``schema-differs``
        a Parquet or Arrow member whose schema, or an MDS shard whose columns, differ
        from the dataset's (the manifest's ``schema_of``: the most common one): a batch
        that mixes them has columns of different types or names.
    ``jsonl-not-json``, ``jsonl-not-utf8``
        a JSON line that does not parse, or is not UTF-8 (JSON text is UTF-8, RFC 8259).
        Without ``deep`` only each member's first line is read; with ``deep`` every
        line is, streamed (memory holds one piece and one line).
    ``duplicate-key``
        a WebDataset key that names two samples of one tar (its files are not
        adjacent, or an extension repeats): "the sample with key K" is ambiguous.
    ``unreadable``, ``drift``
        a member that cannot be read as its format, or that changed since it was
        registered (only where the check reads members: JSON lines); a member of a
        format this process does not know (a plug-in not installed) is ``unreadable``.

Warnings
    ``duplicate-key`` (across tars)
        a WebDataset key found in two tars: sample ids stay distinct (they name the
        member), but tools that key samples by ``__key__`` alone merge them.
    ``extensions-differ``
        a tar whose samples lack extensions others have, or have ones others lack.
    ``empty-member``
        a member of no samples.
    ``many-tiny-files``
        more than :data:`TINY_FILES` members whose median size is below
        :data:`TINY_BYTES`: each member costs a listing entry, a version check and a
        manifest entry, and a read of a tiny file is all overhead (the anchor: DVC's
        hours over 600k files). Pack them into shards of 64 MiB to 1 GiB.
    ``row-group-too-big``
        a Parquet row group of more than :data:`ROW_GROUP_MAX_BYTES` uncompressed: it is
        cut into units of at most
        :data:`~chunkd.client.datasets.formats.MAX_UNIT_BYTES` (128 MiB), and each unit
        reads the whole group's column chunks and decodes the group's rows up to its own,
        so the group costs several times its decode. Write groups of 1 to 128 MiB.
    ``row-group-too-small``
        a Parquet member of several row groups whose median group is below
        :data:`ROW_GROUP_MIN_BYTES` uncompressed: each group is a ranged read and a
        decode of its own, with per-column overhead, and the footer grows with the
        group count.
    ``jsonl-blank-line``
        an empty line: it is a sample (of no bytes), which is rarely what was meant.
    ``jsonl-line-too-long``
        a line over :data:`~chunkd.client.datasets.formats.jsonl.MAX_LINE_BYTES`.
    ``zst-not-seekable``
        a ``.zst`` JSON lines member not in the seekable zstd format: a random read
        decompresses it from its start (kept per process only up to the cache bound).
        Write it with a seekable zstd writer.
    ``compressed-shard-too-big``
        a compressed MDS shard bigger, decompressed, than the per-process cache
        (:data:`~chunkd.client.datasets.formats.mds.CACHE_BYTES`): it is not kept, so
        each unit read decompresses it from its start to that unit's end.
    ``excluded``
        a file registration left out (``--skip-bad``), with the reason it gave.

Findings are counted right, and grouped: the same warning (or error) of the same
code found in many members is **one** finding with its ``count`` and a few
``examples`` (at most :data:`EXAMPLES` of the members' keys). At most
:data:`MAX_PER_CODE` distinct findings of one code are listed; one more (member
``None``) stands for the rest, with their count. A summary adds up the counts.

:class:`Finding` and the texts findings show (:func:`size_text`, :func:`columns_text`)
live in :mod:`chunkd.client.datasets.findings`, which the formats' rules build on
without importing this module (it calls them); the Parquet bounds
(:data:`ROW_GROUP_MAX_BYTES`, :data:`ROW_GROUP_MIN_BYTES`) are the parquet format's.
Both are re-exported here.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from chunkd.client.datasets.findings import Finding, Level, columns_text, size_text
from chunkd.client.datasets.formats import format_of
from chunkd.client.datasets.formats.parquet import ROW_GROUP_MAX_BYTES, ROW_GROUP_MIN_BYTES
from chunkd.errors import DatasetFormatError

if TYPE_CHECKING:
    from chunkd.client.datasets.source import Source
    from chunkd.snapshot import Member, Snapshot

__all__ = [
    "EXAMPLES",
    "MAX_PER_CODE",
    "ROW_GROUP_MAX_BYTES",
    "ROW_GROUP_MIN_BYTES",
    "TINY_BYTES",
    "TINY_FILES",
    "Finding",
    "Level",
    "check",
    "columns_text",
    "size_text",
    "summarize",
]

#: more members than this ...
TINY_FILES: Final = 1000
#: ... of a median size below this are "a great many tiny files"
TINY_BYTES: Final = 1 << 20
#: distinct findings of one code listed; the rest are counted in one more
MAX_PER_CODE: Final = 20
#: the members a grouped finding names as examples
EXAMPLES: Final = 3


def check(snapshot: Snapshot, source: Source, *, deep: bool = False) -> list[Finding]:
    """What ``snapshot`` breaks of the storage-format expectations (the module docstring).

    The rules of every dataset (excluded files, empty members, many tiny files) are
    checked here; each format's own rules by its
    :meth:`~chunkd.client.datasets.formats.Format.check`, once per format with its
    members. A member of a format this process does not know is an ``unreadable``
    error. Reads only the manifest, except where a format reads more (JSON lines: their
    first line each, or, with ``deep``, every line, streamed in bounded memory).

    Args:
        snapshot: the snapshot.
        source: where its members' bytes are read from.
        deep: read and validate every sample where a format checks them (JSON lines).

    Returns:
        The findings, errors first, then by code and member.
    """
    found = _Findings()
    members = snapshot.members
    for excluded in snapshot.excluded:
        found.add(
            "warning",
            str(excluded.get("key")),
            "excluded",
            f"left out at registration: {excluded.get('error', 'unreadable')}",
        )
    for member in members:
        if member.samples == 0:
            found.add("warning", member.key, "empty-member", "holds no samples")
    _tiny_files(found, members)
    by_format: dict[str, list[Member]] = {}
    for member in members:
        by_format.setdefault(member.format, []).append(member)
    for name, mine in by_format.items():
        try:
            fmt = format_of(name)
        except DatasetFormatError as exc:
            for member in mine:
                found.add("error", member.key, "unreadable", str(exc))
            continue
        for f in fmt.check(source, mine, snapshot.schema_of, deep=deep):
            found.add(f.level, f.member, f.code, f.message, count=f.count, examples=f.examples)
    return found.sorted()


# -- the rules of every dataset ----------------------------------------------------------


def _tiny_files(found: _Findings, members: Iterable[Member]) -> None:
    sizes = [m.size for m in members]
    if len(sizes) > TINY_FILES and statistics.median(sizes) < TINY_BYTES:
        found.add(
            "warning",
            None,
            "many-tiny-files",
            f"{len(sizes)} files of median size {size_text(int(statistics.median(sizes)))}: "
            "per-file costs (listing, version checks, one request each) dominate; pack "
            "them into shards of 64 MiB to 1 GiB",
        )


# -- findings ----------------------------------------------------------------------------


def summarize(findings: Iterable[Finding]) -> list[Finding]:
    """``findings`` grouped and sorted, as :func:`check` answers them (the module
    docstring): the same finding of many members once, with their count; at most
    :data:`MAX_PER_CODE` distinct ones a code, then one for the rest. The counts add up
    to the findings given (a finding's ``count`` counts as that many)."""
    found = _Findings()
    for f in findings:
        found.add(f.level, f.member, f.code, f.message, count=f.count, examples=f.examples)
    return found.sorted()


@dataclass(slots=True)
class _Group:
    """One finding found one or more times."""

    count: int = 0
    examples: list[str] = field(default_factory=list)
    #: whether it was found in a member (not only of the dataset as a whole)
    named: bool = False


class _Findings:
    """Findings as they are found, grouped by (level, code, message)."""

    def __init__(self) -> None:
        self._groups: dict[tuple[Level, str, str], _Group] = {}  # in the order found

    def add(
        self,
        level: Level,
        member: str | None,
        code: str,
        message: str,
        *,
        count: int = 1,
        examples: Iterable[str] = (),
    ) -> None:
        group = self._groups.setdefault((level, code, message), _Group())
        group.count += count
        group.named = group.named or member is not None
        for key in (member, *examples):
            if key is not None and len(group.examples) < EXAMPLES and key not in group.examples:
                group.examples.append(key)

    def sorted(self) -> list[Finding]:
        by_code: dict[tuple[Level, str], list[Finding]] = defaultdict(list)
        for (level, code, message), group in self._groups.items():
            member = group.examples[0] if group.named and group.examples else None
            by_code[level, code].append(
                Finding(level, member, code, message, group.count, tuple(group.examples))
            )
        out: list[Finding] = []
        for (level, code), listed in by_code.items():
            out += listed[:MAX_PER_CODE]
            rest = listed[MAX_PER_CODE:]
            if rest:
                count = sum(f.count for f in rest)
                keys = tuple(k for f in rest for k in f.examples)[:EXAMPLES]
                out.append(
                    Finding(level, None, code, f"... and {count} more like these", count, keys)
                )
        rank = {"error": 0, "warning": 1}
        return sorted(out, key=lambda f: (rank[f.level], f.code, f.member is None, f.member or ""))
