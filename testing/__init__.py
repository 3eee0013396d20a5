"""Test kits: real servers and network labs for the tests and the benchmarks.

Installed as ``chunkd.testing`` (as ``chunkd.cache.testing`` is) so that the tests,
the benchmarks and a user's own tests use one implementation. Nothing in the daemon,
the cache or the client imports it.

- :mod:`chunkd.testing.ports`: free loopback ports, waiting for a server;
- :mod:`chunkd.testing.process`: a server subprocess started, waited for and stopped;
- :mod:`chunkd.testing.s3`: a moto S3 server in a subprocess, ``[[backends]]`` tables for it;
- :mod:`chunkd.testing.s3front`: the S3 front's test keys, its table, clients of it;
- :mod:`chunkd.testing.proxy`: a counting TCP proxy that can go down and up;
- :mod:`chunkd.testing.relay`: a TCP relay that delays every piece by latency ± jitter;
- :mod:`chunkd.testing.netlab`: nodes in network namespaces behind shaped links, and
  chaos on one node's link: loss, partitions, latency (root).
- :mod:`chunkd.testing.crowd`: a crowd of slow HTTP clients (slowloris), a process of
  its own;
- :mod:`chunkd.testing.soak`: a daemon under many client processes for a while, its
  memory, fds and threads sampled (import it by name: it pulls in numpy).
"""

from __future__ import annotations

from chunkd.testing.ports import BIN, free_port, wait_for_port
from chunkd.testing.proxy import CountingProxy
from chunkd.testing.relay import LatencyRelay
from chunkd.testing.s3 import S3Server, refused_backend, s3_backend

__all__ = [
    "BIN",
    "CountingProxy",
    "LatencyRelay",
    "S3Server",
    "free_port",
    "refused_backend",
    "s3_backend",
    "wait_for_port",
]
