"""The daemon's configuration: the TOML file, the embedded default, env overrides."""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import textwrap
import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chunkd.cache import CacheConfig, FsyncPolicy, WritePolicy
from chunkd.errors import ConfigError
from chunkd.gateway import config as config_module
from chunkd.gateway.config import (
    BackendConfig,
    Config,
    DatasetsConfig,
    PeersConfig,
    Secret,
    ServerConfig,
    embedded_default,
    format_size,
    load_config,
    parse_duration,
    parse_size,
)
from chunkd.gateway.config import doc as config_doc
from chunkd.gateway.config.schema import (
    BACKENDS,
    CACHE,
    NOT_CACHE_KEYS,
    PEERS,
    SECTIONS,
    SERVER,
)
from chunkd.gateway.config.values import Origin

GiB = 1 << 30
MiB = 1 << 20

FULL = """
[server]
listen = "0.0.0.0:9000"
socket = "/run/chunkd/test.sock"
socket_mode = "0640"
socket_group = "train"
shutdown_timeout = "30s"
log_format = "text"
log_level = "debug"

[cache]
dir = "/nvme/chunkd"
ram_bytes = "16GiB"
disk_bytes = "1.5TiB"
disk_min_free_bytes = "10 GB"
chunk_bytes = "8MiB"
fsync = "never"
compress = false
verify_reads = false
write_policy = "write-behind"
eviction = "lru"

[[backends]]
name = "data"
url = "s3://datasets/imagenet/train/"
endpoint = "http://127.0.0.1:9000"
region = "us-east-1"
access_key_id = "AKIDEXAMPLE"
secret_access_key = "wJalrXUtnFEMI-very-secret"
session_token = "session-token-also-secret"
allow_http = true
revalidate = "5m"
timeout = "2.5s"
retries = 5

[[backends]]
name = "ckpt-store"
url = "gs://checkpoints"
writable = true

[[backends]]
name = "blobs_01"
url = "az://container/some/prefix"

[[backends]]
name = "scratch"
url = "file:///mnt/scratch/"
revalidate = "immutable"

[[backends]]
name = "mem"
url = "memory://"
"""

SECRETS = ("wJalrXUtnFEMI-very-secret", "session-token-also-secret")


def write(tmp_path: Path, text: str, name: str = "chunkd.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def minimal(extra: str = "", backend: str = "") -> str:
    """A config with one file backend, plus ``extra`` sections and ``backend`` keys."""
    return f'{extra}\n[[backends]]\nname = "data"\nurl = "file:///srv/data"\n{backend}\n'


def load_error(tmp_path: Path, text: str, environ: dict[str, str] | None = None) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ=environ or {}, cwd=tmp_path)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    return message


# -- a whole config ---------------------------------------------------------------


def test_a_full_example_parses(tmp_path: Path) -> None:
    path = write(tmp_path, FULL)
    config = load_config(path, environ={}, cwd=tmp_path)
    assert config.source == str(path)
    assert config.server == ServerConfig(
        listen="0.0.0.0:9000",
        socket=Path("/run/chunkd/test.sock"),
        socket_mode=0o640,
        socket_group="train",
        shutdown_timeout=30.0,
        log_format="text",
        log_level="debug",
    )
    assert (config.server.host, config.server.port) == ("0.0.0.0", 9000)
    assert config.cache == CacheConfig(
        dir=Path("/nvme/chunkd"),
        ram_bytes=16 * GiB,
        disk_bytes=3 * (1 << 39),
        disk_min_free_bytes=10 * 10**9,
        chunk_bytes=8 * MiB,
        fsync=FsyncPolicy.NEVER,
        compress=False,
        verify_reads=False,
        write_policy=WritePolicy.BEHIND,
        eviction="lru",
    )
    assert isinstance(config.cache.fsync, FsyncPolicy)
    assert isinstance(config.cache.write_policy, WritePolicy)
    assert [b.name for b in config.backends] == ["data", "ckpt-store", "blobs_01", "scratch", "mem"]

    data = config.backend("data")
    assert data == BackendConfig(
        name="data",
        url="s3://datasets/imagenet/train/",
        endpoint="http://127.0.0.1:9000",
        region="us-east-1",
        access_key_id="AKIDEXAMPLE",
        secret_access_key=Secret(SECRETS[0]),
        session_token=Secret(SECRETS[1]),
        allow_http=True,
        writable=False,
        revalidate=300.0,
        timeout=2.5,
        retries=5,
    )
    assert data.secret_access_key is not None
    assert data.secret_access_key.reveal() == SECRETS[0]
    assert (data.scheme, data.bucket, data.prefix) == ("s3", "datasets", "imagenet/train")
    assert not data.immutable

    ckpt = config.backend("ckpt-store")
    assert ckpt is not None
    assert (ckpt.scheme, ckpt.bucket, ckpt.prefix, ckpt.writable) == ("gs", "checkpoints", "", True)
    assert ckpt.immutable  # the default
    assert ckpt.timeout == 30.0
    assert ckpt.retries == 3
    blobs = config.backend("blobs_01")
    assert blobs is not None
    assert (blobs.scheme, blobs.bucket, blobs.prefix) == ("az", "container", "some/prefix")
    scratch = config.backend("scratch")
    assert scratch is not None
    assert (scratch.scheme, scratch.bucket, scratch.prefix) == ("file", None, "/mnt/scratch")
    assert scratch.revalidate is None
    mem = config.backend("mem")
    assert mem is not None
    assert (mem.scheme, mem.bucket, mem.prefix) == ("memory", None, "")
    assert config.backend("nope") is None


def test_left_out_sections_and_keys_take_the_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, minimal()), environ={}, cwd=tmp_path)
    assert config.server == ServerConfig()
    assert config.server.socket == Path("/run/chunkd/chunkd.sock")
    assert config.server.socket_mode == 0o660
    assert config.cache == CacheConfig(dir=Path("/var/cache/chunkd"))
    (backend,) = config.backends
    assert backend == BackendConfig(name="data", url="file:///srv/data")
    assert backend.prefix == "/srv/data"
    assert (backend.writable, backend.allow_http, backend.revalidate) == (False, False, None)


def test_the_reference_in_the_module_docstring_is_a_config_of_the_defaults(
    tmp_path: Path,
) -> None:
    doc = config_module.__doc__
    assert doc is not None
    block = doc.split("a key left out takes the default)::\n", 1)[1].split("\nRelative paths")[0]
    reference = textwrap.dedent(block)
    config = load_config(write(tmp_path, reference), environ={}, cwd=tmp_path)
    assert config.server == ServerConfig()
    assert config.cache == CacheConfig(dir=Path("/var/cache/chunkd"))
    assert config.backends == (BackendConfig(name="data", url="s3://bucket/prefix"),)
    # Every key is listed, the optional ones commented out.
    uncommented = tomllib.loads(
        "\n".join(
            line.replace("# ", "", 1) if line.lstrip().startswith("# ") and "=" in line else line
            for line in reference.splitlines()
        )
    )
    assert config.peers == PeersConfig()
    assert set(uncommented["peers"]) == {
        "self" if f.name == "address" else f.name for f in dataclasses.fields(PeersConfig)
    }
    assert set(uncommented["server"]) == {f.name for f in dataclasses.fields(ServerConfig)}
    assert set(uncommented["backends"][0]) == {f.name for f in dataclasses.fields(BackendConfig)}
    assert set(uncommented["cache"]) == {
        "dir",
        "ram_bytes",
        "disk_bytes",
        "disk_min_free_bytes",
        "chunk_bytes",
        "fsync",
        "compress",
        "verify_reads",
        "write_policy",
        "eviction",
        "disk_workers",
        "index_flush_interval",
        "disk_retry_after",
    }
    # Every field of the cache library's CacheConfig is a key, but the one kept out.
    assert set(uncommented["cache"]) == {f.name for f in dataclasses.fields(CacheConfig)} - {
        "reconcile"
    }
    assert set(uncommented) == {
        "server",
        "cache",
        "backends",
        "peers",
        "datasets",
        "s3_front",
        "jobs",
        "cost",
    }
    assert config.datasets == DatasetsConfig()
    for name in ("CHUNKD_SERVER_<KEY>", "CHUNKD_CACHE_<KEY>", "CHUNKD_BACKENDS_<NAME>_<KEY>"):
        assert name in doc


