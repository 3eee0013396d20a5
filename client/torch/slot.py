"""The :class:`~chunkd.client.Client` of one process, made on first use from a factory.

A forked DataLoader worker reuses the client its parent made; a pickled dataset
carries only the factory (see "Clients and processes" in :mod:`chunkd.client.torch`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

from chunkd.client.core import Client

__all__ = ["ClientFactory", "ClientSlot"]

#: makes a process's client; must pickle under the ``spawn`` start method
ClientFactory = Callable[[], Client]


class ClientSlot:
    """The Client of one process, made on first use; pickles as its factory only."""

    def __init__(self, client: Client | ClientFactory | None) -> None:
        self._client: Client | None = None
        if isinstance(client, Client):
            self._client = client
            self._factory: ClientFactory = functools.partial(
                Client, client.socket_path, timeout=client.timeout
            )
        elif client is None:
            self._factory = Client
        elif callable(client):
            self._factory = client
        else:
            raise TypeError(f"client must be a Client, a factory of one, or None; got {client!r}")

    def get(self) -> Client:
        if self._client is None:
            self._client = self._factory()
            # A client made here is this slot's: it closes when the dataset goes.
            weakref.finalize(self, self._client.close)
        return self._client

    def __getstate__(self) -> dict[str, Any]:
        return {"_client": None, "_factory": self._factory}
