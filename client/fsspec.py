"""An fsspec filesystem for ``chunkd://BACKEND/KEY``: pyarrow, pandas, DuckDB, datasets.

Registered under the ``chunkd`` protocol through the ``fsspec.specs`` entry point,
so ``fsspec.open("chunkd://data/x.parquet")``, ``pandas.read_parquet``, pyarrow
dataset discovery (``pyarrow.dataset.dataset("data/shards", filesystem=fs)``), HF
``datasets.load_dataset(..., data_files="chunkd://data/shards/*.parquet")``, polars
through a file object, and DuckDB through ``duckdb.register_filesystem(fs)`` read
through the node's daemon. Reads are byte ranges of the daemon's cached chunks; the
filesystem is read-only.

Directories are the backend's key prefixes (``/``-separated), as object stores
have them. Listings are read from the daemon page by page, so a folder of a
million shards lists; ``find`` with no depth limit is one recursive listing, not a
walk. A file's info carries its size, ``mtime`` (seconds since the epoch, also
through :meth:`~ChunkdFileSystem.modified`) and ``ETag`` (the backend's version
token, also :meth:`~ChunkdFileSystem.ukey`). ``cat_ranges`` sends small ranges
together, up to 256 a round trip.
"""

from __future__ import annotations

import datetime
import hashlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from chunkd.client.core import Client
from chunkd.errors import ChunkdError, ObjectNotFoundError, RangeNotSatisfiableError

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

    # -- listing ----------------------------------------------------------------------

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        # docstring inherited
        path = self._strip_protocol(path)
        out = _without_markers([_info(e) for e in self.client.iter_ls(path)])
        if not out:
            out = [self.info(path)]  # a file lists as itself; a missing path raises
        return out if detail else [e["name"] for e in out]

    def find(
        self,
        path: str,
        maxdepth: int | None = None,
        withdirs: bool = False,
        detail: bool = False,
        **kwargs: Any,
    ) -> Any:
        # docstring inherited
        if maxdepth is not None:
            return super().find(path, maxdepth=maxdepth, withdirs=withdirs, detail=detail, **kwargs)
        path = self._strip_protocol(path)
        found: dict[str, dict[str, Any]] = {}
        for info in self._walk_recursive(path, withdirs):
            found[info["name"]] = info
        if not found:
            try:
                info = self.info(path)
            except FileNotFoundError:
                return {} if detail else []
            if info["type"] == "file" or withdirs:
                found[path] = info
        elif withdirs and path:
            found.setdefault(path, {"name": path, "size": 0, "type": "directory"})
        folders = _folders(found)  # a folder's marker (see _without_markers) is no file
        names = sorted(
            n
            for n, i in found.items()
            if not (i["type"] == "file" and not i["size"] and n in folders)
        )
        return {n: found[n] for n in names} if detail else names

    def _walk_recursive(self, path: str, withdirs: bool) -> Iterator[dict[str, Any]]:
        """Every file under ``path`` (one recursive listing), and with ``withdirs``
        each directory the keys imply, once, before its first file."""
        top = f"{path}/" if path else ""
        above: list[str] = []  # the directories of the file before, below ``top``
        for entry in self.client.iter_ls(path, recursive=True):
            info = _info(entry)
            if withdirs:
                parts = info["name"][len(top) :].split("/")[:-1]
                same = 0
                while same < min(len(parts), len(above)) and parts[same] == above[same]:
                    same += 1
                for depth in range(same, len(parts)):  # keys come in order: new ones
                    yield {
                        "name": top + "/".join(parts[: depth + 1]),
                        "size": 0,
                        "type": "directory",
                    }
                above = parts
            yield info

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        # docstring inherited
        path = self._strip_protocol(path)
        if "/" in path:
            try:
                stat = self.client.stat(path)
            except ObjectNotFoundError:
                pass
            else:
                return {
                    "name": path,
                    "size": stat.size,
                    "type": "file",
                    "mtime": stat.modified,
                    "ETag": stat.version,
                    "version": stat.version,
                }
        if not path or self.client.ls_page(path, limit=1)[0]:
            return {"name": path, "size": 0, "type": "directory"}
        raise FileNotFoundError(f"chunkd://{path} does not exist")

    # -- what engines ask of a file -------------------------------------------------

    def modified(self, path: str) -> datetime.datetime:
        """When the object was last written (UTC).

        Raises:
            FileNotFoundError: no such object.
            IsADirectoryError: ``path`` is a directory (a key prefix has no time).
        """
        info = self._file_info(path)
        if info["mtime"] is None:
            raise NotImplementedError(f"the backend of chunkd://{path} records no times")
        return datetime.datetime.fromtimestamp(info["mtime"], tz=datetime.UTC)

    def created(self, path: str) -> datetime.datetime:
        """When the object was written: object stores replace objects whole, so an
        object's version was created when it was last written (:meth:`modified`)."""
        return self.modified(path)

    def ukey(self, path: str) -> str:
        """A key unique to this version of the object: its backend version token."""
        return str(self._file_info(path)["ETag"])

    def checksum(self, path: str) -> int:
        """An integer that changes whenever the object does (from its version token)."""
        info = self._file_info(path)
        token = f"{info['name']}\0{info['ETag']}\0{info['size']}".encode()
        return int(hashlib.blake2b(token, digest_size=8).hexdigest(), 16)

    def _file_info(self, path: str) -> dict[str, Any]:
        info = self.info(path)
        if info["type"] != "file":
            raise IsADirectoryError(f"chunkd://{info['name']} is a directory")
        return info

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> bytes:
        # docstring inherited
        path = self._strip_protocol(path)
        size = self.info(path)["size"]
        lo, hi = _bounds(start, end, size)
        if hi <= lo:
            return b""
        return bytes(self.client.read(path, lo, hi - lo))

    def cat_ranges(
        self,
        paths: list[str],
        starts: int | list[int | None] | None,
        ends: int | list[int | None] | None,
        max_gap: int | None = None,
        on_error: str = "return",
        **kwargs: Any,
    ) -> list[bytes | Exception]:
        """Byte ranges of several objects, small ones batched into few round trips.

        ``starts`` and ``ends`` follow :meth:`cat_file` (None: the start or the end;
        negative: from the end). With ``on_error="return"`` a range that fails comes
        back as its exception; otherwise the first failure is raised.
        """
        names = [self._strip_protocol(p) for p in paths]
        count = len(names)
        lows = starts if isinstance(starts, list) else [starts] * count
        highs = ends if isinstance(ends, list) else [ends] * count
        if len(lows) != count or len(highs) != count:
            raise ValueError("cat_ranges wants as many starts and ends as paths")
        out: list[bytes | Exception | None] = [None] * count
        asked: list[tuple[int, str, int, int]] = []
        for i, (name, lo, hi) in enumerate(zip(names, lows, highs, strict=True)):
            try:
                size = None
                if lo is None or hi is None or lo < 0 or hi < 0:
                    size = self.info(name)["size"]
                first, last = _bounds(lo, hi, size)
            except (OSError, ChunkdError) as exc:
                out[i] = exc
                continue
            if last <= first:
                out[i] = b""
            else:
                asked.append((i, name, first, last - first))
        got = self.client.read_ranges([(n, o, ln) for _, n, o, ln in asked])
        for (i, _, _, _), result in zip(asked, got, strict=True):
            # fsspec's ranges are slices: one that starts at or past the end is empty.
            out[i] = b"" if isinstance(result, RangeNotSatisfiableError) else result
        results: list[bytes | Exception] = []
        for outcome in out:
            assert outcome is not None
            if isinstance(outcome, Exception) and on_error != "return":
                raise outcome
            results.append(outcome)
        return results

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