def test_relative_paths_start_from_the_working_directory(tmp_path: Path) -> None:
    text = minimal('[server]\nsocket = "run/c.sock"\n[cache]\ndir = "cache"\n')
    config = load_config(write(tmp_path, text), environ={}, cwd=tmp_path)
    assert config.server.socket == tmp_path / "run" / "c.sock"
    assert config.cache.dir == tmp_path / "cache"


# -- the embedded default ------------------------------------------------------------


def test_embedded_default_runs_without_a_file(tmp_path: Path) -> None:
    assert not (tmp_path / "chunkd-data").exists()
    config = embedded_default(tmp_path)
    assert (tmp_path / "chunkd-data").is_dir()  # created for the newcomer
    assert config.source == "embedded default"
    assert config.server.listen == "127.0.0.1:8470"
    assert config.server.socket == tmp_path / "chunkd.sock"
    assert config.cache.dir == tmp_path / "chunkd-cache"
    assert (config.cache.ram_bytes, config.cache.disk_bytes) == (1 * GiB, 10 * GiB)
    assert config.cache.disk_min_free_bytes == 1 * GiB
    assert config.cache.chunk_bytes == CacheConfig().chunk_bytes
    (local,) = config.backends
    assert local.name == "local"
    assert local.url == f"file://{tmp_path}/chunkd-data"
    assert local.prefix == str(tmp_path / "chunkd-data")
    assert local.writable
    # Idempotent, and what load_config gives without a path.
    assert embedded_default(tmp_path) == config
    assert load_config(None, environ={}, cwd=tmp_path) == config
    assert embedded_default(tmp_path / "elsewhere" / "..") == config


def test_embedded_default_takes_overrides(tmp_path: Path) -> None:
    environ = {
        "CHUNKD_SERVER_LISTEN": "127.0.0.1:0",
        "CHUNKD_CACHE_RAM_BYTES": "64MiB",
        "CHUNKD_BACKENDS_LOCAL_REVALIDATE": "immutable",
    }
    config = load_config(environ=environ, cwd=tmp_path)
    assert config.server.port == 0
    assert config.cache.ram_bytes == 64 * MiB
    assert config.backends[0].revalidate is None
    assert (tmp_path / "chunkd-data").is_dir()


def test_embedded_default_reports_a_data_directory_it_cannot_create(tmp_path: Path) -> None:
    (tmp_path / "chunkd-data").write_text("a file in the way")
    with pytest.raises(ConfigError, match=r"embedded default: cannot create the data directory"):
        embedded_default(tmp_path)


# -- environment overrides -------------------------------------------------------------


def test_each_kind_of_override_applies(tmp_path: Path) -> None:
    path = write(tmp_path, FULL)
    environ = {
        "CHUNKD_SERVER_LISTEN": "[::1]:8471",
        "CHUNKD_SERVER_SOCKET_MODE": "0600",
        "CHUNKD_CACHE_RAM_BYTES": "32GiB",
        "CHUNKD_CACHE_COMPRESS": "yes",
        "CHUNKD_CACHE_FSYNC": "always",
        "CHUNKD_BACKENDS_DATA_ENDPOINT": "https://s3.internal:443",
        "CHUNKD_BACKENDS_DATA_SECRET_ACCESS_KEY": "from-the-environment",
        "CHUNKD_BACKENDS_DATA_RETRIES": "0",
        "CHUNKD_BACKENDS_CKPT_STORE_WRITABLE": "false",  # '-' written as '_'
        "CHUNKD_BACKENDS_CKPT_STORE_TIMEOUT": "1m",
        "CHUNKD_BACKENDS_BLOBS_01_URL": "az://other",
        # Not config: read by the client, or by nobody. Left alone.
        "CHUNKD_SOCKET": "/tmp/elsewhere.sock",
        "CHUNKD_CONFIG": "whatever",
        "CHUNKD_SERVER": "no underscore after the section",
        "PATH": os.environ.get("PATH", ""),
    }
    config = load_config(path, environ=environ, cwd=tmp_path)
    assert (config.server.host, config.server.port) == ("::1", 8471)
    assert config.server.socket_mode == 0o600
    assert config.server.log_level == "debug"  # untouched
    assert config.cache.ram_bytes == 32 * GiB
    assert config.cache.compress is True
    assert config.cache.fsync is FsyncPolicy.ALWAYS
    data = config.backend("data")
    assert data is not None
    assert data.endpoint == "https://s3.internal:443"
    assert data.secret_access_key == Secret("from-the-environment")
    assert data.retries == 0
    assert data.region == "us-east-1"  # untouched
    ckpt = config.backend("ckpt-store")
    assert ckpt is not None
    assert (ckpt.writable, ckpt.timeout) == (False, 60.0)
    blobs = config.backend("blobs_01")
    assert blobs is not None
    assert (blobs.bucket, blobs.prefix) == ("other", "")


def test_os_environ_is_the_default_source_of_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHUNKD_CACHE_DISK_BYTES", "3GiB")
    config = load_config(write(tmp_path, minimal()), cwd=tmp_path)
    assert config.cache.disk_bytes == 3 * GiB


def test_kubernetes_service_variables_are_not_overrides(tmp_path: Path) -> None:
    # What a pod gets for Services named chunkd-server and chunkd-backends in its
    # namespace: no key of chunkd's, and no reason for the daemon not to start.
    environ = {
        "CHUNKD_SERVER_SERVICE_HOST": "10.0.0.7",
        "CHUNKD_SERVER_SERVICE_PORT": "8470",
        "CHUNKD_SERVER_SERVICE_PORT_HTTP": "8470",
        "CHUNKD_SERVER_PORT": "tcp://10.0.0.7:8470",
        "CHUNKD_SERVER_PORT_8470_TCP": "tcp://10.0.0.7:8470",
        "CHUNKD_SERVER_PORT_8470_TCP_PROTO": "tcp",
        "CHUNKD_SERVER_PORT_8470_TCP_PORT": "8470",
        "CHUNKD_SERVER_PORT_8470_TCP_ADDR": "10.0.0.7",
        "CHUNKD_BACKENDS_SERVICE_HOST": "10.0.0.8",
        "CHUNKD_BACKENDS_PORT_443_TCP": "tcp://10.0.0.8:443",
    }
    config = load_config(write(tmp_path, FULL), environ=environ, cwd=tmp_path)
    assert config.server.listen == load_config(write(tmp_path, FULL), cwd=tmp_path).server.listen
    # A misspelled key is still refused: only the shapes Kubernetes writes are passed over.
    for typo in ("CHUNKD_SERVER_SERVICE", "CHUNKD_SERVER_PORTS", "CHUNKD_SERVER_PORT_X_TCP"):
        with pytest.raises(ConfigError, match=f"environment {typo}: \\[server\\] has no key"):
            load_config(write(tmp_path, FULL), environ={typo: "1"}, cwd=tmp_path)


