"""Who may change what on the local socket: the owner of a thing, or an admin.

Whoever may open the local socket reads every configured backend and writes the
writable ones with the daemon's credentials: the socket's group is a credential
(docs/deploy.md). Within it, what one user made is not another's to destroy. The ops
that remove or rewrite what someone made, or write the dataset registry, are scoped
by the caller's uid, which the kernel gives with the connection (``SO_PEERCRED``),
against the uid recorded when the thing was made:

* a checkpoint's manifest records its ``owner`` (the uid of the save that committed
  it); ``ckpt_delete``, a save with ``overwrite=True`` onto it, and ``ckpt_gc``'s
  retention (``keep_last``) of it need its owner;
* a dataset name's version 1 records its ``uid``: the name's owner. A new version
  (``ds_commit``, ``ds_migrate`` into the name), a tag move (``ds_tag``) and a freeze
  (``ds_freeze``) of a version of the name need its owner; a freeze by snapshot id
  alone names no owner, so it needs an admin;
* ``ckpt_scrub`` with ``remove`` needs an admin.

An **admin** may do all of it: root (uid 0), the daemon's own user, and members of
``server.admin_group`` (the connection's primary group, or one of its supplementary
groups as the kernel gives them, ``SO_PEERGROUPS``). A thing that records no owner
(made before chunkd recorded owners) is an admin's alone to change. Reading is never
scoped: anyone who may open the socket may read and load everything.

A uid means one user on one node. A cluster whose nodes share a registry or a
checkpoint backend must give each person the same uid on every node (LDAP, SSSD), as
shared file systems already require.
"""

from __future__ import annotations

import array
import errno
import grp
import os
import socket
from dataclasses import dataclass, field
from typing import Final

from chunkd.errors import AccessDeniedError, ChunkdError

__all__ = ["Authority", "Caller", "group_id", "peer_groups"]

#: SO_PEERGROUPS (Linux 4.13): the supplementary groups of the peer, at connect time
_SO_PEERGROUPS: Final = getattr(socket, "SO_PEERGROUPS", 59)
#: the most supplementary groups asked for at first (grown when the kernel says so)
_GROUPS_AT_FIRST: Final = 64


def group_id(group: str, key: str) -> int:
    """The GID of ``group``: a name, or a numeric GID (a container's natural form).

    Raises:
        ChunkdError: no such group on this host (the message names ``key``).
    """
    try:
        return int(group) if group.isdecimal() else grp.getgrnam(group).gr_gid
    except (KeyError, ValueError):
        raise ChunkdError(
            f"{key} {group!r} is not a group on this host; name one that is, or give its "
            "numeric GID"
        ) from None


def peer_groups(conn: socket.socket) -> frozenset[int]:
    """The supplementary groups of the process at the other end of ``conn`` (a Unix
    socket), as they were when it connected; empty where the kernel cannot tell."""
    size = _GROUPS_AT_FIRST
    while True:
        try:
            raw = conn.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, size * 4)
        except OSError as exc:
            if exc.errno == errno.ERANGE and size < 65536:
                size *= 16
                continue
            return frozenset()
        gids = array.array("I")
        gids.frombytes(raw[: len(raw) - len(raw) % 4])
        return frozenset(gids)


@dataclass(frozen=True)
class Caller:
    """Who sent a request on the local socket (from the kernel, not from the request)."""

    uid: int
    gid: int
    pid: int = 0
    groups: frozenset[int] = field(default_factory=frozenset)


class Authority:
    """The rule above for one daemon.

    Args:
        admin_group: ``server.admin_group``'s GID; None: no admin group.
        daemon_uid: the daemon's own uid (an admin).
    """

    def __init__(self, admin_group: int | None = None, daemon_uid: int | None = None) -> None:
        self.admin_group = admin_group
        self.daemon_uid = os.geteuid() if daemon_uid is None else daemon_uid

    def is_admin(self, caller: Caller) -> bool:
        """Whether ``caller`` may change everything."""
        if caller.uid in (0, self.daemon_uid):
            return True
        group = self.admin_group
        return group is not None and (caller.gid == group or group in caller.groups)

    def require_admin(self, caller: Caller, action: str) -> None:
        """Raise unless ``caller`` is an admin.

        Raises:
            AccessDeniedError: the message says who may ``action``.
        """
        if not self.is_admin(caller):
            raise AccessDeniedError(
                f"uid {caller.uid} may not {action}: only root, the daemon's own user "
                f"(uid {self.daemon_uid}) and members of server.admin_group may"
            )

    def require_owner(self, caller: Caller, owner: object, what: str, action: str) -> None:
        """Raise unless ``caller`` owns ``what`` (whose recorded owner is ``owner``, a
        uid, or None when none was recorded) or is an admin.

        Raises:
            AccessDeniedError: the message names the owner and who may ``action`` it.
        """
        if self.is_admin(caller):
            return
        if not isinstance(owner, int) or isinstance(owner, bool):
            raise AccessDeniedError(
                f"uid {caller.uid} may not {action} {what}: it records no owner (it was made "
                "before chunkd recorded owners), so only root, the daemon's own user and "
                "members of server.admin_group may"
            )
        if owner != caller.uid:
            raise AccessDeniedError(
                f"uid {caller.uid} may not {action} {what}: it was made by uid {owner}; only "
                "its owner, root, the daemon's own user and members of server.admin_group may"
            )
