"""A read-only, seekable file over one version of an object: :class:`ChunkdFile`.

``Client.open`` makes one. It reads through its client (and the client's cache), and
asks the client for nothing but ranges (:class:`RangeSource`), so this module does not
import the client.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Protocol

from chunkd.client.results import ObjectStat
from chunkd.client.views import Located, byte_target
from chunkd.errors import VersionChangedError

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = ["ChunkdFile", "RangeSource"]


class RangeSource(Protocol):
    """What a :class:`ChunkdFile` needs of its client (a :class:`~chunkd.client.Client`)."""

    def locate(self, name: str, offset: int, length: int | None) -> Located:
        """A byte range of the object's current version, as the pieces that hold it."""
        ...


class ChunkdFile(io.RawIOBase):
    """A read-only, seekable file over one version of an object (``Client.open``).

    Suits ``io.BufferedReader`` and ``pyarrow.PythonFile``. Every read goes through
    the client (and its cache). The file is pinned to the version it was opened
    on: if the object changes, a read raises :class:`~chunkd.errors.VersionChangedError`
    rather than mix two versions.
    """

    def __init__(self, client: RangeSource, stat: ObjectStat) -> None:
        super().__init__()
        self._client = client
        self._stat = stat
        self._position = 0

    def __repr__(self) -> str:
        return f"<ChunkdFile {self.name!r} size={self.size}>"

    @property
    def name(self) -> str:
        """The object, ``BACKEND/KEY``."""
        return self._stat.name

    @property
    def mode(self) -> str:
        """Always ``"rb"``."""
        return "rb"

    @property
    def size(self) -> int:
        """Bytes in the object version this file reads."""
        return self._stat.size

    @property
    def version(self) -> str:
        """The object version this file reads."""
        return self._stat.version

    def readable(self) -> bool:
        self._checkClosed()
        return True

    def seekable(self) -> bool:
        self._checkClosed()
        return True

    def tell(self) -> int:
        self._checkClosed()
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._checkClosed()
        if whence == io.SEEK_SET:
            position = offset
        elif whence == io.SEEK_CUR:
            position = self._position + offset
        elif whence == io.SEEK_END:
            position = self.size + offset
        else:
            raise ValueError(f"whence must be 0, 1 or 2; got {whence!r}")
        if position < 0:
            raise ValueError(f"cannot seek to {position}, before the start of {self.name}")
        self._position = position
        return position

    def readinto(self, buffer: WriteableBuffer) -> int:
        self._checkClosed()
        target = byte_target(buffer)
        n = min(len(target), self.size - self._position)
        if n <= 0:
            return 0
        copied = self._located(n).copy_into(target)
        self._position += copied
        return copied

    def read(self, size: int | None = -1) -> bytes:
        self._checkClosed()
        left = self.size - self._position
        n = left if size is None or size < 0 else min(size, left)
        if n <= 0:
            return b""
        data = self._located(n).to_bytes()
        self._position += len(data)
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def _located(self, n: int) -> Located:
        located = self._client.locate(self.name, self._position, n)
        if located.version != self.version:
            raise VersionChangedError(
                f"{self.name} changed from version {self.version} to {located.version} "
                "while it was open; open it again to read the new version"
            )
        return located
