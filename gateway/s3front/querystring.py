"""How the S3 front reads a query string: the one reading its verifiers sign with.

Each ``&``-separated parameter is a name, and a value after its first ``=``; both
are percent-decoded after a ``+`` is made a space, as S3 reads a query and as
object_store (obstore, polars) sends a space. An escape that is not UTF-8
decodes to U+FFFD. Repeated parameters are all kept, in the order sent, and an
empty one (``a&&b``) is none.

What a door serves from the query must be read this way (:func:`decoded_query`),
so that a parameter it acts on is the one that was signed.
"""

from __future__ import annotations

from typing import NamedTuple
from urllib.parse import unquote

__all__ = ["QueryParameter", "decode", "decoded_query", "parse_query"]


class QueryParameter(NamedTuple):
    """One parameter of a query string.

    Attributes:
        name: the name, decoded.
        raw_name: the name as sent.
        raw_value: the value as sent ('' when there is none).
        has_value: whether an ``=`` follows the name (``?acl`` has none,
            ``?versionId=`` an empty one).
    """

    name: str
    raw_name: str
    raw_value: str
    has_value: bool

    @property
    def value(self) -> str:
        """The value, decoded."""
        return decode(self.raw_value)


def parse_query(raw_query: str) -> list[QueryParameter]:
    """Each parameter of ``raw_query`` (the text after ``?``), in the order sent."""
    parameters = []
    for pair in raw_query.split("&"):
        if pair:
            raw_name, equals, raw_value = pair.partition("=")
            parameters.append(QueryParameter(decode(raw_name), raw_name, raw_value, bool(equals)))
    return parameters


def decoded_query(raw_query: str) -> list[tuple[str, str]]:
    """(name, value) of each parameter of ``raw_query``, decoded, in the order sent."""
    return [(parameter.name, parameter.value) for parameter in parse_query(raw_query)]


def decode(raw: str) -> str:
    """A name or value as sent, decoded: ``+`` a space, then percent-decoded."""
    return unquote(raw.replace("+", " "))
