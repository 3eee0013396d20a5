"""``chunkd doctor``: check a node against what docs/deploy.md recommends, and say what to change.

Each check gives a status (``ok``, ``warn`` or ``error``), one line of what it found,
and the fix (empty when there is nothing to do):

* ``config``: the configuration loads (as ``chunkd serve`` would read it).
* ``shmem_enabled``: shared memory may use transparent huge pages (``advise``), which
  checkpoint staging and warm views are fast with.
* ``open_files``: the open-files limit holds the RAM tier's chunks (each is an open
  memfd; the cache keeps at most three quarters of the limit as chunks).
* ``socket``: the local socket's mode, owner and group, and who may connect.
* ``cache_disk``: free space on the cache's filesystem against the disk tier's budget.
* ``o_direct``: whether that filesystem takes ``O_DIRECT`` (the disk tier writes
  chunks with it, without a page-cache copy).
* ``backend:NAME``: each backend answers a one-object listing with its credentials.
* ``clock:NAME``: this node's clock against each HTTP(S) backend's ``Date`` header
  (SigV4 refuses a request more than 15 minutes off).
* ``peer:HOST:PORT``: each peer answers a peer route with the token (and, with
  ``[peers]`` TLS, this node's certificate).

It only reads: it creates nothing (not the embedded default's data directory, not a
cache), writes no file (sysfs least of all: its fixes say what to run), and takes no
lock. Every request is bounded (a few seconds) and asks for nothing to be fetched: a
backend listing of one object, an unsigned ``HEAD`` for the clock, a peer's
``held=1`` page request that the peer answers from its memory (404) or refuses (401).
Exit status: 0 with no error (warnings allowed), 1 with one, 2 on bad usage.

It is one job at ~970 lines: checking one node against ``docs/deploy.md``, a check for
each of its recommendations in the order above. Each check is a function from the
config (and sysfs, procfs or the network) to one :class:`Check` in one voice (what it
found, and the fix), and none calls another; most lines are those findings and fixes.
Splitting them by where they look (this node, the network) would split one list that
the page, the ``--json`` document and ``tests/test_doctor.py`` read as one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import email.utils
import errno
import grp
import json
import os
import pwd
import stat
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, TextIO

from chunkd.gateway.cli.options import human_size

if TYPE_CHECKING:
    import ssl

    from chunkd.gateway.config import BackendConfig, Config, PeersConfig

__all__ = ["Check", "add_parser", "doctor", "run"]

OK: Final = "ok"
WARN: Final = "warn"
ERROR: Final = "error"

#: the most one network check (a backend listing, a clock probe, a peer) may take
_NETWORK_TIMEOUT: Final = 5.0
#: peers probed at once, and the most probed in one run
_PEERS_AT_ONCE: Final = 32
_MAX_PEERS: Final = 1024
#: files looked at under chunks/ to sum what the disk tier holds, and to find a file
#: to try O_DIRECT on; past it the held bytes are a lower bound
_MAX_FILES_WALKED: Final = 200_000
#: SigV4 (and the S3 front, max_skew) refuse a request more than this off
_SIGV4_SKEW: Final = 900.0
#: a skew above this is worth fixing before it grows
_SKEW_WARN: Final = 60.0
_THP: Final = "kernel/mm/transparent_hugepage"
_HUGE_MODES: Final = frozenset({"always", "within_size", "advise", "force"})
_DEPLOY: Final = "docs/deploy.md"
_ZERO_PAGE: Final = "0" * 64


@dataclass(frozen=True)
class Check:
    """One check's outcome."""

    #: what was checked: "shmem_enabled", "backend:data", "peer:10.0.0.8:8470"
    name: str
    #: "ok", "warn" or "error"
    status: str
    #: what it found, one line
    finding: str
    #: what to change; empty when there is nothing to do
    fix: str = ""


# -- huge pages ----------------------------------------------------------------------


