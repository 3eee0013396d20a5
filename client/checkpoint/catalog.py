"""The catalog: committed manifests, listing, retention and garbage collection, deleting.

The module's function :func:`list` shadows the builtin here, so the builtin is
``builtins.list``.
"""

from __future__ import annotations

import builtins
import json
import os
from collections.abc import Iterator
from typing import Any, Final

from chunkd import memfd
from chunkd.client.checkpoint.process import client_or_default
from chunkd.client.core import Client
from chunkd.errors import CheckpointError

#: a collection over a large backend lists and deletes for a long time
_GC_TIMEOUT: Final = 6 * 3600.0
#: checkpoints asked for in one listing page
_LIST_PAGE: Final = 1000


def manifest(name: str, *, client: Client | None = None) -> dict[str, Any]:
    """The committed manifest of ``name`` with its parts (see ``docs/checkpoints.md``).

    Raises:
        CheckpointNotFoundError: there is no such checkpoint (or its manifest is torn).
    """
    answer = client_or_default(client).request(
        "ckpt_manifest", {"name": name}, what=f"loading {name}"
    )
    return _json_fd(answer.fds, f"the manifest of {name}")


def _json_fd(fds: builtins.list[int], what: str) -> dict[str, Any]:
    """The JSON object in the one sealed memfd of an answer (``fds`` are closed)."""
    try:
        if len(fds) != 1:
            raise CheckpointError(f"the daemon answered {what} without its fd")
        size = os.fstat(fds[0]).st_size
        doc = json.loads(os.pread(fds[0], size, 0))
    finally:
        memfd.close_all(fds)
    if not isinstance(doc, dict):
        raise CheckpointError(f"{what} is not a JSON object")
    return doc


def list(prefix: str, *, client: Client | None = None) -> builtins.list[dict[str, Any]]:
    """Checkpoints under ``BACKEND[/PREFIX]``: name, step, sizes, dedup ratio, durability.

    Every one of them, read from the daemon page by page (see :func:`pages`).
    """
    return [entry for page in pages(prefix, client=client) for entry in page]


def pages(
    prefix: str, *, limit: int = _LIST_PAGE, client: Client | None = None
) -> Iterator[builtins.list[dict[str, Any]]]:
    """The checkpoints under ``BACKEND[/PREFIX]``, one page (at most ``limit``) at a time,
    in the order of their manifest keys; a page may be empty before the last one."""
    chunkd = client_or_default(client)
    token: str | None = None
    while True:
        with chunkd.request(
            "ckpt_list",
            {"prefix": prefix, "start_after": token, "limit": limit},
            what=f"listing {prefix}",
        ) as answer:
            entries: builtins.list[dict[str, Any]] = json.loads(answer.payload)
        yield entries
        token = answer.header.get("next")
        if token is None:
            return


def gc(
    target: str,
    *,
    keep_last: int | None = None,
    grace: float = 3600.0,
    dry_run: bool = False,
    timeout: float = _GC_TIMEOUT,
    client: Client | None = None,
) -> dict[str, Any]:
    """Retention, then mark and sweep, in the daemon: what ``chunkd gc`` runs.

    Returns the report: ``retired`` (every checkpoint name retired, however many),
    ``chunks``, ``referenced``, ``kept_young``, ``swept``, ``freed_bytes``,
    ``stale_parts``. Saves may run meanwhile (docs/checkpoints.md, garbage collection).
    """
    fields = {"target": target, "keep_last": keep_last, "grace": grace, "dry_run": dry_run}
    answer = client_or_default(client).request(
        "ckpt_gc", fields, timeout=timeout, what=f"collecting garbage in {target}"
    )
    return _json_fd(answer.fds, f"the garbage collection report of {target}")


def delete(name: str, *, client: Client | None = None) -> int:
    """Delete checkpoint ``name`` (its chunks go at the next ``chunkd gc``)."""
    with client_or_default(client).request(
        "ckpt_delete", {"name": name}, what=f"deleting {name}"
    ) as answer:
        return int(answer.header.get("removed", 0))


def scrub(
    backend: str,
    *,
    remove: bool = False,
    start_after: str | None = None,
    limit: int | None = None,
    client: Client | None = None,
) -> Iterator[dict[str, Any]]:
    """Check every chunk of ``backend``'s chunk store against its name, in the daemon,
    page by page (``chunkd gc BACKEND --scrub``); yields each page's answer:
    ``checked``, ``bytes``, ``damaged`` (``[{"key", "problem"}]``), ``removed``,
    ``next``. With ``remove`` the damaged chunks are deleted (an admin's request:
    docs/security.md); the next save or freeze holding their bytes sends them again.
    """
    connection = client_or_default(client)
    fields: dict[str, Any] = {"backend": backend, "remove": remove}
    if limit is not None:
        fields["limit"] = limit
    after = start_after
    while True:
        with connection.request(
            "ckpt_scrub",
            fields | {"start_after": after},
            timeout=_GC_TIMEOUT,
            what=f"scrubbing the chunks of {backend}",
        ) as answer:
            page = dict(answer.header)
        page.pop("ok", None)
        page.pop("id", None)
        yield page
        after = page.get("next")
        if after is None:
            return
