"""The HTTP doors' side of attribution: the ``X-Chunkd-Job`` header (and, between
peers, ``X-Chunkd-Name``) read into an :class:`Attribution`, and written from the
current one for a request to a peer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from chunkd.client.protocol import check_job_name
from chunkd.errors import InvalidRequestError
from chunkd.gateway.costs.attribution import ATTRIBUTION, Attribution
from chunkd.gateway.costs.ledger import Ledger

__all__ = ["JOB_HEADER", "MAX_NAME_CHARS", "NAME_HEADER", "attribution_of", "headers_of"]

#: the job a request over HTTP is for (checked as a train_job; a bad one is a 400)
JOB_HEADER: Final = "X-Chunkd-Job"
#: between peers only: the dataset or checkpoint name the asking node's work is for
NAME_HEADER: Final = "X-Chunkd-Name"
#: the longest name a peer may state (a checkpoint's BACKEND/RUN; longer is a 400)
MAX_NAME_CHARS: Final = 1024


def attribution_of(
    headers: Mapping[str, str], ledger: Ledger | None, *, peer: bool = False
) -> Attribution:
    """The attribution a request with ``headers`` runs under (``peer``: a peer's
    request, whose ``X-Chunkd-Name`` is taken too).

    Raises:
        InvalidRequestError: ``X-Chunkd-Job`` is no job name, or ``X-Chunkd-Name`` is
            too long or holds control characters.
    """
    job = headers.get(JOB_HEADER)
    if job is not None:
        try:
            check_job_name(job)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"header {JOB_HEADER}: {exc}") from None
    name = headers.get(NAME_HEADER) if peer else None
    if name is not None and (not name or len(name) > MAX_NAME_CHARS or not name.isprintable()):
        raise InvalidRequestError(
            f"header {NAME_HEADER} is no dataset or checkpoint name: 1 to {MAX_NAME_CHARS} "
            "printable characters"
        )
    return Attribution(job, None, name, ledger, remote=peer)


def headers_of() -> dict[str, str]:
    """The headers that carry the current attribution to a peer (none for no job)."""
    at = ATTRIBUTION.get()
    headers = {}
    if at.job is not None:
        headers[JOB_HEADER] = at.job
    if at.name is not None and len(at.name) <= MAX_NAME_CHARS and at.name.isprintable():
        headers[NAME_HEADER] = at.name
    return headers