def _selected(path: Path) -> str | None:
    """The bracketed choice of a THP sysfs file (``always [advise] never``); None when
    the file is missing or holds no choice."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end].strip() if 0 <= start < end else None


def check_huge_pages(sysfs: Path) -> Check:
    """``shmem_enabled``: whether shared memory may use 2 MiB pages (as cache/ram.py
    reads it: the per-size setting, where it is not ``inherit``, over the global one)."""
    name = "shmem_enabled"
    shared = sysfs / _THP / "shmem_enabled"
    per_size = sysfs / _THP / "hugepages-2048kB" / "shmem_enabled"
    mode, path = _selected(per_size), per_size
    if mode is None or mode == "inherit":
        mode, path = _selected(shared), shared
    if mode is None:
        return Check(
            name,
            WARN,
            f"cannot tell whether shared memory may use huge pages: {shared} is missing or "
            "holds no [choice] (a kernel without transparent huge pages, or no sysfs)",
            "run chunkd on a kernel with transparent huge pages (CONFIG_TRANSPARENT_HUGEPAGE) "
            f"and set shmem_enabled to advise ({_DEPLOY}, Huge pages for shared memory)",
        )
    real = Path("/sys") / path.relative_to(sysfs)
    if mode in _HUGE_MODES:
        return Check(
            name,
            OK,
            f"{real} is {mode}: the RAM tier's chunks of 2 MiB or more and checkpoint "
            "staging get huge pages",
        )
    return Check(
        name,
        WARN,
        f"{real} is {mode}: shared memory gets 4 KiB pages only, so async_save blocks the "
        "trainer about 3x longer (16.9x less than torch.save with huge pages, 5.4x "
        "without) and a warm 96 MiB view takes about 8 ms instead of 0.5",
        f"as root, now: echo advise > {real}; and at every boot, a tmpfiles.d line "
        f"'w {real} - - - - advise' (or your node image) ({_DEPLOY}, Huge pages for "
        "shared memory)",
    )


# -- open files -----------------------------------------------------------------------


def _nofile(limits: Path) -> tuple[int | None, int | None] | None:
    """(soft, hard) of "Max open files" in a ``/proc/PID/limits`` file (None for
    unlimited); None when the file cannot be read."""
    try:
        text = limits.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Max open files"):
            fields = line[len("Max open files") :].split()
            if len(fields) >= 2:
                values = [None if f == "unlimited" else int(f) for f in fields[:2]]
                return values[0], values[1]
    return None


def _daemon_pid(cache_dir: Path, procfs: Path) -> str | None:
    """The pid a daemon wrote into its cache's ``LOCK``, where that process is alive;
    read without taking the lock (a lock, even shared and brief, could make a daemon
    starting at that moment refuse the cache)."""
    try:
        text = (cache_dir / "LOCK").read_bytes()[:32].decode(errors="replace").strip()
    except OSError:
        return None
    return text if text.isdecimal() and (procfs / text).is_dir() else None


def check_open_files(config: Config, procfs: Path) -> Check:
    """``open_files``: the limit against the chunks ``ram_bytes`` holds."""
    name = "open_files"
    chunks = max(1, config.cache.ram_bytes // config.cache.chunk_bytes)
    pid = _daemon_pid(config.cache.dir, procfs)
    limit: int | None
    if pid is not None and (found := _nofile(procfs / pid / "limits")) is not None:
        limit, whose = found[0], f"the running daemon's (pid {pid})"
    else:
        found = _nofile(procfs / "self" / "limits")
        if found is None:
            import resource

            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            found = (
                None if soft == resource.RLIM_INFINITY else soft,
                None if hard == resource.RLIM_INFINITY else hard,
            )
        # chunkd serve raises its soft limit to the hard one.
        limit, whose = (
            found[1],
            "this shell's hard limit, which chunkd serve raises its soft one to",
        )
    if limit is None:
        return Check(name, OK, f"the open-files limit is unlimited ({whose})")
    budget = max(64, limit * 3 // 4)
    needed = -(-chunks * 4 // 3)
    size = human_size(config.cache.chunk_bytes)
    if budget >= chunks:
        return Check(
            name,
            OK,
            f"the open-files limit is {limit}, {whose}: the RAM tier may hold {budget} "
            f"chunks, and ram_bytes ({human_size(config.cache.ram_bytes)}) holds {chunks} of "
            f"{size} (smaller objects take an fd each too)",
        )
    return Check(
        name,
        WARN,
        f"the open-files limit is {limit}, {whose}: the RAM tier may hold {budget} chunks "
        f"(three quarters of it), fewer than the {chunks} of {size} ram_bytes "
        f"({human_size(config.cache.ram_bytes)}) holds, so it evicts at "
        f"{human_size(budget * config.cache.chunk_bytes)} or less",
        f"raise the open-files limit to {needed} or more: LimitNOFILE=1048576 under systemd "
        f"(systemd/chunkd.service sets it), ulimit -n {needed} in a shell; in a container, "
        f"the runtime's limit ({_DEPLOY}, Open files)",
    )


# -- the local socket -----------------------------------------------------------------


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _may_connect(user: pwd.struct_passwd, st: os.stat_result) -> bool:
    """Whether ``user`` may connect to a socket of ``st`` (connecting wants write)."""
    if user.pw_uid == 0 or user.pw_uid == st.st_uid:
        return bool(st.st_mode & stat.S_IWUSR) or user.pw_uid == 0
    groups = {user.pw_gid} | {g.gr_gid for g in grp.getgrall() if user.pw_name in g.gr_mem}
    if st.st_gid in groups:
        return bool(st.st_mode & stat.S_IWGRP)
    return bool(st.st_mode & stat.S_IWOTH)


def _group_members(gid: int) -> list[str]:
    members = set()
    with contextlib.suppress(KeyError):
        members.update(grp.getgrgid(gid).gr_mem)
    members.update(p.pw_name for p in pwd.getpwall() if p.pw_gid == gid)
    return sorted(members)


def check_socket(config: Config, readers: Iterable[str]) -> Check:
    """``socket``: the local socket's mode and group against who will connect."""
    name = "socket"
    server = config.server
    path = server.socket
    wanted = f"{server.socket_mode:04o}"
    group_fix = (
        'socket_mode = "0660" and put the readers in the socket\'s group (usermod -aG GROUP '
        'USER), or set socket_group = "GROUP" to a group they share '
        f"({_DEPLOY}, Several users' jobs on one node)"
    )
    if server.socket_group is not None and not server.socket_group.isdecimal():
        try:
            grp.getgrnam(server.socket_group)
        except KeyError:
            return Check(
                name,
                ERROR,
                f"server.socket_group {server.socket_group!r} is not a group on this host: "
                "the daemon cannot start",
                "name a group that exists (getent group), or give its numeric GID",
            )
    try:
        st = os.stat(path)
    except FileNotFoundError:
        who = "owner and group" if server.socket_mode & 0o060 else "owner only"
        group = server.socket_group or "the daemon user's own"
        return Check(
            name,
            WARN if not server.socket_mode & 0o020 else OK,
            f"no socket at {path} (no daemon runs with this config); it will get mode "
            f"{wanted} ({who}), group {group}",
            "" if server.socket_mode & 0o020 else group_fix,
        )
    except OSError as exc:
        return Check(
            name,
            WARN,
            f"cannot look at {path} ({exc.strerror or exc}): it is in a directory this user "
            "cannot enter",
            "run chunkd doctor as the daemon's user or as root",
        )
    if not stat.S_ISSOCK(st.st_mode):
        return Check(
            name,
            ERROR,
            f"{path} is not a socket: the daemon refuses to start over it",
            "remove it, or move server.socket",
        )
    mode = stat.S_IMODE(st.st_mode)
    owner, group = _user(st.st_uid), _group(st.st_gid)
    problems, fixes = [], []
    if mode & 0o002:
        problems.append("every user of the node may connect, and read every backend through it")
        fixes.append('socket_mode = "0660" (restart the daemon)')
    elif not mode & 0o020:
        also = "" if st.st_uid == 0 else " (and root)"
        problems.append(f"only {owner}{also} may connect: the group {group} may not")
        fixes.append(group_fix)
    if f"{mode:04o}" != wanted:
        problems.append(f"the config gives {wanted}")
        fixes.append(
            f"restart the daemon with this config (it gives the socket mode {wanted}), or "
            "set socket_mode to the mode wanted"
        )
    refused = []
    for reader in readers:
        try:
            user = pwd.getpwnam(reader)
        except KeyError:
            problems.append(f"--reader {reader} is no user of this host")
            fixes.append("give --reader a user of this host (getent passwd USER)")
            continue
        if not _may_connect(user, st):
            refused.append(reader)
    if refused:
        problems.append(f"{', '.join(refused)} may not connect")
        if group_fix not in fixes:
            fixes.append(f"usermod -aG {group} USER for each, or {group_fix}")
    parent = path.parent
    with contextlib.suppress(OSError):
        pst = os.stat(parent)
        enters = pst.st_mode & (stat.S_IXGRP if pst.st_gid == st.st_gid else stat.S_IXOTH)
        # Connecting to a socket takes write permission on it: only where the group or
        # others may connect does the directory's search bit matter to them.
        if not enters and mode & 0o022:
            problems.append(
                f"its directory {parent} (mode {stat.S_IMODE(pst.st_mode):04o}) lets only its "
                "owner through"
            )
            fixes.append(f"chmod g+x {parent} (RuntimeDirectoryMode=0750, or 0751 for others)")
    members = _group_members(st.st_gid)
    can = (
        f"{owner}, and group {group} ({', '.join(members[:8]) or 'no members'}"
        f"{', ...' if len(members) > 8 else ''})"
        if mode & 0o020
        else owner
    )
    finding = f"{path}: mode {mode:04o}, owner {owner}, group {group}; may connect: {can}"
    if problems:
        return Check(name, WARN, f"{finding}; " + "; ".join(problems), "; ".join(fixes))
    return Check(name, OK, finding)


