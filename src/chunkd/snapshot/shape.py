"""JSON documents read at a cost bounded before it is paid.

A document's shape is checked on its bytes before it is parsed
(:func:`check_json_shape`: nesting, objects and lists per byte, the first byte), the
parse fails as a :class:`~chunkd.errors.ManifestError`, never a ``RecursionError``
(:func:`load_json`), a manifest is parsed one member's entry at a time so that the
GIL is let go between entries, with the cyclic garbage collector paused meanwhile,
and the fields of what was parsed are checked for their type (``_object``,
``_text``, ``_whole``). The manifest, its pages, the frozen records and the
registry's documents are all read this way.
"""

from __future__ import annotations

import contextlib
import gc
import json
import re
import threading
from collections.abc import Iterator, Mapping
from typing import Any, Final

from chunkd.errors import ManifestError

__all__ = [
    "CONTAINER_BYTES",
    "MAX_DEPTH",
    "check_json_shape",
    "check_manifest_shape",
    "load_json",
]

#: the deepest a manifest's JSON may nest (registered ones nest 8 deep at most: a
#: WebDataset member's index of samples, each a list of its files)
MAX_DEPTH: Final = 32
#: the fewest bytes a manifest may spend on each JSON object or list, over its whole
#: length (registered ones spend 17 or more; the densest entry of any, a JSON-lines
#: index's first ``[0,0],``, spends 6; ``[{},{},...]`` spends 3)
CONTAINER_BYTES: Final = 6


# -- a JSON document's shape, before it is parsed -----------------------------------------

#: every byte but JSON's brackets and the quote, for ``bytes.translate`` to delete
_NOT_STRUCTURE: Final = bytes(c for c in range(256) if c not in b'[]{}"')
#: an opening bracket as "(", a closing one as ")"
_PAIRS: Final = bytes.maketrans(b"[{]}", b"(())")
_QUOTED: Final = re.compile(rb'"[^"]*"')


def check_json_shape(
    data: bytes, what: str, *, max_depth: int, container_bytes: int = 1, top: bytes = b""
) -> None:
    """Refuse, before it is parsed, JSON whose shape no document of its kind has.

    A cheap pass over the bytes (counts, translations and replacements that run at
    memory speed, no Python object per value): at most one object or list per
    ``container_bytes`` bytes over the whole document, nesting at most ``max_depth``
    deep (strings' contents left out), and, with ``top``, a first byte that is one of
    ``top`` (``b"{"``: an object). Brackets inside strings count as objects or lists in
    the first rule: it can only refuse more, never less.

    Args:
        data: the document's bytes.
        what: what the document is, for the error (``"the manifest"``).
        max_depth: the deepest nesting allowed.
        container_bytes: the fewest bytes per object or list.
        top: the bytes the document may start with (after white space); empty: any.

    Raises:
        ManifestError: the shape is not one of a document of this kind; nothing was
            parsed.
    """
    size = len(data)
    start = data[:256].lstrip()[:1]
    if top and (not start or start not in top):
        raise ManifestError(
            f"{what} is not JSON, or not a JSON {'object' if top == b'{' else 'document'} "
            f"(it starts with {start!r}); refused before it was parsed"
        )
    containers = data.count(b"{") + data.count(b"[")
    if containers > size // container_bytes + 8:
        raise ManifestError(
            f"{what} holds {containers} JSON objects and lists in {size} bytes, more than "
            f"one in {container_bytes} bytes, which no such document has (parsing it would "
            "cost far more memory than its size); refused before it was parsed"
        )
    text = data
    if b"\\" in text:  # escapes: a quote inside a string never ends it
        text = text.replace(b"\\\\", b"").replace(b'\\"', b"")
    skeleton = text.translate(None, _NOT_STRUCTURE).replace(b'""', b"")
    if b'"' in skeleton:  # strings that hold brackets
        skeleton = _QUOTED.sub(b"", skeleton)
    skeleton = skeleton.translate(_PAIRS)
    deep = b"(" * (max_depth + 1)
    for _ in range(max_depth):
        if not skeleton or deep in skeleton:
            break
        shorter = skeleton.replace(b"()", b"")  # one level of nesting, everywhere
        if len(shorter) == len(skeleton):
            break
        skeleton = shorter
    if skeleton:
        raise ManifestError(
            f"{what} nests its JSON more than {max_depth} deep, or its brackets do not "
            "pair up: no such document does; refused before it was parsed"
        )


def check_manifest_shape(data: bytes) -> None:
    """Refuse, before it is parsed, what cannot be a manifest: anything but one JSON
    object, nested more than :data:`MAX_DEPTH` deep, or with more than one object or
    list per :data:`CONTAINER_BYTES` bytes (see the module docstring).

    Raises:
        ManifestError: it is not a manifest's shape.
    """
    check_json_shape(
        data,
        "the manifest",
        max_depth=MAX_DEPTH,
        container_bytes=CONTAINER_BYTES,
        top=b"{",
    )


