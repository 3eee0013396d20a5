"""Sample ids: ``"BACKEND/KEY#INDEX"``, a shard and a sample's index in it.

An id is stable whatever the seed, epoch, ranks or workers: it names where the sample
is stored, not where it falls in an order.
"""

from __future__ import annotations

__all__ = ["SampleId", "sample_id", "split_sample_id"]

#: a sample's stable id: ``"BACKEND/KEY#INDEX"``, the shard and the sample's index in it
SampleId = str


def sample_id(name: str, index: int) -> SampleId:
    """The id of sample ``index`` of shard ``name``."""
    return f"{name}#{index}"


def split_sample_id(sample_id: SampleId) -> tuple[str, int]:
    """``"BACKEND/KEY#INDEX"`` as ``(shard name, index in the shard)``."""
    name, _, index = sample_id.rpartition("#")
    if not name or not index.isdigit():
        raise ValueError(f"{sample_id!r} is not a sample id (BACKEND/KEY#INDEX)")
    return name, int(index)
