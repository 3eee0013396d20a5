"""Credentials in /v1/stats: the access key id masked as the AWS CLI shows it, secrets hidden."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chunkd.gateway.config import load_config
from chunkd.testing import S3Server, s3_backend
from tests.conftest import Daemon

KEY_ID = "AKIAIOSFODNN7EXAMPLE"
SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
TOKEN = "FwoGZXIvYXdzEXAMPLESESSIONTOKEN"


def backend_table(name: str, **keys: str) -> str:
    lines = "".join(f'{key} = "{value}"\n' for key, value in keys.items())
    return (
        f'[[backends]]\nname = "{name}"\nurl = "s3://bucket/{name}"\nregion = "us-east-1"\n{lines}'
    )


@pytest.mark.parametrize(
    ("key_id", "shown"),
    [
        (KEY_ID, "****************MPLE"),  # as `aws configure list` shows it
        ("AKIA" + "Z" * 124, "****************ZZZZ"),  # the length is not shown either
        ("ASIAWXYZ1", "****************XYZ1"),
        ("shortkey", "****************"),  # too short to show any of it
        ("abc", "****************"),
    ],
)
def test_the_access_key_id_shows_only_its_last_four_characters(
    tmp_path: Path, key_id: str, shown: str
) -> None:
    toml = tmp_path / "chunkd.toml"
    toml.write_text(
        backend_table(
            "data",
            access_key_id=key_id,
            secret_access_key=SECRET,
            session_token=TOKEN,
        )
        + backend_table("machine")  # the machine's own credentials: nothing to show
    )
    view = load_config(toml, environ={}, cwd=tmp_path).redacted()
    data, machine = view["backends"]
    assert data["access_key_id"] == shown
    assert data["secret_access_key"] == data["session_token"] == "***"
    assert machine["access_key_id"] is None
    assert machine["secret_access_key"] is None
    text = json.dumps(view)
    for clear in (key_id, SECRET, TOKEN):
        assert clear not in text


def test_stats_never_show_an_access_key_id_in_clear(
    start_daemon, tmp_path: Path, s3_server: S3Server, bucket: str
) -> None:
    table = s3_backend(
        "data",
        f"s3://{bucket}/pre",
        s3_server.endpoint,
        access_key_id=KEY_ID,
        secret_access_key=SECRET,
    )
    daemon: Daemon = start_daemon(
        f'[server]\nlog_format = "json"\n\n[cache]\ndir = "{tmp_path / "cache"}"\n'
        f'ram_bytes = "64MiB"\ndisk_bytes = "128MiB"\ndisk_min_free_bytes = 0\n\n{table}'
    )
    s3_server.client().put_object(Bucket=bucket, Key="pre/x.bin", Body=b"through the cache")
    assert daemon.get("/v1/objects/data/x.bin")[2] == b"through the cache"
    status, _, body = daemon.get("/v1/stats")
    assert status == 200
    backend = json.loads(body)["config"]["backends"][0]
    assert backend["access_key_id"] == "****************MPLE"
    assert backend["secret_access_key"] == "***"
    assert KEY_ID.encode() not in body
    assert SECRET.encode() not in body
    assert daemon.stop() == 0
    log = daemon.log.read_text()
    assert KEY_ID not in log
    assert SECRET not in log