# -- the cache disk -------------------------------------------------------------------


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _walk_files(root: Path, limit: int) -> Iterable[Path]:
    """Regular files under ``root``, at most ``limit`` of them, without following links."""
    seen = 0
    for top, _, files in os.walk(root):
        for file in files:
            if seen >= limit:
                return
            seen += 1
            yield Path(top) / file


def check_cache_disk(config: Config) -> Check:
    """``cache_disk``: the free space of the cache's filesystem against the budget."""
    name = "cache_disk"
    cache = config.cache
    where = _existing(cache.dir)
    try:
        fs = os.statvfs(where)
    except OSError as exc:
        return Check(
            name, WARN, f"cannot look at {where} ({exc.strerror or exc})", "run it as root"
        )
    free, total = fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize
    held, counted = 0, 0
    for file in _walk_files(cache.dir / "chunks", _MAX_FILES_WALKED):
        with contextlib.suppress(OSError):
            held += file.lstat().st_blocks * 512
            counted += 1
    room = free + held - cache.disk_min_free_bytes
    budget = human_size(cache.disk_bytes)
    state = "" if cache.dir.exists() else " (not made yet: the daemon makes it)"
    finding = (
        f"{cache.dir}{state}: {human_size(free)} free of {human_size(total)}, the disk tier "
        f"holds {human_size(held)} ({counted} files) of its disk_bytes {budget}, and leaves "
        f"disk_min_free_bytes {human_size(cache.disk_min_free_bytes)} free"
    )
    fix = (
        f"give cache.dir a larger local NVMe filesystem, or lower disk_bytes to "
        f"{human_size(max(0, room))} or less ({_DEPLOY})"
    )
    if free < cache.disk_min_free_bytes:
        return Check(name, WARN, f"{finding}: under the floor, it stores nothing new", fix)
    if room < cache.disk_bytes:
        return Check(name, WARN, f"{finding}: it can grow to {human_size(max(0, room))} only", fix)
    return Check(name, OK, finding)


