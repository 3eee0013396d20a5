"""Placement: which members to ask for a key, and in which order.

Rendezvous (HRW) hashing: a key's owners are the healthy members (this node
included) ordered by ``blake3(member || 0x00 || key)``, highest first. Each key has
one owner; when a member comes or goes, only the keys it owned move. The key is a
chunk's id when it is known (checkpoints, dataset pages) and an object chunk's
locator otherwise (:mod:`chunkd.gateway.readpath`).

:func:`sources` turns that order into the list a reader asks, which is where any
other kind of source for a key would be added: the client asks whatever it is given,
in order, and knows nothing of how the list was made.
"""

from __future__ import annotations

from typing import NamedTuple

import blake3

__all__ = ["Source", "rank_owners", "sources"]


def rank_owners(members: list[str], key: bytes) -> list[str]:
    """``members`` in rendezvous order for ``key``: the first is its owner."""
    return sorted(
        members, key=lambda m: blake3.blake3(m.encode() + b"\0" + key).digest(), reverse=True
    )


class Source(NamedTuple):
    """A member to ask for a key, and how."""

    address: str
    #: Ask for what it holds only (``held=1``): this node owns the key and rejoined
    #: the cluster lately, so the member ranked next after it may have it.
    handoff: bool


def sources(owners: list[str], me: str, *, handing_off: bool) -> list[Source]:
    """Whom this node (``me``) asks for a key whose owners are ``owners`` (in
    rendezvous order), in order: the owners ranked before it; then, when
    ``handing_off`` (it rejoined the cluster lately), the one ranked next after it,
    as a handoff. An empty list: this node owns the key and reads the backend.
    """
    asked: list[Source] = []
    for rank, owner in enumerate(owners):
        if owner == me:
            if handing_off and rank + 1 < len(owners):
                asked.append(Source(owners[rank + 1], handoff=True))
            break
        asked.append(Source(owner, handoff=False))
    return asked
