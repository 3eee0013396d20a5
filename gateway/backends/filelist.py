"""Listing a ``file://`` backend in key order, resumable after any key.

obstore's ``LocalStore`` lists in directory order and implements ``offset`` by
walking everything and filtering, so a listing of N keys read in pages would cost
N²/page. :class:`FileLister` walks the tree itself in **key order** (the UTF-8 byte
order S3 lists in), and resumes after a key by descending its path, so each page
costs about what it returns.

Key order from a directory walk: the children of a directory are sorted by
``name + "/"`` for a directory and ``name`` for a file. Every key below a
directory ``d`` starts with ``d/``, so sorting siblings that way puts each
subtree exactly where its keys fall among the siblings' keys (``data.json`` comes
before ``data/x``, as ``.`` sorts before ``/``).

The keys are what obstore's ``LocalStore`` names the same files (paths relative to
the root, symlinks followed), and the sizes, times and versions what its HEAD says
(``"INODE-MTIME_US-SIZE"`` in hex, quoted). Files that ``LocalStore`` hides (the
``name#N`` staging files of a write in progress) are hidden here too.

Large directories are read once and kept sorted in memory while their mtime (and
inode) stays the same, within a bound on the names kept in all.
"""

from __future__ import annotations

import bisect
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

from chunkd.gateway.backends.meta import ObjectMeta

__all__ = ["FileLister"]

#: directories with at least this many entries are kept sorted between pages
_CACHE_FROM: Final = 256
#: names kept in all by one lister's directory cache (about 100 bytes each): enough
#: for a few folders of 100,000 files each read in pages
_CACHE_NAMES: Final = 1 << 18
_STAGING: Final = re.compile(r".*#[0-9]+")


@dataclass(frozen=True, slots=True)
class _Dir:
    """One directory's children, sorted in key order."""

    #: ``name + "/"`` for a directory, ``name`` for a file: the sort key
    keys: list[str]
    #: which of them are directories
    dirs: list[bool]
    stamp: tuple[int, int, int]


class FileLister:
    """Lists the files under ``root`` in key order. Blocking: call it in a thread.

    Args:
        root: the backend's directory.
    """

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/") or "/"
        self._cache: OrderedDict[str, _Dir] = OrderedDict()
        self._cached_names = 0
        self._lock = threading.Lock()

    def batch(self, prefix: str, start_after: str | None, limit: int) -> list[ObjectMeta]:
        """Up to ``limit`` files under ``prefix``, after the key ``start_after``.

        ``prefix`` counts whole path segments, as obstore's does: ``a/b`` holds
        ``a/b/x`` but neither ``a/bc`` nor a file ``a/b`` itself.
        """
        base = prefix.strip("/")
        top = f"{base}/" if base else ""
        after = start_after or ""
        if after and not after.startswith(top):
            if after > top:
                return []  # the token is past everything under the prefix
            after = ""
        out: list[ObjectMeta] = []
        self._walk(top, after[len(top) :], limit, out)
        return out

    def _walk(self, rel: str, after: str, limit: int, out: list[ObjectMeta]) -> None:
        """Append files under directory ``rel`` (``""`` or ``"a/b/"``) whose key,
        relative to it, sorts after ``after``, until ``out`` holds ``limit``."""
        listing = self._read(rel)
        if listing is None:
            return
        keys, dirs = listing.keys, listing.dirs
        start = bisect.bisect_right(keys, after) if after else 0
        if after and start and dirs[start - 1] and after.startswith(keys[start - 1]):
            inner = keys[start - 1]  # the token lies inside this directory: resume there
            self._walk(rel + inner, after[len(inner) :], limit, out)
        if start >= len(keys) or len(out) >= limit:
            return
        try:
            fd = os.open(self._path(rel), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return  # removed meanwhile
        try:
            stat = os.stat
            for i in range(start, len(keys)):
                if len(out) >= limit:
                    return
                name = keys[i]
                if dirs[i]:
                    self._walk(rel + name, "", limit, out)
                    continue
                try:
                    st = stat(name, dir_fd=fd)
                except OSError:
                    continue  # removed meanwhile, or a dangling link
                micros = st.st_mtime_ns // 1000
                size = st.st_size
                etag = f'"{st.st_ino:x}-{micros:x}-{size:x}"'
                out.append(ObjectMeta(rel + name, size, etag, etag, micros / 1e6))
        finally:
            os.close(fd)

    def _path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def _read(self, rel: str) -> _Dir | None:
        path = self._path(rel)
        try:
            st = os.stat(path)
        except OSError:
            return None
        stamp = (st.st_mtime_ns, st.st_ino, st.st_dev)
        with self._lock:
            cached = self._cache.get(path)
            if cached is not None and cached.stamp == stamp:
                self._cache.move_to_end(path)
                return cached
        children: list[tuple[str, bool]] = []
        try:
            with os.scandir(path) as entries:
                for entry in entries:
                    name = entry.name
                    if not name.isascii() and not _utf8(name):
                        continue  # not a name any key can spell
                    try:
                        is_dir = entry.is_dir()  # follows links, as LocalStore does
                    except OSError:
                        continue
                    if is_dir:
                        children.append((name + "/", True))
                    elif not _STAGING.fullmatch(name):
                        children.append((name, False))
        except (NotADirectoryError, FileNotFoundError, PermissionError):
            return None
        children.sort()
        listing = _Dir([k for k, _ in children], [d for _, d in children], stamp)
        if len(children) >= _CACHE_FROM:
            self._keep(path, listing)
        return listing

    def _keep(self, path: str, listing: _Dir) -> None:
        with self._lock:
            old = self._cache.pop(path, None)
            if old is not None:
                self._cached_names -= len(old.keys)
            if len(listing.keys) > _CACHE_NAMES:
                return
            self._cache[path] = listing
            self._cached_names += len(listing.keys)
            while self._cached_names > _CACHE_NAMES:
                _, dropped = self._cache.popitem(last=False)
                self._cached_names -= len(dropped.keys)


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
