"""The S3 front's access keys: ``[s3_front] keys_file`` and one key from the config.

The keys file holds one ``ACCESS_KEY_ID SECRET`` pair a line (blank lines and ``#``
comments allowed), like an htpasswd file, readable by the daemon's user only. It is
read again when it changes (looked at no more than once a second), so that a key is
added or revoked without a restart; a file that turns unreadable or malformed keeps
the keys last read, and says so in the log once per change.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Final

from chunkd.errors import ConfigError
from chunkd.gateway.config import S3FrontConfig, Secret

__all__ = ["AccessKeys"]

log = logging.getLogger("chunkd.gateway.s3front")

_LOOK_EVERY: Final = 1.0  # seconds between looks at the keys file
_ID: Final = re.compile(r"[A-Za-z0-9._+=@-]{3,128}")


class AccessKeys(Mapping[str, Secret]):
    """Access key id -> secret, for the SigV4 check. A read-only mapping whose lookups
    see the keys file as it is now (within a second).

    Raises (when made):
        ConfigError: the keys file cannot be read or is malformed, or there is no key
            at all and unsigned requests are not allowed.
    """

    def __init__(self, config: S3FrontConfig) -> None:
        self.config = config
        self._fixed: dict[str, Secret] = {}
        if config.access_key_id is not None and config.secret_access_key is not None:
            self._fixed[config.access_key_id] = config.secret_access_key
        self._from_file: dict[str, Secret] = {}
        self._stamp: tuple[int, int, int] | None = None
        self._looked = 0.0
        if config.keys_file is not None:
            self._from_file = _read(config.keys_file)
            self._stamp = _stamp(config.keys_file)
            self._looked = time.monotonic()
        if not self._fixed and not self._from_file and not config.unsigned_from_loopback:
            raise ConfigError(
                "[s3_front] has no access key: every request would be refused; set keys_file "
                "(or access_key_id and secret_access_key), or unsigned_from_loopback = true "
                "for this host's unsigned clients"
            )

    def _refresh(self) -> None:
        path = self.config.keys_file
        now = time.monotonic()
        if path is None or now - self._looked < _LOOK_EVERY:
            return
        self._looked = now
        try:
            stamp = _stamp(path)
        except OSError as exc:
            stamp = None
            problem = f"cannot read it ({exc.strerror or exc})"
        if stamp == self._stamp and stamp is not None:
            return
        if stamp is not None:
            try:
                self._from_file = _read(path)
            except ConfigError as exc:
                problem = str(exc)
            else:
                self._stamp = stamp
                log.info("[s3_front] keys file %s read again: %d keys", path, len(self._from_file))
                return
        if self._stamp is not None:  # said once per change, not per request
            log.warning("[s3_front] keys file %s: %s; the keys read before stay", path, problem)
        self._stamp = stamp

    def __getitem__(self, access_key: str) -> Secret:
        self._refresh()
        secret = self._fixed.get(access_key) or self._from_file.get(access_key)
        if secret is None:
            raise KeyError(access_key)
        return secret

    def __iter__(self) -> Iterator[str]:
        self._refresh()
        return iter({**self._from_file, **self._fixed})

    def __len__(self) -> int:
        self._refresh()
        return len({**self._from_file, **self._fixed})

    def __repr__(self) -> str:
        return f"AccessKeys({len(self)} keys)"


def _stamp(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _read(path: Path) -> dict[str, Secret]:
    """The keys of ``path``; raises ConfigError naming the line that is wrong (never
    its secret)."""
    try:
        text = path.read_text(encoding="utf-8")
        mode = os.stat(path).st_mode
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"[s3_front] keys_file {path}: cannot read it ({why})") from None
    if mode & 0o077:
        log.warning(
            "[s3_front] keys_file %s holds secrets but other users may read it (mode %04o); "
            "chmod 600 it, owned by the daemon's user",
            path,
            mode & 0o777,
        )
    keys: dict[str, Secret] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2 or not _ID.fullmatch(parts[0]) or len(parts[1]) < 8:
            raise ConfigError(
                f"[s3_front] keys_file {path} line {number}: write 'ACCESS_KEY_ID SECRET' "
                "(an id of 3-128 letters, digits or ._+=@-, a secret of 8 characters or more)"
            )
        keys[parts[0]] = Secret(parts[1])
    return keys
