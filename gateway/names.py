"""Names, written once: ``BACKEND/KEY`` objects, ``BACKEND[/PREFIX]`` listings and
``BACKEND/PATH`` checkpoints, and the rule for a key chunkd will look up.

Every door (HTTP, the local socket, the command line) and every path (read, write,
listing) splits and checks names here, so a name one door takes, every door takes.

A key is refused (:class:`~chunkd.errors.InvalidKeyError`) when it is empty, over
:data:`MAX_KEY_BYTES` UTF-8 bytes, starts with ``/``, has an empty, ``.`` or ``..``
path segment, holds a backslash, or holds NUL or another control character. The
backend's own name is checked against the configured backends by whoever looks it
up (the backend list is the allowlist).
"""

from __future__ import annotations

from typing import Final

from chunkd.errors import InvalidKeyError

__all__ = [
    "MAX_KEY_BYTES",
    "checkpoint_name",
    "split_name",
    "split_prefix",
    "validate_key",
]

#: the longest object key accepted (S3's own limit)
MAX_KEY_BYTES: Final = 1024


def validate_key(key: str) -> str:
    """Return ``key`` if chunkd will look it up, else raise :class:`InvalidKeyError`."""
    if not key:
        raise InvalidKeyError("the object key is empty; ask for BACKEND/KEY")
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidKeyError("the object key is not valid UTF-8") from None
    if size > MAX_KEY_BYTES:
        raise InvalidKeyError(
            f"the object key is {size} bytes long; keys are at most {MAX_KEY_BYTES}"
        )
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):
        raise InvalidKeyError("the object key holds a control character (NUL, newline, ...)")
    if key.startswith("/"):
        raise InvalidKeyError(f"the object key {key!r} starts with '/'; keys are relative")
    if "\\" in key:
        raise InvalidKeyError(f"the object key {key!r} holds a backslash")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise InvalidKeyError(
            f"the object key {key!r} has an empty, '.' or '..' path segment; "
            "chunkd never resolves paths outside a backend"
        )
    return key


def validate_prefix(prefix: str) -> str:
    """A listing's prefix without its outer slashes, checked as a key unless empty."""
    prefix = prefix.strip("/")
    if prefix:
        validate_key(prefix)
    return prefix


def split_name(name: object) -> tuple[str, str]:
    """Split an object's ``BACKEND/KEY``; the key is not checked yet (the read path does)."""
    if not isinstance(name, str):
        raise InvalidKeyError("a request names its object as 'BACKEND/KEY' (a string)")
    backend, _, key = name.partition("/")
    if not backend or not key:
        raise InvalidKeyError(f"{name!r} is not BACKEND/KEY")
    return backend, key


def split_prefix(name: str) -> tuple[str, str]:
    """Split a listing's ``BACKEND[/PREFIX]``; the prefix comes back checked, without
    its outer slashes (``""`` for the whole backend)."""
    backend, _, prefix = name.strip("/").partition("/")
    if not backend:
        raise InvalidKeyError("a listing names 'BACKEND' or 'BACKEND/PREFIX'")
    return backend, validate_prefix(prefix)


def checkpoint_name(name: object) -> tuple[str, str]:
    """Split a checkpoint's ``BACKEND/PATH`` (outer slashes dropped) and check the path."""
    if not isinstance(name, str):
        raise InvalidKeyError("a checkpoint is named 'BACKEND/PATH' (a string)")
    backend, _, path = name.strip("/").partition("/")
    path = path.strip("/")
    if not backend or not path:
        raise InvalidKeyError(f"{name!r} is not BACKEND/PATH")
    return backend, validate_key(path)
