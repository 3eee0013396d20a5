"""Where a snapshot's member bytes come from: :class:`Source`.

Formats read members through a source, never through the client directly, so the
same format code reads a member pinned at its recorded version in its backend
(:class:`PinnedSource`) or, once the snapshot is frozen, from the registry's
content-addressed chunks (``FrozenSource``, in :mod:`chunkd.client.datasets.frozen`).
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, BinaryIO, Protocol

from chunkd.client.files import ChunkdFile
from chunkd.client.jobs import FOR_DATASET
from chunkd.client.results import ObjectStat
from chunkd.errors import (
    ObjectNotFoundError,
    RangeNotSatisfiableError,
    SnapshotDriftError,
    VersionChangedError,
)

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

    from chunkd.client.core import Client
    from chunkd.client.views import Located
    from chunkd.snapshot import Member

__all__ = ["MemberFile", "PinnedSource", "Source"]


class Source(Protocol):
    """The bytes of a snapshot's members."""

    def read(self, member: Member, offset: int, length: int) -> memoryview:
        """Bytes ``offset .. offset + length`` of ``member`` (cut at its end).

        Raises:
            SnapshotDriftError: the member's object is no longer the version recorded.
        """
        ...

    def file(self, member: Member) -> BinaryIO:
        """A read-only, seekable file over ``member`` (for pyarrow and tarfile)."""
        ...

    def name(self, member: Member) -> str:
        """The member's object name, ``BACKEND/KEY``."""
        ...


def drift(name: str, version: str, exc: BaseException) -> SnapshotDriftError:
    """The error of a member whose object changed (``exc``) since it was recorded."""
    what = "is gone" if isinstance(exc, ObjectNotFoundError) else "changed"
    return SnapshotDriftError(
        f"snapshot member {name} {what} since it was registered (recorded version "
        f"{version!r}): it is not read at other contents. Register the dataset again, "
        "or freeze snapshots whose sources are rewritten"
    )


class PinnedSource:
    """Members read from their backend, each pinned at its recorded version.

    Args:
        client: the node's daemon.
        backend: the backend the snapshot's members are in.

    Attributes:
        dataset: the dataset's name (a registered snapshot's), sent with its reads so
            the daemon accounts their cost to it; None: not known.
    """

    def __init__(self, client: Client, backend: str) -> None:
        self.client = client
        self.backend = backend
        self.dataset: str | None = None

    def name(self, member: Member) -> str:
        return f"{self.backend}/{member.key}"

    def read(self, member: Member, offset: int, length: int) -> memoryview:
        name = self.name(member)
        if length <= 0 or offset >= member.size:
            return memoryview(b"")
        token = FOR_DATASET.set(self.dataset)
        try:
            return self.client.read(name, offset, length, version=member.version)
        except (VersionChangedError, ObjectNotFoundError, RangeNotSatisfiableError) as exc:
            # The range is inside the member as recorded: past the object's end, it shrank.
            raise drift(name, member.version, exc) from None
        finally:
            FOR_DATASET.reset(token)

    def file(self, member: Member) -> BinaryIO:
        name = self.name(member)
        stat = ObjectStat(name, member.size, member.version, self.client.chunk_bytes, 0)
        raw = ChunkdFile(_Pinned(self.client, member.version, self.dataset), stat)
        return io.BufferedReader(raw, buffer_size=1 << 20)


class _Pinned:
    """A range source (for :class:`ChunkdFile`) that maps a changed object to drift."""

    def __init__(self, client: Client, version: str, dataset: str | None = None) -> None:
        self._client = client
        self._version = version
        self._dataset = dataset

    def locate(self, name: str, offset: int, length: int | None) -> Located:
        token = FOR_DATASET.set(self._dataset)
        try:
            located = self._client.locate(name, offset, length, self._version)
        except (ObjectNotFoundError, RangeNotSatisfiableError) as exc:
            raise drift(name, self._version, exc) from None
        finally:
            FOR_DATASET.reset(token)
        if located.version != self._version:
            raise drift(name, self._version, VersionChangedError(name))
        return located


class MemberFile(io.RawIOBase):
    """A read-only, seekable file over a member (for pyarrow and tarfile) that answers
    from ranges already read where it can (``pieces``: ``{offset: bytes}``, a row group,
    a record batch, a footer) and reads anything else through the source.

    Args:
        source: where the member's bytes come from.
        member: the member.
        pieces: ranges of it already in hand, by their offset.
    """

    def __init__(
        self, source: Source, member: Member, pieces: dict[int, memoryview] | None = None
    ) -> None:
        super().__init__()
        self._source = source
        self._member = member
        self._pieces = pieces or {}
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._member.size}
        self._position = max(0, base[whence] + offset)
        return self._position

    def readinto(self, buffer: WriteableBuffer) -> int:
        target = memoryview(buffer).cast("B")
        n = min(len(target), self._member.size - self._position)
        if n <= 0:
            return 0
        for start, view in self._pieces.items():
            inside = self._position - start
            if inside >= 0 and inside + n <= len(view):
                target[:n] = view[inside : inside + n]
                break
        else:
            got = self._source.read(self._member, self._position, n)
            n = len(got)
            target[:n] = got
        self._position += n
        return n
