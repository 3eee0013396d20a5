"""Prometheus metrics of one daemon, in a registry of its own.

Counters that the gateway updates as it works live here as prometheus-client
objects; the cache's counters are read from :meth:`ChunkCache.stats` at scrape time
by :class:`CacheCollector`, so the cache library needs no metrics dependency. Every
metric's help text (``# HELP`` in ``/metrics``) says what it counts. The ones an
operator reads first, and what they do not count:

``chunkd_cache_hits_total{tier}``, ``chunkd_cache_misses_total``
    Chunks of objects looked up for a reader, each once: a hit of the tier whose
    copy the reader got (``ram``; ``disk``, promoted into RAM on the way), or a
    miss: no tier held it, so it was fetched from a peer or the backend, or the
    reader waited on a fetch already in flight. A first read of an object is a
    miss per chunk; the lease on a chunk just fetched and stored is no hit. Readers
    are every door's object reads (HTTP, the local socket, the S3 front, a peer
    asking for a chunk it places here, a dataset's members, a freeze, prefetch and
    ``chunkd warm``) and ``GET /v1/chunks/{id}`` (a miss there is a 404); readahead
    is none. Checkpoint loads are counted by
    ``chunkd_checkpoint_restored_bytes_total{source}``.
``chunkd_read_chunks_total{source}``
    The same lookups for object reads, counted by the read path: ``ram`` and
    ``disk`` are the cache's hits of that tier, ``fetched`` its misses, one for one
    (the cache's counters differ from these only by ``GET /v1/chunks``). The
    dashboard's and ``chunkd top``'s hit ratios are these.
``chunkd_backend_requests_total{backend,op}``
    Requests sent to a backend, each attempt of a retried one included.
``chunkd_backend_errors_total{backend,kind}``
    Requests the backend failed, by chunkd's error kind: ``BackendUnavailableError``
    (5xx, timeouts, refused connections; retried), ``BackendForbiddenError``
    (credentials), ``VersionChangedError`` (an object changed under a pinned read).
    Not an absent object, which is an answer (the next counter), nor a key the
    store cannot hold (``chunkd_backend_rejected_keys_total``).
``chunkd_backend_not_found_total{backend}``
    Requests answered "no such object": a HEAD or GET of a key that is not there,
    as asked (opening a dataset asks whether its frozen record exists; a checkpoint
    save asks whether each chunk is already uploaded).
``chunkd_cost_*{train_job,name,...}``
    The cost ledger's counters (:mod:`chunkd.gateway.costs.ledger`, read at scrape
    time by its collector): the same backend requests and bytes as above, by the job
    and dataset or checkpoint name whose work made them, the bytes served to readers
    by source, the bytes written, what the same reads would have asked of the
    backend without chunkd, and each priced by the backend's ``[cost]`` table.
    ``train_job`` is a job's name, ``other`` or ``none`` (:class:`JobTable` admits
    names); no other metric has a ``train_job`` label. docs/jobs.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from chunkd.cache import ChunkCache

__all__ = ["CacheCollector", "Metrics"]

_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    """Every metric the daemon exports. One instance per daemon (no global state)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.backend_requests = Counter(
            "chunkd_backend_requests", "Requests sent to backends", ["backend", "op"], registry=r
        )
        self.backend_errors = Counter(
            "chunkd_backend_errors",
            "Backend requests that failed (an absent object is an answer, not counted here)",
            ["backend", "kind"],
            registry=r,
        )
        self.backend_not_found = Counter(
            "chunkd_backend_not_found",
            "Backend requests answered 'no such object' (an answer to what was asked, "
            "not a backend error)",
            ["backend"],
            registry=r,
        )
        self.backend_read_bytes = Counter(
            "chunkd_backend_read_bytes", "Bytes read from backends", ["backend"], registry=r
        )
        self.backend_write_bytes = Counter(
            "chunkd_backend_write_bytes", "Bytes written to backends", ["backend"], registry=r
        )
        self.backend_seconds = Histogram(
            "chunkd_backend_request_seconds",
            "Latency of backend requests",
            ["backend", "op"],
            buckets=_LATENCY,
            registry=r,
        )
        self.backend_circuit_open = Gauge(
            "chunkd_backend_circuit_open",
            "1 while a backend's circuit breaker is open",
            ["backend"],
            registry=r,
        )
        self.singleflight_waiters = Counter(
            "chunkd_singleflight_waiters",
            "Readers that waited on a fetch already in flight instead of starting one",
            registry=r,
        )
        self.read_seconds = Histogram(
            "chunkd_read_seconds",
            "Latency of object reads served over HTTP (to the first byte)",
            buckets=_LATENCY,
            registry=r,
        )
        self.read_bytes = Counter(
            "chunkd_read_bytes", "Object bytes served to readers", ["source"], registry=r
        )
        self.peer_bytes = Counter(
            "chunkd_peer_bytes", "Bytes exchanged with peers", ["direction"], registry=r
        )
        self.peer_requests = Counter(
            "chunkd_peer_requests",
            "Chunk requests sent to peers, by peer and outcome",
            ["peer", "outcome"],
            registry=r,
        )
        self.peer_integrity_failures = Counter(
            "chunkd_peer_integrity_failures",
            "Chunks from a peer that did not match their id (dropped, never cached)",
            ["peer"],
            registry=r,
        )
        self.peer_members = Gauge("chunkd_peer_members", "Members of the cluster", registry=r)
        self.peer_healthy = Gauge(
            "chunkd_peer_healthy", "Members of the cluster that are up", registry=r
        )
        self.http_requests = Counter(
            "chunkd_http_requests", "HTTP requests answered", ["route", "status"], registry=r
        )
        self.local_requests = Counter(
            "chunkd_local_requests",
            "Requests on the local socket, by client uid and op",
            ["uid", "op"],
            registry=r,
        )
        self.local_clients = Gauge(
            "chunkd_local_clients", "Clients connected to the local socket", registry=r
        )
        self.local_malformed = Counter(
            "chunkd_local_malformed_frames",
            "Local connections closed for a malformed frame",
            registry=r,
        )
        self.local_stuck = Counter(
            "chunkd_local_stuck_clients",
            "Local connections dropped after socket_send_timeout: the client took no bytes, "
            "or asked again without reading an answer that carried fds",
            registry=r,
        )
        self.ckpt_saves = Counter(
            "chunkd_checkpoint_saves",
            "Checkpoint save jobs (one per rank), by outcome",
            ["outcome"],
            registry=r,
        )
        self.ckpt_bytes = Counter(
            "chunkd_checkpoint_bytes",
            "Checkpoint bytes saved: logical (as staged) and new (uploaded, not deduplicated)",
            ["kind"],
            registry=r,
        )
        self.ckpt_restored_bytes = Counter(
            "chunkd_checkpoint_restored_bytes",
            "Checkpoint chunk bytes handed to this node's readers, by where they came from: "
            "cache (already on this node), peer, backend",
            ["source"],
            registry=r,
        )
        self.ckpt_integrity_failures = Counter(
            "chunkd_checkpoint_integrity_failures",
            "Checkpoint chunks from a backend that did not match their id (never cached)",
            registry=r,
        )
        self.dataset_first_batch = Histogram(
            "chunkd_dataset_first_batch_seconds",
            "Time to a data loader's first batch, by phase, as the loaders on this node "
            "report it: metadata (resolving the snapshot, building the order), "
            "worker_start (a worker process's start to its first read), first_chunk (the "
            "first sample's bytes), decode (the rest of the first batch), total",
            ["phase"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=r,
        )
        self.dataset_decodes = Counter(
            "chunkd_dataset_decodes",
            "Dataset units decoded, by where: daemon (by its decode workers, once per node "
            "for every reader that asks), reader (in a reader's own process, where the "
            "daemon did not decode for it: as the readers report them)",
            ["where"],
            registry=r,
        )
        self.dataset_decode_repeats = Counter(
            "chunkd_dataset_decode_repeats",
            "Daemon decodes of a unit it had decoded before (its entry was evicted, or its "
            "decode failed): 0 while each unit is decoded once per node",
            registry=r,
        )
        self.dataset_decode_hits = Counter(
            "chunkd_dataset_decode_hits",
            "ds_decode requests answered with a decoded unit the daemon held",
            registry=r,
        )
        self.dataset_decode_waits = Counter(
            "chunkd_dataset_decode_waits",
            "ds_decode requests that waited for the same unit's decode in flight",
            registry=r,
        )
        self.dataset_decode_declined = Counter(
            "chunkd_dataset_decode_declined",
            "ds_decode requests the daemon did not decode (the reader decodes in-process), by "
            "reason: off, busy, format (another decoder version, a format not installed "
            "here), size (a table over the largest entry), failed (its worker timed out or "
            "crashed)",
            ["reason"],
            registry=r,
        )
        self.dataset_decoded_bytes = Gauge(
            "chunkd_dataset_decoded_bytes",
            "Bytes of decoded units the daemon holds (within [datasets] decoded_bytes)",
            registry=r,
        )
        self.dataset_decoded_units = Gauge(
            "chunkd_dataset_decoded_units", "Decoded units the daemon holds", registry=r
        )
        self.dataset_decoded_evicted = Counter(
            "chunkd_dataset_decoded_evicted",
            "Decoded units the daemon dropped to stay within decoded_bytes",
            registry=r,
        )
        self.dataset_decode_seconds = Histogram(
            "chunkd_dataset_decode_seconds",
            "Time of one unit's decode by the daemon's workers, from its start to its sealed table",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.read_chunks = Counter(
            "chunkd_read_chunks",
            "Chunks the read path looked up for a reader, by where it found them: ram, disk "
            "(already cached there: cache hits), fetched (from a peer or the backend, or "
            "waited on a fetch in flight: cache misses)",
            ["source"],
            registry=r,
        )
        self.read_chunk_bytes = Counter(
            "chunkd_read_chunk_bytes",
            "Bytes of the chunks the read path found cached, by tier (ram, disk); bytes "
            'fetched are chunkd_peer_bytes_total{direction="in"} and '
            "chunkd_backend_read_bytes_total",
            ["source"],
            registry=r,
        )
        self.peer_member_bytes = Counter(
            "chunkd_peer_member_bytes",
            "Bytes exchanged with each member of the cluster: in (received from it), out "
            "(served to it)",
            ["peer", "direction"],
            registry=r,
        )
        self.peer_role_bytes = Counter(
            "chunkd_peer_role_bytes",
            "Chunk bytes exchanged with each member, by the role the sender played for the "
            "chunk: owner, holder or replica; in (received from it), out (served to it)",
            ["peer", "direction", "role"],
            registry=r,
        )
        self.peer_holder_answers = Counter(
            "chunkd_peer_holder_answers",
            "This node's answers, as a chunk's owner, to peers asking for it: served (the "
            "chunk), holders (a list of nodes that hold it), direct (served to an asker "
            "whose holders failed)",
            ["answer"],
            registry=r,
        )
        self.peer_holders_tracked = Gauge(
            "chunkd_peer_holders_tracked",
            "Chunks whose holders this node remembers as their owner (bounded, expiring)",
            registry=r,
        )
        self.replica_bytes = Gauge(
            "chunkd_replica_bytes",
            "Bytes of other nodes' replicas held in this node's RAM",
            registry=r,
        )
        self.replica_budget = Gauge(
            "chunkd_replica_budget_bytes",
            "RAM this node gives to other nodes' replicas ([peers] replica_budget)",
            registry=r,
        )
        self.replica_pushes = Counter(
            "chunkd_replica_pushes",
            "Replica chunks this node pushed to peers, by peer and outcome: ok, full (the "
            "peer's replica budget), failed",
            ["peer", "outcome"],
            registry=r,
        )
        self.replica_received = Counter(
            "chunkd_replica_received",
            "Replica chunks other nodes pushed here, by outcome: stored, full (past the "
            "replica budget), invalid (not the chunk its id names), refused",
            ["outcome"],
            registry=r,
        )
        self.replica_saves = Counter(
            "chunkd_replica_saves",
            "This node's saves asked to be replicated, by outcome: full (K copies), partial "
            "(fewer), none",
            ["outcome"],
            registry=r,
        )
        self.readahead_chunks = Counter(
            "chunkd_readahead_chunks", "Chunks fetched ahead of sequential readers", registry=r
        )
        self.list_requests = Counter(
            "chunkd_list_requests",
            "Listing pages answered, by backend and where the page came from (cache, backend)",
            ["backend", "source"],
            registry=r,
        )
        self.list_entries = Counter(
            "chunkd_list_entries",
            "Entries (objects and directories) in the listing pages answered",
            ["backend"],
            registry=r,
        )
        self.list_cached_entries = Gauge(
            "chunkd_list_cache_entries", "Entries held by the listing cache", registry=r
        )
        self.prefetch_objects = Counter(
            "chunkd_prefetch_objects",
            "Objects loaded ahead of a job (prefetch and warm), by outcome",
            ["outcome"],
            registry=r,
        )
        self.prefetch_in_flight = Gauge(
            "chunkd_prefetch_in_flight", "Objects being prefetched right now", registry=r
        )
        self.prefetch_in_flight_max = Gauge(
            "chunkd_prefetch_in_flight_max",
            "The most objects prefetched at once since the daemon started",
            registry=r,
        )
        self.prefetch_queued = Gauge(
            "chunkd_prefetch_queued", "Object names waiting for a prefetch slot", registry=r
        )
        self.stale_served = Counter(
            "chunkd_stale_served",
            "Object versions served stale because the backend could not re-check them "
            "(stale-if-error)",
            ["backend"],
            registry=r,
        )
        self.rejected_keys = Counter(
            "chunkd_backend_rejected_keys",
            "Requests a backend refused for their own key (too long, invalid for that "
            "store): answered 4xx, never counted against the backend's health",
            ["backend"],
            registry=r,
        )
        self.malformed_http = Counter(
            "chunkd_http_malformed_requests",
            "HTTP requests refused before routing (bad request line, headers or framing)",
            registry=r,
        )
        self.s3_requests = Counter(
            "chunkd_s3_requests",
            "Requests the S3 front answered, by operation and S3 error code (OK: none)",
            ["op", "code"],
            registry=r,
        )
        self.gc_barrier_waits = Counter(
            "chunkd_checkpoint_gc_barrier_waits",
            "Saves that waited for a garbage collection in progress before deduplicating",
            registry=r,
        )

    def watch_cache(self, cache: ChunkCache) -> None:
        """Export ``cache``'s counters and gauges at every scrape."""
        self.registry.register(CacheCollector(cache))


class CacheCollector(Collector):
    """Reads the cache's own counters when Prometheus scrapes."""

    def __init__(self, cache: ChunkCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[Metric]:
        # docstring inherited
        if self.cache.closed:
            return
        stats = self.cache.stats()
        hits = CounterMetricFamily(
            "chunkd_cache_hits",
            "Chunks of objects looked up for readers and answered from a tier (a chunk "
            "just fetched is no hit); chunkd_read_chunks_total{source=TIER} counts the same",
            labels=["tier"],
        )
        evictions = CounterMetricFamily(
            "chunkd_cache_evictions", "Chunks evicted to make room", labels=["tier"]
        )
        integrity = CounterMetricFamily(
            "chunkd_cache_integrity_failures",
            "Cached copies found damaged, dropped and never served",
            labels=["tier"],
        )
        errors = CounterMetricFamily(
            "chunkd_cache_errors", "OS errors met by a tier", labels=["tier", "kind"]
        )
        size = GaugeMetricFamily("chunkd_cache_bytes", "Bytes held by a tier", labels=["tier"])
        chunks = GaugeMetricFamily("chunkd_cache_chunks", "Chunks held by a tier", labels=["tier"])
        budget = GaugeMetricFamily(
            "chunkd_cache_budget_bytes", "A tier's byte budget", labels=["tier"]
        )
        degraded = GaugeMetricFamily(
            "chunkd_cache_degraded", "1 while a tier is degraded", labels=["tier"]
        )
        for tier in stats.tiers:
            hits.add_metric([tier.name], tier.hits)
            evictions.add_metric([tier.name], tier.evictions)
            integrity.add_metric([tier.name], tier.integrity_failures)
            for kind, count in sorted(tier.errors.items()):
                errors.add_metric([tier.name, kind], count)
            size.add_metric([tier.name], tier.bytes)
            chunks.add_metric([tier.name], tier.chunks)
            budget.add_metric([tier.name], tier.budget_bytes)
            degraded.add_metric([tier.name], 1 if tier.degraded else 0)
        misses = CounterMetricFamily(
            "chunkd_cache_misses",
            "Chunks of objects looked up for readers that no tier held: fetched from a "
            "peer or the backend, or waited on such a fetch; "
            'chunkd_read_chunks_total{source="fetched"} counts the same',
        )
        misses.add_metric([], stats.misses)
        yield from (hits, misses, evictions, integrity, errors, size, chunks, budget, degraded)
