"""A real HTTP file server for tests: Debian's nginx (``nginx-light``) on loopback.

:class:`NginxServer` starts ``nginx`` in the foreground (``daemon off;``) with its own
config, prefix, pid file and logs under a directory of the test's, serving a directory
of files with ``Range`` and ``ETag`` as a mirror or a static file server does (``etag
off;`` for a server that sends none). Python's ``http.server`` serves neither, which is
why this kit exists. Skip a test with :func:`nginx_or_skip` where nginx is absent.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Final

from chunkd.testing.ports import free_port
from chunkd.testing.process import ServerProcess

__all__ = ["NGINX", "NginxServer", "nginx_or_skip"]

#: where Debian's nginx-light installs it
NGINX: Final = "/usr/sbin/nginx"


def _nginx() -> str | None:
    return NGINX if os.access(NGINX, os.X_OK) else shutil.which("nginx")


def nginx_or_skip() -> str:
    """The nginx binary; the test is skipped (with the reason) where it is absent."""
    import pytest

    found = _nginx()
    if found is None:
        pytest.skip("nginx is not installed (apt-get install nginx-light)")
    return found


class NginxServer:
    """nginx serving ``root`` on ``127.0.0.1``, its files under ``workdir``.

    Args:
        root: the directory served at ``/``.
        workdir: where its config, pid file, logs and temporary files go.
        etag: whether it sends ``ETag`` (nginx's is strong: mtime and size); a string:
            that ``ETag`` for every file instead (``'W/"v1"'``: a weak one).
        header_buffers: nginx's ``large_client_header_buffers`` (``"4 1k"``: a request
            line over 1 KiB is answered 414), or None for nginx's default.
    """

    def __init__(
        self,
        root: Path,
        workdir: Path,
        *,
        etag: bool | str = True,
        header_buffers: str | None = None,
    ) -> None:
        self.root = root
        self.workdir = workdir
        self.etag = etag
        self.header_buffers = header_buffers
        self.port = 0
        self._log = workdir / "error.log"
        self._server: ServerProcess | None = None

    @property
    def url(self) -> str:
        """The server's base URL: ``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    def _config(self) -> str:
        work = self.workdir
        user = "user root;\n" if os.geteuid() == 0 else ""
        temps = "\n".join(
            f"    {name}_temp_path {work}/{name};"
            for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        return f"""{user}daemon off;
master_process off;
worker_processes 1;
pid {work}/nginx.pid;
error_log {self._log} warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
{temps}
    default_type application/octet-stream;{self._buffers()}
    server {{
        listen 127.0.0.1:{self.port};
        root {self.root};
        etag {"on" if self.etag is True else "off"};{self._fixed_etag()}
        location / {{ }}
    }}
}}
"""

    def _buffers(self) -> str:
        if self.header_buffers is None:
            return ""
        return f"\n    large_client_header_buffers {self.header_buffers};"

    def _fixed_etag(self) -> str:
        if not isinstance(self.etag, str):
            return ""
        quoted = self.etag.replace("\\", "\\\\").replace("'", "\\'")
        return f"\n        add_header ETag '{quoted}';"

    def start(self) -> NginxServer:
        """Start it and wait until it listens."""
        binary = _nginx()
        if binary is None:
            raise FileNotFoundError("nginx is not installed (apt-get install nginx-light)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        conf = self.workdir / "nginx.conf"
        conf.write_text(self._config())
        argv = [binary, "-p", str(self.workdir), "-c", str(conf), "-e", str(self._log)]
        try:
            self._server = ServerProcess.launch(argv, port=self.port)
        except TimeoutError:
            raise RuntimeError(f"nginx did not start: {self.log()}") from None
        return self

    def log(self) -> str:
        """What nginx wrote to its error log."""
        return self._log.read_text(errors="replace") if self._log.exists() else ""

    def stop(self) -> None:
        """Stop it (and wait for it)."""
        server, self._server = self._server, None
        if server is not None:
            server.stop()

    def __enter__(self) -> NginxServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
