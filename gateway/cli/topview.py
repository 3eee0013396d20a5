"""The live screen of ``chunkd top``: a textual app whose panels each own one concern.

Kept apart from :mod:`chunkd.gateway.cli.top` so that ``chunkd --help`` and the
``--once``/``--json`` paths never import textual. Data flows one way: the
:class:`~chunkd.gateway.cli.top.DashboardFeed` worker posts messages to the app, the
app keeps the last 300 samples and binds them (``data_bind``) to the panels, and each
panel draws its section from them at whatever size it has. No panel polls.

The screen uses the room it has. Rows go first to what has something to show: a panel
with nothing in it folds (no saves in flight: the checkpoints panel is its title; no
``[peers]``: the backends take the whole row), the backends get the rows their list
needs up to half of what is left, and the hottest objects and the warnings the rest.
Wider, the throughput's sparklines and each backend's and peer's grow; from
:data:`TALL` rows, a panel of the hit ratios and the backends' latency over time shows
(the dashboard's two smaller charts). While the stream is down, the panels dim, as the
page's do: the last figures stay, but do not pass for live ones.
"""

from __future__ import annotations

from collections import deque
from typing import Any, ClassVar, Final

from rich.console import RenderableType
from rich.markup import escape
from rich.text import Text
from textual import events, work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.geometry import Size
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Footer

from chunkd.gateway.cli.topfeed import (
    HISTORY,
    Connection,
    DashboardFeed,
    Endpoint,
    Restarted,
    Sample,
    SampleArrived,
    Snapshot,
)
from chunkd.gateway.cli.toppanels import (
    backends_text,
    checkpoints_text,
    clock,
    cost_text,
    errors_text,
    hot_text,
    jobs_text,
    node_text,
    peers_text,
    throughput_text,
    tiers_text,
    trends_text,
)

__all__ = ["TopApp"]

#: from this many rows, the hit ratio and latency panel shows
TALL: Final = 32
#: rows of the panels of fixed height: the throughput and tiers row, the trends panel;
#: the throughput's sparklines grow by up to this many lines each where rows are left
RATES_ROWS: Final = 5
RATES_TALLER: Final = 2
TRENDS_ROWS: Final = 6
#: the checkpoints panel at most (its title and 11 saves)
CHECKPOINTS_ROWS: Final = 12
#: the warnings panel at most (its title and 7 entries), and at most a quarter of the rows
ERRORS_ROWS: Final = 8
#: the jobs and cost row at most (its title and 9 lines), and at most a third of the rows
#: left; hidden while there is no job and nothing spent
JOBS_ROWS: Final = 10
#: the cost panel's columns at most (it takes a third of the screen up to this); the
#: jobs the rest
COST_COLUMNS: Final = 60
#: the backends and peers row at least, and the hottest panel at least
LINKS_MIN: Final = 3
RECENT_MIN: Final = 5
#: the tiers panel's columns at most (it takes half the screen up to this); the
#: throughput's sparklines take the rest
TIERS_COLUMNS: Final = 50
_NO_PEERS: Final = escape(" (no [peers] in the config)")


class FeedMessage(Message):
    """What the feed saw, carried to the app (a Snapshot, SampleArrived, ...)."""

    def __init__(self, event: object) -> None:
        super().__init__()
        self.event = event


class Panel(Widget):
    """One section of the screen, drawn from the samples bound to it."""

    DEFAULT_CSS = """
    Panel {
        width: 1fr;
        height: 1fr;
        border-top: solid $primary;
        border-title-color: $text;
        border-title-style: bold;
        padding: 0 1;
    }
    """
    TITLE: ClassVar[str] = ""

    history: reactive[tuple[Sample, ...]] = reactive(())

    def on_mount(self) -> None:
        self.border_title = self.TITLE

    @property
    def sample(self) -> Sample | None:
        """The latest sample, or None before the first."""
        return self.history[-1] if self.history else None

    def render(self) -> RenderableType:
        size = self.content_size
        return self.section(size.width, size.height)

    def section(self, width: int, rows: int) -> Text:
        """The panel's text at this size."""
        raise NotImplementedError


class ThroughputPanel(Panel):
    """Bytes per second by source, with five minutes of sparkline."""

    TITLE = "throughput"

    def section(self, width: int, rows: int) -> Text:
        return throughput_text(self.history, width, rows)


class TrendsPanel(Panel):
    """The hit ratios and the backends' latency percentiles over time."""

    TITLE = "hit ratio and backend latency"

    def section(self, width: int, rows: int) -> Text:
        return trends_text(self.history, width, rows)


class TiersPanel(Panel):
    """Tiers, their hit ratios, misses, single-flight waits and requests."""

    TITLE = "tiers and hits"

    def section(self, width: int, rows: int) -> Text:
        return tiers_text(self.sample, width, rows)


