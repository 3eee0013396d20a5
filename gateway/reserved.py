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

Backends may share one store: ``raw = s3://b`` and ``ckpt = s3://b/team`` (or
``file:///srv`` and ``file:///srv/team``) are two names for overlapping keys, and
``raw/team/chunks/<id>`` is ``ckpt/chunks/<id>``. So the rule knows where each backend
lies (its URL: the scheme, the bucket or the file system, the prefix or directory) and,
for each backend A:

* every backend B whose place lies inside A's (or is A's) adds B's reserved prefixes
  to A's, under B's path relative to A (``team/chunks/`` for ``raw`` above);
* if A's place lies inside one of B's reserved prefixes (``ckpt2 = s3://b/team/chunks``),
  all of A is reserved.

Two backends share a store when their schemes and buckets (containers) are the same,
whatever their endpoints or accounts (two names of one server cannot be told apart, so
the rule errs on the side of refusing); every ``file://`` backend is in the one file
system (directories compared after symbolic links are resolved); each ``memory://``
backend is a store of its own.

A door that writes a key a client chose (``ds_migrate``'s destination, the S3 front,
any later one) asks :meth:`ReservedPrefixes.check` about every **final** key, after
its prefix and the member's own relative key are joined: a member ``x/chunks/<id>``
migrated to a backend's root lands on ``chunks/<id>``, so checking the destination
prefix alone is not enough. chunkd's own writers (saves, commits, freezes, the
registry, the collector) build their keys themselves and do not go through it.
"""

from __future__ import annotations

import os.path
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from chunkd.errors import ReservedKeyError
from chunkd.gateway.checkpoints.model import CHECKPOINTS, CHUNKS, GC_BARRIERS, INTENTS

if TYPE_CHECKING:
    from chunkd.gateway.config import BackendConfig

__all__ = ["EVERY_BACKEND", "ReservedPrefixes"]

#: the prefixes reserved at the root of every backend
EVERY_BACKEND: Final = (CHUNKS, CHECKPOINTS, INTENTS, GC_BARRIERS)


@dataclass(frozen=True)
class _Place:
    """Where a backend's keys lie: a store, and the path of its root in that store
    (``""``, or ending in ``/``)."""

    store: tuple[str, ...]
    root: str

    @classmethod
    def of(cls, config: BackendConfig) -> _Place:
        if config.scheme == "file":
            path = os.path.realpath(config.prefix).strip("/")
            return cls(("file",), f"{path}/" if path else "")
        if config.scheme == "memory":
            return cls(("memory", config.name), "")  # each one its own store
        prefix = config.prefix
        return cls((config.scheme, config.bucket or ""), f"{prefix}/" if prefix else "")


class ReservedPrefixes:
    """The prefixes of each backend that no client-chosen write may touch.

    Args:
        registry: ``[datasets] registry``, ``BACKEND/PREFIX`` (or ``BACKEND``: the
            registry at its backend's root).
        backends: the configured backends (their ``[[backends]]`` entries): where each
            lies, so that a backend whose keys overlap another's keeps the other's
            prefixes too. Without them each backend is taken as a store of its own.
    """

    def __init__(self, registry: str, backends: Iterable[BackendConfig] = ()) -> None:
        # Here, not at the top: the datasets package imports this module (migrate).
        from chunkd.gateway.datasets.layout import FROZEN, MANIFESTS, NAMES, PAGES

        self.registry_backend, _, prefix = registry.partition("/")
        prefix = prefix.strip("/")
        # A registry at its backend's root keeps its own folders there.
        self._registry = (f"{prefix}/",) if prefix else (MANIFESTS, NAMES, FROZEN, PAGES)
        # backend -> [(prefix, whose)]: whose is None for the backend's own prefixes,
        # else the backend (and its prefix) the key would land in.
        self._overlaps: dict[str, list[tuple[str, str]]] = {}
        places = {config.name: _Place.of(config) for config in backends}
        for name, place in places.items():
            found: list[tuple[str, str]] = []
            for other, there in places.items():
                if other == name or there.store != place.store:
                    continue
                for own in self._own(other):
                    absolute = there.root + own
                    if absolute.startswith(place.root):
                        found.append((absolute[len(place.root) :], f"{other}/{own}"))
                    elif place.root.startswith(absolute):
                        found.append(("", f"{other}/{own}"))  # all of this backend
            self._overlaps[name] = found

    def _own(self, backend: str) -> tuple[str, ...]:
        if backend == self.registry_backend:
            return EVERY_BACKEND + self._registry
        return EVERY_BACKEND

    def of(self, backend: str) -> tuple[str, ...]:
        """The reserved prefixes of ``backend`` (every one ends in ``/``, but ``""``:
        all of it lies inside another backend's reserved prefix)."""
        own = self._own(backend)
        more = tuple(p for p, _ in self._overlaps.get(backend, ()) if p not in own)
        return own + tuple(dict.fromkeys(more))

    def under(self, backend: str, key: str) -> str | None:
        """The reserved prefix ``key`` of ``backend`` lies under (or names), or None."""
        return next(
            (p for p in self.of(backend) if key.startswith(p) or key == p.rstrip("/")), None
        )

    def check(self, backend: str, key: str, *, door: str) -> str:
        """``key``, if ``door`` (``"migrate"``, ``"the S3 front"``) may write it.

        Raises:
            ReservedKeyError: ``key`` is under one of :meth:`of`; the message names the
                key, the prefix (and the backend it belongs to, when it is another's
                that shares the store) and the door, and nothing is written.
        """
        prefix = self.under(backend, key)
        if prefix is None:
            return key
        whose = next((w for p, w in self._overlaps.get(backend, ()) if p == prefix), None)
        if prefix in self._own(backend) or whose is None:
            where = f"under {prefix!r}, a prefix chunkd keeps for its own layout"
        elif prefix:
            where = (
                f"under {prefix!r}, which is {whose} (backend {whose.partition('/')[0]!r} "
                "lies there in the same store), a prefix chunkd keeps for its own layout"
            )
        else:
            where = (
                f"and all of backend {backend!r} lies inside {whose} (another backend's, "
                "in the same store), a prefix chunkd keeps for its own layout"
            )
        raise ReservedKeyError(
            f"{door} would write {backend}/{key}, {where} (chunks/, checkpoints/, intents/, "
            "gc/ and the dataset registry are written by chunkd alone); choose a "
            "destination whose keys stay outside them"
        )
