"""The daemon's configuration: one TOML file, with ``CHUNKD_*`` environment overrides.

``chunkd serve --config /etc/chunkd/chunkd.toml`` reads the file with
:func:`load_config`; ``chunkd serve`` with no file runs on :func:`embedded_default`.
Config is data: frozen dataclasses, read once at start-up. This module is the only
one that reads the environment for configuration.

Every key, with its default (a key left out takes the default)::

    [server]
    listen = "127.0.0.1:8470"           # HTTP listener, host:port; IPv6 as "[::1]:8470";
                                        # "0.0.0.0:8470" for every interface
    socket = "/run/chunkd/chunkd.sock"  # local socket for the trainers of this node
    socket_mode = "0660"                # its permissions: a string "0660" or TOML octal
                                        # 0o660 (a plain integer is read as a number)
    # socket_group = "train"            # group owning the socket; unset: the daemon's
    shutdown_timeout = "10s"            # how long a stop waits for requests in flight
    log_format = "json"                 # "json" or "text"
    log_level = "info"                  # "debug", "info", "warning", "error", "critical"
    # token = "..."                     # shared secret: clients that are not on loopback
                                        # must send "Authorization: Bearer TOKEN" to every
                                        # data route; unset, they get 403 (never a proxy)
    prefetch_in_flight = 64             # objects loaded at once for prefetch and warm,
                                        # over every client together
    prefetch_per_client = 8             # of those, at once for one client (a user id)

    [cache]
    dir = "/var/cache/chunkd"           # index/, chunks/, tmp/ and LOCK live here
    ram_bytes = "8GiB"                  # RAM tier budget (sealed memfds)
    disk_bytes = "200GiB"               # disk tier budget (stored bytes)
    disk_min_free_bytes = "1GiB"        # free space the disk tier leaves on its filesystem
    chunk_bytes = "4MiB"                # chunk size; a multiple of the page size
    fsync = "always"                    # "always" or "never"
    compress = true                     # zstd on disk when it saves at least 1/8
    verify_reads = true                 # check every chunk read from disk against its id
    write_policy = "write-through"      # "write-through", "write-behind" or "upper-only"
    eviction = "s3fifo"                 # RAM eviction: "s3fifo" (scan-resistant) or "lru"

    [peers]                             # other chunkd nodes to share chunks with; without
                                        # self, this node is on its own (self and
                                        # token_file go together)
    # self = "10.0.0.7:8470"            # this node's address, as the others reach it
    # members = ["10.0.0.7:8470"]     # a static list of host:port (self may be in it)
    # members_file = "/etc/chunkd/peers"  # one host:port a line ('#' comments), re-read
                                        # when it changes (written from a Slurm hostlist)
    # dns = "chunkd.train.svc:8470"    # a name whose A/AAAA records are the members
                                        # (a Kubernetes headless service), re-resolved
                                        # every health_interval
    # token_file = "/etc/chunkd/token"  # shared secret every peer request carries
    # timeout = "2s"                    # a peer silent this long is probed; one that
                                        # fails the probe too is skipped
    # health_interval = "1s"            # how often each peer's /healthz is probed
    # down_after = 3                    # failed probes before a peer is marked down
    # up_after = 2                      # passed probes before it is up again
    # tls_cert = "/etc/chunkd/node.pem"  # TLS (all three keys, or none): this node's
                                        # certificate chain, PEM; its SANs name the host
                                        # of self (an IP SAN for an address). The HTTP
                                        # port then serves HTTPS only
    # tls_key = "/etc/chunkd/node.key"  # its private key, PEM, unencrypted (chmod 600)
    # tls_ca = "/etc/chunkd/ca.pem"     # the CA(s) peers' certificates must chain to;
                                        # peer routes also want a client certificate

    [[backends]]                        # one table per backend; at least one
    name = "data"                       # required: [a-z0-9][a-z0-9_-]{0,62}; users name
                                        # objects "data/KEY"
    url = "s3://bucket/prefix"          # required: s3://BUCKET[/PREFIX], gs://..., az://...,
                                        # file:///ABSOLUTE/DIR or memory://
    # endpoint = "https://minio:9000"   # unset: the provider's own endpoint
    # region = "eu-west-1"              # unset: the client library's default
    # access_key_id = "AKIA..."         # unset (with secret_access_key): ambient
    # secret_access_key = "..."         #   credentials. Secrets are never logged and
    # session_token = "..."             #   show as "***" in /v1/stats
    allow_http = false                  # allow a plain http:// endpoint
    writable = false                    # checkpoints may be written to this backend
    revalidate = "immutable"            # or a duration: re-check an object's version
                                        # after that long
    timeout = "30s"                     # a read fails when the backend is silent
                                        # this long (no response, or a body that
                                        # stops): a slow, steady body is not cut off;
                                        # writes, HEADs and lists must end within it
    retries = 3                         # per backend request
    list_revalidate = "30s"             # a listing is answered from the daemon's memory
                                        # this long (a folder gains new shards); 0: never
    stale_if_error = "1d"               # with revalidate a duration: a cached object
                                        # whose version cannot be re-checked (backend
                                        # down) is still served this long after its last
                                        # check, marked stale (RFC 5861); 0: never

Relative paths (``socket``, ``dir``) are taken from the working directory when the
config is loaded. ``endpoint``, ``region``, the credentials and ``allow_http`` apply to
s3, gs and az backends (a file or memory backend ignores them); there
``access_key_id`` and ``secret_access_key`` go together, and an ``http://`` endpoint
needs ``allow_http = true``.

Sizes are a whole number of bytes or a string: ``"8GiB"``, ``"200 GiB"``,
``"512KiB"``, ``"1.5GiB"`` (binary units KiB, MiB, GiB, TiB, PiB; also Ki, Mi, Gi...),
``"10GB"`` (decimal units kB, MB, GB, TB, PB) or ``"123"`` (bytes). A bare ``"8G"`` is
refused as ambiguous. Durations are a number of seconds or a string: ``"250ms"``,
``"1.5s"``, ``"5m"``, ``"1h"``, ``"2d"``, ``"1h30m"``.

Environment overrides, applied on top of the file (or of the embedded default):

* ``CHUNKD_SERVER_<KEY>`` sets one key of ``[server]``: ``CHUNKD_SERVER_LISTEN=0.0.0.0:8470``.
* ``CHUNKD_CACHE_<KEY>`` sets one key of ``[cache]``: ``CHUNKD_CACHE_RAM_BYTES=16GiB``.
* ``CHUNKD_PEERS_<KEY>`` sets one key of ``[peers]``: ``CHUNKD_PEERS_TLS_CA=/etc/chunkd/ca.pem``.
* ``CHUNKD_BACKENDS_<NAME>_<KEY>`` sets one key of the backend named NAME (upper-cased,
  ``-`` written as ``_``): ``CHUNKD_BACKENDS_DATA_SECRET_ACCESS_KEY=...``.

KEY is the key upper-cased. Values go through the same parsing and checks as the
file's; booleans are ``true``/``false`` (also ``1``/``0``, ``yes``/``no``,
``on``/``off``). An empty value unsets a key whose default is unset (``socket_group``,
``endpoint``, ``region``, the credentials, and ``revalidate``, which then means
immutable). A variable under these prefixes that names no key, or no configured
backend, is an error; the environment can neither add nor rename a backend. Other
``CHUNKD_*`` variables (``CHUNKD_SOCKET``, read by the client) are not configuration
and are left alone.
"""

