"""The result types every benchmark fills and every view of a run reads: a row
(:class:`Result`) with its rounds (:class:`Rounds`), a plot's data (:class:`Series`), a
scenario's wall time (:class:`Duration`), the report's areas, and the texts of their
numbers (:func:`number_text`, :func:`duration_text`, ...).

A room of its own so that the views of a run (:mod:`bench.report`'s Markdown,
:mod:`bench.history`, :mod:`bench.page`, :mod:`bench.plots`) import it and not each
other: :mod:`bench.report` writes the run through the others, none of them imports it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

__all__ = [
    "AREAS",
    "MAX_ROUNDS",
    "MAX_SERIES",
    "PERCENTILES",
    "Duration",
    "Result",
    "Rounds",
    "Run",
    "Series",
    "cell_text",
    "duration_text",
    "number_text",
    "percentile",
    "ratio_text",
    "shortfall_text",
]

#: the report's tables, in this order; a row's area is one of these or any other name
#: (tables of other areas follow these, in the order their first row came)
AREAS = (
    "cache",
    "gateway (read path)",
    "client",
    "listing",
    "checkpoints",
    "fan-out",
    "cold reads at link speed",
    "datasets and time to first batch",
    "inspector",
    "S3 front",
    "faults",
    "soak",
)

#: the most rounds a row keeps: a benchmark that runs more summarizes them first
MAX_ROUNDS = 64
#: the most series a run keeps for its plots (each holds a few hundred numbers at most)
MAX_SERIES = 256
#: the percentiles a latency series keeps, whatever the number of samples
PERCENTILES = (0.0, 1.0, 5.0, 10.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.9, 100.0)


@dataclass(frozen=True)
class Rounds:
    """Each side's figure per round (in the row's unit, or any unit proportional to it).

    ``baseline`` may be empty (a row with no baseline rounds: a fixed baseline, or
    none), or hold one figure (the same baseline for every round).
    """

    chunkd: tuple[float, ...]
    baseline: tuple[float, ...] = ()

    @classmethod
    def of(cls, chunkd: Iterable[float], baseline: Iterable[float] = ()) -> Rounds:
        """Rounds from any iterables of figures."""
        rounds = cls(tuple(float(v) for v in chunkd), tuple(float(v) for v in baseline))
        if not rounds.chunkd or max(len(rounds.chunkd), len(rounds.baseline)) > MAX_ROUNDS:
            raise ValueError(
                f"a row keeps 1 to {MAX_ROUNDS} rounds, got {len(rounds.chunkd)} and "
                f"{len(rounds.baseline)}: summarize longer runs before adding them"
            )
        return rounds

    def scaled(self, factor: float) -> Rounds:
        """Both sides times ``factor`` (a change of unit)."""
        return Rounds(
            tuple(v * factor for v in self.chunkd), tuple(v * factor for v in self.baseline)
        )

    @property
    def count(self) -> int:
        """How many rounds: the larger side."""
        return max(len(self.chunkd), len(self.baseline))

    def ratios(self) -> list[float]:
        """chunkd / baseline per round, where the sides pair up (same count, or one
        baseline for all); empty where they do not."""
        if len(self.baseline) == len(self.chunkd):
            pairs = list(zip(self.chunkd, self.baseline, strict=True))
        elif len(self.baseline) == 1:
            pairs = [(c, self.baseline[0]) for c in self.chunkd]
        else:
            return []
        return [c / b for c, b in pairs if b and math.isfinite(c / b)]

    def ratio_spread(self) -> tuple[float, float] | None:
        """The min and max of the ratio over the rounds. Sides that do not pair up (other
        counts) give the widest spread they allow: the lowest over the highest, and the
        highest over the lowest."""
        paired = self.ratios()
        if paired:
            return min(paired), max(paired)
        base = [b for b in self.baseline if b and math.isfinite(b)]
        if not base or not self.chunkd:
            return None
        return min(self.chunkd) / max(base), max(self.chunkd) / min(base)

    def chunkd_spread(self) -> tuple[float, float]:
        """The min and max of chunkd's figure over the rounds."""
        return min(self.chunkd), max(self.chunkd)


