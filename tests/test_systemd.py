"""Running under systemd: sd_notify over real datagram sockets, the log lines, the unit files."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import tomllib
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from chunkd.errors import ConfigError
from chunkd.gateway.logs import configure_logging
from chunkd.gateway.sdnotify import SystemdNotifier

REPO = Path(__file__).resolve().parent.parent
SYSTEMD = REPO / "systemd"


# --- sd_notify --------------------------------------------------------------------------


class Listener:
    """A datagram socket standing in for systemd's NOTIFY_SOCKET."""

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.sock = sock
        #: the address as systemd writes it in NOTIFY_SOCKET
        self.address = address

    def recv(self) -> str:
        self.sock.settimeout(2.0)
        return self.sock.recv(4096).decode()

    def pending(self) -> list[str]:
        self.sock.setblocking(False)
        got = []
        while True:
            try:
                got.append(self.sock.recv(4096).decode())
            except BlockingIOError:
                return got


@pytest.fixture(params=["path", "abstract"])
def listener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Listener]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        path = tmp_path / "notify.sock"
        sock.bind(str(path))
        address = str(path)
    else:
        name = f"chunkd-test-{uuid.uuid4().hex}"
        sock.bind("\0" + name)
        address = "@" + name
    with sock:
        yield Listener(sock, address)


def test_ready_status_stopping_arrive_exactly(listener: Listener) -> None:
    notifier = SystemdNotifier.from_env({"NOTIFY_SOCKET": listener.address})
    assert notifier.enabled
    assert notifier.address == listener.address
    assert notifier.status("opening the cache") is True
    assert listener.recv() == "STATUS=opening the cache\n"
    assert notifier.ready("serving on http://127.0.0.1:8470") is True
    assert listener.recv() == "READY=1\nSTATUS=serving on http://127.0.0.1:8470\n"
    assert notifier.ready() is True
    assert listener.recv() == "READY=1\n"
    assert notifier.stopping("flushing the index") is True
    assert listener.recv() == "STOPPING=1\nSTATUS=flushing the index\n"
    assert notifier.stopping() is True
    assert listener.recv() == "STOPPING=1\n"
    assert notifier.notify("RELOADING=1", "MONOTONIC_USEC=1") is True
    assert listener.recv() == "RELOADING=1\nMONOTONIC_USEC=1\n"
    assert listener.pending() == []


def test_watchdog_ping_arrives_exactly(listener: Listener) -> None:
    notifier = SystemdNotifier.from_env(
        {"NOTIFY_SOCKET": listener.address, "WATCHDOG_USEC": "30000000"}
    )
    assert notifier.watchdog() is True
    assert listener.recv() == "WATCHDOG=1\n"


def test_a_status_cannot_forge_another_assignment(listener: Listener) -> None:
    notifier = SystemdNotifier(listener.address)
    assert notifier.status("bad news\nREADY=1\r\u2028!")
    assert listener.recv() == "STATUS=bad news READY=1  !\n"


@pytest.mark.parametrize("line", ["READY", "=1", "READY=1\nSTATUS=x", ""])
def test_a_malformed_line_is_a_callers_bug(listener: Listener, line: str) -> None:
    notifier = SystemdNotifier(listener.address)
    with pytest.raises(ValueError, match="KEY=VALUE"):
        notifier.notify(line)
    assert listener.pending() == []


def test_a_dead_socket_does_not_raise(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="chunkd.gateway.sdnotify")
    missing = SystemdNotifier.from_env(
        {"NOTIFY_SOCKET": str(tmp_path / "gone.sock"), "WATCHDOG_USEC": "1000000"}
    )
    assert missing.enabled
    assert missing.ready("serving") is False
    assert missing.watchdog() is False
    # A socket file whose owner has gone: the kernel refuses the datagram.
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(stale))
    assert stale.exists()
    assert SystemdNotifier(str(stale)).stopping() is False
    unbound = SystemdNotifier(f"@chunkd-test-{uuid.uuid4().hex}")
    assert unbound.status("x") is False
    failures = [r for r in caplog.records if r.name == "chunkd.gateway.sdnotify"]
    assert len(failures) == 4
    assert all(r.levelno == logging.DEBUG for r in failures)
    assert "gone.sock" in failures[0].getMessage()


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {"NOTIFY_SOCKET": ""},
        {"WATCHDOG_USEC": "30000000"},
        {"NOTIFY_SOCKET": "vsock:2:1234", "WATCHDOG_USEC": "30000000"},
    ],
    ids=["unset", "empty", "watchdog-only", "not-unix"],
)
async def test_a_disabled_notifier_is_a_no_op(environ: dict[str, str]) -> None:
    notifier = SystemdNotifier.from_env(environ)
    assert not notifier.enabled
    assert notifier.address is None
    assert notifier.notify("READY=1") is False
    assert notifier.ready("serving") is False
    assert notifier.stopping() is False
    assert notifier.status("x") is False
    assert notifier.watchdog() is False
    assert notifier.watchdog_interval() is None
    async with asyncio.timeout(1.0):
        await notifier.run_watchdog(asyncio.Event())