def test_an_empty_override_unsets_an_optional_key(tmp_path: Path) -> None:
    path = write(tmp_path, FULL)
    environ = {
        "CHUNKD_SERVER_SOCKET_GROUP": "",
        "CHUNKD_BACKENDS_DATA_ENDPOINT": "",
        "CHUNKD_BACKENDS_DATA_REGION": "",
        "CHUNKD_BACKENDS_DATA_REVALIDATE": "",
    }
    config = load_config(path, environ=environ, cwd=tmp_path)
    assert config.server.socket_group is None
    data = config.backend("data")
    assert data is not None
    assert (data.endpoint, data.region, data.revalidate) == (None, None, None)


@pytest.mark.parametrize(
    ("var", "value", "expected"),
    [
        ("CHUNKD_CACHE_RAM_BYTES", "x", "environment CHUNKD_CACHE_RAM_BYTES = 'x' is not a size"),
        ("CHUNKD_CACHE_CHUNK_BYTES", "", "environment CHUNKD_CACHE_CHUNK_BYTES = '' is not a size"),
        ("CHUNKD_CACHE_VERIFY_READS", "maybe", "CHUNKD_CACHE_VERIFY_READS = 'maybe' is not true"),
        ("CHUNKD_SERVER_LISTEN", "8470", "CHUNKD_SERVER_LISTEN = '8470' has no port"),
        ("CHUNKD_SERVER_SHUTDOWN_TIMEOUT", "soon", "CHUNKD_SERVER_SHUTDOWN_TIMEOUT = 'soon'"),
        ("CHUNKD_BACKENDS_DATA_RETRIES", "-1", "CHUNKD_BACKENDS_DATA_RETRIES = '-1'"),
        ("CHUNKD_BACKENDS_DATA_TIMEOUT", "0s", "CHUNKD_BACKENDS_DATA_TIMEOUT = '0s' is not more"),
        ("CHUNKD_BACKENDS_DATA_URL", "ftp://x", "CHUNKD_BACKENDS_DATA_URL = 'ftp://x' has scheme"),
    ],
)
def test_a_bad_override_names_the_variable(
    tmp_path: Path, var: str, value: str, expected: str
) -> None:
    message = load_error(tmp_path, minimal(), {var: value})
    assert expected in message


@pytest.mark.parametrize(
    ("var", "expected"),
    [
        ("CHUNKD_CACHE_RAM", "environment CHUNKD_CACHE_RAM: [cache] has no key 'ram'"),
        ("CHUNKD_SERVER_LISTNE", "has no key 'listne'; did you mean 'listen'?"),
        ("CHUNKD_SERVER_", "environment CHUNKD_SERVER_: [server] has no key ''"),
        ("CHUNKD_BACKENDS_DATA_ENDPONT", "backend 'data' has no key 'endpont'; did you mean"),
        ("CHUNKD_BACKENDS_OTHER_ENDPOINT", "CHUNKD_BACKENDS_OTHER_ENDPOINT names no configured"),
        ("CHUNKD_BACKENDS_DATA", "CHUNKD_BACKENDS_DATA names no configured backend"),
        ("CHUNKD_BACKENDS_DATA_NAME", "a backend cannot be renamed from the environment"),
    ],
)
def test_an_unknown_override_names_the_variable(tmp_path: Path, var: str, expected: str) -> None:
    message = load_error(tmp_path, minimal(), {var: "secret-looking-value"})
    assert expected in message
    assert "secret-looking-value" not in message  # it may be a mistyped credential


def test_an_override_cannot_add_a_backend_to_the_embedded_default(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="CHUNKD_BACKENDS_DATA_URL names no configured backend"):
        load_config(environ={"CHUNKD_BACKENDS_DATA_URL": "memory://"}, cwd=tmp_path)


def test_backend_names_that_differ_only_in_dash_and_underscore_are_ambiguous(
    tmp_path: Path,
) -> None:
    text = minimal(backend='[[backends]]\nname = "a-b"\nurl = "memory://"\n')
    text += '[[backends]]\nname = "a_b"\nurl = "memory://"\n'
    assert len(load_config(write(tmp_path, text), environ={}, cwd=tmp_path).backends) == 3
    message = load_error(tmp_path, text, {"CHUNKD_BACKENDS_A_B_WRITABLE": "true"})
    assert "could mean backend 'a-b' or 'a_b'" in message


def test_a_backend_whose_name_extends_another_gets_its_own_overrides(tmp_path: Path) -> None:
    text = minimal(backend='[[backends]]\nname = "data_raw"\nurl = "memory://"\n')
    environ = {"CHUNKD_BACKENDS_DATA_RAW_WRITABLE": "1", "CHUNKD_BACKENDS_DATA_RETRIES": "7"}
    config = load_config(write(tmp_path, text), environ=environ, cwd=tmp_path)
    raw, data = config.backend("data_raw"), config.backend("data")
    assert raw is not None
    assert data is not None
    assert (raw.writable, raw.retries, data.writable, data.retries) == (True, 3, False, 7)


# -- errors in the file ------------------------------------------------------------------


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=rf"{missing}: cannot read the config file"):
        load_config(missing, environ={})
    with pytest.raises(ConfigError, match=rf"{tmp_path}: cannot read the config file"):
        load_config(tmp_path, environ={})


def test_an_unreadable_file_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, minimal())
    path.chmod(0)
    try:
        if os.access(path, os.R_OK):
            pytest.skip("running as root: a mode-0 file is still readable")
        with pytest.raises(ConfigError, match=rf"{path}: cannot read the config file"):
            load_config(path, environ={})
    finally:
        path.chmod(0o644)


def test_invalid_toml_names_the_file_and_the_line(tmp_path: Path) -> None:
    text = '[server]\nlisten = "127.0.0.1:8470"\nlog_level = info\n'
    message = load_error(tmp_path, text)
    assert message.startswith(f"{tmp_path / 'chunkd.toml'}: not valid TOML at line 3")


def test_a_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "chunkd.toml"
    path.write_bytes(b'[server]\nlog_level = "\xff"\n')
    with pytest.raises(ConfigError, match=rf"{path}: is not UTF-8"):
        load_config(path, environ={})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (minimal("[peer]\nx = 1\n"), "unknown section [peer]"),
        (minimal("[backend]\nname = 'x'\n"), "unknown section [backend]; did you mean 'backends'?"),
        (minimal("[server.tls]\ncert = 'x'\n"), "[server] has no key 'tls'"),
        (
            'listen = "0.0.0.0:1"\n' + minimal(),
            "'listen' outside any section; it belongs under [se",
        ),
        ('url = "memory://"\n' + minimal(), "'url' outside any section; it belongs under [[back"),
        (minimal("[server]\nlisen = '0.0.0.0:1'\n"), "[server] has no key 'lisen'; did you mean"),
        (minimal("[cache]\nram = '1GiB'\n"), "[cache] has no key 'ram'"),
        (minimal("[cache]\nreconcile = false\n"), "[cache] has no key 'reconcile'"),
        (minimal(backend="writeable = true"), "[[backends]] 'data' has no key 'writeable'"),
        (minimal(backend="secret_key = 'hunter2'"), "'data' has no key 'secret_key'"),
        ("server = 3\n" + minimal(), "server is not a table; write it as a [server] section"),
        ("[backends]\nname = 'x'\nurl = 'memory://'\n", "write [[backends]] (two brackets)"),
        ("backends = ['x']\n", "backends is not an array of tables"),
        ("[server]\n", "has no [[backends]]"),
        (minimal(backend="[[backends]]\nurl = 'memory://'"), "[[backends]] #2 has no name"),
        ("[[backends]]\nname = 'data'\n", "[[backends]] 'data' has no url"),
        (
            minimal(backend="[[backends]]\nname = 'data'\nurl = 'memory://'"),
            "[[backends]] #2 name = 'data' is taken by [[backends]] #1",
        ),
    ],
)
def test_structure_errors_name_the_file(tmp_path: Path, text: str, expected: str) -> None:
    message = load_error(tmp_path, text)
    assert message.startswith(f"{tmp_path / 'chunkd.toml'}: ")
    assert expected in message
    assert "hunter2" not in message


