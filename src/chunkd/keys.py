"""The rule for an object key chunkd will look up, written once for both ends (a leaf
module of the shared floor, so that neither end loads the other's package for it).

The daemon's doors check every key with it (:func:`chunkd.gateway.names.validate_key`,
which raises :class:`~chunkd.errors.InvalidKeyError`), and the client checks keys it
takes from a user before it sends them (a registration's file of keys). A key is refused
when it is empty, over :data:`MAX_KEY_BYTES` UTF-8 bytes, holds NUL or another control
character, starts with ``/``, holds a backslash, or has an empty, ``.`` or ``..`` path
segment: chunkd never resolves a path outside a backend.
"""

from __future__ import annotations

from typing import Final

__all__ = ["MAX_KEY_BYTES", "key_problem"]

#: the longest object key accepted (S3's own limit), in UTF-8 bytes
MAX_KEY_BYTES: Final = 1024


def key_problem(key: str) -> str | None:
    """Why chunkd refuses ``key``, as a sentence about "the object key", or None."""
    if not key:
        return "the object key is empty; ask for BACKEND/KEY"
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        return "the object key is not valid UTF-8"
    if size > MAX_KEY_BYTES:
        return f"the object key is {size} bytes long; keys are at most {MAX_KEY_BYTES}"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):
        return "the object key holds a control character (NUL, newline, ...)"
    if key.startswith("/"):
        return f"the object key {key!r} starts with '/'; keys are relative"
    if "\\" in key:
        return f"the object key {key!r} holds a backslash"
    if any(part in ("", ".", "..") for part in key.split("/")):
        return (
            f"the object key {key!r} has an empty, '.' or '..' path segment; "
            "chunkd never resolves paths outside a backend"
        )
    return None
