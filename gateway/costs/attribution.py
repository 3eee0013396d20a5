"""Who the work at hand is for: the job and the dataset or checkpoint name it is
accounted to, carried by a context variable from the door a request came in by down
to the backend request it causes.

Each door sets :data:`ATTRIBUTION` for the request it serves (the local socket from
its connection's ``hello`` and the request's fields, the HTTP routes from the
``X-Chunkd-Job`` header, the peer routes from the asking node's header); tasks started
while serving it (a single flight's fetch, a readahead) copy the context, so the job
whose read caused a backend fetch is the job that pays for it. Work the daemon does
for nobody (its own scrubs, GC, replica pushes) runs under the daemon's default:
no job (``none``).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from chunkd.gateway.costs.ledger import Ledger

__all__ = ["ATTRIBUTION", "Attribution", "account_name"]


@dataclass(frozen=True, slots=True)
class Attribution:
    """Who the work at hand is for.

    ``job`` is the client's claim (``train_job``; None: no job), for accounting, not
    security: ``uid`` is the caller's uid from the kernel (the local socket; None at
    the HTTP doors) recorded beside it. ``name`` is the dataset or checkpoint name the
    work is for (no version, no step; None: plain object reads). ``ledger`` is where
    costs go (None: counted nowhere, as in a bare read path built by a test).
    ``remote``: the work is a peer's request for the asking node's job, charged to that
    job's label here if it has one, else to ``other``: it never starts the job on this
    node (a remote job would take a slot of the top K from this node's own trainers).
    """

    job: str | None = None
    uid: int | None = None
    name: str | None = None
    ledger: Ledger | None = None
    remote: bool = False


#: the attribution of the work running now (each door sets it per request)
ATTRIBUTION: Final[ContextVar[Attribution]] = ContextVar(
    "chunkd_attribution",
    default=Attribution(),  # noqa: B039 (frozen: never changed, replaced)
)


def account_name(op: str, args: Mapping[str, Any]) -> str | None:
    """The dataset or checkpoint name a local-socket request is accounted to.

    A request's ``dataset`` field names its dataset (a version after ``@`` is
    dropped); a checkpoint op's ``name`` is ``BACKEND/RUN/STEP``, accounted to its
    run, ``BACKEND/RUN`` (a name of one key component, ``BACKEND/RUN``, stays whole);
    a dataset op's ``name`` is the dataset's. Anything else: None.
    """
    dataset = args.get("dataset")
    if isinstance(dataset, str) and dataset:
        return dataset.partition("@")[0]
    name = args.get("name")
    if not isinstance(name, str) or not name:
        return None
    if op.startswith("ckpt_"):
        backend, _, key = name.partition("/")
        run, slash, _ = key.rpartition("/")
        return f"{backend}/{run}" if slash else name
    if op.startswith("ds_"):
        return name.partition("@")[0]
    return None
