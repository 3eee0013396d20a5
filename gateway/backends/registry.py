"""The configured backends by name (:class:`Backends`), and the kind each URL scheme is."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Final

import obstore.exceptions

from chunkd.errors import ConfigError, UnknownBackendError
from chunkd.gateway.backends.azure import AzureBackend
from chunkd.gateway.backends.damaged import DamagedChunks
from chunkd.gateway.backends.file import FileBackend
from chunkd.gateway.backends.gcs import GCSBackend
from chunkd.gateway.backends.memory import MemoryBackend
from chunkd.gateway.backends.resilience import Resilient
from chunkd.gateway.backends.s3 import S3Backend

if TYPE_CHECKING:
    from chunkd.gateway.backends.base import Backend
    from chunkd.gateway.backends.store import StoreBackend
    from chunkd.gateway.config import BackendConfig
    from chunkd.gateway.metrics import Metrics

__all__ = ["KINDS", "Backends", "make_backend"]

#: the backend class of each URL scheme
KINDS: Final[dict[str, type[StoreBackend]]] = {
    "s3": S3Backend,
    "gs": GCSBackend,
    "az": AzureBackend,
    "file": FileBackend,
    "memory": MemoryBackend,
}


def make_backend(config: BackendConfig, metrics: Metrics) -> Resilient:
    """The backend of ``config``'s kind (a file backend's directory is created), in
    the resilience wrapper (:class:`~chunkd.gateway.backends.resilience.Resilient`:
    retries, backoff and the circuit breaker around each of its requests).

    Raises:
        UnknownBackendError: no kind of backend has the URL's scheme.
        ConfigError: a key the kind does not take is set, or the store refuses its
            settings (an az:// backend without an account, say).
    """
    kind = KINDS.get(config.scheme)
    if kind is None:
        raise UnknownBackendError(
            f"backend {config.name!r} has an unsupported scheme {config.scheme!r}"
        )
    if kind is FileBackend:
        Path(config.prefix).mkdir(parents=True, exist_ok=True)
    try:
        inner = kind(config, metrics)
    except obstore.exceptions.BaseError as exc:  # the store refused its settings
        reason = str(exc).split("\n", 1)[0]
        raise ConfigError(
            f"backend {config.name!r} ({config.url}) cannot be set up: {reason}; check its "
            "endpoint and credentials keys (see the README's Backends section)"
        ) from None
    return Resilient.around(inner, metrics)


class Backends:
    """The configured backends by name: the only ones chunkd will reach."""

    def __init__(self, backends: Iterable[Backend]) -> None:
        self._by_name = {b.name: b for b in backends}
        #: the chunks this node read damaged from the backends' chunk stores, which the
        #: next save or freeze holding their bytes writes again (chunkd.gateway.chunkstore)
        self.damaged = DamagedChunks()

    @classmethod
    def from_config(cls, configs: Iterable[BackendConfig], metrics: Metrics) -> Backends:
        """Build every backend of the config (local directories are created)."""
        return cls(make_backend(config, metrics) for config in configs)

    def get(self, name: str) -> Backend:
        """The backend called ``name``.

        Raises:
            UnknownBackendError: no backend of that name is configured.
        """
        backend = self._by_name.get(name)
        if backend is None:
            known = ", ".join(sorted(self._by_name)) or "none"
            raise UnknownBackendError(
                f"no backend named {name!r} is configured (configured: {known})"
            )
        return backend

    def __iter__(self) -> Iterator[Backend]:
        return iter(self._by_name.values())

    async def close(self) -> None:
        """Close every backend."""
        for backend in self._by_name.values():
            await backend.close()