from __future__ import annotations

import difflib
import hmac
import ipaddress
import math
import mmap
import os
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from fractions import Fraction
from pathlib import Path
from typing import Any, Final, final
from urllib.parse import urlsplit

from chunkd.cache import CacheConfig, FsyncPolicy, WritePolicy
from chunkd.errors import ConfigError

__all__ = [
    "BackendConfig",
    "Config",
    "PeersConfig",
    "Secret",
    "ServerConfig",
    "embedded_default",
    "format_size",
    "load_config",
    "parse_duration",
    "parse_size",
]

_ENVIRONMENT: Final = "environment"
_EMBEDDED: Final = "embedded default"
_DEFAULT_CACHE_DIR: Final = Path("/var/cache/chunkd")
_GiB: Final = 1 << 30

# -- sizes and durations ------------------------------------------------------------

_BINARY: Final = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_DECIMAL: Final = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_SIZE_UNITS: Final[dict[str, int]] = {
    "": 1,
    "b": 1,
    **{f"{p}ib": f for p, f in _BINARY.items()},
    **{f"{p}i": f for p, f in _BINARY.items()},
    **{f"{p}b": f for p, f in _DECIMAL.items()},
}
_NUMBER: Final = r"(?:[0-9]+(?:\.[0-9]+)?|\.[0-9]+)"
_SIZE_RE: Final = re.compile(rf"(?P<number>{_NUMBER})\s*(?P<unit>[A-Za-z]*)")
_SIZE_HINT: Final = "write it like '8GiB'"
# Largest unit first, binary before decimal: the exact spelling format_size picks.
_FORMAT_UNITS: Final = (
    *((f"{p.upper()}iB", f) for p, f in reversed(_BINARY.items())),
    *((f"{p.upper() if p != 'k' else p}B", f) for p, f in reversed(_DECIMAL.items())),
)

_DURATION_UNITS: Final[dict[str, Fraction]] = {
    "ms": Fraction(1, 1000),
    "s": Fraction(1),
    "m": Fraction(60),
    "h": Fraction(3600),
    "d": Fraction(86400),
}
_DURATION_PART: Final = re.compile(rf"({_NUMBER})\s*(ms|s|m|h|d)\s*")
_DURATION_RE: Final = re.compile(rf"(?:{_DURATION_PART.pattern})+")
_DURATION_HINT: Final = "write it like '30s', '5m' or '250ms'"


def _where(source: str, key: str) -> str:
    """Where a value comes from, as error messages start."""
    if source == _ENVIRONMENT:
        return f"environment {key}"
    return f"{source}: {key}"


def _show(value: object) -> str:
    """A value as an error message shows it: TOML booleans, quoted strings, short."""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_size(text: str | int, *, key: str, source: str) -> int:
    """A size in bytes, from an integer or a string like ``"8GiB"`` or ``"10GB"``.

    Binary units (KiB, MiB, GiB, TiB, PiB; also Ki, Mi, ...) count in 1024s, decimal
    units (kB, MB, GB, TB, PB) in 1000s; units are case-insensitive and may follow a
    space. A fraction (``"1.5GiB"``) is rounded down to a whole byte. A bare ``"8G"``
    is refused as ambiguous.

    Args:
        text: the value as given (TOML integer or string, or an environment string).
        key: what the value is for, as messages name it: ``"[cache] ram_bytes"`` or
            the environment variable.
        source: the file the value came from, or ``"environment"``.

    Returns:
        The size in bytes, 0 or more.

    Raises:
        ConfigError: the value is not a size (a bool, a float, garbage, a negative
            number); the message names ``key`` and ``source``.
    """
    return _parse_size(text, key, source)


def _parse_size(value: object, key: str, source: str) -> int:
    where = _where(source, key)
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(f"{where} = {_show(value)} is not a size; {_SIZE_HINT}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{where} = {value} is negative; a size is 0 or more, like '8GiB'")
        return value
    text = value.strip()
    if text.startswith("-"):
        raise ConfigError(f"{where} = {value!r} is negative; a size is 0 or more, like '8GiB'")
    match = _SIZE_RE.fullmatch(text)
    if match is None:
        raise ConfigError(f"{where} = {value!r} is not a size; {_SIZE_HINT}")
    number, unit = Fraction(match["number"]), match["unit"].lower()
    if unit in _BINARY:
        raise ConfigError(
            f"{where} = {value!r} is ambiguous; write {match['number']}{unit.upper()}iB for "
            f"binary units (1024) or {match['number']}{unit.upper()}B for decimal ones (1000)"
        )
    factor = _SIZE_UNITS.get(unit)
    if factor is None:
        raise ConfigError(f"{where} = {value!r} is not a size; {_SIZE_HINT}")
    if factor == 1 and number.denominator != 1:
        raise ConfigError(f"{where} = {value!r} is not a whole number of bytes; {_SIZE_HINT}")
    return int(number * factor)


def format_size(size: int) -> str:
    """``size`` bytes as an exact string :func:`parse_size` reads back.

    The largest unit that divides ``size`` exactly, binary first:
    ``8 << 30`` gives ``"8GiB"``, ``10**9`` gives ``"1GB"``, ``123`` gives ``"123"``.

    Raises:
        ValueError: ``size`` is negative.
    """
    if size < 0:
        raise ValueError(f"a size is 0 or more bytes; got {size}")
    for unit, factor in _FORMAT_UNITS:
        if size and size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


