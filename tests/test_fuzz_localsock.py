"""Fuzzing the local socket: hostile frames and op sequences against a real daemon.

Hypothesis writes whole connections: a hello (mostly), then frames built from the op
table (:data:`chunkd.client.protocol.OPS`) with fields valid, mutated, of the wrong
type, out of bounds, huge, ``NaN``, nested deep, and raw header bytes that are not
JSON chunkd takes; payloads on requests; fds (memfds sealed or not, a pipe, a socket,
a directory, more than :data:`MAX_FDS`) where the op takes none and none where it
takes some; reads of known files whose bytes are checked; and, last, a frame that
breaks the framing (lengths over the limits, cut off, garbage bytes). Properties:

* every frame the daemon can stay in step with gets one well-formed answer that
  echoes its id and names the fds it carries, and an error names a class of the
  :mod:`chunkd.errors` family, never the daemon's own failure;
* a frame that breaks the framing closes that connection and no other (a second
  connection, open all along, still reads the right bytes after each one);
* reads of known files return the right bytes in between;
* the daemon stays alive, ``/healthz`` answers, and once the connections are closed
  it holds no more fds than before.

Bounded for the suite (see ``EXAMPLES``); ``CHUNKD_FUZZ_SCALE=10`` tries ten times as
many. Each run prints its seed; ``CHUNKD_FUZZ_SEED=N`` replays one (a failure's
message gives the command).
"""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from chunkd import memfd
from chunkd.client.protocol import (
    INLINE_MAX,
    MAX_FDS,
    MAX_HEADER,
    MAX_ID_BYTES,
    MAX_PAYLOAD,
    MAX_RANGES,
    OPS,
    PREFIX,
    VERSION,
    Field,
    decode_header,
    encode_frame,
    recv_frame,
)
from chunkd.client.protocol.ops import MAX_DATASET_NAME
from chunkd.errors import ChunkdError, ProtocolError, error_class
from chunkd.memfd import close_all

from .conftest import Daemon
from .test_localsock import assemble, fd_count

# -- seeds and counts, shared with test_fuzz_http ----------------------------------------

SEED_ENV = "CHUNKD_FUZZ_SEED"
SCALE_ENV = "CHUNKD_FUZZ_SCALE"
#: shrink a failure to a small example: off in the suite, where each step of shrinking
#: is a round trip to a server (and a hang would be one timeout per step)
SHRINK_ENV = "CHUNKD_FUZZ_SHRINK"


def fuzz_seed() -> int:
    """The seed of this run: ``$CHUNKD_FUZZ_SEED``, or a new one (printed, to replay)."""
    text = os.environ.get(SEED_ENV, "").strip()
    return int(text) if text else random.SystemRandom().randrange(1 << 32)


def fuzz_examples(count: int) -> int:
    """``count`` examples, times ``$CHUNKD_FUZZ_SCALE`` (1 in the suite)."""
    return max(1, round(count * float(os.environ.get(SCALE_ENV) or 1)))


def fuzz_settings(count: int) -> settings:
    """Settings for a fuzz test against a real server.

    No deadline (a daemon's answer takes what it takes), no example database (the seed
    replays a run), and no health checks: a server round trip per example is slow by
    their measure, and that is the point.
    """
    return settings(
        max_examples=fuzz_examples(count),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=(Phase.explicit, Phase.generate)
        + ((Phase.shrink,) if os.environ.get(SHRINK_ENV) == "1" else ()),
        print_blob=False,
    )


@contextmanager
def replayable(request: pytest.FixtureRequest, run_seed: int, what: str) -> Iterator[None]:
    """Say how to replay ``what`` if it fails; print its seed either way."""
    replay = f"{SEED_ENV}={run_seed} {SHRINK_ENV}=1 .venv/bin/pytest '{request.node.nodeid}' -q -s"
    print(f"{what}: seed {run_seed} (replay: {replay})")
    try:
        yield
    except BaseException as exc:
        exc.add_note(f"fuzz seed {run_seed}; replay this run with: {replay}")
        raise


# -- the daemon ---------------------------------------------------------------------------

