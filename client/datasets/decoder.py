"""The daemon's decode worker: ``python -m chunkd.client.datasets.decoder``.

The daemon decodes a dataset unit once per node (docs/decoding.md) in a few of these
processes, started and bounded by its pool (:mod:`chunkd.gateway.inspector.pool`,
:mod:`chunkd.gateway.decoding`). The daemon's own process never decodes (nor imports
pyarrow).

Usage::

    python -m chunkd.client.datasets.decoder --socket PATH --memory BYTES --fds N

The protocol, one JSON object a line, as the inspector's worker has it:

1. The worker sets its address-space limit (``RLIMIT_AS``) to ``--memory`` bytes before
   it imports pyarrow, so a hostile unit fails its request, not the node.
2. It reads requests on stdin: ``{"n": N, "op": OP, "args": {...}}``, one at a time.
3. Before each success answer line, the worker sends exactly one message on the socket
   pair ``--fds`` (the answer's fds, or none).
   ``formats`` answers ``{"formats": {NAME: DECODER_VERSION, ...}}``: every format this
   installation decodes (the daemon refuses a request for another name or version).
4. ``decode`` (args: ``format``, ``decoder``, the member's ``key``, ``size``,
   ``version``, ``samples`` and ``meta`` (an object), ``unit``, ``columns`` (a list or
   null) and the source: ``backend``, or ``registry``, ``chunk_bytes`` and ``chunks``)
   reads the member through the daemon's local socket as a reader does (pinned at
   ``version``, or a frozen member's chunks by id; the daemon verifies every chunk), runs
   ``format_of(format).decode(...)``, writes the table as an Arrow IPC **file** into a
   memfd, seals it (:data:`chunkd.memfd.SEALS`), sends it on the socket pair ``--fds``
   (one message, SCM_RIGHTS), closes its own fd, then answers
   ``{"rows": N, "bytes": N, "columns": [NAME, ...]}``.
5. An error answer is ``{"n": N, "ok": false, "error": KIND, "message": TEXT}``, KIND a
   class of :mod:`chunkd.errors` (``DatasetFormatError``, ``SnapshotDriftError``,
   ``InvalidRequestError``, ...); ``InspectCrashedError`` after running out of memory
   (the pool then replaces the worker); it sends no fds.
6. Nothing else is written to stdout (fd 1 is pointed at stderr). It ends at the end of
   stdin.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING, Any, Final

from chunkd import memfd
from chunkd.client.inspect.worker import limit_memory, serve
from chunkd.client.protocol.ops import MAX_DECODED_BYTES
from chunkd.errors import ChunkdError, DatasetFormatError, InspectError, InvalidRequestError

if TYPE_CHECKING:
    from chunkd.client.core import Client
    from chunkd.client.datasets.source import Source

__all__ = ["Decoder", "main"]

log = logging.getLogger("chunkd.datasets.decoder")

#: the client cache is at most this share of the worker's memory, and at most this much
_CACHE_SHARE: Final = 8
_CACHE_BYTES: Final = 256 << 20


class Decoder:
    """Answers decode requests through one client of the daemon's socket.

    Args:
        socket_path: the daemon's local socket.
        memory: the worker's address-space limit (it sizes the client's cache).
        channel: the socket the decoded tables' memfds are sent on.
    """

    def __init__(self, socket_path: str, memory: int, channel: socket.socket) -> None:
        self.socket_path = socket_path
        self.memory = memory
        self.channel = channel
        self._client: Client | None = None

    @property
    def client(self) -> Client:
        """The client, connected on first use."""
        if self._client is None:
            from chunkd.client import Client

            cache = min(_CACHE_BYTES, self.memory // _CACHE_SHARE)
            self._client = Client(socket_path=self.socket_path, cache_bytes=cache)
        return self._client

    def answer(self, line: bytes) -> str:
        """The answer line to one request line (without its newline)."""
        n: Any = None
        try:
            request = json.loads(line)
            n = request.get("n") if isinstance(request, dict) else None
            return _ok(n, self.call(request))
        except MemoryError:
            return _error(
                n,
                "InspectCrashedError",
                f"the decode ran out of the worker's {self.memory} bytes of memory",
            )
        except ChunkdError as exc:
            return _error(n, type(exc).__name__, str(exc))
        except ValueError as exc:  # the line is no JSON
            return _error(n, "InvalidRequestError", f"a request that is no JSON: {exc}")
        except Exception as exc:  # a format's fault: the reader decodes in-process
            log.exception("decode failed")
            return _error(n, "InspectError", f"the decode failed ({type(exc).__name__}: {exc})")

    def call(self, request: object) -> dict[str, Any]:
        """The result of one request (a parsed line)."""
        if not isinstance(request, dict) or not isinstance(request.get("args"), dict):
            raise InvalidRequestError("a request is a JSON object with an object of args")
        op, args = request.get("op"), request["args"]
        if op == "formats":
            found = formats()
            socket.send_fds(self.channel, [b"-"], [])  # every success answer's one message
            return {"formats": found}
        if op == "decode":
            return self.decode(args)
        raise InvalidRequestError(f"no decoder op {op!r}; the ops are formats, decode")

    def decode(self, args: dict[str, Any]) -> dict[str, Any]:
        """Decode one unit, send its sealed memfd, and describe it."""
        from chunkd.client.datasets.formats import clear_caches, format_of
        from chunkd.snapshot import Member

        # Each request is decoded from its own inputs alone: the formats' caches (footers,
        # unit plans, shards) are keyed by a member's name and version, and another
        # caller's request may have named them with another record (or frozen chunks).
        clear_caches()
        fmt = format_of(str(args["format"]))
        if fmt.version != args["decoder"]:
            raise InvalidRequestError(
                f"format {fmt.name} decodes at version {fmt.version} here, not {args['decoder']}"
            )
        meta = args["meta"]
        if not isinstance(meta, dict):
            raise InvalidRequestError("a member's meta is an object")
        member = Member(
            key=str(args["key"]),
            size=int(args["size"]),
            version=str(args["version"]),
            format=fmt.name,
            samples=int(args["samples"]),
            meta=meta,
        )
        unit = int(args["unit"])
        try:
            units = fmt.units(member)
        except (KeyError, TypeError, ValueError) as exc:
            raise DatasetFormatError(
                f"member {member.key}'s meta is not {fmt.name}'s ({type(exc).__name__}: {exc})"
            ) from None
        if not 0 <= unit < len(units):
            raise InvalidRequestError(
                f"member {member.key} has {len(units)} units; unit {unit} is none of them"
            )
        columns = args.get("columns")
        table = fmt.decode(self._source(args, member), member, unit, columns)
        if table.num_rows != units[unit]:
            raise DatasetFormatError(
                f"unit {unit} of {member.key} decoded to {table.num_rows} rows; its "
                f"manifest says {units[unit]} samples"
            )
        if table.nbytes > MAX_DECODED_BYTES:  # the daemon hands out nothing larger: unwritten
            raise InspectError(
                f"unit {unit} of {member.key} decodes to {table.nbytes} bytes, more than a "
                f"decoded unit may be ({MAX_DECODED_BYTES}): the reader decodes it itself"
            )
        fd = _ipc_file(table)
        try:
            size = os.fstat(fd).st_size
            socket.send_fds(self.channel, [b"d"], [fd])
        finally:
            os.close(fd)
        return {"rows": table.num_rows, "bytes": size, "columns": list(table.column_names)}

    def _source(self, args: dict[str, Any], member: Any) -> Source:
        from chunkd.client.datasets.frozen import FrozenSource
        from chunkd.client.datasets.source import PinnedSource

        if args.get("backend") is not None:
            return PinnedSource(self.client, str(args["backend"]))
        chunks = [str(c) for c in args["chunks"]]
        return FrozenSource.of_member(
            self.client, str(args["registry"]), int(args["chunk_bytes"]), member, chunks
        )


def formats() -> dict[str, int]:
    """Every format this installation decodes, with its decoder's version."""
    from chunkd.client.datasets.formats import format_of, names

    found: dict[str, int] = {}
    for name in names():
        try:
            version = format_of(name).version
        except Exception:  # a broken plug-in: not decoded here; readers decode it
            log.warning("format %r cannot be loaded; it is not decoded here", name)
            continue
        if isinstance(version, int) and not isinstance(version, bool):
            found[name] = version
    return found