def parse_duration(text: str | int | float, *, key: str, source: str) -> float:
    """A duration in seconds, from a number or a string like ``"250ms"`` or ``"1h30m"``.

    Units (lowercase): ``ms``, ``s``, ``m`` (minutes), ``h``, ``d``; parts add up
    (``"1m30s"``); a bare number is seconds.

    Args:
        text: the value as given (TOML number or string, or an environment string).
        key: what the value is for, as messages name it.
        source: the file the value came from, or ``"environment"``.

    Returns:
        The duration in seconds, 0 or more.

    Raises:
        ConfigError: the value is not a duration (a bool, garbage, a negative or
            non-finite number); the message names ``key`` and ``source``.
    """
    return _parse_duration(text, key, source)


def _parse_duration(value: object, key: str, source: str) -> float:
    where = _where(source, key)
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"{where} = {_show(value)} is not a duration; {_DURATION_HINT}")
    if isinstance(value, int | float):
        if not math.isfinite(value) or value < 0:
            raise ConfigError(
                f"{where} = {value!r} is not a duration of 0 seconds or more; {_DURATION_HINT}"
            )
        return float(value)
    text = value.strip()
    if re.fullmatch(_NUMBER, text):
        return float(Fraction(text))
    if not _DURATION_RE.fullmatch(text):
        problem = "is negative" if text.startswith("-") else "is not a duration"
        raise ConfigError(f"{where} = {value!r} {problem}; {_DURATION_HINT}")
    total = sum(
        (Fraction(number) * _DURATION_UNITS[unit] for number, unit in _DURATION_PART.findall(text)),
        start=Fraction(0),
    )
    return float(total)


# -- secrets ------------------------------------------------------------------------


@final
class Secret:
    """A string that is never shown: ``repr`` and ``str`` give ``Secret('***')``.

    Credentials are wrapped from the moment they are read, so a config that is
    printed, logged or served by ``/v1/stats`` cannot leak them. Only the code that
    hands a credential to a backend client calls :meth:`reveal`. Two secrets are
    equal when their values are (compared in constant time).
    """

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        """The secret value itself. Never log it."""
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Secret):
            return NotImplemented
        return hmac.compare_digest(self._value.encode(), other._value.encode())

    def __hash__(self) -> int:
        return hash((Secret, self._value))


# -- one value: converters and their checks -----------------------------------------


@dataclass(frozen=True)
class _Origin:
    """Where one value came from: a file (or a class) and a key, or a variable."""

    source: str
    #: "[cache] ram_bytes", or the environment variable
    key: str

    @property
    def where(self) -> str:
        return _where(self.source, self.key)

    @property
    def from_env(self) -> bool:
        return self.source == _ENVIRONMENT

    def error(self, value: object, problem: str) -> ConfigError:
        return ConfigError(f"{self.where} = {_show(value)} {problem}")


_Convert = Callable[[object, _Origin], Any]


def _text(value: object, origin: _Origin) -> str:
    if not isinstance(value, str):
        raise origin.error(value, "is not a string; write it in quotes")
    if not value.strip():
        raise ConfigError(f"{origin.where} is empty; give a value, or leave the key out")
    return value


def _path(value: object, origin: _Origin) -> Path:
    return value if isinstance(value, Path) else Path(_text(value, origin))


def _bool(value: object, origin: _Origin) -> bool:
    if isinstance(value, bool):
        return value
    if origin.from_env and isinstance(value, str):
        word = value.strip().lower()
        if word in ("true", "1", "yes", "on"):
            return True
        if word in ("false", "0", "no", "off"):
            return False
        raise origin.error(value, "is not true or false; write true or false")
    raise origin.error(value, "is not true or false; write true or false, without quotes")


def _count(value: object, origin: _Origin) -> int:
    if origin.from_env and isinstance(value, str) and re.fullmatch(r"[0-9]+", value.strip()):
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise origin.error(value, "is not a whole number; write it like 3")
    if value < 0:
        raise origin.error(value, "is negative; write 0 or more")
    return value


def _positive_count(value: object, origin: _Origin) -> int:
    count = _count(value, origin)
    if count < 1:
        raise origin.error(value, "is not 1 or more; write a whole number like 8")
    return count


def _size(value: object, origin: _Origin) -> int:
    return _parse_size(value, origin.key, origin.source)


def _chunk_size(value: object, origin: _Origin) -> int:
    size = _parse_size(value, origin.key, origin.source)
    if size <= 0 or size % mmap.PAGESIZE:
        raise origin.error(
            value,
            f"is not a positive multiple of the page size ({format_size(mmap.PAGESIZE)}), "
            "which chunks need to be mapped side by side; write it like '4MiB'",
        )
    return size


def _duration(value: object, origin: _Origin) -> float:
    return _parse_duration(value, origin.key, origin.source)


def _positive_duration(value: object, origin: _Origin) -> float:
    seconds = _parse_duration(value, origin.key, origin.source)
    if seconds <= 0:
        raise origin.error(value, f"is not more than 0 seconds; {_DURATION_HINT}")
    return seconds


def _revalidate(value: object, origin: _Origin) -> float | None:
    if value is None or (isinstance(value, str) and value.strip() == "immutable"):
        return None
    try:
        return _parse_duration(value, origin.key, origin.source)
    except ConfigError:
        raise origin.error(
            value, "is neither 'immutable' nor a duration; write 'immutable', or like '5m'"
        ) from None


def _choice(*options: str) -> _Convert:
    def convert(value: object, origin: _Origin) -> str:
        if value not in options:
            listed = ", ".join(repr(option) for option in options)
            raise origin.error(value, f"is not one of {listed}; write one of those")
        return str(value)

    return convert


def _enum(kind: type[Enum]) -> _Convert:
    check = _choice(*(str(member.value) for member in kind))

    def convert(value: object, origin: _Origin) -> Enum:
        return kind(check(value, origin))

    return convert


def _secret(value: object, origin: _Origin) -> Secret:
    if isinstance(value, Secret):
        secret = value
    elif isinstance(value, str):
        secret = Secret(value)
    else:
        # The value is not shown: it may be the secret itself, mistyped.
        raise ConfigError(f"{origin.where} is not a string; write the secret in quotes")
    if not secret.reveal():
        raise ConfigError(f"{origin.where} is empty; give the secret, or leave the key out")
    return secret


def _socket_mode(value: object, origin: _Origin) -> int:
    hint = "write it as a string like '0660', or as TOML octal 0o660"
    if isinstance(value, str):
        digits = value.strip().lower().removeprefix("0o")
        if not re.fullmatch(r"[0-7]{1,4}", digits):
            raise origin.error(value, f"is not an octal permission mode; {hint}")
        mode = int(digits, 8)
    elif isinstance(value, int) and not isinstance(value, bool):
        mode = value
    else:
        raise origin.error(value, f"is not a permission mode; {hint}")
    if not 0 <= mode <= 0o777:
        raise origin.error(value, f"is not a permission mode from 0 to 0777; {hint}")
    return mode


