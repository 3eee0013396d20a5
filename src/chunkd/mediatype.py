"""Media types sniffed from an object's first bytes.

The inspector serves samples to a browser. Only a short allowlist of image, audio and
video types may be served as themselves; anything else (above all SVG and HTML, which
a browser would run as a page) is not recognised here and is served as
``application/octet-stream``. The type comes from magic numbers only, never from a
file name or a claimed ``Content-Type``, so a hostile object cannot pick its own type.

Pure and dependency-free: the daemon, the inspector's workers and the client import it.
"""

from __future__ import annotations

from typing import Final, Literal

__all__ = ["MEDIA_TYPES", "SNIFF_BYTES", "kind_of", "sniff"]

#: How many leading bytes :func:`sniff` needs to decide (it accepts fewer).
SNIFF_BYTES: Final = 64

_IMAGE: Final = frozenset({"image/png", "image/jpeg", "image/webp", "image/gif"})
_AUDIO: Final = frozenset({"audio/wav", "audio/flac", "audio/mpeg", "audio/ogg"})
_VIDEO: Final = frozenset({"video/webm", "video/mp4"})

#: Every media type :func:`sniff` can answer: the ones the inspector serves as media.
MEDIA_TYPES: Final[frozenset[str]] = _IMAGE | _AUDIO | _VIDEO

# MPEG audio frame sync: 11 set bits, then a version that is not "reserved" (01), a
# layer that is not "reserved" (00), a bitrate index that is not "bad" (1111) and a
# sample-rate index that is not "reserved" (11). Checking the reserved values keeps
# random binary that happens to start with 0xFF 0xE? from passing as MP3.
_MPEG_VERSION_RESERVED: Final = 0b01
_MPEG_LAYER_RESERVED: Final = 0b00


def _is_mpeg_frame(head: bytes) -> bool:
    if len(head) < 4 or head[0] != 0xFF or (head[1] & 0xE0) != 0xE0:
        return False
    version = (head[1] >> 3) & 0b11
    layer = (head[1] >> 1) & 0b11
    bitrate = head[2] >> 4
    rate = (head[2] >> 2) & 0b11
    return (
        version != _MPEG_VERSION_RESERVED
        and layer != _MPEG_LAYER_RESERVED
        and bitrate != 0b1111
        and rate != 0b11
    )


def sniff(head: bytes) -> str | None:
    """The media type of an object from its first bytes, or ``None``.

    Args:
        head: The object's first bytes; :data:`SNIFF_BYTES` are enough, fewer may
            fail to match.

    Returns:
        One of :data:`MEDIA_TYPES`: ``image/png``, ``image/jpeg``, ``image/webp``,
        ``image/gif``, ``audio/wav``, ``audio/flac``, ``audio/mpeg`` (an ID3 tag or an
        MPEG audio frame), ``audio/ogg``, ``video/webm`` (any EBML/Matroska stream) or
        ``video/mp4`` (an ``ftyp`` box at offset 4); ``None`` for anything else,
        including SVG, HTML and text.
    """
    head = bytes(head[:SNIFF_BYTES])
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if head.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    if head.startswith(b"RIFF") and len(head) >= 12:
        form = head[8:12]
        if form == b"WEBP":
            return "image/webp"
        if form == b"WAVE":
            return "audio/wav"
        return None
    if head.startswith(b"fLaC"):
        return "audio/flac"
    if head.startswith(b"ID3") or _is_mpeg_frame(head):
        return "audio/mpeg"
    if head.startswith(b"OggS"):
        return "audio/ogg"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "video/webm"
    if len(head) >= 12 and head[4:8] == b"ftyp":
        return "video/mp4"
    return None


def kind_of(media_type: str | None) -> Literal["image", "audio", "video"] | None:
    """Whether a sniffed media type is an image, audio or video.

    Args:
        media_type: A type as :func:`sniff` answers it (or ``None``).

    Returns:
        ``"image"``, ``"audio"`` or ``"video"`` for a type in :data:`MEDIA_TYPES`,
        ``None`` for anything else.
    """
    if media_type in _IMAGE:
        return "image"
    if media_type in _AUDIO:
        return "audio"
    if media_type in _VIDEO:
        return "video"
    return None
