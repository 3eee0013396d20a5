"""Results and the report every benchmark writes into.

A benchmark adds rows (:class:`Result`) and, for the plots, data series
(:meth:`Report.sizes`, :meth:`Report.latencies`, :meth:`Report.stack`). A row carries
its rounds (:class:`Rounds`: each side's figure per round), so the report can give its
spread (the min and max of the per-round ratio) and compare it with the previous run
on this machine (:mod:`bench.history`): a ratio outside the previous run's spread is
marked, better or worse, never a fixed percentage.

How a benchmark states its rounds:

- through :func:`interleave`: it returns the medians as before, and their rounds;
  ``rates.pair("chunkd", "baseline", scale)`` is the row's :class:`Rounds`;
- any other way: ``Rounds.of(chunkd=[...], baseline=[...])``, one figure per round
  for each side (paired by round where both have as many; otherwise the spread is
  the widest the two sides allow).

Each scenario (what ``--only`` names) runs inside :meth:`Report.timed`, which prints
and records how long it took (:class:`Duration`); each row it adds says which one it is
``part_of``.

``Report.write`` writes the run into a folder of its own, ``OUT/runs/<UTC time>/``
(``report.md``, ``results.json``, ``durations.json``, ``report.html`` with its plots),
points ``OUT/latest`` at it, and keeps the run in ``OUT/history/``.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "AREAS",
    "Duration",
    "Phase",
    "Rates",
    "Report",
    "Result",
    "Rounds",
    "Series",
    "interleave",
    "median_rate",
]

#: one timed run of a contender: returns (amount of work, seconds)
Phase = Callable[[], Awaitable[tuple[float, float]]]

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
                f"{got} against {self.baseline_name} ({_num(self.chunkd)} vs "
                f"{_num(self.baseline)} {self.unit}), target {self.target_ratio:g}x"
            )
            short = _shortfall(self.ratio, self.target_ratio, higher_is_better=True, unit="x")
        elif self.target_max is not None:
            against = (
                f" against {self.baseline_name} {_num(self.baseline)} {self.unit}"
                if math.isfinite(self.baseline) and self.baseline_name
                else ""
            )
            body = (
                f"{_num(self.chunkd)} {self.unit}{against}, target at most "
                f"{_num(self.target_max)} {self.unit}"
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
            return f"<= {_num(self.target_max)} {self.unit}"
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
        return f"{_num(spread[0])}-{_num(spread[1])}{suffix}"

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


@dataclass
class Report:
    """All rows of one run, with the machine they ran on."""

    results: list[Result] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    series: list[Series] = field(default_factory=list)
    #: the area rows and series added now go in (``__main__`` sets it per scenario)
    area: str = "other"
    #: a ``--quick`` run: compared only with quick runs
    quick: bool = False
    #: ``--rounds``: every scenario that honours it runs this many rounds
    rounds_override: int | None = None
    #: each scenario's duration, in the order they ran
    durations: list[Duration] = field(default_factory=list)
    #: the run's own folder (``OUT/runs/<UTC time>``), once :meth:`folder` made it
    run_dir: Path | None = None
    #: the scenario running now (:meth:`timed`): the rows added go in its ``part_of``
    _part: str = ""

    @contextmanager
    def timed(self, scenario: str, area: str | None = None) -> Iterator[None]:
        """Run ``scenario`` (in ``area``, if given) and print and record how long it took.

        A scenario that raises is printed as failed after its time, and not recorded: the
        run stops there and writes no report.
        """
        if area is not None:
            self.area = area
        before = len(self.results)
        start = time.monotonic()
        self._part = scenario
        ok = False
        try:
            yield
            ok = True
        finally:
            self._part = ""
            seconds = time.monotonic() - start
            rows = len(self.results) - before
            if ok:
                self.durations.append(Duration(scenario, self.area, round(seconds, 2), rows))
                print(
                    f"  {scenario}: took {duration_text(seconds)} ({rows} row"
                    f"{'' if rows == 1 else 's'})",
                    flush=True,
                )
            else:
                print(f"  {scenario}: failed after {duration_text(seconds)}", flush=True)

    def folder(self, out: Path) -> Path:
        """The run's own folder under ``out/runs`` (made on the first call): where its
        report and everything its scenarios write go."""
        if self.run_dir is None:
            from . import history

            self.run_dir = history.new_run_folder(out, self.started)
        return self.run_dir

    def missed(self) -> list[str]:
        """Each target missed, in words: ``"<row>: <verdict_text>"``."""
        return [f"{r.scenario}: {r.verdict_text()}" for r in self.results if r.verdict == "missed"]

    def rounds_for(self, default: int) -> int:
        """The rounds a scenario runs: ``--rounds`` if given, else ``default``."""
        return self.rounds_override if self.rounds_override is not None else default

    def add(self, result: Result) -> None:
        """Record a row and print it at once."""
        if not result.area:
            result.area = self.area
        if not result.part_of:
            result.part_of = self._part
        self.results.append(result)
        spread = result.spread_text()
        verdict = result.verdict
        if verdict == "missed":
            verdict = f"missed by {_shortfall_of(result)}"
        print(
            f"  {result.scenario:<52} {_num(result.chunkd):>10} vs {_num(result.baseline):>10} "
            f"{result.unit:<7} {result.ratio:6.2f}x  {result.target_text():<10} {verdict}"
            + (f"  ({spread}, {result.rounds} rounds)" if spread else ""),
            flush=True,
        )

    def _series(self, series: Series) -> None:
        if len(self.series) >= MAX_SERIES:
            raise ValueError(f"a run keeps at most {MAX_SERIES} plot series")
        self.series.append(series)

    def sizes(
        self,
        figure: str,
        label: str,
        points: Mapping[int, float] | Sequence[tuple[int, float]],
        unit: str,
        *,
        note: str = "",
    ) -> None:
        """A line of ``figure`` (throughput against size): ``points`` size in bytes to a
        rate in ``unit``."""
        pairs = sorted(points.items() if isinstance(points, Mapping) else points)
        self._series(
            Series(
                figure,
                "size",
                label,
                y=tuple(float(v) for _, v in pairs),
                x=tuple(float(s) for s, _ in pairs),
                unit=unit,
                area=self.area,
                note=note,
            )
        )

    def latencies(
        self,
        figure: str,
        label: str,
        seconds: Sequence[float] | Mapping[float, float],
        *,
        note: str = "",
    ) -> None:
        """A distribution of ``figure``: latency samples in seconds (kept as
        :data:`PERCENTILES`, whatever their number), or percentiles already taken
        (``{50: p50, 99: p99, 100: max}``)."""
        if isinstance(seconds, Mapping):
            taken = sorted((float(p), float(v)) for p, v in seconds.items())
        else:
            ordered = sorted(float(v) for v in seconds)
            if not ordered:
                return
            taken = [(p, _percentile(ordered, p)) for p in PERCENTILES]
        self._series(
            Series(
                figure,
                "latency",
                label,
                y=tuple(v for _, v in taken),
                x=tuple(p for p, _ in taken),
                unit="s",
                area=self.area,
                note=note,
            )
        )

    def stack(
        self, figure: str, label: str, parts: Mapping[str, float], unit: str, *, note: str = ""
    ) -> None:
        """One stacked bar of ``figure``: ``parts`` segment name to value in ``unit``."""
        self._series(
            Series(
                figure,
                "stack",
                label,
                y=tuple(float(v) for v in parts.values()),
                parts=tuple(parts),
                unit=unit,
                area=self.area,
                note=note,
            )
        )

    def areas(self) -> list[str]:
        """The areas with rows or series, in the report's order."""
        used = {r.area for r in self.results} | {s.area for s in self.series}
        known = [a for a in AREAS if a in used]
        others = [a for a in dict.fromkeys([*(r.area for r in self.results)]) if a not in AREAS]
        others += [a for a in dict.fromkeys(s.area for s in self.series) if a not in AREAS]
        return known + list(dict.fromkeys(others))

    def markdown(self, changes: Mapping[str, str] | None = None) -> str:
        """The report as Markdown: one table per area, then notes. ``changes``: per
        scenario, how it compares with the previous run (``bench.history``)."""
        changes = changes or {}
        lines = [
            "# chunkd benchmark report",
            "",
            f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(self.started))} on "
            f"{platform.machine()}, {_cpus()} CPUs, Python {platform.python_version()}, "
            f"Linux {platform.release()}{', --quick' if self.quick else ''}.",
            "Each figure is the median of its rounds; ratio = chunkd / baseline; spread = "
            "the min and max of the per-round ratio (of chunkd's figure where there is no "
            "baseline). A figure outside the previous run's spread is marked.",
        ]
        if self.durations:
            total = sum(d.seconds for d in self.durations)
            lines += [
                "",
                "## Durations",
                "",
                f"Each scenario's wall time; {duration_text(total)} in all.",
                "",
                "| scenario | area | took | rows |",
                "| --- | --- | ---: | ---: |",
            ]
            lines += [
                f"| {_cell(d.scenario)} | {_cell(d.area)} | {duration_text(d.seconds)} | {d.rows} |"
                for d in self.durations
            ]
        for area in self.areas():
            rows = [r for r in self.results if r.area == area]
            if not rows:
                continue
            lines += [
                "",
                f"## {area}",
                "",
                "| scenario | chunkd | baseline | unit | ratio | spread | rounds | target | "
                "verdict | vs previous run | baseline is |",
                "| --- | ---: | ---: | --- | ---: | --- | ---: | --- | --- | --- | --- |",
            ]
            for r in rows:
                lines.append(
                    f"| {_cell(r.scenario)} | {_num(r.chunkd)} | {_num(r.baseline)} | {r.unit} | "
                    f"{_ratio(r.ratio)} | {r.spread_text()} | {r.rounds} | {r.target_text()} | "
                    f"{_cell(r.verdict_cell())} | {_cell(changes.get(r.scenario, ''))} | "
                    f"{_cell(r.baseline_name)} |"
                )
        notes = [r for r in self.results if r.note]
        if notes:
            lines += ["", "## Notes", ""]
            lines += [f"- **{_cell(r.scenario)}**: {r.note}" for r in notes]
        return "\n".join(lines) + "\n"

    def write(self, out: Path, *, keep: int = 50) -> Path:
        """Write the run into its own folder, ``out/runs/<UTC time>/`` (``report.md``,
        ``results.json``, ``durations.json``, ``series.json``, ``report.html`` and its
        plots), point ``out/latest`` at it, and keep the run in ``out/history``. Only the
        last ``keep`` runs are kept, folders and history alike. Returns the folder."""
        from . import history, page, plots

        folder = self.folder(out)
        meta = history.run_meta(self) | {"folder": folder.relative_to(out).as_posix()}
        previous = history.load(out / "history", meta)
        changes = history.compare(self.results, previous)
        texts = {scenario: change.text() for scenario, change in changes.items()}
        (folder / "report.md").write_text(self.markdown(texts))
        rows = [r.row() for r in self.results]
        (folder / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
        durations = [d.to_json() for d in self.durations]
        (folder / "durations.json").write_text(json.dumps(durations, indent=2) + "\n")
        doc = [s.to_json() for s in self.series]
        (folder / "series.json").write_text(json.dumps(doc, indent=1) + "\n")
        drawn = plots.draw(self.series, folder)
        (folder / "report.html").write_text(page.render(self, meta, changes, drawn))
        history.save(out / "history", meta, rows, keep=keep)
        history.point_latest(out, folder)
        history.prune_runs(out, keep)
        return folder


class Rates(dict[str, float]):
    """What :func:`interleave` returns: each phase's median rate, and every round's."""

    def __init__(self, medians: Mapping[str, float], per_round: Mapping[str, list[float]]):
        super().__init__(medians)
        #: each phase's rate (amount per second) in every timed round, in order
        self.per_round = {name: list(rates) for name, rates in per_round.items()}

    def pair(self, chunkd: str, baseline: str | None = None, scale: float = 1.0) -> Rounds:
        """The per-round rates of phase ``chunkd`` against phase ``baseline`` (paired by
        round), times ``scale``: a row's :class:`Rounds`."""
        other = self.per_round[baseline] if baseline is not None else []
        return Rounds.of(self.per_round[chunkd], other).scaled(scale)


def median_rate(rounds: list[tuple[float, float]]) -> float:
    """Median of amount/seconds over rounds of (amount, seconds)."""
    return statistics.median(amount / seconds for amount, seconds in rounds)


def rates_of(rounds: list[tuple[float, float]]) -> list[float]:
    """amount/seconds of each round of (amount, seconds)."""
    return [amount / seconds for amount, seconds in rounds]


async def interleave(rounds: int, phases: dict[str, Phase]) -> Rates:
    """Run every phase once untimed, then ``rounds`` times, rotating their order.

    The machines are noisy and this VM charges the first touch of fresh memory:
    warming up and rotating the order keeps either side from always paying for
    the other. Returns the median rate (amount per second) of each phase, a
    :class:`Rates` that also keeps every round's (``rates.pair(a, b)``).
    """
    names = list(phases)
    for name in names:
        await phases[name]()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            samples[name].append(await phases[name]())
    return Rates(
        {name: median_rate(runs) for name, runs in samples.items()},
        {name: rates_of(runs) for name, runs in samples.items()},
    )


def _percentile(ordered: Sequence[float], p: float) -> float:
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
            return f"missed by {_num(got - want)}{'' if unit == 'x' else ' '}{unit}"
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


def _shortfall_of(result: Result) -> str:
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


def _ratio(value: float) -> str:
    return f"{value:.2f}x" if math.isfinite(value) else ""


def _cell(text: str) -> str:
    """Text in a Markdown table cell: its pipes escaped."""
    return text.replace("|", "\\|").replace("\n", " ")


def _num(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 100_000:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))
