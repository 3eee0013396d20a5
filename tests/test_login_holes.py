"""The login cookie and the login form against hostile input and a real browser
(issue 24): every request here comes from another host (a network namespace in
198.18.0.0/15, ``other_host``), to a daemon that has a ``server.token``.

- a session cookie with digits that are not ASCII, or bytes that are not UTF-8, is no
  session (401), never a 500;
- ``POST /login`` answers a body it cannot take with a 4xx that says why (an unknown
  charset, bytes that are not UTF-8, multipart without a boundary, a compressed body,
  one too large or with too many fields), and nothing reaches the log as a traceback;
- a person signs in with real Chromium: the pages' Referrer-Policy lets the browser
  send the form's real ``Origin`` (``no-referrer`` made it ``null``, which the daemon
  refuses), and a wrong token shows the form again with a message, not JSON.
"""

from __future__ import annotations

import base64
import gzip
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from chunkd.gateway.dashboard.session import LOGIN_BODY_BYTES, LOGIN_FIELDS
from chunkd.testing.browser import chromium_missing
from tests.conftest import Daemon, free_port

TOKEN = "login-holes-token"

# Runs inside the other host's namespace: sends each request's raw bytes on a
# connection of its own and prints what came back (base64), one answer per request.
_RAW = textwrap.dedent(
    """
    import base64, json, socket, sys

    def complete(got):
        head, sep, body = got.partition(b"\\r\\n\\r\\n")
        if not sep:
            return False
        for line in head.split(b"\\r\\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                return len(body) >= int(value)
        return False

    host, port = sys.argv[1], int(sys.argv[2])
    answers = []
    for item in json.loads(sys.stdin.read()):
        with socket.create_connection((host, port), timeout=20) as conn:
            conn.sendall(base64.b64decode(item))
            got = b""
            while not complete(got):
                try:
                    piece = conn.recv(65536)
                except (ConnectionResetError, TimeoutError):
                    break
                if not piece:
                    break
                got += piece
        answers.append(base64.b64encode(got).decode())
    print(json.dumps(answers))
    """
)


def _raw(ns: str, daemon: Daemon, requests: list[bytes]) -> list[tuple[int, str, str]]:
    """Send each raw request from namespace ``ns``: (status, headers, body) each."""
    done = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", _RAW, daemon.host, str(daemon.port)],
        input=json.dumps([base64.b64encode(r).decode() for r in requests]),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    answers = []
    for text in json.loads(done.stdout):
        head, _, body = base64.b64decode(text).partition(b"\r\n\r\n")
        status_line, _, headers = head.decode("latin-1").partition("\r\n")
        assert status_line.startswith("HTTP/1."), status_line
        answers.append((int(status_line.split()[1]), headers, body.decode("utf-8", "replace")))
    return answers


