"""The text of each panel of ``chunkd top``: a view formats what the dashboard's sample
says (throughput, trends, tiers, backends, peers, checkpoints, hot chunks, errors, the
header), fitted to the columns and rows it is given.

``chunkd top --once`` (:mod:`chunkd.gateway.cli.top`) and the live view
(:mod:`chunkd.gateway.cli.topview`) both draw these; what they draw comes from the feed
(:mod:`chunkd.gateway.cli.topfeed`), which knows nothing of how it is shown.

It is one job at some 600 lines: every function here turns samples into one panel's
text, on the shared pieces at the top (figures for a person, sparklines, the fitted
rows, the dashboard's colours); a panel is ~40 lines, and splitting panels apart
would only spread those pieces over modules.
"""

from __future__ import annotations

import functools
import math
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib.resources import files
from typing import TYPE_CHECKING, Any, Final

from chunkd.gateway.cli.options import human_size

if TYPE_CHECKING:
    from rich.text import Text

    from chunkd.gateway.cli.topfeed import Sample

__all__ = [
    "ROW_SPARK_MIN",
    "WINDOW",
    "backends_text",
    "byte_rate",
    "checkpoints_text",
    "clock",
    "colours",
    "cost_text",
    "durability_bar",
    "errors_text",
    "hot_text",
    "jobs_text",
    "millis",
    "money",
    "node_text",
    "peers_text",
    "per_second",
    "percent",
    "seconds",
    "spark",
    "spark_rows",
    "throughput_text",
    "tiers_text",
    "trends_text",
]

_SPARK: Final = "▁▂▃▄▅▆▇█"
#: lists are ordered by what moved over the last this many samples (the daemon's latency
#: window): busiest first, without reshuffling every second
WINDOW: Final = 10
#: a per-row sparkline (a backend's, a peer's) is drawn when at least this many columns
#: are left beside the row's figures
ROW_SPARK_MIN: Final = 12
#: the dashboard's series colours in its dark scheme, used where chunkd.css cannot be read
_COLOURS: Final = {
    "ram": "#6ea1ff",
    "disk": "#b48cff",
    "peer": "#4fd1c0",
    "backend": "#f6a055",
    "p50": "#1f8a4c",
    "p90": "#b7791f",
    "p99": "#c53030",
}
_CSS_COLOUR: Final = re.compile(r"--(ram|disk|peer|backend|p50|p90|p99)\s*:\s*(#[0-9a-fA-F]{6})\b")


# -- formatting: a view formats what the sample says ------------------------------------


def byte_rate(value: float | None) -> str:
    """``value`` bytes per second for a person, ``-`` for none."""
    return "-" if value is None else f"{human_size(value)}/s"


def per_second(value: float | None) -> str:
    """A count per second, ``-`` for none, as the page writes it: ``0/s`` only for zero,
    no decimals from 100/s, one from 1/s, two significant digits below (``0.05/s``), so
    a rate never reads as zero when it is not."""
    if value is None:
        return "-"
    if value == 0:
        return "0/s"
    if value >= 100:
        return f"{value:.0f}/s"
    return f"{value:.1f}/s" if value >= 1 else f"{value:.2g}/s"


def percent(value: float | None) -> str:
    """A ratio (0 to 1) as a percentage, ``-`` for none."""
    return "-" if value is None else f"{value * 100:.1f}%"


def millis(value: float | None) -> str:
    """Milliseconds, ``-`` for none."""
    if value is None:
        return "-"
    return f"{value / 1000:.2f}s" if value >= 1000 else f"{value:.1f}ms"


def seconds(value: float | None) -> str:
    """Seconds of a phase as the page writes them: ``350ms`` under a second, ``1.25s``
    from one; ``-`` for none."""
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.2f}s"


def money(value: float | None, currency: str | None = None) -> str:
    """An amount in the price table's currency as the page writes it: two decimals, more
    where it needs them never to read as zero when it is not (``0.00040 USD``)."""
    if value is None:
        return "-"
    figure = "0.00"
    if value != 0:
        decimals = min(10, max(2, 1 - math.floor(math.log10(abs(value)))))
        figure = f"{value:.{decimals}f}"
    return f"{figure} {currency}" if currency else figure


def clock(unix: float) -> str:
    """``HH:MM:SS`` of a wall time, in local time."""
    return time.strftime("%H:%M:%S", time.localtime(unix))


