"""A map-style dataset whose samples are byte ranges ``(name, offset, length)``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from torch.utils.data import Dataset

from chunkd.client.core import Client
from chunkd.client.torch.slot import ClientFactory, ClientSlot

__all__ = ["Record", "RecordDataset"]


class Record(NamedTuple):
    """A byte range of an object: a sample of a :class:`RecordDataset`."""

    name: str
    offset: int
    length: int


class RecordDataset(Dataset[Any]):
    """A map-style dataset whose samples are byte ranges of objects.

    ``dataset[i]`` reads ``records[i]`` through the client: a read-only, zero-copy
    ``memoryview`` of its bytes, or ``transform(view)``. Pass a transform with
    DataLoader workers, since a view does not pickle (see the module docstring).

    Args:
        records: ``(name, offset, length)`` per sample (``name`` is ``BACKEND/KEY``).
        client: a :class:`~chunkd.client.Client`, a zero-argument factory of one,
            or None (``Client()``); made on first use in each process.
        transform: applied to the view of each sample.
    """

    def __init__(
        self,
        records: Sequence[tuple[str, int, int]],
        client: Client | ClientFactory | None = None,
        *,
        transform: Callable[[memoryview], Any] | None = None,
    ) -> None:
        self.records = records
        self.transform = transform
        self._client = ClientSlot(client)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> Any:
        name, offset, length = self.records[index]
        view = self._client.get().read(name, offset, length)
        if len(view) != length:
            raise ValueError(
                f"record {index} asks for {length} bytes of {name} at {offset}, "
                f"but the object ends after {len(view)} of them; fix the record"
            )
        return view if self.transform is None else self.transform(view)