def check_o_direct(config: Config) -> Check:
    """``o_direct``: open a file already in the cache directory read-only with
    ``O_DIRECT`` (a probe file would be a write)."""
    name = "o_direct"
    root = config.cache.dir
    candidates = [root / "LOCK", root / "index" / "data.mdb"]
    candidates += _walk_files(root / "chunks", 64)
    for path in candidates:
        try:
            if not stat.S_ISREG(path.lstat().st_mode):
                continue
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        except PermissionError:
            return Check(
                name,
                WARN,
                f"cannot tell: {path} is not readable by this user",
                "run chunkd doctor as the daemon's user or as root",
            )
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                continue
            return Check(
                name,
                WARN,
                f"the filesystem of {root} refuses O_DIRECT (tmpfs, some FUSE or network "
                "filesystems): chunks go through the page cache, a second copy of each, and "
                "cold reads through the daemon ran 1.4x slower that way",
                "put cache.dir on a local NVMe filesystem (ext4, xfs)",
            )
        os.close(fd)
        return Check(
            name,
            OK,
            f"the filesystem of {root} takes O_DIRECT ({path.name} opened with it, read-only): "
            "the disk tier writes chunks without a page-cache copy",
        )
    return Check(
        name,
        WARN,
        f"cannot tell: {root} holds no file yet to open with O_DIRECT (doctor never writes one)",
        "run chunkd doctor again once the daemon has run with this config",
    )


# -- backends, their clocks and peers --------------------------------------------------


