"""The one rule for writes where a client picks the key: chunkd's own prefixes are refused.

chunkd keeps a layout of its own in a backend, and trusts what it finds there:

``chunks/<id>``
    content-addressed chunks of checkpoints and frozen snapshots; a save or a freeze
    that finds one there sends nothing for it
``checkpoints/``
    checkpoints' parts and manifests (a manifest is the commit; the highest step is a
    trainer's "latest")
``intents/``
    the chunk ids of saves and freezes in flight, which a collection must keep
``gc/``
    the barriers of running collections, which every save and freeze waits out
the dataset registry's prefix (``[datasets] registry``, on its backend only)
    manifests, version and tag pointers, frozen records: what a snapshot id and a
    dataset name mean

A door that writes a key a client chose (``ds_migrate``'s destination, the S3 front,
any later one) asks :meth:`ReservedPrefixes.check` about every **final** key, after
its prefix and the member's own relative key are joined: a member ``x/chunks/<id>``
migrated to a backend's root lands on ``chunks/<id>``, so checking the destination
prefix alone is not enough. chunkd's own writers (saves, commits, freezes, the
registry, the collector) build their keys themselves and do not go through it.
"""

from __future__ import annotations

from typing import Final

from chunkd.errors import ReservedKeyError
from chunkd.gateway.checkpoints.model import CHECKPOINTS, CHUNKS, GC_BARRIERS, INTENTS

__all__ = ["EVERY_BACKEND", "ReservedPrefixes"]

#: the prefixes reserved at the root of every backend
EVERY_BACKEND: Final = (CHUNKS, CHECKPOINTS, INTENTS, GC_BARRIERS)


class ReservedPrefixes:
    """The prefixes of each backend that no client-chosen write may touch.

    Args:
        registry: ``[datasets] registry``, ``BACKEND/PREFIX`` (or ``BACKEND``: the
            registry at its backend's root).
    """

    def __init__(self, registry: str) -> None:
        # Here, not at the top: the datasets package imports this module (migrate).
        from chunkd.gateway.datasets.layout import FROZEN, MANIFESTS, NAMES

        self.registry_backend, _, prefix = registry.partition("/")
        prefix = prefix.strip("/")
        # A registry at its backend's root keeps its own three folders there.
        self._registry = (f"{prefix}/",) if prefix else (MANIFESTS, NAMES, FROZEN)

    def of(self, backend: str) -> tuple[str, ...]:
        """The reserved prefixes of ``backend`` (every one ends in ``/``)."""
        if backend == self.registry_backend:
            return EVERY_BACKEND + self._registry
        return EVERY_BACKEND

    def under(self, backend: str, key: str) -> str | None:
        """The reserved prefix ``key`` of ``backend`` lies under (or names), or None."""
        return next(
            (p for p in self.of(backend) if key.startswith(p) or key == p.rstrip("/")), None
        )

    def check(self, backend: str, key: str, *, door: str) -> str:
        """``key``, if ``door`` (``"migrate"``, ``"the S3 front"``) may write it.

        Raises:
            ReservedKeyError: ``key`` is under one of :meth:`of`; the message names the
                key, the prefix and the door, and nothing is written.
        """
        prefix = self.under(backend, key)
        if prefix is not None:
            raise ReservedKeyError(
                f"{door} would write {backend}/{key}, under {prefix!r}, a prefix chunkd keeps "
                "for its own layout (chunks/, checkpoints/, intents/, gc/ and the dataset "
                "registry are written by chunkd alone); choose a destination whose keys "
                "stay outside them"
            )
        return key
