"""The inspector's view of an image, audio or video object (:class:`MediaView`): the whole
object as one ``$media`` range, which the browser decodes; an audio object's duration,
rate and channels from its headers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from chunkd.client.inspect.audio import audio_info
from chunkd.client.inspect.values import media
from chunkd.client.inspect.views.view import PinnedReads, past_end

if TYPE_CHECKING:
    from chunkd.client.results import ObjectStat

__all__ = ["MediaView"]


class MediaView:
    """An image, audio or video object: the browser decodes it from ranges."""

    def __init__(
        self, stat: ObjectStat, kind: str, media_type: str | None, read: PinnedReads | None = None
    ) -> None:
        self.kind = kind
        self.name = stat.name
        self._stat = stat
        self.media_type = media_type
        self._read = read
        self._audio: dict[str, Any] | None = None

    total = 1
    nbytes = 256

    def fields(self) -> list[str] | None:
        return None

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"media": self._media()}
        if self.kind == "audio":
            # its duration, rate and channels from its headers: a few small reads
            if self._audio is None and self._read is not None:
                read = self._read
                self._audio = (
                    audio_info(lambda o, n: bytes(read(o, n)), self._stat.size, self.media_type)
                    or {}
                )
            out["audio"] = self._audio or None
        return out

    def _media(self) -> dict[str, Any]:
        return media(self.name, 0, self._stat.size, self.media_type)

    def rows(self, start: int, columns: list[str] | None) -> Iterator[tuple[int, Any]]:
        if start != 0:
            raise past_end(self.name, start, 1)
        yield 0, self._media()
