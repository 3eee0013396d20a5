"""The daemon's inspector API as ``chunkd inspect`` asks it: ``GET /v1/inspect/{op}``,
``/v1/list`` and the media route, over ``urllib`` (``docs/inspector.md``).

Answers are read up to :data:`MAX_ANSWER`; an error answer is :class:`Refused` (the
daemon's error kind and message), no usable answer :class:`Unreachable`.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    import ssl

__all__ = ["MAX_ANSWER", "InspectApi", "Refused", "Unreachable"]

#: the largest answer read from the daemon (its pages are at most 64 MiB)
MAX_ANSWER: Final = 80 << 20


class Unreachable(Exception):
    """No usable answer from the daemon."""


class Refused(Exception):
    """The daemon answered with an error."""

    def __init__(self, kind: str, message: str, status: int) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.status = status


@dataclass
class InspectApi:
    """``GET`` requests to the daemon's HTTP port."""

    url: str
    context: ssl.SSLContext | None = None
    token: str | None = None

    def op(self, op: str, **args: object) -> Any:
        """The result of inspector op ``op``; None-valued args are left out."""
        query = {k: _arg(v) for k, v in args.items() if v is not None}
        return json.loads(self.get(f"/v1/inspect/{op}", query))

    def listing(self, backend: str, prefix: str, **query: object) -> Any:
        """A page of ``/v1/list``."""
        path = f"/v1/list/{_quote(backend)}/{_quote(prefix)}"
        return json.loads(self.get(path, {k: _arg(v) for k, v in query.items() if v is not None}))

    def media(self, name: str, offset: int, length: int) -> bytes:
        """Bytes of an object's window, through the media route."""
        backend, _, key = name.partition("/")
        path = f"/v1/inspect/media/{_quote(backend)}/{_quote(key)}"
        return self.get(path, {"offset": str(offset), "length": str(length)})

    def get(self, path: str, query: dict[str, str]) -> bytes:
        """The body of ``GET path?query``, at most :data:`MAX_ANSWER` bytes.

        Raises:
            Refused: the daemon answered with an error.
            Unreachable: no usable answer.
        """
        url = self.url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(url, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=120, context=self.context) as response:
                body: bytes = response.read(MAX_ANSWER + 1)
        except urllib.error.HTTPError as exc:
            raise _refusal(exc) from None
        except (urllib.error.URLError, OSError) as exc:
            from chunkd.gateway.tls import unreachable

            raise Unreachable(unreachable(self.url, exc)) from None
        if len(body) > MAX_ANSWER:
            raise Unreachable(f"{path}: the answer is over {MAX_ANSWER >> 20} MiB; ask for less")
        return body


def _refusal(exc: urllib.error.HTTPError) -> Refused:
    try:
        body = json.loads(exc.read(1 << 20))
        return Refused(str(body["error"]), str(body["message"]), exc.code)
    except (ValueError, KeyError, TypeError, OSError):
        return Refused("HTTPError", f"the daemon answered {exc.code} {exc.reason}", exc.code)


def _arg(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _quote(text: str) -> str:
    return urllib.parse.quote(text, safe="/")
