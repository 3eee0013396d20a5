"""Loading: one rank's part of a committed checkpoint into new values, into a state
dict in place, or value by value (:class:`CheckpointReader`).

CPU tensors and arrays are filled straight from the daemon's chunks; CUDA tensors
(targets of :func:`load_into`, or new ones for ``map_location="cuda"``) through a
small ring of pinned host buffers whose copies to the GPU overlap the reads of the
next chunks (:mod:`.device`).
"""

from __future__ import annotations

from typing import Any

from chunkd.client.checkpoint.catalog import manifest
from chunkd.client.checkpoint.decode import Decoder, fill_into, tensors_by_id, walk
from chunkd.client.checkpoint.device import DeviceLink, check_location
from chunkd.client.checkpoint.process import client_or_default, distributed
from chunkd.client.checkpoint.reader import PartReader
from chunkd.client.core import Client
from chunkd.errors import CheckpointError


def _open_part(
    name: str, client: Client | None, part: int | None, link: DeviceLink | None = None
) -> tuple[PartReader, Any]:
    chunkd = client_or_default(client)
    doc = manifest(name, client=chunkd)
    parts = doc["parts"]
    if part is None:
        dist = distributed()
        part = dist[0] if dist is not None and dist[1] == len(parts) else 0
    chosen = next((p for p in parts if p["rank"] == part), None)
    if chosen is None:
        raise CheckpointError(
            f"checkpoint {name} has parts for ranks 0..{len(parts) - 1}, not {part}; "
            "pass part= (or use chunkd.client.dcp to reshard)"
        )
    return PartReader(chunkd, name, chosen, link), chosen["tree"]


class CheckpointReader:
    """One rank's part of a committed checkpoint, read value by value.

    For adapters that need only some values of a part (``chunkd.client.dcp``):
    :attr:`values` maps each top-level key of the saved dict to its encoded node;
    :meth:`read` fetches and decodes just those.

    Raises:
        CheckpointNotFoundError: no committed checkpoint has that name.
    """

    def __init__(self, name: str, part: int = 0, *, client: Client | None = None) -> None:
        self.name = name
        self._reader, self.tree = _open_part(name, client, part)
        self.values: dict[Any, Any] = {}
        if isinstance(self.tree, dict) and self.tree.get("t") == "dict":
            self.values = dict(zip(self.tree["keys"], self.tree["values"], strict=True))
        self._by_id = tensors_by_id(self.tree)
        for node, path in walk(self.tree, ""):
            self._reader.note_owner(node, path)

    def read(self, keys: list[Any]) -> dict[Any, Any]:
        """Decode the top-level values ``keys`` (tensors on the CPU).

        A tied tensor read without the key that holds its bytes still loads: the
        owner's bytes are fetched for it.
        """
        decoder = Decoder(self._reader, "cpu", self._by_id)
        values = {k: decoder.decode(self.values[k]) for k in keys}
        self._reader.run()
        return values

    def close(self) -> None:
        """Nothing stays open between reads; kept for ``with``."""

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load(
    name: str,
    *,
    map_location: Any = "cpu",
    part: int | None = None,
    client: Client | None = None,
    _link: DeviceLink | None = None,
) -> Any:
    """Load checkpoint ``name`` into new tensors and arrays.

    ``map_location``: where new tensors go, a device as ``torch.device`` takes it
    (``"cpu"``, ``"cuda"``, ``"cuda:1"``). On a CUDA device they are filled through
    pinned host buffers, the copies overlapped with the reads; the load returns once
    every copy has finished. ``part`` picks a rank's part (default: this rank under
    ``torch.distributed`` when the world sizes match, else 0).

    Raises:
        CheckpointNotFoundError: no committed checkpoint has that name.
        CheckpointError: ``map_location`` is a CUDA device this process does not see
            (before anything is read).
        IntegrityError: a chunk is damaged in the backend; the message names the tensor.
    """
    # _link (tests): the way to the device; CPU tensors go through the staging ring too
    if not (isinstance(map_location, str) and map_location == "cpu"):  # torch stays unloaded
        map_location = check_location(map_location, name)
    reader, tree = _open_part(name, client, part, _link)
    for node, path in walk(tree, ""):
        reader.note_owner(node, path)
    state = Decoder(reader, map_location, ring_cpu=_link is not None).decode(tree)
    reader.run()
    return state


def load_into(
    state_dict: Any,
    name: str,
    *,
    strict: bool = True,
    part: int | None = None,
    client: Client | None = None,
    _link: DeviceLink | None = None,
) -> Any:
    """Fill the tensors and arrays of ``state_dict`` in place from checkpoint ``name``.

    Tensors keep their storage (pinned, CUDA or plain); their shapes and dtypes must
    match the checkpoint's. CPU tensors are read into directly; CUDA tensors through
    a few pinned host buffers (48 MiB in all), each copied to its GPU on a side
    stream while the next chunks are read, and the load returns once every copy has
    finished. Other values (step counters, scalars, strings) are set in their dicts
    and lists. With ``strict``, a key missing on either side is an error.
    Returns ``state_dict``.

    Raises:
        CheckpointError: the checkpoint and ``state_dict`` do not match (named).
    """
    # _link (tests): the way to the device; CPU tensors go through the staging ring too
    reader, tree = _open_part(name, client, part, _link)
    for node, path in walk(tree, ""):
        reader.note_owner(node, path)
    decoder = Decoder(reader, "cpu", tensors_by_id(tree), ring_cpu=_link is not None)
    fill_into(state_dict, tree, "", decoder, strict)
    reader.run()
    return state_dict
