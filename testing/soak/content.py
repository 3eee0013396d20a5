"""The soak's data: every byte a pure function of its object and position
(:func:`content`), the objects of its ``file://`` backend (:class:`SoakDataset`) and
the numpy state its clients save and check (:class:`StateShape`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Final

import numpy as np
import numpy.typing as npt

__all__ = ["GiB", "KiB", "MiB", "SoakDataset", "SoakMismatchError", "StateShape", "content"]

KiB: Final = 1 << 10
MiB: Final = 1 << 20
GiB: Final = 1 << 30

_MASK: Final = (1 << 64) - 1


# -- the dataset ------------------------------------------------------------------------


def _mix(*parts: int) -> int:
    """A 64-bit hash of some integers (splitmix64's finaliser over each in turn)."""
    z = 0x9E3779B97F4A7C15
    for part in parts:
        z = (z ^ (part & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
        z ^= z >> 31
    return z


def content(key_id: int, offset: int, length: int) -> npt.NDArray[np.uint8]:
    """Bytes ``[offset, offset + length)`` of the object ``key_id``.

    Word ``j`` (8 bytes, little-endian) of an object is splitmix64 of ``key_id``'s
    seed plus ``j``: any range is computed without the bytes before it, and no two
    objects (or chunks) share bytes, so no read is answered right by chance.
    """
    first = offset // 8
    count = (offset + length + 7) // 8 - first
    z = np.arange(first, first + count, dtype=np.uint64)
    z += np.uint64(_mix(key_id))  # arrays wrap silently; numpy scalars would warn
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    raw = z.astype("<u8", copy=False).view(np.uint8)
    skip = offset - first * 8
    return raw[skip : skip + length]


@dataclass(frozen=True)
class SoakDataset:
    """The objects of the soak's ``file://`` backend, all derived from ``seed``.

    ``list/`` holds ``small_objects`` objects of ``small_bytes`` (one chunk each), the
    prefix the listing op pages through; ``obj/`` holds ``large_objects`` of
    ``large_bytes`` (several chunks each, sizes not page-aligned).
    """

    seed: int = 7
    small_objects: int = 10_000
    small_bytes: tuple[int, int] = (512, 16 * KiB)
    large_objects: int = 120
    large_bytes: tuple[int, int] = (3 * MiB // 2, 6 * MiB)
    backend: str = "data"

    SMALL_PREFIX: ClassVar[str] = "list"
    LARGE_PREFIX: ClassVar[str] = "obj"

    def small_key(self, i: int) -> str:
        """The key (in the backend) of small object ``i``."""
        return f"{self.SMALL_PREFIX}/s-{i:06d}.bin"

    def large_key(self, i: int) -> str:
        """The key of large object ``i``."""
        return f"{self.LARGE_PREFIX}/o-{i:05d}.bin"

    def small_id(self, i: int) -> int:
        """The content id of small object ``i`` (see :func:`content`)."""
        return _mix(self.seed, 1, i)

    def large_id(self, i: int) -> int:
        """The content id of large object ``i``."""
        return _mix(self.seed, 2, i)

    def small_size(self, i: int) -> int:
        """The size of small object ``i``."""
        low, high = self.small_bytes
        return low + _mix(self.seed, 3, i) % (high - low + 1)

    def large_size(self, i: int) -> int:
        """The size of large object ``i``."""
        low, high = self.large_bytes
        return low + _mix(self.seed, 4, i) % (high - low + 1)

    @property
    def total_bytes(self) -> int:
        """Bytes of every object together."""
        small = sum(self.small_size(i) for i in range(self.small_objects))
        return small + sum(self.large_size(i) for i in range(self.large_objects))

    def write(self, root: Path) -> None:
        """Write every object under ``root`` (the backend's directory)."""
        (root / self.SMALL_PREFIX).mkdir(parents=True, exist_ok=True)
        (root / self.LARGE_PREFIX).mkdir(parents=True, exist_ok=True)
        for i in range(self.small_objects):
            data = content(self.small_id(i), 0, self.small_size(i))
            (root / self.small_key(i)).write_bytes(data.tobytes())
        for i in range(self.large_objects):
            size = self.large_size(i)
            with (root / self.large_key(i)).open("wb") as f:
                for at in range(0, size, 8 * MiB):
                    f.write(content(self.large_id(i), at, min(8 * MiB, size - at)).tobytes())


@dataclass(frozen=True)
class StateShape:
    """The numpy state dict each client saves: parts the same across clients, across
    steps, and new every step, so saves deduplicate both ways."""

    #: the same in every client and step (``uint8``): deduplicated across clients
    shared_bytes: int = 2 * MiB
    #: the client's own, the same every step (``int32``): deduplicated across steps
    own_bytes: int = 1 * MiB
    #: new every step (``uint16``): what a step uploads
    moving_bytes: int = 256 * KiB
    seed: int = 11

    @property
    def staged_bytes(self) -> int:
        """An upper bound of the memfd one save stages: the arrays, each page-aligned,
        and a page of small values."""
        page = 4 * KiB
        arrays = (self.shared_bytes, self.own_bytes, self.moving_bytes)
        return sum(-(-n // page) * page for n in arrays) + 2 * page

    def _arrays(self, client: int, step: int) -> dict[str, npt.NDArray[Any]]:
        return {
            "shared": content(_mix(self.seed, 1), 0, self.shared_bytes),
            "own": content(_mix(self.seed, 2, client), 0, self.own_bytes).view(np.int32),
            "moving": content(_mix(self.seed, 3, client, step), 0, self.moving_bytes).view(
                np.uint16
            ),
            "bias": content(_mix(self.seed, 4, client, step), 0, 512).view(np.int64),
        }

    def state(self, client: int, step: int) -> dict[str, Any]:
        """The state client ``client`` saves at ``step``."""
        arrays = self._arrays(client, step)
        return {
            "model": {"shared": arrays["shared"].reshape(-1, 1024), "own": arrays["own"]},
            "optim": {"moving": arrays["moving"], "bias": arrays["bias"]},
            "step": step,
            "client": f"client-{client}",
        }

    def check(self, loaded: Any, client: int, step: int) -> int:
        """Raise :class:`SoakMismatchError` unless ``loaded`` is the state of
        ``(client, step)``; returns the bytes compared."""
        want = self._arrays(client, step)
        try:
            got = {
                "shared": loaded["model"]["shared"].reshape(-1),
                "own": loaded["model"]["own"],
                "moving": loaded["optim"]["moving"],
                "bias": loaded["optim"]["bias"],
            }
            scalars = (loaded["step"], loaded["client"])
        except (KeyError, TypeError) as exc:
            raise SoakMismatchError(f"the loaded state lacks {exc}") from None
        if scalars != (step, f"client-{client}"):
            raise SoakMismatchError(f"the loaded state's scalars are {scalars!r}")
        compared = 0
        for key, array in want.items():
            other = got[key]
            if not isinstance(other, np.ndarray) or other.dtype != array.dtype:
                raise SoakMismatchError(f"{key}: loaded as {type(other).__name__}")
            if not np.array_equal(other, array):
                raise SoakMismatchError(f"{key}: the loaded array differs from the saved one")
            compared += array.nbytes
        return compared


class SoakMismatchError(AssertionError):
    """What the daemon answered is not what the soak's data says it should be."""