def test_from_env_reads_os_environ(monkeypatch: pytest.MonkeyPatch, listener: Listener) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", listener.address)
    monkeypatch.setenv("WATCHDOG_USEC", "4000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    notifier = SystemdNotifier.from_env()
    assert notifier.address == listener.address
    assert notifier.watchdog_interval() == 2.0


@pytest.mark.parametrize(
    ("extra", "interval"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "200000"}, 0.1),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": ""}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "init"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        ({"WATCHDOG_USEC": "30s"}, None),
        ({"WATCHDOG_PID": str(os.getpid())}, None),
        ({}, None),
    ],
    ids=[
        "30s",
        "200ms",
        "pid-is-ours",
        "pid-empty",
        "pid-is-another",
        "pid-garbage",
        "zero",
        "negative",
        "garbage",
        "pid-without-usec",
        "none",
    ],
)
def test_watchdog_interval(extra: dict[str, str], interval: float | None) -> None:
    notifier = SystemdNotifier.from_env({"NOTIFY_SOCKET": "/run/systemd/notify", **extra})
    assert notifier.enabled
    assert notifier.watchdog_interval() == interval


def test_a_watchdog_meant_for_another_pid_sends_nothing(listener: Listener) -> None:
    notifier = SystemdNotifier.from_env(
        {
            "NOTIFY_SOCKET": listener.address,
            "WATCHDOG_USEC": "30000000",
            "WATCHDOG_PID": str(os.getpid() + 1),
        }
    )
    assert notifier.watchdog() is False
    assert notifier.ready() is True  # the rest of the protocol still applies
    assert listener.recv() == "READY=1\n"
    assert listener.pending() == []


async def test_run_watchdog_pings_until_stopped(listener: Listener) -> None:
    notifier = SystemdNotifier.from_env(
        {"NOTIFY_SOCKET": listener.address, "WATCHDOG_USEC": "200000"}
    )
    assert notifier.watchdog_interval() == 0.1
    loop = asyncio.get_running_loop()
    listener.sock.setblocking(False)
    stop = asyncio.Event()
    task = asyncio.create_task(notifier.run_watchdog(stop))
    pings = []
    async with asyncio.timeout(1.0):
        while len(pings) < 2:
            pings.append((await loop.sock_recv(listener.sock, 4096)).decode())
    assert not task.done()
    stop.set()
    async with asyncio.timeout(0.5):
        assert await task is None
    pings += listener.pending()
    assert len(pings) >= 2
    assert set(pings) == {"WATCHDOG=1\n"}


async def test_run_watchdog_returns_at_once_when_stop_is_already_set(listener: Listener) -> None:
    notifier = SystemdNotifier(listener.address, watchdog_usec=30_000_000)
    stop = asyncio.Event()
    stop.set()
    async with asyncio.timeout(1.0):
        await notifier.run_watchdog(stop)
    assert listener.pending() == []


# --- logs -------------------------------------------------------------------------------

TS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


