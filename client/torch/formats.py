"""Shard formats: how one kind of shard splits into samples.

``"jsonl"``: one sample per line, as ``bytes`` without the newline. ``"fixed"``: one
sample per ``record_bytes`` bytes, as a read-only, zero-copy ``uint8`` tensor.
``"parquet"``: one sample per row group, as a ``pyarrow.Table`` (pyarrow is imported
when a Parquet shard is first opened). A format counts a shard's samples and reads
one of them; what it learns of a shard (line ends, row group counts) it keeps, per
process.
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from typing import Any, Final, Literal

import numpy as np
import torch
from numpy.typing import NDArray

from chunkd.client.core import Client
from chunkd.client.torch.tensors import as_tensor

__all__ = [
    "FixedRecords",
    "JsonLines",
    "ParquetRowGroups",
    "ShardFormat",
    "ShardKind",
    "shard_format",
]

#: what a shard holds: one sample per JSON line, per fixed-size record, per Parquet row group
ShardKind = Literal["jsonl", "fixed", "parquet"]

#: a JSON lines shard is scanned for newlines this many bytes at a time
_SCAN_BYTES: Final = 64 << 20
#: open Parquet files kept per process
_PARQUET_FILES: Final = 16


def shard_format(kind: ShardKind, record_bytes: int | None) -> ShardFormat:
    """The format of shards of ``kind`` (``record_bytes``: for ``"fixed"`` only).

    Raises:
        ValueError: an unknown kind, or ``record_bytes`` missing or given where it
            does not belong.
    """
    if kind == "fixed":
        if record_bytes is None or record_bytes <= 0:
            raise ValueError(f"kind='fixed' needs record_bytes > 0; got {record_bytes!r}")
        return FixedRecords(record_bytes)
    if record_bytes is not None:
        raise ValueError(f"record_bytes is for kind='fixed' only; kind is {kind!r}")
    if kind == "jsonl":
        return JsonLines()
    if kind == "parquet":
        return ParquetRowGroups()
    raise ValueError(f"kind must be 'jsonl', 'fixed' or 'parquet'; got {kind!r}")


class ShardFormat:
    """How one kind of shard splits into samples. Caches are per process."""

    def count(self, client: Client, name: str) -> int:
        raise NotImplementedError

    def read(self, client: Client, name: str, index: int) -> Any:
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)


class JsonLines(ShardFormat):
    """One sample per line (its bytes without the newline); a last line may lack one."""

    def __init__(self) -> None:
        #: per shard, where each line ends (its newline, or the end of the shard)
        self.ends: dict[str, NDArray[np.int64]] = {}

    def count(self, client: Client, name: str) -> int:
        return len(self._ends(client, name))

    def read(self, client: Client, name: str, index: int) -> bytes:
        ends = self._ends(client, name)
        start = 0 if index == 0 else int(ends[index - 1]) + 1
        length = int(ends[index]) - start
        return bytes(client.read(name, start, length)) if length else b""

    def _ends(self, client: Client, name: str) -> NDArray[np.int64]:
        ends = self.ends.get(name)
        if ends is None:
            size = client.stat(name).size
            found = []
            for offset in range(0, size, _SCAN_BYTES):
                view = client.read(name, offset, min(_SCAN_BYTES, size - offset))
                found.append(np.flatnonzero(np.frombuffer(view, dtype=np.uint8) == 0x0A) + offset)
            if size and (not found or not len(found[-1]) or found[-1][-1] != size - 1):
                found.append(np.array([size]))
            ends = np.concatenate([np.empty(0, dtype=np.int64), *found]).astype(np.int64)
            self.ends[name] = ends
        return ends


class FixedRecords(ShardFormat):
    """One sample per ``record_bytes`` bytes: a read-only, zero-copy uint8 tensor."""

    def __init__(self, record_bytes: int) -> None:
        self.record_bytes = record_bytes

    def count(self, client: Client, name: str) -> int:
        size = client.stat(name).size
        records, left = divmod(size, self.record_bytes)
        if left:
            raise ValueError(
                f"shard {name} holds {size} bytes, not a whole number of "
                f"{self.record_bytes}-byte records ({left} bytes left over); "
                "check record_bytes or the shard"
            )
        return records

    def read(self, client: Client, name: str, index: int) -> torch.Tensor:
        size = self.record_bytes
        return as_tensor(client.read(name, index * size, size))


class ParquetRowGroups(ShardFormat):
    """One sample per row group: a ``pyarrow.Table``."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._files: OrderedDict[str, Any] = OrderedDict()

    def count(self, client: Client, name: str) -> int:
        count = self.counts.get(name)
        if count is None:
            count = self.counts[name] = int(self._file(client, name).metadata.num_row_groups)
        return count

    def read(self, client: Client, name: str, index: int) -> Any:
        return self._file(client, name).read_row_group(index)

    def _file(self, client: Client, name: str) -> Any:
        parquet = self._files.get(name)
        if parquet is None:
            pa = importlib.import_module("pyarrow")
            pq = importlib.import_module("pyarrow.parquet")
            # Only the footer and the row groups asked for are read, not the shard.
            parquet = pq.ParquetFile(pa.PythonFile(client.open(name), mode="r"))
            self._files[name] = parquet
            while len(self._files) > _PARQUET_FILES:
                self._files.popitem(last=False)[1].close()
        else:
            self._files.move_to_end(name)
        return parquet

    def __getstate__(self) -> dict[str, Any]:
        return {"counts": self.counts, "_files": OrderedDict()}