class BackendsPanel(Panel):
    """Backend requests, errors and latency, and each backend's circuit."""

    TITLE = "backends"

    def section(self, width: int, rows: int) -> Text:
        return backends_text(self.history, width, rows)


class PeersPanel(Panel):
    """Peers up and down, and bytes each way."""

    TITLE = "peers"

    def section(self, width: int, rows: int) -> Text:
        return peers_text(self.history, width, rows)


class CheckpointsPanel(Panel):
    """Saves in flight and how durable each is."""

    TITLE = "checkpoints in flight"

    def section(self, width: int, rows: int) -> Text:
        return checkpoints_text(self.sample, width, rows)


class HotPanel(Panel):
    """The hottest datasets and objects."""

    TITLE = "hottest (last minute)"

    def section(self, width: int, rows: int) -> Text:
        return hot_text(self.sample, width, rows)


class JobsPanel(Panel):
    """Each job's data stall, worst ranks, bytes by source and time to first batch."""

    TITLE = "jobs"

    def section(self, width: int, rows: int) -> Text:
        return jobs_text(self.sample, width, rows)


class CostPanel(Panel):
    """What data movement spent, without chunkd, and what the cache and peers saved."""

    TITLE = "cost"

    def section(self, width: int, rows: int) -> Text:
        return cost_text(self.sample, width, rows)


class ErrorsPanel(Panel):
    """The latest warnings and errors."""

    TITLE = "warnings and errors"

    def section(self, width: int, rows: int) -> Text:
        return errors_text(self.sample, width, rows)


class StatusBar(Widget):
    """Which daemon, whether the stream is live, and the last restart."""

    DEFAULT_CSS = """
    StatusBar { height: 1; width: 1fr; background: $panel; padding: 0 1; }
    """

    node: reactive[dict[str, Any] | None] = reactive(None)
    connection: reactive[str] = reactive("connecting…")
    live: reactive[bool] = reactive(False)
    restarted: reactive[str] = reactive("")

    def render(self) -> RenderableType:
        out = Text(no_wrap=True, overflow="ellipsis")
        if self.node is None:
            out.append("chunkd", style="bold")
        elif self.restarted:
            # the restart's time is the start's: say it once, so it fits in 80 columns
            out.append(f"chunkd {self.node['version']} {self.node['listen']}", style="bold")
        else:
            out.append(node_text(self.node), style="bold")
        out.append("  ")
        out.append(self.connection, style="green" if self.live else "bold red")
        if self.restarted:
            out.append("  ")
            out.append(self.restarted, style="bold yellow")
        return out


