"""An fsspec filesystem for ``chunkd://BACKEND/KEY``: pyarrow, pandas, datasets.

Registered under the ``chunkd`` protocol through the ``fsspec.specs`` entry point,
so ``fsspec.open("chunkd://data/x.parquet")``,
``pyarrow.parquet.read_table("chunkd://data/x.parquet")``, pyarrow dataset
discovery (``pyarrow.dataset.dataset("chunkd://data/shards/")``) and
``pandas.read_parquet`` read through the node's daemon. Reads are byte ranges of
the daemon's cached chunks; the filesystem is read-only.

Directories are the backend's key prefixes (``/``-separated), as object stores
have them.
"""

from __future__ import annotations

import weakref
from typing import Any

from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from chunkd.client.core import Client
from chunkd.errors import ObjectNotFoundError

__all__ = ["ChunkdFile", "ChunkdFileSystem"]


class ChunkdFileSystem(AbstractFileSystem):  # type: ignore[misc]
    """``chunkd://`` paths, read through the daemon's local socket.

    Args:
        socket_path: the daemon's socket (default: the client's usual search).
    """

    protocol = "chunkd"
    root_marker = ""

    def __init__(self, socket_path: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.socket_path = socket_path
        self._client: Client | None = None

    @property
    def client(self) -> Client:
        """The connection to the daemon (made on first use; fork-safe)."""
        if self._client is None:
            self._client = Client(self.socket_path)
            # fsspec caches filesystems; the connection closes when this one goes.
            weakref.finalize(self, self._client.close)
        return self._client

    @classmethod
    def _strip_protocol(cls, path: str | list[str]) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        if path.startswith("chunkd://"):
            path = path[len("chunkd://") :]
        return path.strip("/")

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        # docstring inherited
        path = self._strip_protocol(path)
        entries = self.client.ls(path)
        if not entries:
            info = self.info(path)  # a file lists as itself; a missing path raises
            entries = [info]
        out = [{"name": e["name"], "size": e.get("size", 0), "type": e["type"]} for e in entries]
        return out if detail else [e["name"] for e in out]

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        # docstring inherited
        path = self._strip_protocol(path)
        if "/" in path:
            try:
                stat = self.client.stat(path)
            except ObjectNotFoundError:
                pass
            else:
                return {"name": path, "size": stat.size, "type": "file", "version": stat.version}
        if not path or self.client.ls(path):
            return {"name": path, "size": 0, "type": "directory"}
        raise FileNotFoundError(f"chunkd://{path} does not exist")

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> bytes:
        # docstring inherited
        path = self._strip_protocol(path)
        size = self.info(path)["size"]
        lo = 0 if start is None else (start if start >= 0 else max(0, size + start))
        hi = size if end is None else (end if end >= 0 else max(0, size + end))
        if hi <= lo or lo >= size:
            return b""
        return bytes(self.client.read(path, lo, min(hi, size) - lo))

    def _open(
        self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any
    ) -> ChunkdFile:
        if mode != "rb":
            raise PermissionError(
                f"chunkd:// is read-only; cannot open {path!r} with mode {mode!r}"
            )
        return ChunkdFile(self, path, mode=mode, block_size=block_size or "default", **kwargs)


class ChunkdFile(AbstractBufferedFile):  # type: ignore[misc]
    """A read-only file of a ``chunkd://`` object; its ranges come from the client."""

    def _fetch_range(self, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        return bytes(self.fs.client.read(self.path, start, end - start))
