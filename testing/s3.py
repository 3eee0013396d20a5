"""A real S3-protocol server (moto's server mode) and the backend tables that use it."""

from __future__ import annotations

import json
import os
from typing import Any

from chunkd.gateway.config import BackendConfig
from chunkd.testing.ports import BIN, free_port
from chunkd.testing.process import ServerProcess

__all__ = ["S3Server", "refused_backend", "s3_backend"]


class S3Server(ServerProcess):
    """A real S3-protocol server (moto's server mode) in a subprocess."""

    @classmethod
    def start(
        cls,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        checks_credentials_after: int | None = None,
        netns: str | None = None,
    ) -> S3Server:
        """Start moto_server and wait until it listens.

        Args:
            host: the address it listens on.
            port: its port (a free one on loopback by default).
            checks_credentials_after: refuse wrong credentials once this many
                requests have gone by unchecked (moto lets the first ones through).
            netns: run it in this network namespace (``ip netns exec``).
        """
        port = port or free_port()
        env = dict(os.environ)
        if checks_credentials_after is not None:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(checks_credentials_after)
        prefix = ["ip", "netns", "exec", netns] if netns else []
        return cls.launch(
            [*prefix, str(BIN / "moto_server"), "-H", host, "-p", str(port)],
            port=port,
            host=host,
            env=env,
        )

    def backend_config(self, name: str, url: str, **keys: Any) -> BackendConfig:
        """A writable backend over ``url`` on this server, with its test credentials;
        ``keys`` add fields or override these."""
        fields: dict[str, Any] = {
            "name": name,
            "url": url,
            "endpoint": self.endpoint,
            "region": "us-east-1",
            "access_key_id": "testing",
            "secret_access_key": "testing-secret",
            "allow_http": True,
            "writable": True,
            **keys,
        }
        return BackendConfig(**fields)

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing-secret",
            region_name="us-east-1",
        )


def s3_backend(name: str, url: str, endpoint: str, **keys: str | int | bool) -> str:
    """A ``[[backends]]`` table for an S3-protocol server of the tests (moto, over
    http), with its test credentials; ``keys`` add keys or override these (a str is
    written as a TOML string, a bool as true/false)."""
    table: dict[str, str | int | bool] = {
        "name": name,
        "url": url,
        "endpoint": endpoint,
        "region": "us-east-1",
        "access_key_id": "testing",
        "secret_access_key": "testing-secret",
        "allow_http": True,
        **keys,
    }
    lines = (f"{key} = {_toml_value(value)}\n" for key, value in table.items())
    return "[[backends]]\n" + "".join(lines)


def refused_backend(endpoint: str, **keys: str | int | bool) -> str:
    """A backend table ``vault`` over bucket ``locked`` with credentials a server that
    checks them refuses (``S3Server.start(checks_credentials_after=...)``), no retries."""
    wrong: dict[str, str | int | bool] = {
        "access_key_id": "not-a-key",
        "secret_access_key": "not-a-secret",
        "retries": 0,
    }
    return s3_backend("vault", "s3://locked/pre", endpoint, **{**wrong, **keys})


def _toml_value(value: str | int | bool) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return json.dumps(value)  # a TOML basic string