@functools.cache
def colours() -> dict[str, str]:
    """Each series' colour as the dashboard draws it, ``#rrggbb`` by name: ``ram``,
    ``disk``, ``peer``, ``backend`` (where bytes came from) and ``p50``, ``p90``, ``p99``.

    Read from the page's own stylesheet (``chunkd.css``), its dark scheme over its light
    one (a terminal's background is dark, as textual's screen is): a source has one
    colour on the page and in the terminal, and a new palette reaches both.
    """
    found = dict(_COLOURS)
    try:
        css = files("chunkd.gateway") / "dashboard" / "static" / "chunkd.css"
        text = css.read_text(encoding="utf-8")
    except (OSError, ValueError):
        return found
    light, _, dark = text.partition("prefers-color-scheme: dark")
    for scheme in (light, dark):
        found.update(_CSS_COLOUR.findall(scheme))
    return found


def spark(values: Iterable[float | None], width: int, top: float | None = None) -> str:
    """The last ``width`` values as a sparkline scaled to ``top`` (default: their own
    maximum); a missing value is a blank."""
    tail = list(values)[-width:] if width > 0 else []
    if top is None:
        top = max((v for v in tail if v is not None), default=0.0)
    cells = []
    for v in tail:
        if v is None:
            cells.append(" ")
        elif top <= 0:
            cells.append(_SPARK[0])
        else:
            level = int(min(v, top) / top * (len(_SPARK) - 1) + 0.5)
            cells.append(_SPARK[max(level, 0)])
    return "".join(cells).rjust(max(width, 0))


