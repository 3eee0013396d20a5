"""``chunkd dataset``: register, list, show, compare, tag, check, freeze, migrate and
replay dataset snapshots.

Every subcommand is a client of the node's daemon over its local socket: the daemon
holds the backends' credentials and the registry (``[datasets] registry``). Member
metadata is read here, in this process, through the daemon's cache: the daemon itself
never parses a data file.

It is one job at ~800 lines: the command line of datasets. Each of the nine subcommands
reads its arguments, asks the daemon or the client library
(:mod:`chunkd.client.datasets`), which does the work, and prints the answer as text or
``--json``. The longest are ``register`` (its progress line and Ray options), ``replay``
(an order's steps back to sample ids) and ``check``, whose drift walk compares the
members with one fresh listing (a stat each where the backend cannot be listed): what
the command adds to the format rules of :mod:`chunkd.client.datasets.check`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from chunkd.errors import ChunkdError, InvalidRequestError, ObjectNotFoundError
from chunkd.gateway.cli.options import human_size, socket_option
from chunkd.snapshot import diff as snapshot_diff

if TYPE_CHECKING:
    from chunkd.client import Client
    from chunkd.client.datasets.bulk import RayRun
    from chunkd.client.datasets.register import Progress
    from chunkd.snapshot import Snapshot

__all__ = ["add_parser", "run"]

_PROG = "chunkd dataset"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Declare ``chunkd dataset``."""
    top = sub.add_parser(
        "dataset",
        help="registered, versioned dataset snapshots",
        description=(
            "Datasets: immutable snapshots of a prefix's files (Parquet, JSON lines, fixed "
            "records, WebDataset tars, MDS), registered under versioned names in the "
            "cluster's registry, read pinned and in a resumable order."
        ),
    )
    cmds = top.add_subparsers(dest="dataset_command", metavar="COMMAND", required=True)

    register = cmds.add_parser(
        "register",
        help="snapshot BACKEND/PREFIX as the next version of NAME",
        description=(
            "List the prefix, read only the metadata each format needs (Parquet footers, "
            "tar headers, MDS indexes; JSON lines are counted), and commit the snapshot as "
            "NAME's next version."
        ),
    )
    register.add_argument("name", metavar="NAME")
    register.add_argument("prefix", metavar="BACKEND/PREFIX")
    register.add_argument(
        "--format",
        default="auto",
        metavar="FORMAT",
        help="auto (by each file's ending), parquet, jsonl, wds, mds or fixed:N (default: auto)",
    )
    register.add_argument(
        "--skip-bad",
        action="store_true",
        help="record files that cannot be read as excluded, instead of stopping",
    )
    register.add_argument(
        "--concurrency", type=int, default=8, metavar="N", help="files read at once (default: 8)"
    )
    register.add_argument(
        "--keys",
        metavar="FILE",
        help="the members' keys below the prefix, one a line, instead of a listing (a "
        "backend that cannot be listed, such as https://); at most 1,000,000 keys, 64 MiB",
    )
    register.add_argument("--quiet", action="store_true", help="no progress on stderr")
    _ray_option(
        register,
        "scan the files as Ray tasks over the cluster's nodes",
        "with --ray: files a task scans, at most (1 to 1024; default: 1024)",
    )

    listing = cmds.add_parser("ls", help="registered datasets, with their latest version")
    listing.add_argument("prefix", nargs="?", default="", metavar="NAME_PREFIX")

    show = cmds.add_parser("show", help="a snapshot: totals, schema, versions, members")
    show.add_argument("ref", metavar="REF", help="NAME, NAME@N, NAME@TAG or a snapshot id")
    show.add_argument(
        "--members", type=int, default=10, metavar="N", help="members to list (default: 10)"
    )

    diff = cmds.add_parser("diff", help="what differs between two snapshots")
    diff.add_argument("a", metavar="A")
    diff.add_argument("b", metavar="B")

    tag = cmds.add_parser("tag", help="point TAG of a dataset at one of its versions")
    tag.add_argument("ref", metavar="NAME@N", help="the version (or NAME@TAG, or NAME)")
    tag.add_argument("tag", metavar="TAG")

    check = cmds.add_parser(
        "check",
        help="check a snapshot against the storage-format expectations (non-zero on an error)",
    )
    check.add_argument("ref", metavar="REF")
    check.add_argument(
        "--deep", action="store_true", help="read every JSON line too (parse and UTF-8)"
    )
    _ray_option(
        check,
        "check the members as Ray tasks over the cluster's nodes, by page",
        "with --ray: members a task checks, about: whole pages (default: 4096)",
    )

    freeze = cmds.add_parser(
        "freeze",
        help="copy a snapshot's bytes into the registry's chunk store",
        description=(
            "Copy every member's bytes (pinned at its recorded version) into the registry "
            "backend's content-addressed chunks: the snapshot then reads bit-exact even "
            "after its source objects are rewritten or deleted."
        ),
    )
    freeze.add_argument("ref", metavar="NAME@N")

    migrate = cmds.add_parser(
        "migrate",
        help="copy a snapshot to another backend, verified, as a new version",
    )
    migrate.add_argument("ref", metavar="NAME@N")
    migrate.add_argument("--to", required=True, metavar="BACKEND/PREFIX")

    replay = cmds.add_parser(
        "replay",
        help="the sample ids a training step read, and how to open them",
        description=(
            "Either REF with --seed, --epoch, --step, --batch-size and --world-size (a run "
            "that never resized), or --state FILE (a saved loader state) and --steps K (the "
            "K-th step after it)."
        ),
    )
    replay.add_argument("ref", nargs="?", metavar="REF")
    replay.add_argument("--seed", type=int)
    replay.add_argument("--epoch", type=int, default=0)
    replay.add_argument("--step", type=int)
    replay.add_argument("--batch-size", type=int)
    replay.add_argument("--world-size", type=int)
    replay.add_argument("--rank", type=int, help="one rank's share only")
    replay.add_argument(
        "--window",
        type=int,
        default=None,
        metavar="N",
        help="the loader's window in units (default: the loader's default; 0: no bound)",
    )
    replay.add_argument(
        "--window-bytes",
        type=int,
        default=None,
        metavar="BYTES",
        help=(
            "the loader's window_bytes (default: the loader's default; 0: no bound; "
            "--window 0 --window-bytes 0: a full shuffle)"
        ),
    )
    replay.add_argument("--no-shuffle", action="store_true", help="the loader did not shuffle")
    replay.add_argument("--state", metavar="FILE", help="a saved loader state (JSON)")
    replay.add_argument("--steps", type=int, default=0, metavar="K")
    replay.add_argument(
        "--tail", choices=("uneven", "pad", "drop"), default="uneven", help="the loader's tail"
    )

    for parser in (register, listing, show, diff, tag, check, freeze, migrate, replay):
        parser.add_argument("--json", action="store_true", help="print JSON")
        socket_option(parser)


