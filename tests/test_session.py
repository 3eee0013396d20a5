"""Who may see the pages: the token from other hosts, exchanged for a session cookie
by a browser; no cross-site use of the daemon from a browser, loopback included
(docs/inspector.md, "Access")."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from tests.conftest import Daemon, free_port

TOKEN = "s3ssion-token-for-tests"

# Runs inside the other host's namespace: one request, no redirects followed; prints
# {"status", "headers", "body"} as JSON.
_PROBE = textwrap.dedent(
    """
    import json, sys, urllib.request, urllib.error
    spec = json.loads(sys.argv[1])

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    opener = urllib.request.build_opener(NoRedirect)
    data = spec.get("body")
    request = urllib.request.Request(
        spec["url"], data=data.encode() if data is not None else None,
        headers=spec.get("headers", {}), method=spec.get("method", "GET"))
    try:
        with opener.open(request, timeout=20) as r:
            out = (r.status, r.headers, r.read())
    except urllib.error.HTTPError as e:
        out = (e.code, e.headers, e.read())
    status, headers, body = out
    print(json.dumps({"status": status,
                      "headers": {k: headers.get_all(k) for k in headers.keys()},
                      "body": body.decode(errors="replace")}))
    """
)


def _request(
    ns: str | None, url: str, *, method: str = "GET", headers=None, body=None
) -> tuple[int, dict[str, list[str]], str]:
    spec = {"url": url, "method": method, "headers": headers or {}, "body": body}
    command = [sys.executable, "-c", _PROBE, json.dumps(spec)]
    if ns is not None:
        command = ["ip", "netns", "exec", ns, *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    return answer["status"], answer["headers"], answer["body"]


def _cookie_of(headers: dict[str, list[str]]) -> str:
    (set_cookie,) = headers["Set-Cookie"]
    return set_cookie


def test_other_hosts_sign_in_with_the_token_and_the_cookie_opens_pages_only_for_reading(
    start_daemon, tmp_path: Path, other_host
) -> None:
    ns, host_ip = other_host
    work = tmp_path / "work"
    (work / "chunkd-data").mkdir(parents=True)
    (work / "chunkd-data" / "ok.bin").write_bytes(b"data")
    port = free_port()
    daemon: Daemon = start_daemon(
        cwd=work,
        env={"CHUNKD_SERVER_LISTEN": f"{host_ip}:{port}", "CHUNKD_SERVER_TOKEN": TOKEN},
        port=port,
    )
    base = daemon.url

    def other(path: str, **kw) -> tuple[int, dict[str, list[str]], str]:
        return _request(ns, base + path, **kw)

    # Unsigned: pages send the browser to the form, data routes say what to send.
    status, headers, _ = other("/inspect/?open=local/ok.bin")
    assert status == 303
    location = urllib.parse.urlsplit(headers["Location"][0])
    assert location.path == "/login"
    assert urllib.parse.parse_qs(location.query)["next"] == ["/inspect/?open=local/ok.bin"]
    assert other("/")[0] == 303
    status, _, body = other("/v1/dashboard")
    assert status == 401
    assert "/login" in json.loads(body)["message"]
    assert other("/v1/dashboard/stream")[0] == 401
    assert other("/v1/inspect/open?name=local/ok.bin")[0] == 401
    assert other("/v1/inspect/media/local/ok.bin")[0] == 401
    # The form and the assets hold no data: open.
    assert other("/login")[0] == 200
    assert other("/static/login.js")[0] == 200

    # A wrong token: back to the form, no cookie.
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    status, headers, _ = other("/login", method="POST", headers=form, body="token=wrong&next=/")
    assert status == 303
    assert headers["Location"][0].startswith("/login?failed=1")
    assert "Set-Cookie" not in headers

    # The token: a cookie, HttpOnly and SameSite=Strict, and on to the page asked for.
    status, headers, _ = other(
        "/login", method="POST", headers=form, body=f"token={TOKEN}&next=/inspect/"
    )
    assert status == 303
    assert headers["Location"] == ["/inspect/"]
    set_cookie = _cookie_of(headers)
    assert "HttpOnly" in set_cookie
    assert "SameSite=Strict" in set_cookie
    assert "Path=/" in set_cookie
    assert "Secure" not in set_cookie  # plain HTTP here; over TLS it is Secure
    cookie = {"Cookie": set_cookie.split(";")[0]}
    status, headers, _ = other("/", headers=cookie)
    assert status == 200
    assert "default-src 'none'" in headers["Content-Security-Policy"][0]
    assert other("/v1/dashboard", headers=cookie)[0] == 200
    assert other("/v1/objects/local/ok.bin", headers=cookie)[1:][1] == "data"
    # ...but never for a state-changing route: that wants the Bearer token.
    assert other("/v1/warm/local/ok.bin", method="POST", headers=cookie, body="")[0] == 401
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    assert other("/v1/warm/local/ok.bin", method="POST", headers=bearer, body="")[0] == 200

    # A forged, a tampered and an expired cookie open nothing.
    name, _, value = cookie["Cookie"].partition("=")
    expiry, _, mac = value.partition(".")
    past = int(time.time()) - 10
    expired_mac = hmac.new(
        TOKEN.encode(), f"chunkd-session:{past}".encode(), hashlib.sha256
    ).hexdigest()
    for bad in (
        f"{name}={int(expiry) + 1000}.{mac}",
        f"{name}={expiry}.{mac[:-1]}{'1' if mac[-1] == '0' else '0'}",  # one digit off
        f"{name}={past}.{expired_mac}",
        f"{name}=nonsense",
    ):
        assert other("/v1/dashboard", headers={"Cookie": bad})[0] == 401, bad

    # The cookie outlives a daemon restart (no state) and dies with a new token.
    assert daemon.stop() == 0
    again: Daemon = start_daemon(
        cwd=work,
        env={"CHUNKD_SERVER_LISTEN": f"{host_ip}:{port}", "CHUNKD_SERVER_TOKEN": TOKEN},
        port=port,
    )
    assert other("/v1/dashboard", headers=cookie)[0] == 200
    assert again.stop() == 0
    rotated: Daemon = start_daemon(
        cwd=work,
        env={"CHUNKD_SERVER_LISTEN": f"{host_ip}:{port}", "CHUNKD_SERVER_TOKEN": "a-new-one"},
        port=port,
    )
    assert other("/v1/dashboard", headers=cookie)[0] == 401
    assert rotated.stop() == 0


def test_without_a_token_other_hosts_see_no_page(start_daemon, tmp_path: Path, other_host) -> None:
    ns, host_ip = other_host
    port = free_port()
    daemon: Daemon = start_daemon(env={"CHUNKD_SERVER_LISTEN": f"{host_ip}:{port}"}, port=port)
    status, _, body = _request(ns, daemon.url + "/")
    assert status == 403
    assert "ssh -L" in json.loads(body)["message"]
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    status, _, body = _request(
        ns, daemon.url + "/login", method="POST", headers=form, body="token=x"
    )
    assert status == 403
    assert _request(ns, daemon.url + "/healthz")[0] == 200


def _local(daemon: Daemon, path: str, *, method: str = "GET", headers=None, body=None) -> int:
    request = urllib.request.Request(
        daemon.url + path,
        data=body.encode() if body is not None else None,
        headers=headers or {},
        method=method,
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_browser_cannot_be_made_to_use_a_loopback_daemon(start_daemon) -> None:
    daemon: Daemon = start_daemon()
    (daemon.cwd / "chunkd-data").mkdir(exist_ok=True)
    (daemon.cwd / "chunkd-data" / "ok.bin").write_bytes(b"data")
    # What the daemon's own pages send: fine.
    same_origin = {"Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "cors"}
    assert _local(daemon, "/v1/dashboard", headers=same_origin) == 200
    assert _local(daemon, "/v1/objects/local/ok.bin") == 200  # a plain client
    # Another site's page (a fetch, an <img>, a form): refused.
    cross = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"}
    assert _local(daemon, "/v1/objects/local/ok.bin", headers=cross) == 403
    assert _local(daemon, "/v1/dashboard/stream", headers=cross) == 403
    # A state-changing request from a foreign Origin (a browser without Sec-Fetch-*).
    evil = {"Origin": "http://evil.example"}
    assert _local(daemon, "/v1/warm/local/ok.bin", method="POST", headers=evil, body="") == 403
    own = {"Origin": f"http://127.0.0.1:{daemon.port}"}
    assert _local(daemon, "/v1/warm/local/ok.bin", method="POST", headers=own, body="") == 200
    # DNS rebinding: a browser that reached 127.0.0.1 under another site's name. Over
    # plain HTTP to such a name it sends no Sec-Fetch-* headers: the Host alone tells.
    rebound = {"Host": f"evil.example:{daemon.port}"}
    assert _local(daemon, "/v1/objects/local/ok.bin", headers=rebound) == 403
    assert _local(daemon, "/v1/dashboard", headers=rebound) == 403
    evil_origin = {
        "Host": f"evil.example:{daemon.port}",
        "Origin": f"http://evil.example:{daemon.port}",
    }
    assert (
        _local(daemon, "/v1/warm/local/ok.bin", method="POST", headers=evil_origin, body="") == 403
    )
    assert (
        _local(daemon, "/v1/objects/local/ok.bin", headers={"Host": "127.0.0.1.evil.example"})
        == 403
    )
    # The node's own names are its own.
    node_name = socket.gethostname()
    assert _local(daemon, "/v1/objects/local/ok.bin", headers={"Host": node_name}) == 200
    for host in (f"localhost:{daemon.port}", f"127.0.0.1:{daemon.port}"):
        assert _local(daemon, "/", headers={"Host": host, "Sec-Fetch-Mode": "navigate"}) == 200


def test_a_login_sends_the_browser_on_to_this_daemon_s_pages_only(start_daemon) -> None:
    daemon: Daemon = start_daemon(env={"CHUNKD_SERVER_TOKEN": TOKEN})
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    cases = {
        "/inspect/?open=local/x.parquet": "/inspect/?open=local/x.parquet",
        "/": "/",
        "//evil.example/": "/",
        "/%09/evil.example": "/",  # a tab, dropped on the way into Location: "//evil..."
        "/%0a/evil.example": "/",
        "/\\evil.example": "/",
        "https://evil.example/": "/",
        "/v1/objects/local/x": "/",  # not a page
    }
    for sent, wanted in cases.items():
        body = f"token={TOKEN}&next={sent}" if "%" in sent else None
        if body is None:
            body = f"token={TOKEN}&next={urllib.parse.quote(sent, safe='')}"
        status, headers, _ = _request(
            None, daemon.url + "/login", method="POST", headers=form, body=body
        )
        assert status == 303, sent
        assert headers["Location"] == [wanted], sent