KiB = 1 << 10
CHUNK = 64 * KiB  # small chunks: a read of a few hundred KiB spans many memfds
#: suite budget of this file: about 1,800 frames on 300 connections in ~15 s
EXAMPLES = 300

TOML = """
[server]
shutdown_timeout = "5s"
socket_send_timeout = "5s"

[cache]
dir = "{cache}"
ram_bytes = "64MiB"
disk_bytes = "128MiB"
disk_min_free_bytes = 0
chunk_bytes = "64KiB"
fsync = "never"

[datasets]
registry = "local/datasets"

[[backends]]
name = "local"
url = "file://{data}"
writable = true
revalidate = "1s"
"""


@dataclass
class Node:
    """The daemon under fuzz, and the objects it serves whose bytes the test knows."""

    daemon: Daemon
    socket: Path
    known: dict[str, bytes]


def known_objects() -> dict[str, bytes]:
    rng = random.Random(15)
    return {
        "local/known/empty.bin": b"",
        "local/known/small.bin": rng.randbytes(1000),
        "local/known/inline.bin": rng.randbytes(INLINE_MAX),  # the most answered inline
        "local/known/mid.bin": rng.randbytes(3 * CHUNK + 17),
        "local/known/big.bin": rng.randbytes(20 * CHUNK + 5),
        "local/known/ü ñ/space.bin": rng.randbytes(300),
    }


@pytest.fixture
def node(start_daemon: Callable[..., Daemon], tmp_path: Path) -> Node:
    work, data = tmp_path / "work", tmp_path / "data"
    known = known_objects()
    for name, blob in known.items():
        path = data / name.removeprefix("local/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(blob)
    daemon = start_daemon(TOML.format(cache=tmp_path / "cache", data=data), cwd=work)
    return Node(daemon, work / "chunkd.sock", known)


def connect(node: Node, *, hello: bool = True) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)  # an answer that never comes fails the test, it does not hang it
    sock.connect(str(node.socket))
    if hello:
        answer = exchange(sock, encode({"op": "hello", "version": VERSION, "id": 0}))
        assert answer.header["ok"], answer.header
    return sock


# -- what is sent --------------------------------------------------------------------------

#: header text that json.dumps cannot write: numbers past a float, odd literals, and
#: JSON that is not JSON. A value of the form RAW + TOKEN is replaced by TOKEN.
RAW = "\x00raw:"
RAW_TOKENS = [
    "NaN",
    "-NaN",
    "Infinity",
    "-Infinity",
    "1e400",
    "-1e400",
    "1" + "0" * 400,
    "-1" + "0" * 400,
    "1.5e-400",
    "-0",
    "-0.0",
    "1E2",
    "0x10",
    "01",
    "+1",
    ".5",
    "1e",
    "tru",
    "nul",
    '"\\ud800"',
    '"\\udfff\\ud800"',
    '"\\u0000"',
    '"\\x41"',
    "'single'",
    '"a" "b"',
]


def raw(token: str) -> str:
    return RAW + token


def encode(header: object, *, ascii_only: bool = True) -> bytes:
    """A header's bytes; RAW values are spliced in as written, and lone surrogates
    go out as ``\\ud800`` escapes (``ascii_only``) or as bytes that are not UTF-8."""
    text = json.dumps(header, allow_nan=True, ensure_ascii=ascii_only)
    for token in sorted(set(_raw_values(header)), key=len, reverse=True):
        text = text.replace(json.dumps(raw(token), ensure_ascii=ascii_only), token)
    return text.encode("utf-8", "surrogatepass")


def _raw_values(value: object) -> Iterator[str]:
    if isinstance(value, str) and value.startswith(RAW):
        yield value[len(RAW) :]
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _raw_values(key)
            yield from _raw_values(item)
    elif isinstance(value, list):
        for item in value:
            yield from _raw_values(item)


