"""The inspector's view of any other object (:class:`BinaryView`): its first bytes, as
hex and as text; it has no rows."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from chunkd.client.inspect.views.view import FORMATS, HEAD_BYTES
from chunkd.errors import InvalidRequestError

if TYPE_CHECKING:
    from chunkd.client.results import ObjectStat

__all__ = ["BinaryView"]


class BinaryView:
    """Any other object: its first bytes, as hex and as text."""

    kind = "binary"

    def __init__(self, stat: ObjectStat, head: bytes) -> None:
        self.name = stat.name
        self._head = head

    total = None
    nbytes = 256 + HEAD_BYTES

    def fields(self) -> list[str] | None:
        return None

    def describe(self) -> dict[str, Any]:
        return {
            "head_bytes": len(self._head),
            "hex": self._head.hex(),
            "text": self._head.decode("utf-8", "replace"),
        }

    def rows(self, start: int, columns: list[str] | None) -> Iterator[tuple[int, Any]]:
        raise InvalidRequestError(
            f"{self.name} is opened as binary, which has no rows: open it with a format "
            f"({', '.join(FORMATS[:-1])}), or fetch its bytes as media"
        )
