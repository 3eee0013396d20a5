"""The composition root: what one daemon is made of, and its lifecycle in one place.

:func:`open_node` builds the parts from the config, each from the ones before it,
and closes them in the reverse order however the start or the run ends::

    backends      (config only: a bad scheme or token file fails before the cache opens)
    peers         (membership, health probes)                    [peers] only
    cache         ChunkCache.open: RAM and disk tiers, the index
    read path     cache + backends + peers
    listings      backends
    prefetcher    read path
    datasets      backends + read path + cache (the registry of [datasets])
    checkpoints   cache + backends + peers + the datasets' GC roots; resumes journaled saves
    local socket  read path + checkpoints + datasets + listings + prefetcher
    inspector     worker processes that decode for /inspect, clients of the local socket
    decoding      worker processes that decode dataset units once per node (ds_decode)
    telemetry     the dashboard's samples, once a second, of all the above

The HTTP routes (:mod:`chunkd.gateway.api`) reach the parts through the app's keys,
which :func:`build_app` sets from the node inside the app's ``cleanup_ctx``.

Start: load the config (or the embedded default), set up structured logging, load
the ``[peers]`` TLS files if any, run on uvloop, set up the aiohttp runner (the
``cleanup_ctx`` opens the node), bind the HTTP site (HTTPS with TLS), then tell
systemd READY=1 and start the watchdog. Both ports' runners are
:class:`~chunkd.gateway.connections.GuardedRunner` objects over one
:class:`~chunkd.gateway.connections.ConnectionGuard`: the caps on connections (a budget
of their own for the peers' addresses), the header, idle, body and send timeouts, and
the bounds of a request head, before any route runs.

Stop (SIGTERM or SIGINT): STOPPING=1, /readyz turns 503, the site stops taking
connections, in-flight requests get ``server.shutdown_timeout`` seconds to finish,
then ``cleanup_ctx`` closes the cache, which finishes its disk writes and flushes
the index. A second signal does not cut that short: the index stays consistent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

import chunkd
from chunkd import faults
from chunkd.cache import ChunkCache
from chunkd.errors import ChunkdError, ConfigError
from chunkd.gateway import api, appkeys
from chunkd.gateway.admission import ConnectionGuard, ConnectionLimits
from chunkd.gateway.authority import Authority, group_id
from chunkd.gateway.backends import Backends
from chunkd.gateway.checkpoints import Checkpoints
from chunkd.gateway.config import Config, load_config
from chunkd.gateway.connections import ACCEPT_BACKLOG, GuardedRunner
from chunkd.gateway.costs import ATTRIBUTION, Attribution, Ledger
from chunkd.gateway.costs.prices import Prices
from chunkd.gateway.costs.routes import LEDGER
from chunkd.gateway.dashboard import TELEMETRY, Telemetry
from chunkd.gateway.datasets import Datasets
from chunkd.gateway.decoding import DecodeService
from chunkd.gateway.inspector import INSPECTOR, InspectorPool
from chunkd.gateway.jobs import JobTable
from chunkd.gateway.jobs.routes import JOBS
from chunkd.gateway.listing import Listings
from chunkd.gateway.localsock import LocalServer
from chunkd.gateway.logs import MalformedRequestLog, configure_logging
from chunkd.gateway.metrics import Metrics
from chunkd.gateway.peers import Peers
from chunkd.gateway.peers.replica_routes import REPLICAS
from chunkd.gateway.peers.replicas import Replicas
from chunkd.gateway.prefetch import Prefetcher
from chunkd.gateway.readpath import ReadPath
from chunkd.gateway.s3front import S3Front, S3FrontRunner
from chunkd.gateway.s3front.keys import AccessKeys
from chunkd.gateway.sdnotify import SystemdNotifier
from chunkd.gateway.tls import PeerTLS, server_context

__all__ = ["Node", "build_app", "open_node", "run", "serve"]

log = logging.getLogger("chunkd.gateway.daemon")


def serve(config_path: str | None, *, enable_faults: bool = False) -> int:
    """Run the daemon until SIGTERM; returns the process exit status.

    ``enable_faults``: honour ``CHUNKD_FAULTS`` (:mod:`chunkd.faults`; for tests).
    """
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
        faults.arm_from_environment(enable_faults)  # after the logging: it says so loudly
    except ConfigError as exc:
        print(f"chunkd: bad fault injection: {exc}", file=sys.stderr)
        return 2
    try:
        tls = PeerTLS.from_config(config)  # after the logging: it may warn
    except ConfigError as exc:
        print(f"chunkd: bad configuration: {exc}", file=sys.stderr)
        return 2
    try:
        if config.s3_front.enabled:
            AccessKeys(config.s3_front)  # a keys file that cannot be read fails here
            _front_tls(config)
    except ConfigError as exc:
        print(f"chunkd: bad configuration: {exc}", file=sys.stderr)
        return 2
    import uvloop

    try:
        return uvloop.run(run(config, tls=tls))
    except ChunkdError as exc:
        log.error("chunkd could not start: %s", exc)  # noqa: TRY400 - the message says it all
        return 1


@dataclass(frozen=True, slots=True)
class Node:
    """The parts of one running daemon, as :func:`open_node` built them."""

    config: Config
    metrics: Metrics
    backends: Backends
    peers: Peers | None
    cache: ChunkCache
    read_path: ReadPath
    listings: Listings
    prefetcher: Prefetcher
    checkpoints: Checkpoints
    datasets: Datasets
    local: LocalServer
    inspector: InspectorPool
    decoder: DecodeService
    telemetry: Telemetry
    #: the jobs this node serves and their trainers' waits (docs/jobs.md)
    jobs: JobTable
    #: what data movement cost, by job and name (docs/jobs.md)
    ledger: Ledger
    #: copies of this node's saves in peers' RAM, and theirs here (docs/replicas.md)
    replicas: Replicas | None = None


@contextlib.asynccontextmanager
async def open_node(
    config: Config, metrics: Metrics, *, tls: PeerTLS | None
) -> AsyncIterator[Node]:
    """Build and start every part of a daemon from ``config``; close them all on exit.

    Raises:
        ConfigError: a backend, the peers or the cache cannot be set up as configured.
    """
    async with contextlib.AsyncExitStack() as parts:
        jobs = JobTable(
            top=config.jobs.top,
            worst_ranks=config.jobs.worst_ranks,
            idle=config.jobs.idle,
            tracked=config.jobs.tracked,
        )
        ledger = Ledger(
            jobs,
            prices=Prices(
                config.prices,
                {backend.name: config.price_of(backend) for backend in config.backends},
                default=config.cost.default,
            ),
            names=config.cost.names,
            tracked=config.jobs.tracked,
            idle=config.jobs.idle,
            state_path=config.cache.dir / "cost.json",
        )
        for collector in (jobs.collector(), ledger.collector()):
            metrics.registry.register(collector)
            parts.callback(metrics.registry.unregister, collector)
        # Work the daemon starts for nobody (a scrub, GC, a replica push) is accounted
        # to no job: the tasks started from here copy this context.
        ATTRIBUTION.set(Attribution(ledger=ledger))
        backends = Backends.from_config(config.backends, metrics)
        parts.push_async_callback(backends.close)
        peers = Peers(config.peers, metrics, tls=tls) if config.peers.enabled else None
        # The journaled saves' chunks, pinned before the open's background reconciliation
        # evicts down to the budget (oldest first): a kill -9 can leave the disk over it,
        # and they would go before their jobs resume and pin them.
        journaled = await Checkpoints.journaled_chunks(config.cache.dir / "checkpoints")
        cache = await ChunkCache.open(config.cache, pinned=journaled)
        parts.push_async_callback(_closed_cache, cache, config)  # finishes disk writes
        # The ledger's totals go to <cache.dir>/cost.json every minute and at close
        # (after everything that charges it has closed: pushed last-but-cache).
        parts.push_async_callback(_closed_ledger, ledger, asyncio.create_task(ledger.run()))
        log.info(
            "cache open",
            extra={"dir": str(config.cache.dir), "backends": [b.name for b in config.backends]},
        )
        read_path = ReadPath(
            cache,
            backends,
            metrics,
            readahead_chunks=config.server.readahead_chunks,
            span_chunks=config.server.span_chunks,
            peers=peers,
        )
        parts.push_async_callback(read_path.close)
        listings = Listings(backends, metrics)
        parts.push_async_callback(listings.close)
        prefetcher = Prefetcher(
            read_path,
            metrics,
            in_flight=config.server.prefetch_in_flight,
            per_client=config.server.prefetch_per_client,
        )
        parts.push_async_callback(prefetcher.close)
        metrics.watch_cache(cache)
        if peers is not None:
            parts.push_async_callback(peers.close)
            await peers.start()
        admin_group = config.server.admin_group
        authority = Authority(
            None if admin_group is None else group_id(admin_group, "server.admin_group")
        )
        datasets = Datasets(
            config.datasets, backends, read_path, cache, metrics, authority=authority
        )
        replicas = None
        if peers is not None:
            # Closed after the checkpoints (whose pushes use it), before the cache (its
            # leases pin the replicas held in the RAM tier).
            replicas = Replicas(peers, cache, metrics)
            parts.push_async_callback(replicas.close)
        checkpoints = Checkpoints(
            cache,
            backends,
            metrics,
            config.cache.dir / "checkpoints",
            peers=peers,
            gc_roots=datasets.roots,  # frozen snapshots' chunks are roots of the mark
            authority=authority,
            held=journaled,  # unpinned once the jobs resumed and pinned their own
            replicas=replicas,
        )
        parts.push_async_callback(checkpoints.close)
        resumed = await checkpoints.start()
        if resumed:
            log.info("resuming %d checkpoint saves from the journal", resumed)
        # Its workers are clients of the local socket: built before it (the socket's
        # ds_decode asks it), closed before it.
        decoder = DecodeService(config.server.socket, config.datasets, metrics)
        local = LocalServer(
            config.server.socket,
            read_path,
            metrics,
            checkpoints,
            listings=listings,
            prefetcher=prefetcher,
            datasets=datasets,
            decoder=decoder,
            dataset_registry=config.datasets.registry,
            mode=config.server.socket_mode,
            group=config.server.socket_group,
            send_timeout=config.server.socket_send_timeout,
            max_clients=config.server.socket_max_clients,
            jobs=jobs,
            ledger=ledger,
        )
        parts.push_async_callback(local.close)
        await local.start()
        # Its workers are clients of the local socket: closed before it.
        inspector = InspectorPool(
            config.server.socket,
            workers=config.server.inspect_workers,
            timeout=config.server.inspect_timeout,
            memory=config.server.inspect_memory,
        )
        parts.push_async_callback(inspector.close)
        parts.push_async_callback(decoder.close)
        telemetry = Telemetry(
            metrics,
            cache,
            backends,
            checkpoints,
            read_path.hot,
            peers=peers,
            listen=config.server.listen,
            jobs=jobs,
            ledger=ledger,
        )
        parts.push_async_callback(telemetry.close)
        await telemetry.start()
        yield Node(
            config=config,
            metrics=metrics,
            backends=backends,
            peers=peers,
            cache=cache,
            read_path=read_path,
            listings=listings,
            prefetcher=prefetcher,
            checkpoints=checkpoints,
            datasets=datasets,
            local=local,
            inspector=inspector,
            decoder=decoder,
            telemetry=telemetry,
            jobs=jobs,
            ledger=ledger,
            replicas=replicas,
        )


async def _closed_ledger(ledger: Ledger, saver: asyncio.Task[None]) -> None:
    saver.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await saver
    try:
        await ledger.save()
    except OSError as exc:
        log.warning("cannot write the cost ledger to %s: %s", ledger.state_path, exc)


async def _closed_cache(cache: ChunkCache, config: Config) -> None:
    await cache.close()  # finishes disk writes and flushes the index
    log.info("cache closed", extra={"dir": str(config.cache.dir)})


def build_app(
    config: Config, *, metrics: Metrics | None = None, tls: PeerTLS | None = None
) -> web.Application:
    """The daemon's aiohttp application: the routes, over a node opened in ``cleanup_ctx``.

    ``tls``: the contexts of ``[peers]`` TLS, if the caller has loaded them already;
    None: loaded here from ``config`` (when it sets TLS).

    Raises:
        ConfigError: the TLS files of ``config`` are unusable.
    """
    tls = tls if tls is not None else PeerTLS.from_config(config)
    app = api.build_app(config, metrics=metrics or Metrics(), tls=tls)

    async def node_context(app: web.Application) -> AsyncIterator[None]:
        async with open_node(config, app[appkeys.METRICS], tls=tls) as node:
            app[appkeys.BACKENDS] = node.backends
            app[appkeys.PEERS] = node.peers
            app[REPLICAS] = None if node.replicas is None else node.replicas.store
            app[appkeys.CACHE] = node.cache
            app[appkeys.READ_PATH] = node.read_path
            app[appkeys.LISTINGS] = node.listings
            app[appkeys.PREFETCHER] = node.prefetcher
            app[appkeys.CHECKPOINTS] = node.checkpoints
            app[appkeys.PAGES] = node.datasets.pages
            app[INSPECTOR] = node.inspector
            app[TELEMETRY] = node.telemetry
            app[JOBS] = node.jobs
            app[LEDGER] = node.ledger
            yield

    app.cleanup_ctx.append(node_context)
    return app


async def _start_s3_front(
    config: Config, app: web.Application, server_log: MalformedRequestLog, guard: ConnectionGuard
) -> S3FrontRunner | bool | None:
    """Serve ``[s3_front]`` over the node ``app`` opened; None when it is off, False
    when its port cannot be bound (said in the log)."""
    settings = config.s3_front
    if not settings.enabled:
        return None
    front = S3Front(
        config,
        read_path=app[appkeys.READ_PATH],
        listings=app[appkeys.LISTINGS],
        backends=app[appkeys.BACKENDS],
        metrics=app[appkeys.METRICS],
        ledger=app[LEDGER],
    )
    runner = S3FrontRunner(
        front.build_app(),
        guard=guard,
        tls=_front_tls(config),  # the handshake is the connection handler's
        shutdown_timeout=config.server.shutdown_timeout,
        access_log=None,
        logger=server_log,
    )
    await runner.setup()
    site = web.TCPSite(
        runner, settings.host, settings.port, reuse_address=True, backlog=ACCEPT_BACKLOG
    )
    try:
        await site.start()
    except OSError as exc:
        log.error(  # noqa: TRY400 - a bind failure needs no traceback
            "cannot listen on %s for [s3_front]: %s; set s3_front.listen "
            "(or CHUNKD_S3_FRONT_LISTEN)",
            settings.listen,
            exc.strerror or exc,
        )
        await runner.cleanup()
        return False
    scheme = "http" if settings.tls_cert is None else "https"
    log.info("S3 front serving on %s://%s", scheme, settings.listen)
    return runner


def _front_tls(config: Config) -> ssl.SSLContext | None:
    settings = config.s3_front
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    return server_context(settings.tls_cert, settings.tls_key, "[s3_front]")


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
    tls = app[appkeys.PEER_TLS]
    # Malformed requests are anyone's to send: counted, and logged a few lines a minute.
    server_log = MalformedRequestLog(
        logging.getLogger("aiohttp.server"), app[appkeys.METRICS].malformed_http.inc
    )
    # Both ports' connections, under one set of bounds (chunkd.gateway.connections).
    guard = ConnectionGuard(
        ConnectionLimits.of(config.server),
        app[appkeys.METRICS],
        lambda ip: (peers := app.get(appkeys.PEERS)) is not None and peers.trusts(ip),
    )
    runner = GuardedRunner(
        app,
        guard=guard,
        port="http",
        tls=None if tls is None else tls.server,  # the handshake is the connection handler's
        shutdown_timeout=config.server.shutdown_timeout,
        access_log=None,
        logger=server_log,
    )
    notifier.status("opening the cache")
    await runner.setup()
    site = web.TCPSite(
        runner, config.server.host, config.server.port, reuse_address=True, backlog=ACCEPT_BACKLOG
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
    try:
        front = await _start_s3_front(config, app, server_log, guard)
    except ConfigError as exc:  # the keys or TLS files changed since the check at start
        log.error("[s3_front] cannot start: %s", exc)  # noqa: TRY400 - the message says it
        front = False
    if front is False:
        await runner.cleanup()
        server_log.close()
        return 1
    app[appkeys.STATE].ready = True
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
            "s3_front": config.s3_front.listen,
        },
    )
    # The watchdog keeps pinging through the shutdown: flushing may take a while.
    stopped = asyncio.Event()
    watchdog = asyncio.create_task(notifier.run_watchdog(stopped))
    await stop.wait()
    log.info("stopping: finishing in-flight requests (up to %ss)", config.server.shutdown_timeout)
    notifier.stopping("finishing in-flight requests, flushing the index")
    app[appkeys.STATE].stopping = True
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
        # A second signal must not cut the index flush short.
        loop.add_signal_handler(sig, lambda: log.info("already stopping"))
    try:
        try:
            if isinstance(front, S3FrontRunner):
                await front.cleanup()  # its requests are the node's: finished first
        finally:
            await runner.cleanup()  # the index flush, whatever the front's end
    finally:
        stopped.set()
        await watchdog
        server_log.close()
    log.info("stopped")
    return 0
