"""The inspector's worker process: ``python -m chunkd.client.inspect.worker``.

The daemon never decodes a file; it runs a few of these (``docs/inspector.md``,
"Who decodes what") and sends each one request at a time.

Usage::

    python -m chunkd.client.inspect.worker --socket PATH --memory BYTES

The protocol, one JSON object a line:

1. The worker sets its own address-space limit (``RLIMIT_AS``) to ``--memory`` bytes
   before it imports pyarrow: a hostile file that makes a decoder allocate without end
   fails that request (``MemoryError``), not the node. pyarrow's allocator (mimalloc)
   lives with ``RLIMIT_AS``: it imports and reads Parquet under 768 MiB of address
   space, so ``RLIMIT_DATA`` is not needed.
2. It reads requests on stdin: ``{"n": N, "op": OP, "args": {NAME: TEXT, ...}}``.
3. For each, in order, it writes one answer line on stdout:
   ``{"n": N, "ok": true, "result": {...}}`` (compact ASCII JSON, its keys in that
   order: the daemon passes the result on without parsing it) or
   ``{"n": N, "ok": false, "error": KIND, "message": TEXT}``, KIND a class name of
   :mod:`chunkd.errors` (``MalformedFileError`` for a file that cannot be read as its
   format, ``InvalidRequestError`` for bad args, ``ObjectNotFoundError``,
   ``DatasetNotFoundError``, ... as the client raises them). A request that cannot be
   parsed is answered with ``"n": null`` where its ``n`` cannot be read.
4. Nothing else is written to stdout: file descriptor 1 is pointed at stderr at start,
   so a stray print (or a native library's) goes to the log. It ends at the end of
   stdin.

The ops (``open``, ``rows``, ``sample``, ``rl``, ``datasets``, ``dataset``,
``snapshot``, ``diff``, ``step``) and their answers are ``docs/inspector.md``'s. The
worker reads only through :class:`chunkd.client.Client` on the daemon's socket (so its
reads are cached like every other), and only the ranges a view needs. Its caches are
bounded: open views (footers, line and tar indexes) by count and bytes, decoded row
groups by bytes, resolved snapshots by count.

It is one job at ~650 lines: the process and its ops' dispatch, which answers each op
from the views (:mod:`chunkd.client.inspect.objects`), the registry and the RL pages;
those do the reading, this module only asks them, bounds the answer and frames it.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import re
import resource
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO, Final

from chunkd import errors
from chunkd.errors import (
    ChunkdError,
    DatasetFormatError,
    DatasetNotFoundError,
    InvalidRequestError,
    MalformedFileError,
    UnknownBackendError,
)

if TYPE_CHECKING:
    from chunkd.client.core import Client
    from chunkd.client.inspect.objects import View, Views
    from chunkd.client.inspect.registry import Registry

__all__ = ["MAX_REQUEST_BYTES", "OPS", "Worker", "limit_memory", "main", "requests", "serve"]

log = logging.getLogger("chunkd.inspect.worker")

#: the longest request line read
MAX_REQUEST_BYTES: Final = 1 << 20
#: ``rows``: rows a page, by default and at most
ROWS_COUNT: Final = (20, 500)
#: ``rl``: rows a page, by default and at most
RL_COUNT: Final = (64, 2000)
#: ``snapshot``: members a page, by default and at most
MEMBERS_COUNT: Final = (100, 1000)
#: ``datasets``: names a page, by default and at most
DATASETS_COUNT: Final = (100, 200)
#: the client cache is at most this share of the worker's memory ...
_CACHE_SHARE: Final = 8
#: ... and at most this much
_CACHE_BYTES: Final = 256 << 20
_ID_RE: Final = re.compile(r"[0-9a-f]{64}")
_MAX_INDEX: Final = 1 << 62


# -- arguments ---------------------------------------------------------------------------


class Args:
    """One request's arguments (strings), checked as they are taken."""

    def __init__(self, op: str, raw: dict[str, str], accepted: tuple[str, ...]) -> None:
        unknown = sorted(set(raw) - set(accepted))
        if unknown:
            raise InvalidRequestError(
                f"{op} takes no argument {unknown[0]!r}; it takes {', '.join(accepted)}"
            )
        self.op = op
        self.raw = raw

    def text(self, name: str, default: str | None = None, *, required: bool = False) -> str | None:
        value = self.raw.get(name)
        if value is None or value == "":
            if required:
                raise InvalidRequestError(f"{self.op} needs the argument {name!r}")
            return default
        return value

    def need(self, name: str) -> str:
        value = self.text(name, required=True)
        assert value is not None
        return value

    def whole(
        self, name: str, default: int | None, low: int = 0, high: int = _MAX_INDEX
    ) -> int | None:
        value = self.text(name)
        if value is None:
            return default
        if not (value.isascii() and value.isdigit()) or len(value) > 19:
            raise InvalidRequestError(
                f"{self.op}: {name} is a whole number from {low}; got {value[:40]!r}"
            )
        number = int(value)
        if not low <= number <= high:
            raise InvalidRequestError(
                f"{self.op}: {name} is {number}; it must be from {low} to {high}"
            )
        return number

    def count(self, name: str, bounds: tuple[int, int]) -> int:
        found = self.whole(name, bounds[0], 1, bounds[1])
        assert found is not None
        return found

    def flag(self, name: str, default: bool) -> bool:
        value = self.text(name)
        if value is None:
            return default
        lowered = value.lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise InvalidRequestError(f"{self.op}: {name} is true or false; got {value[:40]!r}")

    def columns(self) -> list[str] | None:
        value = self.text("columns")
        if value is None:
            return None
        found = [c for c in (part.strip() for part in value.split(",")) if c]
        return found or None


