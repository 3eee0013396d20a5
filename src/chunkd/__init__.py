"""chunkd: a per-node storage gateway for GPU training clusters.

The distribution installs three subpackages: :mod:`chunkd.cache` (the
content-addressed tiered store, a pure library), :mod:`chunkd.gateway` (the
daemon) and :mod:`chunkd.client` (what trainers import).
"""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("chunkd")
except metadata.PackageNotFoundError:  # running from a tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
