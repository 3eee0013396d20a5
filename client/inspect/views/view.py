"""What an inspector view is (:class:`View`), and what every view shares: reads pinned
to the version opened (:class:`PinnedReads`), and a file's faults reported as the
file's (:func:`file_errors`, :class:`Guarded`), never as a bug of the worker's.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final, Protocol

from chunkd.errors import ChunkdError, InvalidRequestError, MalformedFileError

if TYPE_CHECKING:
    from chunkd.client.core import Client
    from chunkd.client.results import ObjectStat

__all__ = [
    "FIELD_LINES",
    "FORMATS",
    "HEAD_BYTES",
    "Guarded",
    "PinnedReads",
    "View",
    "file_errors",
    "malformed",
    "out_of_memory",
    "past_end",
    "select",
    "split_name",
]

#: the formats ``open`` takes (``format=``)
FORMATS: Final = ("parquet", "jsonl", "text", "wds", "mds", "image", "audio", "video", "binary")
#: the first bytes read to detect a format and shown for a binary object
HEAD_BYTES: Final = 4096
#: a view's field names are looked for in this many first records (JSON lines)
FIELD_LINES: Final = 8
#: a decoder's own words on a fault are cut to this many characters
FAULT_CHARS: Final = 500


class View(Protocol):
    """One object version, read as one format."""

    #: the format (one of :data:`FORMATS`)
    kind: str
    #: the object, ``BACKEND/KEY``
    name: str

    @property
    def total(self) -> int | None:
        """Its rows (samples, lines), or None while unknown."""
        ...

    @property
    def nbytes(self) -> int:
        """About the memory the view holds."""
        ...

    def describe(self) -> dict[str, Any]:
        """The fields of its ``open`` answer that are particular to its kind."""
        ...

    def fields(self) -> list[str] | None:
        """The names of its records' fields (for RL detection), or None."""
        ...

    def rows(self, start: int, columns: list[str] | None) -> Iterator[tuple[int, Any]]:
        """``(index, value)`` of rows ``start``, ``start + 1``, ... to the end; values as
        :func:`~chunkd.client.inspect.values.encode` sends them.

        Raises:
            InvalidRequestError: ``start`` is past the end, or the view has no rows.
            MalformedFileError: a row cannot be decoded.
        """
        ...


def malformed(exc: BaseException) -> MalformedFileError:
    """The inspector's error for a dataset format's refusal (its message names the file)."""
    return MalformedFileError(str(exc))


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is the worker's address-space limit at work (an allocation, a
    mapping or a thread refused), not a fault of the file."""
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, OSError) and exc.errno == errno.ENOMEM:
        return True
    text = str(exc)
    return "Cannot allocate memory" in text or "Failed to launch worker thread" in text


@contextlib.contextmanager
def file_errors(name: str, what: str) -> Iterator[None]:
    """What a decoder raises on the bytes of ``name``, as the file's fault.

    chunkd's own errors pass as they are (they say what they are), and so does running
    out of memory (an ``ENOMEM`` from a mapping or a thread is made a MemoryError).
    Anything else a decoder raised on the file's bytes (a ValueError, a TypeError on a
    value of the wrong type, pyarrow's errors, a RecursionError) is
    :class:`~chunkd.errors.MalformedFileError` naming the file, ``what`` failed and the
    fault: a malformed file is a 422, never a 500.
    """
    try:
        yield
    except (ChunkdError, MemoryError):
        raise
    except RecursionError:
        raise MalformedFileError(
            f"{name}: {what}: it holds a value nested too deep to read; read it with the client"
        ) from None
    except Exception as exc:
        if out_of_memory(exc):
            raise MemoryError(f"{name}: {exc}") from None
        raise MalformedFileError(
            f"{name}: {what} ({type(exc).__name__}: {str(exc)[:FAULT_CHARS]}): the file is "
            "damaged, or not of its format"
        ) from None


class Guarded:
    """A view whose every read of the file goes through :func:`file_errors`: what a
    view is asked (its description, fields and rows) fails as the file's fault, or as
    chunkd's own error, never as a bug of the worker's."""

    def __init__(self, view: View) -> None:
        self.view = view
        self.kind = view.kind
        self.name = view.name

    @property
    def total(self) -> int | None:
        return self.view.total

    @property
    def nbytes(self) -> int:
        return self.view.nbytes

    def describe(self) -> dict[str, Any]:
        with file_errors(self.name, f"its {self.kind} structure cannot be shown"):
            return self.view.describe()

    def fields(self) -> list[str] | None:
        with file_errors(self.name, "its fields cannot be read"):
            return self.view.fields()

    def rows(self, start: int, columns: list[str] | None) -> Iterator[tuple[int, Any]]:
        rows = self.view.rows(start, columns)
        at = start
        while True:
            with file_errors(self.name, f"row {at} cannot be read as {self.kind}"):
                try:
                    index, value = next(rows)
                except StopIteration:
                    return
            yield index, value
            at = index + 1


def past_end(name: str, start: int, total: int | None) -> InvalidRequestError:
    """The error of a page asked from ``start`` at or past the ``total`` rows of ``name``."""
    return InvalidRequestError(
        f"row {start} of {name}, which holds {total} rows: ask for a start below that"
    )


def split_name(name: str) -> tuple[str, str]:
    """``BACKEND/KEY`` as ``(BACKEND, KEY)``."""
    backend, _, key = name.partition("/")
    return backend, key


class PinnedReads:
    """Reads of one object version through the client (a changed object raises)."""

    def __init__(self, client: Client, stat: ObjectStat) -> None:
        self.client = client
        self.stat = stat

    def __call__(self, offset: int, length: int) -> memoryview:
        if length <= 0 or offset >= self.stat.size:
            return memoryview(b"")
        return self.client.read(self.stat.name, offset, length, version=self.stat.version)


def select(value: Any, columns: list[str] | None) -> Any:
    """``value``'s ``columns`` (all: None) where it is a record; anything else as it is."""
    if columns is None or not isinstance(value, dict):
        return value
    return {k: v for k, v in value.items() if k in columns}