@dataclass
class Result:
    """One row: chunkd against the baseline a user would use instead."""

    scenario: str
    chunkd: float
    baseline: float
    unit: str
    baseline_name: str
    #: the lowest acceptable chunkd/baseline (higher is better) or ``None``
    target_ratio: float | None = None
    #: for time-to-X rows: the most acceptable chunkd value, in ``unit``
    target_max: float | None = None
    note: str = ""
    #: each side's figure per round; ``None``: one round, no spread
    samples: Rounds | None = None
    #: which table the row goes in (:data:`AREAS`); ``Report.add`` fills in its own area
    area: str = ""
    #: "higher" or "lower" is better; "" works it out (see :attr:`higher_is_better`)
    better: str = ""
    #: the scenario (what ``--only`` names) that measured the row; ``Report.add`` fills it
    part_of: str = ""

    @property
    def ratio(self) -> float:
        """chunkd / baseline."""
        return self.chunkd / self.baseline if self.baseline else float("nan")

    @property
    def verdict(self) -> str:
        """'met', 'missed' or '' when there is no target (:meth:`verdict_text` says it
        in words)."""
        if self.target_ratio is not None:
            return "met" if self.ratio >= self.target_ratio else "missed"
        if self.target_max is not None:
            return "met" if self.chunkd <= self.target_max else "missed"
        return ""

    def verdict_text(self) -> str:
        """The verdict in words: the figure, against what, the target, and by how much it
        was missed; '' when there is no target.

        ``0.36x against pyarrow reading the footers (5,218 vs 14,559 files/s), target
        0.8x (missed by 2.2x)``; ``1.34 s against Streaming 1.1 s, target at most 0.5 s
        (missed by 2.7x)``.
        """
        if self.target_ratio is not None:
            got = f"{_ratio_words(self.ratio)}x" if math.isfinite(self.ratio) else "no ratio"
            body = (
                f"{got} against {self.baseline_name} ({number_text(self.chunkd)} vs "
                f"{number_text(self.baseline)} {self.unit}), target {self.target_ratio:g}x"
            )
            short = _shortfall(self.ratio, self.target_ratio, higher_is_better=True, unit="x")
        elif self.target_max is not None:
            against = (
                f" against {self.baseline_name} {number_text(self.baseline)} {self.unit}"
                if math.isfinite(self.baseline) and self.baseline_name
                else ""
            )
            body = (
                f"{number_text(self.chunkd)} {self.unit}{against}, target at most "
                f"{number_text(self.target_max)} {self.unit}"
            )
            short = _shortfall(self.chunkd, self.target_max, higher_is_better=False, unit=self.unit)
        else:
            return ""
        return f"{body} ({short})" if self.verdict == "missed" else f"{body} (met)"

    def verdict_cell(self) -> str:
        """What a table's verdict column says: 'met' (the target is in the column
        beside it), the sentence of a missed target, or ''."""
        return self.verdict_text() if self.verdict == "missed" else self.verdict

    def target_text(self) -> str:
        """The target as written in the table."""
        if self.target_ratio is not None:
            return f">= {self.target_ratio:g}x"
        if self.target_max is not None:
            return f"<= {number_text(self.target_max)} {self.unit}"
        return ""

    @property
    def rounds(self) -> int:
        """How many rounds the row's figures come from."""
        return self.samples.count if self.samples is not None else 1

    @property
    def on_ratio(self) -> bool:
        """Whether the row is judged on its ratio (it has a baseline), else on chunkd's
        own figure."""
        return math.isfinite(self.ratio)

    @property
    def figure(self) -> float:
        """What runs are compared on: the ratio, or chunkd's figure without a baseline."""
        return self.ratio if self.on_ratio else self.chunkd

    @property
    def spread(self) -> tuple[float, float] | None:
        """:attr:`figure`'s min and max over the rounds; ``None`` with one round."""
        if self.samples is None or self.samples.count < 2:
            return None
        if self.on_ratio:
            return self.samples.ratio_spread()
        return self.samples.chunkd_spread()

    @property
    def higher_is_better(self) -> bool:
        """Stated (``better``), else from the target (a lowest ratio: higher; a most
        value: lower), else from the unit: a rate (``.../s``) is better higher; a time,
        a size, a count of bytes or fds is better lower."""
        if self.better:
            return self.better == "higher"
        if self.target_ratio is not None:
            return True
        if self.target_max is not None:
            return False
        return self.unit.endswith("/s") and self.unit != "s/s"

    def spread_text(self) -> str:
        """``lo-hi`` of the figure, as the tables show it."""
        spread = self.spread
        if spread is None:
            return ""
        suffix = "x" if self.on_ratio else f" {self.unit}"
        return f"{number_text(spread[0])}-{number_text(spread[1])}{suffix}"

    def row(self) -> dict[str, Any]:
        """The row as JSON: its fields and what is derived from them."""
        return asdict(self) | {
            "ratio": self.ratio,
            "verdict": self.verdict,
            "verdict_text": self.verdict_text(),
            "rounds": self.rounds,
            "figure": self.figure,
            "on_ratio": self.on_ratio,
            "spread": list(self.spread) if self.spread is not None else None,
            "higher_is_better": self.higher_is_better,
        }