def durability_bar(job: dict[str, Any], width: int = 12) -> str:
    """staged → local → replicated → remote as a bar of four parts; the last fills as
    bytes upload."""
    levels = ("staged", "local", "replicated", "remote")
    reached = levels.index(job["durability"]) if job.get("durability") in levels else -1
    part = max(width // len(levels), 1)
    remote = len(levels) - 1
    cells = []
    for i in range(len(levels)):
        if i <= reached:
            cells.append("█" * part)
        elif i == remote and 1 <= reached < remote and job.get("unique_bytes"):
            done = int(part * min(1.0, job["remote_bytes"] / job["unique_bytes"]))
            cells.append("▓" * done + "░" * (part - done))
        else:
            cells.append("░" * part)
    return "".join(cells)


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def _fit_left(text: str, width: int) -> str:
    """``text`` cut from the left: the end of a key tells objects apart."""
    return text if len(text) <= width else "…" + text[len(text) - width + 1 :]


# -- the sections: the same text for the live panels and --once -----------------------


@dataclass(frozen=True)
class _Row:
    """One line of a section: its text, and a sparkline drawn after it where it fits.

    ``idle``: nothing moved for it over the window, so a line that says how many rows
    are hidden can say they are idle.
    """

    text: str
    style: str = ""
    spark: str = ""
    spark_style: str = ""
    idle: bool = False


def _row_spark(head: str, values: Iterable[float | None], width: int, colour: str) -> _Row:
    """``head`` with a sparkline of ``values`` in the columns it leaves, when enough are."""
    room = width - len(head) - 1
    values = list(values)
    if room < ROW_SPARK_MIN or not any(values):  # nothing ever moved: no flat line
        return _Row(head)
    return _Row(head + " ", spark=spark(values, room), spark_style=colour)


def spark_rows(values: Iterable[float | None], width: int, rows: int) -> list[str]:
    """The last ``width`` values as a sparkline ``rows`` lines tall (top line first),
    scaled to their own maximum; one line is :func:`spark`."""
    tail = list(values)[-width:] if width > 0 else []
    top = max((v for v in tail if v is not None), default=0.0)
    steps = len(_SPARK) * rows
    levels = [
        None if v is None else 1 + (int(v / top * (steps - 1) + 0.5) if top > 0 else 0)
        for v in tail
    ]
    lines = []
    for row in reversed(range(rows)):
        cells = []
        for level in levels:
            part = 0 if level is None else min(max(level - row * len(_SPARK), 0), len(_SPARK))
            cells.append(_SPARK[part - 1] if part else " ")
        lines.append("".join(cells).rjust(max(width, 0)))
    return lines


def throughput_text(
    history: Iterable[Sample], width: int, rows: int = 4, *, sparklines: bool = True
) -> Text:
    """Bytes per second by source, each with a sparkline of its history in the
    dashboard's colour of that source; ``rows`` of 8 or more give each source's
    sparkline ``rows // 4`` lines."""
    from rich.text import Text

    samples = list(history)
    palette = colours()
    tall = max(rows // 4, 1)
    out = Text(no_wrap=True, overflow="crop")
    latest = samples[-1]["throughput"] if samples else {}
    for key, label in (("ram", "RAM"), ("disk", "disk"), ("peer", "peer"), ("backend", "backend")):
        head = f"{label:<8}{byte_rate(latest.get(key)):>13}"
        if not sparklines:
            out.append(head + "\n")
            continue
        head += " "
        values = [s["throughput"][key] for s in samples]
        # the figure on the chart's last line, beside its baseline
        for i, line in enumerate(spark_rows(values, width - len(head), tall)):
            out.append(head if i == tall - 1 else " " * len(head))
            out.append(line, style=palette[key])
            out.append("\n")
    out.rstrip()
    return out


def trends_text(history: Sequence[Sample], width: int, rows: int) -> Text:
    """The hit ratios and the backends' latency percentiles over time (the dashboard's
    two smaller charts): one sparkline each, ratios on 0 to 100%, the percentiles on one
    scale (p99's highest), so that they compare."""
    from rich.text import Text

    out = Text(no_wrap=True, overflow="crop")
    if not history:
        return out
    palette = colours()
    latest = history[-1]
    lines: list[_Row] = []
    for tier in ("ram", "disk"):
        head = f"hit {tier:<5}{percent(latest['hit_ratio'].get(tier)):>9}"
        values = [s["hit_ratio"].get(tier) for s in history]
        lines.append(_sparkline(head, values, width, palette[tier], 1.0))
    latencies = {
        p: [(s["backend"].get("latency_ms") or {}).get(p) for s in history]
        for p in ("p50", "p90", "p99")
    }
    top = max((v for series in latencies.values() for v in series if v is not None), default=0)
    for p, values in latencies.items():
        head = f"{p} latency{millis(values[-1]):>7}"
        lines.append(_sparkline(head, values, width, palette[p], float(top)))
    _emit(out, lines, width, rows)
    return out


def _sparkline(head: str, values: list[float | None], width: int, colour: str, top: float) -> _Row:
    room = width - len(head) - 1
    if room < 1:
        return _Row(head)
    return _Row(head + " ", spark=spark(values, room, top), spark_style=colour)


def tiers_text(sample: Sample | None, width: int, rows: int) -> Text:
    """Each tier's bytes of budget and hit ratio, then misses, waits and requests."""
    from rich.text import Text

    out = Text(no_wrap=True, overflow="crop")
    if sample is None:
        return out
    ratio = sample["hit_ratio"]
    hits = sample["hits"]
    lines: list[tuple[str, str]] = []
    wide = width >= 60
    for tier in sample["tiers"]:
        name = tier["name"]
        held = f"{human_size(tier['bytes'])}/{human_size(tier['budget_bytes'])}"
        line = f"{name:<5}{held:>19}"
        if tier.get("degraded"):
            # the reason matters more than the ratio on a narrow screen
            lines.append((f"{line} DEGRADED: {tier['degraded']}", "bold red"))
            continue
        line += f" {percent(ratio.get(name)):>6} hit"
        if wide:
            line += f" {per_second(hits.get(name))}"
        lines.append((line, ""))
    lines.append(
        (
            f"miss {per_second(hits['miss'])}  single-flight waits "
            f"{per_second(sample['singleflight_waits'])}",
            "",
        )
    )
    requests = sample["requests"]
    lines.append(
        (
            f"http {per_second(requests['http'])}  local {per_second(requests['local'])}"
            f" ({sample['local_clients']} clients)  s3 {per_second(requests.get('s3', 0.0))}",
            "",
        )
    )
    _emit(out, lines, width, rows)
    return out


def _moved(
    history: Sequence[Sample], pick: Callable[[Sample], Iterable[tuple[str, tuple[float, ...]]]]
) -> dict[str, tuple[float, ...]]:
    """What moved for each name over the last :data:`WINDOW` samples: the sums of the
    figures ``pick`` gives for it in each."""
    moved: dict[str, tuple[float, ...]] = {}
    for sample in history[-WINDOW:]:
        for name, figures in pick(sample):
            before = moved.get(name)
            moved[name] = (
                figures if before is None else tuple(map(sum, zip(before, figures, strict=True)))
            )
    return moved


def _series(
    history: Sequence[Sample], pick: Callable[[Sample], Iterable[tuple[str, tuple[float, ...]]]]
) -> dict[str, list[float | None]]:
    """Each name's first figure in every sample of ``history`` (None where it is absent)."""
    series: dict[str, list[float | None]] = {}
    for i, sample in enumerate(history):
        for name, figures in pick(sample):
            series.setdefault(name, [None] * len(history))[i] = figures[0]
    return series


def _backend_figures(sample: Sample) -> Iterable[tuple[str, tuple[float, ...]]]:
    return ((b["name"], (b["bytes"], b["requests"], b["errors"])) for b in sample["backends"])


def backends_text(
    history: Sequence[Sample], width: int, rows: int, *, sparklines: bool = True
) -> Text:
    """All backends together (rates, latency), then one line per backend: those in
    trouble (circuit open, errors in the window) first, then the busiest (bytes, then
    requests, over the last :data:`WINDOW` samples), then by name. When rows run out,
    the idle ones are what is hidden."""
    from rich.text import Text

    out = Text(no_wrap=True, overflow="crop")
    if not history:
        return out
    sample = history[-1]
    total = sample["backend"]
    latency = total.get("latency_ms") or {}
    figures = (
        f"all {per_second(total['requests'])} err {per_second(total['errors'])} "
        f"{byte_rate(total['bytes'])}"
    )
    percentiles = (
        f"p50 {millis(latency.get('p50'))} p90 {millis(latency.get('p90'))} "
        f"p99 {millis(latency.get('p99'))}"
    )
    trouble = "bold red" if total["errors"] else ""
    lines: list[_Row] = []
    if len(figures) + len(percentiles) + 10 <= width:  # one line where it fits
        lines.append(_Row(f"{figures}  latency {percentiles}", trouble))
    else:
        lines.append(_Row(figures, trouble))
        lines.append(_Row(("latency " if width >= 50 else "") + percentiles))
    moved = _moved(history, _backend_figures)
    still = (0.0, 0.0, 0.0)

    def order(backend: dict[str, Any]) -> tuple[bool, bool, float, float, str]:
        nbytes, requests, errors = moved.get(backend["name"], still)
        return (not backend["circuit_open"], errors <= 0, -nbytes, -requests, backend["name"])

    ordered = sorted(sample["backends"], key=order)
    series = _series(history, _backend_figures) if sparklines else {}
    colour = colours()["backend"]
    for backend in ordered:
        name = backend["name"]
        circuit = "OPEN" if backend["circuit_open"] else "ok"
        head = (
            f"{_fit(name, 10):<10} {per_second(backend['requests']):>7} "
            f"err {per_second(backend['errors']):>6} "
        )
        if width >= 50:  # narrow: the circuit before the bytes
            head += f"{byte_rate(backend['bytes']):>12} "
        head += circuit
        row = _row_spark(head, series.get(name, ()), width, colour) if sparklines else _Row(head)
        idle = not backend["circuit_open"] and not any(moved.get(name, still))
        style = "bold red" if backend["circuit_open"] else ""
        lines.append(_Row(row.text, style, row.spark, row.spark_style, idle))
    _emit(out, lines, width, rows)
    return out


def _peer_flow(sample: Sample) -> Iterable[tuple[str, tuple[float, ...]]]:
    peers = sample.get("peers") or {}
    return ((m["address"], (m["in"] + m["out"],)) for m in peers.get("members") or ())


def peers_text(
    history: Sequence[Sample], width: int, rows: int, *, sparklines: bool = True
) -> Text:
    """Peers up and down, with bytes per second from and to each: those down first,
    then the busiest over the last :data:`WINDOW` samples, then by address. Under the
    head, the replicas held here against their budget and the pushes in and out, and
    this node's answers as an owner; under each peer that exchanged chunks, the bytes
    since the start by the role the sender played (owner, holder, replica), from it and
    to it. Where ``rows`` are too few, the per-role lines go first, then the owner's
    line, then the replicas' line."""
    from rich.text import Text

    out = Text(no_wrap=True, overflow="crop")
    if not history:
        return out
    peers = history[-1]["peers"]
    if peers is None:
        out.append("no [peers] in the config", style="dim")
        return out
    members = peers["members"]
    wide = width >= 60
    head = f"{peers['healthy']} of {len(members)} up, self {peers['self']}"
    if not wide:
        head = f"{peers['healthy']} of {len(members)} up; in, out per s"
    summary = [
        _Row(line)
        for parts in (_replicas_parts(peers), _owner_parts(peers))
        for line in _packed(parts, width)
    ]
    flow = _moved(history, _peer_flow)
    series = _series(history, _peer_flow) if sparklines else {}
    colour = colours()["peer"]
    ordered = sorted(
        members, key=lambda m: (m["healthy"], -flow.get(m["address"], (0.0,))[0], m["address"])
    )
    listed: list[tuple[_Row, list[_Row]]] = []
    for member in ordered:
        state = "up" if member["healthy"] else "DOWN"
        if member["address"] == peers["self"]:
            state = "self"  # a member too; it exchanges nothing with itself
        if wide:
            flows = f" in {byte_rate(member['in']):>12} out {byte_rate(member['out']):>12}"
        else:
            flows = f" {human_size(member['in']):>9} {human_size(member['out']):>9}"
        address = member["address"]
        room = max(min(width - len(flows) - 5, 40), 13)
        text = f"{_fit(address, room):<{room}} {state:<4}{flows}"
        row = _row_spark(text, series.get(address, ()), width, colour) if sparklines else _Row(text)
        idle = member["healthy"] and not any(flow.get(address, ()))
        style = "" if member["healthy"] else "bold red"
        roles = [_Row(line, "dim", idle=idle) for line in _packed(_roles_parts(member), width)]
        listed.append((_Row(row.text, style, row.spark, row.spark_style, idle), roles))
    detailed = [line for row, roles in listed for line in (row, *roles)]
    lines = [_Row(head), *summary, *detailed]
    if rows > 0 and len(lines) > rows:  # the per-role lines go first, then the summary
        peer_lines = [row for row, _ in listed]
        while summary and 1 + len(summary) + len(peer_lines) > rows:
            summary.pop()
        lines = [_Row(head), *summary, *peer_lines]
    _emit(out, lines, width, rows)
    return out


def _packed(parts: Sequence[str], width: int) -> list[str]:
    """``parts`` joined by spaces into as few lines as fit ``width`` (no limit from 0),
    each part whole; a line after the first is indented as the first is."""
    if not parts:
        return []
    indent = parts[0][: len(parts[0]) - len(parts[0].lstrip())]
    lines = [parts[0]]
    for part in parts[1:]:
        if width <= 0 or len(lines[-1]) + 1 + len(part) <= width:
            lines[-1] += " " + part
        else:
            lines.append(indent + part)
    return lines


def _replicas_parts(peers: dict[str, Any]) -> list[str]:
    """The replicas held here against the budget, the pushes received (stored, refused
    full, invalid) and made (ok, refused full, failed), and this node's saves by how
    many copies they got; none from a daemon that sends no replica figures."""
    replicas = peers.get("replicas")
    if not replicas:
        return []
    received, pushes, saves = replicas["received"], replicas["pushes"], replicas["saves"]
    return [
        f"replicas {human_size(replicas['bytes'])} of {human_size(replicas['budget_bytes'])};",
        f"in {received['stored']} stored {received['full']} full {received['invalid']} invalid;",
        f"out {pushes['ok']} ok {pushes['full']} full {pushes['failed']} failed;",
        f"saves {saves['full']} full {saves['partial']} partial",
    ]


def _owner_parts(peers: dict[str, Any]) -> list[str]:
    """This node's answers as a chunk's owner since the start; none before any."""
    answers = peers.get("holder_answers")
    if not answers or not any(answers.values()):
        return []
    return [
        f"as owner: served {answers['served']},",
        f"to holders {answers['holders']},",
        f"direct {answers['direct']};",
        f"{peers.get('holders_tracked', 0)} chunks tracked",
    ]


def _roles_parts(member: dict[str, Any]) -> list[str]:
    """A member's bytes since the start by role, only the roles that moved: ``from
    owner 12.0 MiB holder 3.0 MiB,`` ``to holder 4.0 MiB``; none when none did."""
    totals = member.get("role_bytes")
    if not totals:
        return []
    parts = []
    for direction, word in (("in", "from"), ("out", "to")):
        moved = [f"{role} {human_size(n)}" for role, n in totals[direction].items() if n > 0]
        if moved:
            parts.append(f"  {word} " + " ".join(moved))
    if len(parts) == 2:
        parts = [parts[0] + ",", parts[1].lstrip()]
    return parts


def checkpoints_text(sample: Sample | None, width: int, rows: int) -> Text:
    """Saves in flight, each with its durability bar and bytes uploaded."""
    from rich.text import Text

    out = Text(no_wrap=True, overflow="crop")
    if sample is None:
        return out
    jobs = sample["checkpoints"]
    if not jobs:
        out.append("no saves in flight", style="dim")
        return out
    lines = []
    for job in jobs:
        level = job["durability"] or "-"
        tail = (
            f" {job['rank']}/{job['world_size']} {job['state']:<9} {durability_bar(job)} "
            f"{level:<10} {human_size(job['remote_bytes'])}/{human_size(job['unique_bytes'])}"
        )
        extra = f" up, {human_size(job['logical_bytes'])} logical"
        if job["age_s"] is not None:
            extra += f", {job['age_s']:.0f}s"
        if width - len(tail) - len(extra) >= 16:  # room for the name with the details
            tail += extra
        lines.append((_fit(job["name"], max(width - len(tail), 12)) + tail, ""))
    more = sample.get("checkpoints_total", len(jobs)) - len(jobs)
    if more > 0:
        lines.append((f"… and {more} more saves in flight", "dim"))
    _emit(out, lines, width, rows)
    return out


#: below this many rows the hottest panel has no room for its two headings and an item
#: under each with the line saying how many more: it lists items only
HOT_HEADINGS_ROWS: Final = 6


def hot_text(sample: Sample | None, width: int, rows: int) -> Text:
    """The hottest datasets and objects, each kind busiest first (bytes, then reads per
    second). With both kinds, each has a heading and a share of the rows, so that many
    hot datasets never hide every object. Under :data:`HOT_HEADINGS_ROWS` rows there
    are no headings: the busiest items of both kinds, each kind's busiest kept where
    there are two rows or more, the last row saying how many more where there are three
    or more. Never more lines than ``rows`` (0: every item)."""
    from rich.text import Text

    out = Text(no_wrap=True, overflow="crop")
    if sample is None:
        return out
    groups: list[tuple[str, list[_Row]]] = []
    busy: list[list[tuple[float, float]]] = []  # each line's (bytes, reads), per kind
    for kind in ("datasets", "objects"):
        items = sorted(sample["hot"][kind], key=lambda i: (-i["bytes"], -i["reads"], i["name"]))
        busy.append([(i["bytes"], i["reads"]) for i in items])
        lines = []
        for item in items:
            tail = f" {byte_rate(item['bytes']):>12}"
            if width >= 50:  # narrow: the name before the reads
                # the daemon rounds rates to 3 decimals: a read fading out is not 0
                reads = "<0.001/s" if item["bytes"] and not item["reads"] else None
                tail += f" {reads or per_second(item['reads']):>8}"
            room = max(width - len(tail), 8)
            lines.append(_Row(_fit_left(item["name"], room).ljust(room) + tail))
        if lines:
            groups.append((kind, lines))
    if not groups:
        out.append("no reads in the last minute", style="dim")
        return out
    if len(groups) == 1:
        _emit(out, groups[0][1], width, rows)
        return out
    if 0 < rows < HOT_HEADINGS_ROWS:
        _emit_hottest(out, [lines for _, lines in groups], busy, width, rows)
        return out
    # each kind its heading and its lines, within its share of the rows
    shares = [len(lines) + 1 for _, lines in groups]
    while rows > 0 and sum(shares) > rows and max(shares) > 2:
        shares[shares.index(max(shares))] -= 1
    for i, ((kind, lines), share) in enumerate(zip(groups, shares, strict=True)):
        out.append(_fit(kind, width) if width > 0 else kind, style="bold dim")
        out.append("\n")
        _emit(out, lines, width, share - 1 if rows > 0 else 0)
        if i < len(groups) - 1:
            out.append("\n")
    return out


#: a job's time to first batch by phase, in the order they happen
FIRST_BATCH_PHASES: Final = (
    ("metadata", "metadata"),
    ("worker_start", "worker start"),
    ("first_chunk", "first chunk"),
    ("decode", "decode"),
)
#: a job with at least this data stall is shown in trouble (the alert's line)
STALL_BAD: Final = 0.1


def jobs_text(sample: Sample | None, width: int, rows: int) -> Text:
    """Each job, the highest data stall first, as the sample lists them: its stall (and
    over the ranks' latest windows) and ranks; under it, its worst ranks, its bytes per
    second by source and its time to first batch by phase. Short of rows, the lines
    under the jobs go first."""
    from rich.text import Text

    out = Text(no_wrap=True, overflow="crop")
    if sample is None:
        return out
    jobs = sample.get("jobs") or []
    total = max(sample.get("jobs_total") or 0, len(jobs))
    if not jobs:
        out.append("no jobs seen", style="dim")
        return out
    heads: list[_Row] = []
    details: list[list[_Row]] = []
    for job in jobs:
        ranks = job.get("ranks")
        world = job.get("world_size")
        tail = f" stall {percent(job.get('stall')):>6} recent {percent(job.get('recent_stall')):>6}"
        if ranks is not None:
            tail += f" {ranks}/{world} ranks" if world else f" {ranks} ranks"
        name = str(job.get("name")) + (" (ended)" if job.get("ended") else "")
        room = max(min(width - len(tail), 32), 12) if width > 0 else len(name)
        stall = job.get("stall")
        style = "bold red" if isinstance(stall, int | float) and stall >= STALL_BAD else ""
        heads.append(_Row(_fit(name, room).ljust(room) + tail, style))
        details.append([_Row(line, "dim") for line in _packed(_job_parts(job), width)])
    lines = [line for head, more in zip(heads, details, strict=True) for line in (head, *more)]
    if rows > 0 and len(lines) > rows:
        lines = heads
    if total > len(jobs):
        lines.append(_Row(f"… and {total - len(jobs)} more jobs", "dim"))
    _emit(out, lines, width, rows)
    return out


def _job_parts(job: dict[str, Any]) -> list[str]:
    """A job's second line in parts: its worst ranks, bytes per second by source, then
    its time to first batch and each phase of it."""
    throughput = job.get("throughput") or {}
    parts = []
    worst = job.get("worst_ranks") or []
    if worst:
        parts.append("  worst")
        parts += [f"{r['rank']} {percent(r.get('stall'))}," for r in worst]
        parts[-1] = parts[-1].rstrip(",") + ";"
    parts.append("from" if parts else "  from")
    for key, label in (("ram", "RAM"), ("disk", "disk"), ("peer", "peer"), ("backend", "backend")):
        parts.append(f"{label} {byte_rate(throughput.get(key))}")
    first = job.get("first_batch")
    if first:
        parts[-1] += ";"
        parts.append(f"first batch {seconds(first.get('total'))}:")
        parts += [f"{label} {seconds(first.get(key))}" for key, label in FIRST_BATCH_PHASES]
        if first.get("rank") is not None:
            parts.append(f"(rank {first['rank']})")
    return parts


def cost_text(sample: Sample | None, width: int, rows: int) -> Text:
    """What the node's data movement spent, what it would have without chunkd, what the
    cache and the peers saved, the backend's requests and bytes; then the jobs that
    spent most, each with the same figures."""
    from rich.text import Text

    out = Text(no_wrap=True, overflow="crop")
    if sample is None:
        return out
    cost = sample.get("cost")
    if cost is None:
        out.append("no cost ledger", style="dim")
        return out
    currency = cost.get("currency")
    totals = cost.get("totals") or {}
    saved = totals.get("saved") or {}
    requests = totals.get("backend_requests_total")
    read = (totals.get("backend_bytes") or {}).get("read")
    written = totals.get("written_total")
    parts = [
        f"spent {money(totals.get('spent'), currency)},",
        f"without chunkd {money(totals.get('direct'), currency)};",
        f"saved by cache {money(saved.get('cache'), currency)},",
        f"by peers {money(saved.get('peer'), currency)}",
    ]
    lines = [_Row(line) for line in _packed(parts, width)]
    # the page's words and figures: backend requests, backend bytes read, bytes written
    backend = [f"backend requests {'-' if requests is None else f'{requests:.0f}'},"]
    backend.append(f"backend bytes read {'-' if read is None else human_size(read)},")
    backend.append(f"bytes written {'-' if written is None else human_size(written)}")
    if cost.get("since"):
        backend.append(f"since {clock(cost['since'])}")
    lines += [_Row(line, "dim") for line in _packed(backend, width)]
    for job in cost.get("jobs") or []:
        name = job.get("job") if job.get("job") is not None else job.get("label", "none")
        j_saved = job.get("saved") or {}
        parts = [
            _fit(str(name), width) if width > 0 else str(name),
            f"spent {money(job.get('spent'), currency)},",
            f"without {money(job.get('direct'), currency)};",
            f"saved by cache {money(j_saved.get('cache'), currency)},",
            f"by peers {money(j_saved.get('peer'), currency)}",
        ]
        packed = _packed(parts, width)
        lines += [_Row(packed[0]), *(_Row("  " + line) for line in packed[1:])]
    more = (cost.get("jobs_total") or 0) - len(cost.get("jobs") or [])
    if more > 0:
        lines.append(_Row(f"… and {more} more jobs", "dim"))
    storage = cost.get("storage")
    if isinstance(storage, dict):
        figures = [
            f"{k.replace('_', ' ')} {_storage_figure(k, v, currency)}"
            for k, v in storage.items()
            if isinstance(v, int | float | str) and not isinstance(v, bool)
        ]
        lines += [_Row(line, "dim") for line in _packed(["storage:", *figures], width)]
    _emit(out, lines, width, rows)
    return out


def _storage_figure(key: str, value: float | str, currency: str | None) -> str:
    """One storage figure as the page writes it: bytes, an amount, or as sent."""
    if isinstance(value, str):
        return value
    if "bytes" in key:
        return human_size(value)
    if any(word in key for word in ("month", "cost", "dollars", "price")):
        return money(value, currency)
    return f"{value:,}"


def errors_text(sample: Sample | None, width: int, rows: int) -> Text:
    """The latest warnings and errors, newest first."""
    from rich.text import Text

    out = Text(no_wrap=True, overflow="crop")
    if sample is None:
        return out
    entries = list(reversed(sample["errors"]))
    if not entries:
        out.append(f"none ({sample['errors_total']} since the start)", style="dim")
        return out
    lines = []
    for entry in entries:
        level = str(entry["level"]).upper()
        style = "bold red" if level in ("ERROR", "CRITICAL") else "yellow"
        line = f"{clock(entry['t'])} {level[:4]} {entry['logger']}: {entry['message']}"
        lines.append((_fit(" ".join(line.split()), width), style))
    _emit(out, lines, width, rows)
    return out


def _emit_hottest(
    out: Text,
    groups: list[list[_Row]],
    busy: list[list[tuple[float, float]]],
    width: int,
    rows: int,
) -> None:
    """Both kinds' lines in ``rows`` (under :data:`HOT_HEADINGS_ROWS`), no headings:
    each kind's busiest first where two rows or more leave room for both, then the
    busiest of what is left, datasets before objects as with headings; the last row
    says how many are hidden where there are three rows or more."""
    total = sum(len(lines) for lines in groups)
    room = rows - 1 if total > rows >= 3 else min(rows, total)
    taken = [0] * len(groups)
    if room >= len(groups):
        taken = [1] * len(groups)
    while sum(taken) < room:
        # the busiest next line of any kind: (bytes, reads), ties to the first kind
        kind = max(
            (k for k in range(len(groups)) if taken[k] < len(groups[k])),
            key=lambda k: (busy[k][taken[k]], -k),
        )
        taken[kind] += 1
    shown = [line for lines, n in zip(groups, taken, strict=True) for line in lines[:n]]
    hidden = [line for lines, n in zip(groups, taken, strict=True) for line in lines[n:]]
    if hidden and len(shown) < rows:
        idle = ", idle" if all(r.idle for r in hidden) else ""
        shown.append(_Row(f"… {len(hidden)} more{idle}", "dim"))
    _emit(out, shown, width, 0)


def _emit(out: Text, lines: Sequence[_Row | tuple[str, str]], width: int, rows: int) -> None:
    """``lines`` into ``out``, at most ``rows`` of them; the last says how many are left
    (and that they are idle, when every one hidden is)."""
    shown = [line if isinstance(line, _Row) else _Row(*line) for line in lines]
    if rows > 0 and len(shown) > rows:
        hidden = shown[rows - 1 :]
        note = f"… {len(hidden)} more" + (", idle" if all(r.idle for r in hidden) else "")
        shown = [*shown[: rows - 1], _Row(note, "dim")]
    for i, row in enumerate(shown):
        text = _fit(row.text, width) if width > 0 else row.text
        out.append(text, style=row.style)
        if row.spark and (width <= 0 or len(text) + len(row.spark) <= width):
            out.append(row.spark, style=row.spark_style)
        if i < len(shown) - 1:
            out.append("\n")


def node_text(node: dict[str, Any]) -> str:
    """The header: which daemon this is."""
    text = f"chunkd {node['version']} {node['listen']}, started {clock(node['started'])}"
    if node.get("self"):
        text += f", peer {node['self']}"
    return text
