"""Results and the report every benchmark writes into."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["Phase", "Report", "Result", "interleave", "median_rate"]

#: one timed run of a contender: returns (amount of work, seconds)
Phase = Callable[[], Awaitable[tuple[float, float]]]


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

    @property
    def ratio(self) -> float:
        """chunkd / baseline."""
        return self.chunkd / self.baseline if self.baseline else float("nan")

    @property
    def verdict(self) -> str:
        """'met', 'MISSED' or '' when there is no target."""
        if self.target_ratio is not None:
            return "met" if self.ratio >= self.target_ratio else "MISSED"
        if self.target_max is not None:
            return "met" if self.chunkd <= self.target_max else "MISSED"
        return ""

    def target_text(self) -> str:
        """The target as written in the table."""
        if self.target_ratio is not None:
            return f">= {self.target_ratio:g}x"
        if self.target_max is not None:
            return f"<= {self.target_max:g} {self.unit}"
        return ""


@dataclass
class Report:
    """All rows of one run, with the machine they ran on."""

    results: list[Result] = field(default_factory=list)
    started: float = field(default_factory=time.time)

    def add(self, result: Result) -> None:
        """Record a row and print it at once."""
        self.results.append(result)
        print(
            f"  {result.scenario:<52} {_num(result.chunkd):>10} vs {_num(result.baseline):>10} "
            f"{result.unit:<7} {result.ratio:6.2f}x  {result.target_text():<10} {result.verdict}",
            flush=True,
        )

    def markdown(self) -> str:
        """The report as a Markdown table plus notes."""
        lines = [
            "# chunkd benchmark report",
            "",
            f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(self.started))} on "
            f"{platform.machine()}, {_cpus()} CPUs, Python {platform.python_version()}, "
            f"Linux {platform.release()}.",
            "Each figure is the median of several interleaved rounds; ratio = chunkd / baseline.",
            "",
            "| scenario | chunkd | baseline | unit | ratio | target | verdict | baseline is |",
            "| --- | ---: | ---: | --- | ---: | --- | --- | --- |",
        ]
        for r in self.results:
            lines.append(
                f"| {r.scenario} | {_num(r.chunkd)} | {_num(r.baseline)} | {r.unit} | "
                f"{r.ratio:.2f}x | {r.target_text()} | {r.verdict} | {r.baseline_name} |"
            )
        notes = [r for r in self.results if r.note]
        if notes:
            lines += ["", "## Notes", ""]
            lines += [f"- **{r.scenario}**: {r.note}" for r in notes]
        return "\n".join(lines) + "\n"

    def write(self, out: Path) -> None:
        """Write ``report.md`` and ``results.json`` under ``out``."""
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.md").write_text(self.markdown())
        rows = [asdict(r) | {"ratio": r.ratio, "verdict": r.verdict} for r in self.results]
        (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")


def median_rate(rounds: list[tuple[float, float]]) -> float:
    """Median of amount/seconds over rounds of (amount, seconds)."""
    return statistics.median(amount / seconds for amount, seconds in rounds)


async def interleave(rounds: int, phases: dict[str, Phase]) -> dict[str, float]:
    """Run every phase once untimed, then ``rounds`` times, rotating their order.

    The machines are noisy and this VM charges the first touch of fresh memory:
    warming up and rotating the order keeps either side from always paying for
    the other. Returns the median rate (amount per second) of each phase.
    """
    names = list(phases)
    for name in names:
        await phases[name]()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            samples[name].append(await phases[name]())
    return {name: median_rate(runs) for name, runs in samples.items()}


def _num(value: float) -> str:
    if value >= 100_000:
        return f"{value:,.0f}"
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))
