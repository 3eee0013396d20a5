"""The daemon's dataset registry: named, versioned snapshots, frozen and migrated.

The rooms, each one job:

* :mod:`.layout`: the registry's keys in its backend, and the commit, tag and freeze
  protocols, written down;
* :mod:`.registry`: commits of versions, tags, resolving a reference, listings;
* :mod:`.manifests`: the manifests by id, checked in turns, kept parsed;
* :mod:`.documents`: the registry's small documents, read within a bound;
* :mod:`.pinned`: a member read through the read path at its recorded version only;
* :mod:`.freeze`: members' bytes into the registry's chunk store, and the chunks a
  garbage collection must keep;
* :mod:`.records`: a frozen record as read (its bound, its check, its chunk ids);
* :mod:`.migrate`: a snapshot copied to another backend, verified, registered again;
* :mod:`.store`: :class:`Datasets`, the facade the local socket's ``ds_*`` ops use.

The snapshot format itself is :mod:`chunkd.snapshot`; ``docs/datasets.md`` the prose.
"""

from __future__ import annotations

from chunkd.gateway.datasets.registry import Registry, Resolved
from chunkd.gateway.datasets.store import Datasets

__all__ = ["Datasets", "Registry", "Resolved"]