@dataclass(frozen=True)
class Series:
    """Data for one line (or bar) of a plot. ``kind`` says which plot:

    - ``"size"``: throughput against size: ``x`` sizes in bytes, ``y`` rates in ``unit``;
    - ``"latency"``: a latency distribution: ``x`` percentiles (0-100), ``y`` seconds;
    - ``"stack"``: one stacked bar: ``parts`` its segments' names, ``y`` their values.

    Series with the same ``figure`` (its title) are drawn together.
    """

    figure: str
    kind: str
    label: str
    y: tuple[float, ...]
    x: tuple[float, ...] = ()
    parts: tuple[str, ...] = ()
    unit: str = ""
    area: str = ""
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True)
class Duration:
    """How long one scenario (what ``--only`` names) took, and how many rows it gave
    (none: it was skipped, or found nothing to measure)."""

    scenario: str
    area: str
    seconds: float
    rows: int

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


class Run(Protocol):
    """What the views of a run (:mod:`bench.history`, :mod:`bench.page`) read of it: a
    :class:`bench.report.Report` is one. They name this, not the report, so that the
    report, which writes the run through them, is the only one that imports the other."""

    #: when the run started (seconds since the epoch)
    started: float
    #: a ``--quick`` run
    quick: bool
    results: list[Result]
    durations: list[Duration]

    def areas(self) -> list[str]:
        """The areas with rows or series, in the report's order."""
        ...


def percentile(ordered: Sequence[float], p: float) -> float:
    """The ``p`` percentile (0-100) of sorted values, linear between neighbours."""
    at = (len(ordered) - 1) * p / 100
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def duration_text(seconds: float) -> str:
    """A duration as people read it: ``0.84 s``, ``41 s``, ``12.5 min``, ``1.3 h``."""
    if seconds < 10:
        if seconds < 1:
            return f"{seconds:.2g} s"
        return f"{seconds:.0f} s" if float(seconds).is_integer() else f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min" if seconds < 600 else f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _shortfall(got: float, want: float, *, higher_is_better: bool, unit: str) -> str:
    """How far ``got`` is from the target ``want``: a factor when it is 1.5x or more
    off, else a percentage (``missed by 1%`` reads better than ``by 1.0x``)."""
    if not math.isfinite(got):
        return "missed: no figure to compare"
    if higher_is_better:
        if got <= 0:
            return "missed: measured 0"
        factor = want / got
    else:
        if want <= 0:
            return f"missed by {number_text(got - want)}{'' if unit == 'x' else ' '}{unit}"
        factor = got / want
    if factor >= 1.5:
        return f"missed by {factor:.1f}x"
    # how far short of the target, as a share of it
    short = (1 - got / want if higher_is_better else got / want - 1) * 100
    return f"missed by {short:.0f}%" if short >= 1 else f"missed by {short:.1g}%"


def _ratio_words(value: float) -> str:
    """A ratio in a sentence: two decimals, or two digits where it is small."""
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.2f}" if abs(value) >= 0.1 else f"{value:.2g}"


def shortfall_text(result: Result) -> str:
    """:func:`_shortfall` of a row, without its 'missed by ' (the console's column)."""
    if result.target_ratio is not None:
        text = _shortfall(result.ratio, result.target_ratio, higher_is_better=True, unit="x")
    elif result.target_max is not None:
        text = _shortfall(
            result.chunkd, result.target_max, higher_is_better=False, unit=result.unit
        )
    else:
        return ""
    return text.removeprefix("missed by ").removeprefix("missed: ")


def ratio_text(value: float) -> str:
    return f"{value:.2f}x" if math.isfinite(value) else ""


def cell_text(text: str) -> str:
    """Text in a Markdown table cell: its pipes escaped."""
    return text.replace("|", "\\|").replace("\n", " ")


def number_text(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 100_000:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"
