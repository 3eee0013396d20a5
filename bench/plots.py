"""The report's plots, drawn with matplotlib into SVG files next to ``report.html``.

No display and no pyplot: each plot is a :class:`matplotlib.figure.Figure` saved by its
SVG backend, so nothing here opens a window or keeps global figures. Text stays text
in the SVG (small files, the reader's fonts); ids are salted with the plot's name and
the date left out, so the same data draws the same file.

The kinds of :class:`bench.report.Series`, one plot per ``figure`` title:

- ``size``: throughput against size, one line per contender, log2 size axis;
- ``latency``: one row per contender on a log time axis: the whole range (min to max),
  the middle half (p25-p75), the median and p99; series with only some percentiles
  (the soak's p50, p99, max) show those;
- ``stack``: horizontal stacked bars, one per series, a colour per segment name (the
  same name keeps its colour across plots: a node's sources, a first batch's phases).
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from .results import Series

__all__ = ["Plot", "draw", "slug"]

#: the project's page colours (gateway/dashboard/static/chunkd.css)
INK, MUTED, LINE = "#1d2330", "#687083", "#dde1e8"
PALETTE = ("#2f6fdb", "#e07b24", "#1f9e8f", "#8a4fd8", "#c53030", "#1f8a4c", "#b7791f")
#: segment names that mean the same thing wherever they appear
NAMED = {
    "local": "#1f8a4c",
    "cache": "#1f8a4c",
    "peer": "#1f9e8f",
    "backend": "#e07b24",
    "imports": "#8f98a8",
    "metadata": "#2f6fdb",
    "worker start": "#8a4fd8",
    "first batch": "#e07b24",
}
WIDTH = 7.5  # inches: the report's column at 100 dpi


@dataclass(frozen=True)
class Plot:
    """A plot written next to the report."""

    figure: str
    area: str
    kind: str
    path: Path
    #: what the series said about themselves, for the caption
    notes: tuple[str, ...]


def slug(title: str) -> str:
    """A file name for ``title``: lower case, runs of other characters as one dash."""
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:80] or "plot"


def draw(series: Sequence[Series], out: Path) -> list[Plot]:
    """Draw every figure of ``series`` as ``out/plot-<slug>.svg``; the plots, in the
    order their first series came. Without matplotlib: none, and a line saying so."""
    try:
        import matplotlib as mpl
        from matplotlib.figure import Figure
    except ImportError:
        print("plots: matplotlib is not installed (pip install '.[bench]'): no plots")
        return []
    groups: dict[str, list[Series]] = {}
    for s in series:
        groups.setdefault(s.figure, []).append(s)
    plots = []
    drawers = {"size": _sizes, "latency": _latencies, "stack": _stacks}
    for title, members in groups.items():
        kind = members[0].kind
        if kind not in drawers or any(s.kind != kind for s in members):
            raise ValueError(f"plot {title!r}: series of kinds {[s.kind for s in members]}")
        name = slug(title)
        style: dict[str, Any] = {
            "svg.fonttype": "none",
            "svg.hashsalt": name,
            "font.size": 9,
            "axes.edgecolor": MUTED,
            "axes.labelcolor": INK,
            "xtick.color": MUTED,
            "ytick.color": MUTED,
            "axes.titlesize": 10,
        }
        with mpl.rc_context(style):  # type: ignore[arg-type]  # keys typed as literals
            figure = Figure(figsize=(WIDTH, 3.0), layout="constrained")
            drawers[kind](figure, title, members)
            path = out / f"plot-{name}.svg"
            figure.savefig(path, format="svg", metadata={"Date": None})
        notes = tuple(dict.fromkeys(f"{s.label}: {s.note}" for s in members if s.note))
        plots.append(Plot(title, members[0].area, kind, path, notes))
    return plots


def _axes(figure: Figure, title: str) -> Axes:
    ax = figure.add_subplot()
    # a long title on two lines rather than cut at the figure's edge
    ax.set_title("\n".join(textwrap.wrap(title, 72)), loc="left", color=INK)
    ax.grid(True, color=LINE, linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return ax


def _size_text(value: float, _pos: object = None) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:g} {unit}"
    return f"{value:g} B"


def _sizes(figure: Figure, title: str, members: list[Series]) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter

    ax = _axes(figure, title)
    ticks: set[float] = set()
    values: list[float] = []
    for i, s in enumerate(members):
        ax.plot(s.x, s.y, marker="o", markersize=4, color=PALETTE[i % len(PALETTE)], label=s.label)
        ticks.update(s.x)
        values += [v for v in s.y if v > 0]
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sorted(ticks)))
    ax.xaxis.set_major_formatter(FuncFormatter(_size_text))
    ax.xaxis.set_minor_locator(FixedLocator([]))
    if values and max(values) / min(values) > 30:
        ax.set_yscale("log")  # contenders orders of magnitude apart: all stay readable
        _plain_log_labels(ax.yaxis)
    ax.set_xlabel("size")
    ax.set_ylabel(members[0].unit)
    ax.legend(frameon=False, fontsize=8)


def _latencies(figure: Figure, title: str, members: list[Series]) -> None:
    from matplotlib.lines import Line2D

    figure.set_size_inches(WIDTH, 1.2 + 0.38 * len(members))
    ax = _axes(figure, title)
    ms = 1e3
    for row, s in enumerate(reversed(members)):
        q = dict(zip(s.x, s.y, strict=True))
        color = PALETTE[(len(members) - 1 - row) % len(PALETTE)]
        ends = [q[p] for p in (0.0, 100.0) if p in q] or [min(s.y), max(s.y)]
        ax.hlines(row, min(ends) * ms, max(ends) * ms, color=color, linewidth=1)
        if 25.0 in q and 75.0 in q:
            ax.hlines(row, q[25.0] * ms, q[75.0] * ms, color=color, linewidth=6, alpha=0.6)
        if 50.0 in q:
            ax.plot([q[50.0] * ms], [row], marker="|", markersize=14, color=INK, mew=2)
        if 99.0 in q:
            ax.plot([q[99.0] * ms], [row], marker="o", markersize=5, color="#c53030")
    ax.set_yticks(range(len(members)), [s.label for s in reversed(members)])
    ax.set_ylim(-0.6, len(members) - 0.4)
    positive = [v for s in members for v in s.y if v > 0]
    if positive and max(positive) / min(positive) > 10:
        ax.set_xscale("log")
        _plain_log_labels(ax.xaxis)
    ax.set_xlabel("ms")
    ax.grid(False, axis="y")
    key = [
        Line2D([], [], color=MUTED, linewidth=1, label="min-max"),
        Line2D([], [], color=MUTED, linewidth=6, alpha=0.6, label="p25-p75"),
        Line2D([], [], color=INK, marker="|", markersize=10, mew=2, linestyle="", label="p50"),
        Line2D([], [], color="#c53030", marker="o", markersize=5, linestyle="", label="p99"),
    ]
    ax.legend(handles=key, frameon=False, fontsize=8, loc="center left", bbox_to_anchor=(1, 0.5))


def _plain_log_labels(axis: Any) -> None:
    """Decades as plain numbers (0.001, 10), not powers, and no labels between them."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _stacks(figure: Figure, title: str, members: list[Series]) -> None:
    figure.set_size_inches(WIDTH, 1.3 + 0.32 * len(members))
    ax = _axes(figure, title)
    colors: dict[str, str] = {}
    shown: set[str] = set()
    for row, s in enumerate(reversed(members)):
        left = 0.0
        for part, value in zip(s.parts, s.y, strict=True):
            color = colors.setdefault(part, NAMED.get(part, PALETTE[len(colors) % len(PALETTE)]))
            if value > 0 and math.isfinite(value):
                label = part if part not in shown else None  # once each in the legend
                shown.add(part)
                ax.barh(row, value, left=left, color=color, label=label, height=0.6)
                left += value
    ax.set_yticks(range(len(members)), [s.label for s in reversed(members)])
    ax.set_xlabel(members[0].unit)
    ax.grid(False, axis="y")
    handles, labels = ax.get_legend_handles_labels()
    order: dict[str, Any] = dict(zip(labels, handles, strict=True))
    ax.legend(
        order.values(),
        order.keys(),
        frameon=False,
        fontsize=8,
        loc="center left",
        bbox_to_anchor=(1, 0.5),
    )
