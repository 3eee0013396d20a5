"""The conformance suite of the :class:`~chunkd.gateway.backends.Backend` interface.

In the shape of zarr's ``testing/store.py`` ``StoreTests``: :class:`BackendTests` holds
every test; each backend is a short subclass that supplies the ``backend`` fixture (an
empty, writable backend on a real server) and, where its server lacks a feature, names
it in :attr:`BackendTests.lacks` with the reason, which skips those tests for that
backend alone::

    class TestMemory(BackendTests):
        @pytest.fixture
        def backend(self) -> Backend:
            return make_backend(BackendConfig(name="mem", url="memory://", writable=True),
                                Metrics())

Features a server may lack: ``"put"`` (writes through the backend; the test objects
are then written by :meth:`BackendTests.write`, which a subclass overrides),
``"delete"``, ``"conditional_put"`` (``put(..., if_absent=True)``) and
``"conditional_get"`` (a read pinned to a version that changed fails).

Capabilities a kind claims (:attr:`BackendTests.claims`, each a capability property of
the :class:`~chunkd.gateway.backends.Backend`): ``"writes"`` (``supports_writes``)
and ``"list"`` (``supports_list``); every kind claims both unless its subclass says
otherwise. A kind that does not claim one passes the tests that check it refuses it
(a write is :class:`~chunkd.errors.ReadOnlyBackendError`, a listing an error), and the
tests of the capability itself skip, naming it. A read-only, unlisted kind (``https://``)::

    class TestHTTP(BackendTests):
        claims = frozenset()  # reads only

        async def write(self, backend, key, data):  # its server's files, written directly
            ...
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, ClassVar, Final

import pytest

from chunkd.errors import (
    ChunkdError,
    ObjectNotFoundError,
    RangeNotSatisfiableError,
    ReadOnlyBackendError,
    VersionChangedError,
)
from chunkd.ranges import ByteRange, OffsetRange, SuffixRange

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from chunkd.gateway.backends import Backend, ObjectMeta
    from chunkd.ranges import RequestRange

__all__ = ["CAPABILITIES", "FEATURES", "ODD_KEYS", "BackendTests"]

#: what :attr:`BackendTests.lacks` may name
FEATURES: Final = frozenset({"put", "delete", "conditional_put", "conditional_get"})
#: what :attr:`BackendTests.claims` may name: a capability property of the backend
CAPABILITIES: Final = frozenset({"writes", "list"})
#: keys that a URL, a path or a form encoding would each mangle differently
ODD_KEYS: tuple[str, ...] = (
    "odd/with space",
    "odd/ünïcødé-名前",
    "odd/plus+sign",
    "odd/per%cent",
    "odd/%20not-a-space",
    "odd/a=b&c;d",
)
_DATA = bytes(range(256)) * 4  # 1024 bytes, each offset tells where it is


def _got(view: memoryview | None) -> bytes:
    """The bytes of a read that must have found its object."""
    assert view is not None
    return bytes(view)


def _flat(pages: list[list[str]]) -> list[str]:
    return [key for page in pages for key in page]


class BackendTests:
    """Every test a backend must pass. Subclasses supply the ``backend`` fixture."""

    #: features the backend's server lacks, each with the reason: their tests skip
    lacks: ClassVar[dict[str, str]] = {}
    #: the capabilities the kind claims (:data:`CAPABILITIES`): the tests of one it
    #: does not claim skip, and it must refuse it
    claims: ClassVar[frozenset[str]] = CAPABILITIES

    @pytest.fixture
    def backend(self) -> Backend:
        """An empty, writable backend (a subclass supplies it)."""
        raise NotImplementedError("a BackendTests subclass supplies the backend fixture")

    async def write(self, backend: Backend, key: str, data: bytes) -> None:
        """Put ``data`` at ``key`` for a test (through the backend, unless its server
        lacks ``"put"``: then the subclass writes another way)."""
        assert await backend.put(key, data)

    def needs(self, feature: str) -> None:
        """Skip the test, naming the feature and why, if the server lacks it (or the
        capability, if the kind does not claim it)."""
        if feature in CAPABILITIES:
            if feature not in self.claims:
                pytest.skip(f"{type(self).__name__} does not claim {feature}: the kind has none")
            return
        assert feature in FEATURES, feature
        why = self.lacks.get(feature)
        if why is not None:
            pytest.skip(f"{type(self).__name__} lacks {feature}: {why}")

    async def _head(self, backend: Backend, key: str) -> ObjectMeta:
        meta = await backend.head(key)
        assert meta is not None, key
        return meta

    # -- capabilities -------------------------------------------------------------------

    def test_capabilities(self, backend: Backend) -> None:
        assert self.claims <= CAPABILITIES, self.claims
        assert backend.supports_writes is ("writes" in self.claims)
        assert backend.supports_list is ("list" in self.claims)
        assert backend.supports_conditional_put in (True, False)
        assert not backend.circuit_open
        assert backend.request_bound > 0

    async def test_what_it_does_not_claim_is_refused(self, backend: Backend) -> None:
        if self.claims == CAPABILITIES:
            pytest.skip(f"{type(self).__name__} claims every capability")
        if "writes" not in self.claims:
            with pytest.raises(ReadOnlyBackendError):
                await backend.put("w/refused", b"x")
            with pytest.raises(ReadOnlyBackendError):
                await backend.put("w/refused", b"x", if_absent=True)
            with pytest.raises(ReadOnlyBackendError):
                await backend.delete("w/refused")

            async def pieces() -> AsyncIterator[bytes]:
                yield b"x"

            with pytest.raises(ReadOnlyBackendError):
                await backend.put_stream("w/refused", pieces(), size=1)
        if "list" not in self.claims:
            with pytest.raises(ChunkdError):
                async for _ in backend.scan(""):
                    pass

    # -- absent objects -----------------------------------------------------------------

    async def test_absent_object_is_none(self, backend: Backend) -> None:
        assert await backend.head("no/such/object") is None
        assert await backend.get("no/such/object") is None
        assert await backend.get("no/such/object", ByteRange(0, 10)) is None
        assert await backend.get("no/such/object", SuffixRange(10)) is None
        if "list" in self.claims:
            batches = [b async for b in backend.scan("no/such")]
            assert batches == []

    # -- whole objects and ranges -------------------------------------------------------

    async def test_head_and_get(self, backend: Backend) -> None:
        await self.write(backend, "obj/whole.bin", _DATA)
        meta = await self._head(backend, "obj/whole.bin")
        assert (meta.key, meta.size) == ("obj/whole.bin", len(_DATA))
        assert meta.version
        assert _got(await backend.get("obj/whole.bin")) == _DATA
        pinned = await backend.get("obj/whole.bin", version=meta)
        assert pinned is not None
        assert bytes(pinned) == _DATA

    @pytest.mark.parametrize(
        ("byte_range", "expected"),
        [
            (ByteRange(0, 1), (0, 1)),
            (ByteRange(0, 1024), (0, 1024)),
            (ByteRange(1000, 1024), (1000, 1024)),
            (ByteRange(1000, 5000), (1000, 1024)),  # past the end: cut there
            (ByteRange(1023, 1024), (1023, 1024)),
            (ByteRange(1024, 1024), (1024, 1024)),  # asks for nothing, at the end
            (ByteRange(10, 10), (10, 10)),
            (OffsetRange(0), (0, 1024)),
            (OffsetRange(1023), (1023, 1024)),
            (SuffixRange(1), (1023, 1024)),
            (SuffixRange(24), (1000, 1024)),
            (SuffixRange(1024), (0, 1024)),
            (SuffixRange(5000), (0, 1024)),  # longer than the object: all of it
            (None, (0, 1024)),
        ],
    )
    async def test_ranges_at_the_edges(
        self, backend: Backend, byte_range: RequestRange | None, expected: tuple[int, int]
    ) -> None:
        await self.write(backend, "obj/ranges.bin", _DATA)
        start, end = expected
        got = await backend.get("obj/ranges.bin", byte_range)
        assert got is not None
        assert bytes(got) == _DATA[start:end]
        meta = await self._head(backend, "obj/ranges.bin")
        pinned = await backend.get("obj/ranges.bin", byte_range, version=meta)
        assert pinned is not None
        assert bytes(pinned) == _DATA[start:end]
        pieces = [bytes(p) async for p in backend.stream_range(meta, byte_range, piece_bytes=100)]
        assert b"".join(pieces) == _DATA[start:end]

    @pytest.mark.parametrize(
        "byte_range",
        [
            OffsetRange(1024),  # starts at the end
            ByteRange(1024, 1025),
            ByteRange(2000, 3000),  # past the end
            ByteRange(1025, 1025),  # asks for nothing, past the end
            OffsetRange(5000),
            SuffixRange(0),
        ],
    )
    async def test_ranges_past_the_end(self, backend: Backend, byte_range: RequestRange) -> None:
        await self.write(backend, "obj/past.bin", _DATA)
        with pytest.raises(RangeNotSatisfiableError) as refused:
            await backend.get("obj/past.bin", byte_range)
        assert refused.value.size == len(_DATA)
        meta = await self._head(backend, "obj/past.bin")
        with pytest.raises(RangeNotSatisfiableError):
            await backend.get("obj/past.bin", byte_range, version=meta)
        with pytest.raises(RangeNotSatisfiableError):
            async for _ in backend.stream_range(meta, byte_range, piece_bytes=100):
                pass

    async def test_empty_object(self, backend: Backend) -> None:
        await self.write(backend, "obj/empty", b"")
        meta = await self._head(backend, "obj/empty")
        assert meta.size == 0
        assert _got(await backend.get("obj/empty")) == b""
        assert _got(await backend.get("obj/empty", version=meta)) == b""
        assert _got(await backend.get("obj/empty", ByteRange(0, 0))) == b""
        for byte_range in (OffsetRange(0), ByteRange(0, 1), SuffixRange(5)):
            with pytest.raises(RangeNotSatisfiableError):
                await backend.get("obj/empty", byte_range)
        assert [p async for p in backend.stream_range(meta, None, piece_bytes=10)] == []

    # -- a first read: the version and the bytes in one -------------------------------

    async def test_open_first_answers_the_version_and_the_bytes(self, backend: Backend) -> None:
        await self.write(backend, "obj/first.bin", _DATA)
        meta = await self._head(backend, "obj/first.bin")
        for start, end in ((0, 100), (0, 4096), (1000, 1024), (1000, 5000)):
            first = await backend.open_first("obj/first.bin", start, end, piece_bytes=64)
            assert first is not None
            assert (first.meta.version, first.meta.size) == (meta.version, meta.size)
            assert (first.start, first.end) == (start, min(end, len(_DATA)))
            assert first.pieces is not None
            assert b"".join([bytes(p) async for p in first.pieces]) == _DATA[start:end]
        # A stream the caller stops early is closed, not read to its end.
        first = await backend.open_first("obj/first.bin", 0, 1024, piece_bytes=64)
        assert first is not None
        assert first.pieces is not None
        assert len(bytes(await anext(aiter(first.pieces)))) >= 1
        await first.pieces.aclose()  # type: ignore[attr-defined]

    async def test_open_first_of_a_known_version_sends_no_bytes(self, backend: Backend) -> None:
        await self.write(backend, "obj/known.bin", _DATA)
        meta = await self._head(backend, "obj/known.bin")
        first = await backend.open_first("obj/known.bin", 0, 100, piece_bytes=64, known=meta)
        assert first is not None
        assert first.meta.version == meta.version
        if "conditional_get" not in self.lacks:  # a server that ignores If-None-Match
            assert first.pieces is None  # sends the bytes of the same version: correct
        elif first.pieces is not None:
            assert b"".join([bytes(p) async for p in first.pieces]) == _DATA[:100]
        await self.write(backend, "obj/known.bin", _DATA[::-1])  # changed: its bytes come
        first = await backend.open_first("obj/known.bin", 0, 100, piece_bytes=64, known=meta)
        assert first is not None
        assert first.meta.version != meta.version
        assert first.pieces is not None
        assert b"".join([bytes(p) async for p in first.pieces]) == _DATA[::-1][:100]

    async def test_open_first_past_the_end_absent_and_empty(self, backend: Backend) -> None:
        assert await backend.open_first("no/such/object", 0, 10, piece_bytes=64) is None
        await self.write(backend, "obj/short.bin", _DATA)
        past = await backend.open_first("obj/short.bin", len(_DATA), 2000, piece_bytes=64)
        assert past is not None
        assert (past.meta.size, past.pieces) == (len(_DATA), None)
        await self.write(backend, "obj/empty-first", b"")
        empty = await backend.open_first("obj/empty-first", 0, 10, piece_bytes=64)
        assert empty is not None
        assert (empty.meta.size, empty.pieces) == (0, None)

    # -- versions -----------------------------------------------------------------------

    async def test_versions_change_with_content(self, backend: Backend) -> None:
        await self.write(backend, "obj/v", b"first version")
        first = await self._head(backend, "obj/v")
        await self.write(backend, "obj/v", b"other version")  # the same size
        second = await self._head(backend, "obj/v")
        assert first.version != second.version
        assert first.size == second.size

    async def test_conditional_read_of_a_changed_object(self, backend: Backend) -> None:
        self.needs("conditional_get")
        await self.write(backend, "obj/cond", b"A" * 100)
        old = await self._head(backend, "obj/cond")
        await self.write(backend, "obj/cond", b"B" * 100)
        with pytest.raises(VersionChangedError):
            await backend.get("obj/cond", ByteRange(0, 10), version=old)
        with pytest.raises(VersionChangedError):
            async for _ in backend.stream_range(old, ByteRange(0, 50), piece_bytes=10):
                pass
        new = await self._head(backend, "obj/cond")
        assert _got(await backend.get("obj/cond", ByteRange(0, 3), version=new)) == b"BBB"

    # -- writes -------------------------------------------------------------------------

    async def test_put_overwrites(self, backend: Backend) -> None:
        self.needs("writes")
        self.needs("put")
        assert await backend.put("w/x", b"one")
        assert await backend.put("w/x", memoryview(b"two!"))
        assert _got(await backend.get("w/x")) == b"two!"

    async def test_put_if_absent(self, backend: Backend) -> None:
        self.needs("writes")
        self.needs("put")
        self.needs("conditional_put")
        assert backend.supports_conditional_put
        assert await backend.put("w/once", b"first", if_absent=True)
        assert not await backend.put("w/once", b"second", if_absent=True)
        assert _got(await backend.get("w/once")) == b"first"

    async def test_delete(self, backend: Backend) -> None:
        self.needs("writes")
        self.needs("delete")
        await self.write(backend, "w/gone", b"x")
        await backend.delete("w/gone")
        assert await backend.head("w/gone") is None
        await backend.delete("w/gone")  # deleting a missing object is no error
        await backend.delete("w/never-there")

    async def test_pinned_reads_of_a_deleted_object(self, backend: Backend) -> None:
        # A read pinned to a version the backend no longer holds: get answers None (the
        # object is absent), and a stream, which has no None to give, raises.
        self.needs("writes")
        self.needs("delete")
        await self.write(backend, "w/pinned", b"soon gone")
        meta = await self._head(backend, "w/pinned")
        await backend.delete("w/pinned")
        assert await backend.get("w/pinned", ByteRange(0, 4), version=meta) is None
        with pytest.raises(ObjectNotFoundError):
            async for _ in backend.stream_range(meta, ByteRange(0, 4), piece_bytes=1 << 20):
                pass

    # -- listings -----------------------------------------------------------------------

    async def _keys(self, backend: Backend, prefix: str, **kwargs: object) -> list[list[str]]:
        out: list[list[str]] = []
        scan = backend.scan(prefix, **kwargs)  # type: ignore[arg-type]
        async with contextlib.aclosing(scan):
            async for batch in scan:
                out.append([m.key for m in batch])
        return out

    async def test_scan_pages_and_prefixes(self, backend: Backend) -> None:
        self.needs("list")
        keys = [f"list/a/{n:02d}" for n in range(7)] + ["list/a.json", "list/ab", "list/b/x"]
        for key in keys:
            await self.write(backend, key, key.encode())
        everything = sorted(keys, key=lambda k: k.encode())
        assert _flat(await self._keys(backend, "")) == everything
        assert _flat(await self._keys(backend, "list")) == everything
        below_a = [k for k in everything if k.startswith("list/a/")]
        pages = await self._keys(backend, "list/a", batch=3)
        assert _flat(pages) == below_a  # a whole segment: neither list/ab nor list/a.json
        assert all(0 < len(page) <= 3 for page in pages)
        assert _flat(await self._keys(backend, "list/a/", batch=3)) == below_a
        after = await self._keys(backend, "list/a", start_after="list/a/03", batch=2)
        assert _flat(after) == below_a[4:]
        assert _flat(await self._keys(backend, "list", start_after="list/ab")) == ["list/b/x"]
        assert await self._keys(backend, "list", start_after="list/zzz") == []
        metas = [m async for batch in backend.scan("list/b") for m in batch]
        assert [(m.key, m.size) for m in metas] == [("list/b/x", len(b"list/b/x"))]
        head = await self._head(backend, "list/b/x")
        assert metas[0].version == head.version

    async def test_scan_stops_early(self, backend: Backend) -> None:
        self.needs("list")
        for n in range(5):
            await self.write(backend, f"early/{n}", b"x")
        scan = backend.scan("early", batch=2)
        async with contextlib.aclosing(scan):
            first = await anext(scan)
        assert [m.key for m in first] == ["early/0", "early/1"]

    # -- odd keys -----------------------------------------------------------------------

    async def test_odd_keys(self, backend: Backend) -> None:
        for n, key in enumerate(ODD_KEYS):
            await self.write(backend, key, key.encode() * (n + 1))
        for n, key in enumerate(ODD_KEYS):
            meta = await self._head(backend, key)
            assert meta.key == key
            assert meta.size == len(key.encode()) * (n + 1)
            got = await backend.get(key, SuffixRange(len(key.encode())), version=meta)
            assert _got(got) == key.encode()
        if "list" in self.claims:
            listed = _flat(await self._keys(backend, "odd"))
            assert listed == sorted(ODD_KEYS, key=lambda k: k.encode())
        assert await backend.head("odd/with%20space") is None  # not decoded as a URL
        assert await backend.head("odd/plus sign") is None  # nor as a form
