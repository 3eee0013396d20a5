"""A schema-2 snapshot's member pages through the node's daemon.

* :class:`DaemonPages` is the :class:`~chunkd.snapshot.PageSource` of a resolved
  snapshot: each page it is asked for is one ``ds_page`` request, answered from the
  daemon's tiers (a node fetches a page once for all its readers, peers share it). It
  checks nothing itself: the snapshot checks every page it loads against its id and
  its root's entry (:func:`chunkd.snapshot.parse_page`).
* :func:`commit_snapshot` registers a built snapshot: each of its pages with
  ``ds_page_put`` (put if absent), then its root with ``ds_commit``, the commit. A
  registration cut short leaves pages no root names, which are harmless: the name
  still resolves to its previous version, and registering again puts only the pages
  that are missing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import blake3

from chunkd import memfd
from chunkd.errors import ManifestError
from chunkd.snapshot import PageSource, Snapshot, check_dataset_name, page_bytes

if TYPE_CHECKING:
    from chunkd.client.core import Client

__all__ = ["DaemonPages", "commit_snapshot", "put_page"]


class DaemonPages:
    """Pages by ``ds_page`` from the daemon of ``client``.

    Args:
        client: a connection to the node's daemon.
        registry: the registry the snapshot was resolved in (``ds_resolve``'s
            ``registry``); None: the daemon's own.
    """

    def __init__(self, client: Client, registry: str | None = None) -> None:
        self.client = client
        self.registry = registry

    def page(self, page_id: str) -> bytes:
        # docstring inherited
        fields: dict[str, Any] = {"page": page_id, "registry": self.registry}
        with self.client.request("ds_page", fields, timeout=None) as reply:
            fds = list(reply.fds)
            reply.fds.clear()
        try:
            if len(fds) != 1:
                raise ManifestError(f"the daemon answered page {page_id} with {len(fds)} fds")
            size = os.fstat(fds[0]).st_size
            return os.pread(fds[0], size, 0) if size else b""
        finally:
            memfd.close_all(fds)


def put_page(client: Client, data: bytes) -> dict[str, Any]:
    """Store one page with ``ds_page_put``: ``{"ok", "page", "created"}``.

    Raises:
        ManifestError: the daemon refused the bytes (not a page, or a ``content`` claim).
        InvalidRequestError: larger than :data:`~chunkd.snapshot.PAGE_MAX_BYTES`.
    """
    fd = memfd.sealed(data, "chunkd-page")
    try:
        with client.request("ds_page_put", {}, fds=[fd], timeout=None) as reply:
            return dict(reply.header)
    finally:
        memfd.close_all([fd])


def _pages_of(snapshot: Snapshot, pages: PageSource | None) -> Iterator[tuple[str, bytes]]:
    """Each distinct page of ``snapshot`` with its bytes, one at a time: from ``pages``
    (a built snapshot's :class:`~chunkd.snapshot.MemoryPages`), else written again from
    its members, and checked against its id either way."""
    seen: set[str] = set()
    for index, ref in enumerate(snapshot.pages):
        if ref.id in seen:
            continue
        seen.add(ref.id)
        data = pages.page(ref.id) if pages is not None else page_bytes(snapshot.page_members(index))
        if blake3.blake3(data).hexdigest() != ref.id:
            raise ManifestError(
                f"page {ref.id} of snapshot {snapshot.id} is not the bytes its root names; "
                "nothing was registered"
            )
        yield ref.id, data


def commit_snapshot(
    client: Client, name: str, snapshot: Snapshot, pages: PageSource | None = None
) -> dict[str, Any]:
    """Register ``snapshot`` as the next version of ``name``: its pages first (each put
    if absent), then its root, the commit (a schema-1 snapshot: its manifest alone).

    ``pages``: where the pages' bytes are (the :class:`~chunkd.snapshot.MemoryPages` that
    :meth:`Snapshot.build` wrote them into); None: written again from its members.

    Returns the ``ds_commit`` answer, with ``"pages"`` (how many were put) and
    ``"pages_created"`` (how many the registry did not hold yet).

    Raises:
        ManifestError: the daemon refused a page or the root.
        DatasetNotFoundError: a page went missing between its put and the commit.
        AccessDeniedError, ReadOnlyBackendError, DatasetError, BackendUnavailableError
    """
    check_dataset_name(name)
    put = created = 0
    if snapshot.schema >= 2:
        for page_id, data in _pages_of(snapshot, pages):
            answer = put_page(client, data)
            if answer.get("page") != page_id:
                raise ManifestError(
                    f"the daemon stored page {page_id} as {answer.get('page')}; nothing was "
                    "registered"
                )
            put += 1
            created += bool(answer.get("created"))
    fd = memfd.sealed(snapshot.data, "chunkd-manifest")
    try:
        with client.request("ds_commit", {"name": name}, fds=[fd], timeout=None) as reply:
            committed = dict(reply.header)
    finally:
        memfd.close_all([fd])
    return committed | {"pages": put, "pages_created": created}