def _request(
    daemon: Daemon, method: str, path: str, headers: dict[str, str] | None, body: bytes = b""
) -> bytes:
    head = [f"{method} {path} HTTP/1.1", f"Host: {daemon.host}:{daemon.port}"]
    head += [f"{name}: {value}" for name, value in (headers or {}).items()]
    if body and "Transfer-Encoding" not in (headers or {}):
        head.append(f"Content-Length: {len(body)}")
    head.append("Connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def _post_login(daemon: Daemon, content_type: str | None, body: bytes, **more: str) -> bytes:
    headers = {"Origin": f"http://{daemon.host}:{daemon.port}"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    headers.update({name.replace("_", "-"): value for name, value in more.items()})
    return _request(daemon, "POST", "/login", headers, body)


def _off_host_daemon(start_daemon: Callable[..., Daemon], tmp_path: Path, host_ip: str) -> Daemon:
    port = free_port()
    return start_daemon(
        cwd=tmp_path / "work",
        env={"CHUNKD_SERVER_LISTEN": f"{host_ip}:{port}", "CHUNKD_SERVER_TOKEN": TOKEN},
        port=port,
    )


def _no_traceback(daemon: Daemon) -> None:
    log = daemon.log.read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]
    assert "Error handling request" not in log, log[-4000:]


def _multipart(boundary: str, fields: list[tuple[str, bytes, str | None]]) -> bytes:
    parts = []
    for name, value, content_type in fields:
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n'
        if content_type is not None:
            head += f"Content-Type: {content_type}\r\n"
        parts.append(head.encode() + b"\r\n" + value + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode()


@pytest.mark.timeout(30)
def test_a_hostile_session_cookie_is_no_session_not_a_500(
    start_daemon: Callable[..., Daemon], tmp_path: Path, other_host: tuple[str, str]
) -> None:
    ns, host_ip = other_host
    daemon = _off_host_daemon(start_daemon, tmp_path, host_ip)
    mac = "0" * 64
    cookies = [
        "²00.x",  # str.isdigit() is true for "²", int() fails on it
        f"²00.{mac}",
        f"١٢٣٤٥٦٧٨٩٠.{mac}",  # Arabic-Indic digits: int() takes them
        f"{'9' * 12}.{mac}",
        f"{'9' * 400}.{mac}",
        f"100.{'é' * 64}",
        "100.x\udcff",  # a byte that is not UTF-8, below
        "",
        ".",
        "1.",
    ]
    requests = []
    for value in cookies:
        raw = f"chunkd_session={value}".encode("utf-8", "surrogateescape")
        request = _request(daemon, "GET", "/v1/dashboard", None)
        head, _, _ = request.partition(b"\r\n\r\n")
        requests.append(head + b"\r\nCookie: " + raw + b"\r\n\r\n")
    for value, (status, _, body) in zip(cookies, _raw(ns, daemon, requests), strict=True):
        assert status == 401, (value, status, body)
        assert "/login" in json.loads(body)["message"]
    _no_traceback(daemon)


@pytest.mark.timeout(30)
def test_login_answers_a_body_it_cannot_take_with_a_4xx_that_says_why(
    start_daemon: Callable[..., Daemon], tmp_path: Path, other_host: tuple[str, str]
) -> None:
    ns, host_ip = other_host
    daemon = _off_host_daemon(start_daemon, tmp_path, host_ip)
    form = "application/x-www-form-urlencoded"
    good = f"token={TOKEN}&next=/".encode()
    cases: dict[str, tuple[bytes, int, str]] = {
        "multipart, an unknown charset": (
            _post_login(
                daemon,
                "multipart/form-data; boundary=XyZ",
                _multipart("XyZ", [("token", TOKEN.encode(), "text/plain; charset=nosuch")]),
            ),
            415,
            "nosuch",
        ),
        "multipart, bytes that are not UTF-8": (
            _post_login(
                daemon,
                "multipart/form-data; boundary=XyZ",
                _multipart("XyZ", [("token", b"\xff\xfe" + TOKEN.encode(), None)]),
            ),
            400,
            "UTF-8",
        ),
        "urlencoded, charset=nosuch": (
            _post_login(daemon, f"{form}; charset=nosuch", good),
            415,
            "nosuch",
        ),
        "urlencoded, bytes that are not UTF-8": (
            _post_login(daemon, form, b"token=%ff%fe&next=/"),
            400,
            "UTF-8",
        ),
        "multipart without a boundary": (
            _post_login(daemon, "multipart/form-data", _multipart("XyZ", [("token", b"x", None)])),
            400,
            "boundary",
        ),
        "gzip that is not gzip": (
            _post_login(daemon, form, b"this is not gzip", Content_Encoding="gzip"),
            415,
            "Content-Encoding",
        ),
        "gzip that is gzip": (
            _post_login(daemon, form, gzip.compress(good), Content_Encoding="gzip"),
            415,
            "Content-Encoding",
        ),
        "another media type": (_post_login(daemon, "application/json", b"{}"), 415, "form"),
        "too many fields": (
            _post_login(daemon, form, b"&".join([b"a=1"] * (LOGIN_FIELDS + 1))),
            413,
            f"{LOGIN_FIELDS} fields",
        ),
        "too many multipart fields": (
            _post_login(
                daemon,
                "multipart/form-data; boundary=XyZ",
                _multipart("XyZ", [("a", b"1", None)] * (LOGIN_FIELDS + 1)),
            ),
            413,
            f"{LOGIN_FIELDS} fields",
        ),
        "too large, said up front": (
            _post_login(daemon, form, b"token=" + b"x" * LOGIN_BODY_BYTES),
            413,
            f"{LOGIN_BODY_BYTES} bytes",
        ),
        "too large, chunked": (
            _post_login(
                daemon,
                form,
                b"".join(
                    f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
                    for piece in [b"token=" + b"x" * 4000] + [b"x" * 4000] * 5
                )
                + b"0\r\n\r\n",
                Transfer_Encoding="chunked",
            ),
            413,
            f"{LOGIN_BODY_BYTES} bytes",
        ),
        # Refused as before: a sandboxed or file: page sends Origin: null.
        "Origin: null": (
            _request(daemon, "POST", "/login", {"Origin": "null", "Content-Type": form}, good),
            403,
            "state-changing",
        ),
    }
    answers = _raw(ns, daemon, [request for request, _, _ in cases.values()])
    wrong = []
    for (case, (_, wanted, words)), (status, _, body) in zip(cases.items(), answers, strict=True):
        if status != wanted or words not in body:
            wrong.append(f"{case}: {status} {body[:200]}")
        else:
            assert json.loads(body)["status"] == wanted
    assert not wrong, "\n".join(wrong)
    _no_traceback(daemon)

    # ...and the daemon still signs in a good form, urlencoded and multipart.
    multipart = _multipart(
        "b0undary", [("token", TOKEN.encode(), "text/plain; charset=UTF-8"), ("next", b"/", None)]
    )
    signed = _raw(
        ns,
        daemon,
        [
            _post_login(daemon, form, good),
            _post_login(daemon, "multipart/form-data; boundary=b0undary", multipart),
            _post_login(daemon, f"{form}; charset=utf-8", good),
        ],
    )
    for status, headers, body in signed:
        assert status == 303, (status, body)
        assert "Set-Cookie: chunkd_session=" in headers


@pytest.mark.timeout(20)
def test_a_login_body_said_too_large_is_refused_before_it_is_sent(
    start_daemon: Callable[..., Daemon], tmp_path: Path, other_host: tuple[str, str]
) -> None:
    """A client that announces 1 GB is answered at once: the daemon reads none of it."""
    ns, host_ip = other_host
    daemon = _off_host_daemon(start_daemon, tmp_path, host_ip)
    head = _post_login(daemon, "application/x-www-form-urlencoded", b"")
    head = head.replace(b"Connection: close", b"Content-Length: 1000000000\r\nConnection: close")
    started = time.monotonic()
    ((status, _, body),) = _raw(ns, daemon, [head])
    assert status == 413, body
    assert time.monotonic() - started < 10
    _no_traceback(daemon)


# -- a person signing in with Chromium, from another host ------------------------------

# Runs inside the other host's namespace: drives Chromium through the form and prints
# what it saw as JSON.
_BROWSER = textwrap.dedent(
    """
    import json, sys
    from chunkd.testing.browser import chromium
    base, token = sys.argv[1], sys.argv[2]
    seen = {"posts": []}

    def landed(page):
        form = page.locator("#token").count() == 1
        return {
            "url": page.url,
            "type": page.evaluate("document.contentType"),
            "form": form,
            "message": page.inner_text("#failed") if form and page.is_visible("#failed") else None,
            "next": page.input_value("#next") if form else None,
            "text": page.inner_text("body")[:300],
        }

    def submit(page, value):
        page.fill("#token", value)
        with page.expect_navigation():
            page.click("button[type=submit]")
        page.wait_for_load_state()
        return landed(page)

    with chromium() as browser:
        page = browser.new_page()
        page.set_default_timeout(10000)
        page.on("request", lambda r: seen["posts"].append(
            {"url": r.url, "origin": r.headers.get("origin")}) if r.method == "POST" else None)
        page.goto(base + "/inspect/")
        seen["asked"] = landed(page)
        seen["wrong"] = submit(page, "not-the-token")
        if seen["wrong"]["form"]:
            seen["signed"] = submit(page, token)
            page.goto(base + "/")
            # A function, not an expression: playwright polls an expression with eval(),
            # which the page's CSP (script-src 'self') refuses once the first check fails.
            page.wait_for_function(
                "() => document.getElementById('node').textContent.includes('chunkd ')"
            )
            seen["dashboard"] = page.inner_text("#node")
            seen["cookies"] = [c["name"] for c in page.context.cookies()]
    print(json.dumps(seen))
    """
)


@pytest.mark.timeout(60)
@pytest.mark.skipif(chromium_missing() is not None, reason=chromium_missing() or "")
def test_a_person_signs_in_with_chromium_from_another_host(
    start_daemon: Callable[..., Daemon], tmp_path: Path, other_host: tuple[str, str]
) -> None:
    ns, host_ip = other_host
    daemon = _off_host_daemon(start_daemon, tmp_path, host_ip)
    done = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", _BROWSER, daemon.url, TOKEN],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:] + daemon.log.read_text()[-2000:]
    seen = json.loads(done.stdout)
    asked = seen["asked"]
    assert asked["url"].startswith(daemon.url + "/login?next="), asked
    assert asked["form"], asked
    # The browser sends the form's real origin, the daemon's own (under the old
    # Referrer-Policy, no-referrer, it sent "null" and the daemon refused the form).
    assert seen["posts"], seen
    for post in seen["posts"]:
        assert post["origin"] == daemon.url, (post, seen)
    wrong = seen["wrong"]
    assert wrong["type"] == "text/html", wrong  # the form again, not JSON
    assert wrong["form"], wrong
    assert wrong["url"].startswith(daemon.url + "/login?failed=1"), wrong
    assert wrong["message"] == "That is not the token. Try again.", wrong
    assert wrong["next"] == "/inspect/", wrong  # where the person was going is kept
    signed = seen["signed"]
    assert signed["url"] == daemon.url + "/inspect/", signed
    assert signed["type"] == "text/html", signed
    assert not signed["form"], signed
    assert "chunkd " in seen["dashboard"]
    assert seen["cookies"] == ["chunkd_session"]
    _no_traceback(daemon)
