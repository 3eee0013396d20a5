"""The old name of the tier conformance suite: :mod:`chunkd.testing.tiers` holds it now.

``from chunkd.cache.testing import TierTests`` keeps working: the name is looked up
when first used (PEP 562), by module name, so importing :mod:`chunkd.cache` never
imports ``chunkd.testing`` (the cache imports nothing above it; this module is the
one place that names it, and only by a string resolved on first use). New code
imports ``chunkd.testing.tiers``.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["TierTests"]  # noqa: F822 (resolved on first use, by __getattr__ below)


def __getattr__(name: str) -> Any:
    if name != "TierTests":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = importlib.import_module("chunkd.testing.tiers").TierTests
    globals()[name] = value
    return value
