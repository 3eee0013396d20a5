"""Sample ids: ``"KEY#INDEX"``, a member's key and a sample's index in it.

An id is stable whatever the seed, epoch, ranks or workers: it names where the sample
is stored, not where it falls in an order (:meth:`Dataset.sample_id
<chunkd.client.datasets.Dataset.sample_id>` makes them).
"""

from __future__ import annotations

__all__ = ["SampleId", "split_sample_id"]

#: a sample's stable id: ``"KEY#INDEX"``, its member's key and its index in the member
SampleId = str


def split_sample_id(sample_id: SampleId) -> tuple[str, int]:
    """``"KEY#INDEX"`` as ``(key, index in the member)``."""
    name, _, index = sample_id.rpartition("#")
    if not name or not index.isdigit():
        raise ValueError(f"{sample_id!r} is not a sample id (KEY#INDEX)")
    return name, int(index)