_HOST_RE: Final = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?\.?")
_LISTEN_HINT: Final = "write host:port, like '127.0.0.1:8470', '0.0.0.0:8470' or '[::1]:8470'"


def _split_listen(text: str) -> tuple[str, int]:
    """``host:port`` (IPv6 in brackets) as (host without brackets, port).

    Raises:
        ValueError: the problem, worded for a message.
    """
    if text.startswith("["):
        host, bracket, port_text = text[1:].partition("]")
        if not bracket or not port_text.startswith(":"):
            raise ValueError(f"is not [IPv6 address]:port; {_LISTEN_HINT}")
        port_text = port_text[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(
                f"has {host!r} in brackets, not an IPv6 address; {_LISTEN_HINT}"
            ) from None
    else:
        host, colon, port_text = text.rpartition(":")
        if not colon:
            raise ValueError(f"has no port; {_LISTEN_HINT}")
        if ":" in host:
            raise ValueError("has an IPv6 address without brackets; write it like '[::1]:8470'")
        if not host:
            raise ValueError(
                "has no host; write '0.0.0.0:8470' for every interface, or "
                "'127.0.0.1:8470' for this node only"
            )
        if not _HOST_RE.fullmatch(host):
            raise ValueError(f"has {host!r}, not a host name or address; {_LISTEN_HINT}")
        if re.fullmatch(r"[0-9.]+", host):
            try:
                ipaddress.IPv4Address(host)
            except ValueError:
                raise ValueError(f"has {host!r}, not an IPv4 address; {_LISTEN_HINT}") from None
    if not re.fullmatch(r"[0-9]{1,5}", port_text) or int(port_text) > 65535:
        raise ValueError(f"has no port from 0 to 65535; {_LISTEN_HINT}")
    return host, int(port_text)


def _listen(value: object, origin: _Origin) -> str:
    text = _text(value, origin)
    try:
        _split_listen(text)
    except ValueError as exc:
        raise origin.error(value, str(exc)) from None
    return text


_SCHEMES: Final = ("s3", "gs", "az", "file", "memory")
_CLOUD_SCHEMES: Final = ("s3", "gs", "az")
_URL_HINT: Final = (
    "write it like 's3://bucket/prefix', 'gs://bucket', 'az://container/prefix', "
    "'file:///absolute/dir' or 'memory://'"
)
_BUCKET_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _hide_userinfo(url: str) -> str:
    """``url`` with any ``user:password@`` replaced, for error messages."""
    scheme, sep, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = "***@" + authority.rpartition("@")[2]
    return f"{scheme}{sep}{authority}{slash}{path}"


def _url_problem(url: str) -> str | None:
    scheme, sep, rest = url.partition("://")
    if not sep:
        return f"is not a URL; {_URL_HINT}"
    if scheme not in _SCHEMES:
        return f"has scheme {scheme!r}; chunkd knows s3, gs, az, file and memory; {_URL_HINT}"
    if scheme == "file":
        if not rest.startswith("/"):
            return "is not an absolute file URL; write it like 'file:///data/chunkd'"
        if ".." in rest.split("/"):
            return "has '..' in its path; write the directory without it"
        return None
    if scheme == "memory":
        if rest and not rest.startswith("/"):
            return "names a bucket, which memory backends have none of; write 'memory://'"
        return None
    parts = urlsplit(url)
    if "@" in parts.netloc:
        return (
            "has credentials in it; put them in access_key_id and secret_access_key, "
            "and write the URL like 's3://bucket/prefix'"
        )
    if not parts.netloc:
        return f"has no bucket; {_URL_HINT}"
    if not _BUCKET_RE.fullmatch(parts.netloc):
        return f"has {parts.netloc!r}, not a bucket name; {_URL_HINT}"
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        return "has a query or fragment; give options as keys of the backend instead"
    if ".." in parts.path.split("/"):
        return "has '..' in its prefix; write the prefix without it"
    return None


def _url(value: object, origin: _Origin) -> str:
    text = _text(value, origin)
    problem = _url_problem(text)
    if problem is not None:
        raise origin.error(_hide_userinfo(text), problem)
    return text


def _endpoint(value: object, origin: _Origin) -> str:
    text = _text(value, origin)
    parts = urlsplit(text)
    hint = "write it like 'https://storage.example.com' or 'http://127.0.0.1:9000'"
    problem = None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        problem = f"is not an http:// or https:// URL; {hint}"
    elif "@" in parts.netloc:
        problem = "has credentials in it; put them in access_key_id and secret_access_key"
    elif parts.query or parts.fragment:
        problem = f"has a query or fragment; {hint}"
    if problem is not None:
        raise origin.error(_hide_userinfo(text), problem)
    return text


_NAME_RE: Final = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")


def _name(value: object, origin: _Origin) -> str:
    text = _text(value, origin)
    if not _NAME_RE.fullmatch(text):
        raise origin.error(
            value,
            "is not a backend name: 1 to 63 lowercase letters, digits, '-' or '_', "
            "starting with a letter or digit (users write it first in 'NAME/KEY')",
        )
    return text


_LOG_LEVELS: Final = ("debug", "info", "warning", "error", "critical")

# The keys of each section, in the order the docs list them, with their converters.
_SERVER_KEYS: Final[dict[str, _Convert]] = {
    "listen": _listen,
    "socket": _path,
    "socket_mode": _socket_mode,
    "socket_group": _text,
    "shutdown_timeout": _duration,
    "log_format": _choice("json", "text"),
    "log_level": _choice(*_LOG_LEVELS),
    "token": _secret,
    "prefetch_in_flight": _positive_count,
    "prefetch_per_client": _positive_count,
}
_CACHE_KEYS: Final[dict[str, _Convert]] = {
    "dir": _path,
    "ram_bytes": _size,
    "disk_bytes": _size,
    "disk_min_free_bytes": _size,
    "chunk_bytes": _chunk_size,
    "fsync": _enum(FsyncPolicy),
    "compress": _bool,
    "verify_reads": _bool,
    "write_policy": _enum(WritePolicy),
    "eviction": _choice("s3fifo", "lru"),
}
_BACKEND_KEYS: Final[dict[str, _Convert]] = {
    "name": _name,
    "url": _url,
    "endpoint": _endpoint,
    "region": _text,
    "access_key_id": _text,
    "secret_access_key": _secret,
    "session_token": _secret,
    "allow_http": _bool,
    "writable": _bool,
    "revalidate": _revalidate,
    "timeout": _positive_duration,
    "retries": _count,
    "list_revalidate": _duration,
    "stale_if_error": _duration,
}


def _members(value: object, origin: _Origin) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise origin.error(value, "must be a list of host:port strings")
    members = []
    for item in items:
        text = str(item).strip()
        if text:
            members.append(_listen(text, origin))
    return tuple(members)


_PEERS_KEYS: Final[dict[str, _Convert]] = {
    "self": _listen,
    "members": _members,
    "members_file": _path,
    "dns": _listen,
    "token_file": _path,
    "timeout": _positive_duration,
    "health_interval": _positive_duration,
    "down_after": _count,
    "up_after": _count,
    "tls_cert": _path,
    "tls_key": _path,
    "tls_ca": _path,
}
_PEERS_TLS_KEYS: Final = ("tls_cert", "tls_key", "tls_ca")

# Keys whose default is None (unset): an empty environment value unsets them.
_UNSETTABLE: Final = frozenset(
    (
        "socket_group",
        "token",
        "endpoint",
        "region",
        "access_key_id",
        "secret_access_key",
        "session_token",
        "revalidate",
    )
)


def _normalize(obj: object, keys: Mapping[str, _Convert], source: str) -> None:
    """Check (and convert in place) the fields of a frozen config dataclass."""
    for name, convert in keys.items():
        value = getattr(obj, name)
        if value is None and name in _UNSETTABLE:
            continue
        object.__setattr__(obj, name, convert(value, _Origin(source, name)))


def _backend_rules(values: Mapping[str, Any], where: Callable[[str], str]) -> None:
    """Checks across the keys of one backend; ``where(key)`` names a key in messages.

    They apply to s3, gs and az backends: a file or memory backend ignores the
    endpoint, region, credentials and ``allow_http``.
    """
    if str(values["url"]).partition("://")[0] not in _CLOUD_SCHEMES:
        return
    has_id = values.get("access_key_id") is not None
    has_secret = values.get("secret_access_key") is not None
    if has_id != has_secret:
        present, missing = (
            ("access_key_id", "secret_access_key")
            if has_id
            else ("secret_access_key", "access_key_id")
        )
        raise ConfigError(
            f"{where(present)} is set but {missing} is not; set both, or neither to use "
            "the credentials of the machine (instance role, provider environment)"
        )
    if values.get("session_token") is not None and not has_id:
        raise ConfigError(
            f"{where('session_token')} is set without access_key_id and secret_access_key; "
            "a session token goes with them: set all three"
        )
    endpoint = values.get("endpoint")
    if (
        isinstance(endpoint, str)
        and urlsplit(endpoint).scheme == "http"
        and not values.get("allow_http")
    ):
        raise ConfigError(
            f"{where('endpoint')} = {endpoint!r} is plain http, but allow_http is false; "
            "set allow_http = true for this backend, or use https"
        )


# -- the config ---------------------------------------------------------------------


@dataclass(frozen=True)
class ServerConfig:
    """The ``[server]`` section. Every field has the default shown.

    Fields are checked (and strings such as ``socket_mode="0660"`` converted) when
    the object is made; a bad value raises :class:`~chunkd.errors.ConfigError`.
    """

    #: HTTP listener, "host:port"; IPv6 in brackets, "[::1]:8470"
    listen: str = "127.0.0.1:8470"
    #: the local socket trainers on this node connect to
    socket: Path = Path("/run/chunkd/chunkd.sock")
    #: permissions of the local socket (TOML "0660" or 0o660)
    socket_mode: int = 0o660
    #: group that owns the local socket; None: the daemon's own group
    socket_group: str | None = None
    #: seconds a stop waits for requests in flight (TOML: a duration)
    shutdown_timeout: float = 10.0
    #: "json" (one object a line) or "text"
    log_format: str = "json"
    #: "debug", "info", "warning", "error" or "critical"
    log_level: str = "info"
    #: shared secret non-loopback clients must send on data routes (never shown);
    #: None: data routes answer loopback clients only
    token: Secret | None = None
    #: objects loaded at once for ``prefetch`` and ``chunkd warm``, all clients together
    prefetch_in_flight: int = 64
    #: of those, at once for one client, a user of the node by uid (its other names wait)
    prefetch_per_client: int = 8

    def __post_init__(self) -> None:
        _normalize(self, _SERVER_KEYS, "ServerConfig")

    @property
    def host(self) -> str:
        """The host part of :attr:`listen`, without brackets: ``"::1"``, ``"0.0.0.0"``."""
        return _split_listen(self.listen)[0]

    @property
    def port(self) -> int:
        """The port of :attr:`listen`."""
        return _split_listen(self.listen)[1]


@dataclass(frozen=True)
class PeersConfig:
    """The ``[peers]`` section. Every field has the default shown; no ``self``: no peers."""

    #: this node's address as the others reach it ("host:port"); TOML key ``self``
    address: str | None = None
    #: a static member list ("host:port" each; this node may be in it)
    members: tuple[str, ...] = ()
    #: a file of members, one "host:port" a line, re-read when it changes
    members_file: Path | None = None
    #: "name:port": the name's A/AAAA records are members, re-resolved as it goes
    dns: str | None = None
    #: the file holding the shared secret every peer request carries
    token_file: Path | None = None
    #: seconds of silence before a peer being asked is probed (a failed probe: the
    #: next owner is tried); also the connect timeout
    timeout: float = 2.0
    #: seconds between two health probes of a peer
    health_interval: float = 1.0
    #: failed probes in a row before a peer is marked down
    down_after: int = 3
    #: passed probes in a row before a down peer is up again
    up_after: int = 2
    #: this node's certificate chain, PEM (its certificate first; its SANs name the
    #: host of ``address``); with tls_key and tls_ca: the HTTP port serves HTTPS only
    #: and peers talk HTTPS, see :mod:`chunkd.gateway.tls`. None: plain HTTP
    tls_cert: Path | None = None
    #: the private key of tls_cert, PEM, unencrypted
    tls_key: Path | None = None
    #: the CA bundle, PEM, that peers' certificates (server and client) must chain to
    tls_ca: Path | None = None

    @property
    def enabled(self) -> bool:
        """Whether this node shares chunks with peers."""
        return self.address is not None

    @property
    def tls_enabled(self) -> bool:
        """Whether the HTTP port and the peer requests use TLS."""
        return self.tls_cert is not None


@dataclass(frozen=True)
class BackendConfig:
    """One ``[[backends]]`` table. Every field but ``name`` and ``url`` has the default shown.

    Fields are checked when the object is made, each alone and together (credentials
    go in pairs; a file or memory backend takes no endpoint); a bad value raises
    :class:`~chunkd.errors.ConfigError`.
    """

    #: the backend's name, first part of object names ("NAME/KEY"); [a-z0-9][a-z0-9_-]{0,62}
    name: str
    #: where objects live: s3://bucket/prefix, gs://..., az://..., file:///dir, memory://
    url: str
    #: custom endpoint of an S3-compatible (or other) service; None: the provider's own
    endpoint: str | None = None
    #: the bucket's region; None: the client library's default
    region: str | None = None
    #: access key id; None (with secret_access_key None): the machine's credentials
    access_key_id: str | None = None
    #: secret access key (never shown)
    secret_access_key: Secret | None = None
    #: session token for temporary credentials (never shown)
    session_token: Secret | None = None
    #: allow a plain http:// endpoint
    allow_http: bool = False
    #: checkpoints and other writes may go to this backend
    writable: bool = False
    #: seconds after which an object's version is re-checked; None: "immutable", never
    revalidate: float | None = None
    #: seconds a backend may stay silent in a read over HTTP: waiting for a response,
    #: or between two reads of a body (which may take longer in all); writes, HEADs,
    #: lists and file:// reads must end within it (TOML: a duration)
    timeout: float = 30.0
    #: retries of a failed backend request
    retries: int = 3
    #: seconds a listing is answered from the daemon's memory; 0: always asked
    list_revalidate: float = 30.0
    #: seconds after its last successful check that a cached object is still served,
    #: marked stale, while its version cannot be re-checked (RFC 5861
    #: ``stale-if-error``); only for a duration ``revalidate``; 0: never
    stale_if_error: float = 86400.0

    def __post_init__(self) -> None:
        source = f"BackendConfig {self.name!r}"
        _normalize(self, _BACKEND_KEYS, source)
        _backend_rules(
            {f.name: getattr(self, f.name) for f in fields(self)},
            lambda key: _where(source, key),
        )

    @property
    def scheme(self) -> str:
        """The URL scheme: ``"s3"``, ``"gs"``, ``"az"``, ``"file"`` or ``"memory"``."""
        return self.url.partition("://")[0]

    @property
    def bucket(self) -> str | None:
        """The bucket (or container) of an s3, gs or az URL; None for file and memory."""
        if self.scheme not in _CLOUD_SCHEMES:
            return None
        return urlsplit(self.url).netloc

    @property
    def prefix(self) -> str:
        """Where keys start inside the backend.

        For s3, gs, az (and memory) the URL path without leading or trailing
        slashes (``""`` for a whole bucket); for file the absolute directory, taken
        literally (no percent-decoding).
        """
        rest = self.url.partition("://")[2]
        if self.scheme == "file":
            return rest.rstrip("/") or "/"
        if self.scheme == "memory":
            return rest.strip("/")
        return urlsplit(self.url).path.strip("/")

    @property
    def immutable(self) -> bool:
        """Whether object versions are never re-checked (``revalidate`` is None)."""
        return self.revalidate is None


@dataclass(frozen=True)
class Config:
    """The whole configuration of one daemon. Build it with :func:`load_config`."""

    #: the [server] section
    server: ServerConfig
    #: the [cache] section (dir defaults to /var/cache/chunkd in a file)
    cache: CacheConfig
    #: the [[backends]], in file order; also the allowlist of reachable backends
    backends: tuple[BackendConfig, ...]
    #: the file it was read from, or "embedded default"
    source: str
    #: the [peers] section (disabled when absent)
    peers: PeersConfig = PeersConfig()

    def __post_init__(self) -> None:
        object.__setattr__(self, "backends", tuple(self.backends))
        seen: set[str] = set()
        for backend in self.backends:
            if backend.name in seen:
                raise ConfigError(
                    f"{self.source}: backend name {backend.name!r} is used twice; "
                    "give each backend its own name"
                )
            seen.add(backend.name)

    def backend(self, name: str) -> BackendConfig | None:
        """The backend called ``name``, or None if there is none."""
        for backend in self.backends:
            if backend.name == name:
                return backend
        return None

    def redacted(self) -> dict[str, Any]:
        """A JSON-able view for ``/v1/stats`` and logs, with nothing secret in it.

        Every :class:`Secret` shows as ``"***"`` (an unset one as None). An
        ``access_key_id`` shows as the AWS CLI shows it, sixteen ``*`` and its last
        four characters (``"****************WXYZ"``; only the stars for a key of
        eight characters or fewer): enough to tell which key is in use, not to use
        it. Paths and enums are strings, ``socket_mode`` is octal text like ``"0660"``
        and a ``revalidate`` of None is ``"immutable"``, as one would write them in
        TOML.
        """
        server = _plain(self.server)
        server["socket_mode"] = f"{self.server.socket_mode:04o}"
        backends = []
        for backend in self.backends:
            view = _plain(backend)
            if backend.revalidate is None:
                view["revalidate"] = "immutable"
            if (key_id := backend.access_key_id) is not None:
                view["access_key_id"] = "*" * 16 + (key_id[-4:] if len(key_id) > 8 else "")
            backends.append(view)
        return {
            "source": self.source,
            "server": server,
            "cache": _plain(self.cache),
            "backends": backends,
            "peers": _plain(self.peers),
        }


def _plain(obj: object) -> dict[str, Any]:
    return {f.name: _jsonable(getattr(obj, f.name)) for f in fields(obj)}  # type: ignore[arg-type]


def _jsonable(value: object) -> Any:
    if isinstance(value, Secret):
        return "***"
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, Enum):
        return _jsonable(value.value)
    if isinstance(value, str | Path):
        return str(value)
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    if is_dataclass(value) and not isinstance(value, type):
        return _plain(value)
    return str(value)


