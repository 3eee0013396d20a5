"""Canonical JSON: the one way chunkd writes a document it stores.

Every JSON document chunkd puts in a backend (checkpoint manifests, parts, intents and
collection barriers; dataset snapshots, member pages, frozen records, version
pointers, tags and registry entries) goes through :func:`canonical`. The flags:

- ``sort_keys=True, separators=(",", ":")``: one byte string per document, so its
  blake3 can name it and a reader can verify it by the bytes it holds;
- ``ensure_ascii=False``: text is written as UTF-8, not as ``\\uXXXX`` escapes. These
  won over the ASCII escapes the checkpoint and registry writers used because the
  snapshot ids already in backends are the blake3 of UTF-8 bytes: changing the
  snapshot side would change every existing snapshot's id, while changing the other
  writers changes only new documents' bytes, which no one has hashed yet;
- ``allow_nan=False``: ``NaN`` and ``Infinity`` are not JSON (RFC 8259); a document
  holding one could not be read by any other JSON reader (jq, a browser, Go), so it
  is refused when written rather than stored unreadable.

One exception, :func:`escaped`: a checkpoint save that a daemon from before the
flags were one accepted and journaled may hold a string UTF-8 cannot (a lone
surrogate, which its wire form allowed as an escape). The daemon acknowledged it, so
when a daemon of today resumes it, its part and intent are written as that daemon
would have written them (ASCII escapes), not refused. New saves are refused up front.

Readers never re-serialise a stored document to check it: they hash the bytes they
fetched and parse them. So a document written before the flags were one (a checkpoint
manifest or a registry pointer with ``\\u00e9`` escapes) still reads and still
verifies; only documents written since are UTF-8.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["canonical", "escaped"]


def canonical(doc: Any) -> bytes:
    """The canonical bytes of a JSON document: sorted keys, no spaces, UTF-8, no NaN.

    Raises:
        ValueError: ``doc`` holds a float that is not finite (``NaN``, ``Infinity``),
            or a string that is not text (a lone surrogate, which UTF-8 cannot hold);
            the message says which. (``TypeError``: a value JSON has no form for.)
    """
    try:
        text = json.dumps(
            doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except ValueError as exc:
        raise ValueError(
            f"the document holds NaN or Infinity, which JSON cannot hold ({exc}); "
            "store it as a string or as null"
        ) from None
    try:
        return text.encode()
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"the document holds a string that is not text: a lone surrogate "
            f"{text[exc.start : exc.end]!r} at character {exc.start}, which UTF-8 cannot hold"
        ) from None


def escaped(doc: Any) -> bytes:
    """``doc`` in the checkpoint writers' form from before the flags were one: sorted keys,
    no spaces, ASCII escapes, no NaN. Only for a journaled save an older daemon
    accepted whose document :func:`canonical` cannot hold (see the module docstring).

    Raises:
        ValueError: ``doc`` holds NaN or Infinity.
    """
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
