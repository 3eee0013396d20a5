"""How a family of ops registers its handlers, and the table they make together.

A family (reads and listings, checkpoints, datasets, prefetch) is a module of the
package with one :class:`Family`; each handler is registered against an op name of
:data:`chunkd.client.protocol.OPS` with :meth:`Family.op`. The server builds its
dispatch table with :func:`handler_table` when it is imported: every op of ``OPS``
has exactly one handler, and every handler names an op, or the import fails saying
which op is wrong (a daemon that would answer an op of its own table
``unknown op`` never starts).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from chunkd.client.protocol import OPS

if TYPE_CHECKING:
    from chunkd.gateway.checkpoints import Checkpoints
    from chunkd.gateway.datasets import Datasets
    from chunkd.gateway.decoding import DecodeService
    from chunkd.gateway.jobs.table import JobTable
    from chunkd.gateway.listing import Listings
    from chunkd.gateway.localsock.answer import Answer
    from chunkd.gateway.metrics import Metrics
    from chunkd.gateway.prefetch import Prefetcher
    from chunkd.gateway.readpath import ReadPath

__all__ = ["Family", "Handler", "Parts", "handler_table"]


@dataclass(frozen=True, slots=True)
class Parts:
    """The parts of the daemon the socket's ops call: each handler asks these, and
    only through their public methods.

    ``checkpoints``, ``datasets`` and ``decoder`` are None where the daemon serves none
    (their ops then answer so); ``dataset_registry`` is ``[datasets] registry``
    (``BACKEND/PREFIX``), which ``ds_resolve`` names; ``jobs`` is the node's job table
    (None: reports are taken and dropped).
    """

    read_path: ReadPath
    listings: Listings
    prefetcher: Prefetcher
    metrics: Metrics
    checkpoints: Checkpoints | None = None
    datasets: Datasets | None = None
    decoder: DecodeService | None = None
    dataset_registry: str | None = None
    jobs: JobTable | None = None


#: one op's handler: the daemon's parts, the request's fields (checked against the
#: op table, defaults filled in) and the answer to fill; it returns the answer's header
Handler: TypeAlias = Callable[[Parts, Mapping[str, Any], "Answer"], Awaitable[dict[str, Any]]]


class Family:
    """The handlers of one family of ops, by op name.

    Args:
        name: the family's name, for the errors of a wrong table.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.handlers: dict[str, Handler] = {}

    def op(self, name: str) -> Callable[[Handler], Handler]:
        """Register the decorated function as the handler of op ``name``.

        Raises:
            TypeError: ``name`` is no op of :data:`~chunkd.client.protocol.OPS`, or
                this family has a handler for it already.
        """

        def register(handler: Handler) -> Handler:
            if name not in OPS:
                raise TypeError(
                    f"the {self.name} handler {handler.__name__} names op {name!r}, which "
                    "chunkd.client.protocol.OPS does not declare; add the op there first"
                )
            if name in self.handlers:
                raise TypeError(f"the {self.name} ops have two handlers for {name!r}")
            self.handlers[name] = handler
            return handler

        return register


def handler_table(*families: Family) -> Mapping[str, Handler]:
    """The handler of each op of :data:`~chunkd.client.protocol.OPS`, from ``families``.

    Raises:
        TypeError: an op has no handler, or more than one (across families).
    """
    table: dict[str, Handler] = {}
    owner: dict[str, str] = {}
    for family in families:
        for name, handler in family.handlers.items():
            if name in table:
                raise TypeError(
                    f"op {name!r} has a handler among the {owner[name]} ops and among the "
                    f"{family.name} ops; an op has one"
                )
            table[name] = handler
            owner[name] = family.name
    missing = [name for name in OPS if name not in table]
    if missing:
        raise TypeError(
            f"no handler for op {', '.join(missing)} of chunkd.client.protocol.OPS; "
            "register one in its family's module (chunkd.gateway.localsock)"
        )
    return {name: table[name] for name in OPS}
