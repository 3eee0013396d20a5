"""Fixed-size records: one sample per ``record_bytes`` bytes, as a read-only view.

Member ``meta``: ``{"record_bytes": N}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from chunkd.errors import DatasetFormatError

if TYPE_CHECKING:
    from chunkd.client.datasets.source import Source
    from chunkd.snapshot import Member

__all__ = ["FORMAT", "FixedRecords"]


class FixedRecords:
    """The ``fixed`` format (see the module docstring)."""

    name = "fixed"

    def scan(self, source: Source, member: Member, options: Mapping[str, Any]) -> Member:
        size = options.get("record_bytes")
        if not isinstance(size, int) or size <= 0:
            raise DatasetFormatError("the fixed format needs a record size: --format fixed:N")
        records, left = divmod(member.size, size)
        if left:
            raise DatasetFormatError(
                f"{source.name(member)} holds {member.size} bytes, not a whole number of "
                f"{size}-byte records ({left} bytes left over); check the record size"
            )
        return replace(member, samples=records, meta={"record_bytes": size})

    def read(self, source: Source, member: Member, index: int) -> memoryview:
        size = int(member.meta["record_bytes"])
        return source.read(member, index * size, size)

    def ranges(self, member: Member, index: int) -> list[tuple[int, int]]:
        size = int(member.meta["record_bytes"])
        return [(index * size, size)]

    def schema(self, members: list[Member]) -> Any:
        sizes = sorted({int(m.meta["record_bytes"]) for m in members})
        return {"record_bytes": sizes[0]} if len(sizes) == 1 else {"record_bytes": sizes}


FORMAT = FixedRecords()
