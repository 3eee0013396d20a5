"""``chunkd doctor``: each check against a real node's parts (a fake sysfs and procfs
tree, real sockets, a moto S3 server, a real daemon as a peer), and that it writes
nothing."""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import hashlib
import http.server
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from chunkd.gateway.cli import main
from chunkd.testing import S3Server, free_port, s3_backend
from chunkd.testing.nginx import NginxServer, nginx_or_skip
from tests.conftest import BIN, Daemon, small_node_toml

NEVER = "always within_size advise [never] deny force\n"
ADVISE = "always within_size [advise] never deny force\n"
TOKEN = "a-peer-token-of-the-cluster-0123456789"


pytestmark = pytest.mark.usefixtures("clean_cwd")


def fake_sysfs(root: Path, shmem: str, per_size: str | None = None) -> Path:
    thp = root / "kernel" / "mm" / "transparent_hugepage"
    thp.mkdir(parents=True)
    (thp / "shmem_enabled").write_text(shmem)
    (thp / "enabled").write_text("always [madvise] never\n")
    if per_size is not None:
        (thp / "hugepages-2048kB").mkdir()
        (thp / "hugepages-2048kB" / "shmem_enabled").write_text(per_size)
    return root


def node_toml(tmp_path: Path, extra: str = "", backends: str | None = None) -> Path:
    """A config for the doctor: its cache, socket and a file backend under ``tmp_path``."""
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    text = f'[server]\nsocket = "{tmp_path / "run" / "chunkd.sock"}"\n'
    text += small_node_toml(tmp_path / "cache", *([] if backends else [("files", data)]))
    text += (backends or "") + extra
    path = tmp_path / "doctor.toml"
    path.write_text(text)
    return path


def doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, dict[str, str]]]:
    """``chunkd doctor --json ARGS`` in this process: the status and the checks by name."""
    capsys.readouterr()
    status = main(["doctor", "--json", *args])
    document = json.loads(capsys.readouterr().out)
    assert document["ok"] == (status == 0)
    checks = {check["name"]: check for check in document["checks"]}
    assert all(set(check) == {"name", "status", "finding", "fix"} for check in checks.values())
    # docs/deploy.md: every check that is not ok says what to change
    unfixed = [c for c in checks.values() if c["status"] != "ok" and not c["fix"].strip()]
    assert unfixed == [], unfixed
    return status, checks


