"""Peers over TLS: HTTPS on the daemon's port, certificates checked both ways."""

from __future__ import annotations

import http.client
import ipaddress
import json
import logging
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from chunkd.client import Client
from chunkd.client import checkpoint as ckpt
from chunkd.errors import ConfigError
from chunkd.gateway.config import Config, load_config
from chunkd.gateway.peers import rank_owners
from chunkd.gateway.tls import PeerTLS
from chunkd.testing import CountingProxy, S3Server, free_port
from tests.conftest import Daemon
from tests.test_peers import TOKEN, load_everywhere, node_toml, state_of

CHUNKD = str(Path(sys.executable).parent / "chunkd")
MiB = 1 << 20
BOTH = (ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH)


class Authority:
    """A CA in a directory, and the node certificates it issues (EC P-256, a day)."""

    def __init__(self, directory: Path, name: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.dir = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
        now = datetime.now(UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(self.subject)
            .issuer_name(self.subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(now + timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_usage(ca=True), critical=True)
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )
        self.pem = directory / f"{name}-ca.pem"
        self.pem.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self,
        name: str,
        *,
        ips: Sequence[str] = ("127.0.0.1",),
        usages: Sequence[x509.ObjectIdentifier] = BOTH,
    ) -> tuple[Path, Path]:
        """(certificate, key) files for ``name``, with ``ips`` as its IP SANs."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.now(UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(now + timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
                ),
                critical=False,
            )
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_usage(ca=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        cert_path, key_path = self.dir / f"{name}.pem", self.dir / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        key_path.chmod(0o600)
        return cert_path, key_path


def _usage(*, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def tls_toml(toml: str, cert: Path, key: Path, ca: Path) -> str:
    """``toml`` (from ``node_toml``) with TLS in its [peers] section."""
    lines = f'tls_cert = "{cert}"\ntls_key = "{key}"\ntls_ca = "{ca}"\n'
    assert toml.count("[peers]\n") == 1
    return toml.replace("[peers]\n", "[peers]\n" + lines)


def start_tls_cluster(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    bucket: str,
    proxy: CountingProxy,
    authorities: Sequence[Authority],
    *,
    env: Sequence[dict[str, str]] | None = None,
    wait_healthy: bool = True,
) -> list[Daemon]:
    """One node per authority (each trusting only its own CA), all members of each other.

    Started in order; ``env``: more variables for each node.
    """
    ports = [free_port() for _ in authorities]
    nodes = []
    for i, (port, ca) in enumerate(zip(ports, authorities, strict=True)):
        cert, key = ca.issue(f"n{i}-{port}")
        toml = node_toml(tmp_path, bucket, proxy, f"n{i}", port, ports)
        nodes.append(
            start_daemon(
                tls_toml(toml, cert, key, ca.pem),
                cwd=tmp_path / f"n{i}",
                env={"CHUNKD_SERVER_LISTEN": f"127.0.0.1:{port}", **(env[i] if env else {})},
                port=port,
                tls_ca=ca.pem,
            )
        )
    if wait_healthy:
        deadline = time.monotonic() + 20
        while any(n.metric("chunkd_peer_healthy") < len(nodes) for n in nodes):
            assert time.monotonic() < deadline, "the nodes never all saw each other up"
            time.sleep(0.1)
    return nodes


def https_get(
    url: str,
    *,
    ca: Path,
    client: tuple[Path, Path] | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    context = ssl.create_default_context(cafile=str(ca))
    if client is not None:
        context.load_cert_chain(*map(str, client))
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def config_with(
    tmp_path: Path,
    cert: Path | str | None,
    key: Path | str | None,
    ca: Path | str | None,
    *,
    address: str = "127.0.0.1:8470",
    environ: dict[str, str] | None = None,
) -> Config:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    lines = [f'self = "{address}"', f'token_file = "{token}"']
    for name, value in (("tls_cert", cert), ("tls_key", key), ("tls_ca", ca)):
        if value is not None:
            lines.append(f'{name} = "{value}"')
    path = tmp_path / "chunkd.toml"
    path.write_text(
        '[[backends]]\nname = "d"\nurl = "memory://"\n[peers]\n' + "\n".join(lines) + "\n"
    )
    return load_config(path, environ=environ or {}, cwd=tmp_path)


def handshake(port: int, *, ca: Path, client: tuple[Path, Path], version: ssl.TLSVersion) -> None:
    """A TLS handshake with 127.0.0.1:``port`` at exactly ``version``."""
    context = ssl.create_default_context(cafile=str(ca))
    context.load_cert_chain(*map(str, client))
    context.minimum_version = context.maximum_version = version
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        tls.do_handshake()


def peers_of(node: Daemon) -> dict[str, bool]:
    status, _, body = node.get("/v1/stats")
    assert status == 200
    return {m["address"]: m["healthy"] for m in json.loads(body)["peers"]["members"]}


# -- a cluster over TLS ----------------------------------------------------------------


def test_three_tls_nodes_restore_a_checkpoint_with_one_backend_read_per_chunk(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    ca = Authority(tmp_path / "pki", "cluster")
    state = state_of(21)
    nodes = start_tls_cluster(start_daemon, tmp_path, bucket, s3_proxy, [ca] * 3)
    with Client(nodes[0].cwd / "chunkd.sock") as client:
        ckpt.save(state, "ckpt/tls/step-1", client=client)
    for node in nodes:
        node.stop()
    nodes = start_tls_cluster(start_daemon, tmp_path / "again", bucket, s3_proxy, [ca] * 3)
    time.sleep(0.5)  # a health round
    s3_proxy.reset()
    for result in load_everywhere(nodes, "ckpt/tls/step-1"):
        assert not isinstance(result, Exception), result
        assert all(torch.equal(result[k], state[k]) for k in state)
    size = sum(t.numel() * 4 for t in state.values())
    assert size <= s3_proxy.bytes_down <= 1.1 * size  # one backend read per chunk
    got_from_peers = sum(n.metric("chunkd_peer_bytes_total", direction="in") for n in nodes)
    assert got_from_peers >= size  # two of three nodes got every chunk, over TLS
    for node in nodes:
        assert node.url.startswith("https://")
        _, _, body = node.get("/v1/stats")
        assert json.loads(body)["peers"]["tls"] is True
        assert f"serving on https://127.0.0.1:{node.port}" in node.log.read_text()
        assert node.metric("chunkd_peer_healthy") == 3


def test_a_tls_port_wants_https_and_peer_routes_want_a_client_certificate(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    ca = Authority(tmp_path / "pki", "cluster")
    stranger = Authority(tmp_path / "stranger", "stranger")
    (node,) = start_tls_cluster(start_daemon, tmp_path, bucket, s3_proxy, [ca])
    plain = f"http://127.0.0.1:{node.port}/healthz"
    with pytest.raises((OSError, http.client.HTTPException)):
        urllib.request.urlopen(plain, timeout=10)
    # Clients without a certificate: the open and data routes answer as before.
    assert https_get(f"{node.url}/healthz", ca=ca.pem)[0] == 200
    assert https_get(f"{node.url}/v1/stats", ca=ca.pem)[0] == 200
    # ...and peer routes want a certificate from the cluster's CA, as well as the token.
    chunk = f"{node.url}/v1/peer/chunks/ckpt/{'ab' * 32}"
    token = {"Authorization": f"Bearer {TOKEN}"}
    status, body = https_get(chunk, ca=ca.pem, headers=token)
    assert status == 401
    assert "client certificate" in json.loads(body)["message"]
    member = ca.issue("another-member")
    assert https_get(chunk, ca=ca.pem, client=member, headers=token)[0] == 404  # let in
    wrong = {"Authorization": "Bearer wrong"}
    assert https_get(chunk, ca=ca.pem, client=member, headers=wrong)[0] == 401
    # A certificate from another CA does not get through the handshake: with TLS 1.3
    # the server's verdict comes after the client's last flight, so the request fails.
    intruder = stranger.issue("intruder")
    with pytest.raises((ssl.SSLError, ConnectionError)):
        https_get(chunk, ca=ca.pem, client=intruder, headers=token)
    with pytest.raises(ssl.SSLError):  # uvloop closes without an alert: EOF
        handshake(node.port, ca=ca.pem, client=intruder, version=ssl.TLSVersion.TLSv1_2)
    handshake(node.port, ca=ca.pem, client=member, version=ssl.TLSVersion.TLSv1_2)
    # Nor does a server with another CA's certificate convince a client of this one.
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        https_get(f"{node.url}/healthz", ca=stranger.pem)


def test_a_node_with_a_foreign_certificate_is_refused_and_reads_fall_back(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    ca = Authority(tmp_path / "pki", "cluster")
    other = Authority(tmp_path / "other", "other")
    state = state_of(22, tensors=32)
    nodes = start_tls_cluster(start_daemon, tmp_path, bucket, s3_proxy, [ca, ca])
    with Client(nodes[0].cwd / "chunkd.sock") as client:
        ckpt.save(state, "ckpt/foreign/step-1", client=client)
        manifest = ckpt.manifest("ckpt/foreign/step-1", client=client)
    for node in nodes:
        node.stop()
    # Fresh caches. The foreign node starts first, and the cluster nodes probe it
    # only every 2 s and mark it down only after 10 misses: they still see it up
    # when the reads start (however slowly the nodes start), so their reads do ask it.
    slow_to_judge = {"CHUNKD_PEERS_HEALTH_INTERVAL": "2s", "CHUNKD_PEERS_DOWN_AFTER": "10"}
    nodes = start_tls_cluster(
        start_daemon,
        tmp_path / "again",
        bucket,
        s3_proxy,
        [other, ca, ca],
        env=[{}, slow_to_judge, slow_to_judge],
        wait_healthy=False,
    )
    foreign = f"127.0.0.1:{nodes[0].port}"
    s3_proxy.reset()
    started = time.monotonic()
    results = load_everywhere(nodes, "ckpt/foreign/step-1")
    took = time.monotonic() - started
    for result in results:
        assert result is not None  # no reader hung
        assert not isinstance(result, Exception), result
        assert all(torch.equal(result[k], state[k]) for k in state)
    assert took < 60  # a refused handshake moves on at once: nothing waits on it
    size = sum(t.numel() * 4 for t in state.values())
    # The foreign node read everything from the backend, the two others once between them.
    assert 2 * size <= s3_proxy.bytes_down <= 2.3 * size
    members = [f"127.0.0.1:{n.port}" for n in nodes]
    chunks = [c for seg in manifest["parts"][0]["segments"] for c, _ in seg["chunks"]]
    if any(rank_owners(members, bytes.fromhex(c))[0] == foreign for c in chunks):
        for node in nodes[1:]:  # asked it first for those, and were refused
            assert node.metric("chunkd_peer_requests_total", peer=foreign, outcome="error") > 0
    deadline = time.monotonic() + 40
    while True:
        seen = [peers_of(n) for n in nodes]
        if sum(seen[0].values()) == 1 and not seen[1][foreign] and not seen[2][foreign]:
            break
        assert time.monotonic() < deadline, seen
        time.sleep(0.2)
    assert seen[1][members[2]]
    assert seen[2][members[1]]
    # The log says why: the certificate, not a vague failure.
    said = nodes[1].log.read_text()
    assert f"peer {foreign} is down after" in said
    assert "CERTIFICATE_VERIFY_FAILED" in said or "certificate verify failed" in said
    shared = sum(n.metric("chunkd_peer_bytes_total", direction="in") for n in nodes[1:])
    assert shared > 0  # the cluster nodes shared with each other
    for direction in ("in", "out"):
        assert nodes[0].metric("chunkd_peer_bytes_total", direction=direction) == 0


async def test_peers_check_the_host_name_of_the_certificate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ca = Authority(tmp_path / "pki", "cluster")
    cert, key = ca.issue("misnamed", ips=("10.9.9.9",))
    config = config_with(tmp_path, cert, key, ca.pem, address="127.0.0.1:1")
    with caplog.at_level(logging.WARNING, logger="chunkd.gateway.tls"):
        tls = PeerTLS.from_config(config)
    assert tls is not None
    assert "will be refused by its peers" in caplog.text
    assert "not valid for '127.0.0.1'" in caplog.text  # the host it should name

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    # A server with that certificate on 127.0.0.1, asked as a peer asks.
    app = web.Application()
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=tls.server).start()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls.client)) as s:
            with pytest.raises(aiohttp.ClientConnectorCertificateError, match="mismatch"):
                await s.get(f"https://127.0.0.1:{port}/healthz")
    finally:
        await runner.cleanup()


def test_a_certificate_that_cannot_be_a_client_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ca = Authority(tmp_path / "pki", "cluster")
    cert, key = ca.issue("server-only", usages=(ExtendedKeyUsageOID.SERVER_AUTH,))
    with caplog.at_level(logging.WARNING, logger="chunkd.gateway.tls"):
        assert PeerTLS.from_config(config_with(tmp_path, cert, key, ca.pem)) is not None
    assert "as a client" in caplog.text
    caplog.clear()
    good = ca.issue("good")
    with caplog.at_level(logging.WARNING, logger="chunkd.gateway.tls"):
        assert PeerTLS.from_config(config_with(tmp_path, *good, ca.pem)) is not None
    assert caplog.text == ""


# -- configuration errors ----------------------------------------------------------------


def test_the_three_tls_keys_go_together(tmp_path: Path) -> None:
    ca = Authority(tmp_path / "pki", "cluster")
    cert, key = ca.issue("node")
    source = str(tmp_path / "chunkd.toml")
    with pytest.raises(ConfigError, match=r"has tls_cert but no tls_key or tls_ca") as caught:
        config_with(tmp_path, cert, None, None)
    assert source in str(caught.value)
    with pytest.raises(ConfigError, match=r"has tls_cert and tls_key but no tls_ca"):
        config_with(tmp_path, cert, key, None)
    with pytest.raises(ConfigError, match=r"has tls_ca \(from CHUNKD_PEERS_TLS_CA\) but no"):
        config_with(tmp_path, None, None, None, environ={"CHUNKD_PEERS_TLS_CA": str(ca.pem)})
    # The environment sets them as it sets any [peers] key; relative paths start from
    # the working directory.
    config = config_with(
        tmp_path,
        None,
        None,
        None,
        environ={
            "CHUNKD_PEERS_TLS_CERT": str(cert),
            "CHUNKD_PEERS_TLS_KEY": str(key.relative_to(tmp_path)),
            "CHUNKD_PEERS_TLS_CA": str(ca.pem),
        },
    )
    assert (config.peers.tls_cert, config.peers.tls_key, config.peers.tls_ca) == (cert, key, ca.pem)
    assert config.peers.tls_enabled
    tls = PeerTLS.from_config(config)
    assert tls is not None
    for context in (tls.server, tls.client):
        assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert tls.server.verify_mode == ssl.CERT_OPTIONAL  # see test_a_tls_port_wants_https...
    assert (tls.client.verify_mode, tls.client.check_hostname) == (ssl.CERT_REQUIRED, True)
    plain = config_with(tmp_path, None, None, None)
    assert not plain.peers.tls_enabled
    assert PeerTLS.from_config(plain) is None
    assert plain.redacted()["peers"]["tls_cert"] is None


@pytest.mark.parametrize(
    ("broken", "problem"),
    [
        ("tls_cert", "missing"),
        ("tls_key", "directory"),
        ("tls_ca", "missing"),
        ("tls_cert", "garbage"),
        ("tls_cert", "bad-base64"),
        ("tls_key", "garbage"),
        ("tls_key", "bad-base64"),
        ("tls_ca", "garbage"),
        ("tls_ca", "bad-base64"),
        ("tls_key", "not-its-key"),
        ("tls_key", "encrypted"),
    ],
)
def test_unusable_tls_files_are_config_errors_that_name_the_key_and_the_file(
    tmp_path: Path, broken: str, problem: str
) -> None:
    ca = Authority(tmp_path / "pki", "cluster")
    cert, key = ca.issue("node")
    files = {"tls_cert": cert, "tls_key": key, "tls_ca": ca.pem}
    bad = tmp_path / f"bad-{broken}.pem"
    if problem == "directory":
        bad.mkdir()
    elif problem == "garbage":
        bad.write_text("this is not PEM at all\n")
    elif problem == "bad-base64":
        kind = "PRIVATE KEY" if broken == "tls_key" else "CERTIFICATE"
        bad.write_text(f"-----BEGIN {kind}-----\nnot*base64*at*all\n-----END {kind}-----\n")
    elif problem == "not-its-key":
        bad = ca.issue("someone-else")[1]
    elif problem == "encrypted":
        private = serialization.load_pem_private_key(key.read_bytes(), password=None)
        bad.write_bytes(
            private.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.BestAvailableEncryption(b"a passphrase"),
            )
        )
    files[broken] = bad
    config = config_with(tmp_path, files["tls_cert"], files["tls_key"], files["tls_ca"])
    with pytest.raises(ConfigError) as caught:
        PeerTLS.from_config(config)
    message = str(caught.value)
    assert f"[peers] {broken} {bad}" in message, message
    assert str(tmp_path / "chunkd.toml") in message
    expected = {
        "missing": "cannot be read",
        "directory": "cannot be read",
        "garbage": "holds no PEM",
        "bad-base64": "not",
        "not-its-key": "is not the key of tls_cert",
        "encrypted": "is encrypted",
    }[problem]
    assert expected in message, message


def test_a_daemon_with_an_unusable_key_exits_with_the_reason(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    ca = Authority(tmp_path / "pki", "cluster")
    cert, _ = ca.issue("node")
    _, wrong_key = ca.issue("another")
    port = free_port()
    toml = tls_toml(
        node_toml(tmp_path, bucket, s3_proxy, "n", port, [port]), cert, wrong_key, ca.pem
    )
    node = start_daemon(toml, cwd=tmp_path / "n", port=port, wait=False, tls_ca=ca.pem)
    assert node.process.wait(timeout=30) == 2
    said = node.log.read_text()
    assert f"[peers] tls_key {wrong_key} is not the key of tls_cert {cert}" in said, said
    half = node_toml(tmp_path, bucket, s3_proxy, "m", port, [port])
    node = start_daemon(
        half.replace("[peers]\n", f'[peers]\ntls_cert = "{cert}"\n'),
        cwd=tmp_path / "m",
        port=port,
        wait=False,
    )
    assert node.process.wait(timeout=30) == 2
    assert "has tls_cert but no tls_key or tls_ca" in node.log.read_text()


# -- the command line --------------------------------------------------------------------


def test_chunkd_stats_and_warm_over_https(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    bucket: str,
    s3_proxy: CountingProxy,
    s3_server: S3Server,
) -> None:
    ca = Authority(tmp_path / "pki", "cluster")
    (node,) = start_tls_cluster(start_daemon, tmp_path, bucket, s3_proxy, [ca])
    shown = subprocess.run(
        [CHUNKD, "stats", "--url", node.url, "--cacert", str(ca.pem)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"peers: 1 of 1 up (self 127.0.0.1:{node.port}, TLS)" in shown
    assert "backend ckpt (s3): ok" in shown
    unchecked = subprocess.run(
        [CHUNKD, "stats", "--url", node.url], capture_output=True, text=True, check=False
    )
    assert unchecked.returncode == 1
    assert "answered, but its certificate is not trusted" in unchecked.stderr
    assert "--cacert" in unchecked.stderr
    plain = subprocess.run(
        [CHUNKD, "stats", "--url", f"http://127.0.0.1:{node.port}"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert plain.returncode == 1
    assert "use https:// and --cacert" in plain.stderr, plain.stderr
    s3_server.client().put_object(Bucket=bucket, Key="pre/warm/a.bin", Body=b"x" * (3 * MiB))
    warmed = subprocess.run(
        [CHUNKD, "warm", "ckpt/warm/a.bin", "--url", node.url, "--cacert", str(ca.pem)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert warmed.returncode == 0, warmed.stdout + warmed.stderr
    assert "warmed 1 of 1 objects" in warmed.stdout