def _ray_option(parser: argparse.ArgumentParser, what: str, batch: str) -> None:
    parser.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        default=None,
        metavar="ADDRESS",
        help=(
            f"{what}, each task through its own node's daemon (needs chunkd[ray]); "
            "ADDRESS: the cluster's head HOST:PORT (default: auto, the cluster of this node)"
        ),
    )
    parser.add_argument("--batch", type=int, default=None, metavar="N", help=batch)


def _ray_first(args: argparse.Namespace) -> None:
    """Refuse ``--ray`` where Ray is not installed before any work, and ``--batch``
    without ``--ray``."""
    if args.ray is not None:
        from chunkd.client.datasets.bulk import import_ray

        import_ray()
    elif args.batch is not None:
        raise InvalidRequestError("--batch sizes the tasks of a job on Ray: give --ray too")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run a ``chunkd dataset`` subcommand; returns the exit status."""
    from chunkd.client import Client

    command: Callable[[Client, argparse.Namespace, TextIO], int] = _COMMANDS[args.dataset_command]
    try:
        with Client(args.socket) as client:
            return command(client, args, sys.stdout)
    except ChunkdError as exc:
        print(f"{_PROG} {args.dataset_command}: {exc}", file=sys.stderr)
        return 1


# -- the subcommands ---------------------------------------------------------------------


def _register(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    from chunkd.client.datasets.register import commit, parse_format, read_keys, scan_prefix
    from chunkd.snapshot import check_dataset_name

    check_dataset_name(args.name)
    fmt, options = parse_format(args.format)
    _ray_first(args)
    keys = None
    if args.keys is not None:
        if args.ray is not None:
            raise InvalidRequestError(
                "--keys and --ray do not go together: a registration from a file of keys "
                "runs on this node"
            )
        try:
            keys = read_keys(args.keys)
        except OSError as exc:
            raise InvalidRequestError(
                f"cannot read the file of keys {args.keys!r}: {exc.strerror or exc}"
            ) from None
    tty = sys.stderr.isatty()
    # In a terminal the line updates in place from the start; in a log, a line every
    # 5 s, the first after 5 s (a registration of a few files logs none)
    shown = [0.0 if tty else time.monotonic()]

    def progress(state: Progress) -> None:
        now = time.monotonic()
        if args.quiet or now - shown[0] < (0.5 if tty else 5.0):
            return
        shown[0] = now
        print(("\r" if tty else "") + state.line(), end="" if tty else "\n", file=sys.stderr)

    started = time.monotonic()
    ray_run: RayRun | None = None
    if args.ray is not None:
        from chunkd.client.datasets.bulk import BATCH_MEMBERS, register_on_ray

        snapshot, ray_run = register_on_ray(
            client,
            args.prefix,
            fmt=fmt,
            options=options,
            skip_bad=args.skip_bad,
            address=args.ray,
            batch=BATCH_MEMBERS if args.batch is None else args.batch,
            concurrency=args.concurrency,
            progress=progress,
        )
    else:
        snapshot = scan_prefix(
            client,
            args.prefix,
            fmt=fmt,
            options=options,
            skip_bad=args.skip_bad,
            concurrency=args.concurrency,
            progress=progress,
            keys=keys,
        )
    scanned = time.monotonic() - started
    if tty and not args.quiet and shown[0]:
        print(file=sys.stderr)
    # Its pages first (each put if absent), then its root: the commit, one request.
    answer = commit(client, args.name, snapshot)
    report = {
        "name": args.name,
        "version": answer.get("version"),
        "snapshot": snapshot.id,
        "created": answer.get("created"),
        "members": len(snapshot.members),
        "samples": len(snapshot),
        "bytes": snapshot.total_bytes,
        "excluded": list(snapshot.excluded),
        "seconds": round(scanned, 3),
        "files_per_second": round(len(snapshot.members) / max(scanned, 1e-9), 1),
    }
    if ray_run is not None:
        report["ray"] = ray_run.to_json()
    if args.json:
        _dump(report, out)
        return 0
    on_ray = "" if ray_run is None else f" by {ray_run.tasks} Ray tasks on {ray_run.nodes} nodes"
    print(
        f"registered {args.name}@{report['version']}: {report['members']} {snapshot.format} "
        f"files, {report['samples']} samples, {human_size(snapshot.total_bytes)} "
        f"(snapshot {snapshot.id}); read{on_ray} in {scanned:.1f}s, "
        f"{report['files_per_second']:.0f} files/s",
        file=out,
    )
    for entry in snapshot.excluded:
        print(f"  excluded {entry.get('key')}: {entry.get('error')}", file=out)
    return 0


def _ls(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    # Page by page: a registry of a million names is never held whole.
    shown = damaged_count = 0
    token: str | None = None
    if args.json:
        out.write("[")
    while True:
        fields: dict[str, Any] = {"prefix": args.prefix or None, "start_after": token}
        with client.request("ds_list", fields) as reply:
            entries = list(json.loads(reply.payload or b"[]"))
            token = reply.header.get("next")
        for entry in entries:
            if args.json:
                out.write(("," if shown else "") + "\n  " + json.dumps(entry))
            elif entry.get("damaged"):
                # Listed around: the rest of the listing goes on (docs/datasets.md).
                damaged = entry["damaged"]
                print(
                    f"{_PROG} ls: warning: dataset {entry.get('name')} is damaged: "
                    f"{damaged.get('error') if isinstance(damaged, dict) else damaged}",
                    file=sys.stderr,
                )
                damaged_count += 1
                continue
            else:
                if not shown:
                    print(f"{'NAME':<40} {'LATEST':>6}  {'SNAPSHOT':<16}  CREATED", file=out)
                print(
                    f"{entry.get('name')!s:<40} {entry.get('latest', '-')!s:>6}  "
                    f"{str(entry.get('snapshot', '-'))[:16]:<16}  {_when(entry.get('created'))}",
                    file=out,
                )
            shown += 1
        if token is None:
            break
    if args.json:
        out.write("\n]\n" if shown else "]\n")
    elif not shown and not damaged_count:
        print("(no datasets registered)", file=out)
    return 0


def _show(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    from chunkd.client.datasets import resolve

    snapshot, header, _ = resolve(client, args.ref)
    report = _describe(snapshot, header)
    report["members_shown"] = [
        {
            "key": m.key,
            "size": m.size,
            "samples": m.samples,
            "version": m.version,
            "format": m.format,
        }
        for m in snapshot.members[: max(0, args.members)]
    ]
    if args.json:
        _dump(report, out)
        return 0
    where = f"{header.get('name')}@{header.get('version')}" if header.get("name") else args.ref
    print(f"{where}  snapshot {snapshot.id}", file=out)
    print(
        f"  {snapshot.format}: {len(snapshot.members)} files, {len(snapshot)} samples, "
        f"{human_size(snapshot.total_bytes)}, from {snapshot.backend}/{snapshot.prefix}",
        file=out,
    )
    if header.get("tags"):
        print(f"  tags: {', '.join(header['tags'])}", file=out)
    print(f"  frozen: {'yes' if header.get('frozen') else 'no'}", file=out)
    if snapshot.schema_of is not None:
        print(f"  schema: {json.dumps(snapshot.schema_of)[:400]}", file=out)
    if snapshot.excluded:
        print(f"  excluded: {len(snapshot.excluded)} files", file=out)
    for m in report["members_shown"]:
        print(f"  {m['key']}  {human_size(m['size'])}  {m['samples']} samples", file=out)
    if len(snapshot.members) > len(report["members_shown"]):
        print(f"  ... and {len(snapshot.members) - len(report['members_shown'])} more", file=out)
    return 0


def _describe(snapshot: Snapshot, header: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": snapshot.id,
        "snapshot": snapshot.id,
        "name": header.get("name"),
        "version": header.get("version"),
        "tags": header.get("tags", []),
        "frozen": bool(header.get("frozen")),
        "format": snapshot.format,
        "source": f"{snapshot.backend}/{snapshot.prefix}",
        "members": len(snapshot.members),
        "samples": len(snapshot),
        "bytes": snapshot.total_bytes,
        "schema": snapshot.schema_of,
        "excluded": list(snapshot.excluded),
    }


def _diff(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    from chunkd.client.datasets import resolve
    from chunkd.client.datasets.frozen import FrozenSource

    a, _, source_a = resolve(client, args.a)
    b, _, source_b = resolve(client, args.b)
    records = tuple(s.record if isinstance(s, FrozenSource) else None for s in (source_a, source_b))
    report = snapshot_diff(a, b, frozen=(records[0], records[1]))
    if args.json:
        _dump(report, out)
        return 0
    by = report["same_by"]
    known = f"{by['content']} by content hash, {by['version']} by version token"
    if report["same"]:
        print(
            f"{args.a} and {args.b}: the same contents ({len(a)} samples; "
            f"{report['unchanged']} members the same: {known})",
            file=out,
        )
        return 0
    unknown = report["unknown"]
    print(
        f"{args.a} -> {args.b}: {len(report['added'])} added, {len(report['removed'])} "
        f"removed, {len(report['changed'])} changed, {len(unknown)} unknown, "
        f"{report['unchanged']} the same ({known}); samples {len(a)} -> {len(b)}",
        file=out,
    )
    for key in report["added"][:50]:
        print(f"  + {key}", file=out)
    for key in report["removed"][:50]:
        print(f"  - {key}", file=out)
    for entry in report["changed"][:50]:
        print(f"  ~ {entry['key']} ({', '.join(entry['fields'])})", file=out)
    for key in unknown[:50]:
        print(f"  ? {key}", file=out)
    if report["schema_changed"]:
        print("  the schema changed", file=out)
    if unknown:
        print(
            f"  ?: {len(unknown)} members are not known to be the same: each side reads "
            "another object and no content hash of both is known (a migrated copy records "
            "one; freezing both snapshots compares their chunks)",
            file=out,
        )
    return 0


def _tag(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    from chunkd.errors import InvalidRequestError
    from chunkd.snapshot import check_tag, parse_ref

    ref = parse_ref(args.ref)
    check_tag(args.tag)
    if ref.name is None:
        raise InvalidRequestError(
            f"a tag belongs to a dataset: give NAME@N, not the snapshot id {args.ref}"
        )
    answer = _ask(client, "ds_tag", {"name": ref.name, "tag": args.tag, "ref": args.ref})
    if args.json:
        _dump(_documented(answer, _TAG_FIELDS), out)
    else:
        print(f"{ref.name}@{args.tag} -> version {answer.get('version')}", file=out)
    return 0


def _check(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    from chunkd.client.datasets import resolve
    from chunkd.client.datasets.check import check, summarize

    _ray_first(args)
    snapshot, header, source = resolve(client, args.ref)
    if args.ray is not None:
        from chunkd.client.datasets.bulk import CHECK_MEMBERS, check_on_ray

        findings, _ = check_on_ray(
            client,
            snapshot,
            deep=args.deep,
            address=args.ray,
            members_per_task=CHECK_MEMBERS if args.batch is None else args.batch,
        )
    else:
        findings = check(snapshot, source, deep=args.deep)
    if not header.get("frozen"):
        others = [f for f in findings if f.code != "drift"]
        findings = summarize(_drifted(client, snapshot) + others)
    errors = sum(f.count for f in findings if f.level == "error")
    warnings = sum(f.count for f in findings if f.level == "warning")
    if args.json:
        _dump([_finding(f) for f in findings], out)
    else:
        for f in findings:
            if f.count > 1 and f.member is not None:
                shown = ", ".join(f.examples) + (", ..." if f.count > len(f.examples) else "")
                print(f"{f.level}: {f.message} [{f.code}] ({f.count} files: {shown})", file=out)
            else:
                where = f" {f.member}" if f.member else ""
                print(f"{f.level}{where}: {f.message} [{f.code}]", file=out)
        print(
            f"{args.ref}: {errors} errors, {warnings} warnings "
            f"({len(snapshot.members)} files checked)",
            file=out,
        )
    return 1 if errors else 0


def _drifted(client: Client, snapshot: Snapshot) -> list[Any]:
    """A finding for each member whose object is gone or changed: one fresh listing of
    the snapshot's prefix, member by member (both in key order), not a request each."""
    from chunkd.client.datasets.check import Finding

    found: list[Any] = []
    wanted = iter(snapshot.members)
    member = next(wanted, None)
    listing = client.iter_ls(
        f"{snapshot.backend}/{snapshot.prefix}".rstrip("/"), recursive=True, fresh=True
    )
    try:
        first = next(listing, None)
    except InvalidRequestError:  # a backend that cannot be listed (its answer says so)
        return _drifted_by_stat(client, snapshot)
    for entry in itertools.chain([] if first is None else [first], listing):
        key = str(entry["name"])[len(snapshot.backend) + 1 :]
        while member is not None and member.key.encode() < key.encode():
            found.append(_gone(member, Finding))
            member = next(wanted, None)
        if member is not None and member.key == key:
            if str(entry.get("version")) != member.version:
                found.append(
                    Finding(
                        "error",
                        member.key,
                        "drift",
                        f"{snapshot.backend}/{member.key} changed since it was registered "
                        f"(version {member.version!r}, now {entry.get('version')!r}): its "
                        "reads fail; register the dataset again, or freeze it next time",
                    )
                )
            member = next(wanted, None)
    while member is not None:
        found.append(_gone(member, Finding))
        member = next(wanted, None)
    return found


