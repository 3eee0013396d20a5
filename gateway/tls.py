"""TLS for the HTTP port and between peers: ``[peers] tls_cert``, ``tls_key``, ``tls_ca``.

With the three keys set, the daemon's HTTP port serves HTTPS only (TLS 1.2 or
newer), and peers talk ``https://`` to each other:

1. Every connection to the port is encrypted, and every client can check the
   node against ``tls_ca`` (``chunkd stats --cacert``).
2. The node asks every client for a certificate but does not insist on one
   (``CERT_OPTIONAL``): local tools, ``/healthz``, ``/metrics`` and the data
   routes work as before, over HTTPS. A certificate that is sent must chain to
   ``tls_ca``, or the handshake fails.
3. Peer routes (``/v1/peer/...``) want both the token and a client certificate
   that chains to ``tls_ca`` (401 otherwise): a stolen token alone does not make a
   peer.
4. A node asking a peer checks the peer's certificate against ``tls_ca`` and its
   host name: the host part of the member address (``"10.0.0.7:8470"``) must be
   among the certificate's subject alternative names (an IP SAN for an address).
   It sends ``tls_cert`` as its own client certificate.

The files are read once, when the daemon starts (a new certificate takes a
restart); any problem with them is a :class:`~chunkd.errors.ConfigError` that
names the key and the file.
"""

from __future__ import annotations

import http.client
import logging
import re
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from chunkd.errors import ConfigError

if TYPE_CHECKING:
    from chunkd.gateway.config import Config

__all__ = ["PeerTLS", "cacert_context", "server_context", "unreachable"]

log = logging.getLogger("chunkd.gateway.tls")

_TLS_KEYS: Final = ("tls_cert", "tls_key", "tls_ca")
_CERTIFICATE: Final = b"-----BEGIN CERTIFICATE-----"
_PRIVATE_KEY: Final = re.compile(rb"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----")
_ENCRYPTED: Final = re.compile(rb"-----BEGIN ENCRYPTED PRIVATE KEY-----|Proc-Type: *4, *ENCRYPTED")


@dataclass(frozen=True)
class PeerTLS:
    """The TLS contexts of one node, made from ``[peers] tls_cert/tls_key/tls_ca``.

    Build it with :meth:`from_config`.
    """

    #: for the HTTP site: this node's certificate; client certificates optional,
    #: verified against tls_ca when sent
    server: ssl.SSLContext
    #: for requests to peers: verifies them against tls_ca (host names on) and
    #: presents this node's certificate
    client: ssl.SSLContext

    @classmethod
    def from_config(cls, config: Config) -> PeerTLS | None:
        """The contexts of ``config``'s ``[peers]`` section; None when TLS is not set.

        Reads and checks the three files, then checks, in memory, that this node's
        certificate passes the checks its peers will make (a certificate that does
        not chain to ``tls_ca``, has expired or does not name the host of ``self``
        is logged as a warning: the node still serves its own clients).

        Raises:
            ConfigError: only some of the three keys are set; a file is missing,
                unreadable or not PEM of the right kind; the key is encrypted or does
                not match the certificate. The message names the key and the file.
        """
        peers = config.peers
        paths = {key: getattr(peers, key) for key in _TLS_KEYS}
        given = [key for key, path in paths.items() if path is not None]
        if not given:
            return None
        if len(given) < len(_TLS_KEYS):
            missing = " or ".join(key for key in _TLS_KEYS if paths[key] is None)
            raise ConfigError(
                f"{config.source}: [peers] has {' and '.join(given)} but no {missing}; TLS "
                "needs all three (tls_cert, tls_key, tls_ca), or none for plain HTTP"
            )
        cert, key, ca = (Path(paths[name]) for name in _TLS_KEYS)
        where = {name: f"{config.source}: [peers] {name} {paths[name]}" for name in _TLS_KEYS}
        cert_pem = _read(cert, where["tls_cert"])
        key_pem = _read(key, where["tls_key"])
        ca_pem = _read(ca, where["tls_ca"])
        if _CERTIFICATE not in cert_pem:
            raise ConfigError(
                f"{where['tls_cert']} holds no PEM certificate (no '-----BEGIN CERTIFICATE-----' "
                "line); give this node's certificate, then any intermediates, in PEM"
            )
        _parse_certificates(cert_pem, where["tls_cert"])
        if _ENCRYPTED.search(key_pem):
            raise ConfigError(
                f"{where['tls_key']} is encrypted, and the daemon starts unattended; give it "
                "the key unencrypted (openssl pkey -in KEY -out PLAIN), readable by the "
                "daemon only (chmod 600)"
            )
        if not _PRIVATE_KEY.search(key_pem):
            raise ConfigError(
                f"{where['tls_key']} holds no PEM private key (no '-----BEGIN ... PRIVATE "
                "KEY-----' line); give the key of tls_cert, in PEM"
            )
        if _CERTIFICATE not in ca_pem:
            raise ConfigError(
                f"{where['tls_ca']} holds no PEM certificate (no '-----BEGIN CERTIFICATE-----' "
                "line); give the CA certificate(s) the peers' certificates chain to"
            )
        _parse_certificates(ca_pem, where["tls_ca"])

        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED, host names checked
        for context in (server, client):
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            _load_chain(context, cert, key, where)
            context.load_verify_locations(cafile=str(ca))
        server.verify_mode = ssl.CERT_OPTIONAL
        tls = cls(server=server, client=client)
        if peers.address is not None:
            problem = tls._self_check(peers.address.rpartition(":")[0].strip("[]"))
            if problem is not None:
                log.warning(
                    "peers: this node's certificate %s will be refused by its peers %s; "
                    "check tls_cert, tls_ca and self (see docs/peers.md, TLS)",
                    cert,
                    problem,
                )
        return tls

    def _self_check(self, host: str) -> str | None:
        """A handshake of this node with itself, in memory: what a peer would refuse."""
        to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
        client = self.client.wrap_bio(to_client, to_server, server_hostname=host)
        server = self.server.wrap_bio(to_server, to_client, server_side=True)
        sides = {"as a server": client, "as a client": server}  # who checks whom
        done: set[str] = set()
        for _ in range(8):
            for role, side in sides.items():
                if role in done:
                    continue
                try:
                    side.do_handshake()
                    done.add(role)
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLError as exc:
                    reason = getattr(exc, "verify_message", None) or exc.reason or str(exc)
                    return f"{role} ({str(reason).rstrip('.')})"
            # Both sides, not just the client: with TLS 1.3 the client is done before
            # the server has checked the client's certificate.
            if len(done) == len(sides):
                return None
        return "(its handshake with itself did not finish)"  # pragma: no cover


