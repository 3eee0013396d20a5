"""``report.html``: the run as one static page, with its plots inside it.

One file that opens anywhere: no script, no network, no file beside it needed (each
plot is embedded as a ``data:`` image; the SVG files beside it are the same plots).
Every text that comes from a run (scenario names, notes, the machine) is escaped, and a
Content-Security-Policy allows nothing but the page's own style (by its hash) and
``data:`` images: markup that slipped through could neither load nor run anything.
"""

from __future__ import annotations

import base64
import hashlib
import html
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .plots import slug
from .results import Result, Run, duration_text, number_text

if TYPE_CHECKING:
    from .history import Change
    from .plots import Plot

__all__ = ["render"]

#: the look of the project's pages (gateway/dashboard/static/chunkd.css), condensed
STYLE = """
:root { --bg: #f6f7f9; --panel: #fff; --ink: #1d2330; --muted: #687083; --line: #dde1e8;
  --good: #1f8a4c; --bad: #c53030; --accent: #2f6fdb;
  --mono: ui-monospace, "SFMono-Regular", "DejaVu Sans Mono", Menlo, Consolas, monospace;
  --sans: system-ui, -apple-system, "Segoe UI", "DejaVu Sans", Roboto, sans-serif; }
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--ink); font: 14px/1.4 var(--sans); }
header { padding: 0.8rem 1.2rem; background: var(--panel); border-bottom: 1px solid var(--line); }
h1 { margin: 0; font-size: 1.3rem; }
h2 { margin: 1.6rem 0 0.5rem; font-size: 1.1rem; }
main { padding: 0 1.2rem 2rem; max-width: 1400px; }
a { color: var(--accent); }
.meta, .muted { color: var(--muted); }
.meta { font-family: var(--mono); font-size: 0.85rem; margin: 0.3rem 0 0; }
table { border-collapse: collapse; background: var(--panel); border: 1px solid var(--line);
  font-size: 0.85rem; width: 100%; }
th, td { padding: 0.3rem 0.5rem; border-bottom: 1px solid var(--line); text-align: left;
  vertical-align: top; }
th { color: var(--muted); font-weight: 600; background: var(--bg); }
td.num { text-align: right; font-family: var(--mono); white-space: nowrap; }
.met, .better { color: var(--good); font-weight: 600; }
.missed, .worse { color: var(--bad); font-weight: 600; }
tr.worse td:first-child { box-shadow: inset 3px 0 var(--bad); }
tr.better td:first-child { box-shadow: inset 3px 0 var(--good); }
ul.notes { font-size: 0.8rem; color: var(--muted); padding-left: 1.2rem; }
ul.notes b { color: var(--ink); font-weight: 600; }
figure { margin: 1rem 0; padding: 0.6rem; background: var(--panel);
  border: 1px solid var(--line); display: inline-block; max-width: 100%; }
figure img { max-width: 100%; height: auto; display: block; }
figcaption { font-size: 0.8rem; color: var(--muted); margin-top: 0.3rem; }
.summary li { margin: 0.15rem 0; }
"""


def render(
    report: Run,
    meta: Mapping[str, Any],
    changes: Mapping[str, Change],
    plots: list[Plot],
) -> str:
    """The page of one run."""
    e = html.escape
    style_hash = base64.b64encode(hashlib.sha256(STYLE.encode()).digest()).decode()
    csp = f"default-src 'none'; style-src 'sha256-{style_hash}'; img-src data:"
    machine = meta.get("machine", {})
    commit = str(meta.get("commit", ""))[:12] + (" (changed files)" if meta.get("dirty") else "")
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{e(csp)}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<title>chunkd benchmark report</title>",
        f"<style>{STYLE}</style></head><body>",
        "<header><h1>chunkd benchmark report</h1>",
        f'<p class="meta">{e(str(meta.get("date", "")))} &middot; '
        f"{e(str(machine.get('arch', '')))}, {e(str(machine.get('cpu', '')))}, "
        f"{e(str(machine.get('cpus', '')))} CPUs, {e(str(machine.get('memory_gib', '')))} GiB, "
        f"Python {e(str(machine.get('python', '')))}, Linux {e(str(machine.get('kernel', '')))}"
        f" &middot; commit {e(commit or 'unknown')} &middot; {e(str(meta.get('seconds', '')))} s"
        f"{' &middot; --quick' if report.quick else ''}</p></header><main>",
        _summary(report, changes),
        _durations(report),
    ]
    for area in report.areas():
        parts.append(f'<h2 id="{e(_anchor(area))}">{e(area)}</h2>')
        rows = [r for r in report.results if r.area == area]
        if rows:
            parts.append(_table(rows, changes))
            notes = [r for r in rows if r.note]
            if notes:
                parts.append('<ul class="notes">')
                parts += [f"<li><b>{e(r.scenario)}</b>: {e(r.note)}</li>" for r in notes]
                parts.append("</ul>")
        for plot in (p for p in plots if p.area == area):
            parts.append(_figure(plot))
    parts.append("</main></body></html>\n")
    return "\n".join(parts)


