"""Values as the inspector sends them: JSON as it is, and ``$``-objects for the rest.

``docs/inspector.md`` ("Values") is the contract. A value is never cut short: a long
string or a deep list goes whole. What JSON cannot hold becomes an object with a ``$``
key:

- ``{"$bytes": N, "media_type": T | null, "b64": ...}``: binary, its type sniffed from
  its first bytes (:func:`chunkd.mediatype.sniff`); ``b64`` holds the bytes when N is at
  most :data:`INLINE_BYTES`, else ``"ref"`` says how to fetch them (a range of an
  object, or a sample and its field).
- ``{"$media": {"name", "offset", "length", "media_type"}}``: media that lies as one
  range of an object (:func:`media`).
- ``{"$float": "nan" | "inf" | "-inf"}``, ``{"$datetime": ISO}``, ``{"$decimal": TEXT}``.

numpy scalars and arrays (MDS columns, Arrow tensors) become plain numbers and lists.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
import math
import sys
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Final

from chunkd.client.inspect.audio import audio_info
from chunkd.errors import MalformedFileError
from chunkd.mediatype import SNIFF_BYTES, sniff

__all__ = [
    "AUDIO_CELLS",
    "INLINE_BYTES",
    "MAX_ANSWER_BYTES",
    "MAX_DEPTH",
    "PAGE_BYTES",
    "AudioCells",
    "dumps",
    "encode",
    "json_bytes",
    "media",
]

#: binary values up to this size are sent inline (``b64``)
INLINE_BYTES: Final = 1 << 20
#: a page of rows stops early before its JSON passes this size (at least one row)
PAGE_BYTES: Final = 16 << 20
#: no answer is larger: one sample or row that would be is refused, with what to do
MAX_ANSWER_BYTES: Final = 64 << 20
#: values nested deeper are refused (JSON decoders have limits too)
MAX_DEPTH: Final = 200
#: in one page of rows, this many tar members that are audio get their header read
#: (``audio``: a few reads of at most 64 KiB each); the rest carry no ``audio``
AUDIO_CELLS: Final = 8
#: an integer of at most this many bits has fewer digits than Python's limit (4,300)
_SAFE_INT_BITS: Final = 14_000
#: numpy arrays of more elements than this go as their raw bytes
_MAX_ARRAY_ITEMS: Final = 1 << 20


def media(name: str, offset: int, length: int, media_type: str | None) -> dict[str, Any]:
    """The ``$media`` value of bytes ``offset .. offset + length`` of object ``name``."""
    return {"$media": {"name": name, "offset": offset, "length": length, "media_type": media_type}}


def binary(data: bytes | bytearray | memoryview, ref: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``$bytes`` value of ``data``; ``ref`` says where the bytes lie, for a value too
    big to send inline."""
    view = memoryview(data).cast("B")
    media_type = sniff(bytes(view[:SNIFF_BYTES]))
    out: dict[str, Any] = {"$bytes": view.nbytes, "media_type": media_type}
    if view.nbytes <= INLINE_BYTES:
        out["b64"] = base64.b64encode(view).decode("ascii")
        if media_type is not None and media_type.startswith("audio/"):
            # the bytes are here: their duration, rate and channels cost nothing more
            out["audio"] = audio_info(lambda o, n: bytes(view[o : o + n]), view.nbytes, media_type)
    elif ref is not None:
        out["ref"] = dict(ref)
    return out


class AudioCells:
    """How many more audio tar members of one page get their header read: each costs a
    few reads of its own (an Ogg's last 64 KiB among them), so a page of many audio
    cells reads the first :data:`AUDIO_CELLS` only.

    Args:
        left: how many may still be read.
    """

    def __init__(self, left: int = AUDIO_CELLS) -> None:
        self.left = left

    def take(self) -> bool:
        """Whether the next audio cell gets its header read (one fewer left if so)."""
        if self.left <= 0:
            return False
        self.left -= 1
        return True


