"""Test kits: real servers and network labs for the tests and the benchmarks.

Installed as ``chunkd.testing`` so that the tests,
the benchmarks and a user's own tests use one implementation. Nothing in the daemon,
the cache or the client imports it.

- :mod:`chunkd.testing.ports`: free loopback ports, waiting for a server;
- :mod:`chunkd.testing.process`: a server subprocess started, waited for and stopped;
- :mod:`chunkd.testing.daemon`: a real ``chunkd serve`` process (config, environment,
  working directory, arguments, a command prefix such as ``ip netns exec``), waited for
  and stopped: every test, benchmark and lab launches the daemon through it;
- :mod:`chunkd.testing.s3`: a moto S3 server in a subprocess, ``[[backends]]`` tables for it;
- :mod:`chunkd.testing.s3front`: the S3 front's test keys, its table, clients of it;
- :mod:`chunkd.testing.proxy`: a counting TCP proxy that can go down and up;
- :mod:`chunkd.testing.nginx`: Debian's nginx serving a directory on loopback (Range,
  ETag or none), for the ``https://`` backend kind;
- :mod:`chunkd.testing.prometheus`: Debian's Prometheus on loopback (a free port,
  temporary storage, 1 s scrapes and rule evaluations, chunkd's rules) and its HTTP
  API's queries, for the rules' and dashboard's tests;
- :mod:`chunkd.testing.relay`: a TCP relay that delays every piece by latency ± jitter;
- :mod:`chunkd.testing.netlab`: nodes in network namespaces behind shaped links, and
  chaos on one node's link: loss, partitions, latency (root).
- :mod:`chunkd.testing.crowd`: a crowd of slow HTTP clients (slowloris), a process of
  its own;
- :mod:`chunkd.testing.soak`: a daemon under many client processes for a while, its
  memory, fds and threads sampled (import it by name: it pulls in numpy).
- :mod:`chunkd.testing.backends`: the backends' conformance suite;
- :mod:`chunkd.testing.formats`: the dataset formats' conformance suite (it imports
  neither the daemon nor a server).
- :mod:`chunkd.testing.tiers`: the cache tiers' conformance suite, ``TierTests``
  (``chunkd.cache.testing`` re-exports it under its old name).

The names below are imported when first used (PEP 562), so importing one module of the
kit (``chunkd.testing.formats``) does not import the daemon's config with the others.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chunkd.testing.daemon import DaemonProcess
    from chunkd.testing.nginx import NginxServer
    from chunkd.testing.ports import BIN, free_port, wait_for_port
    from chunkd.testing.prometheus import PrometheusServer
    from chunkd.testing.proxy import CountingProxy
    from chunkd.testing.relay import LatencyRelay
    from chunkd.testing.s3 import S3Server, refused_backend, s3_backend
    from chunkd.testing.tiers import TierTests

__all__ = [
    "BIN",
    "CountingProxy",
    "DaemonProcess",
    "LatencyRelay",
    "NginxServer",
    "PrometheusServer",
    "S3Server",
    "TierTests",
    "free_port",
    "refused_backend",
    "s3_backend",
    "wait_for_port",
]

#: each name's module
_LAZY = {
    "BIN": "ports",
    "free_port": "ports",
    "wait_for_port": "ports",
    "CountingProxy": "proxy",
    "DaemonProcess": "daemon",
    "LatencyRelay": "relay",
    "NginxServer": "nginx",
    "PrometheusServer": "prometheus",
    "S3Server": "s3",
    "refused_backend": "s3",
    "s3_backend": "s3",
    "TierTests": "tiers",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
