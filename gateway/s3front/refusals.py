"""The refusals SigV2 and SigV4 answer alike, and the bounds on what they tell back.

S3 tells a client whose signature does not match what it signed (the
``StringToSign``, and SigV4's ``CanonicalRequest``) so that its author can see
where the two signers differ. Those texts are made of what the request sent, so a
request built to be huge would make a huge answer, and a long hash and a longer
XML document on the event loop every daemon request shares. The verifiers refuse
a text to sign longer than :data:`MAX_SIGNED_TEXT` unread, and every text told
back is :func:`capped`.
"""

from __future__ import annotations

from typing import Final

from chunkd.gateway.s3front.errors import S3Error, s3_error

__all__ = [
    "MAX_SHOWN",
    "MAX_SIGNED_TEXT",
    "capped",
    "check_signed_text",
    "invalid_token",
    "signature_mismatch",
]

#: the longest SigV4 canonical request or SigV2 StringToSign verified. A request the
#: S3 front's parser takes (a request line of 8,190 bytes, each byte of it at most three
#: once percent-encoded, and 8 KiB of headers) makes a shorter one.
MAX_SIGNED_TEXT: Final = 256 * 1024

#: the most characters of one text from the request told back in an error
MAX_SHOWN: Final = 2048

_MISMATCH: Final = (
    "The request signature we calculated does not match the signature you provided. "
    "Check your key and signing method."
)


def capped(text: str, most: int = MAX_SHOWN) -> str:
    """``text``, or its beginning and end with a marker of how much is left out
    between them when it is longer than ``most``.

    Both ends are kept: a signer's author compares the beginning (method, path)
    and the end (signed headers, payload hash) of a canonical request alike.
    """
    if len(text) <= most:
        return text
    tail = most // 4
    head = most - tail
    return f"{text[:head]}...[{len(text) - most} characters left out]...{text[-tail:]}"


def check_signed_text(text: str, what: str) -> None:
    """Refuse to verify a ``what`` (``canonical request``) longer than :data:`MAX_SIGNED_TEXT`.

    Raises:
        S3Error: ``InvalidRequest``.
    """
    if len(text) > MAX_SIGNED_TEXT:
        raise s3_error(
            "InvalidRequest",
            f"The request is too large to verify: its {what} is {len(text)} characters, "
            f"more than the {MAX_SIGNED_TEXT} this endpoint checks. Send a shorter path "
            "or query, or fewer or shorter x-amz-* headers.",
        )


def signature_mismatch(access_key: str, signature: str, **texts: str) -> S3Error:
    """S3's ``SignatureDoesNotMatch``, telling the texts signed (``StringToSign=``,
    ``CanonicalRequest=``) and the signature provided, each :func:`capped`; never
    the signature expected."""
    fields = {"AWSAccessKeyId": capped(access_key)}
    fields.update((name, capped(text)) for name, text in texts.items())
    fields["SignatureProvided"] = capped(signature)
    return s3_error("SignatureDoesNotMatch", _MISMATCH, fields=fields)


def invalid_token() -> S3Error:
    """The refusal of an ``x-amz-security-token``: this endpoint issues none."""
    return s3_error(
        "InvalidToken",
        "The provided token is malformed or otherwise invalid: this endpoint issues no "
        "session tokens; sign with an access key and secret alone.",
    )
