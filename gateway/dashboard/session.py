"""Browser sessions for the pages, and the checks that keep a browser from being used
against the daemon (``docs/inspector.md``, "Access").

A browser cannot send ``Authorization: Bearer`` on a page load, an ``EventSource`` or
an ``<audio>`` range request, so ``POST /login`` exchanges ``server.token`` for a
cookie. The cookie is ``EXPIRY.MAC``, MAC the HMAC-SHA256 of ``chunkd-session:EXPIRY``
under the token: no state in the daemon, valid across restarts, void once the token
changes. It is honoured on GET and HEAD only, so no cross-site form can make the daemon
change anything with it (and SameSite=Strict keeps it off cross-site requests anyway).
A cookie that is not exactly ASCII digits, a dot and 64 hex digits is no session.

:func:`login_form` reads the form ``POST /login`` sends, within bounds checked before a
byte of it is read: :data:`LOGIN_BODY_BYTES`, :data:`LOGIN_FIELDS`,
:data:`LOGIN_BODY_SECONDS`; urlencoded or multipart, UTF-8, not compressed.

:func:`browser_refusal` is the other half, for every request: a browser's own
``Sec-Fetch-Site`` and ``Origin`` headers say when a page of another site sent it, and
a request to a loopback daemon under a name that is not the daemon's is DNS rebinding
(a page whose name now points at 127.0.0.1).
"""

from __future__ import annotations

import asyncio
import email.message
import email.parser
import email.policy
import email.utils
import functools
import hashlib
import hmac
import ipaddress
import re
import socket
import time
from typing import Final
from urllib.parse import unquote_to_bytes, urlsplit

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from chunkd.errors import InvalidRequestError

__all__ = [
    "COOKIE",
    "LOGIN_BODY_BYTES",
    "LOGIN_BODY_SECONDS",
    "LOGIN_FIELDS",
    "SESSION_SECONDS",
    "browser_refusal",
    "clear_cookie",
    "login_form",
    "session_cookie",
    "valid_session",
]

COOKIE: Final = "chunkd_session"
SESSION_SECONDS: Final = 12 * 3600
#: the most bytes a login body may have (the form sends a token and a page's path)
LOGIN_BODY_BYTES: Final = 16 << 10
#: the most fields (or multipart parts) a login body may have
LOGIN_FIELDS: Final = 16
#: seconds a login body may take to arrive, once its headers have
LOGIN_BODY_SECONDS: Final = 10.0
_SAFE: Final = frozenset({"GET", "HEAD", "OPTIONS"})
#: a cookie's expiry: ASCII digits only. str.isdigit() and int() also take other
#: scripts' digits ("²", "٣"), and int() fails on some of them.
_EXPIRY: Final = re.compile(r"[0-9]{1,12}")
_MAC: Final = re.compile(r"[0-9a-f]{64}")
_URLENCODED: Final = "application/x-www-form-urlencoded"
_MULTIPART: Final = "multipart/form-data"
#: the charsets a login form may name: UTF-8 and its subset ASCII, under their names
#: (never a codec lookup by a name a client picked: that imports modules)
_CHARSETS: Final = frozenset({"utf-8", "utf8", "us-ascii", "ascii"})
#: a multipart boundary (RFC 2046: 1 to 70 of these, not ending in a space)
_BOUNDARY: Final = re.compile(r"[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]")
_CONTENT_LENGTH: Final = re.compile(r"[0-9]{1,18}")


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
    if not _EXPIRY.fullmatch(expiry_text) or not _MAC.fullmatch(mac):
        return False
    expiry = int(expiry_text)
    if expiry < time.time():
        return False
    return hmac.compare_digest(mac.encode(), _mac(token, expiry).encode())


async def login_form(request: web.Request) -> dict[str, str]:
    """The fields of the login form in ``request``'s body (the first of each name).

    The body is urlencoded or ``multipart/form-data``, UTF-8 (a charset, where named,
    is UTF-8 or ASCII), without a ``Content-Encoding``: what a browser's form sends.
    Its bounds are checked before it is read: at most :data:`LOGIN_BODY_BYTES` bytes
    and :data:`LOGIN_FIELDS` fields, arriving within :data:`LOGIN_BODY_SECONDS`.

    Raises:
        web.HTTPUnsupportedMediaType: another media type, charset or content coding.
        web.HTTPRequestEntityTooLarge: a body or a field count past its bound.
        web.HTTPRequestTimeout: the body took longer than its bound to arrive.
        InvalidRequestError: a body that is not what its type says (no boundary,
            bytes that are not UTF-8, a body cut short).
    """
    headers = request.headers
    coding = headers.get("Content-Encoding", "identity").strip().lower()
    if coding not in ("", "identity"):
        raise web.HTTPUnsupportedMediaType(
            reason=f"a login form is sent as it is, not with Content-Encoding "
            f"{_shown(coding)}: send it uncompressed"
        )
    content_type = email.message.Message()
    content_type["Content-Type"] = headers.get("Content-Type", "")
    media_type = content_type.get_content_type()
    if media_type not in (_URLENCODED, _MULTIPART):
        raise web.HTTPUnsupportedMediaType(
            reason=f"a login form is {_URLENCODED} or {_MULTIPART}, not "
            f"{_shown(headers.get('Content-Type', 'none'))}"
        )
    _check_charset(_param(content_type, "charset"), "the form")
    boundary = None
    if media_type == _MULTIPART:
        boundary = _param(content_type, "boundary")
        if boundary is None or not _BOUNDARY.fullmatch(boundary):
            raise InvalidRequestError(
                f"a {_MULTIPART} login form wants a boundary parameter (1 to 70 letters, "
                f"digits or '()+_,-./:=? ), not {_shown(boundary)}"
            )
    body = await _bounded_body(request)
    if boundary is None:
        return _urlencoded_fields(body)
    return _multipart_fields(body, boundary)


