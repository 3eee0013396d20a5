"""``chunkd config show``: every key with its value and origin, secrets masked; and the
S3 front on the embedded default from the environment alone."""

from __future__ import annotations

import json
import subprocess
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest

from chunkd.gateway.cli import main
from chunkd.gateway.config.schema import SECTIONS
from chunkd.testing import free_port
from tests.conftest import BIN, Daemon

FRONT = {
    "CHUNKD_S3_FRONT_LISTEN": "127.0.0.1:8471",
    "CHUNKD_S3_FRONT_ACCESS_KEY_ID": "walkthrough",
    "CHUNKD_S3_FRONT_SECRET_ACCESS_KEY": "walkthrough-secret-4f2a9c",
}


pytestmark = pytest.mark.usefixtures("clean_cwd")


def show(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    status = main(["config", "show", *args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.timeout(20)
def test_the_embedded_default_with_overrides_shows_every_key_and_its_origin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for var, value in FRONT.items():
        monkeypatch.setenv(var, value)
    status, out, _ = show(capsys, "--json")
    assert status == 0
    document = json.loads(out)
    assert document["source"] == "embedded default"
    rows = {(r["section"], r["backend"], r["key"]): r for r in document["keys"]}
    # Every key of every section, the one backend's too, defaults included.
    wanted = {
        (s.name, "local" if s.name == "backends" else None, key) for s in SECTIONS for key in s.keys
    }
    assert set(rows) == wanted
    assert len(document["keys"]) == len(wanted)
    listen = rows[("s3_front", None, "listen")]
    assert (listen["value"], listen["origin"], listen["where"]) == (
        "127.0.0.1:8471",
        "env",
        "CHUNKD_S3_FRONT_LISTEN",
    )
    secret = rows[("s3_front", None, "secret_access_key")]
    assert (secret["value"], secret["origin"]) == ("***", "env")
    assert FRONT["CHUNKD_S3_FRONT_SECRET_ACCESS_KEY"] not in out
    # The front's key id is masked as a backend's is: its last four characters.
    key_id = rows[("s3_front", None, "access_key_id")]
    assert (key_id["value"], key_id["origin"]) == ("****************ough", "env")
    assert FRONT["CHUNKD_S3_FRONT_ACCESS_KEY_ID"] not in out
    status, text, _ = show(capsys)
    assert status == 0
    assert FRONT["CHUNKD_S3_FRONT_ACCESS_KEY_ID"] not in text
    assert 'access_key_id = "****************ough"' in text
    # The embedded default's own values, and the declared defaults, are "default".
    url = rows[("backends", "local", "url")]
    assert (url["value"], url["origin"], url["where"]) == (
        f"file://{tmp_path}/chunkd-data",
        "default",
        None,
    )
    assert rows[("backends", "local", "revalidate")]["value"] == 1.0
    assert rows[("cache", None, "ram_bytes")]["value"] == 1 << 30
    assert rows[("server", None, "socket")]["value"] == str(tmp_path / "chunkd.sock")
    assert rows[("peers", None, "self")]["value"] is None
    # It only looks: not even the embedded default's data directory is made.
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(20)
def test_a_file_and_an_override_each_show_where_they_came_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "node.toml"
    config.write_text(
        '[cache]\nram_bytes = "2GiB"\ndisk_bytes = "20GiB"\n\n'
        '[[backends]]\nname = "data"\nurl = "s3://bucket/prefix"\n'
        'access_key_id = "AKIAEXAMPLEKEY1234"\nsecret_access_key = "very-secret-value"\n'
    )
    monkeypatch.setenv("CHUNKD_CACHE_DISK_BYTES", "30GiB")
    status, out, _ = show(capsys, "--config", str(config))
    assert status == 0
    assert out.startswith(f"# chunkd's effective configuration: the file {config}\n")
    assert "very-secret-value" not in out
    assert "AKIAEXAMPLEKEY1234" not in out
    lines = {line.split(" = ")[0]: line for line in out.splitlines() if " = " in line}
    assert lines["ram_bytes"].endswith(f"# file {config}")
    assert lines["ram_bytes"].startswith('ram_bytes = "2GiB"')
    assert lines["disk_bytes"].startswith('disk_bytes = "30GiB"')
    assert lines["disk_bytes"].endswith("# env CHUNKD_CACHE_DISK_BYTES")
    assert lines["chunk_bytes"].endswith("# default")
    assert lines["secret_access_key"].startswith('secret_access_key = "***"')
    assert "# socket_group unset" in out
    # The text is TOML: read back, it gives the same values (sizes and durations as
    # one writes them), secrets masked.
    parsed = tomllib.loads(out)
    assert parsed["cache"]["ram_bytes"] == "2GiB"
    assert parsed["cache"]["dir"] == "/var/cache/chunkd"
    assert parsed["server"]["socket_mode"] == "0660"
    assert parsed["server"]["shutdown_timeout"] == "10s"
    (backend,) = parsed["backends"]
    assert backend["url"] == "s3://bucket/prefix"
    assert backend["revalidate"] == "immutable"
    assert backend["access_key_id"] == "****************1234"
    assert backend["secret_access_key"] == "***"


@pytest.mark.timeout(20)
def test_a_wrong_config_exits_1_saying_where(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "front.toml"
    config.write_text('[s3_front]\nlisten = "127.0.0.1:8471"\n')
    status, out, err = show(capsys, "--config", str(config))
    assert (status, out) == (1, "")
    assert err.startswith(f"chunkd config show: bad configuration: {config}: has no [[backends]]")
    assert f'url = "file://{tmp_path}/chunkd-data"' in err
    status, _, _ = show(capsys, "--config", str(tmp_path / "missing.toml"))
    assert status == 1


@pytest.mark.timeout(60)
def test_the_s3_front_starts_on_the_embedded_default_from_the_environment(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """The walkthrough's step: in a fresh directory, no config file, the front from
    three variables; the default backend ``local`` stays and is served as a bucket."""
    import boto3

    port = free_port()
    env = {**FRONT, "CHUNKD_S3_FRONT_LISTEN": f"127.0.0.1:{port}"}
    run = tmp_path / "fresh"
    daemon = start_daemon(None, env=env, cwd=run)
    (run / "chunkd-data" / "hello.txt").write_bytes(b"hello through the front\n")
    client = boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{port}",
        aws_access_key_id=FRONT["CHUNKD_S3_FRONT_ACCESS_KEY_ID"],
        aws_secret_access_key=FRONT["CHUNKD_S3_FRONT_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    )
    assert [b["Name"] for b in client.list_buckets()["Buckets"]] == ["local"]
    body = client.get_object(Bucket="local", Key="hello.txt")["Body"].read()
    assert body == b"hello through the front\n"
    # chunkd config show in the same place, with the same variables, says so.
    shown = subprocess.run(
        [str(BIN / "chunkd"), "config", "show", "--json"],
        capture_output=True,
        text=True,
        env=daemon.env,
        cwd=run,
        timeout=30,
        check=True,
    )
    rows = {(r["section"], r["key"]): r for r in json.loads(shown.stdout)["keys"]}
    assert rows[("s3_front", "listen")]["where"] == "CHUNKD_S3_FRONT_LISTEN"
    assert rows[("backends", "name")]["value"] == "local"
