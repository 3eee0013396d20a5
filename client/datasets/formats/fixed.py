"""Fixed-size records: one sample per ``record_bytes`` bytes, as a read-only view.

A member's **units** are runs of whole records of about
:data:`~chunkd.client.datasets.formats.UNIT_BYTES` (8 MiB) each:
``max(1, UNIT_BYTES // record_bytes)`` records, the last unit holding the rest; a
record larger than that is a unit of its own. They follow from ``record_bytes`` and the
member's size alone, so a member registered before units reads as it did.

:meth:`~FixedRecords.decode` reads a unit with one ranged read and gives a table of one
column, ``record``, of type ``fixed_size_binary(record_bytes)``, over the bytes read
(no copy where the source's view allows it). A sample
(:meth:`~FixedRecords.sample`) is a read-only :class:`memoryview` of its record's bytes.

Member ``meta``: ``{"record_bytes": N}``.

pyarrow is imported when a unit is first decoded.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Final

from chunkd.client.datasets.formats import UNIT_BYTES, FormatBase
from chunkd.errors import DatasetFormatError, InvalidRequestError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from chunkd.client.datasets.source import Source
    from chunkd.snapshot import Member

__all__ = ["COLUMN", "FORMAT", "FixedRecords"]

#: the one column of a decoded unit
COLUMN: Final = "record"


class FixedRecords(FormatBase):
    """The ``fixed`` format (see the module docstring)."""

    name = "fixed"
    version = 1
    #: no key says it holds fixed records: ``--format fixed:N`` names them
    suffixes: tuple[str, ...] = ()
    argument = "N"

    def options(self, arg: str) -> dict[str, Any]:
        """``{"record_bytes": N}`` from the ``N`` of ``--format fixed:N``.

        Raises:
            InvalidRequestError: ``N`` is not a positive whole number of bytes.
        """
        # ASCII digits only ("²" is a digit to str.isdigit), and few of them
        if not (arg.isascii() and arg.isdigit() and len(arg) <= 18) or int(arg) <= 0:
            raise InvalidRequestError("fixed-size records need their size, as fixed:N (bytes)")
        return {"record_bytes": int(arg)}

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

    def schema(self, members: list[Member]) -> Any:
        sizes = sorted({int(m.meta["record_bytes"]) for m in members})
        return {"record_bytes": sizes[0]} if len(sizes) == 1 else {"record_bytes": sizes}

    def units(self, member: Member) -> list[int]:
        per = _per_unit(member)
        full, rest = divmod(member.samples, per)
        return [per] * full + ([rest] if rest else [])

    def unit_bytes(self, member: Member) -> list[int]:
        size = int(member.meta["record_bytes"])
        return [count * size for count in self.units(member)]

    def unit_ranges(self, member: Member, unit: int) -> list[tuple[int, int]]:
        size, per = int(member.meta["record_bytes"]), _per_unit(member)
        first = unit * per
        count = min(per, member.samples - first)
        if unit < 0 or count <= 0:
            raise IndexError(f"unit {unit} of {member.key}, which holds {len(self.units(member))}")
        return [(first * size, count * size)]

    def decode(
        self, source: Source, member: Member, unit: int, columns: Sequence[str] | None
    ) -> Any:
        pa = importlib.import_module("pyarrow")
        name = source.name(member)
        if columns is not None:
            unknown = [c for c in columns if c != COLUMN]
            if unknown:
                raise DatasetFormatError(
                    f"{name} has no column {unknown[0]!r}; its columns: {COLUMN}"
                )
        size = int(member.meta["record_bytes"])
        ((offset, length),) = self.unit_ranges(member, unit)
        view = source.read(member, offset, length)
        if len(view) != length:
            raise DatasetFormatError(
                f"{name} ended at byte {offset + len(view)}, before its recorded size of "
                f"{member.size} bytes: it is truncated"
            )
        # The column's values are the bytes read, not a copy of them.
        records = pa.FixedSizeBinaryArray.from_buffers(
            pa.binary(size), length // size, [None, pa.py_buffer(view)]
        )
        table = pa.table({COLUMN: records})
        return table if columns is None else table.select(list(columns))

    def sample(self, table: Any, row: int) -> memoryview:
        column = table.column(COLUMN)
        for chunk in column.chunks:
            if row < len(chunk):
                break
            row -= len(chunk)
        else:
            raise IndexError(f"row {row} of a table of {len(column)}")
        size = chunk.type.byte_width
        start = (chunk.offset + row) * size
        data = memoryview(chunk.buffers()[1]).cast("B")
        return data[start : start + size].toreadonly()


def _per_unit(member: Member) -> int:
    """The records of a unit: as many as fill UNIT_BYTES, at least one."""
    return max(1, UNIT_BYTES // int(member.meta["record_bytes"]))


FORMAT = FixedRecords()
