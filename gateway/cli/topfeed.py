"""What ``chunkd top`` follows: the daemon's endpoint, the dashboard's snapshot and its
stream read and followed through restarts (:class:`DashboardFeed`), and the messages
the feed posts.

``chunkd top --once`` and the live view (:mod:`chunkd.gateway.cli.topview`) both use
it; neither needs the other, and only the live view imports textual. How a sample is
shown, the text of each panel, is :mod:`chunkd.gateway.cli.toppanels`'s.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    import aiohttp

__all__ = [
    "HISTORY",
    "RETRY_MAX_S",
    "RETRY_MIN_S",
    "STREAM_SILENCE_S",
    "Connection",
    "DaemonUnanswered",
    "DashboardFeed",
    "Endpoint",
    "Event",
    "Restarted",
    "Sample",
    "SampleArrived",
    "Snapshot",
    "fetch_snapshot",
    "read_events",
]

#: one sample of the dashboard's stream, as the daemon sends it (JSON)
Sample = dict[str, Any]

#: samples kept, as the daemon keeps: five minutes at 1 s
HISTORY: Final = 300
#: reconnect waits: 1 s, doubling up to 5 s
RETRY_MIN_S: Final = 1.0
RETRY_MAX_S: Final = 5.0
#: the daemon pings every 15 s; a stream silent for longer than this is dead
STREAM_SILENCE_S: Final = 40.0
#: one SSE line, and one event's data, at most (a sample is a few KiB)
_MAX_LINE: Final = 1 << 20
# -- the feed: the snapshot and the stream --------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    """Where the daemon is and how to talk to it."""

    url: str
    token: str | None = None
    ssl: ssl.SSLContext | None = None

    def headers(self) -> dict[str, str]:
        """The request headers: the token as a Bearer header when there is one."""
        return {} if self.token is None else {"Authorization": f"Bearer {self.token}"}

    def session(self) -> aiohttp.ClientSession:
        """A client session for this daemon."""
        import aiohttp

        return aiohttp.ClientSession(
            base_url=self.url.rstrip("/") + "/",
            headers=self.headers(),
            connector=aiohttp.TCPConnector(ssl=self.ssl if self.ssl is not None else True),
        )


class DaemonUnanswered(Exception):
    """The daemon gave no usable answer; the message says what was asked and why."""


async def fetch_snapshot(session: aiohttp.ClientSession, endpoint: Endpoint) -> dict[str, Any]:
    """``GET /v1/dashboard``.

    Raises:
        DaemonUnanswered: no answer, an HTTP error, or not a snapshot.
    """
    import aiohttp

    try:
        async with session.get("v1/dashboard", timeout=aiohttp.ClientTimeout(total=10)) as reply:
            if reply.status != 200:
                raise DaemonUnanswered(_refused(endpoint, reply.status, await reply.text()))
            body = await reply.json(content_type=None)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        raise DaemonUnanswered(_no_answer(endpoint, exc)) from exc
    if not isinstance(body, dict) or not isinstance(body.get("node"), dict):
        raise DaemonUnanswered(f"{endpoint.url}/v1/dashboard did not answer a dashboard snapshot")
    return body


def _refused(endpoint: Endpoint, status: int, body: str) -> str:
    try:
        message = json.loads(body).get("message") or body
    except (ValueError, AttributeError):
        message = body
    message = " ".join(str(message).split())[:300]
    hint = ""
    if status in (401, 403):
        hint = "; give the daemon's server.token with --token-file PATH or $CHUNKD_TOKEN"
    return f"{endpoint.url} answered HTTP {status} ({message}){hint}"


def _no_answer(endpoint: Endpoint, exc: BaseException) -> str:
    from chunkd.gateway.tls import unreachable

    if isinstance(exc, ssl.SSLCertVerificationError) or isinstance(
        getattr(exc, "os_error", None) or getattr(exc, "certificate_error", None),
        ssl.SSLCertVerificationError,
    ):
        return unreachable(endpoint.url, getattr(exc, "certificate_error", exc))
    if isinstance(exc, TimeoutError):
        return f"{endpoint.url} went silent (nothing for {STREAM_SILENCE_S:.0f}s, not even a ping)"
    detail = str(exc) or type(exc).__name__
    return f"no answer from {endpoint.url} ({detail}); is the daemon running (chunkd serve)?"


@dataclass(frozen=True)
class Event:
    """One server-sent event."""

    name: str
    id: str | None
    data: str


async def read_events(reply: aiohttp.ClientResponse) -> AsyncIterator[Event]:
    """The events of a ``text/event-stream`` reply, as they come (comments skipped).

    Raises:
        DaemonUnanswered: a line or an event over 1 MiB.
        TimeoutError: nothing came for ``STREAM_SILENCE_S`` (not even a ping).
    """
    name, event_id = "message", None
    data: list[str] = []
    size = 0
    pending = bytearray()
    while True:
        chunk = await asyncio.wait_for(reply.content.readany(), STREAM_SILENCE_S)
        if not chunk:
            return
        pending += chunk
        while (end := pending.find(b"\n")) >= 0:
            line = pending[:end].decode("utf-8", "replace").removesuffix("\r")
            del pending[: end + 1]
            if not line:
                if data:
                    yield Event(name, event_id, "\n".join(data))
                name, event_id, data, size = "message", None, [], 0
                continue
            if line.startswith(":"):
                continue
            key, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if key == "event":
                name = value
            elif key == "data":
                data.append(value)
                size += len(value)
            elif key == "id":
                event_id = value
        if len(pending) > _MAX_LINE or size > _MAX_LINE:
            raise DaemonUnanswered(f"the stream sent an event over {_MAX_LINE} bytes")


def _boot_seq(event_id: str | None) -> tuple[str, int] | None:
    if not event_id:
        return None
    boot, _, seq = event_id.partition(":")
    try:
        return boot, int(seq)
    except ValueError:
        return None


@dataclass
class DashboardFeed:
    """Follows the daemon's dashboard and says what happens through ``post``.

    It calls ``post`` with a :class:`Snapshot` (at the start and after a restart), a
    :class:`SampleArrived` for each sample, a :class:`Restarted` when the daemon came
    back as another boot, and :class:`Connection` when the stream goes up or down.
    It runs until cancelled, reconnecting with backoff.
    """

    endpoint: Endpoint
    post: Callable[[Any], object]
    boot: str | None = None
    last_seq: int | None = None
    _retry_s: float = field(default=RETRY_MIN_S, init=False)

    async def run(self) -> None:
        """Follow the stream until cancelled."""
        import aiohttp

        async with self.endpoint.session() as session:
            while True:
                try:
                    if self.boot is None:
                        await self._snapshot(session)
                    await self.follow(session)
                    reason = "the daemon closed the stream"
                except DaemonUnanswered as exc:
                    reason = str(exc)
                except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                    reason = _no_answer(self.endpoint, exc)
                except (ValueError, KeyError, TypeError) as exc:
                    # a sample this view cannot read: say so and start again
                    reason = f"{self.endpoint.url} sent what is not a dashboard sample ({exc!r})"
                wait = self._retry_s
                self._retry_s = min(self._retry_s * 2, RETRY_MAX_S)
                self.post(Connection(False, f"disconnected, retrying in {wait:.0f}s: {reason}"))
                await asyncio.sleep(wait)

    async def _snapshot(self, session: aiohttp.ClientSession) -> None:
        snapshot = await fetch_snapshot(session, self.endpoint)
        node = snapshot["node"]
        if self.boot is not None and node["boot"] != self.boot:
            self.post(Restarted(node))
        self.boot = node["boot"]
        history = [s for s in snapshot.get("history", []) if isinstance(s, dict)][-HISTORY:]
        self.last_seq = history[-1]["seq"] if history else None
        self.post(Snapshot(node, history))

    async def follow(self, session: aiohttp.ClientSession) -> None:
        """Read one connection of the stream, from ``Last-Event-ID`` when there is one.

        Raises:
            DaemonUnanswered: an HTTP error or a malformed stream.
            aiohttp.ClientError: the connection failed or dropped.
        """
        import aiohttp

        headers = {"Accept": "text/event-stream"}
        if self.boot is not None and self.last_seq is not None:
            headers["Last-Event-ID"] = f"{self.boot}:{self.last_seq}"
        timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_read=STREAM_SILENCE_S)
        async with session.get("v1/dashboard/stream", headers=headers, timeout=timeout) as reply:
            if reply.status != 200:
                raise DaemonUnanswered(_refused(self.endpoint, reply.status, await reply.text()))
            self._retry_s = RETRY_MIN_S
            self.post(Connection(True, "live"))
            async for event in read_events(reply):
                if event.name == "restarted":
                    # another boot: its history starts again, so does ours (the snapshot
                    # sees the new boot and says so)
                    await self._snapshot(session)
                    continue
                if event.name != "sample":
                    continue
                ident = _boot_seq(event.id)
                if ident is not None and ident[0] != self.boot:
                    await self._snapshot(session)  # another boot without a restarted event
                    continue
                sample = json.loads(event.data)
                if self.last_seq is not None and sample["seq"] <= self.last_seq:
                    continue  # already had it (the snapshot and the stream overlap)
                self.last_seq = sample["seq"]
                self.post(SampleArrived(sample))


# -- messages ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """The daemon's node and history: the views start again from it."""

    node: dict[str, Any]
    history: list[Sample]


@dataclass(frozen=True)
class SampleArrived:
    """One new sample from the stream."""

    sample: Sample


@dataclass(frozen=True)
class Restarted:
    """The daemon came back as another boot."""

    node: dict[str, Any]


@dataclass(frozen=True)
class Connection:
    """The stream went up (``live``) or down (``detail`` says why, and the retry)."""

    live: bool
    detail: str


#: names that lived here before the panels had a module of their own
#: (:mod:`chunkd.gateway.cli.toppanels`), resolved from there on first use (PEP 562, by
#: module name: the panels name this module's ``Sample``, so an import back would be a
#: circle)
_PANELS: Final = frozenset(
    {
        "backends_text",
        "checkpoints_text",
        "clock",
        "colours",
        "errors_text",
        "hot_text",
        "node_text",
        "peers_text",
        "per_second",
        "spark",
        "spark_rows",
        "throughput_text",
        "tiers_text",
        "trends_text",
    }
)


def __getattr__(name: str) -> Any:
    if name not in _PANELS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("chunkd.gateway.cli.toppanels"), name)
    globals()[name] = value
    return value
