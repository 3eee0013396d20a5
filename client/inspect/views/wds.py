"""The inspector's view of a WebDataset tar (:class:`TarView`): one sample per key, from
its headers alone (the WebDataset format's header walk, taken only as far as the pages
asked for); its files go as ``$media`` ranges of the tar.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

from chunkd.client.datasets.source import PinnedSource
from chunkd.client.inspect.values import AudioCells, tar_file
from chunkd.client.inspect.views.view import (
    FIELD_LINES,
    PinnedReads,
    malformed,
    past_end,
    split_name,
)
from chunkd.errors import DatasetFormatError, InvalidRequestError
from chunkd.mediatype import SNIFF_BYTES, sniff
from chunkd.snapshot import Member

if TYPE_CHECKING:
    from chunkd.client.core import Client
    from chunkd.client.results import ObjectStat

__all__ = ["MAX_TAR_SAMPLES", "TarView"]

#: a tar is indexed up to this many samples
MAX_TAR_SAMPLES: Final = 200_000
#: the first page of a tar's samples in ``open``
_TAR_FIRST_PAGE: Final = 20


class TarView:
    """A WebDataset tar: one sample per key, its files as ranges of the tar."""

    kind = "wds"

    def __init__(self, client: Client, stat: ObjectStat) -> None:
        from chunkd.client.datasets.formats import wds

        self.name = stat.name
        self._read = PinnedReads(client, stat)
        backend, key = split_name(stat.name)
        source = PinnedSource(client, backend)
        member = Member(key, stat.size, stat.version, "wds")
        self._split = wds.split_name
        # The dataset format's header walk, taken only as far as the pages asked for: a
        # tar's headers lie all along it, and reading them is reading the tar.
        self._walk = wds.tar_files(source, member)
        self.index: list[list[Any]] = []
        self._exts: set[str] = set()
        self.walked = False  # every header read
        self.bounded = False  # stopped at MAX_TAR_SAMPLES
        self._grow(_TAR_FIRST_PAGE)

    def _grow(self, upto: int) -> None:
        """Index samples until sample ``upto`` is whole (the next one has begun), the
        tar ends, or :data:`MAX_TAR_SAMPLES` are indexed."""
        while not (self.walked or self.bounded) and len(self.index) <= upto + 1:
            try:
                path, offset, size = next(self._walk)
            except StopIteration:
                self.walked = True
                break
            except DatasetFormatError as exc:
                raise malformed(exc) from None
            parts = self._split(path)
            if parts is None:
                continue
            name, ext = parts
            current = self.index[-1] if self.index else None
            if current is None or name != current[0] or ext in self._exts:
                if len(self.index) >= MAX_TAR_SAMPLES:
                    self.bounded = True
                    break
                current = [name, []]
                self._exts = set()
                self.index.append(current)
            current[1].append((ext, offset, size))
            self._exts.add(ext)

    def _whole(self) -> int:
        """How many samples are indexed whole."""
        done = self.walked or self.bounded
        return len(self.index) if done else max(0, len(self.index) - 1)

    @property
    def total(self) -> int | None:
        return len(self.index) if self.walked else None

    @property
    def nbytes(self) -> int:
        return 256 + sum(120 + 100 * len(files) for _, files in self.index)

    def fields(self) -> list[str] | None:
        found: dict[str, None] = {}
        for _, files in self.index[:FIELD_LINES]:
            found.update(dict.fromkeys(ext for ext, _, _ in files))
        return list(found) or None

    def describe(self) -> dict[str, Any]:
        samples = []
        for i, (key, files) in enumerate(self.index[: min(_TAR_FIRST_PAGE, self._whole())]):
            members = []
            for ext, offset, size in files:
                head = bytes(self._read(offset, min(size, SNIFF_BYTES)))
                members.append(
                    {"ext": ext, "offset": offset, "length": size, "media_type": sniff(head)}
                )
            samples.append({"key": key, "index": i, "members": members})
        return {
            "samples_total": self.total,
            "samples_indexed": len(self.index),
            "samples": samples,
        }

    def rows(self, start: int, columns: list[str] | None) -> Iterator[tuple[int, Any]]:
        self._grow(start)
        if not 0 <= start < self._whole():
            if self.bounded and start >= len(self.index):
                raise InvalidRequestError(
                    f"sample {start} of {self.name}: the inspector indexes a tar's first "
                    f"{MAX_TAR_SAMPLES} samples only; split the tar, or register it as a dataset"
                )
            raise past_end(self.name, start, len(self.index))
        i = start
        cells = AudioCells()  # this page's audio headers
        while True:
            self._grow(i)
            if i >= self._whole():
                return
            key, files = self.index[i]
            value: dict[str, Any] = {"__key__": key}
            for ext, offset, size in files:
                if columns is None or ext in columns:
                    value[ext] = tar_file(self._read, self.name, ext, offset, size, cells)
            yield i, value
            i += 1