def _ipc_file(table: Any) -> int:
    """``table`` as an Arrow IPC file in a sealed memfd (its fd)."""
    pa = importlib.import_module("pyarrow")
    fd = memfd.create("chunkd-decoded")
    try:
        with (
            open(fd, "wb", closefd=False, buffering=1 << 20) as out,
            pa.ipc.new_file(out, table.schema) as writer,
        ):
            writer.write_table(table)
        memfd.seal(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _ok(n: Any, result: dict[str, Any]) -> str:
    # In this order: the pool finds the result by this prefix.
    return json.dumps({"n": n, "ok": True, "result": result}, separators=(",", ":"))


def _error(n: Any, kind: str, message: str) -> str:
    return json.dumps({"n": n, "ok": False, "error": kind, "message": message[:4000]})


def main(argv: list[str] | None = None) -> int:
    """Run a decode worker on stdin and stdout until stdin ends."""
    parser = argparse.ArgumentParser(
        prog="python -m chunkd.client.datasets.decoder",
        description="The daemon's dataset decode worker (the daemon starts it): docs/decoding.md",
    )
    parser.add_argument("--socket", required=True, help="the daemon's local socket")
    parser.add_argument("--memory", required=True, type=int, help="address-space limit, bytes")
    parser.add_argument("--fds", required=True, type=int, help="the socket the memfds go on")
    options = parser.parse_args(argv)
    if options.memory < 64 << 20:
        parser.error(f"--memory {options.memory}: at least {64 << 20} bytes")
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="decode-worker %(levelname)s %(message)s"
    )
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    limit_memory(options.memory)
    channel = socket.socket(fileno=options.fds)
    # Imported now, not in the first request's time; under an address-space limit, a
    # thread pool sized to a big machine's cores would reserve stacks for nothing.
    pa = importlib.import_module("pyarrow")
    pa.set_cpu_count(2)
    pa.set_io_thread_count(2)

    decoder = Decoder(options.socket, options.memory, channel)
    return serve(decoder.answer, out)


if __name__ == "__main__":
    sys.exit(main())
