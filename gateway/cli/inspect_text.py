"""How ``chunkd inspect`` prints: values folded to a few lines (``--full`` whole), floats
as the page shows them, control characters escaped, notes, small tables, ``--json``,
and image previews (:class:`Printer`, which the views build on).

Data never drives the terminal: every string shown goes through :func:`clean`.
"""

from __future__ import annotations

import argparse
import base64
import decimal
import json
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, TextIO

from chunkd.gateway.cli.inspect_api import InspectApi, Refused
from chunkd.gateway.cli.inspect_images import PREVIEW_BYTES, PREVIEWS, half_blocks, image_values
from chunkd.gateway.cli.options import human_size

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

__all__ = [
    "FOLD_CHARS",
    "FOLD_ITEMS",
    "FOLD_LINES",
    "SIG_DIGITS",
    "Printer",
    "audio_text",
    "clean",
    "float_text",
    "fold_text",
    "rich_text",
    "shell_word",
    "special_text",
    "when_text",
]

#: a string longer than this (or of more lines) is folded unless --full
FOLD_CHARS: Final = 240
FOLD_LINES: Final = 3
#: list items shown before the rest are counted
FOLD_ITEMS: Final = 16
#: a float in a table shows this many significant digits (inspect.js's SIG_DIGITS)
SIG_DIGITS: Final = 4
_FOUR_DIGITS: Final = decimal.Decimal("1.000")
# C0 controls but tab and newline, DEL and C1: a sample must not drive the terminal.
_CONTROLS: Final = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)]}
del _CONTROLS[0x09], _CONTROLS[0x0A]


@dataclass
class Printer:
    """One invocation's output: asks the API, prints what it answers (the views are
    its subclasses, :class:`~chunkd.gateway.cli.inspect_catalog.CatalogViews` and
    :class:`~chunkd.gateway.cli.inspect_objects.ObjectViews`)."""

    args: argparse.Namespace
    api: InspectApi
    out: TextIO
    console: Console = field(init=False)
    previews: int = 0

    def __post_init__(self) -> None:
        from rich.console import Console

        self.console = Console(file=self.out, highlight=False, soft_wrap=False)

    def emit(self, answer: Any) -> bool:
        """Print ``answer`` as JSON if --json asked for it; whether it did."""
        if not self.args.json:
            return False
        text = json.dumps(answer, indent=2, ensure_ascii=False)
        # C1 controls can only sit inside JSON strings, where \\u escapes are valid.
        self.out.write(text.translate({c: f"\\u{c:04x}" for c in range(0x80, 0xA0)}) + "\n")
        return True

    def say(self, line: str) -> None:
        """A note for the reader: dim, after the view."""
        self.console.print(rich_text(line, "dim"))

    def more(self, token: Any, template: str) -> None:
        if token is not None:
            self.say(template.format(token))

    def small_table(self, title: str, names: list[str], rows: list[dict[str, Any]]) -> None:
        from rich.table import Table

        table = Table(*names, title=rich_text(title), title_justify="left")
        for row in rows:
            table.add_row(*(self.cell(row.get(n)) for n in names))
        self.console.print(table)

    def cell(self, value: Any) -> Text:
        """One value, on a few lines at most unless --full."""
        from rich.text import Text

        if value is None:
            return Text("null", style="dim")
        if isinstance(value, bool):
            return Text(str(value).lower())
        if isinstance(value, float) and not self.args.full:
            return Text(float_text(value))
        if isinstance(value, int | float):
            return Text(str(value))
        if isinstance(value, str):
            return self.whole(value)
        special = special_text(value)
        if special is not None:
            return Text(special, style="cyan")
        return self.whole(json.dumps(self.fold(value), ensure_ascii=False))

    def whole(self, text: str) -> Text:
        """``text`` folded to a few lines; with --full all of it, a word longer than its
        column (base64, a URL) broken across lines rather than cut."""
        if not self.args.full:
            return rich_text(fold_text(text))
        out = rich_text(text)
        out.overflow = "fold"
        return out

    def fold(self, value: Any, depth: int = 0) -> Any:
        """``value`` with long strings folded, long lists cut and binary described."""
        if isinstance(value, str):
            return clean(value if self.args.full else fold_text(value))
        if isinstance(value, list):
            shown = value if self.args.full else value[:FOLD_ITEMS]
            folded = [self.fold(v, depth + 1) for v in shown]
            if len(shown) < len(value):
                folded.append(f"... {len(value) - len(shown)} more items (--full)")
            return folded
        if isinstance(value, dict):
            special = special_text(value)
            if special is not None:
                return special
            return {clean(str(k)): self.fold(v, depth + 1) for k, v in value.items()}
        return value

    def show_previews(self, value: Any) -> None:
        """Each image in ``value``: its type and size, and a preview on a terminal."""
        if self.args.no_preview or self.args.json or not self.console.is_terminal:
            return
        for image in image_values(value):
            if self.previews >= PREVIEWS:
                return
            data = self.image_bytes(image)
            if data is None:
                continue
            preview = half_blocks(data, min(self.console.width - 2, 64))
            if preview is not None:
                self.previews += 1
                self.console.print(preview)

    def images(self, opened: dict[str, Any]) -> None:
        media = opened.get("$media") or opened.get("media")
        if isinstance(media, dict):
            media = media.get("$media", media)
            self.console.print(rich_text(special_text({"$media": media}) or ""))
            self.show_previews({"$media": media})

    def image_bytes(self, value: dict[str, Any]) -> bytes | None:
        if "$bytes" in value and isinstance(value.get("b64"), str):
            return base64.b64decode(value["b64"])
        media = value.get("$media")
        if isinstance(media, dict) and 0 < (media.get("length") or 0) <= PREVIEW_BYTES:
            try:
                return self.api.media(str(media["name"]), int(media["offset"]), media["length"])
            except Refused:
                return None
        return None


