"""``file:///dir``: a directory (a POSIX mount: NFS, Lustre, a local disk).

Reads and writes go through obstore's ``LocalStore``; listings through
:class:`~chunkd.gateway.backends.filelist.FileLister`, in S3's key order and resumable
after any key (``LocalStore`` lists in directory order). No endpoint, region or
credentials: the daemon's own file permissions apply.

A streamed write (:meth:`FileBackend.put_stream`) goes to a staging file (``NAME#N``,
hidden from listings as ``LocalStore``'s own are) in the key's directory, or in its
nearest directory that exists (the key's own are made only once every byte is in, so
a write that fails leaves no empty directory behind), flushed to disk, then
``link()``-ed to the key: ``link`` fails where the name exists, so an object is never
overwritten. The staging file is removed whatever happens.

Small first reads of many files (a registration's footers, :meth:`FileBackend.read_batch`,
the :class:`~chunkd.gateway.backends.base.BatchReads` protocol) skip obstore: one thread
reads a whole batch (``open``, ``fstat``, ``pread``, ``fstat`` again, ``close`` each),
about 6 us a file where a GET through ``LocalStore`` bridged into asyncio costs over
100 us of the event loop's time. The version is the one the lister and ``LocalStore``
give (``"INODE-MTIME_US-SIZE"``, hex, quoted). A file it does not read plainly (absent,
not a regular file, a name with characters ``LocalStore`` might encode, changed between
the two ``fstat``) is left to the usual GET, which says what is wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import os
import re
import secrets
import stat
import time
from collections.abc import AsyncGenerator, AsyncIterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Final

from obstore.store import LocalStore

from chunkd.errors import (
    BackendUnavailableError,
    ChunkdError,
    InvalidKeyError,
    ObjectNotFoundError,
)
from chunkd.gateway.backends.base import SCAN_BATCH, stream_size_error
from chunkd.gateway.backends.filelist import FileLister
from chunkd.gateway.backends.meta import ObjectMeta
from chunkd.gateway.backends.store import StoreBackend, shown
from chunkd.gateway.costs import charge

if TYPE_CHECKING:
    from chunkd.gateway.config import BackendConfig
    from chunkd.gateway.metrics import Metrics

__all__ = ["FileBackend"]

# obstore's text for an OS error (LocalFileSystem): "... File name too long (os error 36)".
_OS_ERROR: Final = re.compile(r"\(os error (\d+)\)")
# A staging file's name (LocalStore's, and put_stream's): no key may end so.
_STAGING_NAME: Final = re.compile(r".*#[0-9]+")
# Keys a batch reads itself: characters that name the same file whoever joins the path
# (no '%', '#', '?', space or non-ASCII, which an object store client may encode).
_PLAIN_KEY: Final = re.compile(r"[A-Za-z0-9._/=+,@~-]+")
_READ_FLAGS: Final = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO must not block


class FileBackend(StoreBackend):
    """A directory of files; keys are paths below it."""

    bounded_per_read: ClassVar[bool] = False

    def __init__(self, config: BackendConfig, metrics: Metrics, store: Any = None) -> None:
        super().__init__(config, metrics, store)
        self._files = FileLister(config.prefix)

    @classmethod
    def make_store(cls, config: BackendConfig) -> Any:
        # docstring inherited: the directory is made when it is not there
        os.makedirs(config.prefix, exist_ok=True)
        return LocalStore(config.prefix)

    async def scan(
        self, prefix: str, *, start_after: str | None = None, batch: int = SCAN_BATCH
    ) -> AsyncGenerator[list[ObjectMeta], None]:
        # docstring inherited
        last = start_after
        while True:
            after = last
            got = await self._call(
                "list",
                prefix or "/",
                functools.partial(asyncio.to_thread, self._files.batch, prefix, after, batch),
            )
            if got:
                yield got
                last = got[-1].key
            if len(got) < batch:
                return

    async def read_batch(
        self, asked: Sequence[tuple[str, int, int]]
    ) -> list[tuple[ObjectMeta, bytes | None] | None]:
        # docstring inherited (BatchReads)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.config.timeout):
                got = await asyncio.to_thread(_read_files, self.config.prefix, asked)
        except TimeoutError:
            error = BackendUnavailableError(
                f"backend {self.name!r} did not read {len(asked)} files within "
                f"{self.config.timeout:g}s ({asked[0][0] if asked else ''} ...)"
            )
            self.requests.settle(error)
            raise error from None
        metrics = self._metrics
        read = sum(1 for one in got if one is not None)
        if read:
            metrics.backend_requests.labels(self.name, "get").inc(read)
            charge.backend_request(self.name, "get", read)
            nbytes = sum(len(one[1]) for one in got if one is not None and one[1] is not None)
            metrics.backend_read_bytes.labels(self.name).inc(nbytes)
            charge.backend_bytes(self.name, "read", nbytes)
            seconds = metrics.backend_seconds.labels(self.name, "get")
            each = (time.perf_counter() - started) / len(asked)
            for _ in range(read):
                seconds.observe(each)
            self.requests.answered()
        return got

    @property
    def streams_conditional_put(self) -> bool:
        # docstring inherited
        return True

    @property
    def single_put_bytes(self) -> int:
        # docstring inherited
        return 1 << 62

    def held_by_put(self, size: int) -> int:
        # docstring inherited: each piece goes to the staging file as it comes
        return 0

    async def put_stream(
        self, key: str, pieces: AsyncIterable[bytes | memoryview], *, size: int
    ) -> bool:
        # docstring inherited
        self.check_writable()
        if (refused := self._refuse_long_name(key)) is not None:
            raise refused
        if not key or any(part in ("", ".", "..") for part in key.split("/")):
            raise InvalidKeyError(
                f"backend {self.name!r} cannot hold the key {shown(key)}: it has an empty, "
                "'.' or '..' segment; use another name"
            )
        if _STAGING_NAME.fullmatch(key):
            raise InvalidKeyError(
                f"backend {self.name!r} cannot hold the key {shown(key)}: a file:// backend "
                "keeps names that end in '#' and digits for its temporary files; use another name"
            )
        path = os.path.join(self.config.prefix, key)
        staging = ""
        self._metrics.backend_requests.labels(self.name, "put").inc()
        charge.backend_request(self.name, "put")
        fd = -1
        try:
            fd, staging = await asyncio.to_thread(_open_staging, self.config.prefix, path)
            written = 0
            async for piece in pieces:
                view = memoryview(piece)
                if written + view.nbytes > size:
                    raise stream_size_error(f"{self.name}/{key}", size, written + view.nbytes)
                await asyncio.to_thread(_write_all, fd, view)
                written += view.nbytes
            if written != size:
                raise stream_size_error(f"{self.name}/{key}", size, written)
            await asyncio.to_thread(os.fsync, fd)
            try:
                await asyncio.to_thread(_link, staging, path)
            except FileExistsError:
                return False
        except OSError as exc:
            if isinstance(exc, ChunkdError):  # the stream's own (a read that failed)
                raise
            raise self._os_refusal(exc, key) from None
        finally:
            if fd >= 0:
                os.close(fd)
            if staging:
                await asyncio.shield(asyncio.to_thread(_remove, staging))
        self._metrics.backend_write_bytes.labels(self.name).inc(size)
        charge.backend_bytes(self.name, "write", size)
        return True

    def _os_refusal(self, exc: OSError, key: str) -> Exception:
        """What a streamed write's OS error means: the key's fault, or the backend's."""
        code = exc.errno
        refused = self.refused_by_store(
            Exception(f"(os error {code})") if code is not None else exc, key, "put"
        )
        if refused is not None:
            return refused
        self._metrics.backend_errors.labels(self.name, "BackendUnavailableError").inc()
        return BackendUnavailableError(
            f"backend {self.name!r} failed to write {shown(key)}: "
            f"{os.strerror(code) if code is not None else exc}"
        )

    def refused_by_store(self, exc: BaseException, key: str, op: str) -> Exception | None:
        """A filesystem refuses a path segment longer than it allows (ENAMETOOLONG) or a
        name it cannot encode (EILSEQ, EINVAL), and object_store's LocalFileSystem
        refuses names that end in ``#`` and digits (it writes its temporary files under
        them). A key below a key that is a file (ENOTDIR) does not exist when read, and
        cannot be written; nor can a key where a directory is (EISDIR). Only the key is
        named in the message, never the backend's own paths."""
        text = str(exc)
        refused = f"backend {self.name!r} cannot hold the key {shown(key)}"
        if "InvalidPath {" in text:
            return InvalidKeyError(
                f"{refused}: a file:// backend keeps names that end in '#' and digits for "
                "its temporary files; use another name"
            )
        found = _OS_ERROR.search(text)
        code = int(found.group(1)) if found else None
        if code == errno.ENAMETOOLONG:
            longest = max(len(part.encode("utf-8", "surrogatepass")) for part in key.split("/"))
            why = (
                f"one path segment is {longest} bytes, and filesystems allow 255 at most"
                if longest > 255
                else "the whole path is longer than it allows"
            )
            return InvalidKeyError(
                f"{refused}: its filesystem refused the name as too long ({why}); use a shorter key"
            )
        if code in (errno.EILSEQ, errno.EINVAL):
            return InvalidKeyError(
                f"{refused}: its filesystem refused the name ({errno.errorcode[code]}: "
                "a character it does not allow in file names); use another name"
            )
        if code in (errno.ENOTDIR, errno.EISDIR):
            why = (
                "a part of its path is an object, and a file:// backend holds nothing below "
                "an object"
                if code == errno.ENOTDIR
                else "it names a directory of other objects"
            )
            if op in ("head", "get"):
                return ObjectNotFoundError(
                    f"{self.name}/{key} does not exist in backend {self.name!r} ({why})"
                )
            return InvalidKeyError(f"{refused}: {why}; use another name")
        return None


