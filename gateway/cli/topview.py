"""The live screen of ``chunkd top``: a textual app whose panels each own one concern.

Kept apart from :mod:`chunkd.gateway.cli.top` so that ``chunkd --help`` and the
``--once``/``--json`` paths never import textual. Data flows one way: the
:class:`~chunkd.gateway.cli.top.DashboardFeed` worker posts messages to the app, the
app keeps the last 300 samples and binds them (``data_bind``) to the panels, and each
panel draws its section from them at whatever size it has. No panel polls.
"""

from __future__ import annotations

from collections import deque
from typing import Any, ClassVar

from rich.console import RenderableType
from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
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
    backends_text,
    checkpoints_text,
    clock,
    errors_text,
    hot_text,
    node_text,
    peers_text,
    throughput_text,
    tiers_text,
)

__all__ = ["TopApp"]


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
        return throughput_text(self.history, width)


class TiersPanel(Panel):
    """Tiers, their hit ratios, misses, single-flight waits and requests."""

    TITLE = "tiers and hits"

    def section(self, width: int, rows: int) -> Text:
        return tiers_text(self.sample, width, rows)


class BackendsPanel(Panel):
    """Backend requests, errors and latency, and each backend's circuit."""

    TITLE = "backends"

    def section(self, width: int, rows: int) -> Text:
        return backends_text(self.sample, width, rows)


class PeersPanel(Panel):
    """Peers up and down, and bytes each way."""

    TITLE = "peers"

    def section(self, width: int, rows: int) -> Text:
        return peers_text(self.sample, width, rows)


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
    #row-rates { height: 5; min-height: 5; }
    #row-links { height: 1fr; min-height: 5; }
    CheckpointsPanel { height: auto; min-height: 3; max-height: 12; }
    #row-recent { height: 2fr; min-height: 5; }
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
        with Horizontal(id="row-links"):
            yield BackendsPanel().data_bind(TopApp.history)
            yield PeersPanel().data_bind(TopApp.history)
        yield CheckpointsPanel().data_bind(TopApp.history)
        with Horizontal(id="row-recent"):
            yield HotPanel().data_bind(TopApp.history)
            yield ErrorsPanel().data_bind(TopApp.history)
        yield Footer()

    def on_mount(self) -> None:
        self.follow()

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