def _too_large(what: str) -> web.HTTPRequestEntityTooLarge:
    return web.HTTPRequestEntityTooLarge(
        LOGIN_BODY_BYTES,
        reason=f"{what}: a login form has at most {LOGIN_BODY_BYTES} bytes and "
        f"{LOGIN_FIELDS} fields",
    )


async def _bounded_body(request: web.Request) -> bytes:
    length = request.headers.get("Content-Length")
    if length is not None and (
        not _CONTENT_LENGTH.fullmatch(length) or int(length) > LOGIN_BODY_BYTES
    ):
        raise _too_large(f"a body of {_shown(length)} bytes")
    body = bytearray()
    try:
        async with asyncio.timeout(LOGIN_BODY_SECONDS):
            while piece := await request.content.read(LOGIN_BODY_BYTES + 1 - len(body)):
                body += piece
                if len(body) > LOGIN_BODY_BYTES:
                    raise _too_large(f"a body of more than {LOGIN_BODY_BYTES} bytes")
    except TimeoutError:
        raise web.HTTPRequestTimeout(
            reason=f"the login form did not arrive within {LOGIN_BODY_SECONDS:g} s"
        ) from None
    except HttpProcessingError as exc:
        # A chunked body that breaks its framing, cut short: the client's fault.
        raise InvalidRequestError(f"the login form's body could not be read: {exc}") from None
    return bytes(body)


def _urlencoded_fields(body: bytes) -> dict[str, str]:
    pieces = [piece for piece in body.split(b"&") if piece]
    if len(pieces) > LOGIN_FIELDS:
        raise _too_large(f"a form of {len(pieces)} fields")
    fields: dict[str, str] = {}
    for piece in pieces:
        raw_name, _, raw_value = piece.partition(b"=")
        name = _text(unquote_to_bytes(raw_name.replace(b"+", b" ")), "a field's name")
        value = _text(unquote_to_bytes(raw_value.replace(b"+", b" ")), f"field {name!r}")
        fields.setdefault(name, value)
    return fields


def _multipart_fields(body: bytes, boundary: str) -> dict[str, str]:
    # The stdlib's MIME parser records what it cannot make sense of as defects, and
    # never raises on its input; the body is bounded already.
    head = f'Content-Type: {_MULTIPART}; boundary="{boundary}"\r\n\r\n'.encode()
    message = email.parser.BytesParser(policy=email.policy.compat32).parsebytes(head + body)
    parts = message.get_payload()
    if not message.is_multipart() or not isinstance(parts, list):
        raise InvalidRequestError(
            f"the {_MULTIPART} login form has no part that starts with its boundary {boundary!r}"
        )
    if len(parts) > LOGIN_FIELDS:
        raise _too_large(f"a form of {len(parts)} parts")
    fields: dict[str, str] = {}
    for part in parts:
        if not isinstance(part, email.message.Message) or part.is_multipart():
            raise InvalidRequestError("a login form's part is a field's value, never more parts")
        name = _param(part, "name", header="content-disposition")
        if name is None:
            continue  # a part that is no form field: nothing asks for it
        _check_charset(_param(part, "charset"), f"field {name!r}")
        payload = part.get_payload(decode=True)
        raw = payload if isinstance(payload, bytes) else b""
        fields.setdefault(name, _text(raw, f"field {name!r}"))
    return fields


def _param(message: email.message.Message, name: str, header: str = "content-type") -> str | None:
    """A header parameter's value as sent (an RFC 2231 value undecoded: no codec is
    looked up by a name a client picked)."""
    value = message.get_param(name, header=header)
    if value is None:
        return None
    if isinstance(value, tuple):
        return str(value[2])
    return email.utils.unquote(value)


def _check_charset(charset: str | None, what: str) -> None:
    if charset is not None and charset.strip().lower().replace("_", "-") not in _CHARSETS:
        raise web.HTTPUnsupportedMediaType(
            reason=f"{what} names charset {_shown(charset)}; a login form is UTF-8 "
            "(charset=utf-8, or none)"
        )


def _text(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequestError(
            f"{what} of the login form is not UTF-8; send the form as a browser does"
        ) from None


def _shown(text: str | None) -> str:
    """A client's value in a message: quoted, escaped, and short."""
    shown = repr(text)
    return shown if len(shown) <= 60 else shown[:57] + "..."


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
        and _origin_host(origin) != headers.get("Host", "").lower()
    ):
        return f"a state-changing request from {origin!r}, not from this daemon's pages"
    # The Host header itself: request.host, without one, is a DNS look-up of this node
    # (socket.getfqdn()), which must not block the loop.
    host = headers.get("Host", "")
    if loopback and not _own_host(host, listen):
        return (
            f"this daemon answers loopback clients under its own names only, not as "
            f"{host!r}; use http://127.0.0.1:PORT/ or http://localhost:PORT/ "
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
