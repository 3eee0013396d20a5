"""The pages and their data: ``/`` (the dashboard), ``/inspect/`` (the inspector),
``/login``, the static assets, and the dashboard's snapshot and stream.

Routes::

    GET  /                       the dashboard page
    GET  /inspect/, /inspect/*   the inspector page (its JS reads the rest of the URL)
    GET  /login                  the token form; POST /login sets the session cookie
    POST /logout                 clears it
    GET  /static/NAME            an asset shipped in the package (gateway/dashboard/static)
    GET  /v1/dashboard           the snapshot: the node and the last 300 samples
    GET  /v1/dashboard/stream    server-sent events: a sample a second

Every page goes out with :data:`CSP` (no inline script or style, nothing from another
origin) and ``X-Content-Type-Options: nosniff``; the pages put every value into the DOM
as text. Who may load them is :mod:`chunkd.gateway.api`'s guard (with
:mod:`.session`): the pages show data, so they are data routes.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from pathlib import Path
from typing import Final
from urllib.parse import quote

from aiohttp import web

from chunkd.errors import ChunkdError
from chunkd.gateway.appkeys import CONFIG, PEER_TLS, STREAMING
from chunkd.gateway.dashboard.session import clear_cookie, login_form, session_cookie
from chunkd.gateway.dashboard.telemetry import Event, Telemetry
from chunkd.gateway.status import http_status

__all__ = ["CSP", "PAGE_HEADERS", "STATIC", "TELEMETRY", "add_routes"]

TELEMETRY: Final = web.AppKey("telemetry", Telemetry)
#: the assets' folder, shipped as package data
STATIC: Final = Path(__file__).with_name("static")
CSP: Final = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "media-src 'self' blob:; connect-src 'self'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
PAGE_HEADERS: Final = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    # same-origin, not no-referrer: under no-referrer a browser posts a form with
    # "Origin: null" (Fetch, "append a request Origin header"), which browser_refusal
    # refuses as it must; same-origin keeps the real Origin on the daemon's own posts
    # and sends other sites no Referer at all.
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-cache",
}
_TYPES: Final = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".txt": "text/plain; charset=utf-8",
}
_ASSET: Final = re.compile(
    r"[A-Za-z0-9_-]{1,64}(\.[A-Za-z0-9_-]{1,16})?\.(html|js|css|svg|png|txt)"
)
#: seconds between keep-alive comments on a quiet stream
PING_SECONDS: Final = 15.0
#: seconds a stream's client may take to accept one event before it is dropped
SEND_SECONDS: Final = 30.0


def add_routes(app: web.Application) -> None:
    """Add the pages, assets and dashboard data routes to ``app``."""
    app.router.add_get("/", _dashboard_page)
    app.router.add_get("/inspect", _to_inspect)
    app.router.add_get(r"/inspect/{tail:[\s\S]*}", _inspect_page)
    app.router.add_get("/login", _login_page)
    app.router.add_post("/login", _login)
    app.router.add_post("/logout", _logout)
    app.router.add_get("/static/{name}", _asset)
    app.router.add_get("/v1/dashboard", _snapshot)
    app.router.add_get("/v1/dashboard/stream", _stream)
    app.on_shutdown.append(_end_streams)


async def _end_streams(app: web.Application) -> None:
    # Streams never end by themselves: without this a stop would wait its whole
    # shutdown_timeout for them.
    telemetry = app.get(TELEMETRY)
    if telemetry is not None:
        telemetry.end_streams()


def _file(name: str) -> web.StreamResponse:
    path = STATIC / name
    if not _ASSET.fullmatch(name) or not path.is_file():
        raise web.HTTPNotFound(reason=f"no asset {name!r} ships with this chunkd")
    headers = dict(PAGE_HEADERS)
    headers["Content-Type"] = _TYPES[path.suffix]
    return web.FileResponse(path, headers=headers)


async def _dashboard_page(request: web.Request) -> web.StreamResponse:
    return _file("dashboard.html")


async def _to_inspect(request: web.Request) -> web.StreamResponse:
    query = f"?{request.query_string}" if request.query_string else ""
    raise web.HTTPPermanentRedirect(f"/inspect/{query}")


async def _inspect_page(request: web.Request) -> web.StreamResponse:
    return _file("inspect.html")


async def _login_page(request: web.Request) -> web.StreamResponse:
    return _file("login.html")


async def _asset(request: web.Request) -> web.StreamResponse:
    return _file(request.match_info["name"])


#: where a login may send the browser on: a path of this daemon's pages, printable
#: ASCII only (a tab or a newline would be dropped on the way into Location, and
#: "/\t/evil.example" would turn into "//evil.example", another site)
_NEXT: Final = re.compile(r"/(inspect/[\x21-\x7e]*)?(\?[\x21-\x7e]*)?")


def _next_page(text: str | None) -> str:
    """Where to go after the login: one of this daemon's pages (never another site)."""
    if text and _NEXT.fullmatch(text) and "\\" not in text and "//" not in text:
        return text
    return "/"