def special_text(value: Any) -> str | None:
    """A ``$``-value of the API in a few words; None for an ordinary object."""
    if not isinstance(value, dict):
        return None
    if "$bytes" in value:
        kind = value.get("media_type") or "binary"
        sound = audio_text(value.get("audio"))
        return f"<{kind}, {human_size(value['$bytes'] or 0)}" + (f", {sound}>" if sound else ">")
    if isinstance(value.get("$media"), dict):
        media = value["$media"]
        kind = media.get("media_type") or "media"
        sound = audio_text(media.get("audio"))
        return (
            f"<{kind}, {human_size(media.get('length') or 0)}"
            + (f", {sound}" if sound else "")
            + f" at {clean(str(media.get('name')))}+{media.get('offset')}>"
        )
    for key in ("$float", "$datetime", "$decimal"):
        if key in value:
            return clean(str(value[key]))
    return None


def audio_text(info: Any) -> str:
    """What an audio header says, as the page says it: ``2.50 s, 16 kHz, mono, PCM
    16-bit``; empty when the header could not be read."""
    if not isinstance(info, dict):
        return ""
    parts = []
    duration = info.get("duration")
    if isinstance(duration, int | float) and not isinstance(duration, bool):
        minutes, seconds = divmod(float(duration), 60)
        parts.append(f"{int(minutes)}:{seconds:05.2f}" if minutes else f"{seconds:.2f} s")
    rate = info.get("sample_rate")
    if isinstance(rate, int | float) and not isinstance(rate, bool) and rate > 0:
        parts.append(f"{rate / 1000:g} kHz")
    channels = info.get("channels")
    if isinstance(channels, int) and not isinstance(channels, bool) and channels > 0:
        parts.append({1: "mono", 2: "stereo"}.get(channels, f"{channels} channels"))
    codec = " ".join(
        str(x)
        for x in (info.get("codec"), f"{info['bits']}-bit" if info.get("bits") else None)
        if x
    )
    if codec:
        parts.append(clean(codec))
    return ", ".join(parts)


def float_text(value: float) -> str:
    """A float as the page shows it (``fmtFloat`` in inspect.js, the same strings): 4
    significant digits (``0.1429``), whole digits never rounded away (``12345.7``),
    below 0.001 or from 10^15 in exponent form with its trailing zeros dropped
    (``2.914e-4``, ``1e-5``), a whole number whole (``3``), as JavaScript writes them;
    --full prints every digit."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    if value.is_integer():
        # JavaScript's String(n): every digit below 10^21, exponent form from there
        return str(int(value)) if abs(value) < 1e21 else repr(value).replace("e+0", "e+")
    size = abs(value)
    sign = "-" if value < 0 else ""
    if size < 1e-3 or size >= 1e15:
        # toExponential(3): the exact value rounded half up, then `\.?0+e` dropped
        exact = decimal.Decimal(size)
        exponent = exact.adjusted()
        digits = exact.scaleb(-exponent).quantize(_FOUR_DIGITS, decimal.ROUND_HALF_UP)
        if digits >= 10:  # 9.9996e-4 rounds to 10.000e-4: 1.000e-3
            exponent += 1
            digits = exact.scaleb(-exponent).quantize(_FOUR_DIGITS, decimal.ROUND_HALF_UP)
        mantissa = re.sub(r"\.?0+$", "", f"{digits:f}")
        return f"{sign}{mantissa}e{'+' if exponent >= 0 else '-'}{abs(exponent)}"
    # toFixed(max(1, 4 - whole digits)): the exact value rounded half up
    whole = math.floor(math.log10(size)) + 1
    places = max(1, SIG_DIGITS - whole)
    fixed = decimal.Decimal(size).quantize(
        decimal.Decimal(1).scaleb(-places), decimal.ROUND_HALF_UP
    )
    text = f"{fixed:f}".rstrip("0")
    return f"{sign}{text}0" if text.endswith(".") else f"{sign}{text}"


def when_text(value: Any) -> str:
    """A time the API sends as seconds since the epoch, in UTC for a person."""
    import datetime as dt

    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            when = dt.datetime.fromtimestamp(value, dt.UTC)
        except (OverflowError, OSError, ValueError):
            return str(value)
        return when.strftime("%Y-%m-%d %H:%M:%S")
    return "" if value is None else str(value)


def fold_text(text: str) -> str:
    """``text`` cut to :data:`FOLD_LINES` lines and :data:`FOLD_CHARS` characters."""
    lines = text.split("\n")
    cut = "\n".join(lines[:FOLD_LINES])[:FOLD_CHARS]
    if len(cut) == len(text):
        return text
    return f"{cut}... [{len(text) - len(cut)} more chars, --full]"


def clean(text: str) -> str:
    """``text`` with control characters shown as escapes: data never drives the terminal."""
    return text.translate(_CONTROLS)


def rich_text(value: Any, style: str = "") -> Text:
    """``value`` as rich text, never read as markup."""
    from rich.text import Text

    return Text(clean("" if value is None else str(value)), style=style)


def shell_word(word: str) -> str:
    import shlex

    return shlex.quote(word)
