"""The dataset registry as the inspector shows it: ``datasets``, ``dataset``,
``snapshot``, ``diff``, ``step`` and a snapshot's samples (``DATASET@VERSION#INDEX``).

Everything goes through the client side of the registry: the ``ds_list``,
``ds_versions`` and ``ds_resolve`` socket ops, :func:`chunkd.client.datasets.resolve`,
:class:`~chunkd.client.datasets.Dataset` and
:func:`~chunkd.client.datasets.step_sample_ids` (what ``chunkd dataset ls``, ``show``,
``diff`` and ``replay`` use), so the inspector's answers are the CLI's.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

from chunkd.client.datasets import Dataset, resolve, step_sample_ids
from chunkd.client.datasets.source import PinnedSource
from chunkd.client.inspect.values import AudioCells, encode, tar_file
from chunkd.client.inspect.views.view import file_errors
from chunkd.errors import (
    DatasetFormatError,
    DatasetNotFoundError,
    InvalidRequestError,
    MalformedFileError,
    ResumeStateError,
)
from chunkd.snapshot import Snapshot, parse_ref
from chunkd.snapshot import diff as snapshot_diff

if TYPE_CHECKING:
    from chunkd.client.core import Client

__all__ = ["Registry"]

#: snapshots kept resolved (immutable references only: ids and ``NAME@N``)
_RESOLVED: Final = 8
#: ``dataset`` lists at most this many versions ...
MAX_VERSIONS: Final = 10_000
#: ... and gives samples and bytes for the newest this many (each is resolved)
_SIZED_VERSIONS: Final = 32
#: ``diff`` lists at most this many keys of each kind
MAX_DIFF: Final = 1000
#: ``snapshot`` lists at most this many members a page, and of its excluded files
MAX_MEMBERS: Final = 1000
#: the most datasets one ``datasets`` page lists (each costs one request for its tags)
MAX_DATASETS: Final = 200
#: ``dataset`` of a snapshot id looks for its dataset among at most this many datasets'
#: latest versions (``ds_list`` pages) ...
MAX_OWNER_SCAN: Final = 1000
#: ... then reads at most this many of their older versions (newest first), in at
#: most this many ``ds_versions`` requests ...
OWNER_VERSIONS: Final = 2000
OWNER_REQUESTS: Final = 50
#: ... and stops looking after this many seconds (the worker's op limit is 10 s)
OWNER_SECONDS: Final = 3.0
#: versions a ``ds_versions`` page of that lookup asks for
_OWNER_PAGE: Final = 200
#: ``open`` of a dataset lists its first this many members (``snapshot`` pages the rest)
_OPEN_MEMBERS: Final = 100


class Registry:
    """The registry views of one worker.

    Args:
        client: the worker's client.
    """

    def __init__(self, client: Client) -> None:
        self.client = client
        self._resolved: OrderedDict[str, Dataset] = OrderedDict()

    def clear(self) -> None:
        """Drop the snapshots kept resolved."""
        self._resolved.clear()

    def dataset_of(self, ref: str) -> Dataset:
        """The snapshot ``ref`` names, opened (kept a while when ``ref`` cannot change).

        Raises:
            DatasetNotFoundError, ManifestError, InvalidRequestError: as ``resolve``.
        """
        parsed = parse_ref(ref)
        fixed = parsed.id is not None or parsed.version is not None
        if fixed and ref in self._resolved:
            self._resolved.move_to_end(ref)
            return self._resolved[ref]
        snapshot, header, source = resolve(self.client, ref)
        dataset = Dataset(snapshot, source, header)
        if fixed:
            self._resolved[ref] = dataset
            while len(self._resolved) > _RESOLVED:
                self._resolved.popitem(last=False)
        return dataset

    # -- ops -------------------------------------------------------------------------

    def datasets(self, start_after: str | None, limit: int) -> dict[str, Any]:
        """One page of the registered datasets, each with its latest version's tags."""
        limit = min(limit, MAX_DATASETS)
        with self.client.request("ds_list", {"start_after": start_after, "limit": limit}) as reply:
            entries = list(json.loads(reply.payload or b"[]"))
            token = reply.header.get("next")
        out = []
        for entry in entries:
            latest = entry.get("latest")
            tags: list[str] = []
            if isinstance(latest, int):
                fields: dict[str, Any] = {"name": entry["name"], "limit": 1}
                if latest > 1:
                    fields["start_after"] = latest - 1
                with self.client.request("ds_versions", fields) as reply:
                    versions = list(json.loads(reply.payload or b"[]"))
                tags = list(versions[0].get("tags", [])) if versions else []
            out.append(
                {
                    "name": entry.get("name"),
                    "latest": latest,
                    "snapshot": entry.get("snapshot"),
                    "created": entry.get("created"),
                    "tags": tags,
                    "damaged": entry.get("damaged"),
                }
            )
        return {"datasets": out, "next": token}

    def dataset_named(self, ref: str) -> dict[str, Any]:
        """``dataset`` of any reference: ``NAME``, or ``NAME@V``, ``NAME@TAG`` or a
        snapshot id, which show their dataset with ``marked`` the version they name.

        Raises:
            DatasetNotFoundError: no such name, version or tag; no snapshot has that id
                (one request tells); or no dataset was found to hold it within the
                lookup's bounds (:meth:`owner_of`), the message saying how far it looked.
        """
        from chunkd.snapshot import check_dataset_name

        parsed = parse_ref(ref)
        if parsed.id is None and parsed.version is None and "@" not in ref:
            return self.dataset(check_dataset_name(ref)) | {"marked": None}
        if parsed.id is None:
            header = self.dataset_of(ref).registry
            return self.dataset(str(header.get("name"))) | {"marked": header.get("version")}
        name, version = self.owner_of(parsed.id)
        return self.dataset(name) | {"marked": version}

    def owner_of(self, snapshot_id: str) -> tuple[str, int]:
        """The dataset with a version whose snapshot is ``snapshot_id``, and that version.

        A snapshot does not record the names it is registered under, so this looks, in
        order of cost: (1) the snapshot itself (``ds_resolve`` of the id: one manifest
        read; an id no snapshot has ends here); (2) the latest version of each dataset,
        as ``ds_list`` pages say them (the first :data:`MAX_OWNER_SCAN` datasets); (3)
        older versions, newest first, dataset by dataset in name order, at most
        :data:`OWNER_VERSIONS` of them in all, in at most :data:`OWNER_REQUESTS`
        requests, and for at most :data:`OWNER_SECONDS`.

        Raises:
            DatasetNotFoundError: no snapshot has that id, or none of the versions looked
                at names it (the message says how far the lookup went).
        """
        deadline = time.monotonic() + OWNER_SECONDS
        self.dataset_of(snapshot_id)  # raises DatasetNotFoundError for an unknown id
        latest: list[tuple[str, int]] = []
        token: str | None = None
        listed = 0
        while listed < MAX_OWNER_SCAN:
            listing = {"start_after": token, "limit": min(MAX_DATASETS, MAX_OWNER_SCAN - listed)}
            with self.client.request("ds_list", listing) as reply:
                entries = list(json.loads(reply.payload or b"[]"))
                token = reply.header.get("next")
            listed += len(entries)
            for entry in entries:
                number = entry.get("latest")
                if not isinstance(number, int):
                    continue  # a damaged latest pointer: its older versions may still say
                if entry.get("snapshot") == snapshot_id:
                    return str(entry.get("name")), number
                latest.append((str(entry.get("name")), number))
            if token is None or not entries:
                break
        more_datasets = token is not None
        read = asked = 0
        searched: list[str] = []
        for name, number in latest:
            high = number - 1  # versions 1 .. high are left to look at, newest first
            while high >= 1:
                if (
                    read >= OWNER_VERSIONS
                    or asked >= OWNER_REQUESTS
                    or time.monotonic() >= deadline
                ):
                    raise self._owner_unknown(
                        snapshot_id, len(latest), more_datasets, read, searched, stopped=True
                    )
                limit = min(_OWNER_PAGE, high, OWNER_VERSIONS - read)
                fields: dict[str, Any] = {"name": name, "limit": limit}
                if high - limit >= 1:
                    fields["start_after"] = high - limit
                with self.client.request("ds_versions", fields) as reply:
                    page = list(json.loads(reply.payload or b"[]"))
                read += len(page)
                asked += 1
                if name not in searched:
                    searched.append(name)
                for entry in reversed(page):
                    if entry.get("snapshot") == snapshot_id and isinstance(
                        entry.get("version"), int
                    ):
                        return name, int(entry["version"])
                if not page:
                    break
                high -= limit
        raise self._owner_unknown(
            snapshot_id, len(latest), more_datasets, read, searched, stopped=False
        )

    @staticmethod
    def _owner_unknown(
        snapshot_id: str,
        datasets: int,
        more_datasets: bool,
        read: int,
        searched: list[str],
        *,
        stopped: bool,
    ) -> DatasetNotFoundError:
        """The error of a lookup that found no dataset holding ``snapshot_id``."""
        where = (
            f"{read} older versions, of {len(searched)} datasets ({searched[0]} to {searched[-1]})"
            if searched
            else "no older versions"
        )
        if stopped:
            why = (
                f"the lookup stops after {OWNER_VERSIONS} versions, {OWNER_REQUESTS} "
                f"requests for them or {OWNER_SECONDS:g} s, "
                "so an older version of a later dataset may still hold it"
            )
        elif more_datasets:
            why = f"only the first {MAX_OWNER_SCAN} datasets are looked through"
        else:
            why = "no registered version names it"
        return DatasetNotFoundError(
            f"snapshot {snapshot_id} is in the registry, but no dataset was found to hold it: "
            f"looked at the latest version of {datasets} datasets and at {where}; {why}. "
            f"Open it as ?snapshot={snapshot_id}, or by NAME@VERSION"
        )

    def dataset(self, name: str) -> dict[str, Any]:
        """A dataset's versions, oldest first; the newest are sized (samples, bytes)."""
        versions: list[dict[str, Any]] = []
        token: int | None = None
        more = False
        while True:
            fields: dict[str, Any] = {"name": name, "start_after": token}
            with self.client.request("ds_versions", fields) as reply:
                page = list(json.loads(reply.payload or b"[]"))
                token = reply.header.get("next")
            versions += page
            if token is None:
                break
            if len(versions) >= MAX_VERSIONS:
                more = True
                break
        versions = versions[:MAX_VERSIONS]
        out = []
        for i, entry in enumerate(versions):
            samples = size = None
            # A damaged version (its pointer unreadable) has no snapshot: shown as such.
            if i >= len(versions) - _SIZED_VERSIONS and entry.get("snapshot"):
                snapshot = self.dataset_of(str(entry["snapshot"])).snapshot
                samples, size = len(snapshot), snapshot.total_bytes
            shown = {
                "version": entry.get("version"),
                "snapshot": entry.get("snapshot"),
                "created": entry.get("created"),
                "samples": samples,
                "bytes": size,
                "tags": list(entry.get("tags", [])),
            }
            if entry.get("damaged"):
                shown["damaged"] = entry["damaged"]
            out.append(shown)
        return {"name": name, "versions": out, "more": more}

    def snapshot(self, ref: str, start: int, count: int) -> dict[str, Any]:
        """A snapshot's summary and one page of its members."""
        dataset = self.dataset_of(ref)
        snapshot, header = dataset.snapshot, dataset.registry
        count = min(count, MAX_MEMBERS)
        members = [
            {
                "key": m.key,
                "size": m.size,
                "samples": m.samples,
                "first": snapshot.start_of(i),
                "format": m.format,
            }
            for i, m in enumerate(snapshot.members[start : start + count], start)
        ]
        following = start + count if start + count < len(snapshot.members) else None
        return {
            "ref": ref,
            "snapshot": snapshot.id,
            "name": header.get("name"),
            "version": header.get("version"),
            "tags": list(header.get("tags", [])),
            "created": header.get("created"),
            "backend": snapshot.backend,
            "prefix": snapshot.prefix,
            "format": snapshot.format,
            "samples": len(snapshot),
            "bytes": snapshot.total_bytes,
            "members_total": len(snapshot.members),
            "start": start,
            "members": members,
            "next": following,
            "schema": encode(snapshot.schema_of),
            "excluded": [dict(e) for e in snapshot.excluded[:MAX_MEMBERS]],
            "excluded_total": len(snapshot.excluded),
            "frozen": bool(header.get("frozen")),
        }

    def opened(self, name: str, ref: str, overrides: dict[str, str]) -> dict[str, Any]:
        """``open`` of a dataset reference: its snapshot's summary and first page of
        members (as ``snapshot`` answers), as kind ``snapshot``, ``total`` its samples."""
        from chunkd.client.inspect import rl

        summary = self.snapshot(ref, 0, _OPEN_MEMBERS)
        fields = self.fields_of(ref)
        return summary | {
            "name": name,
            "dataset": summary["name"],
            "kind": "snapshot",
            "size": summary["bytes"],
            "total": summary["samples"],
            "media_type": None,
            "rl": rl.detect(fields, overrides) if fields else None,
        }

    def fields_of(self, ref: str) -> list[str]:
        """The field names of the snapshot's schema (none where its format has none)."""
        schema = self.dataset_of(ref).snapshot.schema_of
        return [
            str(f[0]) if isinstance(f, list | tuple) and f else str(f)
            for f in (schema if isinstance(schema, list) else [])
        ]

    def samples_of(self, ref: str) -> int:
        """How many samples the snapshot holds."""
        return len(self.dataset_of(ref).snapshot)

    def rows(
        self, ref: str, start: int, columns: list[str] | None
    ) -> tuple[int, Iterator[tuple[int, Any]]]:
        """The snapshot's sample count, and its samples from global index ``start`` on,
        each as ``sample`` gives its value (only ``columns`` of a record, if given).

        Raises:
            InvalidRequestError: ``start`` is past the last sample.
        """
        total = len(self.dataset_of(ref).snapshot)
        if not 0 <= start < total:
            raise InvalidRequestError(
                f"sample {start} of {ref}, which holds {total} samples: ask for a start below that"
            )

        def samples() -> Iterator[tuple[int, Any]]:
            cells = AudioCells()  # this page's audio headers
            for index in range(start, total):
                value = self.sample(f"{ref}#{index}", ref, index, cells)["value"]
                if columns is not None and isinstance(value, dict):
                    value = {k: v for k, v in value.items() if k in columns}
                yield index, value

        return total, samples()

    def diff(self, a: str, b: str) -> dict[str, Any]:
        """What differs between two snapshots, members matched by their key below each
        snapshot's prefix (as ``chunkd dataset diff`` has it)."""
        left, right = self.dataset_of(a), self.dataset_of(b)
        left_snapshot, right_snapshot = left.snapshot, right.snapshot
        # A frozen snapshot's record tells its members' hashes (as chunkd dataset diff).
        frozen = (getattr(left.source, "record", None), getattr(right.source, "record", None))
        found = snapshot_diff(left_snapshot, right_snapshot, frozen=frozen)
        more = {}
        for part in ("added", "removed", "changed", "unknown"):
            more[part] = max(0, len(found[part]) - MAX_DIFF)
            found[part] = found[part][:MAX_DIFF]
        same = found.pop("unchanged")  # here: how many members are the same
        return found | {
            "a": a,
            "b": b,
            "snapshots": [left_snapshot.id, right_snapshot.id],
            "more": more,
            "same": same,
        }

    def step(
        self,
        ref: str,
        *,
        state: str | None,
        step: int,
        batch_size: int,
        world_size: int,
        rank: int | None,
        seed: int | None,
        epoch: int,
        shuffle: bool,
        window: int | None,
        window_bytes: int | None,
        tail: str,
    ) -> dict[str, Any]:
        """The sample ids step ``step`` read, per rank (as ``chunkd dataset replay``)."""
        from chunkd.client.datasets.epoch import DEFAULT_WINDOW, DEFAULT_WINDOW_BYTES
        from chunkd.client.datasets.state import LoaderState

        if state is not None:
            loaded = LoaderState.parse(state)
            dataset = self.dataset_of(ref or loaded.snapshot)
        else:
            if seed is None:
                raise InvalidRequestError("step needs seed (or state: a saved loader state)")
            dataset = self.dataset_of(ref)
            loaded = LoaderState(
                dataset.id,
                seed,
                epoch,
                0,
                shuffle=shuffle,
                window=(DEFAULT_WINDOW if window is None else window) or None,
                window_bytes=(DEFAULT_WINDOW_BYTES if window_bytes is None else window_bytes)
                or None,
            )
        try:
            found = step_sample_ids(
                dataset,
                loaded,
                step=step,
                batch_size=batch_size,
                world_size=world_size,
                rank=rank,
                tail=tail,  # type: ignore[arg-type]  # checked by the caller
            )
        except ResumeStateError:
            raise
        except (ValueError, IndexError) as exc:  # a step past the epoch, a rank outside it
            raise InvalidRequestError(f"step {step} of {ref}: {exc}") from None
        group = batch_size * world_size
        first = loaded.cursor + step * group
        return {
            "ref": ref,
            "snapshot": dataset.id,
            "backend": dataset.snapshot.backend,
            "step": step,
            "seed": loaded.seed,
            "epoch": loaded.epoch,
            "cursor": loaded.cursor,
            "positions": [first, min(len(dataset), first + group)],
            "ranks": {
                str(r): {"ids": list(ids.ids), "padding": ids.padding}
                for r, ids in sorted(found.items())
            },
        }

    def sample(
        self, sample_id: str, ref: str, index: int, cells: AudioCells | None = None
    ) -> dict[str, Any]:
        """Sample ``index`` (global, in the snapshot) of ``ref`` (``cells``: the audio
        headers its page may still read; None: this sample alone)."""
        dataset = self.dataset_of(ref)
        snapshot = dataset.snapshot
        if not 0 <= index < len(snapshot):
            raise InvalidRequestError(
                f"sample {index} of {ref}, which holds {len(snapshot)} samples: ask for an "
                "index below that"
            )
        member_index, local = snapshot.locate(index)
        member = snapshot.members[member_index]
        name = dataset.source.name(member)
        try:
            with file_errors(name, f"sample {local} cannot be read as {member.format}"):
                value = self._value(dataset, snapshot, member_index, local, name, cells)
        except DatasetFormatError as exc:
            raise MalformedFileError(str(exc)) from None
        header = dataset.registry
        return {
            "id": sample_id,
            "name": name,
            "index": local,
            "kind": member.format,
            "value": value,
            "member": member.key,
            "dataset": {
                "ref": ref,
                "name": header.get("name"),
                "version": header.get("version"),
                "snapshot": snapshot.id,
                "index": index,
                "sample": dataset.sample_id(member_index, local),
            },
        }

    def _value(
        self,
        dataset: Dataset,
        snapshot: Snapshot,
        member_index: int,
        local: int,
        name: str,
        cells: AudioCells | None,
    ) -> Any:
        member = snapshot.members[member_index]
        ref = {"sample": f"{snapshot.id}#{snapshot.start_of(member_index) + local}"}
        if member.format == "wds" and isinstance(dataset.source, PinnedSource):
            # read in place: each file as a range of the tar, as the object's view has it
            key, files = member.meta["index"][local]
            value: dict[str, Any] = {"__key__": key}
            source = dataset.source
            for ext, offset, size in files:
                value[ext] = tar_file(
                    lambda o, n: source.read(member, o, n),
                    name,
                    ext,
                    int(offset),
                    int(size),
                    cells,
                )
            return value
        raw = dataset.read(member_index, local)
        if member.format == "jsonl":
            try:
                value = json.loads(bytes(raw))
            except (ValueError, RecursionError) as exc:
                raise MalformedFileError(
                    f"{name}: line {local} is not JSON ({exc}); open the object with "
                    "format=text to see it as it is"
                ) from None
            return encode(value, ref)
        return encode(raw, ref)