def _drifted_by_stat(client: Client, snapshot: Snapshot) -> list[Any]:
    """:func:`_drifted` for a backend that cannot be listed (``https://``, registered
    from a file of keys): a stat of each member, as its reads would see it (the
    backend's ``revalidate`` applies), a few at once."""
    from chunkd.client.datasets.check import Finding

    def drift(member: Any) -> Any:
        try:
            now = client.stat(f"{snapshot.backend}/{member.key}").version
        except ObjectNotFoundError:
            return _gone(member, Finding)
        if now == member.version:
            return None
        return Finding(
            "error",
            member.key,
            "drift",
            f"{snapshot.backend}/{member.key} changed since it was registered "
            f"(version {member.version!r}, now {now!r}): its reads fail; register the "
            "dataset again, or freeze it next time",
        )

    return [f for f in map(drift, snapshot.members) if f is not None]


def _gone(member: Any, finding: Any) -> Any:
    return finding(
        "error",
        member.key,
        "drift",
        f"{member.key} is gone since it was registered: its reads fail; register the "
        "dataset again, or freeze it next time",
    )


def _finding(f: Any) -> dict[str, Any]:
    return {
        "level": f.level,
        "member": f.member,
        "code": f.code,
        "message": f.message,
        "count": f.count,
        "examples": list(f.examples),
    }