@pytest.mark.parametrize(
    ("section", "line", "expected"),
    [
        ("cache", "ram_bytes = true", "[cache] ram_bytes = true is not a size"),
        (
            "cache",
            "ram_bytes = 'eight'",
            "[cache] ram_bytes = 'eight' is not a size; write it like",
        ),
        ("cache", "ram_bytes = -1", "[cache] ram_bytes = -1 is negative"),
        ("cache", "disk_bytes = 1.5", "[cache] disk_bytes = 1.5 is not a size"),
        (
            "cache",
            "chunk_bytes = '1000'",
            "[cache] chunk_bytes = '1000' is not a positive multiple",
        ),
        ("cache", "chunk_bytes = 0", "[cache] chunk_bytes = 0 is not a positive multiple"),
        (
            "cache",
            "chunk_bytes = '128MiB'",
            "[cache] chunk_bytes = '128MiB' is larger than 64MiB, the largest chunk",
        ),
        ("cache", "fsync = 'sometimes'", "[cache] fsync = 'sometimes' is not one of 'always'"),
        ("cache", "compress = 'yes'", "[cache] compress = 'yes' is not true or false"),
        ("cache", "write_policy = 'through'", "[cache] write_policy = 'through' is not one of"),
        ("cache", "eviction = 'fifo'", "[cache] eviction = 'fifo' is not one of 's3fifo', 'lru'"),
        ("cache", "dir = 3", "[cache] dir = 3 is not a string"),
        ("cache", "dir = ''", "[cache] dir is empty"),
        ("server", "listen = 8470", "[server] listen = 8470 is not a string"),
        ("server", "listen = '::1:8470'", "without brackets; write it like '[::1]:8470'"),
        ("server", "listen = '[::1]'", "[server] listen = '[::1]' is not [IPv6 address]:port"),
        ("server", "listen = 'localhost:http'", "has no port from 0 to 65535"),
        ("server", "socket_mode = 660", "[server] socket_mode = 660 is not a permission mode"),
        ("server", "socket_mode = '0999'", "[server] socket_mode = '0999' is not an octal"),
        ("server", "socket_mode = true", "[server] socket_mode = true is not a permission mode"),
        ("server", "shutdown_timeout = 'soon'", "[server] shutdown_timeout = 'soon' is not a dur"),
        ("server", "shutdown_timeout = -1", "shutdown_timeout = -1 is not a duration of 0"),
        ("server", "shutdown_timeout = inf", "shutdown_timeout = inf is not a duration of 0"),
        ("server", "log_format = 'xml'", "[server] log_format = 'xml' is not one of 'json', 'te"),
        ("server", "log_level = 'INFO'", "[server] log_level = 'INFO' is not one of 'debug'"),
        ("server", "socket_group = 0", "[server] socket_group = 0 is not a string"),
    ],
)
def test_a_wrong_server_or_cache_value_names_the_key_and_the_file(
    tmp_path: Path, section: str, line: str, expected: str
) -> None:
    message = load_error(tmp_path, minimal(f"[{section}]\n{line}\n"))
    assert message.startswith(f"{tmp_path / 'chunkd.toml'}: [{section}] ")
    assert expected in message


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("writable = 'yes'", "'data' writable = 'yes' is not true or false; write true or false"),
        ("allow_http = 1", "'data' allow_http = 1 is not true or false"),
        ("retries = '3'", "'data' retries = '3' is not a whole number"),
        ("retries = -1", "'data' retries = -1 is negative"),
        ("retries = true", "'data' retries = true is not a whole number"),
        ("timeout = 0", "'data' timeout = 0 is not more than 0 seconds"),
        ("timeout = 'a while'", "'data' timeout = 'a while' is not a duration"),
        ("revalidate = 'never'", "'data' revalidate = 'never' is neither 'immutable' nor a dur"),
        ("revalidate = false", "'data' revalidate = false is neither 'immutable' nor"),
        ("region = 1", "'data' region = 1 is not a string"),
    ],
)
def test_a_wrong_backend_value_names_the_key_and_the_file(
    tmp_path: Path, line: str, expected: str
) -> None:
    message = load_error(tmp_path, minimal(backend=line))
    assert message.startswith(f"{tmp_path / 'chunkd.toml'}: [[backends]] ")
    assert expected in message


@pytest.mark.parametrize(
    ("name", "url", "expected"),
    [
        ("Data", "memory://", "[[backends]] #1 name = 'Data' is not a backend name"),
        ("-x", "memory://", "name = '-x' is not a backend name"),
        ("a" * 64, "memory://", "is not a backend name"),
        ("a.b", "memory://", "name = 'a.b' is not a backend name"),
        ("x", "ftp://host/dir", "url = 'ftp://host/dir' has scheme 'ftp'"),
        ("x", "s3:/bucket", "url = 's3:/bucket' is not a URL"),
        ("x", "/srv/data", "url = '/srv/data' is not a URL"),
        ("x", "s3://", "url = 's3://' has no bucket"),
        ("x", "s3:///prefix", "has no bucket"),
        ("x", "s3://bucket?versioned=1", "has a query or fragment"),
        ("x", "gs://bucket/a/../b", "has '..' in its prefix"),
        ("x", "file://srv/data", "url = 'file://srv/data' is not an absolute file URL"),
        ("x", "file://./data", "is not an absolute file URL"),
        ("x", "file:///srv/../etc", "has '..' in its path"),
        ("x", "memory://bucket", "memory backends have none"),
    ],
)
def test_a_bad_backend_name_or_url_is_named(
    tmp_path: Path, name: str, url: str, expected: str
) -> None:
    message = load_error(tmp_path, f"[[backends]]\nname = {name!r}\nurl = {url!r}\n")
    assert message.startswith(f"{tmp_path / 'chunkd.toml'}: [[backends]] ")
    assert expected in message


def test_credentials_in_a_url_are_refused_without_being_shown(tmp_path: Path) -> None:
    text = "[[backends]]\nname = 'x'\nurl = 's3://AKID:hunter2@bucket/prefix'\n"
    message = load_error(tmp_path, text)
    assert "url = 's3://***@bucket/prefix' has credentials in it" in message
    assert "hunter2" not in message
    text = "[[backends]]\nname = 'x'\nurl = 's3://b'\nendpoint = 'https://u:hunter2@h'\n"
    message = load_error(tmp_path, text)
    assert "endpoint = 'https://***@h' has credentials in it" in message
    assert "hunter2" not in message


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ("access_key_id = 'AKID'", "'x' access_key_id is set but secret_access_key is not"),
        ("secret_access_key = 'hunter2'", "'x' secret_access_key is set but access_key_id is not"),
        ("session_token = 'hunter2'", "'x' session_token is set without access_key_id"),
        ("endpoint = 'http://minio:9000'", "is plain http, but allow_http is false"),
        ("endpoint = 'HTTP://minio:9000'", "is plain http, but allow_http is false"),
        ("endpoint = 'minio:9000'", "'x' endpoint = 'minio:9000' is not an http:// or https://"),
        ("secret_access_key = 123456", "'x' secret_access_key is not a string"),
        ("secret_access_key = ''", "'x' secret_access_key is empty"),
    ],
)
def test_backend_keys_that_do_not_go_together_are_named(
    tmp_path: Path, keys: str, expected: str
) -> None:
    message = load_error(tmp_path, f"[[backends]]\nname = 'x'\nurl = 's3://b'\n{keys}\n")
    assert message.startswith(f"{tmp_path / 'chunkd.toml'}: [[backends]] 'x' ")
    assert expected in message
    assert "hunter2" not in message
    assert "123456" not in message


