"""s3rver, an S3-protocol server in Node.js, for the benchmarks that need S3 to keep up
with a link (:mod:`bench.coldlink_bench`).

moto's server answers every ranged GET by reading the whole object, so ranged reads
of a large object crawl (0.024 GB/s for 4 MiB ranges of a 256 MiB object on the
development VM, against 0.53 GB/s for one whole GET); s3rver serves a range from its
file (0.21 GB/s for the same ranges, 0.23 GB/s whole). It takes one key pair
(:data:`KEY`) and ignores ``If-Match`` (it honours ``If-None-Match``), so it is a bench
server, not a conformance target: the backend suite runs against moto. ``make`` installs it from
the npm registry into ``.emulators/`` (:data:`S3RVER_VERSION`); :func:`s3rver_binary`
finds it there, or ``CHUNKD_S3RVER`` names it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Final

from chunkd.testing.ports import free_port
from chunkd.testing.process import ServerProcess

__all__ = ["KEY", "S3RVER_VERSION", "S3rverServer", "s3rver_binary"]

#: the version ``make`` installs (the Makefile names the same)
S3RVER_VERSION: Final = "3.7.1"
_REPO: Final = Path(__file__).resolve().parent.parent
#: the access key and secret s3rver takes
KEY: Final = "S3RVER"


def s3rver_binary() -> Path | None:
    """``s3rver`` from ``CHUNKD_S3RVER`` or ``.emulators/``; None when absent (or when
    there is no node to run it)."""
    named = os.environ.get("CHUNKD_S3RVER")
    path = Path(named) if named else _REPO / ".emulators/node_modules/.bin/s3rver"
    if not path.exists() or shutil.which("node") is None:
        return None
    return path


class S3rverServer(ServerProcess):
    """s3rver over plain http, its objects in a directory, with the buckets named."""

    @classmethod
    def start(
        cls,
        binary: Path,
        directory: Path,
        buckets: list[str],
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        netns: str | None = None,
    ) -> S3rverServer:
        """Start ``binary`` serving ``directory`` and wait until it listens.

        Args:
            binary: the ``s3rver`` script (:func:`s3rver_binary`).
            directory: where it keeps the objects.
            buckets: buckets made at start.
            host: the address it listens on.
            port: its port (a free one on loopback by default).
            netns: run it in this network namespace (``ip netns exec``).
        """
        port = port or free_port()
        directory.mkdir(parents=True, exist_ok=True)
        prefix = ["ip", "netns", "exec", netns] if netns else []
        argv = [*prefix, str(binary), "-d", str(directory), "-a", host, "-p", str(port)]
        argv += [arg for bucket in buckets for arg in ("--configure-bucket", bucket)]
        argv.append("--silent")
        return cls.launch(argv, port=port, host=host)

    def client(self) -> Any:
        """A boto3 S3 client of this server."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=KEY,
            aws_secret_access_key=KEY,
            region_name="us-east-1",
        )
