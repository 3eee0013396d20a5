#!/usr/bin/env python3
"""chunkd's peers on a Slurm cluster: the members file, and this node's ``self``.

One chunkd runs on every node (under systemd) and serves every job on it, so
membership is the nodes, not a job's allocation: every node of a partition (or of
the cluster) is a member, whichever jobs run where. This script writes what the
daemon reads:

``members``
    The members file (``[peers] members_file``): one ``HOST:PORT`` a line, HOST as
    Slurm names the node, PORT the port of ``[server] listen``. The names come from
    ``sinfo`` for a partition, from ``scontrol show hostnames`` for a node list
    expression like ``gpu[001-004,007]``, or from files of host names (``-``:
    standard input), e.g. what ``scontrol show hostnames`` printed elsewhere.
``self``
    ``CHUNKD_PEERS_SELF=HOST:PORT`` for a systemd ``EnvironmentFile=``: HOST is the
    node's short host name (or ``--node-name``), and must be written exactly as in
    the members file, which ``--members`` checks: the daemon tells itself from the
    others by comparing the two strings.

The port is read as chunkd reads it: ``CHUNKD_SERVER_LISTEN`` if set, else
``[server] listen`` of ``--config``, else chunkd's default; a loopback listener is
refused, since peers on other nodes could not reach it. Only the standard library
is used (Python 3.11+), so it runs under the interpreter chunkd is installed with,
or any other. ``deploy/slurm/chunkd.service.d/slurm.conf`` runs both at each start
of the daemon; docs/deploy.md has the rest.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import socket
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Final

PROG: Final = "chunkd_slurm.py"
#: chunkd's own default for [server] listen (gateway/config/schema.py)
DEFAULT_LISTEN: Final = "127.0.0.1:8470"
#: how long sinfo or scontrol may take: a slurmctld that does not answer must not
#: hold up the daemon's start for long (the unit's start timeout is 90 s)
COMMAND_TIMEOUT: Final = 30.0
_HOST_RE: Final = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")


class MembersError(Exception):
    """What went wrong, worded for the person who runs the script."""


def split_host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 in brackets) as (host without brackets, port)."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise MembersError(f"{text!r} is not HOST:PORT, like '0.0.0.0:8470'")
    return host, int(port)


def listen_address(config: Path | None, environ: Mapping[str, str]) -> str:
    """``[server] listen`` as the daemon will see it: the environment, the file, the default."""
    if environ.get("CHUNKD_SERVER_LISTEN"):
        return environ["CHUNKD_SERVER_LISTEN"]
    if config is None:
        return DEFAULT_LISTEN
    try:
        doc = tomllib.loads(config.read_text(encoding="utf-8"))
    except OSError as exc:
        raise MembersError(f"cannot read the config {config}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise MembersError(f"{config} is not valid TOML: {exc}") from exc
    listen = doc.get("server", {}).get("listen", DEFAULT_LISTEN)
    if not isinstance(listen, str):
        raise MembersError(f"{config}: [server] listen is not a string")
    return listen


def peer_port(config: Path | None, environ: Mapping[str, str]) -> int:
    """The port the other nodes reach this daemon on; refused if it listens on loopback."""
    listen = listen_address(config, environ)
    host, port = split_host_port(listen)
    if _is_loopback(host):
        raise MembersError(
            f"[server] listen is {listen!r}, which other nodes cannot reach; listen on "
            "'0.0.0.0:PORT' (or this node's address) in the config, or set "
            "CHUNKD_SERVER_LISTEN"
        )
    return port


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # another host name: it names an interface other nodes may reach


def address(host: str, port: int) -> str:
    """``host:port`` as the members file and ``self`` spell it (IPv6 in brackets)."""
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


def host_names(lines: Iterable[str], source: str) -> list[str]:
    """The host names in ``lines``: whitespace-separated, '#' comments, each once, in order."""
    names: dict[str, None] = {}
    for number, line in enumerate(lines, 1):
        for word in line.split("#", 1)[0].split():
            if not _HOST_RE.fullmatch(word):
                try:
                    ipaddress.ip_address(word)
                except ValueError:
                    raise MembersError(
                        f"{source} line {number}: {word!r} is not a host name; give one name "
                        "a line, as `scontrol show hostnames` prints them"
                    ) from None
            names[word] = None
    return list(names)


def run_slurm(argv: Sequence[str]) -> list[str]:
    """The lines ``argv`` (a Slurm command) prints."""
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=False
        )
    except FileNotFoundError:
        raise MembersError(
            f"{argv[0]} is not on PATH: run this on a node with Slurm's commands, or give "
            "it a file of host names (`scontrol show hostnames ... > FILE`)"
        ) from None
    except subprocess.TimeoutExpired:
        raise MembersError(
            f"`{' '.join(argv)}` did not answer in {COMMAND_TIMEOUT:.0f} s (is slurmctld up?)"
        ) from None
    if done.returncode != 0:
        raise MembersError(
            f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip() or 'no message'}"
        )
    return done.stdout.splitlines()


def gather(partitions: Sequence[str], nodelists: Sequence[str], files: Sequence[str]) -> list[str]:
    """Every node named by the partitions, node lists and files, each once, in order."""
    names: dict[str, None] = {}
    for partition in partitions:
        # Every node of the partition, whatever its state: a drained or down node is
        # still a member, which the daemons' health checks skip while it is away, so
        # membership does not churn with node states.
        argv = ["sinfo", "--noheader", "--Node", "--partition", partition, "--format", "%N"]
        names.update(dict.fromkeys(host_names(run_slurm(argv), f"sinfo -p {partition}")))
    for nodelist in nodelists:
        argv = ["scontrol", "show", "hostnames", nodelist]
        names.update(dict.fromkeys(host_names(run_slurm(argv), f"scontrol ({nodelist})")))
    for name in files:
        if name == "-":
            lines = sys.stdin.read().splitlines()
        else:
            try:
                lines = Path(name).read_text(encoding="utf-8").splitlines()
            except OSError as exc:
                raise MembersError(f"cannot read {name}: {exc.strerror or exc}") from exc
        names.update(dict.fromkeys(host_names(lines, name)))
    if not names:
        raise MembersError(
            "no node names were given or found; a members file without them would leave "
            "every daemon alone, so none was written"
        )
    return list(names)


def members_text(names: Sequence[str], port: int, source: str) -> str:
    """The members file for ``names``."""
    lines = [f"# chunkd peers, written by {PROG} from {source}; regenerate, do not edit"]
    lines += [address(name, port) for name in names]
    return "\n".join(lines) + "\n"


def read_members(path: Path) -> list[str]:
    """The entries of a members file, as the daemon reads them."""
    entries = []
    for line in path.read_text(encoding="utf-8").splitlines():
        entry = line.split("#", 1)[0].strip()
        if entry:
            entries.append(entry)
    return entries


def self_address(name: str, port: int, members: Path | None) -> str:
    """This node's ``self``, checked against the members file when there is one."""
    mine = address(name, port)
    if members is None:
        return mine
    try:
        entries = read_members(members)
    except FileNotFoundError:
        # No members file yet (slurmctld did not answer at start): the daemon runs
        # alone until it appears, and self needs no check against nothing.
        print(f"{PROG}: {members} does not exist yet; writing self unchecked", file=sys.stderr)
        return mine
    except OSError as exc:
        raise MembersError(f"cannot read {members}: {exc.strerror or exc}") from exc
    if mine in entries:
        return mine
    hosts = [entry.rpartition(":")[0] for entry in entries]
    alike = [h for h in hosts if h.split(".")[0] == name.split(".")[0]]
    hint = (
        f"; it lists {alike[0]!r}: give --node-name {alike[0]}"
        if alike
        else "; give --node-name with the name Slurm uses for this node (SLURMD_NODENAME)"
    )
    raise MembersError(
        f"self {mine!r} is not in the members file {members}: the daemon would count this "
        f"node twice{hint}"
    )


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` in one step: the daemon re-reads the members file when it
    changes, and must never read half of one."""
    # The directory is not made here: /run/chunkd is the unit's RuntimeDirectory, and
    # one made by a cron job while the daemon is stopped would have the wrong owner.
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except OSError as exc:
        raise MembersError(f"cannot write {path}: {exc.strerror or exc}") from exc
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        # Neither file is secret, and the daemon's user must read one root wrote.
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def emit(text: str, output: Path | None) -> None:
    if output is None:
        sys.stdout.write(text)
    else:
        write_atomically(output, text)


def short_host_name() -> str:
    """This node's host name up to its first dot, as Slurm's node names usually are."""
    return socket.gethostname().split(".", 1)[0]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Write chunkd's members file and self for the nodes of a Slurm cluster.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    members = commands.add_parser(
        "members", help="the members file: HOST:PORT a line, from Slurm's node names"
    )
    members.add_argument(
        "files",
        nargs="*",
        metavar="FILE",
        help="files of host names, one a line ('-': standard input)",
    )
    members.add_argument(
        "--partition",
        action="append",
        default=[],
        help="every node of this partition, from sinfo (repeatable)",
    )
    members.add_argument(
        "--nodelist",
        action="append",
        default=[],
        help="a node list like 'gpu[001-004,007]', expanded by scontrol show hostnames "
        "(repeatable)",
    )
    this = commands.add_parser("self", help="CHUNKD_PEERS_SELF=HOST:PORT for this node")
    this.add_argument(
        "--node-name",
        help="this node's name as the members file has it (default: the short host name)",
    )
    this.add_argument(
        "--members", type=Path, help="a members file that must list this node (if it exists)"
    )
    for sub in (members, this):
        sub.add_argument(
            "--config",
            type=Path,
            help="chunkd's config, for the port of [server] listen (default: chunkd's default)",
        )
        sub.add_argument(
            "--output", type=Path, help="the file to write, replaced atomically (default: stdout)"
        )
    return parser


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "members" and not (args.partition or args.nodelist or args.files):
        parser.error("members: give --partition, --nodelist or files of host names")
    env = os.environ if environ is None else environ
    try:
        port = peer_port(args.config, env)
        if args.command == "members":
            names = gather(args.partition, args.nodelist, args.files)
            source = ", ".join(
                [f"partition {p}" for p in args.partition]
                + [f"node list {n}" for n in args.nodelist]
                + [f"file {f}" for f in args.files]
            )
            emit(members_text(names, port, source), args.output)
        else:
            name = args.node_name or short_host_name()
            emit(f"CHUNKD_PEERS_SELF={self_address(name, port, args.members)}\n", args.output)
    except MembersError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
