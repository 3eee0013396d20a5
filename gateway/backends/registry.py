"""The configured backends by name (:class:`Backends`), and the class of each kind.

The kinds declare themselves in :mod:`chunkd.gateway.config.kinds` (scheme, keys,
URL rules and the dotted path of the class that does their I/O); this registry
imports a kind's class the first time a backend of it is made, and wraps every
backend in :class:`~chunkd.gateway.backends.resilience.Resilient`.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Final

import obstore.exceptions

from chunkd.errors import ConfigError, UnknownBackendError
from chunkd.gateway.backends.resilience import Resilient
from chunkd.gateway.config.kinds import kind_of, schemes
from chunkd.gateway.damaged import DamagedChunks

if TYPE_CHECKING:
    from chunkd.gateway.backends.base import Backend
    from chunkd.gateway.config import BackendConfig
    from chunkd.gateway.metrics import Metrics

__all__ = ["KINDS", "Backends", "make_backend"]


#: a kind's class: built from its entry and the node's metrics
BackendClass = Callable[["BackendConfig", "Metrics"], "Backend"]


class _Kinds(Mapping[str, BackendClass]):
    """The backend class of each URL scheme, imported from its kind's declaration when
    first asked for."""

    def __init__(self) -> None:
        self._imported: dict[str, BackendClass] = {}

    def __getitem__(self, scheme: str) -> BackendClass:
        found = self._imported.get(scheme)
        if found is None:
            kind = kind_of(scheme)
            if kind is None:
                raise KeyError(scheme)
            module, _, name = kind.io.partition(":")
            found = self._imported[scheme] = getattr(importlib.import_module(module), name)
        return found

    def __iter__(self) -> Iterator[str]:
        return iter(schemes())

    def __len__(self) -> int:
        return len(schemes())


#: the backend class of each URL scheme
KINDS: Final[Mapping[str, BackendClass]] = _Kinds()


def make_backend(config: BackendConfig, metrics: Metrics) -> Resilient:
    """The backend of ``config``'s kind (a file backend's directory is created), in
    the resilience wrapper (:class:`~chunkd.gateway.backends.resilience.Resilient`:
    retries, backoff and the circuit breaker around each of its requests).

    Raises:
        UnknownBackendError: no kind of backend has the URL's scheme.
        ConfigError: a key the kind does not take is set (its declaration says which
            it takes), or the store refuses its settings (an az:// backend without an
            account, say).
    """
    try:
        kind = KINDS[config.scheme]
    except KeyError:
        raise UnknownBackendError(
            f"backend {config.name!r} has an unsupported scheme {config.scheme!r}"
        ) from None
    config.kind.refuse_others(
        {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}, config.name
    )
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