@pytest.fixture
def root_logging() -> Iterator[logging.Logger]:
    """The root logger, put back as it was (handlers and level) after the test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)


def fail(exc: Exception) -> None:
    raise exc


def _strict_json(line: str) -> dict[str, object]:
    def refuse(constant: str) -> object:
        raise AssertionError(f"not strict JSON: {constant} in {line!r}")

    parsed = json.loads(line, parse_constant=refuse)
    assert isinstance(parsed, dict)
    return parsed


def _lines(stream: io.StringIO) -> list[str]:
    text = stream.getvalue()
    assert text.endswith("\n")
    # splitlines() breaks at more than "\n" (\r, \x1c, \u2028, ...): stricter than journald.
    lines = text.splitlines()
    assert len(lines) == text.count("\n")
    return lines


def test_json_lines_carry_the_fields_and_extras(root_logging: logging.Logger) -> None:
    stream = io.StringIO()
    configure_logging("debug", "json", stream)
    before = datetime.now(UTC)
    logging.getLogger("chunkd.test").info(
        "read %d bytes from %s",
        4096,
        "data/k",
        extra={
            "backend": "data",
            "bytes": 4096,
            "hit": True,
            "tiers": ["ram", "disk"],
            "path": Path("/var/cache/chunkd"),
            "when": before,
            "blob": b"\x00",
            "thing": object(),
        },
    )
    logging.getLogger("chunkd.other").debug("second")
    first, second = (_strict_json(line) for line in _lines(stream))
    assert list(first)[:4] == ["ts", "level", "logger", "event"]
    assert first["level"] == "info"
    assert first["logger"] == "chunkd.test"
    assert first["event"] == "read 4096 bytes from data/k"
    assert first["backend"] == "data"
    assert first["bytes"] == 4096
    assert first["hit"] is True
    assert first["tiers"] == ["ram", "disk"]
    assert first["path"] == "/var/cache/chunkd"
    assert first["when"] == str(before)
    assert first["blob"] == str(b"\x00")
    assert str(first["thing"]).startswith("<object object at")
    assert "exc" not in first
    ts = first["ts"]
    assert isinstance(ts, str)
    assert TS.match(ts)
    stamped = datetime.fromisoformat(ts)
    assert stamped.utcoffset() == timedelta(0)
    assert before - timedelta(seconds=1) <= stamped <= datetime.now(UTC)
    assert second["level"] == "debug"
    assert second["logger"] == "chunkd.other"
    assert second["event"] == "second"


def test_json_carries_the_traceback_on_one_line(root_logging: logging.Logger) -> None:
    stream = io.StringIO()
    configure_logging(stream=stream)
    log = logging.getLogger("chunkd.test")
    try:
        fail(ValueError("boom\nsecond line"))
    except ValueError:
        log.exception("request failed", extra={"key": "data/k"})
    (line,) = _lines(stream)
    record = _strict_json(line)
    assert record["level"] == "error"
    assert record["event"] == "request failed"
    assert record["key"] == "data/k"
    exc = record["exc"]
    assert isinstance(exc, str)
    assert exc.startswith("Traceback (most recent call last):")
    assert exc.endswith("ValueError: boom\nsecond line")
    assert list(record)[-1] == "exc"


def test_json_a_newline_in_a_message_stays_on_one_line(root_logging: logging.Logger) -> None:
    stream = io.StringIO()
    configure_logging("info", "json", stream)
    message = "one\ntwo\r\nthree\u2028four\x85five\x1cend"
    log = logging.getLogger("chunkd.test")
    log.warning(message, extra={"detail": "a\nb", "ünï": "cödé"})
    log.info("plain", stack_info=True)
    first, second = (_strict_json(line) for line in _lines(stream))
    assert first["event"] == message
    assert first["detail"] == "a\nb"
    assert first["ünï"] == "cödé"
    assert "cödé" in stream.getvalue()  # readable, not \u-escaped
    stack = second["stack"]
    assert isinstance(stack, str)
    assert stack.startswith("Stack (most recent call last):")


def test_json_values_it_cannot_hold_become_strings(root_logging: logging.Logger) -> None:
    stream = io.StringIO()
    configure_logging("info", "json", stream)
    loop: list[object] = []
    loop.append(loop)
    logging.getLogger("chunkd.test").info(
        "odd values",
        extra={
            "ratio": float("nan"),
            "by_pair": {(1, 2): 3},
            "loop": loop,
            "fine": 1.5,
            "path": Path("/x"),
            "event": "clash",
        },
    )
    (line,) = _lines(stream)
    record = _strict_json(line)
    assert record["event"] == "odd values"
    assert record["extra_event"] == "clash"
    assert record["ratio"] == "nan"
    assert record["by_pair"] == "{(1, 2): 3}"
    assert record["loop"] == "[[...]]"
    assert record["fine"] == 1.5
    assert record["path"] == "/x"


def test_text_format_is_one_readable_line(root_logging: logging.Logger) -> None:
    stream = io.StringIO()
    configure_logging("INFO", "text", stream)
    log = logging.getLogger("chunkd.gateway.test")
    log.info(
        "serving on %s",
        "http://127.0.0.1:8470",
        extra={"backends": 2, "note": "two words", "ok": True, "path": Path("/x")},
    )
    log.debug("not written at info")
    log.warning("line one\nline two", extra={"detail": 'say "hi"\n'})
    try:
        fail(RuntimeError("bad"))
    except RuntimeError:
        log.exception("failed")
    first, second, third = _lines(stream)
    assert re.fullmatch(
        r"\S+Z info    chunkd\.gateway\.test serving on http://127\.0\.0\.1:8470 "
        r'backends=2 note="two words" ok=true path=/x',
        first,
    ), first
    assert TS.match(first.split(" ", 1)[0])
    assert second.endswith(r'warning chunkd.gateway.test line one\nline two detail="say \"hi\"\n"')
    assert " error   chunkd.gateway.test failed exc=" in third
    exc = json.loads(third.split(" exc=", 1)[1])
    assert exc.startswith("Traceback")
    assert exc.endswith("RuntimeError: bad")


def test_configure_twice_replaces_its_handler(root_logging: logging.Logger) -> None:
    others = list(root_logging.handlers)  # e.g. pytest's own capture handlers
    first, second = io.StringIO(), io.StringIO()
    configure_logging("info", "json", first)
    configure_logging("info", "text", second)
    configure_logging("warning", "text", second)
    assert len(root_logging.handlers) == len(others) + 1
    assert all(handler in root_logging.handlers for handler in others)
    log = logging.getLogger("chunkd.test")
    log.info("dropped at warning")
    log.warning("once")
    assert first.getvalue() == ""
    (line,) = _lines(second)
    assert line.endswith("warning chunkd.test once")
    assert root_logging.level == logging.WARNING


def test_configure_writes_to_stderr_by_default(
    root_logging: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging()
    logging.getLogger("chunkd.test").info("to stderr")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert _strict_json(captured.err.strip())["event"] == "to stderr"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"level": "loud"}, "log level 'loud' is unknown; use one of debug, info, warning"),
        ({"level": ""}, "log level '' is unknown"),
        ({"fmt": "xml"}, "log format 'xml' is unknown; use one of json, text"),
    ],
)
def test_invalid_level_or_format_is_a_clear_error(
    root_logging: logging.Logger, kwargs: dict[str, str], message: str
) -> None:
    handlers = list(root_logging.handlers)
    with pytest.raises(ValueError, match=re.escape(message)) as raised:
        configure_logging(**kwargs)
    assert isinstance(raised.value, ConfigError)
    assert root_logging.handlers == handlers


# --- unit files -------------------------------------------------------------------------


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A systemd unit as section -> key -> values (a key may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        assert not line.endswith("\\"), f"line {number}: keep each setting on one line"
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        assert sep, f"line {number} is neither a section, a comment nor KEY=VALUE: {raw!r}"
        assert current is not None, f"line {number} comes before any section"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


@pytest.fixture(scope="module")
def unit() -> dict[str, dict[str, list[str]]]:
    return parse_unit((SYSTEMD / "chunkd.service").read_text())


def test_unit_has_the_required_settings(unit: dict[str, dict[str, list[str]]]) -> None:
    assert set(unit) == {"Unit", "Service", "Install"}
    service = {key: values[-1] for key, values in unit["Service"].items()}
    expected = {
        "Type": "notify",
        "NotifyAccess": "main",
        "ExecStart": "/usr/bin/chunkd serve --config /etc/chunkd/chunkd.toml",
        "User": "chunkd",
        "Group": "chunkd",
        "RuntimeDirectory": "chunkd",
        "RuntimeDirectoryMode": "0750",
        "CacheDirectory": "chunkd",
        "ConfigurationDirectory": "chunkd",
        "WatchdogSec": "30",
        "TimeoutStopSec": "30",
        "Restart": "on-failure",
        "RestartSec": "2",
        "LimitNOFILE": "1048576",
        "LimitMEMLOCK": "infinity",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "PrivateDevices": "yes",
        "NoNewPrivileges": "yes",
        "MemoryDenyWriteExecute": "yes",
        "SystemCallArchitectures": "native",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6 AF_NETLINK",
        "CapabilityBoundingSet": "",
        "UMask": "0027",
    }
    assert {key: service.get(key) for key in expected} == expected
    assert unit["Service"]["SystemCallFilter"][0] == "@system-service"
    for key in (
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "ProtectKernelLogs",
        "ProtectControlGroups",
        "ProtectClock",
        "ProtectHostname",
        "RestrictNamespaces",
        "RestrictRealtime",
        "RestrictSUIDSGID",
        "LockPersonality",
    ):
        assert service.get(key) == "yes", key
    # Credentials come from a drop-in's EnvironmentFile=, never from the unit.
    assert not {"Environment", "EnvironmentFile"} & set(service)
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip(
            "systemd-analyze is not on PATH (Debian/Ubuntu package: systemd); "
            "the unit was only checked as an INI file"
        )
    # verify checks that ExecStart's program exists, so point it at a stand-in.
    program = tmp_path / "chunkd"
    program.write_text("#!/bin/sh\nexit 0\n")
    program.chmod(0o755)
    text = (SYSTEMD / "chunkd.service").read_text()
    assert text.count("ExecStart=/usr/bin/chunkd ") == 1
    copy = tmp_path / "chunkd.service"
    copy.write_text(text.replace("ExecStart=/usr/bin/chunkd ", f"ExecStart={program} "))
    done = subprocess.run(
        [tool, "verify", "--man=no", str(copy)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # verify exits 0 even for unknown keys and bad values, which it only prints.
    about_us = [line for line in done.stderr.splitlines() if "chunkd.service" in line]
    assert done.returncode == 0, done.stderr
    assert about_us == [], done.stderr


def test_sysusers_and_tmpfiles_make_the_user_and_directories(tmp_path: Path) -> None:
    sysusers, tmpfiles = shutil.which("systemd-sysusers"), shutil.which("systemd-tmpfiles")
    if sysusers is None or tmpfiles is None:
        pytest.skip("systemd-sysusers/systemd-tmpfiles are not on PATH (package: systemd)")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    done = subprocess.run(
        [sysusers, f"--root={root}", str(SYSTEMD / "chunkd.sysusers")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    users = {
        line.split(":")[0]: line.split(":")
        for line in (root / "etc/passwd").read_text().splitlines()
    }
    groups = {
        line.split(":")[0]: line.split(":")
        for line in (root / "etc/group").read_text().splitlines()
    }
    user = users["chunkd"]
    assert user[5] == "/var/cache/chunkd"
    assert user[6].endswith("nologin")
    assert user[3] == groups["chunkd"][2]
    if os.geteuid() != 0:
        pytest.skip("systemd-tmpfiles --create needs root to chown; the user part passed")
    done = subprocess.run(
        [tmpfiles, f"--root={root}", "--create", str(SYSTEMD / "chunkd.tmpfiles")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    for path in ("run/chunkd", "var/cache/chunkd"):
        made = (root / path).stat()
        assert (made.st_mode & 0o7777, made.st_uid, made.st_gid) == (
            0o750,
            int(user[2]),
            int(user[3]),
        ), path


def test_tmpfiles_never_ages_the_cache() -> None:
    entries = [
        line.split()
        for line in (SYSTEMD / "chunkd.tmpfiles").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert entries == [
        ["d", "/run/chunkd", "0750", "chunkd", "chunkd", "-"],
        ["d", "/var/cache/chunkd", "0750", "chunkd", "chunkd", "-"],
    ]


def test_example_config_parses_and_keeps_credentials_out() -> None:
    text = (SYSTEMD / "chunkd.toml").read_text()
    config = tomllib.loads(text)
    assert config["server"] == {"listen": "127.0.0.1:8470", "socket": "/run/chunkd/chunkd.sock"}
    assert config["cache"] == {
        "dir": "/var/cache/chunkd",
        "ram_bytes": "8GiB",
        "disk_bytes": "200GiB",
        "chunk_bytes": "4MiB",
    }
    (backend,) = config["backends"]
    assert backend == {
        "name": "data",
        "url": "s3://bucket/prefix",
        "writable": False,
        "revalidate": "immutable",
    }
    assert "# endpoint = " in text
    assert "CHUNKD_<SECTION>_<KEY>" in text
    assert "CHUNKD_BACKENDS_<NAME>_<KEY>" in text
    assert "EnvironmentFile=" in text


def test_readme_gives_the_install_steps() -> None:
    readme = (SYSTEMD / "README.md").read_text()
    for step in (
        "install -D",
        "systemd-sysusers",
        "systemd-tmpfiles --create",
        "systemctl enable --now chunkd",
    ):
        assert step in readme, step