def _freeze(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    answer = _ask(client, "ds_freeze", {"ref": args.ref}, timeout=_LONG)
    if args.json:
        _dump(_documented(answer, _FREEZE_FIELDS), out)
    else:
        print(
            f"froze {args.ref}: {answer.get('members')} files in {answer.get('chunks')} chunks "
            f"({human_size(answer.get('bytes') or 0)}, {answer.get('uploaded')} uploaded)",
            file=out,
        )
    return 0


def _migrate(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    answer = _ask(client, "ds_migrate", {"ref": args.ref, "to": args.to}, timeout=_LONG)
    if args.json:
        _dump(_documented(answer, _MIGRATE_FIELDS), out)
    else:
        print(
            f"migrated {args.ref} to {args.to}: version {answer.get('version')} "
            f"(snapshot {answer.get('snapshot')}), every chunk verified",
            file=out,
        )
    return 0


def _replay(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    from chunkd.client.datasets import Dataset
    from chunkd.client.datasets.epoch import DEFAULT_WINDOW, DEFAULT_WINDOW_BYTES
    from chunkd.client.datasets.loader import step_sample_ids
    from chunkd.client.datasets.state import LoaderState
    from chunkd.errors import InvalidRequestError

    if args.batch_size is None or args.world_size is None:
        raise InvalidRequestError("replay needs --batch-size and --world-size (the run's)")
    if args.state is not None:
        try:
            text = Path(args.state).read_text()
        except OSError as exc:
            raise InvalidRequestError(f"cannot read the state {args.state}: {exc}") from None
        state = LoaderState.parse(text)
        if args.ref is not None:
            dataset = Dataset.open(args.ref, client)
        else:
            dataset = Dataset.open(state.snapshot, client)
        step, ref = args.steps, args.ref or state.snapshot
    else:
        if args.ref is None or args.seed is None or args.step is None:
            raise InvalidRequestError(
                "replay needs REF, --seed and --step (or --state FILE and --steps K)"
            )
        dataset = Dataset.open(args.ref, client)
        window = args.window if args.window is not None else DEFAULT_WINDOW
        window_bytes = args.window_bytes if args.window_bytes is not None else DEFAULT_WINDOW_BYTES
        state = LoaderState(
            dataset.id,
            args.seed,
            args.epoch,
            0,
            shuffle=not args.no_shuffle,
            window=window or None,
            window_bytes=window_bytes or None,
        )
        step, ref = args.step, args.ref
    try:
        found = step_sample_ids(
            dataset,
            state,
            step=step,
            batch_size=args.batch_size,
            world_size=args.world_size,
            rank=args.rank,
            tail=args.tail,
        )
    except (ValueError, IndexError) as exc:  # a step past the epoch, a rank outside it
        raise InvalidRequestError(f"replay: {exc}") from None
    group = args.batch_size * args.world_size
    first = state.cursor + step * group
    member_of = dataset.snapshot.member_index  # a page of the snapshot, not all of them
    ranks: list[dict[str, Any]] = []
    for rank, ids in sorted(found.items()):
        samples = []
        for n, sample_id in enumerate(ids.ids):
            key, _, number = sample_id.rpartition("#")
            member = member_of(key)
            assert member is not None  # the ids come from this snapshot's own members
            index = dataset.snapshot.start_of(member) + int(number)
            padding = n >= len(ids.ids) - ids.padding
            samples.append({"id": sample_id, "index": index, "padding": padding})
        ranks.append({"rank": rank, "samples": samples})
    report = {
        "snapshot": dataset.id,
        "snapshot_ref": ref,
        "seed": state.seed,
        "epoch": state.epoch,
        "cursor": state.cursor,
        "step": step,
        "batch_size": args.batch_size,
        "world_size": args.world_size,
        "positions": [first, min(len(dataset), first + group)],
        "ranks": ranks,
        "open": (
            f"python -c 'from chunkd.client.datasets import Dataset; "
            f'print(Dataset.open("{dataset.id}")[INDEX])\''
        ),
    }
    if args.json:
        _dump(report, out)
        return 0
    print(
        f"{ref} seed {state.seed} epoch {state.epoch} step {step} after cursor "
        f"{state.cursor} (positions {first}..{report['positions'][1]} of the epoch's "
        f"order; batch {args.batch_size} x {args.world_size} ranks)",
        file=out,
    )
    for entry in ranks:
        print(f"rank {entry['rank']}: {len(entry['samples'])} samples", file=out)
        for sample in entry["samples"]:
            pad = "  (padding)" if sample["padding"] else ""
            print(f"  {sample['id']}  [index {sample['index']}]{pad}", file=out)
    print(f"open one: {report['open']}", file=out)
    return 0


_COMMANDS: dict[str, Callable[[Client, argparse.Namespace, TextIO], int]] = {
    "register": _register,
    "ls": _ls,
    "show": _show,
    "diff": _diff,
    "tag": _tag,
    "check": _check,
    "freeze": _freeze,
    "migrate": _migrate,
    "replay": _replay,
}


# -- formatting --------------------------------------------------------------------------


#: how long a freeze or a migration may take (the daemon does the work; it may be TBs)
_LONG = 24 * 3600.0
#: what ``--json`` prints of each answer (docs/datasets.md): the answer's documented
#: fields only, never the socket's own (the request's ``id``, its ``fds``)
_TAG_FIELDS = ("name", "tag", "seq", "version", "snapshot")
_FREEZE_FIELDS = (
    "snapshot",
    "members",
    "chunks",
    "bytes",
    "uploaded",
    "uploaded_bytes",
    "already",
)
_MIGRATE_FIELDS = (
    "snapshot",
    "name",
    "version",
    "created",
    "from",
    "frozen",
    "members",
    "bytes",
    "copied",
    "kept",
)


def _documented(answer: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    return {f: answer.get(f) for f in fields}


def _ask(
    client: Client, op: str, fields: dict[str, Any], *, timeout: float | None = None
) -> dict[str, Any]:
    """The answer's fields of one request (``ok`` left out)."""
    with client.request(op, fields, timeout=timeout) as reply:
        answer = dict(reply.header)
    answer.pop("ok", None)
    return answer


def _dump(doc: Any, out: TextIO) -> None:
    json.dump(doc, out, indent=2, default=str)
    out.write("\n")


def _when(created: object) -> str:
    if not isinstance(created, int | float):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created))