def weighted(*options: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of the strategies, each drawn ``weight`` times in the sum of the weights."""
    table = [strategy for weight, strategy in options for _ in range(weight)]
    return st.integers(0, len(table) - 1).flatmap(table.__getitem__)


SURROGATE = st.integers(0xD800, 0xDFFF).map(chr)
TEXT = weighted(
    (8, st.text(st.characters(codec="utf-8"), max_size=24)),
    (1, st.text(st.characters(codec="utf-8") | SURROGATE, max_size=8)),
)
SCALAR = weighted(
    (2, st.none() | st.booleans()),
    (2, st.integers()),
    (1, st.integers(min_value=1 << 63, max_value=1 << 200)),
    (2, st.floats(allow_nan=False, allow_infinity=False)),
    (3, TEXT),
    # NaN, Infinity (json.dumps writes them as such) and text that is not JSON: each
    # makes the whole header one chunkd refuses, so they are rare
    (1, st.floats() | st.sampled_from(RAW_TOKENS).map(raw)),
)
JSON_VALUE = st.recursive(
    SCALAR,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=10,
)
NESTED = st.integers(1, 20_000).map(lambda d: raw("[" * d + "]" * d)) | st.integers(1, 3_000).map(
    lambda d: raw('{"a":' * d + "1" + "}" * d)
)


def names(known: list[str]) -> st.SearchStrategy[str]:
    """``BACKEND/KEY`` names: known ones, plausible ones and path tricks."""
    tricky = st.sampled_from(
        [
            "",
            "/",
            "local",
            "local/",
            "local//known/small.bin",
            "local/../data/known/small.bin",
            "local/known/../known/small.bin",
            "local/./known/small.bin",
            "local/known\\small.bin",
            "local/known/small.bin\x00",
            "local/known/small.bin\n",
            "local/%2e%2e/x",
            "local/\ud800",
            "LOCAL/known/small.bin",
            "nope/x",
            "/etc/passwd",
            "local//etc/passwd",
            "local/" + "x" * 1195,
            "local/" + "x" * 1194,
            "local/" + "é" * 600,
            "local/datasets",
            "local/checkpoints/x",
            "local/chunks/",
        ]
    )
    plausible = st.builds(lambda key: "local/" + key, TEXT)
    return weighted((6, st.sampled_from(known)), (2, tricky), (2, plausible), (1, TEXT))


DATASET_NAMES = weighted(
    (
        4,
        st.from_regex(
            r"[a-z][a-z0-9_-]{0,12}(/[a-z0-9_-]{1,8}){0,2}(@([0-9]{1,3}|latest))?", fullmatch=True
        ),
    ),
    (1, TEXT),
)


def valid_value(field: Field, name: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    """A value inside the field's bounds (bounded further where a value would make
    the daemon wait: a ckpt_wait timeout)."""
    if field.kind == "text":
        if field.name in ("name", "ref", "prefix") and field.high <= MAX_DATASET_NAME + 80:
            return DATASET_NAMES  # a ds_* op: a dataset's name, not BACKEND/KEY
        if field.name in ("name", "prefix", "target", "to", "start_after"):
            return name
        if field.name == "backend":
            return st.sampled_from(["local", "nope", "", "LOCAL"])
        return TEXT
    if field.kind == "whole":
        low, high = int(field.low), int(field.high)
        small = st.integers(low, min(high, low + 5 * CHUNK))
        return small | st.sampled_from([low, high, min(high, low + 1), min(high, 1 << 31)])
    if field.kind == "number":
        top = 0.2 if field.name == "timeout" else field.high
        return st.floats(field.low, top) | st.just(field.low)
    if field.kind == "flag":
        return st.booleans()
    if field.kind == "choice":
        return st.sampled_from(field.choices)
    if field.kind == "texts":
        return st.lists(name, max_size=6)
    ranges = st.tuples(name, st.integers(0, 30 * CHUNK), st.integers(0, 30 * CHUNK)).map(list)
    return st.lists(ranges, min_size=1, max_size=8)


def wrong_value(field: Field) -> st.SearchStrategy[Any]:
    """A value the field must refuse, or one at the edge of what it takes."""
    edges: list[Any] = []
    if field.kind in ("whole", "number"):
        low, high = field.low, field.high
        edges += [low - 1, high + 1, high * 2 + 1, -(1 << 64), 1 << 64, 10**30, 0.5, -0.0]
        edges += [float(high) * 10, raw("1e400"), raw("NaN"), raw("-Infinity")]
    if field.kind == "text":
        limit = int(field.high)
        edges += ["x" * (limit + 1), "é" * (limit // 2 + 1), "\ud800" * (limit // 6 + 1)]
    if field.kind == "ranges":
        edges += [[], [["local/known/small.bin", 0, 1]] * (MAX_RANGES + 1)]
        edges += [[["local/known/small.bin", -1, 1]], [["local/known/small.bin", 0]]]
        edges += [[["local/known/small.bin", 0, 1 << 63]], [[1, 2, 3]], "ranges"]
    if field.kind == "choice":
        edges += [c.upper() for c in field.choices]
    if not edges:
        return weighted((6, JSON_VALUE), (1, NESTED))
    return weighted((5, st.sampled_from(edges)), (5, JSON_VALUE), (1, NESTED))


# Ops whose valid request waits by design: a commit waits for its ranks' parts until they
# come or its client goes (tests/test_checkpoint_bounds.py bounds what such waits cost);
# a fuzzed one with a valid shape would wait out the exchange's timeout.
WAITS = frozenset({"ckpt_commit"})


@st.composite
def request_headers(draw: st.DrawFn, known: list[str]) -> dict[str, Any]:
    """A request: an op of the table (or not), each field valid, absent or wrong."""
    # SCALAR, not JSON_VALUE: an op that is a list or an object is a known bug of the
    # daemon's (test_an_op_that_is_not_a_string_is_refused); widen this when it is fixed.
    op = draw(weighted((18, st.sampled_from(sorted(set(OPS) - WAITS))), (1, SCALAR)))
    header: dict[str, Any] = {"op": op}
    name = names(known)
    spec = OPS.get(op) if isinstance(op, str) else None
    for field in spec.fields if spec is not None else ():
        roll = draw(st.integers(0, 9))
        if roll < 7 and (field.required or roll < 4):
            header[field.name] = draw(valid_value(field, name))
        elif roll >= 8:
            header[field.name] = draw(wrong_value(field))
    if spec is not None and spec.name == "hello" and draw(st.integers(0, 3)):
        header["version"] = VERSION
    if draw(st.integers(0, 9)) == 0:
        header[draw(TEXT)] = draw(JSON_VALUE)
    if draw(st.integers(0, 9)):
        header["id"] = draw(
            st.integers()
            | TEXT
            | JSON_VALUE
            # A long id, that every answer echoes. Not so long that the answer cannot fit
            # in a header: a known bug of the daemon's (test_an_id_too_long_to_echo_...);
            # take the bound up to MAX_HEADER - 40 when it is fixed.
            | st.integers(1000, MAX_HEADER // 2).map(lambda n: "i" * n)
        )
    return header


#: what a fd attached to a request can be
FD_KINDS = ("memfd", "sealed", "sealed_json", "pipe", "devnull", "dir", "socket")


@dataclass(frozen=True)
class Frame:
    """One frame the daemon can stay in step with: header bytes, payload, fds."""

    body: bytes
    payload: bytes = b""
    fds: tuple[str, ...] = ()
    contents: bytes = b""  # what the memfds hold
    check: tuple[str, int, int | None, bool] | None = None  # a known read: name, offset, ...

    def __repr__(self) -> str:  # short: Hypothesis prints (and warns of) long reprs
        fds = f", fds={_short(self.fds)}" if self.fds else ""
        payload = f", payload={_short(self.payload)}" if self.payload else ""
        return f"Frame({_short(self.body)}{payload}{fds})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # Hypothesis' printer
        printer.text(repr(self))


@dataclass(frozen=True)
class Break:
    """What ends a connection: bytes that break the framing, sent then half-closed."""

    data: bytes
    fds: tuple[str, ...] = ()
    why: str = ""

    def __repr__(self) -> str:
        fds = f", fds={self.fds}" if self.fds else ""
        return f"Break({self.why}: {_short(self.data)}{fds})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))


def _short(value: object, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 40]}...({len(text)} chars)"


def fd_kinds(op: object) -> st.SearchStrategy[tuple[str, ...]]:
    spec = OPS.get(op) if isinstance(op, str) else None
    low, high = spec.fds if spec is not None else (0, 0)
    kind = st.sampled_from(FD_KINDS)
    right = st.lists(kind, min_size=low, max_size=high).map(tuple)
    some = st.lists(kind, min_size=0, max_size=3).map(tuple)
    many = st.just(("devnull",) * (MAX_FDS + 1))  # the kernel cuts the rest
    return weighted((17, right), (2, some), (1, many))


@st.composite
def frames(draw: st.DrawFn, known: dict[str, bytes]) -> Frame:
    roll = draw(st.integers(0, 19))
    if roll < 4:  # a read of a known object whose bytes the test checks
        name = draw(st.sampled_from(sorted(known)))
        size = len(known[name])
        offset = draw(st.integers(0, max(0, size - 1)))
        length = draw(st.none() | st.integers(0, size - offset))
        inline = draw(st.booleans())
        if size == 0:
            offset, length = 0, None
        header = {"op": "read", "name": name, "offset": offset, "inline": inline, "id": roll}
        if length is not None:
            header["length"] = length
        return Frame(encode(header), check=(name, offset, length, inline))
    if roll < 6:  # header bytes that are not a JSON object chunkd takes
        body = draw(
            st.binary(min_size=1, max_size=200)
            | st.sampled_from([b"[]", b"null", b"1", b'"op"', b"{", b"\xff\xfe", b"{}"])
            | NESTED.map(lambda token: encode({"op": "stat", "name": token}))
            | st.sampled_from(RAW_TOKENS).map(lambda t: f'{{"op":"read","offset":{t}}}'.encode())
        )
        return Frame(body, payload=draw(st.sampled_from([b"", b"", b"x"])))
    header = draw(request_headers(sorted(known)))
    body = encode(header, ascii_only=draw(st.integers(0, 9)) > 0)
    if len(body) > MAX_HEADER:  # the daemon could not stay in step: a header cut short
        body = encode({"op": "stat", "name": "local/known/small.bin", "id": "cut"})
    payload = draw(weighted((18, st.just(b"")), (1, st.just(b"p")), (1, st.just(b"\0" * 999))))
    fds = draw(fd_kinds(header.get("op")))
    contents = draw(st.binary(max_size=64) | JSON_VALUE.map(lambda v: encode(v)))
    return Frame(body, payload, fds, contents)


@st.composite
def breaks(draw: st.DrawFn) -> Break:
    body = encode({"op": "stat", "name": "local/known/small.bin", "id": 1})
    kind = draw(st.integers(0, 5))
    fds = draw(st.sampled_from([(), (), ("memfd",), ("sealed", "pipe")]))
    if kind == 0:
        length = draw(st.integers(MAX_HEADER + 1, (1 << 32) - 1))
        return Break(PREFIX.pack(length, 0) + body, fds, "a header length over the limit")
    if kind == 1:
        length = draw(st.integers(MAX_PAYLOAD + 1, (1 << 32) - 1))
        return Break(PREFIX.pack(len(body), length) + body, fds, "a payload over the limit")
    if kind == 2:
        return Break(PREFIX.pack(0, draw(st.integers(0, 10))), fds, "an empty header")
    if kind == 3:
        cut = draw(st.integers(0, len(body) - 1))
        return Break(PREFIX.pack(len(body), 0) + body[:cut], fds, "a frame cut off")
    if kind == 4:
        cut = draw(st.integers(1, PREFIX.size - 1))
        return Break(PREFIX.pack(len(body), 0)[:cut], fds, "a prefix cut off")
    return Break(draw(st.binary(min_size=1, max_size=300)), fds, "garbage")


@st.composite
def connections(draw: st.DrawFn, known: dict[str, bytes]) -> list[Frame | Break]:
    """One connection's frames: a hello (mostly), frames, and maybe a break at the end."""
    actions: list[Frame | Break] = []
    if draw(st.integers(0, 9)):
        actions.append(Frame(encode({"op": "hello", "version": VERSION, "id": "hi"})))
    actions += draw(st.lists(frames(known), max_size=8))
    if draw(st.integers(0, 3)) == 0:
        actions.append(draw(breaks()))
    return actions