def load_json(data: bytes, what: str, *, max_depth: int, checked: bool = False) -> Any:
    """``json.loads`` of a document whose nesting is bounded: its shape checked first
    (:func:`check_json_shape`, unless ``checked``: the caller did), and any failure
    to parse a :class:`~chunkd.errors.ManifestError` that names ``what``, never a
    ``RecursionError``.

    Raises:
        ManifestError: the document is not JSON, or nests more than ``max_depth`` deep.
    """
    if not checked:
        check_json_shape(data, what, max_depth=max_depth)
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{what} is not JSON: {exc}") from None
    except RecursionError:  # pragma: no cover - the shape check refuses it first
        raise ManifestError(f"{what} nests its JSON too deep") from None


# -- a manifest's parse, one member at a time ----------------------------------------

_DECODER: Final = json.JSONDecoder()
#: the parses running that paused the cyclic garbage collector, and whether it ran before
_paused = {"parses": 0, "was_enabled": True}
_paused_lock: Final = threading.Lock()


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a manifest's objects are made.

    A parse makes millions of containers; every few hundred thousand of them start a
    full collection, which walks every object of the process holding the GIL (measured
    0.2-1 s each for a 16 MiB manifest, several per parse). A manifest's objects hold
    no reference cycles, and reference counting frees them as usual; a collection after
    the parse finds whatever cycles other code made meanwhile.
    """
    with _paused_lock:
        if not _paused["parses"]:
            _paused["was_enabled"] = gc.isenabled()
            gc.disable()
        _paused["parses"] += 1
    try:
        yield
    finally:
        with _paused_lock:
            _paused["parses"] -= 1
            if not _paused["parses"] and _paused["was_enabled"]:
                gc.enable()


_SPACE: Final = re.compile(r"[ \t\n\r]*")


def _load_manifest_doc(data: bytes, what: str) -> dict[str, Any]:
    """The JSON object of a manifest whose shape was checked, parsed as ``json.loads``
    parses it, but its ``members`` list one entry at a time.

    ``json.loads`` holds the GIL from the first byte to the last: over a second for
    16 MiB of manifest, during which a daemon that parses it in a thread answers
    nothing. Parsed entry by entry, the parse lets other threads (the event loop) run
    between entries, so it holds the GIL for about one member's entry at a time.

    Raises:
        ManifestError: it is not a JSON object.
    """
    try:
        text = data.decode()
        return _object_by_members(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{what} is not JSON: {exc}") from None
    except RecursionError:  # pragma: no cover - the shape check refuses it first
        raise ManifestError(f"{what} nests its JSON too deep") from None


def _skip_space(text: str, at: int) -> int:
    """The index of the first character at or after ``at`` that is not JSON's space."""
    found = _SPACE.match(text, at)
    return at if found is None else found.end()


def _object_by_members(text: str) -> dict[str, Any]:
    decode = _DECODER.raw_decode
    at = _skip_space(text, 0)
    if text[at : at + 1] != "{":
        raise ValueError("a manifest is a JSON object")
    doc: dict[str, Any] = {}
    at = _skip_space(text, at + 1)
    if text[at : at + 1] == "}":
        at += 1
    else:
        while True:
            if text[at : at + 1] != '"':
                raise ValueError(f"expecting a property name in double quotes (char {at})")
            key, at = decode(text, at)
            at = _skip_space(text, at)
            if text[at : at + 1] != ":":
                raise ValueError(f"expecting ':' delimiter (char {at})")
            at = _skip_space(text, at + 1)
            if key == "members" and text[at : at + 1] == "[":
                doc[key], at = _list_by_entries(text, at)
            else:
                doc[key], at = decode(text, at)
            at = _skip_space(text, at)
            delimiter = text[at : at + 1]
            at = _skip_space(text, at + 1)
            if delimiter == "}":
                break
            if delimiter != ",":
                raise ValueError(f"expecting ',' delimiter (char {at})")
    if at != len(text):
        raise ValueError(f"extra data (char {at})")
    return doc


def _list_by_entries(text: str, at: int) -> tuple[list[Any], int]:
    """The JSON list at ``text[at]`` (a ``[``), each entry parsed apart, and the
    index after it."""
    decode = _DECODER.raw_decode
    entries: list[Any] = []
    at = _skip_space(text, at + 1)
    if text[at : at + 1] == "]":
        return entries, at + 1
    while True:
        entry, at = decode(text, at)
        entries.append(entry)
        at = _skip_space(text, at)
        delimiter = text[at : at + 1]
        if delimiter == "]":
            return entries, at + 1
        if delimiter != ",":
            raise ValueError(f"expecting ',' delimiter (char {at})")
        at = _skip_space(text, at + 1)


# -- checks ------------------------------------------------------------------------------


def _object(doc: object, where: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise ManifestError(f"{where} must be a JSON object")
    return doc


def _text(doc: Mapping[str, Any], key: str, where: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str):
        raise ManifestError(f"{where}: {key!r} must be text")
    return value


def _whole(doc: Mapping[str, Any], key: str, where: str) -> int:
    value = doc.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ManifestError(f"{where}: {key!r} must be a whole number")
    return value
