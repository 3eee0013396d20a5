"""The S3 front in tests and benchmarks: its test keys, its ``[s3_front]`` table, and
S3 clients pointed at it (boto3 with its current default config, as users run it).
"""

from __future__ import annotations

import os
from typing import Any, Final

__all__ = [
    "FRONT_KEY",
    "FRONT_SECRET",
    "front_client",
    "front_env",
    "front_section",
]

#: the front's test access key and its secret
FRONT_KEY: Final = "chunkd-test"
FRONT_SECRET: Final = "front-secret-for-tests"


def front_section(port: int, **keys: str | bool) -> str:
    """An ``[s3_front]`` table on ``127.0.0.1:port`` with the test key; ``keys`` add to
    it or override it (a str is written as a TOML string, a bool as true/false)."""
    table: dict[str, str | bool] = {
        "listen": f"127.0.0.1:{port}",
        "access_key_id": FRONT_KEY,
        "secret_access_key": FRONT_SECRET,
        **keys,
    }
    lines = "".join(
        f"{k} = {str(v).lower() if isinstance(v, bool) else repr(v)}\n" for k, v in table.items()
    )
    return "[s3_front]\n" + lines.replace("'", '"')


def front_env(endpoint: str) -> dict[str, str]:
    """The environment a user sets for an unchanged S3 client to read through the
    front (boto3, the AWS CLI, s3fs, pyarrow, polars, obstore all read these)."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": FRONT_KEY,
        "AWS_SECRET_ACCESS_KEY": FRONT_SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def front_client(endpoint: str, **config: Any) -> Any:
    """A boto3 S3 client of the front, with boto3's default config (checksums
    ``when_supported``, standard retries) unless ``config`` says otherwise."""
    import boto3
    from botocore.config import Config  # type: ignore[import-untyped]

    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=FRONT_KEY,
        aws_secret_access_key=FRONT_SECRET,
        region_name="us-east-1",
        config=Config(**config) if config else None,
    )