# -- sending and checking --------------------------------------------------------------------


@contextmanager
def attached(kinds: tuple[str, ...], contents: bytes, tmp: Path) -> Iterator[list[int]]:
    """Fds of ``kinds`` to attach to a frame; ours are closed afterwards, and the
    write end of a pipe stays open until then (a daemon that read it would hang)."""
    with ExitStack() as stack:
        fds: list[int] = []

        def keep(fd: int) -> int:
            stack.callback(os.close, fd)
            return fd

        for kind in kinds:
            if kind == "memfd":
                fds.append(keep(memfd.create("fuzz")))
            elif kind in ("sealed", "sealed_json"):
                fds.append(keep(memfd.sealed(contents, "fuzz")))
            elif kind == "pipe":
                read_end, write_end = os.pipe()
                keep(write_end)
                fds.append(keep(read_end))
            elif kind == "devnull":
                fds.append(keep(os.open(os.devnull, os.O_RDONLY)))
            elif kind == "dir":
                fds.append(keep(os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)))
            else:
                left, right = socket.socketpair()
                stack.enter_context(left)
                stack.enter_context(right)
                fds.append(left.fileno())
        yield fds


def send(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    if fds:
        sent = sock.sendmsg(
            [data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
        )
        data = data[sent:]
    if data:
        sock.sendall(data)


@dataclass
class Answer:
    header: dict[str, Any]
    payload: bytes
    bytes_read: bytes | None  # a read's bytes, mapped from its memfds or inline


def exchange(
    sock: socket.socket, body: bytes, payload: bytes = b"", fds: list[int] | None = None
) -> Answer:
    """Send one frame and take its answer: checked to be well formed, fds closed."""
    send(sock, PREFIX.pack(len(body), len(payload)) + body + payload, fds or [])
    try:
        header, data, got = recv_frame(sock)
    except (ConnectionError, TimeoutError) as exc:
        raise AssertionError(
            f"no answer to a frame the daemon can stay in step with: {exc}"
        ) from exc
    mapped = header.get("ok") is True and "spans" in header and not header.get("inline")
    try:
        assert isinstance(header.get("ok"), bool), header
        assert header.get("fds", 0) == len(got), ("the answer miscounts its fds", header)
        if not header["ok"]:
            assert got == [], header
            assert_clear_error(header)
    except BaseException:
        close_all(got)
        raise
    if mapped:
        return Answer(header, data, assemble(header, got))  # which closes them
    close_all(got)
    return Answer(header, data, data if header.get("inline") else None)


#: what the daemon says when one of its own exceptions reached the socket: a bug
DAEMON_FAILED = ("the daemon failed", "breaks the framing", "answer to this request is too large")


def assert_clear_error(answer: dict[str, Any]) -> None:
    kind, message = answer.get("error"), answer.get("message")
    assert isinstance(kind, str), answer
    assert error_class(kind).__name__ == kind, f"{kind!r} is not of chunkd.errors: {answer}"
    assert issubclass(error_class(kind), ChunkdError)
    assert isinstance(message, str), answer
    assert message, answer
    assert "Traceback" not in message, answer
    assert not any(text in message for text in DAEMON_FAILED), answer
    assert "status" not in answer, answer  # a status belongs to the HTTP edge


def expected_id(body: bytes) -> object:
    """The id an answer echoes: the request's, unless it is unreadable or too long."""
    try:
        request_id = decode_header(body).get("id")
    except ChunkdError:
        return None
    return request_id if len(json.dumps(request_id)) <= MAX_ID_BYTES else None


def check_frame(node: Node, frame: Frame, answer: Answer, greeted: bool) -> bool:
    """Check ``answer`` against ``frame``; whether the connection is greeted now."""
    header = answer.header
    assert header.get("id") == expected_id(frame.body), ("the id is not echoed", header)
    try:
        request = decode_header(frame.body)
    except ChunkdError:
        request = {}
    op = request.get("op")
    if header["ok"] and op != "hello":
        assert greeted, ("answered before hello", request, header)
    if frame.check is not None:
        name, offset, length, _ = frame.check
        if not greeted:
            assert header["error"] == "InvalidRequestError", header
            return greeted
        assert header["ok"], (frame.check, header)
        blob = node.known[name]
        assert header["offset"] == offset, header
        want = blob[offset:] if length is None else blob[offset : offset + length]
        assert answer.bytes_read == want, (frame.check, header)
    elif header["ok"] and op == "read" and request.get("name") in node.known:
        blob = node.known[request["name"]]
        start = header["offset"]
        assert answer.bytes_read == blob[start : start + header["length"]], header
    elif header["ok"] and op == "readv":
        check_readv(node, request, header, answer.payload)
    return greeted or (header["ok"] and op == "hello")


def check_readv(node: Node, request: dict[str, Any], header: dict[str, Any], data: bytes) -> None:
    entries = header["ranges"]
    assert header["answered"] == len(entries) >= 1, header
    at = 0
    for (name, _, _), entry in zip(request["ranges"], entries, strict=False):
        if "error" in entry:
            assert_clear_error(entry)
            continue
        piece = data[at : at + entry["length"]]
        at += entry["length"]
        if name in node.known:
            start = entry["offset"]
            assert piece == node.known[name][start : start + entry["length"]], (name, entry)
    assert at == len(data), ("a readv payload of other bytes than its entries", header)


def closes(sock: socket.socket, limit: float = 10.0) -> bool:
    """Whether the daemon closes ``sock`` (after answering what it still could)."""
    deadline = time.monotonic() + limit
    sock.settimeout(limit)
    while time.monotonic() < deadline:
        try:
            header, _, got = recv_frame(sock)
        except TimeoutError:
            return False
        except OSError:  # ConnectionError among them: closed
            return True
        except ChunkdError:
            return True  # the daemon closed mid-frame: no answer could be framed
        close_all(got)
        assert isinstance(header.get("ok"), bool), header
        if not header["ok"]:
            assert_clear_error(header)
    return False


# -- the test -------------------------------------------------------------------------------


def test_hostile_frames_and_op_sequences_never_hurt_the_daemon(
    node: Node, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    run_seed = fuzz_seed()
    known = node.known
    counts = {"connections": 0, "frames": 0, "breaks": 0, "fds": 0}
    outcomes: Counter[str] = Counter()
    with connect(node) as witness:
        for name in known:  # every known chunk is cached before the fds are counted
            exchange(witness, encode({"op": "read", "name": name, "inline": False}))
        time.sleep(0.2)
        fds_before = fd_count(node.daemon.process.pid)

        def witness_reads() -> None:
            name = "local/known/mid.bin"
            answer = exchange(witness, encode({"op": "read", "name": name, "offset": 5}))
            assert answer.bytes_read == known[name][5:]

        @fuzz_settings(EXAMPLES)
        @seed(run_seed)
        @given(actions=connections(known))
        def one_connection(actions: list[Frame | Break]) -> None:
            counts["connections"] += 1
            with connect(node, hello=False) as sock:
                greeted = False
                for action in actions:
                    with attached(action.fds, getattr(action, "contents", b""), tmp_path) as fds:
                        counts["fds"] += len(fds)
                        if isinstance(action, Break):
                            counts["breaks"] += 1
                            try:
                                send(sock, action.data, fds)
                                sock.shutdown(socket.SHUT_WR)
                            except (BrokenPipeError, ConnectionResetError):
                                pass  # closed already, as it should be
                            assert closes(sock), f"{action.why} left the connection open"
                            break
                        counts["frames"] += 1
                        answer = exchange(sock, action.body, action.payload, fds)
                        greeted = check_frame(node, action, answer, greeted)
                        outcomes[outcome_of(action, answer)] += 1
            assert node.daemon.process.poll() is None, "the daemon died"
            witness_reads()  # another connection: unaffected

        started = time.monotonic()
        with replayable(request, run_seed, "local socket fuzz"):
            one_connection()
            assert node.daemon.get("/healthz")[0] == 200
            witness_reads()
            deadline = time.monotonic() + 10
            while fd_count(node.daemon.process.pid) > fds_before and time.monotonic() < deadline:
                time.sleep(0.1)
            assert fd_count(node.daemon.process.pid) <= fds_before, "the daemon leaks fds"
            log = node.daemon.log.read_text(errors="replace")
            for text in ("Traceback", *DAEMON_FAILED):
                assert text not in log, f"the daemon's log shows {text!r}:\n{log[-4000:]}"
    print(
        f"local socket fuzz: seed {run_seed}: {counts['connections']} connections, "
        f"{counts['frames']} frames answered, {counts['breaks']} broken frames, "
        f"{counts['fds']} fds attached, in {time.monotonic() - started:.1f}s; answers: "
        + ", ".join(f"{what} {n}" for what, n in sorted(outcomes.items()))
    )


def outcome_of(frame: Frame, answer: Answer) -> str:
    """``op:ok`` or ``op:ErrorKind``, for the run's summary."""
    try:
        op = decode_header(frame.body).get("op")
    except ChunkdError:
        op = None
    op = op if isinstance(op, str) and op in OPS else "other"
    return f"{op}:{'ok' if answer.header['ok'] else answer.header['error']}"


# -- what the fuzz found ---------------------------------------------------------------------


def test_a_lone_surrogate_is_echoed_escaped_and_bytes_not_utf8_are_refused() -> None:
    """Found by the fuzz: an id of "\\ud800" (escaped: valid JSON, valid UTF-8) could
    not be echoed (the answer's header failed to encode and the daemon closed the
    connection); the same surrogate written as bytes (not UTF-8) was taken."""
    frame = encode_frame({"id": "\ud800", "ok": True, "names": ["a\udfff"]})
    header = decode_header(frame[PREFIX.size :])
    assert header == {"id": "\ud800", "ok": True, "names": ["a\udfff"]}
    frame[PREFIX.size :].decode("utf-8")  # the header is UTF-8 still
    for raw_header in (b'{"op":"hello","id":"\xed\xa0\x80"}', '{"op":"hello"}'.encode("utf-16")):
        with pytest.raises(ProtocolError, match="not JSON chunkd takes"):
            decode_header(raw_header)


def test_a_surrogate_in_a_request_is_answered_and_the_connection_stays(node: Node) -> None:
    with connect(node) as sock:
        for body, kind in [
            (b'{"op":"stat","id":["\\ud800"],"name":"local/\\ud800"}', "InvalidKeyError"),
            (b'{"op":"stat","id":"\xed\xa0\x80","name":"local/x"}', "InvalidRequestError"),
            (b'{"op":null,"id":"\\udfff"}', "InvalidRequestError"),
        ]:
            answer = exchange(sock, body)
            assert (answer.header["ok"], answer.header["error"]) == (False, kind)
            assert answer.header["id"] == expected_id(body)
        name = "local/known/small.bin"
        assert exchange(sock, encode({"op": "read", "name": name})).bytes_read == node.known[name]


def test_an_op_that_is_not_a_string_is_refused(node: Node) -> None:
    with connect(node) as sock:
        for op in ([], {}, ["read"], {"read": 1}):
            answer = exchange(sock, encode({"op": op, "id": 3}))
            assert (answer.header["ok"], answer.header["error"]) == (False, "InvalidRequestError")


def test_an_id_too_long_to_echo_is_refused_and_the_connection_stays(node: Node) -> None:
    with connect(node) as sock:
        for long_id in ("i" * (MAX_HEADER - 60), "i" * MAX_ID_BYTES, [0] * 400):
            body = encode({"op": "stat", "name": "local/known/small.bin", "id": long_id})
            assert len(body) <= MAX_HEADER  # a frame the daemon takes
            answer = exchange(sock, body)
            assert (answer.header["ok"], answer.header["error"]) == (False, "InvalidRequestError")
            assert answer.header["id"] is None
        short = "i" * (MAX_ID_BYTES - 2)  # 1,024 bytes as JSON, quotes included
        answer = exchange(
            sock, encode({"op": "stat", "name": "local/known/small.bin", "id": short})
        )
        assert (answer.header["ok"], answer.header["id"]) == (True, short)
        name = "local/known/small.bin"
        assert exchange(sock, encode({"op": "read", "name": name})).bytes_read == node.known[name]
