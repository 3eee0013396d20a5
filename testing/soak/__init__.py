"""The soak: one real daemon under many client processes for a bounded time, and what
its memory, fds and threads do meanwhile.

Shared by ``tests/test_soak.py`` (16 clients, about a minute) and ``bench/soak_bench.py``
(64 clients, 30 minutes). A package of five rooms, one job each, and the driver:

- ``content.py``: :class:`SoakDataset`, the objects of a ``file://`` backend, written
  once: a listing prefix of many small objects (``list/``, at least 10,000 in the full
  soak) and larger ones of several chunks (``obj/``). Every byte is a pure function of
  its object and position (:func:`content`), so a client checks any range it reads
  without holding the data, and a daemon that hands out a wrong byte anywhere is caught.
- ``client.py``: :class:`SoakClient`, one client process (``python -m
  chunkd.testing.soak PLAN``; numpy, never torch). Until its deadline it draws ops from
  a weighted mix: reads of random ranges, of whole small objects and of ranges over
  several chunks, ``read_into``, ``read_ranges``, ``stat``, listing pages of the big
  prefix (with ``start_after``), ``prefetch``, checkpoint saves at ``local`` (``save``,
  or ``async_save`` and a wait) of numpy state that is the same across clients and
  across steps in parts, loads that check every array, and a collection now and then
  that keeps the client's last two checkpoints. Each op's latency goes into a bounded
  histogram; each failure is counted with its message. The report is a JSON file the
  driver reads.
- ``sampler.py``: :class:`DaemonSampler`, once a second, the daemon's memory, fds and
  threads from ``/proc`` (see :class:`Sample` for what is counted how), and its RAM tier
  from ``/v1/stats``, into a bounded :class:`SampleSeries`.
- ``daemon.py``: :class:`SoakConfig` (the daemon's config and the budget's ε) and
  :class:`SoakDaemon` (``chunkd serve`` over it, and what its log holds).
- ``results.py``: :class:`LoadResult` (time series, count, p50, p99 and max per op,
  errors), which renders as Markdown, JSON and CSV.
- ``driver.py``: :class:`Soak`, the driver: dataset, daemon, sampler; :meth:`Soak.load`
  runs one phase of N clients and returns a :class:`LoadResult`.

Every name is re-exported here: ``from chunkd.testing.soak import Soak``.

The memory a daemon holds
    A RAM-tier chunk is a memfd. Its pages are not in the daemon's RSS or PSS unless
    the daemon maps it, and most it holds only as an fd. So the daemon's footprint is
    ``Pss - Pss_Shmem`` (its private and file-backed pages, its share of the libraries)
    plus every memfd it holds by an fd or a mapping, counted once per memfd (many fds
    and mappings of one memfd hold one set of pages) and in full (the daemon keeps all
    of them alive, whoever else maps them), at the pages the kernel allocated
    (``st_blocks``). Mapped memfd pages are in ``Pss_Shmem`` too, hence the subtraction.

The budget and its ε
    The footprint stays under ``ram_bytes + ε``, where ε (:meth:`SoakConfig.epsilon`)
    is what the daemon needs apart from its RAM tier:

    - :data:`PROCESS_ALLOWANCE`, 272 MiB, whatever the number of clients: the
      interpreter and the daemon's imports (45 MiB of PSS idle, measured); the lmdb
      index's pages it has touched (under 8 MiB here, measured: 16); what the daemon
      keeps in memory bounded by entries, which fills over minutes: listing pages
      (65,536 entries, about 20 MiB: a page is kept per ``start_after``, so one key sits
      in many pages: 24), the versions of objects it knows (65,536, every checkpoint
      file included: 16), the hot set, the dashboard's samples and the metrics (8);
      thread stacks (obstore's tokio runtime keeps up to 512 blocking threads, each
      touching tens of KiB: 32); what glibc's arenas and Python's object arenas hold
      after the bursts (50 to 60 MiB over a 15-minute run, measured: 64); and what the
      daemon keeps of each finished save for an hour, whatever their number (about
      8 KiB a save of this state, measured with tracemalloc; 64 clients save about 4 a
      second: 56 MiB in 30 minutes, so 64; not an hour at any rate);
    - :data:`CLIENT_ALLOWANCE` per client, 1 MiB: a connection's buffers (a frame's
      payload is at most 1 MiB) and the chunks pinned by its reads in flight after
      their eviction;
    - the staged checkpoints the daemon holds, per client: the daemon keeps a save's
      sealed memfd (``chunkd-checkpoint``) until its upload is done, outside
      ``ram_bytes`` by design, and a client starts a save only once its last one is
      committed (as a trainer's saves are minutes apart): the staged size of one
      state (:attr:`StateShape.staged_bytes`). Nothing in the daemon bounds the
      staged bytes of saves that come faster than their uploads.

Nothing here grows with time: latencies go into histograms of fixed buckets, errors
keep a count and the first :data:`ERRORS_KEPT` messages, the time series halves its
resolution when full, and the daemon's log is scanned line by line.
"""

from __future__ import annotations

from chunkd.testing.soak.client import (
    DEFAULT_MIX,
    ERRORS_KEPT,
    ClientPlan,
    ClientReport,
    LatencyHistogram,
    SoakClient,
)
from chunkd.testing.soak.content import (
    GiB,
    KiB,
    MiB,
    SoakDataset,
    SoakMismatchError,
    StateShape,
    content,
)
from chunkd.testing.soak.daemon import (
    CLIENT_ALLOWANCE,
    PROCESS_ALLOWANCE,
    LogReport,
    SoakConfig,
    SoakDaemon,
)
from chunkd.testing.soak.driver import Soak
from chunkd.testing.soak.results import LoadResult, OpStats
from chunkd.testing.soak.sampler import DaemonSampler, Sample, SampleSeries, sample_process

__all__ = [
    "CLIENT_ALLOWANCE",
    "DEFAULT_MIX",
    "ERRORS_KEPT",
    "PROCESS_ALLOWANCE",
    "ClientPlan",
    "ClientReport",
    "DaemonSampler",
    "GiB",
    "KiB",
    "LatencyHistogram",
    "LoadResult",
    "LogReport",
    "MiB",
    "OpStats",
    "Sample",
    "SampleSeries",
    "Soak",
    "SoakClient",
    "SoakConfig",
    "SoakDaemon",
    "SoakDataset",
    "SoakMismatchError",
    "StateShape",
    "content",
    "sample_process",
]
