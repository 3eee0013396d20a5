"""The inspector's worker process: media sniffing, and every op against a real daemon."""

from __future__ import annotations

import pytest

from chunkd.mediatype import MEDIA_TYPES, kind_of, sniff

# ---------------------------------------------------------------------------
# chunkd.mediatype
# ---------------------------------------------------------------------------

_HEADS = [
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "image/png", "image"),
    (b"\xff\xd8\xff\xe0\x00\x10JFIF\x00", "image/jpeg", "image"),
    (b"RIFF\x24\x00\x00\x00WEBPVP8 ", "image/webp", "image"),
    (b"GIF89a\x01\x00\x01\x00", "image/gif", "image"),
    (b"GIF87a\x01\x00\x01\x00", "image/gif", "image"),
    (b"RIFF\x24\x00\x00\x00WAVEfmt ", "audio/wav", "audio"),
    (b"fLaC\x00\x00\x00\x22", "audio/flac", "audio"),
    (b"ID3\x04\x00\x00\x00\x00\x00\x00", "audio/mpeg", "audio"),
    (b"\xff\xfb\x90\x64\x00\x00", "audio/mpeg", "audio"),
    (b"OggS\x00\x02\x00\x00", "audio/ogg", "audio"),
    (b"\x1a\x45\xdf\xa3\x9f\x42\x86\x81\x01", "video/webm", "video"),
    (b"\x00\x00\x00\x20ftypisom\x00\x00\x02\x00", "video/mp4", "video"),
]


@pytest.mark.parametrize(("head", "media_type", "kind"), _HEADS)
def test_sniff_knows_each_allowed_type(head: bytes, media_type: str, kind: str) -> None:
    assert sniff(head) == media_type
    assert media_type in MEDIA_TYPES
    assert kind_of(media_type) == kind


@pytest.mark.parametrize(
    "head",
    [
        b"",
        b"<svg xmlns='http://www.w3.org/2000/svg'><script>alert(1)</script></svg>",
        b"<?xml version='1.0'?><svg/>",
        b"<!DOCTYPE html><html><script>alert(1)</script>",
        b"<html><body>",
        b"PAR1\x15\x04",
        b'{"a": 1}\n',
        b"RIFF\x24\x00\x00\x00AVI LIST",
        b"\xff\xff\xff\xff",  # frame sync with reserved fields: random binary, not MP3
        b"\x89PN",
        b"\x00\x00\x00\x20moov",
    ],
)
def test_sniff_refuses_everything_else(head: bytes) -> None:
    assert sniff(head) is None


def test_kind_of_unknown_types() -> None:
    assert kind_of(None) is None
    assert kind_of("image/svg+xml") is None
    assert kind_of("text/html") is None
    assert len(MEDIA_TYPES) == 10
