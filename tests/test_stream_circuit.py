"""A missing bucket is the backend's answer, not a failure, on the streaming path too.

docs/s3.md: a backend whose bucket was deleted "does not open the backend's circuit".
Reads that stream (``stream_range``, ``open_first``: the read path's spans and first
reads) and whole GETs count their errors one way (``StoreBackend._settle``); here
against moto, with the bucket deleted behind the backend, more times than the circuit
takes to open were these failures. (A started body cannot carry S3's NoSuchBucket, so
this holds with or without the shared count; it guards the docs' promise on every path
a streamed read takes.)
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from chunkd.errors import BucketNotFoundError
from chunkd.gateway.backends import Backends
from chunkd.gateway.backends.base import Backend
from chunkd.gateway.metrics import Metrics
from chunkd.ranges import ByteRange
from chunkd.testing import S3Server

BODY = bytes(range(256)) * 1024


@pytest.fixture
async def doomed(s3_server: S3Server) -> AsyncIterator[tuple[Backend, Metrics, str]]:
    """An S3 backend over a bucket of its own holding ``k`` (the test deletes it)."""
    name = f"chunkd-stream-{uuid.uuid4().hex[:8]}"
    client = s3_server.client()
    client.create_bucket(Bucket=name)
    client.put_object(Bucket=name, Key="k", Body=BODY)
    metrics = Metrics()
    backends = Backends.from_config(
        [s3_server.backend_config("doomed", f"s3://{name}", retries=1)], metrics
    )
    try:
        yield backends.get("doomed"), metrics, name
    finally:
        await backends.close()
        for item in client.list_objects_v2(Bucket=name).get("Contents", []):
            client.delete_object(Bucket=name, Key=item["Key"])
        client.delete_bucket(Bucket=name)


def errors(metrics: Metrics, kind: str) -> float:
    labels = {"backend": "doomed", "kind": kind}
    return metrics.registry.get_sample_value("chunkd_backend_errors_total", labels) or 0


@pytest.mark.timeout(30)
async def test_a_deleted_bucket_never_opens_the_circuit_of_streamed_reads(
    s3_server: S3Server, doomed: tuple[Backend, Metrics, str]
) -> None:
    backend, metrics, bucket = doomed
    meta = await backend.head("k")
    assert meta is not None
    direct = s3_server.client()
    direct.delete_object(Bucket=bucket, Key="k")
    direct.delete_bucket(Bucket=bucket)
    for _ in range(8):  # more than the 5 failures in a row that open the circuit
        with pytest.raises(BucketNotFoundError, match="its bucket does not exist"):
            async for _piece in backend.stream_range(meta, ByteRange(0, 4096), piece_bytes=1024):
                pass
        with pytest.raises(BucketNotFoundError):
            await backend.open_first("k", 0, 4096, piece_bytes=1024)
        with pytest.raises(BucketNotFoundError):
            await backend.get("k")
        assert not backend.circuit_open
    assert errors(metrics, "BucketNotFoundError") == 24
    assert errors(metrics, "BackendUnavailableError") == 0
    assert metrics.registry.get_sample_value(
        "chunkd_backend_circuit_open", {"backend": "doomed"}
    ) in (None, 0)
    # The bucket made again: the next streamed read gets its bytes, at once.
    direct.create_bucket(Bucket=bucket)
    direct.put_object(Bucket=bucket, Key="k", Body=BODY)
    first = await backend.open_first("k", 0, len(BODY), piece_bytes=64 << 10)
    assert first is not None
    assert first.pieces is not None
    got = b"".join([bytes(p) async for p in first.pieces])
    assert got == BODY