def _info(entry: dict[str, Any]) -> dict[str, Any]:
    """A daemon listing entry as fsspec describes a path."""
    if entry["type"] == "directory":
        return {"name": entry["name"], "size": 0, "type": "directory"}
    version = entry.get("version")
    return {
        "name": entry["name"],
        "size": int(entry.get("size", 0)),
        "type": "file",
        "mtime": entry.get("modified"),
        "ETag": version,
        "version": version,
    }


def _without_markers(infos: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One level of entries without the directory markers among them.

    An S3 folder is often marked by an empty object named ``dir/``, which obstore
    names ``dir``, the name of the folder itself: listed beside it, it would be a
    second ``dir``. An empty file whose name a directory of the listing has is left
    out, as s3fs leaves markers out.
    """
    dirs = {i["name"] for i in infos if i["type"] == "directory"}
    return [i for i in infos if not (i["type"] == "file" and not i["size"] and i["name"] in dirs)]


def _folders(names: Iterable[str]) -> set[str]:
    """Every folder above one of ``names``."""
    out: set[str] = set()
    for name in names:
        while (slash := name.rfind("/")) > 0:
            name = name[:slash]
            if name in out:
                break
            out.add(name)
    return out


def _bounds(start: int | None, end: int | None, size: int | None) -> tuple[int, int]:
    """``start`` and ``end`` as cat_file takes them, resolved against ``size``."""
    lo = 0 if start is None else start
    if lo < 0:
        assert size is not None
        lo = max(0, size + lo)
    if end is None:
        assert size is not None
        hi = size
    elif end < 0:
        assert size is not None
        hi = max(0, size + end)
    else:
        hi = end if size is None else min(end, size)
    return lo, hi