#: each op's arguments
OPS: Final[dict[str, tuple[str, ...]]] = {
    "open": ("name", "format", "map"),
    "rows": ("name", "start", "count", "format", "columns"),
    "sample": ("id", "format", "columns"),
    "rl": ("name", "start", "count", "map", "format"),
    "datasets": ("start_after", "limit"),
    "dataset": ("name",),
    "snapshot": ("ref", "start", "count"),
    "diff": ("a", "b"),
    "step": (
        "ref", "step", "batch_size", "world_size", "seed", "epoch", "rank", "shuffle",
        "window", "window_bytes", "state", "tail",
    ),
}  # fmt: skip


# -- the worker --------------------------------------------------------------------------


class Worker:
    """Answers inspector requests through one client.

    Args:
        socket: the daemon's local socket.
        memory: the worker's address-space limit (it sizes the client's cache).
        client: a client to use instead of making one on first use.
    """

    def __init__(self, socket: str, memory: int, client: Client | None = None) -> None:
        self.socket = socket
        self.memory = memory
        self._client = client
        self._views: Views | None = None
        self._registry: Registry | None = None

    @property
    def client(self) -> Client:
        """The client, connected on first use (so a worker starts before the daemon
        answers)."""
        if self._client is None:
            from chunkd.client import Client

            cache = min(_CACHE_BYTES, self.memory // _CACHE_SHARE)
            self._client = Client(socket_path=self.socket, cache_bytes=cache)
        return self._client

    @property
    def views(self) -> Views:
        if self._views is None:
            from chunkd.client.inspect.objects import Views

            self._views = Views(self.client, max_bytes=max(16 << 20, self.memory // 8))
        return self._views

    @property
    def registry(self) -> Registry:
        if self._registry is None:
            from chunkd.client.inspect.registry import Registry

            self._registry = Registry(self.client)
        return self._registry

    def forget(self) -> None:
        """Drop every cache (after running out of memory)."""
        if self._views is not None:
            self._views.clear()
        if self._registry is not None:
            self._registry.clear()
        gc.collect()

    def answer(self, line: bytes) -> str:
        """The answer to one request line, as the JSON line to write (ASCII, no newline)."""
        from chunkd.client.inspect.values import MAX_ANSWER_BYTES, dumps

        n: Any = None
        started = time.perf_counter()
        op = "?"
        try:
            request = _parse(line)
            n = request.get("n")
            op, args = _checked(request)
            result = self.call(op, args)
            # In this order: the pool finds the result by this prefix and passes it on
            # unparsed (gateway/inspector/pool.py).
            text = dumps({"n": n, "ok": True, "result": result})
            if len(text) <= MAX_ANSWER_BYTES:
                log.debug("%s answered in %.1f ms", op, 1000 * (time.perf_counter() - started))
                return text  # encoded once: a page may be megabytes
            answer = _error(
                n,
                "InvalidRequestError",
                f"the answer to {op} would be {len(text)} bytes of JSON, more than the "
                f"{MAX_ANSWER_BYTES} the inspector sends: ask for fewer rows or columns, "
                "or read the object with the client",
            )
        except MemoryError:
            self.forget()
            answer = _error(
                n,
                "InspectCrashedError",
                f"{op} ran out of the worker's {self.memory} bytes of memory; the worker "
                "dropped its caches. Ask for fewer rows or columns",
            )
        except DatasetFormatError as exc:
            answer = _error(n, "MalformedFileError", str(exc))
        except ChunkdError as exc:
            answer = _error(n, _kind(exc), str(exc))
        except RecursionError:
            answer = _error(n, "MalformedFileError", f"{op}: a value is nested too deep to show")
        except Exception as exc:
            from chunkd.client.inspect.views.view import out_of_memory

            if out_of_memory(exc):  # an mmap or a thread refused under the limit
                self.forget()
                answer = _error(
                    n,
                    "InspectCrashedError",
                    f"{op} ran out of the worker's {self.memory} bytes of address space "
                    f"({exc}); the worker dropped its caches. Ask for fewer rows or columns",
                )
            else:
                # A fault of ours: a file's faults are MalformedFileError by now (the
                # views and samples pass every decoder's error through file_errors).
                log.exception("inspector %s failed", op)
                answer = _error(
                    n, "InspectError", f"{op} failed in the worker ({type(exc).__name__}: {exc})"
                )
        log.debug("%s answered in %.1f ms", op, 1000 * (time.perf_counter() - started))
        return dumps(answer)

    def call(self, op: str, raw: dict[str, str]) -> dict[str, Any]:
        """Run ``op`` with its arguments; its result."""
        accepted = OPS.get(op)
        if accepted is None:
            raise InvalidRequestError(f"no inspector op {op!r}; the ops are {', '.join(OPS)}")
        args = Args(op, raw, accepted)
        handler: Callable[[Args], dict[str, Any]] = getattr(self, f"_op_{op}")
        return handler(args)

    # -- object ops ----------------------------------------------------------------------

    def _dataset_ref(self, name: str, fmt: str | None) -> str | None:
        """``name`` as a dataset reference, where it is one, else None (an object).

        A snapshot id, and a name without ``/`` (``NAME``, ``NAME@N``, ``NAME@TAG``), are
        datasets': an object's name is always ``BACKEND/KEY``. A name with ``/`` is an
        object's where that object exists; where it does not (no such key, or its first
        segment is no configured backend), it is a dataset's when it has ``@``
        (``text/web@2``) or a dataset of that name is registered (``text/web``), else
        the object's (whose error then says what is missing).
        """
        from chunkd.snapshot import parse_ref

        if fmt is not None:
            return None
        try:
            parse_ref(name)
        except InvalidRequestError:
            if "/" in name:
                return None  # BACKEND/KEY with an '@' in the key, or another character
            raise InvalidRequestError(
                f"{name[:200]!r} is neither an object (BACKEND/KEY) nor a dataset (NAME, "
                "NAME@VERSION, NAME@TAG or a snapshot id)"
            ) from None
        if "/" not in name or _ID_RE.fullmatch(name):
            return name
        try:
            self.client.stat(name)
        except (FileNotFoundError, LookupError, ValueError):  # no such object or backend
            return name if "@" in name or self._registered(name) else None
        return None

    def _registered(self, name: str) -> bool:
        """Whether a dataset named ``name`` is registered (one ``ds_versions`` of one
        version)."""
        try:
            with self.client.request("ds_versions", {"name": name, "limit": 1}):
                return True
        except (DatasetNotFoundError, InvalidRequestError, UnknownBackendError):
            return False

    def _op_open(self, args: Args) -> dict[str, Any]:
        from chunkd.client.inspect import rl

        name = args.need("name")
        ref = self._dataset_ref(name, args.text("format"))
        if ref is not None:
            return self.registry.opened(name, ref, rl.parse_map(args.text("map")))
        view, stat, media_type = self.views.open(name, args.text("format"))
        described = view.describe()
        return {
            "name": name,
            "size": stat.size,
            "version": stat.version,
            "kind": view.kind,
            "media_type": media_type,
            "rl": rl.detect(view.fields(), rl.parse_map(args.text("map"))),
            "total": view.total,
            **described,
        }

    def _op_rows(self, args: Args) -> dict[str, Any]:
        from chunkd.client.inspect.values import PAGE_BYTES, json_bytes

        name = args.need("name")
        start = args.whole("start", 0)
        assert start is not None
        count = args.count("count", ROWS_COUNT)
        columns = args.columns()
        ref = self._dataset_ref(name, args.text("format"))
        total: int | None
        if ref is not None:
            total, found = self.registry.rows(ref, start, columns)
        else:
            view, _, _ = self.views.open(name, args.text("format"))
            total = view.total
            if total == 0 and start == 0:
                return {"name": name, "start": 0, "total": 0, "rows": [], "next": None}
            found = view.rows(start, columns)
        rows: list[dict[str, Any]] = []
        following: int | None = None
        used = 0
        for index, value in found:
            row = {"index": index, "value": value}
            size = json_bytes(row)
            if rows and used + size > PAGE_BYTES:
                following = index  # the page is full: it goes on here
                break
            rows.append(row)
            used += size
            if len(rows) == count:
                following = _following(found, total, index)
                break
        return {"name": name, "start": start, "total": total, "rows": rows, "next": following}

    def _op_sample(self, args: Args) -> dict[str, Any]:
        sample_id = args.need("id")
        where, hash_, number = sample_id.rpartition("#")
        if (
            not hash_
            or not where
            or not (number.isascii() and number.isdigit())
            or len(number) > 19
        ):
            raise InvalidRequestError(
                f"sample id {sample_id!r} is BACKEND/KEY#INDEX or DATASET@VERSION#INDEX"
            )
        index = int(number)
        # A bare NAME is a dataset's (its latest); BACKEND/KEY an object's where it exists.
        if self._dataset_ref(where, None) is not None:
            return self.registry.sample(sample_id, where, index)
        view, _, _ = self.views.open(where, args.text("format"))
        found = next(iter(view.rows(index, args.columns())))
        return {
            "id": sample_id,
            "name": where,
            "index": index,
            "kind": view.kind,
            "value": found[1],
        }

    def _op_rl(self, args: Args) -> dict[str, Any]:
        from chunkd.client.inspect import rl

        name = args.need("name")
        start = args.whole("start", 0)
        assert start is not None
        count = args.count("count", RL_COUNT)
        overrides = rl.parse_map(args.text("map"))
        ref = self._dataset_ref(name, args.text("format"))
        view: View | None = None
        if ref is not None:  # a dataset's samples, by global index
            fields = self.registry.fields_of(ref)
            total: int | None = self.registry.samples_of(ref)
        else:
            view, _, _ = self.views.open(name, args.text("format"))
            fields = view.fields() or []
            total = view.total
        kind = rl.detect(fields, overrides)
        if kind is None:
            raise InvalidRequestError(
                f"{name} does not look like RL data: its fields "
                f"({', '.join(fields)[:400] or 'none'}) hold neither prompt, completion "
                "and reward (rollouts) nor episode, observation or action, and reward "
                "(episodes); name them with map="
                "prompt:FIELD,completion:FIELD,reward:FIELD"
            )
        rows: Iterator[tuple[int, Any]]
        if total == 0:
            rows = iter(())
        elif view is not None:
            rows = view.rows(start, None)
        else:
            assert ref is not None
            rows = self.registry.rows(ref, start, None)[1]
        answer = rl.page(kind, rows, fields, overrides, start, count)
        return {"name": name, **answer}

    # -- registry ops --------------------------------------------------------------------

    def _op_datasets(self, args: Args) -> dict[str, Any]:
        return self.registry.datasets(args.text("start_after"), args.count("limit", DATASETS_COUNT))

    def _op_dataset(self, args: Args) -> dict[str, Any]:
        return self.registry.dataset_named(args.need("name"))

    def _op_snapshot(self, args: Args) -> dict[str, Any]:
        start = args.whole("start", 0)
        assert start is not None
        return self.registry.snapshot(args.need("ref"), start, args.count("count", MEMBERS_COUNT))

    def _op_diff(self, args: Args) -> dict[str, Any]:
        return self.registry.diff(args.need("a"), args.need("b"))

    def _op_step(self, args: Args) -> dict[str, Any]:
        tail = args.text("tail", "uneven")
        if tail not in ("uneven", "pad", "drop"):
            raise InvalidRequestError(f"step: tail is uneven, pad or drop; got {tail!r:.40}")
        state = args.text("state")
        ref = args.text("ref")
        if ref is None and state is None:
            raise InvalidRequestError("step needs ref (or state: a saved loader state)")
        step = args.whole("step", 0 if state is not None else None)
        if step is None:
            raise InvalidRequestError("step needs the argument 'step' (the step of the epoch)")
        batch_size = args.whole("batch_size", None, 1, 1 << 24)
        world_size = args.whole("world_size", None, 1, 1 << 20)
        if batch_size is None or world_size is None:
            raise InvalidRequestError("step needs batch_size and world_size (the run's)")
        epoch = args.whole("epoch", 0)
        assert epoch is not None
        return self.registry.step(
            ref or "",
            state=state,
            step=step,
            batch_size=batch_size,
            world_size=world_size,
            rank=args.whole("rank", None, 0, world_size - 1),
            seed=args.whole("seed", None),
            epoch=epoch,
            shuffle=args.flag("shuffle", True),
            window=args.whole("window", None),
            window_bytes=args.whole("window_bytes", None),
            tail=tail,
        )


def _following(rows: Iterator[tuple[int, Any]], total: int | None, last: int) -> int | None:
    """The start of the page after the row ``last``, or None at the end."""
    if total is not None:
        return last + 1 if last + 1 < total else None
    try:
        peeked = next(rows, None)
    except (MalformedFileError, InvalidRequestError):
        return last + 1  # the next page will say what is wrong there
    return None if peeked is None else peeked[0]


def _parse(line: bytes) -> dict[str, Any]:
    import json

    try:
        request = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequestError(
            f"a request is one JSON object a line; this is not JSON ({exc})"
        ) from None
    if not isinstance(request, dict):
        raise InvalidRequestError('a request is a JSON object: {"n": N, "op": OP, "args": {...}}')
    return request


def _checked(request: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """A parsed request's op and args, if they are a string and an object of strings."""
    op, args = request.get("op"), request.get("args", {})
    if not isinstance(op, str):
        raise InvalidRequestError("a request's op is a string")
    if not isinstance(args, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in args.items()
    ):
        raise InvalidRequestError(f"{op}: args is an object of strings (as query parameters are)")
    return op, args


def _kind(exc: ChunkdError) -> str:
    """The error's kind on the wire: its class, or the nearest of :mod:`chunkd.errors`."""
    for cls in type(exc).__mro__:
        if cls.__module__ == errors.__name__:
            return cls.__name__
    return "ChunkdError"


def _error(n: Any, kind: str, message: str) -> dict[str, Any]:
    return {"n": n, "ok": False, "error": kind, "message": message}


# -- the process -------------------------------------------------------------------------


def limit_memory(memory: int) -> None:
    """Limit the process's address space to ``memory`` bytes (never above its hard
    limit)."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        memory = min(memory, hard)
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))


def requests(stdin: BinaryIO) -> Iterator[bytes | None]:
    """Request lines of a worker's stdin (None for one over :data:`MAX_REQUEST_BYTES`,
    which is skipped to its end): the inspector's worker's, and the decoder's."""
    while True:
        line = stdin.readline(MAX_REQUEST_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_REQUEST_BYTES and not line.endswith(b"\n"):
            while True:
                rest = stdin.readline(MAX_REQUEST_BYTES)
                if not rest or rest.endswith(b"\n"):
                    break
            yield None
            continue
        if line.strip():
            yield line


def _warm_up() -> None:
    """Import what the ops use now, not in the first request's time (pyarrow alone
    takes a few hundred milliseconds to import)."""
    import chunkd.client.inspect.objects as objects
    import chunkd.client.inspect.registry
    import chunkd.client.inspect.rl  # noqa: F401

    try:
        objects.pyarrow_modules()
    except ImportError:  # no pyarrow: Parquet objects fail alone, with a clear message
        log.warning("pyarrow is not installed: Parquet objects cannot be inspected")


def main(argv: list[str] | None = None) -> int:
    """Run a worker on stdin and stdout until stdin ends."""
    parser = argparse.ArgumentParser(
        prog="python -m chunkd.client.inspect.worker",
        description="The inspector's decoding worker (the daemon starts it): docs/inspector.md",
    )
    parser.add_argument("--socket", required=True, help="the daemon's local socket")
    parser.add_argument(
        "--memory", required=True, type=int, help="address-space limit, bytes (RLIMIT_AS)"
    )
    options = parser.parse_args(argv)
    if options.memory < 64 << 20:
        parser.error(f"--memory {options.memory}: at least {64 << 20} bytes")
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="inspect-worker %(levelname)s %(message)s"
    )
    # Answers go to a private copy of stdout; fd 1 becomes stderr, so that nothing else
    # (a print, a native library) can write into the protocol.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    limit_memory(options.memory)

    _warm_up()

    worker = Worker(options.socket, options.memory)
    return serve(worker.answer, out)


def serve(answer: Callable[[bytes], str], out: BinaryIO) -> int:
    """Answer stdin's request lines on ``out``, one line each, until stdin ends (a line
    over :data:`MAX_REQUEST_BYTES` gets an error answer): the inspector's worker's loop,
    and the decoder's."""
    try:
        for line in requests(sys.stdin.buffer):
            if line is None:
                text = json.dumps(
                    _error(
                        None,
                        "InvalidRequestError",
                        f"a request line is longer than {MAX_REQUEST_BYTES} bytes",
                    )
                )
            else:
                text = answer(line)
            out.write(text.encode("ascii") + b"\n")
            out.flush()
    except (BrokenPipeError, KeyboardInterrupt):
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