async def check_backend(config: BackendConfig) -> Check:
    """``backend:NAME``: a listing of one object, with the backend's credentials."""
    name = f"backend:{config.name}"
    if config.scheme == "memory":
        return Check(name, OK, f"{config.url}: in the daemon's memory, nothing to reach")
    if config.scheme == "file":
        return _check_directory(name, config)
    from chunkd.errors import BackendForbiddenError, BucketNotFoundError, ChunkdError
    from chunkd.gateway.backends.registry import KINDS
    from chunkd.gateway.metrics import Metrics

    bounded = dataclasses.replace(config, timeout=min(config.timeout, _NETWORK_TIMEOUT), retries=0)
    variable = f"CHUNKD_BACKENDS_{config.name.upper().replace('-', '_')}"
    keys = f"{variable}_ACCESS_KEY_ID and {variable}_SECRET_ACCESS_KEY"
    start = time.monotonic()
    try:
        backend = KINDS[config.scheme](bounded, Metrics())
    except (ChunkdError, KeyError) as exc:
        return Check(name, ERROR, f"{config.url} cannot be set up: {exc}", "fix its keys")
    try:
        async with asyncio.timeout(_NETWORK_TIMEOUT + 1):
            if not backend.supports_list:  # https://: a HEAD of a key no file has (a 404)
                await backend.head(".chunkd-doctor-probe")
                return Check(name, OK, f"{config.url}: answers (read-only, not listed)")
            listing = backend.scan("", batch=1)
            try:
                first = await anext(listing, None)
            finally:
                await listing.aclose()
    except BucketNotFoundError as exc:
        return Check(
            name, ERROR, f"{config.url}: {exc}", "create the bucket, or fix the url's bucket"
        )
    except (ChunkdError, TimeoutError, OSError) as exc:
        if not isinstance(exc, BackendForbiddenError) and not _refused(str(exc)):
            what = "no answer within 5 s" if isinstance(exc, TimeoutError) else str(exc)[:300]
            return Check(
                name,
                ERROR,
                f"{config.url} is unreachable ({config.endpoint or 'the provider endpoint'}): "
                f"{what}",
                "check the endpoint, the network and the firewall from this node",
            )
        return Check(
            name,
            ERROR,
            f"{config.url} refused this node's credentials: {str(exc)[:300]}",
            f"check access_key_id and secret_access_key ({keys}), or the machine's role, "
            "and that they may list the bucket",
        )
    finally:
        await backend.close()
    took = 1e3 * (time.monotonic() - start)
    return Check(
        name,
        OK,
        f"{config.url} listed with its credentials in {took:.0f} ms "
        f"({'an object' if first else 'no object'} under its prefix)",
    )


def _refused(message: str) -> bool:
    """Whether a store's error says it refused the credentials: a listing's 401 or 403
    comes back from obstore as a generic error, its status in the text."""
    return any(code in message for code in (" 401 Unauthorized", " 403 Forbidden"))


def _check_directory(name: str, config: BackendConfig) -> Check:
    root = Path(config.prefix)
    if not root.exists():
        return Check(
            name,
            WARN,
            f"{config.url}: {root} does not exist (chunkd serve creates it, empty)",
            f"mkdir -p {root}, or fix the url"
            if not config.writable
            else f"nothing, if an empty {root} is what it should serve: chunkd serve creates "
            "it; else fix the url",
        )
    if not root.is_dir():
        return Check(
            name, ERROR, f"{config.url}: {root} is not a directory", "fix the url, or move it"
        )
    wants = os.R_OK | os.X_OK | (os.W_OK if config.writable else 0)
    if not os.access(root, wants):
        need = "read and write" if config.writable else "read"
        return Check(
            name,
            WARN,
            f"{config.url}: this user ({_user(os.getuid())}) may not {need} {root}",
            f"give the daemon's user {need} access to {root} (or run doctor as that user)",
        )
    return Check(name, OK, f"{config.url}: a readable{' and writable' * config.writable} directory")


def _clock_url(config: BackendConfig) -> str | None:
    """Where a backend's ``Date`` header comes from: its endpoint, or its provider's."""
    if config.endpoint:
        # Path style, as the backend asks: an unsigned HEAD of the bucket.
        bucket = config.bucket if config.scheme == "s3" else ""
        return f"{config.endpoint.rstrip('/')}/{bucket or ''}"
    if config.scheme == "s3":
        return (
            f"https://s3.{config.region}.amazonaws.com/"
            if config.region
            else "https://s3.amazonaws.com/"
        )
    if config.scheme == "gs":
        return "https://storage.googleapis.com/"
    if config.scheme == "az" and config.access_key_id:
        return f"https://{config.access_key_id}.blob.core.windows.net/"
    return None


