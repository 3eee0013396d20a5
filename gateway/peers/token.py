"""The peer token: the cluster's shared secret, read from ``token_file`` and checked
on every peer request (constant time)."""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
from pathlib import Path

from chunkd.errors import ConfigError

__all__ = ["authorized", "read_token"]

log = logging.getLogger("chunkd.gateway.peers")


def authorized(token: str, header: str | None) -> bool:
    """Whether an ``Authorization`` header carries ``token`` (constant time)."""
    wanted = f"Bearer {token}".encode()
    return hmac.compare_digest((header or "").encode("utf-8", "surrogateescape"), wanted)


def read_token(path: Path | None) -> str:
    """The token in ``path`` (``[peers] token_file``), stripped.

    Raises:
        ConfigError: no ``token_file``, it cannot be read, or it holds under 16
            characters.
    """
    if path is None:
        raise ConfigError("[peers] needs token_file")
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"[peers] token_file {path} cannot be read ({exc.strerror or exc}); create it "
            "with the cluster's shared secret"
        ) from exc
    if len(token) < 16:
        raise ConfigError(
            f"[peers] token_file {path} holds under 16 characters; use a longer secret"
        )
    with contextlib.suppress(OSError):
        if os.stat(path).st_mode & 0o066:  # read or write by group or others; x is moot
            log.warning(
                "peers: token_file %s may be read or written by its group or others; chmod 600 it",
                path,
            )
    return token