def server_context(cert: Path, key: Path, where: str) -> ssl.SSLContext:
    """A TLS server context (TLS 1.2 or newer) of ``cert`` and ``key``, no client
    certificates asked: what the S3 front serves HTTPS with. ``where`` names the
    section in messages (``"[s3_front]"``).

    Raises:
        ConfigError: a file cannot be read, holds no PEM, or the key is not the
            certificate's (or is encrypted).
    """
    places = {"tls_cert": f"{where} tls_cert {cert}", "tls_key": f"{where} tls_key {key}"}
    cert_pem = _read(cert, places["tls_cert"])
    key_pem = _read(key, places["tls_key"])
    if _CERTIFICATE not in cert_pem:
        raise ConfigError(f"{places['tls_cert']} holds no PEM certificate; give it in PEM")
    _parse_certificates(cert_pem, places["tls_cert"])
    if _ENCRYPTED.search(key_pem) or not _PRIVATE_KEY.search(key_pem):
        raise ConfigError(
            f"{places['tls_key']} is not an unencrypted PEM private key; give the key of "
            "tls_cert unencrypted (openssl pkey -in KEY -out PLAIN), chmod 600"
        )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(context, cert, key, places)
    return context


def _read(path: Path, where: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"{where} cannot be read ({exc.strerror or exc}); check the path and that the "
            "daemon's user may read it"
        ) from exc


def _parse_certificates(pem: bytes, where: str) -> None:
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(
            cadata=pem.decode("ascii", "replace")
        )
    except ssl.SSLError as exc:
        raise ConfigError(
            f"{where} is not valid PEM certificates ({exc.reason or exc}); write it again "
            "from the issuing CA (openssl x509 -in FILE -noout -text shows what is wrong)"
        ) from exc


class _EncryptedKeyError(Exception):
    pass


def _refuse_password() -> str:
    # Without a callback OpenSSL would prompt on the terminal; the encrypted-key
    # check above means this is only reached for a form it does not know.
    raise _EncryptedKeyError


def _load_chain(context: ssl.SSLContext, cert: Path, key: Path, where: dict[str, str]) -> None:
    try:
        context.load_cert_chain(str(cert), str(key), password=_refuse_password)
    except _EncryptedKeyError:
        raise ConfigError(
            f"{where['tls_key']} is encrypted, and the daemon starts unattended; give it "
            "the key unencrypted (openssl pkey -in KEY -out PLAIN), readable by the daemon only"
        ) from None
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ConfigError(
                f"{where['tls_key']} is not the key of tls_cert {cert}; give the key that "
                "certificate was issued for"
            ) from exc
        # The certificates parsed already: what fails is the key.
        raise ConfigError(
            f"{where['tls_key']} is not a usable private key ({exc.reason or exc}); give "
            "the key of tls_cert, in PEM"
        ) from exc
    except OSError as exc:  # the file went away since it was read
        raise ConfigError(f"{where['tls_key']} cannot be read ({exc.strerror or exc})") from exc


# -- for the command line -------------------------------------------------------------


def cacert_context(cacert: str | None) -> ssl.SSLContext | None:
    """An HTTPS context that trusts ``cacert`` (a PEM bundle); None for the defaults.

    Raises:
        OSError: the file cannot be read or holds no certificate (``ssl.SSLError``).
    """
    if cacert is None:
        return None
    context = ssl.create_default_context(cafile=cacert)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def unreachable(url: str, exc: BaseException) -> str:
    """Why a command got no usable answer from the daemon at ``url``, and what to do."""
    reason = getattr(exc, "reason", None)
    if isinstance(exc, ssl.SSLCertVerificationError) or isinstance(
        reason, ssl.SSLCertVerificationError
    ):
        detail = getattr(exc, "verify_message", None) or getattr(reason, "verify_message", exc)
        return (
            f"{url} answered, but its certificate is not trusted ({detail}); give the CA "
            "that signed it ([peers] tls_ca) with --cacert PATH"
        )
    if url.startswith("http://") and isinstance(
        exc if reason is None else reason, (ConnectionResetError, http.client.RemoteDisconnected)
    ):
        return (
            f"{url} closed the connection without answering ({exc}); if the daemon serves "
            "HTTPS ([peers] tls_cert), use https:// and --cacert PATH"
        )
    return f"no answer from {url} ({exc}); is the daemon running (chunkd serve)?"
