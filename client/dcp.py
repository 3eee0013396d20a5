"""``torch.distributed.checkpoint`` (DCP) storage on chunkd's checkpoint path.

::

    import torch.distributed.checkpoint as dcp
    from chunkd.client.dcp import ChunkdStorageReader, ChunkdStorageWriter

    dcp.save(state_dict, storage_writer=ChunkdStorageWriter("ckpt/run1/step-100"))
    dcp.load(state_dict, storage_reader=ChunkdStorageReader("ckpt/run1/step-100"))

DCP plans which rank writes what (each rank its own shards of a DTensor, a replicated
tensor by one rank only) and how a checkpoint is resharded on load; chunkd stores the
bytes. Each rank's items go to the daemon as one part of a chunkd checkpoint
(:func:`chunkd.client.checkpoint.async_save` with a save id every rank shares), and
the coordinator commits the checkpoint once every part is in the backend, with DCP's
:class:`~torch.distributed.checkpoint.metadata.Metadata` (pickled, base64) in the
manifest under ``"dcp_metadata"``. Loading reads only the chunks of the values a rank
needs: a rank that loads a quarter of a tensor fetches the parts it overlaps.

Where an item is kept: in part ``p`` (the rank's position in DCP's global plan) under
the key ``FQN`` (bytes) or ``FQN@OFFSETS`` (a tensor shard at those offsets, e.g.
``"layers.0.w@128,0"``); each ``WriteResult.storage_data`` and so each entry of
``Metadata.storage_data`` is the tuple ``(p, key)``. Errors name these keys: a damaged
chunk fails the load with :class:`~chunkd.errors.IntegrityError` naming the values
it holds. DCP reports a rank's failure wrapped in its ``CheckpointException``, whose
``failures`` maps each failed rank to the chunkd error.

What is not supported: ``use_collectives=False`` (chunkd commits one manifest for
all ranks) and save-plan caching (``DefaultSavePlanner(enable_plan_caching=True)``
would hand ranks the save id of an earlier save).

Loading unpickles the DCP metadata stored in the checkpoint, as DCP's own
``FileSystemReader`` does: load only checkpoints from backends you trust.

This module imports torch and numpy when it is imported; ``import chunkd.client``
imports neither.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import os
import pickle
import re
import uuid
from collections.abc import Iterator
from typing import Any, Final

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from chunkd.client import checkpoint
from chunkd.client.core import Client
from chunkd.client.protocol import DURABILITY_LEVELS
from chunkd.errors import CheckpointError, CheckpointExistsError, CheckpointNotFoundError

__all__ = ["METADATA_KEY", "ChunkdStorageReader", "ChunkdStorageWriter"]

#: the manifest key that holds DCP's metadata (pickled, then base64)
METADATA_KEY: Final = "dcp_metadata"
#: a load decodes at most about this many bytes of one part before copying them out
_READ_BATCH_BYTES: Final = 256 << 20
_NAME_RE: Final = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}/[^/].*")


@dataclasses.dataclass(frozen=True)
class _RankPlan:
    """What the coordinator tells each rank (``SavePlan.storage_data``)."""

    save_id: str
    #: this rank's part of the checkpoint: its position in the global plan
    part: int
    world_size: int


def _storage_key(index: MetadataIndex) -> str:
    """The key an item is saved under in its part: ``FQN`` or ``FQN@OFFSETS``."""
    if index.offset is None:
        return index.fqn
    return f"{index.fqn}@{','.join(str(o) for o in index.offset)}"


def _completed(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class ChunkdStorageWriter(StorageWriter):
    """Saves a DCP checkpoint as chunkd checkpoint ``name`` (``BACKEND/PATH``).

    DCP calls it in this order (``dcp.save``; one instance per rank)::

        0. (all ranks)   reset(checkpoint_id), if dcp.save was given a checkpoint_id:
                         it replaces ``name``
        1. (all ranks)   set_up_storage_writer(is_coordinator)
        2. (all ranks)   prepare_local_plan(plan)        -> the plan, unchanged
        3. (coordinator) prepare_global_plan(plans)      -> checks that the name is
                         free (unless ``overwrite``), makes one save id and gives
                         each rank its part number in ``SavePlan.storage_data``
        4. (all ranks)   write_data(plan, planner)       -> stages the rank's items
                         into the daemon as one part (commit="none") and waits until
                         it reached ``durability``
        5. (coordinator) finish(metadata, results)       -> commits the manifest,
                         with DCP's metadata in it, once every part is in the backend

    The checkpoint exists from step 5 on; a save that fails before leaves no
    checkpoint (its parts go at a later ``chunkd gc``). ``dcp.save`` returns after
    step 5 on every rank, so it always waits for the upload: a ``durability`` below
    ``"remote"`` only moves that wait from ``write_data`` into the commit, which must
    then finish within the client's timeout.

    Args:
        name: ``BACKEND/PATH`` on a writable backend.
        durability: what ``write_data`` waits for: ``"staged"``, ``"local"`` or
            ``"remote"`` (default).
        overwrite: replace a checkpoint of that name (default: fail with
            :class:`~chunkd.errors.CheckpointExistsError` before anything is written).
        client: the daemon's client (default: one per process, found through
            ``$CHUNKD_SOCKET``).
    """

    def __init__(
        self,
        name: str,
        *,
        durability: str = "remote",
        overwrite: bool = False,
        client: Client | None = None,
    ) -> None:
        super().__init__()
        if durability not in DURABILITY_LEVELS:
            raise ValueError(f"durability must be one of {DURABILITY_LEVELS}; got {durability!r}")
        self.name = name
        self.durability = durability
        self.overwrite = overwrite
        self.client = client
        self.is_coordinator = False
        #: set on the coordinator by prepare_global_plan, on every rank by write_data
        self.save_id: str | None = None
        self.world_size: int | None = None

    @property
    def checkpoint_id(self) -> str:
        """The chunkd checkpoint name (DCP logs it)."""
        return self.name

    def reset(self, checkpoint_id: str | os.PathLike[Any] | None = None) -> None:
        # docstring inherited
        if checkpoint_id:
            self.name = os.fspath(checkpoint_id)
        self.save_id = None
        self.world_size = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # docstring inherited
        if kwargs.get("use_collectives", True) is False:
            raise CheckpointError(
                f"saving {self.name}: ChunkdStorageWriter commits one manifest for all "
                "ranks and needs DCP's collectives; save with use_collectives=True"
            )
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # docstring inherited
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # docstring inherited
        if not all(getattr(plan, "usable", True) for plan in plans):
            raise CheckpointError(
                f"saving {self.name}: a cached save plan would reuse the save id of an "
                "earlier save; ChunkdStorageWriter does not support "
                "DefaultSavePlanner(enable_plan_caching=True)"
            )
        if not self.overwrite:
            self._check_free()
        self.save_id = uuid.uuid4().hex
        self.world_size = len(plans)
        return [
            dataclasses.replace(plan, storage_data=_RankPlan(self.save_id, part, len(plans)))
            for part, plan in enumerate(plans)
        ]

    def _check_free(self) -> None:
        try:
            checkpoint.manifest(self.name, client=self.client)
        except CheckpointNotFoundError:
            return
        raise CheckpointExistsError(
            f"checkpoint {self.name} exists; pass ChunkdStorageWriter(..., overwrite=True) "
            "to replace it"
        )

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        # docstring inherited
        where = plan.storage_data
        if not isinstance(where, _RankPlan):
            raise CheckpointError(
                f"saving {self.name}: the plan carries no chunkd part (storage_data is "
                f"{where!r}); ChunkdStorageWriter.prepare_global_plan did not run"
            )
        self.save_id, self.world_size = where.save_id, where.world_size
        values: dict[str, Any] = {}
        results: list[WriteResult] = []
        for item in plan.items:
            key = _storage_key(item.index)
            if key in values:
                raise CheckpointError(
                    f"saving {self.name}: two items of rank part {where.part} map to the "
                    f"key {key!r}; rename one of them"
                )
            data = planner.resolve_data(item)
            if isinstance(data, io.BytesIO):
                raw = data.getvalue()
                # an array, not bytes: its bytes go into chunks, not the part's JSON
                values[key] = np.frombuffer(raw, dtype=np.uint8)
                size = len(raw)
            else:
                tensor = data.detach()
                values[key] = tensor
                size = tensor.numel() * tensor.element_size()
            results.append(
                WriteResult(index=item.index, size_in_bytes=size, storage_data=(where.part, key))
            )
        handle = checkpoint.async_save(
            values,
            self.name,
            durability=self.durability,
            overwrite=self.overwrite,
            rank=where.part,
            world_size=where.world_size,
            save_id=where.save_id,
            client=self.client,
            _commit="none",
        )
        del values  # staged: the tensors may change from here on
        handle.result()
        return _completed(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # docstring inherited
        if self.save_id is None or self.world_size is None:
            raise CheckpointError(
                f"committing {self.name}: this writer made no save id; finish() runs on "
                "the coordinator after prepare_global_plan()"
            )
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        metadata.storage_meta = self.storage_meta()
        blob = base64.b64encode(pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL))
        checkpoint.commit(
            self.name,
            self.save_id,
            self.world_size,
            overwrite=self.overwrite,
            extra={METADATA_KEY: blob.decode()},
            client=self.client,
        )

    def storage_meta(self) -> StorageMeta | None:
        # docstring inherited
        return StorageMeta(checkpoint_id=self.name, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[Any]) -> bool:
        """Whether ``checkpoint_id`` has the form of a chunkd name, ``BACKEND/PATH``."""
        return isinstance(checkpoint_id, str) and _NAME_RE.fullmatch(checkpoint_id) is not None


class ChunkdStorageReader(StorageReader):
    """Loads a DCP checkpoint saved by :class:`ChunkdStorageWriter` as ``name``.

    DCP calls it in this order (``dcp.load``; one instance per rank)::

        0. (all ranks)   reset(checkpoint_id), if dcp.load was given a checkpoint_id:
                         it replaces ``name``
        1. (all ranks)   read_metadata()                  -> DCP's metadata, from the
                         committed manifest
        2. (all ranks)   set_up_storage_reader(metadata, is_coordinator)
        3. (all ranks)   prepare_local_plan(plan)         -> the plan, unchanged
        4. (coordinator) prepare_global_plan(plans)       -> the plans, unchanged
        5. (all ranks)   read_data(plan, planner)         -> per part: fetch the chunks
                         of only the values the plan reads, narrow each to the
                         requested slice and copy it into the planner's tensor

    Any number of ranks may load a checkpoint saved by any number (DCP reshards).

    Args:
        name: ``BACKEND/PATH`` of a committed checkpoint.
        client: the daemon's client (default: one per process, found through
            ``$CHUNKD_SOCKET``).

    Raises:
        CheckpointNotFoundError: (``read_metadata``) no committed checkpoint has that name.
        CheckpointError: (``read_metadata``) the checkpoint was not saved through DCP.
        IntegrityError: (``read_data``) a chunk is damaged; the message names its values.
    """

    def __init__(self, name: str, *, client: Client | None = None) -> None:
        super().__init__()
        self.name = name
        self.client = client
        self.load_id = uuid.uuid4().hex
        self.storage_data: dict[MetadataIndex, Any] = {}

    @property
    def checkpoint_id(self) -> str:
        """The chunkd checkpoint name (DCP logs it)."""
        return self.name

    def reset(self, checkpoint_id: str | os.PathLike[Any] | None = None) -> None:
        # docstring inherited
        if checkpoint_id:
            self.name = os.fspath(checkpoint_id)
        self.storage_data = {}
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # docstring inherited
        doc = checkpoint.manifest(self.name, client=self.client)
        blob = doc.get(METADATA_KEY)
        if not isinstance(blob, str):
            raise CheckpointError(
                f"checkpoint {self.name} has no DCP metadata: it was not saved through "
                "torch.distributed.checkpoint; load it with chunkd.client.checkpoint.load"
            )
        try:
            metadata = pickle.loads(base64.b64decode(blob))
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint {self.name}: its DCP metadata cannot be read ({exc!r}); it was "
                "saved by an incompatible torch, or the manifest is damaged"
            ) from exc
        if not isinstance(metadata, Metadata):
            raise CheckpointError(
                f"checkpoint {self.name}: its DCP metadata is a {type(metadata).__name__}, "
                "not a torch.distributed.checkpoint Metadata"
            )
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta(checkpoint_id=self.name)
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        # docstring inherited
        if not isinstance(metadata.storage_data, dict):
            raise CheckpointError(
                f"checkpoint {self.name}: its DCP metadata says nowhere where the values are"
            )
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # docstring inherited
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        # docstring inherited
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # docstring inherited
        by_part: dict[int, dict[str, list[ReadItem]]] = {}
        for item in plan.items:
            where = self.storage_data.get(item.storage_index)
            if not (
                isinstance(where, tuple)
                and len(where) == 2
                and isinstance(where[0], int)
                and isinstance(where[1], str)
            ):
                raise CheckpointError(
                    f"checkpoint {self.name}: its DCP metadata has no chunkd location for "
                    f"{item.storage_index} (found {where!r}); it was not saved by "
                    "ChunkdStorageWriter"
                )
            part, key = where
            by_part.setdefault(part, {}).setdefault(key, []).append(item)
        for part, wanted in sorted(by_part.items()):
            with checkpoint.CheckpointReader(self.name, part, client=self.client) as reader:
                for batch in _batches(reader, part, list(wanted)):
                    values = reader.read(list(dict.fromkeys(batch.values())))
                    for key, source in batch.items():
                        for item in wanted[key]:
                            self._load(item, key, values[source], planner)
                    del values
        return _completed(None)

    def _load(self, item: ReadItem, key: str, value: Any, planner: LoadPlanner) -> None:
        if item.type == LoadItemType.BYTE_IO:
            if isinstance(value, np.ndarray):
                value = value.tobytes()
            if not isinstance(value, bytes):
                raise CheckpointError(
                    f"checkpoint {self.name}: {key} holds a {type(value).__name__}, not the "
                    "bytes DCP expects"
                )
            planner.load_bytes(item, io.BytesIO(value))
            return
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"checkpoint {self.name}: {key} holds a {type(value).__name__}, not the "
                "tensor DCP expects"
            )
        source = value
        for dim, (offset, length) in enumerate(
            zip(item.storage_offsets, item.lengths, strict=True)
        ):
            source = source.narrow(dim, offset, length)
        target = planner.resolve_tensor(item).detach()
        if target.size() != source.size():
            raise CheckpointError(
                f"checkpoint {self.name}: {key} gives a slice of {list(source.size())} for "
                f"{item.dest_index.fqn}, whose target is {list(target.size())}"
            )
        target.copy_(source)
        planner.commit_tensor(item, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[Any]) -> bool:
        """Whether ``checkpoint_id`` has the form of a chunkd name, ``BACKEND/PATH``."""
        return ChunkdStorageWriter.validate_checkpoint_id(checkpoint_id)


def _batches(
    reader: checkpoint.CheckpointReader, part: int, keys: list[str]
) -> Iterator[dict[str, str]]:
    """``keys`` in batches of about :data:`_READ_BATCH_BYTES`: ``{key: key to read}``.

    The key to read differs from the key where the saved value was a tensor saved
    twice (tied weights): the part holds it once, under the other key.
    """
    owners = {
        node["id"]: key
        for key, node in reader.values.items()
        if isinstance(node, dict) and node.get("t") == "tensor" and "id" in node
    }
    batch: dict[str, str] = {}
    sources: set[str] = set()
    size = 0
    for key in keys:
        node = reader.values.get(key)
        if node is None:
            raise CheckpointError(
                f"checkpoint {reader.name}: part {part} holds no value {key!r}, which its "
                "DCP metadata names; the checkpoint is damaged"
            )
        source = key
        if isinstance(node, dict) and node.get("t") == "ref":
            source = owners[node["id"]]
        if source not in sources:
            sources.add(source)
            size += int(reader.values[source].get("len", 0))
        batch[key] = source
        if size >= _READ_BATCH_BYTES:
            yield batch
            batch, sources, size = {}, set(), 0
    if batch:
        yield batch
