"""The ops of the local socket that carry no data: ``hello`` and ``prefetch``.

``hello`` opens every connection: the server answers nothing else before it (a rule
of the connection, kept by :mod:`.server`), and this handler refuses a client of
another protocol version. ``prefetch`` hands names and ranges to the
:class:`~chunkd.gateway.prefetch.Prefetcher`, bounded per user of the node (the
caller's uid, the kernel's word), not per connection.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import chunkd
from chunkd.client.protocol import VERSION
from chunkd.errors import ProtocolVersionError
from chunkd.gateway.costs.attribution import ATTRIBUTION
from chunkd.gateway.localsock.family import Family, Parts
from chunkd.gateway.names import split_name

if TYPE_CHECKING:
    from chunkd.gateway.localsock.answer import Answer
    from chunkd.gateway.prefetch import Wanted

__all__ = ["FAMILY"]

#: the handlers of this module's ops
FAMILY: Final = Family("prefetch")


@FAMILY.op("hello")
async def _hello(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    version = args["version"]
    if version != VERSION:
        raise ProtocolVersionError(
            f"this chunkd daemon (chunkd {chunkd.__version__}) speaks local protocol "
            f"version {VERSION}; the client speaks {version!r}; install the same "
            "chunkd version for the trainers and the daemon"
        )
    if parts.jobs is not None and args["train_job"] is not None:
        who = ATTRIBUTION.get()  # the server set it from this hello's train_job
        parts.jobs.label(who.job, who.uid)  # a hello is enough to start its job
    return {
        "ok": True,
        "version": VERSION,
        "chunk_bytes": parts.read_path.chunk_bytes,
        "daemon": f"chunkd {chunkd.__version__}",
    }


@FAMILY.op("prefetch")
async def _prefetch(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    wanted: list[Wanted] = [*args["names"], *args["ranges"]]
    for name in wanted:
        split_name(name if isinstance(name, str) else name[0])
    # Bounded per user of the node, not per connection (see Prefetcher); a request of
    # the daemon's own (no caller) counts as its user's.
    uid = answer.caller.uid if answer.caller is not None else os.getuid()
    return {"ok": True, "started": parts.prefetcher.submit(("uid", uid), wanted)}
