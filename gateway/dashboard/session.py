"""Browser sessions for the pages, and the checks that keep a browser from being used
against the daemon (``docs/inspector.md``, "Access").

A browser cannot send ``Authorization: Bearer`` on a page load, an ``EventSource`` or
an ``<audio>`` range request, so ``POST /login`` exchanges ``server.token`` for a
cookie. The cookie is ``EXPIRY.MAC``, MAC the HMAC-SHA256 of ``chunkd-session:EXPIRY``
under the token: no state in the daemon, valid across restarts, void once the token
changes. It is honoured on GET and HEAD only, so no cross-site form can make the daemon
change anything with it (and SameSite=Strict keeps it off cross-site requests anyway).

:func:`browser_refusal` is the other half, for every request: a browser's own
``Sec-Fetch-Site`` and ``Origin`` headers say when a page of another site sent it, and
a request to a loopback daemon under a name that is not the daemon's is DNS rebinding
(a page whose name now points at 127.0.0.1).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import socket
import time
from typing import Final
from urllib.parse import urlsplit

from aiohttp import web

__all__ = [
    "COOKIE",
    "SESSION_SECONDS",
    "browser_refusal",
    "clear_cookie",
    "session_cookie",
    "valid_session",
]

COOKIE: Final = "chunkd_session"
SESSION_SECONDS: Final = 12 * 3600
_SAFE: Final = frozenset({"GET", "HEAD", "OPTIONS"})


def _mac(token: str, expiry: int) -> str:
    message = f"chunkd-session:{expiry}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def session_cookie(response: web.StreamResponse, token: str, *, secure: bool) -> None:
    """Set a new session cookie for ``token`` on ``response``."""
    expiry = int(time.time()) + SESSION_SECONDS
    response.set_cookie(
        COOKIE,
        f"{expiry}.{_mac(token, expiry)}",
        max_age=SESSION_SECONDS,
        path="/",
        httponly=True,
        secure=secure,
        samesite="Strict",
    )


def clear_cookie(response: web.StreamResponse, *, secure: bool) -> None:
    """Clear the session cookie on ``response``."""
    response.set_cookie(
        COOKIE, "", max_age=0, path="/", httponly=True, secure=secure, samesite="Strict"
    )


def valid_session(request: web.Request, token: str) -> bool:
    """Whether ``request`` carries an unexpired session cookie made with ``token``, on a
    safe method (GET, HEAD)."""
    if request.method not in _SAFE:
        return False
    value = request.cookies.get(COOKIE, "")
    expiry_text, _, mac = value.partition(".")
    if not expiry_text.isdigit() or len(expiry_text) > 12:
        return False
    expiry = int(expiry_text)
    if expiry < time.time():
        return False
    return hmac.compare_digest(mac.encode(), _mac(token, expiry).encode())


def browser_refusal(request: web.Request, *, loopback: bool, listen: str) -> str | None:
    """Why a browser's request must be refused, or None.

    - ``Sec-Fetch-Site: cross-site``: a page of another site sent it;
    - a state-changing method whose ``Origin`` is not this daemon's own;
    - from loopback, a ``Host`` that is none of this daemon's names (a loopback name or
      address, the node's host name, the host of ``listen``): DNS rebinding, a page
      whose name now points at 127.0.0.1. Browsers send no ``Sec-Fetch-*`` headers to
      such a page's plain-HTTP origin, so every loopback request is checked.
    """
    headers = request.headers
    if headers.get("Sec-Fetch-Site", "").lower() == "cross-site":
        return "a page of another site sent this request; open the daemon's own page"
    origin = headers.get("Origin")
    if (
        request.method not in _SAFE
        and origin is not None
        and _origin_host(origin) != request.host.lower()
    ):
        return f"a state-changing request from {origin!r}, not from this daemon's pages"
    if loopback and not _own_host(request.host, listen):
        return (
            f"this daemon answers loopback clients under its own names only, not as "
            f"{request.host!r}; use http://127.0.0.1:PORT/ or http://localhost:PORT/ "
            "(or an ssh tunnel)"
        )
    return None


def _origin_host(origin: str) -> str | None:
    """The host (and port) an ``Origin`` names; None for ``null`` or one that is not a URL
    (``http://[``), which no page of this daemon sends."""
    if origin == "null":
        return None
    try:
        return urlsplit(origin).netloc.lower()
    except ValueError:
        return None


@functools.cache
def _node_names() -> frozenset[str]:
    """The node's own host name, short and as set (no DNS: it must not block)."""
    name = socket.gethostname().lower()
    return frozenset({name, name.split(".", 1)[0]})


def _own_host(host: str, listen: str) -> bool:
    """Whether ``host`` (a Host header) names this daemon for a loopback client."""
    name = _host_name(host)
    if not name:
        return True  # HTTP/1.0 sends none: no browser page does that
    if name == "localhost" or name.endswith(".localhost"):
        return True
    if name in _node_names() or name == _host_name(listen):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _host_name(host: str) -> str:
    """The name of ``host:port`` (``[v6]:port`` too), lowercased, without the port."""
    name = host.strip().lower()
    if name.startswith("["):
        return name[1 : name.find("]")] if "]" in name else name
    if name.count(":") == 1:
        return name.rsplit(":", 1)[0]
    return name