def test_a_cross_key_error_names_the_variable_that_caused_it(tmp_path: Path) -> None:
    text = "[[backends]]\nname = 'x'\nurl = 's3://b'\n"
    message = load_error(tmp_path, text, {"CHUNKD_BACKENDS_X_ENDPOINT": "http://minio:9000"})
    assert message.startswith("environment CHUNKD_BACKENDS_X_ENDPOINT = 'http://minio:9000'")
    config = load_config(
        write(tmp_path, text),
        environ={
            "CHUNKD_BACKENDS_X_ENDPOINT": "http://m:9000",
            "CHUNKD_BACKENDS_X_ALLOW_HTTP": "1",
        },
        cwd=tmp_path,
    )
    assert config.backends[0].allow_http


def test_a_local_backend_ignores_cloud_keys(tmp_path: Path) -> None:
    text = minimal(backend="region = 'nowhere'\naccess_key_id = 'unused'")
    config = load_config(write(tmp_path, text), environ={}, cwd=tmp_path)
    assert config.backends[0].region == "nowhere"


# -- secrets ---------------------------------------------------------------------------------


def test_secrets_never_show_in_repr_str_or_the_redacted_view(tmp_path: Path) -> None:
    environ = {"CHUNKD_BACKENDS_MEM_ENDPOINT": "https://x"}  # unused, but a real override
    config = load_config(write(tmp_path, FULL), environ=environ, cwd=tmp_path)
    view = config.redacted()
    text = json.dumps(view)  # JSON-able as it is
    for shown in (repr(config), str(config), text, f"{config}", repr(config.backends)):
        for secret in SECRETS:
            assert secret not in shown
    assert "Secret('***')" in repr(config)
    data = view["backends"][0]
    assert data["secret_access_key"] == "***"
    assert data["session_token"] == "***"
    assert data["access_key_id"] == "****************MPLE"  # as the AWS CLI shows it
    assert view["backends"][1]["secret_access_key"] is None
    assert view["source"] == str(tmp_path / "chunkd.toml")
    assert view["server"]["socket_mode"] == "0640"
    assert view["server"]["socket"] == "/run/chunkd/test.sock"
    assert view["cache"]["fsync"] == "never"
    assert view["cache"]["ram_bytes"] == 16 * GiB
    assert data["revalidate"] == 300.0
    assert view["backends"][3]["revalidate"] == "immutable"
    assert json.loads(text) == view


def test_secret_hides_its_value_but_compares_by_it() -> None:
    secret = Secret("hunter2")
    assert secret.reveal() == "hunter2"
    for shown in (repr(secret), str(secret), f"{secret}", "%s %r" % (secret, secret)):  # noqa: UP031
        assert "hunter2" not in shown
    assert repr(secret) == str(secret) == "Secret('***')"
    assert secret == Secret("hunter2")
    assert secret != Secret("hunter3")
    assert secret != "hunter2"
    assert hash(secret) == hash(Secret("hunter2"))
    assert len({secret, Secret("hunter2"), Secret("x")}) == 2
    backend = BackendConfig(name="x", url="s3://b", access_key_id="a", secret_access_key=secret)
    assert hash(backend) == hash(dataclasses.replace(backend))


def test_an_override_secret_is_kept_secret(tmp_path: Path) -> None:
    text = "[[backends]]\nname = 'x'\nurl = 's3://b'\n"
    environ = {
        "CHUNKD_BACKENDS_X_ACCESS_KEY_ID": "AKID",
        "CHUNKD_BACKENDS_X_SECRET_ACCESS_KEY": "hunter2",
    }
    config = load_config(write(tmp_path, text), environ=environ, cwd=tmp_path)
    key = config.backends[0].secret_access_key
    assert isinstance(key, Secret)
    assert key.reveal() == "hunter2"
    assert "hunter2" not in repr(config) + json.dumps(config.redacted())


# -- single values ----------------------------------------------------------------------


def test_ipv6_and_other_listen_addresses() -> None:
    for listen, host, port in [
        ("[::1]:8470", "::1", 8470),
        ("[::]:80", "::", 80),
        ("[fe80::1%eth0]:1", "fe80::1%eth0", 1),
        ("0.0.0.0:8470", "0.0.0.0", 8470),
        ("localhost:65535", "localhost", 65535),
        ("node-17.cluster.local:8470", "node-17.cluster.local", 8470),
    ]:
        server = ServerConfig(listen=listen)
        assert (server.host, server.port) == (host, port)
    for bad in ["[::1]", "[::1]8470", "[nope]:1", "::1:8470", ":8470", "host:", "h:-1", "a b:1"]:
        with pytest.raises(ConfigError, match=r"ServerConfig: listen = "):
            ServerConfig(listen=bad)


def test_revalidate_is_immutable_or_a_duration(tmp_path: Path) -> None:
    for value, expected in [('"immutable"', None), ('"90s"', 90.0), ("0", 0.0), ('"1h"', 3600.0)]:
        path = write(tmp_path, minimal(backend=f"revalidate = {value}"))
        (backend,) = load_config(path, environ={}, cwd=tmp_path).backends
        assert backend.revalidate == expected
        assert backend.immutable is (expected is None)


def test_socket_mode_accepts_octal_text_and_numbers(tmp_path: Path) -> None:
    for value, expected in [
        ('"0660"', 0o660),
        ('"660"', 0o660),
        ('"0o600"', 0o600),
        ("0o640", 0o640),
    ]:
        path = write(tmp_path, minimal(f"[server]\nsocket_mode = {value}\n"))
        assert load_config(path, environ={}, cwd=tmp_path).server.socket_mode == expected


def test_chunk_bytes_is_a_multiple_of_the_page_size(tmp_path: Path) -> None:
    path = write(tmp_path, minimal(f"[cache]\nchunk_bytes = {3 * mmap.PAGESIZE}\n"))
    assert load_config(path, environ={}, cwd=tmp_path).cache.chunk_bytes == 3 * mmap.PAGESIZE


def test_configs_built_in_code_are_checked_too() -> None:
    with pytest.raises(ConfigError, match=r"BackendConfig 'Bad': name = 'Bad' is not a backend"):
        BackendConfig(name="Bad", url="memory://")
    with pytest.raises(ConfigError, match=r"url = 'nope' is not a URL"):
        BackendConfig(name="x", url="nope")
    with pytest.raises(ConfigError, match=r"BackendConfig 'x': timeout = -1 is not a duration"):
        BackendConfig(name="x", url="memory://", timeout=-1)
    with pytest.raises(ConfigError, match=r"writable = 'yes' is not true or false"):
        BackendConfig(name="x", url="memory://", writable="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"access_key_id is set but secret_access_key is not"):
        BackendConfig(name="x", url="s3://b", access_key_id="AKID")
    # An Azure account alone is whole: its key (or a SAS, a managed identity) comes
    # from the machine. Its key alone still is not.
    assert BackendConfig(name="x", url="az://c", access_key_id="acct").access_key_id == "acct"
    with pytest.raises(ConfigError, match=r"secret_access_key is set but access_key_id is not"):
        BackendConfig(name="x", url="az://c", secret_access_key="key")
    with pytest.raises(ConfigError, match=r"ServerConfig: log_format = 'xml'"):
        ServerConfig(log_format="xml")
    one = BackendConfig(name="x", url="memory://")
    with pytest.raises(ConfigError, match=r"backend name 'x' is used twice"):
        Config(ServerConfig(), CacheConfig(), (one, one), source="test")
    # Strings a caller may pass are converted, as from TOML.
    server = ServerConfig(socket_mode="0600", shutdown_timeout="1m")  # type: ignore[arg-type]
    assert (server.socket_mode, server.shutdown_timeout) == (0o600, 60.0)
    config = Config(ServerConfig(), CacheConfig(), [one], source="test")  # type: ignore[arg-type]
    assert config.backends == (one,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.source = "x"  # type: ignore[misc]


# -- sizes and durations ---------------------------------------------------------------

BINARY = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "PiB": 1 << 50}
DECIMAL = {"kB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15}
UNITS = {"": 1, "B": 1, **BINARY, **DECIMAL}


def size(value: str | int) -> int:
    return parse_size(value, key="[cache] ram_bytes", source="chunkd.toml")


def duration(value: str | float) -> float:
    return parse_duration(value, key="[server] shutdown_timeout", source="chunkd.toml")


def test_sizes_from_the_spec() -> None:
    assert size("8GiB") == 8 * GiB
    assert size("200 GiB") == 200 * GiB
    assert size("4MiB") == 4 * MiB
    assert size("512KiB") == 512 << 10
    assert size("1.5GiB") == 3 * GiB // 2
    assert size("10GB") == 10 * 10**9
    assert size("123") == 123
    assert size(0) == 0
    assert size(" 16 gib ") == 16 * GiB
    assert size("2Gi") == 2 * GiB


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, "ram_bytes = true is not a size; write it like '8GiB'"),
        (False, "is not a size"),
        (-5, "ram_bytes = -5 is negative"),
        ("-5GiB", "ram_bytes = '-5GiB' is negative"),
        ("eight", "chunkd.toml: [cache] ram_bytes = 'eight' is not a size; write it like '8GiB'"),
        ("", "is not a size"),
        ("8 GiB 2", "is not a size"),
        ("8G", "'8G' is ambiguous; write 8GiB for binary units (1024) or 8GB for decimal"),
        ("1.5", "is not a whole number of bytes"),
        ("1e9", "is not a size"),
        ("0x10", "is not a size"),
        ("٣GiB", "is not a size"),  # a non-ASCII digit
        (2.0, "ram_bytes = 2.0 is not a size"),
        (None, "ram_bytes = None is not a size"),
    ],
)
def test_bad_sizes_name_the_key_and_the_source(value: object, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        size(value)  # type: ignore[arg-type]
    assert expected in str(info.value)
    assert str(info.value).startswith("chunkd.toml: [cache] ram_bytes = ")


def test_a_size_from_the_environment_names_the_variable() -> None:
    with pytest.raises(
        ConfigError, match=r"^environment CHUNKD_CACHE_RAM_BYTES = 'x' is not a size"
    ):
        parse_size("x", key="CHUNKD_CACHE_RAM_BYTES", source="environment")


@given(st.integers(min_value=0, max_value=10**6), st.sampled_from(sorted(UNITS)), st.booleans())
def test_size_round_trip_through_text(number: int, unit: str, space: bool) -> None:
    text = f"{number}{' ' if space else ''}{unit}"
    assert size(text) == number * UNITS[unit]
    assert size(text.lower()) == number * UNITS[unit]
    assert size(text.upper()) == number * UNITS[unit]


@given(
    st.integers(min_value=0, max_value=10**4),
    st.integers(min_value=0, max_value=999),
    st.sampled_from(sorted(BINARY | DECIMAL)),
)
def test_fractional_sizes_round_down_to_a_whole_byte(
    whole: int, thousandths: int, unit: str
) -> None:
    factor = UNITS[unit]
    assert size(f"{whole}.{thousandths:03d}{unit}") == (whole * 1000 + thousandths) * factor // 1000


@given(st.integers(min_value=0, max_value=1 << 62))
def test_format_size_round_trips(number: int) -> None:
    text = format_size(number)
    assert size(text) == number
    assert size(number) == number
    assert size(str(number)) == number


def test_format_size_picks_the_largest_exact_unit() -> None:
    assert format_size(8 * GiB) == "8GiB"
    assert format_size(4 * MiB) == "4MiB"
    assert format_size(10**9) == "1GB"
    assert format_size(1000) == "1kB"
    assert format_size(1536) == "1536"
    assert format_size(0) == "0"
    with pytest.raises(ValueError, match="0 or more"):
        format_size(-1)


@given(st.text(max_size=12))
def test_any_text_is_a_size_or_a_config_error(text: str) -> None:
    message = ""
    try:
        assert size(text) >= 0
    except ConfigError as exc:
        message = str(exc)
    assert not message or message.startswith("chunkd.toml: [cache] ram_bytes = ")


def test_durations_from_the_spec() -> None:
    assert duration("60s") == 60.0
    assert duration("5m") == 300.0
    assert duration("1h") == 3600.0
    assert duration("250ms") == 0.25
    assert duration("1.5s") == 1.5
    assert duration("45") == 45.0
    assert duration(10) == 10.0
    assert duration(0.5) == 0.5
    assert duration("1h30m") == 5400.0
    assert duration("1m 30s") == 90.0
    assert duration("2d") == 172800.0
    assert isinstance(duration(3), float)


@pytest.mark.parametrize(
    "value", [True, "-1s", -1, "soon", "", "5 minutes", "1.5.s", "s", "5M", math.nan, math.inf]
)
def test_bad_durations_name_the_key_and_the_source(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^chunkd.toml: \[server\] shutdown_timeout = "):
        duration(value)  # type: ignore[arg-type]


DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


@given(
    st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=10**5), st.sampled_from(sorted(DURATION_UNITS))
        ),
        min_size=1,
        max_size=4,
    ),
    st.booleans(),
)
def test_duration_round_trip_through_text(parts: list[tuple[int, str]], spaced: bool) -> None:
    text = (" " if spaced else "").join(f"{n}{unit}" for n, unit in parts)
    expected = sum(n * DURATION_UNITS[unit] for n, unit in parts)
    assert math.isclose(duration(text), expected, rel_tol=1e-12, abs_tol=1e-12)


@given(st.floats(min_value=0, max_value=1e9, allow_nan=False, allow_infinity=False))
def test_duration_numbers_and_their_text_agree(seconds: float) -> None:
    assert duration(seconds) == seconds
    assert duration(f"{seconds:.6f}s") == pytest.approx(seconds, abs=1e-6)
    assert duration(f"{seconds:.6f}") == pytest.approx(seconds, abs=1e-6)


def test_peers_need_self_and_a_token_file(tmp_path: Path) -> None:
    base = '[[backends]]\nname = "d"\nurl = "memory://"\n'
    with pytest.raises(ConfigError, match="has no self"):
        load_config(write(tmp_path, base + '[peers]\nmembers = ["a:1"]\n'), environ={})
    with pytest.raises(ConfigError, match="token_file"):
        load_config(write(tmp_path, base + '[peers]\nself = "a:1"\n'), environ={})
    with pytest.raises(ConfigError, match="members"):
        load_config(
            write(tmp_path, base + '[peers]\nself = "a:1"\ntoken_file = "t"\nmembers = "x"\n'),
            environ={},
        )
    config = load_config(
        write(tmp_path, base + '[peers]\nself = "10.0.0.1:8470"\ntoken_file = "t"\n'),
        environ={"CHUNKD_PEERS_MEMBERS": "10.0.0.1:8470, 10.0.0.2:8470"},
        cwd=tmp_path,
    )
    assert config.peers.enabled
    assert config.peers.members == ("10.0.0.1:8470", "10.0.0.2:8470")
    assert config.peers.token_file == tmp_path / "t"


# -- each key declared once: the docs are made (or checked) from the declarations ------

ROOT = Path(__file__).resolve().parents[1]


def test_the_docstring_reference_is_generated_from_the_declarations() -> None:
    doc = config_module.__doc__
    assert doc is not None
    block = doc.split(config_doc.REFERENCE_START, 1)[1].split(config_doc.REFERENCE_END)[0]
    assert textwrap.dedent(block) == config_doc.reference(), (
        "run python -m chunkd.gateway.config.doc --write"
    )


