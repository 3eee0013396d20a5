"""Values that name a place: ``host:port`` addresses, backend URLs, endpoints, names.

Each is a :class:`~chunkd.gateway.config.values.Kind` like the ones in ``values``;
they live here because their checks (IPv4/IPv6, schemes) are a job of their own. A
backend URL's own rules (buckets, paths) are its kind's
(:mod:`chunkd.gateway.config.kinds`).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Final
from urllib.parse import urlsplit

from chunkd.gateway.config.kinds import kind_of, schemes, url_hint
from chunkd.gateway.config.values import Kind, Origin, parse_text

__all__ = [
    "ENDPOINT",
    "LISTEN",
    "MAX_LABELS",
    "MEMBERS",
    "NAME",
    "URL",
    "is_loopback",
    "split_listen",
    "split_member",
]

_HOST_RE: Final = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?\.?")
_LISTEN_HINT: Final = "write host:port, like '127.0.0.1:8470', '0.0.0.0:8470' or '[::1]:8470'"


def split_listen(text: str) -> tuple[str, int]:
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


def _listen(value: object, origin: Origin) -> str:
    text = parse_text(value, origin)
    try:
        split_listen(text)
    except ValueError as exc:
        raise origin.error(value, str(exc)) from None
    return text


def _hide_userinfo(url: str) -> str:
    """``url`` with any ``user:password@`` replaced, for error messages."""
    scheme, sep, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = "***@" + authority.rpartition("@")[2]
    return f"{scheme}{sep}{authority}{slash}{path}"


def _url_problem(url: str) -> str | None:
    """What is wrong with a backend URL: its form here, the rest by its kind's rules."""
    scheme, sep, _ = url.partition("://")
    if not sep:
        return f"is not a URL; {url_hint()}"
    kind = kind_of(scheme)
    if kind is None:
        known = schemes()
        return (
            f"has scheme {scheme!r}; chunkd knows {', '.join(known[:-1])} and {known[-1]}; "
            f"{url_hint()}"
        )
    return kind.url_problem(url)


def _url(value: object, origin: Origin) -> str:
    text = parse_text(value, origin)
    problem = _url_problem(text)
    if problem is not None:
        raise origin.error(_hide_userinfo(text), problem)
    return text


def _endpoint(value: object, origin: Origin) -> str:
    text = parse_text(value, origin)
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


def _name(value: object, origin: Origin) -> str:
    text = parse_text(value, origin)
    if not _NAME_RE.fullmatch(text):
        raise origin.error(
            value,
            "is not a backend name: 1 to 63 lowercase letters, digits, '-' or '_', "
            "starting with a letter or digit (users write it first in 'NAME/KEY')",
        )
    return text


#: labels one member may carry (``rack=R``, ...)
MAX_LABELS: Final = 8
_LABEL_KEY_RE: Final = re.compile(r"[a-z][a-z0-9_-]{0,31}")
_LABEL_VALUE_RE: Final = re.compile(r"[A-Za-z0-9._-]{1,63}")
_MEMBER_HINT: Final = "write host:port, then labels like 'rack=r1', e.g. '10.0.0.7:8470 rack=r1'"


def split_member(text: str) -> tuple[str, dict[str, str]]:
    """A member entry, ``host:port`` then labels ``key=value`` separated by spaces
    (``"10.0.0.7:8470 rack=r1"``), as (address, labels).

    The label ``rack`` names the member's failure domain (replica placement,
    ``docs/replicas.md``); a member without it is a domain of its own. At most
    :data:`MAX_LABELS` labels; keys ``[a-z][a-z0-9_-]{0,31}``, values
    ``[A-Za-z0-9._-]{1,63}``.

    Raises:
        ValueError: the problem, worded for a message.
    """
    address, *words = text.split()
    split_listen(address)
    labels: dict[str, str] = {}
    for word in words:
        key, eq, value = word.partition("=")
        if not eq or not _LABEL_KEY_RE.fullmatch(key) or not _LABEL_VALUE_RE.fullmatch(value):
            raise ValueError(f"has {word[:80]!r}, not a label key=value; {_MEMBER_HINT}")
        if key in labels:
            raise ValueError(f"names label {key!r} twice")
        labels[key] = value
    if len(labels) > MAX_LABELS:
        raise ValueError(f"has {len(labels)} labels; a member has at most {MAX_LABELS}")
    return address, labels


def _member(text: str, origin: Origin) -> str:
    try:
        address, labels = split_member(text)
    except ValueError as exc:
        raise origin.error(text, str(exc)) from None
    return " ".join([address, *(f"{k}={v}" for k, v in labels.items())])


def _members(value: object, origin: Origin) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise origin.error(value, "must be a list of host:port strings (each may add labels)")
    members = []
    for item in items:
        text = str(item).strip()
        if text:
            members.append(_member(text, origin))
    return tuple(members)


#: host:port, IPv6 in brackets
LISTEN: Final = Kind(_listen)
#: a backend's URL, of a kind :mod:`chunkd.gateway.config.kinds` declares
URL: Final = Kind(_url)
#: an http:// or https:// endpoint
ENDPOINT: Final = Kind(_endpoint)
#: a backend name: [a-z0-9][a-z0-9_-]{0,62}
NAME: Final = Kind(_name)
#: a list of host:port, each maybe with labels (``"10.0.0.7:8470 rack=r1"``; from the
#: environment: comma-separated)
MEMBERS: Final = Kind(_members)


def is_loopback(address: str | None) -> bool:
    """Whether a client's address (``request.remote``) is this host's loopback; an
    IPv4-mapped IPv6 address counts as its IPv4 one, and no address (not TCP) never
    does: a door refuses rather than guess."""
    if not address:
        return False
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback
