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

from chunkd.errors import InvalidKeyError
from chunkd.keys import MAX_KEY_BYTES, key_problem

__all__ = [
    "MAX_KEY_BYTES",
    "checkpoint_name",
    "split_name",
    "split_prefix",
    "validate_key",
]


def validate_key(key: str) -> str:
    """Return ``key`` if chunkd will look it up, else raise :class:`InvalidKeyError`
    (the rule: :func:`chunkd.keys.key_problem`)."""
    problem = key_problem(key)
    if problem is not None:
        raise InvalidKeyError(problem)
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
