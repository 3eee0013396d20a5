"""The report every benchmark writes into, and how it is written out.

The result types (:class:`Result`, :class:`Rounds`, :class:`Series`, :class:`Duration`)
live in :mod:`bench.results` and are re-exported here. A benchmark adds rows
(:class:`Result`) and, for the plots, data series (:meth:`Report.sizes`,
:meth:`Report.latencies`, :meth:`Report.stack`). A row carries its rounds
(:class:`Rounds`: each side's figure per round), so the report can give its spread (the
min and max of the per-round ratio) and compare it with the previous run on this machine
(:mod:`bench.history`): a ratio outside the previous run's spread is marked, better or
worse, never a fixed percentage.

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
points ``OUT/latest`` at it, and keeps the run in ``OUT/history/``. The report is the only
module that imports the views of a run (:mod:`bench.history`, :mod:`bench.page`,
:mod:`bench.plots`); they read it as a :class:`bench.results.Run`, so no import runs in a
circle.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .results import (
    AREAS,
    MAX_SERIES,
    PERCENTILES,
    Duration,
    Result,
    Rounds,
    Series,
    cell_text,
    duration_text,
    number_text,
    percentile,
    ratio_text,
    shortfall_text,
)

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
            verdict = f"missed by {shortfall_text(result)}"
        print(
            f"  {result.scenario:<52} {number_text(result.chunkd):>10} vs "
            f"{number_text(result.baseline):>10} "
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
            taken = [(p, percentile(ordered, p)) for p in PERCENTILES]
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
                f"| {cell_text(d.scenario)} | {cell_text(d.area)} | "
                f"{duration_text(d.seconds)} | {d.rows} |"
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
                    f"| {cell_text(r.scenario)} | {number_text(r.chunkd)} | "
                    f"{number_text(r.baseline)} | {r.unit} | "
                    f"{ratio_text(r.ratio)} | {r.spread_text()} | {r.rounds} | {r.target_text()} | "
                    f"{cell_text(r.verdict_cell())} | {cell_text(changes.get(r.scenario, ''))} | "
                    f"{cell_text(r.baseline_name)} |"
                )
        notes = [r for r in self.results if r.note]
        if notes:
            lines += ["", "## Notes", ""]
            lines += [f"- **{cell_text(r.scenario)}**: {r.note}" for r in notes]
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


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))
