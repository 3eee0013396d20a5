"""``file:///dir``: a directory (a POSIX mount: NFS, Lustre, a local disk).

Reads and writes go through obstore's ``LocalStore``; listings through
:class:`~chunkd.gateway.backends.filelist.FileLister`, in S3's key order and resumable
after any key (``LocalStore`` lists in directory order). No endpoint, region or
credentials: the daemon's own file permissions apply.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import re
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, ClassVar, Final

from obstore.store import LocalStore

from chunkd.errors import InvalidKeyError, ObjectNotFoundError
from chunkd.gateway.backends.base import SCAN_BATCH
from chunkd.gateway.backends.filelist import FileLister
from chunkd.gateway.backends.store import StoreBackend, shown

if TYPE_CHECKING:
    from chunkd.gateway.backends.meta import ObjectMeta
    from chunkd.gateway.config import BackendConfig
    from chunkd.gateway.metrics import Metrics

__all__ = ["FileBackend"]

# obstore's text for an OS error (LocalFileSystem): "... File name too long (os error 36)".
_OS_ERROR: Final = re.compile(r"\(os error (\d+)\)")


class FileBackend(StoreBackend):
    """A directory of files; keys are paths below it."""

    bounded_per_read: ClassVar[bool] = False

    def __init__(self, config: BackendConfig, metrics: Metrics, store: Any = None) -> None:
        super().__init__(config, metrics, store)
        self._files = FileLister(config.prefix)

    @classmethod
    def make_store(cls, config: BackendConfig) -> Any:
        # docstring inherited
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