def test_the_key_tables_of_docs_config_are_generated_from_the_declarations() -> None:
    page = (ROOT / "docs" / "config.md").read_text()
    block = page.split(config_doc.KEYS_START, 1)[1].split(config_doc.KEYS_END)[0]
    assert block == config_doc.key_tables(), "run python -m chunkd.gateway.config.doc --write"
    for section in SECTIONS:
        for key in section.keys.values():
            assert f"| `{key.name}` |" in block
    assert "Every key and its default is declared once in\n`gateway/config/schema.py`" in page


@pytest.mark.timeout(10)
def test_docs_config_writes_down_the_embedded_default_and_every_override_family(
    tmp_path: Path,
) -> None:
    from chunkd.gateway.config.load import _SECTION_PREFIXES

    page = (ROOT / "docs" / "config.md").read_text()
    # The embedded default as a file, run in /srv/work there: the same config here.
    section = page.split("## The embedded default", 1)[1]
    block = section.split("```toml\n", 1)[1].split("```", 1)[0]
    path = write(tmp_path, block.replace("/srv/work", str(tmp_path)))
    written = load_config(path, environ={}, cwd=tmp_path)
    default = embedded_default(tmp_path)
    assert (written.server, written.cache, written.backends) == (
        default.server,
        default.cache,
        default.backends,
    )
    for prefix in [*_SECTION_PREFIXES, "CHUNKD_BACKENDS_"]:
        assert f"| `{prefix}" in page, prefix
    for line in (
        "CHUNKD_S3_FRONT_LISTEN=127.0.0.1:8471",
        "CHUNKD_S3_FRONT_ACCESS_KEY_ID=",
        "CHUNKD_S3_FRONT_SECRET_ACCESS_KEY=",
        "## `chunkd config show`",
        "### A config file never gets the default's backend",
    ):
        assert line in page


def test_the_doc_command_checks_every_generated_and_example_file(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert config_doc.main(["--check"]) == 0
    assert config_doc.main([]) == 0
    assert capsys.readouterr().out.strip() == config_doc.reference()


def test_the_example_config_lists_every_key_with_its_default() -> None:
    text = (ROOT / "systemd" / "chunkd.toml").read_text()
    assert config_doc.example_problems(text) == []
    # The example is also a config that loads.
    config = tomllib.loads(text)
    assert set(config) <= {section.name for section in SECTIONS}


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (("# disk_workers = 4\n", ""), "[cache] disk_workers is missing"),
        (("# disk_workers = 4\n", "# disk_workers = 8\n"), "the default is 4"),
        (('ram_bytes = "8GiB"\n', 'ram_bytes = "9GiB"\n'), 'the default is "8GiB"'),
        (("# retries = 3\n", "# retries = 3\n# retry = 3\n"), "[[backends]] retry: no such key"),
        (("# retries = 3\n", "# retries = 3\n# retries = 3\n"), "retries: listed twice"),
        (("# span_chunks = 64\n", "# span_chunks = 'x'\n"), "span_chunks = 'x' is not a whole"),
        (("[peers]\n", "[peer]\n"), "unknown section [peer]"),
    ],
)
def test_the_example_check_finds_missing_unknown_and_wrong_keys(
    change: tuple[str, str], expected: str
) -> None:
    text = (ROOT / "systemd" / "chunkd.toml").read_text()
    old, new = change
    assert old in text
    problems = config_doc.example_problems(text.replace(old, new, 1))
    assert any(expected in problem for problem in problems), problems


def test_every_key_is_declared_with_a_kind_a_default_and_a_line_of_doc() -> None:
    for section in SECTIONS:
        for name, key in section.keys.items():
            assert key.name == name
            assert key.doc
            assert "=" not in key.doc
            assert "\n" not in key.doc
            assert key.required or key.default_toml() is not None or key.example is not None
            if key.default_toml() is not None:
                # The default, written as the docs write it, reads back as itself.
                value = tomllib.loads(f"v = {key.default_toml()}")["v"]
                origin = Origin("docs", name)
                assert key.kind.parse(value, origin) == key.default
    # The dataclasses and the key tables are the same declarations.
    assert [k.field for k in SERVER.keys.values()] == [
        f.name for f in dataclasses.fields(ServerConfig)
    ]
    assert [k.field for k in BACKENDS.keys.values()] == [
        f.name for f in dataclasses.fields(BackendConfig)
    ]
    assert [k.field for k in PEERS.keys.values()] == [
        f.name for f in dataclasses.fields(PeersConfig)
    ]
    cache_fields = {f.name: f.default for f in dataclasses.fields(CacheConfig)}
    assert set(CACHE.keys) | set(NOT_CACHE_KEYS) == set(cache_fields)
    assert all(reason for reason in NOT_CACHE_KEYS.values())
    for name, key in CACHE.keys.items():
        # A [cache] default is the cache library's, but for the directory.
        assert key.default == (Path("/var/cache/chunkd") if name == "dir" else cache_fields[name])


# -- tunables that became keys ----------------------------------------------------------

TUNED = """
[server]
socket_max_clients = 16
socket_send_timeout = "5s"
readahead_chunks = 0
span_chunks = 8

[cache]
disk_workers = 2
index_flush_interval = "10ms"
disk_retry_after = "1m"

[peers]
self = "10.0.0.1:8470"
token_file = "token"
request_timeout = "30s"

[[backends]]
name = "ckpt"
url = "gs://checkpoints"
credentials_file = "gcs.json"
"""


def test_the_tunables_are_settable_from_toml(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, TUNED), environ={}, cwd=tmp_path)
    server = config.server
    assert (server.socket_max_clients, server.socket_send_timeout) == (16, 5.0)
    assert (server.readahead_chunks, server.span_chunks) == (0, 8)
    cache = config.cache
    assert (cache.disk_workers, cache.index_flush_interval, cache.disk_retry_after) == (
        2,
        0.01,
        60.0,
    )
    assert config.peers.request_timeout == 30.0
    (backend,) = config.backends
    assert backend.credentials_file == str(tmp_path / "gcs.json")
    assert config.redacted()["backends"][0]["credentials_file"] == str(tmp_path / "gcs.json")


def test_the_tunables_default_to_what_the_code_used_before(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, minimal()), environ={}, cwd=tmp_path)
    server = config.server
    assert (server.socket_max_clients, server.socket_send_timeout) == (1024, 30.0)
    assert (server.readahead_chunks, server.span_chunks) == (4, 64)
    cache = config.cache
    assert (cache.disk_workers, cache.index_flush_interval, cache.disk_retry_after) == (
        4,
        0.05,
        30.0,
    )
    assert config.peers.request_timeout == 120.0
    assert config.backends[0].credentials_file is None


def test_the_tunables_take_overrides(tmp_path: Path) -> None:
    environ = {
        "CHUNKD_SERVER_SOCKET_MAX_CLIENTS": "4",
        "CHUNKD_SERVER_SPAN_CHUNKS": "2",
        "CHUNKD_CACHE_DISK_WORKERS": "1",
        "CHUNKD_CACHE_INDEX_FLUSH_INTERVAL": "1ms",
        "CHUNKD_PEERS_REQUEST_TIMEOUT": "1m",
        "CHUNKD_BACKENDS_CKPT_CREDENTIALS_FILE": "/etc/chunkd/sa.json",
    }
    config = load_config(write(tmp_path, TUNED), environ=environ, cwd=tmp_path)
    assert (config.server.socket_max_clients, config.server.span_chunks) == (4, 2)
    assert (config.cache.disk_workers, config.cache.index_flush_interval) == (1, 0.001)
    assert config.peers.request_timeout == 60.0
    assert config.backends[0].credentials_file == "/etc/chunkd/sa.json"
    unset = load_config(
        write(tmp_path, TUNED),
        environ={"CHUNKD_BACKENDS_CKPT_CREDENTIALS_FILE": ""},
        cwd=tmp_path,
    )
    assert unset.backends[0].credentials_file is None