async def check_clock(config: BackendConfig) -> Check | None:
    """``clock:NAME``: this node's clock against the backend's ``Date``; None for a
    backend without HTTP (file, memory)."""
    import aiohttp

    url = _clock_url(config)
    if url is None:
        return None
    name = f"clock:{config.name}"
    timeout = aiohttp.ClientTimeout(total=_NETWORK_TIMEOUT)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            before = time.time()
            # Unsigned: no credential leaves the node; any status carries a Date.
            async with session.head(url, allow_redirects=False) as response:
                after = time.time()
                date = response.headers.get("Date")
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return Check(
            name,
            WARN,
            f"cannot tell: {url} did not answer ({type(exc).__name__}: {exc})",
            f"see backend:{config.name}",
        )
    fix = (
        "check that the endpoint is the backend's (a proxy or load balancer in between may "
        "drop or rewrite Date), and keep this node's clock synced: timedatectl set-ntp true"
    )
    if not date:
        return Check(name, WARN, f"cannot tell: {url} sent no Date header", fix)
    try:
        when = email.utils.parsedate_to_datetime(date)
    except (TypeError, ValueError):
        return Check(
            name,
            WARN,
            f"cannot tell: the backend's Date header is unreadable ({url} sent {date[:80]!r})",
            fix,
        )
    if when.tzinfo is None:  # "-0000": UTC with no zone said (RFC 5322), never local time
        when = when.replace(tzinfo=datetime.UTC)
    parsed = when.timestamp()
    # The Date is whole seconds, sent between our two readings.
    skew = parsed + 0.5 - (before + after) / 2
    margin = 0.5 + (after - before) / 2
    found = (
        f"this node's clock is {abs(skew):.1f} s {'behind' if skew > 0 else 'ahead of'} "
        f"{url}'s Date (within {margin:.1f} s)"
    )
    fix = (
        "sync the clock: timedatectl set-ntp true, or chronyc makestep where chrony "
        "runs (SigV4 refuses a request more than 15 minutes off)"
    )
    if abs(skew) - margin > _SIGV4_SKEW:
        return Check(name, ERROR, f"{found}: SigV4 refuses every request past 15 minutes", fix)
    if abs(skew) - margin > _SKEW_WARN:
        return Check(name, WARN, f"{found}: SigV4 refuses requests past 15 minutes", fix)
    return Check(name, OK, found)


