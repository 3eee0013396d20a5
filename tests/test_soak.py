"""The soak in CI: 16 client processes against one real daemon for 50 seconds.

The clients (numpy only, never torch) draw mixed reads, ``read_into``, ``stat``,
listing pages of a 10,000-key prefix, ``prefetch``, checkpoint saves at ``local``
(deduplicated across clients and steps), loads and collections from
:data:`chunkd.testing.soak.DEFAULT_MIX`, and check every byte they get. Meanwhile the
daemon is sampled once a second (:class:`chunkd.testing.soak.DaemonSampler`). What a
user relies on, checked here:

- no op fails, and every read, load and listing page was checked;
- the daemon's memory (PSS less its mapped shmem, plus every memfd it holds, once
  each) stays under ``ram_bytes`` (128 MiB, against a dataset of about 500 MiB, so it
  evicts all along) plus ε: 272 MiB for the process whatever the load (45 MiB idle;
  lmdb's touched pages, what it keeps bounded by entries, thread stacks, malloc's
  slack, finished saves), and per client 1 MiB of connection buffers and one staged
  save (3.3 MiB), which the daemon holds outside ``ram_bytes`` until its upload is
  done: 340 MiB in all. :mod:`chunkd.testing.soak`'s docstring itemises it. The RAM
  tier's memfds alone stay within ``ram_bytes`` plus 1 MiB a client (chunks that
  reads in flight hold after their eviction);
- its fds stay flat once warm (the last fifth of the samples against the first
  fifth after a warm-up of 15 s, medians): files and pipes, and connections, move by
  at most 8 each; all fds but the RAM tier's chunks (those, staged saves, chunks held
  by reads in flight) by at most 32; all of them together grow by at most 10% (the
  RAM tier's count moves with the mix of small and large chunks it holds);
- its own pages (PSS less Pss_Shmem) grow by at most 32 MiB over the settled minute:
  bounded caches fill over minutes, but a buffer leaked per request would show;
- its threads are bounded, and go back to rest: obstore's tokio runtime keeps up to
  512 blocking threads for 10 s after a burst (collections, uploads), so the peak may
  be high, but 12 s after the load the count is within 16 of what it was 12 s after
  the warm-up (pools that start threads lazily, asyncio's default executor among them);
- it still serves afterwards, and its log has no traceback and no error.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from chunkd.testing.soak import (
    LatencyHistogram,
    Sample,
    SampleSeries,
    Soak,
    SoakConfig,
    SoakDataset,
    sample_process,
)

MiB = 1 << 20
GiB = 1 << 30
CLIENTS = 16
SECONDS = 50.0
#: tokio's default cap of blocking threads (obstore's runtime), plus the daemon's own
THREAD_CAP = 512 + 64
#: seconds at rest before and after the load: tokio lets an idle blocking thread go after 10
REST = 12.0
READ_OPS = ("read_range", "read_small", "read_span", "read_into")


@pytest.mark.timeout(240)
def test_sixteen_clients_for_a_while_leave_the_daemon_as_they_found_it(tmp_path: Path) -> None:
    config = SoakConfig(dataset=SoakDataset(small_objects=10_000, large_objects=120))
    with Soak(tmp_path / "soak", config) as soak:
        warmed = soak.warm()
        time.sleep(REST)
        before = sample_process(soak.daemon.pid)
        result = soak.load("ci", CLIENTS, SECONDS)
        time.sleep(REST)
        after = sample_process(soak.daemon.pid)
        soak.check_serving()
        log = soak.daemon.log_report()
    summary = result.summary()
    result.write(tmp_path / "out")
    print(f"\nwarm-up read of the large objects: {warmed:.1f} s")
    print(result.markdown())
    print(
        f"at rest before and after: threads {before.threads} and {after.threads}, fds "
        f"{before.fds} and {after.fds}; daemon log: {log.warnings} warnings"
    )

    assert result.errors == 0, summary["first_errors"]
    ops = result.ops
    for op in (*READ_OPS, "read_ranges", "stat", "list", "prefetch", "ckpt_load", "ckpt_gc"):
        assert ops[op].count > 0, f"no {op} ran"
    assert ops["ckpt_save_local"].count + ops["ckpt_async_save"].count > 0
    checked = sum(ops[op].count for op in READ_OPS) + 16 * ops["read_ranges"].count
    assert result.report.verified_reads == checked
    assert result.report.verified_bytes > 1 * GiB
    assert result.report.verified_loads == ops["ckpt_load"].count
    assert result.report.verified_pages == ops["list"].count

    assert result.peak_footprint <= result.limit, (
        f"the daemon held {result.peak_footprint / MiB:.0f} MiB, over ram_bytes + epsilon "
        f"({result.limit / MiB:.0f} MiB)"
    )
    # The RAM tier itself keeps to its budget, give or take the chunks that reads in
    # flight hold after their eviction (a client's allowance in ε covers them).
    assert config.ram_bytes // 2 < result.peak.cache_memfd_bytes <= config.ram_bytes + CLIENTS * MiB

    assert summary["other_fd_drift"] <= 8, summary
    assert summary["socket_fd_drift"] <= 8, summary
    assert summary["untiered_fd_drift"] <= 32, summary
    assert summary["fd_drift"] <= max(64, result.peak.fds // 10), summary
    assert summary["process_drift"] <= 32 * MiB, summary

    assert result.peak.threads <= THREAD_CAP
    assert after.threads <= before.threads + 16, (before.threads, after.threads)

    assert log.tracebacks == 0, log.first
    assert log.errors == 0, log.first


# Python's mmap keeps a dup of its fd, so the mapping-only memfd is mapped with libc's.
_HOLDER = """
import ctypes, mmap, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
a = os.memfd_create("chunkd")
os.write(a, b"a" * (1 << 20))
copies = [os.dup(a) for _ in range(2)]
b = os.memfd_create("chunkd")
os.write(b, b"b" * (2 << 20))
address = libc.mmap(None, 2 << 20, mmap.PROT_READ, mmap.MAP_SHARED, b, 0)
assert address not in (None, ctypes.c_void_p(-1).value)
os.close(b)
c = os.memfd_create("chunkd-checkpoint")
os.write(c, b"c" * (512 << 10))
print("ready", flush=True)
sys.stdin.readline()
"""


def test_the_sampler_counts_each_memfd_once_whether_held_by_fds_or_a_mapping() -> None:
    # A memfd held by three fds is one set of pages; one only mapped is still held.
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        sample = sample_process(child.pid)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
        assert child.stdout is not None
        child.stdout.close()
    assert sample.memfds == 3
    assert sample.memfd_fds == 4  # a and its two copies, c
    assert sample.memfd_bytes == (1 << 20) + (2 << 20) + (512 << 10)
    assert sample.cache_memfd_bytes == 3 << 20
    assert sample.staged_memfd_bytes == 512 << 10
    assert sample.footprint == sample.pss - sample.pss_shmem + sample.memfd_bytes
    assert sample.threads == 1


def test_latency_quantiles_are_within_a_bucket_and_the_series_stays_bounded() -> None:
    histogram = LatencyHistogram()
    for i in range(1, 1001):
        histogram.record(i / 1000)  # 1 ms .. 1 s
    assert 0.5 <= histogram.quantile(0.5) <= 0.5 * 1.05
    assert 0.99 <= histogram.quantile(0.99) <= 0.99 * 1.05
    assert histogram.quantile(1.0) == histogram.max == 1.0
    again = LatencyHistogram.from_json(histogram.to_json())
    again.merge(histogram)
    assert again.count == 2000
    assert again.quantile(0.5) == histogram.quantile(0.5)

    series = SampleSeries(capacity=64)
    for t in range(10_000):
        series.add(Sample(t=float(t), fds=t % 100, footprint=5 if t == 7777 else 1))
    assert len(series.samples) < 64
    assert series.count == 10_000
    assert series.peak.footprint == 5  # merged, never lost
    assert max(s.footprint for s in series.samples) == 5
    assert series.samples[-1].t > 9000