@pytest.mark.parametrize(
    ("section", "line", "expected"),
    [
        ("server", "socket_max_clients = 0", "[server] socket_max_clients = 0 is not 1 or more"),
        ("server", "socket_send_timeout = 0", "[server] socket_send_timeout = 0 is not more than"),
        ("server", "readahead_chunks = -1", "[server] readahead_chunks = -1 is negative"),
        ("server", "span_chunks = 0", "[server] span_chunks = 0 is not 1 or more"),
        ("cache", "disk_workers = 0", "[cache] disk_workers = 0 is not 1 or more"),
        ("cache", "index_flush_interval = 0", "[cache] index_flush_interval = 0 is not more"),
        ("cache", "disk_retry_after = 'soon'", "[cache] disk_retry_after = 'soon' is not a dur"),
        ("peers", "request_timeout = 0", "[peers] request_timeout = 0 is not more than 0"),
    ],
)
def test_a_wrong_tunable_names_the_key_and_the_file(
    tmp_path: Path, section: str, line: str, expected: str
) -> None:
    message = load_error(tmp_path, minimal(f"[{section}]\n{line}\n"))
    assert message.startswith(f"{tmp_path / 'chunkd.toml'}: [{section}] ")
    assert expected in message


def test_a_credentials_file_is_a_path_string(tmp_path: Path) -> None:
    message = load_error(tmp_path, minimal(backend="credentials_file = 3"))
    assert "[[backends]] 'data' credentials_file = 3 is not a string" in message
    message = load_error(tmp_path, minimal(backend="credentials_file = ''"))
    assert "[[backends]] 'data' credentials_file is empty" in message


# -- a config file without backends ----------------------------------------------------


@pytest.mark.timeout(10)
def test_a_file_without_backends_says_what_to_add_and_adds_nothing(tmp_path: Path) -> None:
    text = '[s3_front]\nlisten = "127.0.0.1:8471"\n'
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={}, cwd=tmp_path)
    message = str(caught.value)
    assert message.startswith(f"{path}: has no [[backends]]")
    # The message holds the embedded default's backend as TOML, its url absolute for the
    # directory the config was loaded from, and says it was not added.
    block = message[message.index("[[backends]]\nname") :].split("\n\n")[0]
    assert tomllib.loads(block) == {
        "backends": [
            {
                "name": "local",
                "url": f"file://{tmp_path}/chunkd-data",
                "writable": True,
                "revalidate": "1s",
            }
        ]
    }
    assert "never" in message
    assert "--config" in message
    assert not (tmp_path / "chunkd-data").exists()
    # Pasted as it stands, it gives the file the embedded default's backend.
    path.write_text(text + "\n" + block + "\n")
    config = load_config(path, environ={}, cwd=tmp_path)
    assert [b.name for b in config.backends] == ["local"]
    assert config.backends[0] == embedded_default(tmp_path).backends[0]
    assert config.s3_front.listen == "127.0.0.1:8471"


# -- [jobs], [cost] and the price tables (issue 30) -----------------------------------

_PRICED = """
[jobs]
top = 4
idle = "5m"
[cost]
default = "mine"
names = 8
[cost.mine]
egress_per_gb = 0.01
get_per_1000 = 0.001
put_per_1000 = 0.01
storage_per_gb_month = 0.02
[[backends]]
name = "data"
url = "s3://bucket/prefix"
price = "example-s3-internet"
[[backends]]
name = "other"
url = "s3://bucket2"
[[backends]]
name = "files"
url = "file:///srv/data"
"""


@pytest.mark.timeout(10)
def test_jobs_cost_and_price_tables_load_and_each_backend_gets_its_table(tmp_path: Path) -> None:
    config = load_config(
        write(tmp_path, _PRICED), environ={"CHUNKD_JOBS_TRACKED": "99"}, cwd=tmp_path
    )
    assert (config.jobs.top, config.jobs.idle, config.jobs.tracked) == (4, 300.0, 99)
    assert (config.cost.default, config.cost.names) == ("mine", 8)
    assert [config.price_of(b) for b in config.backends] == ["example-s3-internet", "mine", "free"]
    assert config.prices["mine"].get_per_1000 == 0.001
    assert config.prices["mine"].currency == "USD"
    # The shipped tables are there beside the file's.
    assert {"free", "example-s3-in-region", "example-s3-internet", "example-gcs-internet"} <= set(
        config.prices
    )


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            ('price = "example-s3-internet"', 'price = "nope"'),
            "price = 'nope' names no price table",
        ),
        (('default = "mine"', 'default = "gone"'), "default = 'gone' names no price table"),
        (("get_per_1000 = 0.001\n", ""), "[cost.mine] has no get_per_1000"),
        (("get_per_1000 = 0.001", "get_per_1000 = -1"), "is not a finite price of 0 or more"),
        (("get_per_1000 = 0.001", 'get_per_1000 = "x"'), "is not a number"),
        (("get_per_1000 = 0.001", "get_per_100 = 0.001"), "[cost.mine] has no key 'get_per_100'"),
        (("top = 4", "top = -1"), "is negative"),
    ],
)
def test_a_bad_price_or_a_price_naming_no_table_is_a_config_error(
    tmp_path: Path, change: tuple[str, str], expected: str
) -> None:
    old, new = change
    assert old in _PRICED
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, _PRICED.replace(old, new, 1)), environ={}, cwd=tmp_path)
    assert expected in str(caught.value)
    if "names no price table" in expected:
        # The message lists the tables there are.
        assert "example-s3-in-region" in str(caught.value)
        assert "mine" in str(caught.value)


@pytest.mark.timeout(10)
def test_docs_config_shows_the_shipped_price_tables_and_an_example_that_loads(
    tmp_path: Path,
) -> None:
    from chunkd.gateway.config.schema import SHIPPED_PRICES

    section = (ROOT / "docs" / "config.md").read_text().split("## Prices", 1)[1]
    section = section.split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip().strip("`") for cell in line.strip("|").split("|")]
        if len(cells) == 6 and cells[0] in SHIPPED_PRICES:
            rows[cells[0]] = tuple(float(cell) for cell in cells[1:])
    assert rows == {
        name: (t.egress_per_gb, t.get_per_1000, t.put_per_1000, t.storage_per_gb_month,
               t.delete_per_1000)
        for name, t in SHIPPED_PRICES.items()
    }  # fmt: skip
    block = section.split("```toml\n", 1)[1].split("```", 1)[0]
    config = load_config(write(tmp_path, block), environ={}, cwd=tmp_path)
    assert config.price_of(config.backends[0]) == "our-contract"


@pytest.mark.timeout(10)
def test_price_tables_in_use_in_different_currencies_are_a_config_error(tmp_path: Path) -> None:
    euro = _PRICED.replace(
        "storage_per_gb_month = 0.02\n", 'storage_per_gb_month = 0.02\ncurrency = "EUR"\n'
    )
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, euro), environ={}, cwd=tmp_path)
    message = str(caught.value)
    assert "different currencies" in message
    assert "EUR: mine" in message
    assert "USD: example-s3-internet" in message
    # A table nobody uses, and the free table (it charges nothing), are no conflict.
    unused = _PRICED.replace('default = "mine"', 'default = "example-s3-in-region"').replace(
        "storage_per_gb_month = 0.02\n", 'storage_per_gb_month = 0.02\ncurrency = "EUR"\n'
    )
    config = load_config(write(tmp_path, unused), environ={}, cwd=tmp_path)
    assert config.prices["mine"].currency == "EUR"
