"""What an audio file says about itself: duration, sample rate, channels, from its
headers only (the inspector's audio view).

Each parser reads through ``read(offset, length)`` and never more than a few small
windows, whatever the file's size: a WAV's chunk headers (at most :data:`MAX_CHUNKS`
of them, in the first :data:`WAV_SCAN` bytes), a FLAC's first metadata block, an MP3's
ID3v2 header and first frame (with its Xing/Info or VBRI header), an Ogg's first page
and its last :data:`TAIL_BYTES` (the last granule position says how long it is). A file
whose headers do not parse gives ``None``, never an error: the browser still plays
what it can, and the page says the header could not be read.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Final

__all__ = ["MAX_READ", "audio_info"]

#: the most bytes one window reads
MAX_READ: Final = 64 << 10
#: a WAV's chunks are looked for in its first this many bytes ...
WAV_SCAN: Final = 1 << 20
#: ... and at most this many of them (a LIST, a fact, a JUNK pad come before data)
MAX_CHUNKS: Final = 32
#: an Ogg's last granule position is looked for in its last this many bytes
TAIL_BYTES: Final = MAX_READ

Read = Callable[[int, int], bytes]

# MPEG audio: bitrates (kbit/s) by [version is 1][layer], sample rates by version
_MP3_BITRATES: Final = {
    (True, 1): (0, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),
    (True, 2): (0, 32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),
    (True, 3): (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    (False, 1): (0, 32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
    (False, 2): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
    (False, 3): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
_MP3_RATES: Final = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}


def audio_info(read: Read, size: int, media_type: str | None) -> dict[str, Any] | None:
    """Duration (seconds), sample rate (Hz), channels and codec of an audio file.

    Args:
        read: ``read(offset, length)`` of the file's bytes (fewer at its end).
        size: the file's size in bytes.
        media_type: its sniffed type (``audio/wav``, ``audio/flac``, ``audio/mpeg``,
            ``audio/ogg``); any other gives ``None``.

    Returns:
        ``{"codec", "duration", "sample_rate", "channels", "bits"}`` (a value the header
        does not say is ``None``), or ``None`` when the header cannot be read.
    """
    parse = {
        "audio/wav": _wav,
        "audio/flac": _flac,
        "audio/mpeg": _mp3,
        "audio/ogg": _ogg,
    }.get(media_type or "")
    if parse is None or size <= 0:
        return None

    def bounded(offset: int, length: int) -> bytes:
        if offset < 0 or offset >= size:
            return b""
        return bytes(read(offset, min(length, MAX_READ, size - offset)))

    try:
        return parse(bounded, size)
    except (struct.error, ValueError, IndexError, ZeroDivisionError):
        return None


def _info(
    codec: str, duration: float | None, rate: int | None, channels: int | None, bits: int | None
) -> dict[str, Any]:
    return {
        "codec": codec,
        "duration": None if duration is None else round(duration, 6),
        "sample_rate": rate,
        "channels": channels,
        "bits": bits,
    }


def _wav(read: Read, size: int) -> dict[str, Any] | None:
    head = read(0, 12)
    if len(head) < 12 or head[:4] not in (b"RIFF", b"RF64") or head[8:12] != b"WAVE":
        return None
    offset = 12
    fmt: tuple[int, int, int, int, int] | None = None
    data_bytes: int | None = None
    rf64_data: int | None = None
    for _ in range(MAX_CHUNKS):
        if offset + 8 > min(size, WAV_SCAN):
            break
        chunk = read(offset, 8)
        if len(chunk) < 8:
            break
        cid, length = chunk[:4], struct.unpack("<I", chunk[4:8])[0]
        if cid == b"ds64":  # RF64: the real sizes, 64-bit
            body = read(offset + 8, 28)
            rf64_data = struct.unpack("<Q", body[8:16])[0]
        elif cid == b"fmt ":
            body = read(offset + 8, 16)
            tag, channels, rate, byte_rate, align = struct.unpack("<HHIIH", body[:14])
            bits = struct.unpack("<H", body[14:16])[0]
            fmt = (channels, rate, byte_rate, align, bits)
            del tag
        elif cid == b"data":
            data_bytes = rf64_data if length == 0xFFFFFFFF and rf64_data else length
            # a streamed WAV's data length may be unset (0 or past the end): what is there
            data_bytes = min(data_bytes, size - offset - 8) if data_bytes else size - offset - 8
            break
        offset += 8 + length + (length & 1)
    if fmt is None:
        return None
    channels, rate, byte_rate, align, bits = fmt
    duration = None
    if data_bytes is not None and byte_rate:
        duration = data_bytes / byte_rate
    elif data_bytes is not None and align and rate:
        duration = data_bytes / align / rate
    return _info("pcm" if bits else "wav", duration, rate or None, channels or None, bits or None)


def _flac(read: Read, size: int) -> dict[str, Any] | None:
    head = read(0, 42)
    # "fLaC", then the first metadata block, which must be STREAMINFO (type 0, 34 bytes)
    if len(head) < 42 or head[:4] != b"fLaC" or head[4] & 0x7F != 0:
        return None
    info = head[8:42]
    rate = (info[10] << 12) | (info[11] << 4) | (info[12] >> 4)
    channels = ((info[12] >> 1) & 0x07) + 1
    bits = (((info[12] & 0x01) << 4) | (info[13] >> 4)) + 1
    total = ((info[13] & 0x0F) << 32) | struct.unpack(">I", info[14:18])[0]
    duration = total / rate if rate and total else None
    return _info("flac", duration, rate or None, channels, bits)


def _syncsafe(b: bytes) -> int:
    return (b[0] << 21) | (b[1] << 14) | (b[2] << 7) | b[3]


def _mp3(read: Read, size: int) -> dict[str, Any] | None:
    offset = 0
    head = read(0, 10)
    if head[:3] == b"ID3" and len(head) == 10:
        offset = 10 + _syncsafe(head[6:10]) + (10 if head[5] & 0x10 else 0)
    window = read(offset, 4096)
    # the first frame sync after the tag (some files pad the tag with zeros)
    at = 0
    while True:
        at = window.find(b"\xff", at)
        if at < 0 or at + 4 > len(window):
            return None
        if window[at + 1] & 0xE0 == 0xE0:
            break
        at += 1
    frame = window[at:]
    version = (frame[1] >> 3) & 0x03  # 3: MPEG-1, 2: MPEG-2, 0: MPEG-2.5
    layer = 4 - ((frame[1] >> 1) & 0x03)  # 1, 2, 3
    if version == 1 or layer == 4:
        return None
    bitrate = _MP3_BITRATES[(version == 3, layer)][frame[2] >> 4] * 1000
    rate = _MP3_RATES[version][(frame[2] >> 2) & 0x03]
    channels = 1 if (frame[3] >> 6) == 3 else 2
    samples_per_frame = 384 if layer == 1 else (1152 if layer == 2 or version == 3 else 576)
    duration = None
    # Xing/Info (VBR or LAME's CBR header) after the side information, or VBRI at 36
    side = (17 if channels == 1 else 32) if version == 3 else (9 if channels == 1 else 17)
    for tag_at in (4 + side, 36):
        tag = frame[tag_at : tag_at + 12]
        if tag[:4] in (b"Xing", b"Info") and struct.unpack(">I", tag[4:8])[0] & 1:
            frames = struct.unpack(">I", tag[8:12])[0]
            duration = frames * samples_per_frame / rate
            break
        if tag[:4] == b"VBRI" and tag_at == 36:
            vbri = frame[tag_at : tag_at + 18]
            frames = struct.unpack(">I", vbri[14:18])[0]
            duration = frames * samples_per_frame / rate
            break
    if duration is None and bitrate:
        # a constant bit rate: the audio bytes over the rate (an ID3v1 tag at the end aside)
        tail = read(size - 128, 3) if size >= 128 else b""
        audio_bytes = size - offset - at - (128 if tail == b"TAG" else 0)
        duration = audio_bytes * 8 / bitrate
    return _info("mp3", duration, rate, channels, None)


def _ogg_page(data: bytes, at: int) -> tuple[int, int, bytes] | None:
    """The page at ``at`` of ``data``: its granule position, its length and its body."""
    if data[at : at + 4] != b"OggS" or at + 27 > len(data):
        return None
    granule = struct.unpack("<q", data[at + 6 : at + 14])[0]
    segments = data[at + 26]
    table = data[at + 27 : at + 27 + segments]
    body_at = at + 27 + segments
    length = sum(table)
    return granule, body_at + length - at, data[body_at : body_at + length]


def _ogg(read: Read, size: int) -> dict[str, Any] | None:
    head = read(0, 4096)
    first = _ogg_page(head, 0)
    if first is None:
        return None
    body = first[2]
    pre_skip = 0
    if body[:7] == b"\x01vorbis":
        channels = body[11]
        rate = struct.unpack("<I", body[12:16])[0]
        codec = "vorbis"
        clock = rate
    elif body[:8] == b"OpusHead":
        channels = body[9]
        pre_skip = struct.unpack("<H", body[10:12])[0]
        rate = struct.unpack("<I", body[12:16])[0] or 48000  # the input's rate
        codec = "opus"
        clock = 48000  # Opus granules count 48 kHz samples whatever the input's rate
    elif body[:5] == b"\x7fFLAC":
        info = body[13:47]
        rate = (info[10] << 12) | (info[11] << 4) | (info[12] >> 4)
        channels = ((info[12] >> 1) & 0x07) + 1
        codec = "flac"
        clock = rate
    else:
        return None
    # the last page's granule position is the stream's length in samples
    start = max(0, size - TAIL_BYTES)
    tail = read(start, size - start)
    granule = None
    at = tail.rfind(b"OggS")
    while at >= 0:
        page = _ogg_page(tail, at)
        if page is not None and page[0] >= 0:
            granule = page[0]
            break
        at = tail.rfind(b"OggS", 0, at)
    # An Opus stream whose last granule is below its pre-skip (a broken or cut stream)
    # has no length to tell: unknown, never a negative duration.
    samples = granule - pre_skip if granule else None
    duration = samples / clock if samples is not None and samples >= 0 and clock else None
    return _info(codec, duration, rate or None, channels or None, None)