async def _resolve(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to, within the network bound.

    The lookup runs in a daemon thread of its own: a resolver that hangs past the
    bound is left behind, where the loop's executor would be waited for at exit.
    """
    import socket
    import threading

    loop = asyncio.get_running_loop()
    answer: asyncio.Future[list[str]] = loop.create_future()

    def settle(result: list[str] | None, error: OSError | None) -> None:
        if answer.done():
            return
        if error is not None:
            answer.set_exception(error)
        else:
            answer.set_result(result or [])

    def look_up() -> None:
        try:
            infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
            found: tuple[list[str] | None, OSError | None] = ([str(i[4][0]) for i in infos], None)
        except OSError as exc:
            found = (None, exc)
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
            loop.call_soon_threadsafe(settle, *found)

    threading.Thread(target=look_up, name="chunkd-doctor-dns", daemon=True).start()
    async with asyncio.timeout(_NETWORK_TIMEOUT):
        return await answer


async def _members(peers: PeersConfig) -> tuple[list[str], list[Check]]:
    """The members of ``[peers]`` (but self): the list, the file and the DNS name."""
    members = list(peers.members)
    problems = []
    if peers.members_file is not None:
        try:
            text = await asyncio.to_thread(Path(peers.members_file).read_text)
        except OSError as exc:
            problems.append(
                Check(
                    "peers",
                    ERROR,
                    f"[peers] members_file {peers.members_file} cannot be read "
                    f"({exc.strerror or exc})",
                    "write it (one HOST:PORT a line), or drop members_file",
                )
            )
        else:
            members += [line.split("#", 1)[0].strip() for line in text.splitlines()]
    if peers.dns is not None:
        host, _, port = peers.dns.rpartition(":")
        try:
            addresses = await _resolve(host.strip("[]"), int(port))
        except (OSError, TimeoutError) as exc:
            problems.append(
                Check(
                    "peers",
                    ERROR,
                    f"[peers] dns {peers.dns} does not resolve ({exc or 'no answer within 5 s'})",
                    "check the name (a headless Service's) and the resolver",
                )
            )
        else:
            for address in addresses:
                members.append(f"[{address}]:{port}" if ":" in address else f"{address}:{port}")
    unique = list(dict.fromkeys(m for m in members if m and m != peers.address))
    return unique, problems


async def check_peers(config: Config) -> list[Check]:
    """``peer:ADDRESS`` for each member: a peer route asked with the token."""
    peers = config.peers
    if not peers.enabled:
        return [Check("peers", OK, "no [peers] self: this node is on its own")]
    from chunkd.errors import ConfigError
    from chunkd.gateway.peers import read_token
    from chunkd.gateway.tls import PeerTLS

    try:
        token = read_token(peers.token_file)
        tls = PeerTLS.from_config(config)
    except ConfigError as exc:
        return [Check("peers", ERROR, str(exc), "fix [peers] (docs/peers.md)")]
    checks: list[Check] = []
    if peers.token_file is not None and (exposed := _token_exposure(peers.token_file)):
        checks.append(
            Check(
                "peers",
                WARN,
                f"[peers] token_file {peers.token_file} is {exposed}",
                f"chmod 600 {peers.token_file}",
            )
        )
    members, problems = await _members(peers)
    checks += problems
    if len(members) > _MAX_PEERS:
        checks.append(
            Check(
                "peers",
                WARN,
                f"{len(members)} members: the first {_MAX_PEERS} are checked",
                f"run chunkd doctor on a node of each group of {_MAX_PEERS} members to check "
                "the rest",
            )
        )
    at_once = asyncio.Semaphore(_PEERS_AT_ONCE)

    async def one(member: str) -> Check:
        async with at_once:
            return await _check_peer(
                member, token, peers.address or "", tls.client if tls else None
            )

    checks += await asyncio.gather(*(one(m) for m in members[:_MAX_PEERS]))
    if not members:
        checks.append(
            Check(
                "peers",
                WARN,
                "[peers] names no member but self",
                "add members, members_file or dns",
            )
        )
    return checks


def _token_exposure(path: str | Path) -> str:
    """Who besides its owner may read or write the token file, in words ("" for nobody):
    reading it lets one pose as a peer, writing it cuts this node off. Execute bits
    give nothing of a file's contents and are not counted."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    who = []
    for mask, whom in ((0o040, "its group"), (0o004, "every user")):
        if mode & mask:
            who.append(f"readable by {whom}")
    for mask, whom in ((0o020, "its group"), (0o002, "every user")):
        if mode & mask:
            who.append(f"writable by {whom}")
    return f"{' and '.join(who)} (mode {mode:04o})" if who else ""


async def _check_peer(
    member: str, token: str, address: str, context: ssl.SSLContext | None
) -> Check:
    import aiohttp

    name = f"peer:{member}"
    scheme = "https" if context is not None else "http"
    # held=1: answered from the peer's memory (404) or refused (401); never fetched.
    url = f"{scheme}://{member}/v1/peer/pages/{_ZERO_PAGE}?held=1"
    headers = {"Authorization": f"Bearer {token}", "X-Chunkd-Peer": address}
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_NETWORK_TIMEOUT)) as session,
            # Never redirected: the token goes to the member named and nowhere else.
            session.get(
                url,
                headers=headers,
                ssl=context if context is not None else True,
                allow_redirects=False,
            ) as r,
        ):
            status = r.status
            body = await r.content.read(4096)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return Check(
            name,
            ERROR,
            f"{scheme}://{member} is unreachable ({type(exc).__name__}: {exc})",
            "check that its daemon runs and its port is open to this node "
            "(server.listen off loopback)",
        )
    text = body.decode(errors="replace")
    if status == 404 and "NotHeld" in text:
        return Check(name, OK, f"{scheme}://{member} took the peer token")
    if status == 401:
        what = "the peer token" + (" or this node's certificate" if context else "")
        return Check(
            name,
            ERROR,
            f"{scheme}://{member} refused {what} (401)",
            "give every node the same [peers] token_file contents"
            + (" and certificates that chain to the same tls_ca" if context else ""),
        )
    if status == 404:
        return Check(
            name,
            ERROR,
            f"{scheme}://{member} has no [peers] section (404)",
            "configure [peers] on that node too (self, token_file, the same members)",
        )
    return Check(
        name,
        WARN,
        f"{scheme}://{member} answered {status}: {text[:120]}",
        f"check that {member} is a chunkd daemon's server.listen (no proxy in between, no "
        "redirect: the token never follows one) and read its log",
    )


