"""Images in a terminal: the image values of an answer, and a half-block preview.

``chunkd inspect`` shows an image's type and size, and, when Pillow is installed and
the output is a terminal, a preview of it: rows of ``▀``, each cell two pixels (its
colour over its background), at most 64 columns wide. A picture bigger than 64 Mpixel
is refused by Pillow's bound, not decoded.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from rich.console import RenderableType

__all__ = ["LIST_ITEMS", "PREVIEWS", "PREVIEW_BYTES", "half_blocks", "image_values"]

#: images previewed in one view, and the largest one fetched for it
PREVIEWS: Final = 4
PREVIEW_BYTES: Final = 16 << 20
#: items of a list searched for images (four pages of folded items)
LIST_ITEMS: Final = 64


def image_values(value: Any, depth: int = 0) -> Iterator[dict[str, Any]]:
    """The image values inside ``value``, depth first (bounded depth)."""
    if depth > 16:
        return
    if isinstance(value, dict):
        media = value.get("$media")
        described = media if isinstance(media, dict) else value if "$bytes" in value else None
        if described is not None and str(described.get("media_type") or "").startswith("image/"):
            yield value
        else:
            for item in value.values():
                yield from image_values(item, depth + 1)
    elif isinstance(value, list):
        for item in value[:LIST_ITEMS]:
            yield from image_values(item, depth + 1)


def half_blocks(data: bytes, width: int) -> RenderableType | None:
    """An image as rows of '▀', each cell two pixels (its colour over its background)."""
    try:
        from PIL import Image
    except ImportError:
        return None
    from rich.color import Color
    from rich.style import Style
    from rich.text import Text

    Image.MAX_IMAGE_PIXELS = 64 << 20  # a bigger one is refused, not decoded
    try:
        with Image.open(io.BytesIO(data)) as image:
            size = image.size
            image.draft("RGB", (width, width))
            rgb = image.convert("RGB")
        rgb.thumbnail((max(8, width), 48))
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError):
        return None
    pixels = rgb.load()
    if pixels is None:
        return None
    w, h = rgb.size
    text = Text(f"{size[0]}x{size[1]} pixels\n", style="dim")
    for y in range(0, h, 2):
        for x in range(w):
            top = pixels[x, y]
            below = pixels[x, y + 1] if y + 1 < h else None
            text.append(
                "▀",
                Style(
                    color=Color.from_rgb(*top[:3]),  # type: ignore[index]
                    bgcolor=Color.from_rgb(*below[:3]) if below else None,  # type: ignore[index]
                ),
            )
        text.append("\n")
    return text
