"""Bulk dataset jobs on a Ray cluster: registration and checks run as Ray tasks.

``chunkd dataset register NAME BACKEND/PREFIX --ray [ADDRESS]`` (:func:`register_on_ray`)
and ``chunkd dataset check REF --ray [ADDRESS]`` (:func:`check_on_ray`) spread their work
over the nodes of a Ray cluster. Ray schedules the tasks and retries them; chunkd writes
no scheduler of its own. Every node of the cluster runs a chunkd daemon, and each task
talks to the daemon of the node it runs on, through its local socket (``$CHUNKD_SOCKET``,
else the default paths: :mod:`chunkd.client.protocol.discovery`), so each node reads
through its own cache and the nodes share chunks as peers do. Ray is an optional extra
(``pip install 'chunkd[ray]'``, on the driver and on every node); the local engine stays
the default.

Registration, step by step:

1. The driver (the process that runs the command, on a node of the cluster) lists the
   prefix through its node's daemon, in key order, each file pinned at the version the
   listing saw (as a local registration lists it).
2. It cuts the listing into batches of at most :data:`BATCH_MEMBERS` consecutive keys (a
   key range each) and submits one task per batch (:func:`scan_batch`), at most
   :data:`TASKS_PER_CPU` times the cluster's CPUs (and at most :data:`MAX_IN_FLIGHT`) in
   flight at once: a listing of a million files is never a million tasks at once.
3. A task scans its members' metadata (Parquet footers, tar headers, ...; the same scan of
   each format as a local registration, :data:`TASK_CONCURRENCY` members at once) and
   returns their member entries: at most :data:`BATCH_MEMBERS` of them.
4. The driver takes the batches back in key order, each exactly once, and builds the
   snapshot from their members as a local registration does (the same schema, the same
   pages: page boundaries depend on the members alone), so a registration on Ray and a
   local one of the same files give the same snapshot id. It commits once, at the end.

A task whose worker dies (a node lost, a process killed) is retried by Ray, up to
:data:`MAX_RETRIES` times, and so is one whose daemon or backend was briefly unavailable;
a file that cannot be read as its format is not retried (it fails the registration, or
is excluded with ``skip_bad``). A retry scans its batch again and the driver keeps one
answer per batch, so no member is listed twice. Nothing is written to the registry
before every batch is in: a job that fails leaves no version, partial or whole.

A check splits the snapshot's members into runs of whole pages (of about
:data:`CHECK_MEMBERS` members: a schema-1 snapshot, which has no pages, is cut every
:data:`CHECK_MEMBERS` members). Each task (:func:`check_slice`) resolves the snapshot by
its id through its node's daemon and runs the per-member rules and its format's rules on
its run; the driver adds the rules of the dataset as a whole (excluded files, many tiny
files, from the sizes the tasks return: 8 bytes a member) and groups the findings as a
local check does. A format rule that compares members with each other (WebDataset keys
found in two tars) compares the members of one run only.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import statistics
import sys
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from chunkd.client.datasets.check import TINY_BYTES, TINY_FILES, Finding, size_text, summarize
from chunkd.client.datasets.formats import format_of
from chunkd.client.datasets.register import (
    Progress,
    _candidates,
    _split,
    snapshot_of,
)
from chunkd.client.datasets.scan import CONCURRENCY, scan_members
from chunkd.errors import (
    BackendUnavailableError,
    ChunkdError,
    DaemonUnavailableError,
    DatasetError,
    DatasetFormatError,
    InvalidRequestError,
    OwnerSilentError,
)
from chunkd.snapshot import Member, Snapshot

if TYPE_CHECKING:
    from chunkd.client.core import Client

__all__ = [
    "BATCH_MEMBERS",
    "CHECK_MEMBERS",
    "MAX_IN_FLIGHT",
    "MAX_RETRIES",
    "RAY_MISSING",
    "TASKS_PER_CPU",
    "TASK_CONCURRENCY",
    "RayRun",
    "check_on_ray",
    "check_slice",
    "connected",
    "import_ray",
    "register_on_ray",
    "scan_batch",
]

#: the members one registration task scans (and returns the entries of), at most
BATCH_MEMBERS: Final = 1024
#: the members one check task checks, about (whole pages: a page holds up to 16,384)
CHECK_MEMBERS: Final = 4096
#: tasks in flight per CPU of the cluster ...
TASKS_PER_CPU: Final = 2
#: ... and at most this many: what the driver holds is bounded by it
MAX_IN_FLIGHT: Final = 256
#: how often Ray runs a task again after its worker died or its daemon was unavailable
MAX_RETRIES: Final = 3
#: a registration task's reads at once, as a local registration reads
#: (:func:`~chunkd.client.datasets.scan.scan_members`: batches of files, each worker
#: thread on its own connection)
TASK_CONCURRENCY: Final = CONCURRENCY
#: what a task's failure of these means is "try again": Ray retries them
_TRANSIENT: Final = (BackendUnavailableError, DaemonUnavailableError, OwnerSilentError)
#: what to do when Ray is not there
RAY_MISSING: Final = (
    "--ray needs Ray, on this machine and on every node of the cluster: pip install 'chunkd[ray]'"
)


@dataclass(frozen=True, slots=True)
class RayRun:
    """How a bulk job ran on Ray.

    Attributes:
        address: the cluster's address, as Ray gives it.
        tasks: the tasks the job ran (one per batch or run of pages; retries not counted).
        nodes: the distinct nodes its tasks' answers came from.
    """

    address: str
    tasks: int
    nodes: int

    def to_json(self) -> dict[str, Any]:
        """The run as ``--json`` prints it."""
        return {"address": self.address, "tasks": self.tasks, "nodes": self.nodes}


def import_ray() -> Any:
    """The ``ray`` module.

    Raises:
        InvalidRequestError: Ray is not installed (:data:`RAY_MISSING` says how to).
    """
    try:
        return importlib.import_module("ray")
    except ImportError as exc:
        raise InvalidRequestError(f"{RAY_MISSING} ({exc})") from None


@contextlib.contextmanager
def connected(address: str | None = None) -> Iterator[Any]:
    """The ``ray`` module, connected to the cluster at ``address`` for the block.

    Where this process is connected already (``ray.init`` was called), that connection
    is used and kept; otherwise the block connects as a driver and disconnects at its
    end (it never starts or stops a cluster). While it is connected so, what Ray prints
    to its driver (a worker that died, ...) goes to stderr: Ray writes it to stdout,
    where ``--json`` prints the answer.

    Args:
        address: ``HOST:PORT`` of the cluster's head, ``auto`` (the cluster this node
            belongs to: ``$RAY_ADDRESS``, else the one ``ray start`` started here) or
            None (the connection in place, else ``auto``).

    Raises:
        InvalidRequestError: Ray is not installed, or no cluster answers at ``address``.
    """
    ray = import_ray()
    if ray.is_initialized() and address is None:
        yield ray
        return
    where = address or "auto"
    try:
        ray.init(address=where, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise InvalidRequestError(
            f"--ray: no Ray cluster answers at {where} ({exc}); start one "
            "(`ray start --head` on one node, `ray start --address HEAD:PORT` on the others) "
            "and run this on one of its nodes, or give its address (--ray HOST:PORT)"
        ) from None
    with contextlib.redirect_stdout(sys.stderr):
        try:
            yield ray
        finally:
            ray.shutdown()


# -- registration ------------------------------------------------------------------------


def register_on_ray(
    client: Client,
    prefix: str,
    *,
    fmt: str = "auto",
    options: Mapping[str, Any] | None = None,
    skip_bad: bool = False,
    address: str | None = None,
    batch: int = BATCH_MEMBERS,
    concurrency: int = TASK_CONCURRENCY,
    progress: Callable[[Progress], None] | None = None,
    retries: int = MAX_RETRIES,
    task: Callable[..., dict[str, Any]] | None = None,
) -> tuple[Snapshot, RayRun]:
    """The snapshot of ``BACKEND/PREFIX``, its members scanned by Ray tasks (the module
    docstring), and how the job ran. Nothing is committed: the caller commits it.

    Args:
        client: the driver node's daemon (it lists the prefix).
        prefix: ``BACKEND/PREFIX``, as :func:`~chunkd.client.datasets.register.scan_prefix`
            takes it; ``fmt``, ``options`` and ``skip_bad`` as there too.
        address: the Ray cluster (:func:`connected`).
        batch: members a task scans, at most (1 to :data:`BATCH_MEMBERS`).
        concurrency: members a task reads at once.
        progress: called with the progress, from this thread, as batches land.
        retries: how often Ray runs a failed task again (0 to :data:`MAX_RETRIES`).
        task: the task's function (default :func:`scan_batch`, whose arguments it takes;
            a caller may wrap it).

    Raises:
        InvalidRequestError: Ray is not installed, no cluster answers, or ``batch`` is
            out of its bounds.
        DatasetFormatError: a file cannot be read as its format (without ``skip_bad``),
            or the prefix holds no member of the format.
        SnapshotDriftError: a file changed after it was listed; register again.
        DatasetError: a task failed more than :data:`MAX_RETRIES` times (nothing is
            committed).
    """
    if not 1 <= batch <= BATCH_MEMBERS:
        raise InvalidRequestError(f"a batch is 1 to {BATCH_MEMBERS} members; got {batch}")
    _check_retries(retries)
    backend, key_prefix = _split(prefix)
    opts = dict(options or {})
    state = Progress()
    with connected(address) as ray:
        remote = ray.remote(task or scan_batch).options(
            num_cpus=1,
            max_retries=retries,
            retry_exceptions=list(_TRANSIENT),
            scheduling_strategy="SPREAD",
        )
        jobs = _Jobs(ray, _in_flight(ray), retries)

        def land(answer: dict[str, Any]) -> Iterator[Member | dict[str, str]]:
            for entry in answer["members"]:
                yield Member.from_json(entry, "a task's member")
            yield from answer["excluded"]
            state.scanned += len(answer["members"]) + len(answer["excluded"])
            state.excluded += len(answer["excluded"])
            if progress is not None:
                progress(state)

        def found() -> Iterator[Member | dict[str, str]]:
            listed = _candidates(client, backend, key_prefix, fmt, opts)
            for entries, member_options in _batches(listed, batch, state):
                first, last = entries[0]["key"], entries[-1]["key"]
                what = f"scanning {backend}/{first} .. {last} ({len(entries)} files)"
                ref = remote.remote(backend, entries, member_options, skip_bad, concurrency)
                for answer in jobs.submit(ref, what):
                    yield from land(answer)
            state.listing_done = True
            for answer in jobs.drain():
                yield from land(answer)

        # The members come in key order, batch after batch: the snapshot is built from
        # them as a local registration's is (settled, then cut into pages), so the same
        # files give the same snapshot id however the work was split.
        snapshot = snapshot_of(backend, key_prefix, found(), what=prefix, fmt=fmt)
        run = RayRun(_address(ray), jobs.count, len(jobs.nodes))
    return snapshot, run


def scan_batch(
    backend: str,
    entries: list[dict[str, Any]],
    options: list[dict[str, Any]],
    skip_bad: bool,
    concurrency: int = TASK_CONCURRENCY,
) -> dict[str, Any]:
    """One registration task: the members of ``entries`` (listed, not yet scanned)
    scanned through this node's daemon.

    Args:
        backend: the members' backend.
        entries: member entries as listed (key, size, version, format), in key order.
        options: each member's format options.
        skip_bad: a file that cannot be read as its format is excluded, not an error.
        concurrency: members read at once.

    Returns:
        ``{"members": [entry, ...], "excluded": [{"key", "error"}, ...], "node": ID}``:
        the scanned members' entries in key order, the files left out, and the Ray node
        it ran on.

    Raises:
        DatasetFormatError: a file cannot be read as its format (without ``skip_bad``).
        SnapshotDriftError: a file changed since it was listed.
        DaemonUnavailableError: no daemon answers on this node.
    """
    from chunkd.client.core import Client

    members = [Member.from_json(entry, "a listed member") for entry in entries]
    with Client() as client:
        scanned = scan_members(
            client,
            backend,
            zip(members, options, strict=True),
            skip_bad=skip_bad,
            concurrency=concurrency,
        )
    return {
        "members": [m.to_json() for m in scanned.members],
        "excluded": scanned.excluded,
        "node": _node_id(),
    }


def _batches(
    listed: Iterable[tuple[Member, dict[str, Any]]], size: int, state: Progress
) -> Iterator[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """The listing cut into runs of at most ``size`` consecutive members: (their entries,
    their options)."""
    entries: list[dict[str, Any]] = []
    options: list[dict[str, Any]] = []
    for member, member_options in listed:
        state.listed += 1
        state.bytes += member.size
        entries.append(member.to_json())
        options.append(member_options)
        if len(entries) == size:
            yield entries, options
            entries, options = [], []
    if entries:
        yield entries, options


# -- checks ------------------------------------------------------------------------------


def check_on_ray(
    client: Client,
    snapshot: Snapshot,
    *,
    deep: bool = False,
    address: str | None = None,
    members_per_task: int = CHECK_MEMBERS,
    retries: int = MAX_RETRIES,
    task: Callable[..., dict[str, Any]] | None = None,
) -> tuple[list[Finding], RayRun]:
    """What :func:`~chunkd.client.datasets.check.check` finds in ``snapshot``, its
    members checked by Ray tasks (the module docstring), and how the job ran.

    Args:
        client: the driver node's daemon.
        snapshot: the snapshot (resolved through ``client``: each task resolves it again
            by its id, through its own node's daemon).
        deep: as :func:`~chunkd.client.datasets.check.check`'s.
        address: the Ray cluster (:func:`connected`).
        members_per_task: about how many members a task checks (whole pages).
        retries: how often Ray runs a failed task again (0 to :data:`MAX_RETRIES`).
        task: the task's function (default :func:`check_slice`).

    Raises:
        InvalidRequestError: Ray is not installed, or no cluster answers.
        DatasetError: a task failed more than :data:`MAX_RETRIES` times.
    """
    del client  # the tasks resolve the snapshot through their own nodes' daemons
    if members_per_task < 1:
        raise InvalidRequestError(f"a check task takes 1 member or more; got {members_per_task}")
    _check_retries(retries)
    empties: list[Finding] = []
    rules: list[Finding] = []
    sizes = array("q")
    with connected(address) as ray:
        remote = ray.remote(task or check_slice).options(
            num_cpus=1,
            max_retries=retries,
            retry_exceptions=list(_TRANSIENT),
            scheduling_strategy="SPREAD",
        )
        jobs = _Jobs(ray, _in_flight(ray), retries)

        def land(answer: dict[str, Any]) -> None:
            for level, member, code, message, count, examples in answer["findings"]:
                finding = Finding(level, member, code, message, count, tuple(examples))
                (empties if code == "empty-member" else rules).append(finding)
            sizes.frombytes(answer["sizes"])

        for start, stop in _slices(snapshot, members_per_task):
            what = f"checking members {start} .. {stop - 1} of snapshot {snapshot.id}"
            for answer in jobs.submit(remote.remote(snapshot.id, start, stop, deep), what):
                land(answer)
        for answer in jobs.drain():
            land(answer)
        run = RayRun(_address(ray), jobs.count, len(jobs.nodes))
    found = [
        Finding(
            "warning",
            str(entry.get("key")),
            "excluded",
            f"left out at registration: {entry.get('error', 'unreadable')}",
        )
        for entry in snapshot.excluded
    ]
    found += empties
    if len(sizes) > TINY_FILES and statistics.median(sizes) < TINY_BYTES:
        median = int(statistics.median(sizes))
        found.append(
            Finding(
                "warning",
                None,
                "many-tiny-files",
                f"{len(sizes)} files of median size {size_text(median)}: per-file costs "
                "(listing, version checks, one request each) dominate; pack them into "
                "shards of 64 MiB to 1 GiB",
            )
        )
    return summarize(found + rules), run


def check_slice(snapshot_id: str, start: int, stop: int, deep: bool) -> dict[str, Any]:
    """One check task: members ``start .. stop - 1`` of snapshot ``snapshot_id``, checked
    through this node's daemon (the per-member rules and their format's rules).

    Returns:
        ``{"findings": [(level, member, code, message, count, examples), ...],
        "sizes": bytes, "node": ID}``: what it found, the members' sizes (``array('q')``
        bytes, for the rules of the dataset as a whole) and the Ray node it ran on.

    Raises:
        DatasetNotFoundError: the snapshot is not known to this node's registry.
        DaemonUnavailableError: no daemon answers on this node.
    """
    from chunkd.client.core import Client
    from chunkd.client.datasets.dataset import resolve

    with Client() as client:
        snapshot, _, source = resolve(client, snapshot_id)
        members = [snapshot.members[i] for i in range(start, min(stop, len(snapshot.members)))]
        found = [
            Finding("warning", m.key, "empty-member", "holds no samples")
            for m in members
            if m.samples == 0
        ]
        by_format: dict[str, list[Member]] = {}
        for member in members:
            by_format.setdefault(member.format, []).append(member)
        for name, mine in by_format.items():
            try:
                fmt = format_of(name)
            except DatasetFormatError as exc:
                found += [Finding("error", m.key, "unreadable", str(exc)) for m in mine]
                continue
            found += list(fmt.check(source, mine, snapshot.schema_of, deep=deep))
    return {
        "findings": [
            (f.level, f.member, f.code, f.message, f.count, list(f.examples)) for f in found
        ],
        "sizes": array("q", (m.size for m in members)).tobytes(),
        "node": _node_id(),
    }


def _slices(snapshot: Snapshot, size: int) -> Iterator[tuple[int, int]]:
    """Runs ``(start, stop)`` of the snapshot's members: whole pages of about ``size``
    members together (a schema-1 snapshot: every ``size`` members)."""
    pages = snapshot.pages
    total = len(snapshot.members)
    if not pages:
        for start in range(0, total, size):
            yield start, min(total, start + size)
        return
    start = stop = 0
    for page in pages:
        stop += page.members
        if stop - start >= size:
            yield start, stop
            start = stop
    if stop > start:
        yield start, stop


# -- the tasks in flight -----------------------------------------------------------------


class _Jobs:
    """Tasks in flight, at most ``limit``; their answers come back in submission order,
    each once (a retried task's one answer), with a failure as chunkd's error."""

    def __init__(self, ray: Any, limit: int, retries: int) -> None:
        self._ray = ray
        self._limit = limit
        self._retries = retries
        self._pending: dict[Any, tuple[int, str]] = {}  # ref -> (its number, what it does)
        self._done: dict[int, dict[str, Any]] = {}
        self._next = 0
        self.count = 0
        self.nodes: set[str] = set()

    def submit(self, ref: Any, what: str) -> Iterator[dict[str, Any]]:
        """Add a task; the answers that are now next in order."""
        self._pending[ref] = (self.count, what)
        self.count += 1
        while len(self._pending) >= self._limit:
            self._wait()
        yield from self._ready()

    def drain(self) -> Iterator[dict[str, Any]]:
        """The rest of the answers, in order, as they come."""
        while self._pending:
            self._wait()
            yield from self._ready()
        yield from self._ready()

    def _ready(self) -> Iterator[dict[str, Any]]:
        while self._next in self._done:
            answer = self._done.pop(self._next)
            self._next += 1
            yield answer

    def _wait(self) -> None:
        ready, _ = self._ray.wait(list(self._pending), num_returns=1)
        ref = ready[0]
        number, what = self._pending.pop(ref)
        try:
            answer = self._ray.get(ref)
        except Exception as exc:
            self._cancel()
            raise _failure(self._ray, exc, what, self._retries) from None
        self.nodes.add(str(answer.get("node")))
        self._done[number] = answer

    def _cancel(self) -> None:
        for ref in self._pending:
            with contextlib.suppress(Exception):
                self._ray.cancel(ref, force=True)
        self._pending.clear()


def _check_retries(retries: int) -> None:
    if not 0 <= retries <= MAX_RETRIES:
        raise InvalidRequestError(f"retries are 0 to {MAX_RETRIES}; got {retries}")


def _failure(ray: Any, exc: BaseException, what: str, retries: int) -> ChunkdError:
    """chunkd's error for a task that failed (after Ray's retries)."""
    cause = getattr(exc, "cause", None)
    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(cause, ChunkdError):
        return cause  # the task's own error: a file that cannot be read, a drift, ...
    kind = type(exc).__name__
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else kind
    return DatasetError(
        f"a Ray task {what} failed after {retries} retries ({kind}: {first}); "
        "nothing was committed: run the command again"
    )


def _in_flight(ray: Any) -> int:
    """Tasks in flight at once: :data:`TASKS_PER_CPU` a CPU of the cluster, bounded."""
    cpus = int(ray.cluster_resources().get("CPU", 1))
    return max(2, min(MAX_IN_FLIGHT, TASKS_PER_CPU * max(1, cpus)))


def _address(ray: Any) -> str:
    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:  # an older Ray's context: the address is a nicety of the report
        return "?"


def _node_id() -> str:
    """The Ray node this task runs on."""
    ray = import_ray()
    return str(ray.get_runtime_context().get_node_id())
