"""Azurite's blob service (an Azure Blob Storage emulator) in a subprocess, for az://.

``make test`` installs Azurite from the npm registry into ``.emulators/`` at the
repository root (:data:`AZURITE_VERSION`); :func:`azurite_binary` finds it there (or
``CHUNKD_AZURITE`` names it). It runs in memory on a free loopback port, with its
telemetry off, and a backend reaches it as any Azure account: ``endpoint`` is
``http://127.0.0.1:PORT/devstoreaccount1`` (the account in the path), the account
name and key its well-known development ones.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import shutil
import urllib.request
from email.utils import formatdate
from pathlib import Path
from typing import Final

from chunkd.testing.ports import free_port
from chunkd.testing.process import ServerProcess

__all__ = ["ACCOUNT", "ACCOUNT_KEY", "AZURITE_VERSION", "AzuriteServer", "azurite_binary"]

#: the version ``make test`` installs (the Makefile names the same)
AZURITE_VERSION: Final = "3.35.0"
#: Azurite's well-known development account and key (public; they guard nothing)
ACCOUNT: Final = "devstoreaccount1"
ACCOUNT_KEY: Final = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
_REPO: Final = Path(__file__).resolve().parent.parent
_API_VERSION: Final = "2021-08-06"


def azurite_binary() -> Path | None:
    """``azurite-blob`` from ``CHUNKD_AZURITE`` or ``.emulators/``; None when absent
    (or when there is no node to run it)."""
    named = os.environ.get("CHUNKD_AZURITE")
    path = Path(named) if named else _REPO / ".emulators/node_modules/.bin/azurite-blob"
    if not path.exists() or shutil.which("node") is None:
        return None
    return path


class AzuriteServer(ServerProcess):
    """Azurite's blob service over plain http on loopback, in memory."""

    @classmethod
    def start(cls, binary: Path) -> AzuriteServer:
        """Start ``binary`` on a free loopback port and wait until it listens."""
        port = free_port()
        host = "127.0.0.1"
        return cls.launch(
            [
                str(binary),
                "--blobHost",
                host,
                "--blobPort",
                str(port),
                "--inMemoryPersistence",
                "--skipApiVersionCheck",
                "--disableTelemetry",
                "--silent",
            ],
            port=port,
            host=host,
        )

    @property
    def endpoint(self) -> str:
        """The account's blob endpoint (a backend's ``endpoint``)."""
        return f"{super().endpoint}/{ACCOUNT}"

    def create_container(self, name: str) -> None:
        """Create container ``name`` (a Create Container request, signed with the
        account's shared key)."""
        headers = {"x-ms-date": formatdate(usegmt=True), "x-ms-version": _API_VERSION}
        canonical_headers = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()))
        # Verb, then eleven standard headers (all empty here), then x-ms-*, then the
        # resource: the account, the path (which names the account again) and query.
        to_sign = (
            "PUT\n"
            + "\n" * 11
            + canonical_headers
            + f"/{ACCOUNT}/{ACCOUNT}/{name}\nrestype:container"
        )
        digest = hmac.new(base64.b64decode(ACCOUNT_KEY), to_sign.encode(), hashlib.sha256)
        signature = base64.b64encode(digest.digest()).decode()
        request = urllib.request.Request(
            f"{self.endpoint}/{name}?restype=container",
            headers={
                **headers,
                "Authorization": f"SharedKey {ACCOUNT}:{signature}",
                "Content-Length": "0",  # signed as "" (API versions since 2015)
            },
            method="PUT",
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            answer.read()
