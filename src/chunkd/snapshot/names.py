"""Dataset names and references to snapshots: ``NAME``, ``NAME@N``, ``NAME@TAG``, an id.

What a name, a tag and a snapshot id may be, and a reference parsed into a :class:`Ref`
(the module docstring of :mod:`chunkd.snapshot`, "Names"). The registry, the command
line and the inspector check what they are given here before anything is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from chunkd.errors import InvalidRequestError

__all__ = [
    "MAX_NAME_BYTES",
    "MAX_TAG_BYTES",
    "Ref",
    "check_dataset_name",
    "check_snapshot_id",
    "check_tag",
    "parse_ref",
]

#: the longest dataset name
MAX_NAME_BYTES: Final = 256
#: the longest tag
MAX_TAG_BYTES: Final = 64

_SEGMENT: Final = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_NAME_RE: Final = re.compile(rf"{_SEGMENT}(?:/{_SEGMENT})*")
_TAG_RE: Final = re.compile(r"[A-Za-z][A-Za-z0-9._-]*")
_ID_RE: Final = re.compile(r"[0-9a-f]{64}")
_LATEST: Final = "latest"


def check_dataset_name(name: str) -> str:
    """``name``, if it is a dataset name.

    Raises:
        InvalidRequestError: it is not (the message says what one is).
    """
    if (
        not isinstance(name, str)
        or len(name.encode()) > MAX_NAME_BYTES
        or not _NAME_RE.fullmatch(name)
        or any(part in (".", "..") or part.endswith(".") for part in name.split("/"))
        or _ID_RE.fullmatch(name)
    ):
        raise InvalidRequestError(
            f"{name!r} is not a dataset name: use '/'-separated segments of letters, "
            "digits, '.', '_' and '-', each starting with a letter or digit (at most "
            f"{MAX_NAME_BYTES} bytes, and not 64 hex digits, which name a snapshot)"
        )
    return name


def check_tag(tag: str) -> str:
    """``tag``, if it is a tag name (not ``latest``, not a number).

    Raises:
        InvalidRequestError: it is not.
    """
    if (
        not isinstance(tag, str)
        or len(tag) > MAX_TAG_BYTES
        or not _TAG_RE.fullmatch(tag)
        or tag == _LATEST
    ):
        raise InvalidRequestError(
            f"{tag!r} is not a tag: a letter, then letters, digits, '.', '_' or '-' (at "
            f"most {MAX_TAG_BYTES}); 'latest' is kept for the newest version"
        )
    return tag


def check_snapshot_id(text: str) -> str:
    """``text``, if it is a snapshot id (64 lowercase hex digits).

    Raises:
        InvalidRequestError: it is not.
    """
    if not isinstance(text, str) or not _ID_RE.fullmatch(text):
        raise InvalidRequestError(f"{text!r} is not a snapshot id (64 lowercase hex digits)")
    return text


@dataclass(frozen=True, slots=True)
class Ref:
    """A reference to a snapshot: by name and version or tag, or by id.

    Exactly one of ``version`` (a number), ``tag`` (``latest`` included) and ``id``
    is set; ``name`` is None only for an id.
    """

    name: str | None
    version: int | None = None
    tag: str | None = None
    id: str | None = None

    def __str__(self) -> str:
        if self.id is not None:
            return self.id
        return f"{self.name}@{self.version if self.version is not None else self.tag}"

    @property
    def latest(self) -> bool:
        """Whether this is ``NAME@latest``."""
        return self.tag == _LATEST


def parse_ref(text: str) -> Ref:
    """``NAME``, ``NAME@N``, ``NAME@latest``, ``NAME@TAG`` or a snapshot id.

    Raises:
        InvalidRequestError: ``text`` is none of these.
    """
    if not isinstance(text, str):
        raise InvalidRequestError(f"a snapshot reference is text, not {type(text).__name__}")
    if _ID_RE.fullmatch(text):
        return Ref(None, id=text)
    name, at, after = text.partition("@")
    check_dataset_name(name)
    if not at or after == _LATEST:
        return Ref(name, tag=_LATEST)
    if after.isdigit() and after.isascii():
        version = int(after)
        if version < 1 or len(after) > 18:
            raise InvalidRequestError(f"{text!r}: versions count from 1")
        return Ref(name, version=version)
    return Ref(name, tag=check_tag(after))