# -- the whole run --------------------------------------------------------------------


async def _network_checks(config: Config) -> list[Check]:
    backends = [check_backend(b) for b in config.backends]
    clocks = [check_clock(b) for b in config.backends]
    found = await asyncio.gather(*backends, *clocks, check_peers(config))
    checks: list[Check] = []
    for item in found:
        if isinstance(item, list):
            checks += item
        elif item is not None:
            checks.append(item)
    return checks


def diagnose(
    config_path: str | None,
    *,
    sysfs: Path = Path("/sys"),
    procfs: Path = Path("/proc"),
    readers: Iterable[str] = (),
) -> list[Check]:
    """Every check, in the order they print; reads only."""
    from chunkd.errors import ConfigError
    from chunkd.gateway.config.load import explain_config

    checks = [check_huge_pages(sysfs)]
    try:
        config, _ = explain_config(config_path)
    except ConfigError as exc:
        return [
            Check("config", ERROR, str(exc), "fix the configuration (chunkd config show)"),
            *checks,
        ]
    checks.insert(0, Check("config", OK, f"loaded {config.source}"))
    local: list[Callable[[], Check]] = [
        lambda: check_open_files(config, procfs),
        lambda: check_socket(config, readers),
        lambda: check_cache_disk(config),
        lambda: check_o_direct(config),
    ]
    checks += [run() for run in local]
    checks += asyncio.run(_network_checks(config))
    return checks


def doctor(
    config_path: str | None,
    *,
    as_json: bool,
    sysfs: Path = Path("/sys"),
    procfs: Path = Path("/proc"),
    readers: Iterable[str] = (),
    out: TextIO | None = None,
) -> int:
    """Run every check and print them; returns 0 with no error, 1 with one."""
    out = sys.stdout if out is None else out
    checks = diagnose(config_path, sysfs=sysfs, procfs=procfs, readers=readers)
    ok = all(check.status != ERROR for check in checks)
    if as_json:
        document = {"checks": [dataclasses.asdict(check) for check in checks], "ok": ok}
        json.dump(document, out, indent=2)
        out.write("\n")
        return 0 if ok else 1
    for check in checks:
        print(f"  [{check.status.upper():<5}] {check.name}: {check.finding}", file=out)
        if check.fix:
            print(f"          fix: {check.fix}", file=out)
    counts = {s: sum(c.status == s for c in checks) for s in (OK, WARN, ERROR)}
    print(
        f"chunkd doctor: {counts[OK]} ok, {counts[WARN]} warning(s), {counts[ERROR]} error(s)",
        file=out,
    )
    return 0 if ok else 1


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Declare ``chunkd doctor``."""
    parser = sub.add_parser(
        "doctor",
        help="check this node against docs/deploy.md and say what to change",
        description=(
            "Check this node: huge pages for shared memory, the open-files limit, the local "
            "socket's mode and group, the cache disk's free space and O_DIRECT, each "
            "backend with its credentials, the clock against each backend's, and the "
            "peers with the token. Each check prints what it found and its fix. Reads "
            "only, never writes. Exits 1 on an error (warnings allowed), 2 on bad usage."
        ),
    )
    parser.add_argument(
        "--config",
        metavar="PATH",
        help="TOML config, as chunkd serve --config takes it (default: the embedded default)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help='print {"checks": [{"name", "status", "finding", "fix"}], "ok": bool}',
    )
    parser.add_argument(
        "--reader",
        metavar="USER",
        action="append",
        default=[],
        help="a user whose trainers will read through the socket: say whether it may "
        "connect (repeat for several)",
    )
    parser.add_argument(
        "--sysfs", metavar="ROOT", default="/sys", help="where sysfs is (default: %(default)s)"
    )
    parser.add_argument(
        "--procfs", metavar="ROOT", default="/proc", help="where procfs is (default: %(default)s)"
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``chunkd doctor``; returns the exit status."""
    return doctor(
        args.config,
        as_json=args.json,
        sysfs=Path(args.sysfs),
        procfs=Path(args.procfs),
        readers=args.reader,
    )