# -- loading ------------------------------------------------------------------------


@dataclass
class _Setting:
    value: object
    origin: _Origin


@dataclass
class _Document:
    """A config before conversion: raw values, each with where it came from."""

    source: str
    server: dict[str, _Setting]
    cache: dict[str, _Setting]
    #: (name, table) per backend, in order
    backends: list[tuple[str, dict[str, _Setting]]]
    peers: dict[str, _Setting] = field(default_factory=dict)


def _did_you_mean(word: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _read_toml(source: str) -> dict[str, Any]:
    try:
        data = Path(source).read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"{source}: cannot read the config file ({exc.strerror or exc}); check the path "
            "(run without --config for the embedded default)"
        ) from exc
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: is not UTF-8 text; save the config file as UTF-8") from exc
    except tomllib.TOMLDecodeError as exc:
        line = re.search(r"at line (\d+)", str(exc))
        at = f" at line {line[1]}" if line else ""
        raise ConfigError(f"{source}: not valid TOML{at}: {exc}; fix the file there") from exc


def _section(
    doc: Mapping[str, Any], name: str, keys: Mapping[str, _Convert], source: str
) -> dict[str, _Setting]:
    table = doc.get(name, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: {name} is not a table; write it as a [{name}] section")
    settings = {}
    for key, value in table.items():
        if key not in keys:
            raise ConfigError(
                f"{source}: [{name}] has no key {key!r}{_did_you_mean(key, keys)} "
                f"(the keys of [{name}]: {', '.join(keys)})"
            )
        settings[key] = _Setting(value, _Origin(source, f"[{name}] {key}"))
    return settings


def _document_from_toml(doc: Mapping[str, Any], source: str) -> _Document:
    sections = {
        "server": _SERVER_KEYS,
        "cache": _CACHE_KEYS,
        "backends": _BACKEND_KEYS,
        "peers": _PEERS_KEYS,
    }
    for key, value in doc.items():
        if key in sections:
            continue
        if isinstance(value, dict | list):
            raise ConfigError(
                f"{source}: unknown section [{key}]{_did_you_mean(key, sections)} "
                "(the sections: [server], [cache], [[backends]], [peers])"
            )
        homes = [
            "[[backends]]" if name == "backends" else f"[{name}]"
            for name, keys in sections.items()
            if key in keys
        ]
        home = f"; it belongs under {homes[0]}" if homes else ""
        raise ConfigError(f"{source}: unknown key {key!r} outside any section{home}")
    server = _section(doc, "server", _SERVER_KEYS, source)
    cache = _section(doc, "cache", _CACHE_KEYS, source)
    tables = doc.get("backends", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(
            f"{source}: backends is not an array of tables; write [[backends]] "
            "(two brackets) above each backend"
        )
    backends: list[tuple[str, dict[str, _Setting]]] = []
    first_seen: dict[str, int] = {}
    for number, table in enumerate(tables, start=1):
        label = f"[[backends]] #{number}"
        if "name" not in table:
            raise ConfigError(f'{source}: {label} has no name; add name = "..." to it')
        name = _name(table["name"], _Origin(source, f"{label} name"))
        if name in first_seen:
            raise ConfigError(
                f"{source}: {label} name = {name!r} is taken by [[backends]] "
                f"#{first_seen[name]}; give each backend its own name"
            )
        first_seen[name] = number
        label = f"[[backends]] {name!r}"
        settings = {}
        for key, value in table.items():
            if key not in _BACKEND_KEYS:
                raise ConfigError(
                    f"{source}: {label} has no key {key!r}{_did_you_mean(key, _BACKEND_KEYS)} "
                    f"(the keys of a backend: {', '.join(_BACKEND_KEYS)})"
                )
            settings[key] = _Setting(value, _Origin(source, f"{label} {key}"))
        if "url" not in settings:
            raise ConfigError(
                f'{source}: {label} has no url; add one, like url = "s3://bucket/prefix" '
                "(or gs://, az://, file:///dir, memory://)"
            )
        backends.append((name, settings))
    return _Document(source, server, cache, backends, _section(doc, "peers", _PEERS_KEYS, source))


def _embedded_document(cwd: Path) -> _Document:
    source = _EMBEDDED

    def table(section: str, values: Mapping[str, object]) -> dict[str, _Setting]:
        return {k: _Setting(v, _Origin(source, f"{section} {k}")) for k, v in values.items()}

    return _Document(
        source,
        server=table("[server]", {"listen": "127.0.0.1:8470", "socket": str(cwd / "chunkd.sock")}),
        cache=table(
            "[cache]",
            {
                "dir": str(cwd / "chunkd-cache"),
                "ram_bytes": 1 * _GiB,
                "disk_bytes": 10 * _GiB,
                "disk_min_free_bytes": 1 * _GiB,
            },
        ),
        backends=[
            (
                "local",
                table(
                    "[[backends]] 'local'",
                    # A directory the user edits by hand: writable (checkpoints work
                    # out of the box), and files are re-checked after a second.
                    {
                        "name": "local",
                        "url": _embedded_data_url(cwd),
                        "writable": True,
                        "revalidate": 1.0,
                    },
                ),
            )
        ],
    )


def _embedded_data_url(cwd: Path) -> str:
    return f"file://{cwd / 'chunkd-data'}"


_SECTION_PREFIXES: Final = {
    "CHUNKD_SERVER_": ("server", _SERVER_KEYS),
    "CHUNKD_CACHE_": ("cache", _CACHE_KEYS),
    "CHUNKD_PEERS_": ("peers", _PEERS_KEYS),
}
_BACKENDS_PREFIX: Final = "CHUNKD_BACKENDS_"


def _env_name(backend: str) -> str:
    return backend.upper().replace("-", "_")


def _apply_environment(doc: _Document, environ: Mapping[str, str]) -> None:
    """Apply ``CHUNKD_SERVER_*``, ``CHUNKD_CACHE_*`` and ``CHUNKD_BACKENDS_*`` to ``doc``."""
    for var in sorted(environ):
        value = environ[var]
        origin = _Origin(_ENVIRONMENT, var)
        for prefix, (section, keys) in _SECTION_PREFIXES.items():
            if var.startswith(prefix):
                key = var[len(prefix) :].lower()
                if key not in keys:
                    raise ConfigError(
                        f"environment {var}: [{section}] has no key {key!r}"
                        f"{_did_you_mean(key, keys)} (the keys of [{section}]: "
                        f"{', '.join(keys)}); fix the variable's name or unset it"
                    )
                _set(getattr(doc, section), key, _Setting(value, origin))
        if var.startswith(_BACKENDS_PREFIX):
            table, key = _backend_target(doc, var)
            _set(table, key, _Setting(value, origin))


def _set(table: dict[str, _Setting], key: str, setting: _Setting) -> None:
    if setting.value == "" and key in _UNSETTABLE:
        table.pop(key, None)
    else:
        table[key] = setting


def _backend_target(doc: _Document, var: str) -> tuple[dict[str, _Setting], str]:
    """The backend table and key a ``CHUNKD_BACKENDS_<NAME>_<KEY>`` variable names."""
    rest = var[len(_BACKENDS_PREFIX) :]
    names = ", ".join(repr(name) for name, _ in doc.backends)
    matches = []
    for name, table in doc.backends:
        head = _env_name(name) + "_"
        if rest.upper().startswith(head):
            matches.append((name, table, rest[len(head) :].lower()))
    known = [m for m in matches if m[2] in _BACKEND_KEYS]
    if len(known) > 1:
        raise ConfigError(
            f"environment {var} could mean backend {known[0][0]!r} or {known[1][0]!r}; "
            "rename one of them so their names differ in more than '-' and '_'"
        )
    if not known:
        if matches:
            name, _, key = max(matches, key=lambda m: len(m[0]))
            raise ConfigError(
                f"environment {var}: backend {name!r} has no key {key!r}"
                f"{_did_you_mean(key, _BACKEND_KEYS)} (the keys of a backend: "
                f"{', '.join(_BACKEND_KEYS)}); fix the variable's name or unset it"
            )
        raise ConfigError(
            f"environment {var} names no configured backend (backends: {names}); "
            "write CHUNKD_BACKENDS_<NAME>_<KEY> for a backend of the config, or unset it"
        )
    name, table, key = known[0]
    if key == "name":
        raise ConfigError(
            f"environment {var}: a backend cannot be renamed from the environment; "
            f"change name = {name!r} in the config file, or unset the variable"
        )
    return table, key


def _convert(table: Mapping[str, _Setting], keys: Mapping[str, _Convert]) -> dict[str, Any]:
    return {key: keys[key](s.value, s.origin) for key, s in table.items()}


def _absolute(path: Path, cwd: Path) -> Path:
    return path if path.is_absolute() else cwd / path


def _origin_of(table: Mapping[str, _Setting]) -> Callable[[str], str]:
    def where(key: str) -> str:
        return table[key].origin.where

    return where


def _build(doc: _Document, cwd: Path) -> Config:
    server = _convert(doc.server, _SERVER_KEYS)
    if "socket" in server:
        server["socket"] = _absolute(server["socket"], cwd)
    cache = {"dir": _DEFAULT_CACHE_DIR, **_convert(doc.cache, _CACHE_KEYS)}
    cache["dir"] = _absolute(cache["dir"], cwd)
    if not doc.backends:
        raise ConfigError(
            f"{doc.source}: has no [[backends]]; chunkd serves configured backends only, "
            'so add one: a [[backends]] table with name = "data" and url = "s3://bucket/prefix"'
        )
    backends = []
    for _, table in doc.backends:
        values = _convert(table, _BACKEND_KEYS)
        _backend_rules(values, _origin_of(table))
        backends.append(BackendConfig(**values))
    peers = _convert(doc.peers, _PEERS_KEYS)
    for key in ("members_file", "token_file", *_PEERS_TLS_KEYS):
        if key in peers:
            peers[key] = _absolute(peers[key], cwd)
    if "self" in peers:
        peers["address"] = peers.pop("self")
    elif peers:
        raise ConfigError(
            f'{doc.source}: [peers] has no self; add self = "HOST:PORT" (this node\'s '
            "address as the other nodes reach it)"
        )
    if peers and "token_file" not in peers:
        raise ConfigError(
            f"{doc.source}: [peers] has no token_file; peers authenticate each other with a "
            'shared secret, so add token_file = "/etc/chunkd/token"'
        )
    tls = [key for key in _PEERS_TLS_KEYS if key in peers]
    if tls and len(tls) < len(_PEERS_TLS_KEYS):
        missing = " or ".join(key for key in _PEERS_TLS_KEYS if key not in peers)
        given = " and ".join(
            f"{key} (from {origin.key})" if (origin := doc.peers[key].origin).from_env else key
            for key in tls
        )
        raise ConfigError(
            f"{doc.source}: [peers] has {given} but no {missing}; TLS needs all three: "
            "tls_cert (this node's certificate), tls_key (its key) and tls_ca (the CA the "
            "peers' certificates chain to), or none for plain HTTP"
        )
    return Config(
        server=ServerConfig(**server),
        cache=CacheConfig(**cache),
        backends=tuple(backends),
        source=doc.source,
        peers=PeersConfig(**peers),
    )


def _make_data_dir(config: Config, cwd: Path) -> None:
    local = config.backend("local")
    if local is None or local.url != _embedded_data_url(cwd):
        return
    try:
        Path(local.prefix).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"{_EMBEDDED}: cannot create the data directory {local.prefix} "
            f"({exc.strerror or exc}); run chunkd from a writable directory, or give "
            "it a config file"
        ) from exc


def embedded_default(cwd: Path) -> Config:
    """The configuration ``chunkd serve`` runs on without a file.

    One writable backend ``local`` at ``file://{cwd}/chunkd-data`` (this function
    creates the directory if it is missing; files there are re-checked after a
    second), the cache in ``{cwd}/chunkd-cache`` sized for a laptop (1 GiB of RAM,
    10 GiB of disk, 1 GiB left free), the local socket ``{cwd}/chunkd.sock`` and
    HTTP on ``127.0.0.1:8470``. No environment overrides: :func:`load_config` with
    no path applies them.

    Raises:
        ConfigError: the data directory cannot be created.
    """
    cwd = Path(os.path.abspath(cwd))
    config = _build(_embedded_document(cwd), cwd)
    _make_data_dir(config, cwd)
    return config


def load_config(
    path: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Config:
    """Read the configuration: a TOML file (or the embedded default), then overrides.

    See the module docstring for every key, its default, and the environment rules.

    Args:
        path: the TOML file; None for :func:`embedded_default`.
        environ: where ``CHUNKD_*`` overrides come from; None: ``os.environ``.
        cwd: the directory relative paths start from (and the embedded default
            lives in); None: the process's working directory.

    Returns:
        The checked configuration. Its ``source`` is ``str(path)`` or
        ``"embedded default"``.

    Raises:
        ConfigError: the file is missing, unreadable or not valid TOML (the message
            names the path, and the line for TOML errors); a section, key or
            variable is unknown, or a value is wrong (the message names the key and
            the file, or the variable).
    """
    base = Path(os.path.abspath(cwd if cwd is not None else Path.cwd()))
    if path is None:
        doc = _embedded_document(base)
    else:
        source = str(path)
        doc = _document_from_toml(_read_toml(source), source)
    _apply_environment(doc, os.environ if environ is None else environ)
    config = _build(doc, base)
    if path is None:
        _make_data_dir(config, base)
    return config