def tree(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every entry under ``root``: its mtime, mode and (for a file) a hash of its bytes."""
    found = {}
    for top, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = Path(top) / name
            st = path.lstat()
            digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
            found[str(path.relative_to(root))] = (st.st_mtime_ns, st.st_mode, digest)
    return found


# -- huge pages ------------------------------------------------------------------------


@pytest.mark.timeout(20)
def test_shmem_enabled_never_is_reported_with_its_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sysfs = fake_sysfs(tmp_path / "sys", NEVER)
    status, checks = doctor(capsys, "--config", str(node_toml(tmp_path)), "--sysfs", str(sysfs))
    check = checks["shmem_enabled"]
    assert check["status"] == "warn"
    assert "/sys/kernel/mm/transparent_hugepage/shmem_enabled is never" in check["finding"]
    # The fix docs/deploy.md gives: now, and at every boot.
    assert "echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled" in check["fix"]
    assert "w /sys/kernel/mm/transparent_hugepage/shmem_enabled - - - - advise" in check["fix"]
    assert status == 0  # a warning is no error
    deploy = (Path(__file__).parents[1] / "docs" / "deploy.md").read_text()
    assert "w /sys/kernel/mm/transparent_hugepage/shmem_enabled\n  - - - - advise" in deploy


@pytest.mark.timeout(20)
def test_shmem_enabled_advise_is_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sysfs = fake_sysfs(tmp_path / "sys", ADVISE, per_size="[inherit] always advise never\n")
    _, checks = doctor(capsys, "--config", str(node_toml(tmp_path)), "--sysfs", str(sysfs))
    check = checks["shmem_enabled"]
    assert check["status"] == "ok", check
    assert "is advise" in check["finding"]
    assert check["fix"] == ""


@pytest.mark.timeout(20)
def test_a_per_size_never_overrides_a_global_advise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sysfs = fake_sysfs(tmp_path / "sys", ADVISE, per_size="inherit always advise [never]\n")
    _, checks = doctor(capsys, "--config", str(node_toml(tmp_path)), "--sysfs", str(sysfs))
    check = checks["shmem_enabled"]
    assert check["status"] == "warn"
    assert "hugepages-2048kB/shmem_enabled is never" in check["finding"]
    assert "echo advise > /sys/kernel/mm/transparent_hugepage/hugepages-2048kB/" in check["fix"]


@pytest.mark.timeout(20)
def test_no_shmem_enabled_file_says_it_cannot_tell(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "sys").mkdir()
    _, checks = doctor(
        capsys, "--config", str(node_toml(tmp_path)), "--sysfs", str(tmp_path / "sys")
    )
    assert checks["shmem_enabled"]["status"] == "warn"
    assert "cannot tell" in checks["shmem_enabled"]["finding"]


# -- open files ------------------------------------------------------------------------


def limits(nofile: str) -> str:
    return (
        "Limit                     Soft Limit           Hard Limit           Units     \n"
        "Max cpu time              unlimited            unlimited            seconds   \n"
        f"Max open files            {nofile}                files     \n"
    )


@pytest.mark.timeout(20)
def test_an_open_files_limit_below_the_ram_tier_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 64 MiB of 4 MiB chunks is 16 chunks; the floor of the memfd budget is 64, so a
    # larger RAM tier: 1 GiB is 256 chunks, against 3/4 of 128.
    config = node_toml(tmp_path)
    text = config.read_text().replace('ram_bytes = "64MiB"', 'ram_bytes = "1GiB"')
    config.write_text(text)
    procfs = tmp_path / "proc"
    (procfs / "self").mkdir(parents=True)
    (procfs / "self" / "limits").write_text(limits("1024                 128    "))
    _, checks = doctor(capsys, "--config", str(config), "--procfs", str(procfs))
    check = checks["open_files"]
    assert check["status"] == "warn"
    assert "the open-files limit is 128" in check["finding"]
    assert "fewer than the 256 of 4.0 MiB" in check["finding"]
    assert "raise the open-files limit to 342 or more" in check["fix"]
    assert "LimitNOFILE=1048576" in check["fix"]
    # A running daemon (the pid in its cache's LOCK) is judged by its own limit.
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "LOCK").write_text("4242\n")
    (procfs / "4242").mkdir()
    (procfs / "4242" / "limits").write_text(limits("1048576              1048576"))
    _, checks = doctor(capsys, "--config", str(config), "--procfs", str(procfs))
    check = checks["open_files"]
    assert check["status"] == "ok"
    assert "1048576, the running daemon's (pid 4242)" in check["finding"]


# -- the socket ------------------------------------------------------------------------


@pytest.mark.timeout(20)
def test_a_socket_others_cannot_connect_to_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = node_toml(tmp_path)
    path = tmp_path / "run" / "chunkd.sock"
    path.parent.mkdir()
    path.parent.chmod(0o750)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        listener.listen()
        path.chmod(0o600)
        _, checks = doctor(capsys, "--config", str(config), "--reader", "nobody")
        check = checks["socket"]
        assert check["status"] == "warn"
        assert "mode 0600" in check["finding"]
        assert "may connect: the group" in check["finding"] or "may not" in check["finding"]
        assert "the config gives 0660" in check["finding"]
        assert "nobody may not connect" in check["finding"]
        assert 'socket_mode = "0660"' in check["fix"]
        assert "usermod -aG" in check["fix"]
        # Group-readable is not connectable (connecting takes write): the directory's
        # search bit is then no one's problem.
        path.parent.chmod(0o700)
        path.chmod(0o640)
        _, checks = doctor(capsys, "--config", str(config))
        assert "only" in checks["socket"]["finding"]
        assert "its directory" not in checks["socket"]["finding"], checks["socket"]
        path.chmod(0o660)
        _, checks = doctor(capsys, "--config", str(config))
        assert "its directory" in checks["socket"]["finding"], checks["socket"]
        path.parent.chmod(0o750)
        # At the mode the config gives, the group may connect: no fix needed.
        path.chmod(0o660)
        _, checks = doctor(capsys, "--config", str(config))
        assert checks["socket"]["status"] == "ok", checks["socket"]
        assert "mode 0660" in checks["socket"]["finding"]
    finally:
        listener.close()


# -- cache disk and O_DIRECT -------------------------------------------------------------


@pytest.mark.timeout(20)
def test_cache_disk_free_space_and_o_direct(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = node_toml(tmp_path)
    _, checks = doctor(capsys, "--config", str(config))
    assert checks["cache_disk"]["status"] == "ok"
    assert "free of" in checks["cache_disk"]["finding"]
    assert "not made yet" in checks["cache_disk"]["finding"]
    # No file to open with O_DIRECT: it says it cannot tell (it never writes a probe).
    assert checks["o_direct"]["status"] == "warn"
    assert "cannot tell" in checks["o_direct"]["finding"]
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "LOCK").write_text("1\n")
    _, checks = doctor(capsys, "--config", str(config))
    assert checks["o_direct"]["status"] in ("ok", "warn")
    assert (
        "LOCK" in checks["o_direct"]["finding"]
        or "refuses O_DIRECT" in (checks["o_direct"]["finding"])
    )
    # A budget larger than the filesystem is reported, with a size that fits.
    text = config.read_text().replace('disk_bytes = "256MiB"', 'disk_bytes = "1PiB"')
    config.write_text(text)
    _, checks = doctor(capsys, "--config", str(config))
    assert checks["cache_disk"]["status"] == "warn"
    assert "it can grow to" in checks["cache_disk"]["finding"]
    assert "lower disk_bytes to" in checks["cache_disk"]["fix"]


# -- backends and their clocks -----------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_dead_backend_is_an_error_and_exits_1(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    config = node_toml(tmp_path, backends=s3_backend("data", "s3://gone/prefix", dead))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
    done = subprocess.run(
        [str(BIN / "chunkd"), "doctor", "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=25,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    line = next(line for line in done.stdout.splitlines() if "backend:data" in line)
    assert line.startswith("  [ERROR] backend:data: s3://gone/prefix is unreachable")
    assert "fix: check the endpoint" in done.stdout
    assert "Traceback" not in done.stderr
    as_json = subprocess.run(
        [str(BIN / "chunkd"), "doctor", "--json", "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=25,
        check=False,
    )
    assert as_json.returncode == 1
    document = json.loads(as_json.stdout)
    assert document["ok"] is False
    (backend,) = (c for c in document["checks"] if c["name"] == "backend:data")
    assert backend["status"] == "error"
    (clock,) = (c for c in document["checks"] if c["name"] == "clock:data")
    assert clock["status"] == "warn"
    assert "cannot tell" in clock["finding"]


@pytest.mark.timeout(30)
def test_a_reachable_backend_is_ok_and_its_clock_is_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], s3_server: S3Server, bucket: str
) -> None:
    config = node_toml(
        tmp_path, backends=s3_backend("data", f"s3://{bucket}/pre", s3_server.endpoint)
    )
    status, checks = doctor(capsys, "--config", str(config))
    assert checks["backend:data"]["status"] == "ok", checks["backend:data"]
    assert "listed with its credentials" in checks["backend:data"]["finding"]
    clock = checks["clock:data"]
    assert clock["status"] == "ok", clock
    assert f"{s3_server.endpoint}/{bucket}'s Date" in clock["finding"]
    assert status == 0
    # Listing, never writing: the bucket is as empty as it was.
    assert s3_server.client().list_objects_v2(Bucket=bucket).get("KeyCount") == 0
    # A bucket that is not there is an error of its own.
    gone = s3_backend("gone", f"s3://{bucket}-gone/pre", s3_server.endpoint)
    config = node_toml(tmp_path, backends=gone)
    status, checks = doctor(capsys, "--config", str(config))
    assert status == 1
    assert checks["backend:gone"]["status"] == "error"
    assert "its bucket does not exist" in checks["backend:gone"]["finding"]
    assert "create the bucket" in checks["backend:gone"]["fix"]


@pytest.mark.timeout(30)
def test_refused_credentials_are_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with S3Server.start(checks_credentials_after=0) as server:
        config = node_toml(
            tmp_path,
            backends=s3_backend(
                "data",
                "s3://locked/pre",
                server.endpoint,
                access_key_id="not-a-key",
                secret_access_key="not-a-secret",
            ),
        )
        status, checks = doctor(capsys, "--config", str(config))
    assert status == 1
    assert checks["backend:data"]["status"] == "error"
    assert "CHUNKD_BACKENDS_DATA_ACCESS_KEY_ID" in checks["backend:data"]["fix"]


# -- peers -----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_peer_takes_the_token_and_a_wrong_token_is_an_error(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    start_daemon: Callable[..., Daemon],
) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    port = free_port()
    member = f"127.0.0.1:{port}"
    data = tmp_path / "peer-data"
    data.mkdir()
    peer_toml = small_node_toml(tmp_path / "peer-cache", ("data", data)) + (
        f'\n[peers]\nself = "{member}"\nmembers = ["{member}"]\ntoken_file = "{token}"\n'
    )
    start_daemon(peer_toml, port=port, cwd=tmp_path / "peer")
    peers = (
        f'\n[peers]\nself = "127.0.0.1:{free_port()}"\nmembers = ["{member}"]\n'
        f'token_file = "{tmp_path / "mine"}"\n'
    )
    config = node_toml(tmp_path, peers)
    (tmp_path / "mine").write_text(TOKEN)
    (tmp_path / "mine").chmod(0o600)
    status, checks = doctor(capsys, "--config", str(config))
    assert checks[f"peer:{member}"]["status"] == "ok", checks[f"peer:{member}"]
    assert "took the peer token" in checks[f"peer:{member}"]["finding"]
    assert status == 0
    (tmp_path / "mine").write_text("another-cluster-token-0123456789")
    status, checks = doctor(capsys, "--config", str(config))
    check = checks[f"peer:{member}"]
    assert check["status"] == "error"
    assert "refused the peer token (401)" in check["finding"]
    assert "same [peers] token_file" in check["fix"]
    assert status == 1
    # Members from a DNS name's records are checked the same way.
    config.write_text(config.read_text().replace(f'members = ["{member}"]', f'dns = "{member}"'))
    status, checks = doctor(capsys, "--config", str(config))
    assert checks[f"peer:{member}"]["status"] == "error"
    (tmp_path / "mine").write_text(TOKEN)
    status, checks = doctor(capsys, "--config", str(config))
    assert checks[f"peer:{member}"]["status"] == "ok"
    assert status == 0


# -- the configuration, and what doctor leaves behind ------------------------------------


@pytest.mark.timeout(20)
def test_a_config_without_backends_is_an_error_with_what_to_add(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "front.toml"
    config.write_text('[s3_front]\nlisten = "127.0.0.1:8471"\n')
    status, checks = doctor(capsys, "--config", str(config))
    assert status == 1
    assert checks["config"]["status"] == "error"
    assert f'url = "file://{tmp_path}/chunkd-data"' in checks["config"]["finding"]
    assert "shmem_enabled" in checks  # what needs no config still ran


@pytest.mark.timeout(30)
def test_doctor_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], s3_server: S3Server, bucket: str
) -> None:
    sysfs = fake_sysfs(tmp_path / "sys", NEVER, per_size="[inherit] never\n")
    procfs = tmp_path / "proc"
    (procfs / "self").mkdir(parents=True)
    (procfs / "self" / "limits").write_text(limits("1024                 4096   "))
    config = node_toml(
        tmp_path, backends=s3_backend("data", f"s3://{bucket}/pre", s3_server.endpoint)
    )
    cache = tmp_path / "cache"
    (cache / "chunks" / "ab" / "cd").mkdir(parents=True)
    (cache / "chunks" / "ab" / "cd" / ("ab" * 32)).write_bytes(os.urandom(8192))
    (cache / "LOCK").write_text("999999\n")
    before = tree(tmp_path)
    doctor(capsys, "--config", str(config), "--sysfs", str(sysfs), "--procfs", str(procfs))
    assert tree(tmp_path) == before
    # On the embedded default, in a fresh directory: not even its data directory.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    os.chdir(fresh)
    _, checks = doctor(capsys, "--sysfs", str(sysfs), "--procfs", str(procfs))
    assert list(fresh.iterdir()) == []
    assert checks["config"]["finding"] == "loaded embedded default"
    assert checks["backend:local"]["status"] == "warn"
    assert tree(tmp_path / "sys") == {k[4:]: v for k, v in before.items() if k.startswith("sys/")}


@pytest.mark.timeout(20)
def test_doctor_and_config_are_commands(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}

    def chunkd(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(BIN / "chunkd"), *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=15,
            check=False,
        )

    helped = chunkd("--help")
    assert "doctor" in helped.stdout
    assert "config" in helped.stdout
    wrong = chunkd("doctor", "--no-such-option")
    assert wrong.returncode == 2
    assert "Traceback" not in wrong.stderr


@pytest.mark.timeout(20)
def test_deploy_md_writes_down_every_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], s3_server: S3Server, bucket: str
) -> None:
    config = node_toml(
        tmp_path, backends=s3_backend("data", f"s3://{bucket}/pre", s3_server.endpoint)
    )
    _, checks = doctor(capsys, "--config", str(config))
    deploy = (Path(__file__).parents[1] / "docs" / "deploy.md").read_text()
    section = deploy.split("## chunkd doctor\n", 1)[1].split("\n## ", 1)[0]
    for name in checks:
        if name == "peers":
            continue  # the peers' own problems are written down under peer:HOST:PORT
        shown = name.replace("data", "NAME")
        assert f"| `{shown}` |" in section, name
    assert "| `peer:HOST:PORT` |" in section


# -- what a backend's or a peer's odd answers do (review of issue 27) --------------------


@contextlib.contextmanager
def answering(status: int, headers: dict[str, str]) -> Iterator[str]:
    """A real HTTP server on loopback (aiohttp, in a thread of its own) that answers
    every request with ``status`` and ``headers``; yields its base URL."""
    from aiohttp import web

    async def handle(request: web.Request) -> web.Response:
        return web.Response(status=status, headers=headers, text="an odd server\n")

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    port = free_port()
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.run_until_complete(runner.cleanup())
        loop.close()


@pytest.mark.timeout(30)
def test_an_unreadable_date_header_is_a_warning_not_a_crash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with answering(403, {"Date": "garbage"}) as endpoint:
        config = node_toml(tmp_path, backends=s3_backend("data", "s3://odd/pre", endpoint))
        _, checks = doctor(capsys, "--config", str(config))
    clock = checks["clock:data"]
    assert clock["status"] == "warn", clock
    assert "the backend's Date header is unreadable" in clock["finding"]
    assert "'garbage'" in clock["finding"]
    assert clock["fix"]
    # the report is whole
    assert "shmem_enabled" in checks
    assert "backend:data" in checks


@pytest.mark.timeout(30)
def test_a_date_without_a_zone_is_read_as_utc(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # RFC 5322's "-0000": UTC, with no zone said. Read as local time, a node 9 hours
    # east of Greenwich would look 9 hours off.
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        now = email.utils.formatdate(time.time(), usegmt=False).rsplit(" ", 1)[0] + " -0000"
        with answering(403, {"Date": now}) as endpoint:
            config = node_toml(tmp_path, backends=s3_backend("data", "s3://odd/pre", endpoint))
            _, checks = doctor(capsys, "--config", str(config))
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    clock = checks["clock:data"]
    assert clock["status"] == "ok", clock


@pytest.mark.timeout(30)
def test_no_date_header_and_an_odd_peer_answer_each_say_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "mine").write_text(TOKEN)
    (tmp_path / "mine").chmod(0o600)
    with answering(500, {"Date": ""}) as endpoint:
        member = endpoint.removeprefix("http://")
        peers = (
            f'\n[peers]\nself = "127.0.0.1:{free_port()}"\nmembers = ["{member}"]\n'
            f'token_file = "{tmp_path / "mine"}"\n'
        )
        config = node_toml(tmp_path, peers, backends=s3_backend("data", "s3://odd/pre", endpoint))
        _, checks = doctor(capsys, "--config", str(config))
    clock = checks["clock:data"]
    assert clock["status"] == "warn"
    assert "sent no Date header" in clock["finding"]
    peer = checks[f"peer:{member}"]
    assert peer["status"] == "warn"
    assert "answered 500" in peer["finding"]
    assert peer["fix"]  # the doctor() helper checks every non-ok check has one


@pytest.mark.timeout(30)
def test_the_peer_probe_never_follows_a_redirect(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The token goes to the member named, never where it redirects to."""
    seen: list[str] = []

    class Catcher(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization", ""))
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    catcher = http.server.HTTPServer(("127.0.0.1", 0), Catcher)
    threading.Thread(target=catcher.serve_forever, daemon=True).start()
    elsewhere = f"http://127.0.0.1:{catcher.server_address[1]}/v1/peer/pages/x"
    (tmp_path / "mine").write_text(TOKEN)
    (tmp_path / "mine").chmod(0o600)
    try:
        with answering(307, {"Location": elsewhere}) as endpoint:
            member = endpoint.removeprefix("http://")
            peers = (
                f'\n[peers]\nself = "127.0.0.1:{free_port()}"\nmembers = ["{member}"]\n'
                f'token_file = "{tmp_path / "mine"}"\n'
            )
            _, checks = doctor(capsys, "--config", str(node_toml(tmp_path, peers)))
    finally:
        catcher.shutdown()
        catcher.server_close()
    assert seen == []
    peer = checks[f"peer:{member}"]
    assert peer["status"] == "warn"
    assert "answered 307" in peer["finding"]


@pytest.mark.timeout(20)
def test_a_token_file_others_may_read_or_write_is_reported_and_an_executable_bit_is_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token = tmp_path / "mine"
    token.write_text(TOKEN)
    peers = f'\n[peers]\nself = "127.0.0.1:{free_port()}"\nmembers = []\ntoken_file = "{token}"\n'
    config = str(node_toml(tmp_path, peers))
    found = {}
    for mode in (0o600, 0o700, 0o610, 0o601, 0o640, 0o620, 0o604):
        token.chmod(mode)
        doctor(capsys, "--config", config)  # every non-ok check has its fix
        main(["doctor", "--json", "--config", config])
        checks = json.loads(capsys.readouterr().out)["checks"]  # "peers" may come twice
        found[mode] = [c for c in checks if c["name"] == "peers" and "token_file" in c["finding"]]
    assert found[0o600] == found[0o700] == found[0o610] == found[0o601] == []
    (read,) = found[0o640]
    assert "readable by its group" in read["finding"]
    assert "mode 0640" in read["finding"]
    (write,) = found[0o620]
    assert "writable by its group" in write["finding"]
    (others,) = found[0o604]
    assert "readable by every user" in others["finding"]
    assert all(c["fix"] == f"chmod 600 {token}" for c in (read, write, others))


@pytest.mark.timeout(30)
def test_an_unlisted_http_backend_is_checked_by_a_head(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # An https:// (here plain http) mirror cannot be listed: the doctor asks it for one
    # key by HEAD instead, and a 404 is an answer. A server that is gone is still an error.
    nginx_or_skip()
    served = tmp_path / "www" / "mirror"
    served.mkdir(parents=True)
    (served / "a.bin").write_bytes(b"x" * 10)
    with NginxServer(tmp_path / "www", tmp_path / "nginx") as nginx:
        table = f'[[backends]]\nname = "web"\nurl = "{nginx.url}/mirror"\nallow_http = true\n'
        status, checks = doctor(capsys, "--config", str(node_toml(tmp_path, backends=table)))
        assert checks["backend:web"]["status"] == "ok", checks["backend:web"]
        assert "read-only, not listed" in checks["backend:web"]["finding"]
        assert status == 0, checks
        url = nginx.url
    table = f'[[backends]]\nname = "web"\nurl = "{url}/mirror"\nallow_http = true\nretries = 0\n'
    status, checks = doctor(capsys, "--config", str(node_toml(tmp_path, backends=table)))
    assert status == 1
    assert checks["backend:web"]["status"] == "error", checks["backend:web"]