async def _login(request: web.Request) -> web.StreamResponse:
    """Exchange ``server.token`` (a form field) for a session cookie."""
    token = request.app[CONFIG].server.token
    if token is None:
        raise web.HTTPForbidden(
            reason="this daemon has no server.token: it answers pages on its own host only "
            "(use an ssh tunnel: ssh -L 8470:127.0.0.1:8470 NODE)"
        )
    try:
        form = await login_form(request)
    except (web.HTTPClientError, ChunkdError) as refusal:
        if request.content.is_eof():
            raise
        return await _refuse_unread(request, refusal)
    sent = form.get("token", "")
    goto = _next_page(form.get("next") or "/")
    secure = request.app[PEER_TLS] is not None
    if not hmac.compare_digest(sent.strip().encode(), token.reveal().encode()):
        await asyncio.sleep(0.5)  # a wrong guess costs the guesser time
        raise web.HTTPSeeOther(f"/login?failed=1&next={quote(goto, safe='/')}")
    response = web.HTTPSeeOther(goto)
    session_cookie(response, token.reveal(), secure=secure)
    raise response


async def _refuse_unread(
    request: web.Request, refusal: web.HTTPClientError | ChunkdError
) -> web.StreamResponse:
    """Answer a login form refused before its body was read, and close the connection.

    Otherwise aiohttp would read the rest of the body once the answer is out (for up
    to its lingering time, 10 s), which a refusal for size must not cost, and a body
    that does not decompress fails there as an unhandled exception with a traceback.
    The answer is the error body of every other route (``chunkd.gateway.api``).
    """
    if isinstance(refusal, web.HTTPClientError):
        status, message = refusal.status, refusal.reason
    else:
        status, message = http_status(refusal), str(refusal)
    body = {"error": type(refusal).__name__, "message": message, "status": status}
    response = web.json_response(body, status=status)
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    # The answer is in the transport's buffer: closing it sends that first, and a
    # connection marked closed is not read on (no lingering).
    request.protocol.force_close()
    return response


async def _logout(request: web.Request) -> web.StreamResponse:
    response = web.HTTPSeeOther("/login")
    clear_cookie(response, secure=request.app[PEER_TLS] is not None)
    raise response


async def _snapshot(request: web.Request) -> web.Response:
    return web.json_response(request.app[TELEMETRY].snapshot(), headers=_NO_STORE)


_NO_STORE: Final = {"Cache-Control": "no-store"}


def _encode(event: Event) -> bytes:
    lines = [f"event: {event.name}"]
    if event.id:
        lines.append(f"id: {event.id}")
    lines.append("data: " + json.dumps(event.data, separators=(",", ":"), allow_nan=False))
    return ("\n".join(lines) + "\n\n").encode()


async def _stream(request: web.Request) -> web.StreamResponse:
    """Server-sent events: a ``sample`` event each second (``docs/dashboard.md``)."""
    telemetry = request.app[TELEMETRY]
    last = request.headers.get("Last-Event-ID") or request.query.get("last") or None
    async with telemetry.follow(last) as follower:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-store",
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        request[STREAMING] = True
        hello = f"retry: 1000\n: chunkd {telemetry.boot}\n\n".encode()
        try:
            await asyncio.wait_for(response.write(hello), SEND_SECONDS)
            while True:
                try:
                    async with asyncio.timeout(PING_SECONDS):
                        event = await follower.next()
                except TimeoutError:
                    await asyncio.wait_for(response.write(b": ping\n\n"), SEND_SECONDS)
                    continue
                if event is None:
                    break  # ended: the daemon is stopping, or this client fell behind
                await asyncio.wait_for(response.write(_encode(event)), SEND_SECONDS)
            await asyncio.wait_for(response.write_eof(), SEND_SECONDS)
        except TimeoutError:
            # The client takes nothing: drop the connection, or finishing the response
            # would wait on it as well.
            if request.transport is not None:
                request.transport.abort()
        except ConnectionError:
            pass  # it went away
    return response
