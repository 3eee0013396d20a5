"""Loading onto a device: chunk bytes staged through a small ring of host buffers and
copied to the device on a side stream, while the next chunks are read.

The bytes of a CUDA tensor cannot be ``preadv``'d into it; they go through host
memory once, and a copy from *pinned* host memory is what the GPU's copy engines
run at full speed and without blocking the host. So a load stages chunk bytes into
a few pinned buffers and sends each to the device as soon as it is full::

    reader threads (COPY_THREADS of them)          side stream, one per device
    take a buffer (wait for its last copies) ─┐
    preadv the job's pieces into it           │
    enqueue its copies, non-blocking ─────────┼──►  H2D copies of this buffer,
    record a fence, give the buffer back      │     while the threads read the next
                                              ┘

The order a load keeps (:class:`StagingRing` and a :class:`DeviceLink`):

1. :meth:`DeviceLink.begin`: each device's side stream waits for the work already
   queued on that device's current stream (a target may still be written there,
   say by a ``zero_()`` the caller queued), so no copy lands before that work.
2. Per job (pieces of chunks, at most one buffer's worth): :meth:`StagingRing.acquire`
   hands out a buffer only once the copies last sent from it have finished (their
   fence); the pieces are read into it; :meth:`DeviceLink.send` queues its copies
   to the device and returns a fence that covers them; the buffer goes back to the
   ring with that fence.
3. :meth:`DeviceLink.finish`: the host waits for every copy on every side stream.
   Only then are the buffers dropped and the load returns: the targets are complete,
   for any stream.

Bounds: :data:`STAGING_BUFFERS` buffers of :data:`STAGING_BUFFER_BYTES` each (48 MiB
of pinned memory), allocated on first use and reused by every job of the load
(torch's pinned-memory cache keeps them for the next load); at most that many jobs'
copies are outstanding.

:class:`CudaLink` is the link to CUDA devices. :class:`ThreadLink` stands in for it
on the CPU: one thread runs the copies in the order they were sent, each after an
optional delay (a slow device), and its fences are set once their copies ran. With
it, the ring's ordering and reuse are exercised on machines without a GPU
(``load_into(..., _link=ThreadLink())`` sends CPU targets through the ring).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final, Protocol

from chunkd.client.checkpoint.process import COPY_THREADS
from chunkd.client.views import tensor_bytes
from chunkd.errors import CheckpointError

__all__ = [
    "STAGING_BUFFERS",
    "STAGING_BUFFER_BYTES",
    "CudaLink",
    "DeviceLink",
    "DeviceRead",
    "Fence",
    "HostBuffer",
    "StagingRing",
    "ThreadLink",
    "check_location",
    "device_bytes",
    "pack",
    "read_exact",
]

#: host staging buffers of one load: one per reader thread, and two whose copies may
#: still be running while the threads fill the others
STAGING_BUFFERS: Final = COPY_THREADS + 2
#: bytes of each staging buffer: two chunks of the default 4 MiB (a copy of a few
#: MiB already runs near the link's rate; larger buffers only hold more pinned memory)
STAGING_BUFFER_BYTES: Final = 8 << 20


@dataclass(frozen=True, slots=True)
class DeviceRead:
    """Bytes ``start`` to ``stop`` of the chunk in ``fd``, for ``dest[at:]``.

    ``dest`` is a flat ``uint8`` tensor (a device tensor's own bytes).
    """

    fd: int
    start: int
    stop: int
    dest: Any
    at: int


class Fence(Protocol):
    """What a link returns for copies it was sent: wait until they finished."""

    def wait(self) -> None:
        """Block until every copy the fence covers has finished."""


@dataclass(slots=True)
class HostBuffer:
    """One staging buffer: a flat ``uint8`` CPU tensor and a writable view of its bytes."""

    tensor: Any
    view: memoryview
    #: which of the ring's buffers this is (0, 1, ...): for tests and reports
    number: int


class DeviceLink(ABC):
    """The copy path from host staging buffers to devices. Used in this order:
    :meth:`begin`, then :meth:`host_buffer` and :meth:`send` from any thread,
    then :meth:`finish` (always, also after a failure)."""

    @abstractmethod
    def begin(self, devices: Iterable[Any]) -> None:
        """Order the copies to come after the work queued so far on ``devices``."""

    @abstractmethod
    def host_buffer(self, nbytes: int) -> Any:
        """A new flat ``uint8`` CPU tensor of ``nbytes`` to stage bytes in."""

    @abstractmethod
    def send(self, buffer: Any, copies: list[tuple[int, int, Any, int]]) -> Fence:
        """Queue copies of ``buffer[start:stop]`` to ``dest[at:]`` without waiting.

        Args:
            buffer: a tensor from :meth:`host_buffer`.
            copies: ``(start, stop, dest, at)`` each; ``dest`` a flat ``uint8`` tensor.

        Returns:
            A fence that is passed once every one of these copies has finished.
        """

    @abstractmethod
    def finish(self) -> None:
        """Wait until every copy sent has finished; raise the first that failed."""


class _Events:
    """A fence over CUDA events (one per side stream a job's copies went to)."""

    def __init__(self, events: list[Any]) -> None:
        self._events = events

    def wait(self) -> None:
        for event in self._events:
            event.synchronize()  # releases the GIL while it waits


class CudaLink(DeviceLink):
    """Copies to CUDA devices from pinned host buffers, on one side stream per device.

    Each copy is a ``non_blocking`` ``copy_`` issued on the side stream; a fence is a
    CUDA event recorded on each stream after a job's copies.
    """

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._streams: dict[int, Any] = {}

    def begin(self, devices: Iterable[Any]) -> None:
        torch = self._torch
        for device in devices:
            index = torch.device(device).index
            index = torch.cuda.current_device() if index is None else index
            if index in self._streams:
                continue
            stream = torch.cuda.Stream(device=index)
            stream.wait_stream(torch.cuda.current_stream(index))
            self._streams[index] = stream

    def host_buffer(self, nbytes: int) -> Any:
        return self._torch.empty(nbytes, dtype=self._torch.uint8, pin_memory=True)

    def send(self, buffer: Any, copies: list[tuple[int, int, Any, int]]) -> Fence:
        torch = self._torch
        by_device: dict[int, list[tuple[int, int, Any, int]]] = {}
        for copy in copies:
            by_device.setdefault(copy[2].device.index, []).append(copy)
        events = []
        used = []
        try:
            for index, group in by_device.items():
                stream = self._streams[index]
                used.append(stream)
                with torch.cuda.stream(stream):  # the current stream is per thread
                    for start, stop, dest, at in group:
                        dest[at : at + stop - start].copy_(buffer[start:stop], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
                events.append(event)
        except BaseException:
            # The copies queued before the failure must be done before the buffer
            # goes back to the ring (with no fence, the next job would overwrite it).
            for stream in used:
                stream.synchronize()
            raise
        return _Events(events)

    def finish(self) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.synchronize()


class _Flag:
    """A fence of :class:`ThreadLink`: set once its copies ran (or failed)."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def set(self) -> None:
        self._done.set()

    def wait(self) -> None:
        self._done.wait()


class ThreadLink(DeviceLink):
    """A CPU stand-in for a device's copy stream: one thread runs the copies in the
    order they were sent.

    Args:
        delay: seconds each batch of copies waits before it runs: a slow device, so
            that a buffer reused before its copies ran would show as wrong bytes.
    """

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        #: buffers made and batches of copies run, for tests
        self.buffers = 0
        self.batches = 0
        # At most STAGING_BUFFERS batches wait here: a buffer is sent again only after
        # its fence passed, that is after its batch left this queue.
        self._queue: queue.SimpleQueue[tuple[Any, list[tuple[int, int, Any, int]], _Flag] | None]
        self._queue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None

    def begin(self, devices: Iterable[Any]) -> None:
        if self._thread is None:
            self._failed = None
            self._thread = threading.Thread(
                target=self._run, name="chunkd-stand-in-stream", daemon=True
            )
            self._thread.start()

    def host_buffer(self, nbytes: int) -> Any:
        import torch

        self.buffers += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def send(self, buffer: Any, copies: list[tuple[int, int, Any, int]]) -> Fence:
        if self._thread is None:
            raise RuntimeError("ThreadLink.send before begin")
        flag = _Flag()
        self._queue.put((buffer, copies, flag))
        return flag

    def finish(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()
        failed, self._failed = self._failed, None
        if failed is not None:
            raise failed

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            buffer, copies, flag = item
            try:
                if self._failed is None:
                    if self.delay:
                        time.sleep(self.delay)
                    for start, stop, dest, at in copies:
                        dest[at : at + stop - start].copy_(buffer[start:stop])
                    self.batches += 1
            except BaseException as exc:  # raised by finish(), in the loading thread
                self._failed = exc
            finally:
                flag.set()


class StagingRing:
    """``count`` host buffers of ``nbytes`` each, reused in turn for a load's jobs.

    A buffer is handed out again only once the copies last sent from it finished, so
    bytes are never overwritten under a copy in flight. Buffers are made on first
    need, up to ``count``; the one given back longest ago is reused first.
    """

    def __init__(
        self, link: DeviceLink, count: int = STAGING_BUFFERS, nbytes: int = STAGING_BUFFER_BYTES
    ) -> None:
        if count < 1 or nbytes < 1:
            raise ValueError(f"a staging ring needs buffers; got {count} of {nbytes} bytes")
        self.link = link
        self.count = count
        self.nbytes = nbytes
        #: buffers made so far (never more than ``count``)
        self.made = 0
        self._free: deque[tuple[HostBuffer, Fence | None]] = deque()
        self._changed = threading.Condition()

    def acquire(self) -> HostBuffer:
        """A buffer whose earlier copies have all finished (blocks until one is)."""
        with self._changed:
            while not self._free and self.made >= self.count:
                self._changed.wait()
            if self._free:
                buffer, fence = self._free.popleft()
                number = None
            else:
                number = self.made
                self.made += 1
        if number is None:
            if fence is not None:
                fence.wait()
            return buffer
        try:  # outside the lock: pinning memory takes a while, releases must not wait
            tensor = self.link.host_buffer(self.nbytes)
        except BaseException:
            with self._changed:
                self.made -= 1
                self._changed.notify()
            raise
        return HostBuffer(tensor, tensor_bytes(tensor), number)

    def release(self, buffer: HostBuffer, fence: Fence | None) -> None:
        """Give ``buffer`` back; ``fence`` covers the copies just sent from it."""
        with self._changed:
            self._free.append((buffer, fence))
            self._changed.notify()

    def stage(self, job: list[DeviceRead]) -> None:
        """Read ``job`` into a buffer and send it on to its destinations.

        Pieces that continue one another in the buffer and in one destination go as
        one copy.
        """
        buffer = self.acquire()
        fence: Fence | None = None
        try:
            copies: list[tuple[int, int, Any, int]] = []
            at = 0
            for read in job:
                n = read.stop - read.start
                if at + n > self.nbytes:
                    raise ValueError(f"a staging job of over {self.nbytes} bytes")
                read_exact(read.fd, buffer.view[at : at + n], read.start)
                last = copies[-1] if copies else None
                if (
                    last is not None
                    and last[2] is read.dest
                    and last[1] == at
                    and last[3] + (last[1] - last[0]) == read.at
                ):
                    copies[-1] = (last[0], at + n, read.dest, last[3])
                else:
                    copies.append((at, at + n, read.dest, read.at))
                at += n
            if copies:
                fence = self.link.send(buffer.tensor, copies)
        finally:
            self.release(buffer, fence)


def pack(reads: Iterable[DeviceRead], nbytes: int) -> list[list[DeviceRead]]:
    """``reads`` in jobs of at most ``nbytes`` each, in order; a longer read is split."""
    jobs: list[list[DeviceRead]] = []
    job: list[DeviceRead] = []
    room = nbytes
    for read in reads:
        start = read.start
        while start < read.stop:
            if room == 0:
                jobs.append(job)
                job, room = [], nbytes
            stop = min(read.stop, start + room)
            job.append(DeviceRead(read.fd, start, stop, read.dest, read.at + start - read.start))
            room -= stop - start
            start = stop
    if job:
        jobs.append(job)
    return jobs


def read_exact(fd: int, target: memoryview, offset: int) -> None:
    """``preadv`` all of ``target`` from ``fd`` at ``offset``."""
    at = 0
    while at < target.nbytes:
        got = os.preadv(fd, [target[at:]], offset + at)
        if got <= 0:
            raise CheckpointError("a chunk from the daemon is shorter than its size")
        at += got


def device_bytes(tensor: Any) -> Any | None:
    """A contiguous tensor's elements as a flat ``uint8`` tensor on its device, or None.

    None where the bytes are not the tensor's own in C order: not contiguous, a
    lazily conjugated or negated view, a layout other than strided.
    """
    import torch

    if (
        tensor.layout != torch.strided
        or not tensor.is_contiguous()
        or tensor.is_conj()
        or tensor.is_neg()
    ):
        return None
    flat = tensor.detach().reshape(-1)
    if flat.numel() and (flat.stride(0) != 1 or flat.data_ptr() != tensor.data_ptr()):
        return None  # contiguous, yet a size-1 dimension keeps an odd stride
    return flat.view(torch.uint8)


def check_location(map_location: Any, name: str) -> Any:
    """``map_location`` as a ``torch.device``, refused if it is a CUDA device this
    process does not have.

    Raises:
        CheckpointError: CUDA is not available here, or has no device of that index.
    """
    import torch

    try:
        where = torch.device(map_location)
    except (RuntimeError, TypeError) as exc:
        raise CheckpointError(
            f"loading {name}: map_location={map_location!r} is not a device ({exc}); "
            "pass 'cpu', 'cuda', 'cuda:N' or a torch.device"
        ) from None
    if where.type != "cuda":
        return where
    if not torch.cuda.is_available():
        built = (
            f"built with CUDA {torch.version.cuda}"
            if torch.version.cuda
            else "a CPU-only build of torch"
        )
        raise CheckpointError(
            f"loading {name} onto {where}: this process sees no CUDA device (torch "
            f"{torch.__version__}, {built}; CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!s}); load with "
            "map_location='cpu', or run where a GPU is visible"
        )
    count = torch.cuda.device_count()
    if where.index is not None and where.index >= count:
        raise CheckpointError(
            f"loading {name} onto {where}: this process sees {count} CUDA device(s), "
            f"cuda:0 to cuda:{count - 1}"
        )
    return where