def _summary(report: Run, changes: Mapping[str, Change]) -> str:
    e = html.escape
    met = sum(r.verdict == "met" for r in report.results)
    missed = [r for r in report.results if r.verdict == "missed"]
    better = [s for s, c in changes.items() if c.verdict == "better"]
    worse = [s for s, c in changes.items() if c.verdict == "worse"]
    compared = sum(c.verdict != "no spread" for c in changes.values())
    lines = [
        "<h2>Summary</h2>",
        '<p class="muted">Each figure is the median of its rounds; ratio = chunkd / baseline; '
        "spread = the min and max of the per-round ratio (of chunkd's own figure where "
        "there is no baseline). A row is marked when its figure falls outside the spread of "
        "the same row in the previous run on this machine (history/), better or worse; a "
        "previous row of one round has no spread and marks nothing.</p>",
        '<ul class="summary">',
        f"<li>{len(report.results)} rows; targets: {met} met, {len(missed)} missed</li>",
    ]
    if missed:
        lines.append("<li>missed:<ul>")
        lines += [
            f'<li><span class="missed">{e(r.scenario)}</span>: {e(r.verdict_text())}</li>'
            for r in missed
        ]
        lines.append("</ul></li>")
    lines.append(
        f"<li>against the previous run: {compared} rows compared, {len(better)} better, "
        f"{len(worse)} worse, the rest within its spread</li>"
        if changes
        else "<li>no previous run of these scenarios on this machine in history/</li>"
    )
    for verdict, scenarios in (("worse", worse), ("better", better)):
        if scenarios:
            shown = ", ".join(f'<span class="{verdict}">{e(n)}</span>' for n in scenarios)
            lines.append(f"<li>{verdict} than the previous spread: {shown}</li>")
    lines.append("</ul>")
    return "\n".join(lines)


def _durations(report: Run) -> str:
    """Each scenario's wall time, in the order they ran."""
    if not report.durations:
        return ""
    e = html.escape
    total = sum(d.seconds for d in report.durations)
    body = "".join(
        f'<tr><td>{e(d.scenario)}</td><td>{e(d.area)}</td><td class="num">'
        f'{e(duration_text(d.seconds))}</td><td class="num">{d.rows}</td></tr>'
        for d in report.durations
    )
    return (
        '<h2 id="durations">Durations</h2>'
        f'<p class="muted">Each scenario\'s wall time; {e(duration_text(total))} in all.</p>'
        "<table><thead><tr><th>scenario</th><th>area</th><th>took</th><th>rows</th></tr>"
        f"</thead><tbody>{body}</tbody></table>"
    )


def _table(rows: list[Result], changes: Mapping[str, Change]) -> str:
    e = html.escape
    head = (
        "<table><thead><tr><th>scenario</th><th>chunkd</th><th>baseline</th><th>unit</th>"
        "<th>ratio</th><th>spread</th><th>rounds</th><th>target</th><th>verdict</th>"
        "<th>vs previous run</th><th>baseline is</th></tr></thead><tbody>"
    )
    body = []
    for r in rows:
        change = changes.get(r.scenario)
        mark = change.verdict if change is not None and change.marked else ""
        ratio = f"{r.ratio:.2f}x" if math.isfinite(r.ratio) else ""
        verdict_class = r.verdict  # 'met', 'missed' or ''

        change_cell = (
            f'<span class="{mark}">{e(change.text())}</span>'
            if change is not None and mark
            else e(change.text())
            if change is not None
            else ""
        )
        body.append(
            f'<tr class="{mark}"><td>{e(r.scenario)}</td>'
            f'<td class="num">{e(number_text(r.chunkd))}</td>'
            f'<td class="num">{e(number_text(r.baseline))}</td>'
            f'<td>{e(r.unit)}</td><td class="num">{e(ratio)}</td>'
            f'<td class="num">{e(r.spread_text())}</td><td class="num">{r.rounds}</td>'
            f"<td>{e(r.target_text())}</td>"
            f'<td class="{verdict_class}">{e(r.verdict_cell())}</td>'
            f"<td>{change_cell}</td><td>{e(r.baseline_name)}</td></tr>"
        )
    return head + "".join(body) + "</tbody></table>"


def _figure(plot: Plot) -> str:
    e = html.escape
    data = base64.b64encode(plot.path.read_bytes()).decode()
    caption = e(plot.figure) + f' &middot; <span class="muted">{e(plot.path.name)}</span>'
    if plot.notes:
        caption += "<br>" + "; ".join(e(n) for n in plot.notes)
    return (
        f'<figure><img src="data:image/svg+xml;base64,{data}" alt="{e(plot.figure)}">'
        f"<figcaption>{caption}</figcaption></figure>"
    )


def _anchor(area: str) -> str:
    return slug(area)