class TopApp(App[None]):
    """``chunkd top``: the node's dashboard, live."""

    TITLE = "chunkd top"
    CSS = """
    Screen { layout: vertical; }
    /* the stream is down: the last figures dim, so they do not pass for live ones */
    Screen.stale Panel { text-opacity: 45%; }
    #row-rates { height: 5; }
    TrendsPanel { height: 6; }
    #row-links { height: 1fr; }
    #row-jobs { height: 1; }
    CheckpointsPanel { height: 1; }
    HotPanel { height: 2fr; }
    ErrorsPanel { height: 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "quit"),
        # ctrl+c quits at once (textual's own binding only says how to quit)
        Binding("ctrl+c", "quit", "quit", show=False, priority=True),
    ]
    ENABLE_COMMAND_PALETTE = False

    history: reactive[tuple[Sample, ...]] = reactive(())

    def __init__(self, endpoint: Endpoint) -> None:
        super().__init__()
        self.endpoint = endpoint
        self._samples: deque[Sample] = deque(maxlen=HISTORY)

    def compose(self) -> ComposeResult:
        yield StatusBar()
        with Horizontal(id="row-rates"):
            yield ThroughputPanel().data_bind(TopApp.history)
            yield TiersPanel().data_bind(TopApp.history)
        yield TrendsPanel().data_bind(TopApp.history)
        with Horizontal(id="row-links"):
            yield BackendsPanel().data_bind(TopApp.history)
            yield PeersPanel().data_bind(TopApp.history)
        with Horizontal(id="row-jobs"):
            yield JobsPanel().data_bind(TopApp.history)
            yield CostPanel().data_bind(TopApp.history)
        yield CheckpointsPanel().data_bind(TopApp.history)
        yield HotPanel().data_bind(TopApp.history)
        yield ErrorsPanel().data_bind(TopApp.history)
        yield Footer()

    def on_mount(self) -> None:
        self.arrange_rows()
        self.follow()

    def on_resize(self, event: events.Resize) -> None:
        self.arrange_rows(event.size)

    def watch_history(self) -> None:
        self.arrange_rows()

    def arrange_rows(self, size: Size | None = None) -> None:
        """Give each panel the rows it needs, within the screen's (``size``, default the
        app's); fold the empty ones."""
        width, height = size or self.size
        sample = self.history[-1] if self.history else None
        # half the width, at most TIERS_COLUMNS; the throughput's sparklines the rest
        self.query_one(TiersPanel).styles.width = min(width // 2, TIERS_COLUMNS)
        peers = self.query_one(PeersPanel)
        peers.display = sample is None or sample["peers"] is not None
        backends = self.query_one(BackendsPanel)
        backends.border_title = BackendsPanel.TITLE + ("" if peers.display else _NO_PEERS)
        trends = self.query_one(TrendsPanel)
        trends.display = height >= TALL
        left = height - 2 - RATES_ROWS - (TRENDS_ROWS if trends.display else 0)
        # nothing in flight, no warnings: each folds to its title
        checkpoints = self.query_one(CheckpointsPanel)
        jobs = 0 if sample is None else len(sample["checkpoints"])
        more = 0 if sample is None else sample.get("checkpoints_total", jobs) - jobs
        checkpoints.border_title = CheckpointsPanel.TITLE + ("" if jobs else ": none")
        saves = min(1 + jobs + (1 if more > 0 else 0), CHECKPOINTS_ROWS)
        errors = self.query_one(ErrorsPanel)
        logged = 0 if sample is None else len(sample["errors"])
        errors.border_title = ErrorsPanel.TITLE
        if not logged:
            total = 0 if sample is None else sample["errors_total"]
            errors.border_title += f": none ({total} since the start)"
        warnings = min(1 + logged, max(1, left // 4), ERRORS_ROWS)
        jobs_row = self._arrange_jobs(sample, width, left)
        left -= saves + warnings + jobs_row
        # the backends (and peers) as many rows as their lists, up to half of what is left
        inner = (width if not peers.display else width // 2) - 2
        wanted = 1 + len(backends_text(self.history, inner, 0, sparklines=False).split())
        if peers.display and sample is not None:
            lines = peers_text(self.history, inner, 0, sparklines=False)
            wanted = max(wanted, 1 + len(lines.split()))
        links = max(LINKS_MIN, min(wanted, left - max(RECENT_MIN, left // 2)))
        # rows no list wants make the throughput's sparklines taller, 4 at a time
        hot = 1 + len(hot_text(sample, width - 2, 0).split())
        taller = min(max(left - links - max(hot, RECENT_MIN), 0) // 4, RATES_TALLER)
        checkpoints.styles.height = saves
        errors.styles.height = warnings
        self.query_one("#row-rates").styles.height = RATES_ROWS + 4 * taller
        self.query_one("#row-links").styles.height = links
        self.query_one(HotPanel).styles.height = max(RECENT_MIN, left - links - 4 * taller)

    def _arrange_jobs(self, sample: Sample | None, width: int, left: int) -> int:
        """Size the jobs and cost row; its rows. None (hidden) while there is no job
        and nothing spent; else as many as its longer panel's lines, up to
        :data:`JOBS_ROWS` and a third of ``left``."""
        jobs_panel = self.query_one(JobsPanel)
        cost_panel = self.query_one(CostPanel)
        cost_columns = min(width // 3, COST_COLUMNS)
        cost_panel.styles.width = cost_columns
        listed = [] if sample is None else sample.get("jobs") or []
        cost = None if sample is None else sample.get("cost")
        spent = bool(cost and (cost.get("totals") or {}).get("spent"))
        jobs_panel.border_title = JobsPanel.TITLE + ("" if listed else ": none seen")
        cost_panel.border_title = CostPanel.TITLE
        if cost is None:
            cost_panel.border_title += ": no ledger"
        elif not spent:
            cost_panel.border_title += ": nothing spent"
        row = self.query_one("#row-jobs")
        row.display = bool(listed or spent)
        if not row.display:
            return 0  # nothing to show: the rows go to the lists
        wanted = max(
            len(jobs_text(sample, width - cost_columns - 2, 0).split()),
            len(cost_text(sample, cost_columns - 2, 0).split()),
        )
        rows = max(2, min(1 + wanted, JOBS_ROWS, left // 3))
        row.styles.height = rows
        return rows

    @work(exclusive=True, group="feed")
    async def follow(self) -> None:
        """The one worker: reads the daemon's stream and posts what it sees."""
        feed = DashboardFeed(self.endpoint, lambda event: self.post_message(FeedMessage(event)))
        await feed.run()

    def on_feed_message(self, message: FeedMessage) -> None:
        event = message.event
        status = self.query_one(StatusBar)
        if isinstance(event, SampleArrived):
            self._samples.append(event.sample)
            self.history = tuple(self._samples)
        elif isinstance(event, Snapshot):
            status.node = event.node
            self._samples.clear()
            self._samples.extend(event.history)
            self.history = tuple(self._samples)
        elif isinstance(event, Restarted):
            status.restarted = f"daemon restarted at {clock(event.node['started'])}"
            status.node = event.node
            self._samples.clear()
            self.history = ()
        elif isinstance(event, Connection):
            status.live = event.live
            status.connection = event.detail
            self.screen.set_class(not event.live, "stale")