def tar_file(
    read: Callable[[int, int], bytes | memoryview],
    name: str,
    ext: str,
    offset: int,
    size: int,
    cells: AudioCells | None = None,
) -> Any:
    """The value of a tar member (a WebDataset sample's file ``ext``) lying at ``offset``
    of object ``name``, read with ``read(offset, length)``: ``$media`` when its first
    bytes are a media type, ``$bytes`` with a range ``ref`` when it is big, else its text
    (JSON parsed for a ``json`` extension) or its bytes. An audio member carries
    ``audio`` from its header where ``cells`` (a page's budget; None: one sample alone)
    has some left."""
    media_type = sniff(bytes(read(offset, min(size, SNIFF_BYTES))))
    if media_type is not None:
        found = media(name, offset, size, media_type)
        if media_type.startswith("audio/") and (cells is None or cells.take()):
            found["$media"]["audio"] = audio_info(
                lambda o, n: bytes(read(offset + o, min(n, size - o))), size, media_type
            )
        return found
    ref = {"name": name, "offset": offset, "length": size}
    if size > INLINE_BYTES:
        return {"$bytes": size, "media_type": None, "ref": ref}
    data = bytes(read(offset, size))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return binary(data, ref)
    if ext.endswith("json"):
        try:
            return encode(json.loads(text))
        except (ValueError, RecursionError):
            return text
    return text


def encode(value: Any, ref: Mapping[str, Any] | None = None, _depth: int = 0) -> Any:
    """``value`` as the inspector sends it (see the module docstring).

    Args:
        value: a decoded value: what pyarrow's ``to_pylist``, ``json.loads`` or an MDS
            decoder gives.
        ref: where the value lies (``{"sample": ID}``): a binary value too big to
            send inline gets it as its ``ref``, with the field's path added.

    Raises:
        MalformedFileError: the value is nested more than :data:`MAX_DEPTH` deep, or is
            an integer of more digits than Python writes as text (4,300): a page could
            not be written with it. ``ref``'s sample is named.
    """
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        if value.bit_length() > _SAFE_INT_BITS:
            _check_digits(value, ref)
        return value
    if isinstance(value, float):
        if math.isnan(value):
            return {"$float": "nan"}
        if math.isinf(value):
            return {"$float": "inf" if value > 0 else "-inf"}
        return value
    if _depth > MAX_DEPTH:
        raise MalformedFileError(
            f"{_where(ref)}holds a value nested more than {MAX_DEPTH} deep, deeper than the "
            "inspector shows; read it with the client"
        )
    if isinstance(value, bytes | bytearray | memoryview):
        return binary(value, ref)
    if isinstance(value, Mapping):
        if "$media" in value and len(value) == 1:
            return dict(value)  # made by media(): already a value
        return {str(k): encode(v, _child(ref, str(k)), _depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encode(v, _child(ref, i), _depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return {"$datetime": value.isoformat()}
    if isinstance(value, dt.timedelta):
        return {"$decimal": str(value.total_seconds())}
    if isinstance(value, decimal.Decimal):
        return {"$decimal": str(value)}
    if isinstance(value, uuid.UUID):
        return str(value)
    return _other(value, ref, _depth)


def _check_digits(value: int, ref: Mapping[str, Any] | None) -> None:
    """Refuse an integer Python will not write as decimal text (``sys.int_info``'s
    limit, 4,300 digits by default, which guards against quadratic conversions)."""
    try:
        str(value)  # the limit is checked before any conversion work
    except ValueError:
        raise MalformedFileError(
            f"{_where(ref)}holds an integer of about {int(value.bit_length() * 0.30103)} "
            f"digits, more than the {sys.get_int_max_str_digits()} the inspector writes; "
            "read it with the client"
        ) from None


def _where(ref: Mapping[str, Any] | None) -> str:
    """``SAMPLE `` for a message, where ``ref`` names one."""
    sample = ref.get("sample") if ref is not None else None
    return f"{sample} " if isinstance(sample, str) else ""


def _other(value: Any, ref: Mapping[str, Any] | None, depth: int) -> Any:
    """numpy scalars and arrays, and anything else as its text."""
    module = type(value).__module__
    if module == "numpy":
        import numpy as np

        if isinstance(value, np.ndarray):
            if value.dtype.kind in "biuf" and value.size <= _MAX_ARRAY_ITEMS:
                return encode(value.tolist(), ref, depth + 1)
            return binary(np.ascontiguousarray(value).tobytes(), ref)
        if isinstance(value, np.generic):
            return encode(value.item(), ref, depth + 1)
    return str(value)


def _child(ref: Mapping[str, Any] | None, key: str | int) -> Mapping[str, Any] | None:
    if ref is None or "sample" not in ref:
        return ref
    return {**ref, "field": [*ref.get("field", []), key]}


def dumps(doc: Any) -> str:
    """One line of ASCII JSON, no NaN (values are encoded first). ASCII, so that a
    string holding a lone surrogate (JSON allows one) still makes valid UTF-8."""
    return json.dumps(doc, allow_nan=False, separators=(",", ":"))


def json_bytes(doc: Any) -> int:
    """The bytes ``doc`` takes as the worker writes it."""
    return len(dumps(doc))
