"""Malformed HTTP requests cost a few log lines in all, never a line and a traceback each."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp.http_exceptions import BadStatusLine

from chunkd.gateway.logs import MalformedRequestLog
from tests.conftest import Daemon

# One of each kind aiohttp refuses before routing; each is sent on its own connection.
MALFORMED = {
    "request line": b"GARBAGE\r\n\r\n",
    "TLS to the HTTP port": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40,
    "method": b"G\x01T / HTTP/1.1\r\nHost: x\r\n\r\n",
    "version": b"GET / HTTP/9.x\r\nHost: x\r\n\r\n",
    "header name": b"GET / HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n",
    "header without colon": b"GET / HTTP/1.1\r\nHost: x\r\nnocolon\r\n\r\n",
    "oversized header": b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n",
    "oversized request line": b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "chunked framing": (
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhelloXX\r\n0\r\n\r\n"
    ),
    "chunk size": (
        b"POST /v1/warm/local/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"zz\r\nhello\r\n0\r\n\r\n"
    ),
    "length and chunked": (
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\n"
    ),
    "content length": b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    "NUL in the target": b"GET /\x00 HTTP/1.1\r\nHost: x\r\n\r\n",
}
ROUNDS = 250  # 3,250 malformed requests
BURST = 10  # lines the daemon writes one by one per minute, before it sums up


def send(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        answer = b""
        try:
            conn.sendall(payload)
            while data := conn.recv(65536):
                answer += data
        except ConnectionResetError:  # the daemon closed while the request was still coming
            pass
        return answer


def test_malformed_requests_are_counted_and_logged_a_few_lines_in_all(
    start_daemon, tmp_path: Path
) -> None:
    files = tmp_path / "files"
    daemon: Daemon = start_daemon(
        f'[server]\nlog_format = "json"\n\n[cache]\ndir = "{tmp_path / "cache"}"\n'
        'ram_bytes = "64MiB"\ndisk_bytes = "128MiB"\ndisk_min_free_bytes = 0\n\n'
        f'[[backends]]\nname = "local"\nurl = "file://{files}"\n'
    )
    payloads = list(MALFORMED.values()) * ROUNDS
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda p: send(daemon.port, p), payloads))
    assert sum(bool(re.match(rb"HTTP/1\.[01] 400 ", a)) for a in answers) > len(payloads) // 2
    assert daemon.get("/healthz")[0] == 200
    assert daemon.metric("chunkd_http_malformed_requests_total") == len(payloads)
    assert daemon.stop() == 0

    events = [json.loads(line) for line in daemon.log.read_text().splitlines()]
    noise = [e for e in events if e["logger"].startswith("aiohttp")]
    assert all(e["level"] in ("info", "debug") for e in noise), noise[:3]
    assert not [e for e in noise if "exc" in e or "Traceback" in e["event"]], noise[:3]
    one_by_one = [e for e in noise if e["event"].startswith("malformed HTTP request from ")]
    summaries = [
        e for e in noise if re.fullmatch(r"\d+ more malformed HTTP requests? .*", e["event"])
    ]
    assert len(noise) == len(one_by_one) + len(summaries)
    assert 1 <= len(one_by_one) <= BURST * 2  # the run may span two minutes
    assert 1 <= len(summaries) <= 2
    told = len(one_by_one) + sum(int(e["event"].split()[0]) for e in summaries)
    assert told == len(payloads)
    assert all(e["remote"] == "127.0.0.1" and e["reason"] for e in one_by_one), one_by_one[:3]


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def server_logger() -> Iterator[tuple[logging.Logger, Lines]]:
    logger = logging.getLogger("tests.http_logs.server")
    lines = Lines()
    logger.addHandler(lines)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    yield logger, lines
    logger.removeHandler(lines)


def refuse(log: MalformedRequestLog) -> None:
    # What aiohttp's RequestHandler.handle_error does with a request it cannot parse.
    log.exception("Error handling request from %s", "10.0.0.7", exc_info=BadStatusLine("GARBAGE"))


def test_the_log_tells_every_malformed_request_a_few_lines_per_interval(server_logger) -> None:
    logger, lines = server_logger
    now = [1000.0]
    counted = []
    log = MalformedRequestLog(
        logger, lambda: counted.append(1), burst=3, interval=60.0, clock=lambda: now[0]
    )
    for _ in range(50):
        refuse(log)
    now[0] += 59
    refuse(log)
    assert [r.getMessage() for r in lines.records] == [
        "malformed HTTP request from 10.0.0.7 refused: Bad status line 'GARBAGE'"
    ] * 3
    now[0] += 2  # the next interval: first the sum of the last one
    refuse(log)
    assert lines.records[3].getMessage() == (
        "48 more malformed HTTP requests in the last 61 s (not logged one by one)"
    )
    assert lines.records[4].getMessage().startswith("malformed HTTP request from 10.0.0.7")
    refuse(log)
    refuse(log)
    refuse(log)  # past the burst again
    log.close()
    assert lines.records[-1].getMessage().startswith("1 more malformed HTTP request in the last")
    assert len(lines.records) == 8
    assert len(counted) == 55
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in lines.records)
    told = sum(getattr(r, "malformed", 0) or ("remote" in r.__dict__) for r in lines.records)
    assert told == 55


async def test_the_summary_comes_when_the_interval_ends(server_logger) -> None:
    logger, lines = server_logger
    log = MalformedRequestLog(logger, lambda: None, burst=1, interval=0.2)
    for _ in range(4):
        refuse(log)
    assert len(lines.records) == 1
    await asyncio.sleep(0.4)  # no further request needed
    assert [r.getMessage().split(" (")[0] for r in lines.records[1:]] == [
        "3 more malformed HTTP requests in the last 0 s"
    ]
    log.close()
    assert len(lines.records) == 2


def test_other_records_pass_unchanged(server_logger) -> None:
    logger, lines = server_logger
    log = MalformedRequestLog(logger, lambda: pytest.fail("counted"))
    log.exception("Error handling request from %s", "127.0.0.1", exc_info=RuntimeError("a bug"))
    log.debug("Ignored premature client disconnection")
    assert [(r.levelno, r.getMessage()) for r in lines.records] == [
        (logging.ERROR, "Error handling request from 127.0.0.1"),
        (logging.DEBUG, "Ignored premature client disconnection"),
    ]
    assert lines.records[0].exc_info is not None
