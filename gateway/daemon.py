"""``chunkd serve``: the daemon's lifecycle in one place.

Start: load the config (or the embedded default), set up structured logging, load
the ``[peers]`` TLS files if any, run on uvloop, set up the aiohttp runner
(``cleanup_ctx`` opens the cache and the backends), bind the HTTP site (HTTPS with
TLS), then tell systemd READY=1 and start the watchdog.

Stop (SIGTERM or SIGINT): STOPPING=1, /readyz turns 503, the site stops taking
connections, in-flight requests get ``server.shutdown_timeout`` seconds to finish,
then ``cleanup_ctx`` closes the cache, which finishes its disk writes and flushes
the index. A second signal does not cut that short: the index stays consistent.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from aiohttp import web

import chunkd
from chunkd.errors import ChunkdError, ConfigError
from chunkd.gateway.api import METRICS, PEER_TLS, STATE, build_app
from chunkd.gateway.config import Config, load_config
from chunkd.gateway.logs import MalformedRequestLog, configure_logging
from chunkd.gateway.sdnotify import SystemdNotifier
from chunkd.gateway.tls import PeerTLS

__all__ = ["run", "serve"]

log = logging.getLogger("chunkd.gateway.daemon")


def serve(config_path: str | None) -> int:
    """Run the daemon until SIGTERM; returns the process exit status."""
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        print(f"chunkd: bad configuration: {exc}", file=sys.stderr)
        return 2
    try:
        configure_logging(config.server.log_level, config.server.log_format)
    except ValueError as exc:
        print(f"chunkd: bad configuration: {exc}", file=sys.stderr)
        return 2
    try:
        tls = PeerTLS.from_config(config)  # after the logging: it may warn
    except ConfigError as exc:
        print(f"chunkd: bad configuration: {exc}", file=sys.stderr)
        return 2
    import uvloop

    try:
        return uvloop.run(run(config, tls=tls))
    except ChunkdError as exc:
        log.error("chunkd could not start: %s", exc)  # noqa: TRY400 - the message says it all
        return 1


async def run(
    config: Config, *, stop: asyncio.Event | None = None, tls: PeerTLS | None = None
) -> int:
    """Serve ``config`` until ``stop`` is set or a SIGTERM/SIGINT arrives.

    ``tls``: the ``[peers]`` TLS contexts if already loaded; None: loaded from ``config``.
    """
    notifier = SystemdNotifier.from_env()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    app = build_app(config, tls=tls)
    tls = app[PEER_TLS]
    # Malformed requests are anyone's to send: counted, and logged a few lines a minute.
    server_log = MalformedRequestLog(
        logging.getLogger("aiohttp.server"), app[METRICS].malformed_http.inc
    )
    runner = web.AppRunner(
        app,
        shutdown_timeout=config.server.shutdown_timeout,
        access_log=None,
        logger=server_log,
    )
    notifier.status("opening the cache")
    await runner.setup()
    site = web.TCPSite(
        runner,
        config.server.host,
        config.server.port,
        reuse_address=True,
        ssl_context=None if tls is None else tls.server,
    )
    try:
        await site.start()
    except OSError as exc:
        log.error(  # noqa: TRY400 - a bind failure needs no traceback
            "cannot listen on %s: %s; set server.listen (or CHUNKD_SERVER_LISTEN)",
            config.server.listen,
            exc.strerror or exc,
        )
        await runner.cleanup()
        server_log.close()
        return 1
    app[STATE].ready = True
    where = f"{'http' if tls is None else 'https'}://{config.server.listen}"
    notifier.ready(f"serving on {where}")
    log.info(
        "chunkd %s serving on %s",
        chunkd.__version__,
        where,
        extra={
            "config": config.source,
            "cache_dir": str(config.cache.dir),
            "backends": [b.name for b in config.backends],
        },
    )
    # The watchdog keeps pinging through the shutdown: flushing may take a while.
    stopped = asyncio.Event()
    watchdog = asyncio.create_task(notifier.run_watchdog(stopped))
    await stop.wait()
    log.info("stopping: finishing in-flight requests (up to %ss)", config.server.shutdown_timeout)
    notifier.stopping("finishing in-flight requests, flushing the index")
    app[STATE].stopping = True
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
        # A second signal must not cut the index flush short.
        loop.add_signal_handler(sig, lambda: log.info("already stopping"))
    try:
        await runner.cleanup()
    finally:
        stopped.set()
        await watchdog
        server_log.close()
    log.info("stopped")
    return 0