def _read_files(
    root: str, asked: Sequence[tuple[str, int, int]]
) -> list[tuple[ObjectMeta, bytes | None] | None]:
    """Each file's version and bytes (see :meth:`FileBackend.read_batch`). Blocking."""
    out: list[tuple[ObjectMeta, bytes | None] | None] = []
    plain = _PLAIN_KEY.fullmatch
    for key, start, end in asked:
        if not plain(key):
            out.append(None)
            continue
        try:
            fd = os.open(f"{root}/{key}", _READ_FLAGS)
        except OSError:
            out.append(None)  # absent, a directory's part, too long: the GET says which
            continue
        try:
            before = os.fstat(fd)
            if not stat.S_ISREG(before.st_mode):
                out.append(None)
                continue
            size = before.st_size
            micros = before.st_mtime_ns // 1000
            etag = f'"{before.st_ino:x}-{micros:x}-{size:x}"'
            meta = ObjectMeta(key, size, etag, etag, micros / 1e6)
            if start >= size:
                out.append((meta, None))
                continue
            want = min(end, size) - start
            data = os.pread(fd, want, start)
            after = os.fstat(fd)
            if len(data) != want or (after.st_mtime_ns, after.st_size, after.st_ino) != (
                before.st_mtime_ns,
                size,
                before.st_ino,
            ):
                out.append(None)  # written meanwhile: the GET reads one version
                continue
            out.append((meta, data))
        except OSError:
            out.append(None)
        finally:
            os.close(fd)
    return out


def _open_staging(root: str, path: str) -> tuple[int, str]:
    """A new staging file for ``path`` (below ``root``): in its directory, or the
    nearest one above it that exists. A name no key can have (LocalStore refuses keys
    ending in "#" and digits), which listings hide."""
    where = os.path.dirname(path)
    while not os.path.isdir(where) and len(where) > len(root):
        where = os.path.dirname(where)
    staging = os.path.join(where, f"{os.path.basename(path)}#{secrets.randbelow(10**15)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    return os.open(staging, flags, 0o666), staging


def _link(staging: str, path: str) -> None:
    """Link ``staging`` to ``path``, its directories made first (FileExistsError: an
    object is there)."""
    parent = os.path.dirname(path)
    try:
        os.makedirs(parent, exist_ok=True)
    except FileExistsError:  # a part of the path is an object
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), parent) from None
    os.link(staging, path)


def _write_all(fd: int, view: memoryview) -> None:
    while view.nbytes:
        view = view[os.write(fd, view) :]


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
