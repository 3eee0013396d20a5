"""The local socket protocol between trainers and the daemon of their node.

This package is the only part of the client that the gateway imports; it needs
nothing but the standard library (and :mod:`chunkd.errors`, :mod:`chunkd.memfd`).
Its modules, each with one job:

* :mod:`~chunkd.client.protocol.ops`: the op table (:data:`OPS`), the request
  bounds, the durability levels and commit modes, :func:`request_header`;
* :mod:`~chunkd.client.protocol.fields`: a request field, its bounds and its check;
* :mod:`~chunkd.client.protocol.frames`: framing, fd passing, sending and receiving
  frames (sync and async);
* :mod:`~chunkd.client.protocol.errors`: error answers and the errors they name;
* :mod:`~chunkd.client.protocol.discovery`: where a client looks for the socket.

Every name is re-exported here: ``from chunkd.client.protocol import OPS``.

Transport: a Unix stream socket (``server.socket``; the client looks at
``$CHUNKD_SOCKET``, then ``/run/chunkd/chunkd.sock``, then ``./chunkd.sock``).

Framing, both ways::

    u32 header_length  (big-endian)
    u32 payload_length (big-endian)
    header             JSON object, UTF-8, at most MAX_HEADER bytes
    payload            raw bytes, at most MAX_PAYLOAD bytes (inline read data)

File descriptors travel with SCM_RIGHTS on the ``sendmsg`` that carries a frame's
first byte; the receiver takes them with the ``recvmsg`` that reads the 8-byte
prefix. A response names how many it carries (``"fds": n``); at most MAX_FDS.

Every request has ``"op"`` and a client-chosen ``"id"`` that its response echoes
(any JSON value of at most :data:`MAX_ID_BYTES` bytes; a longer one is refused with
``InvalidRequestError`` and an ``"id"`` of ``null``).
A connection carries one request at a time, and starts with ``hello``: a daemon
answers nothing else before it, and refuses a client of another version (whose
requests it might otherwise answer differently than that client expects, for
example a listing cut to its first page).

What a client can make the node hold. The fds of an answer are the client's from
the moment they are sent: a chunk's sealed memfd keeps its pages while the client has
it open, mapped, or still unread in its socket, even after the daemon evicted the
chunk from its RAM tier (``cache.ram_bytes``). Beyond that budget, a client holds:

* **the chunks it keeps**, open or mapped: its own choice (this package's client keeps
  at most ``cache_bytes`` of them, and the views its user keeps hold theirs);
* **at most one answer with fds it has not read, per connection**: at most
  :data:`MAX_FDS` chunks (``MAX_FDS * chunk_bytes`` bytes), or one JSON memfd (a
  manifest, a snapshot, a collection's report). After an answer with fds, the daemon
  takes up the connection's next request only once the client has read everything
  sent to it, so the chunks it leases for an answer and the answer left unread are
  never both there. A client that sent its next request first is waited for at most
  ``server.socket_send_timeout``, then served no more: the daemon shuts the
  connection down (the client reads what it has, then the end of the stream), and
  keeps it among its ``server.socket_max_clients`` connections until the client has
  read that answer or closed its socket. Every client together thus leaves at most
  ``socket_max_clients`` answers unread. A client that reads each answer before it
  sends its next request, as this package's does, is never held;
* **the staged bytes of its checkpoint saves**: the data memfd of each ``ckpt_save``,
  which the client wrote (its pages are charged to the client's memory cgroup),
  held by the daemon until the save is on the node's disk and in the backend (only
  until it is on disk while the backend is down), whether or not the client is still
  there; the daemon does not limit how many saves a client has in progress. A layout
  or JSON fd (at most :data:`MAX_LAYOUT` bytes) is read and closed while its request
  is answered.

A client that dies leaves nothing behind: the kernel closes its fds, unmaps its
mappings and drops what was unread in its socket; the daemon releases what it leased
for an answer whether or not the answer could be sent; a save it had handed over goes
on to its commit, then gives its bytes back.

Each op, with its request's fields (type, bounds, whether required), its answer and
its errors, is declared once in :data:`OPS`; the list of ops at the end of this
docstring is generated from it (:func:`~chunkd.client.protocol.ops.describe_ops`).
The daemon checks every request against it (:meth:`Op.check`) and the client builds
every request from it (:func:`request_header`): there is no second list of fields
anywhere.

Adding an op is two entries: its declaration in :data:`OPS` (in
:mod:`~chunkd.client.protocol.ops`: its fields and their bounds, the fds its request
carries, whether the daemon may hold it long, its answer and its errors), and its
handler in the daemon, in the module of its family in :mod:`chunkd.gateway.localsock`
(reads and listings, checkpoints, datasets, prefetch), registered against the op's
name. The daemon checks when it is imported that every op of :data:`OPS` has exactly
one handler and every handler names an op, so an op declared here and not answered
there stops the daemon's import, naming the op. A client method builds the request
with :func:`request_header`. A new op needs no new :data:`VERSION` (a daemon without it
answers ``InvalidRequestError``, "unknown op"); a change to what an existing op takes
or answers, which a peer of the other version would misread, does.

Bounds: every number, count and length a request can name has one, named in
:mod:`~chunkd.client.protocol.ops` (``MAX_*``) and listed with each field below;
JSON nested deeper than :data:`MAX_DEPTH`, and the non-numbers ``NaN`` and
``Infinity``, are refused.

Errors. Any request may instead get ``{"ok": false, "error": KIND, "message": TEXT}``
(and ``"chunk": ID`` when the error names a chunk): KIND is the name of a class of
the :mod:`chunkd.errors` family, which the client raises (:func:`error_of`). There
is no HTTP status on the socket; that mapping belongs to the HTTP edge alone. A
request with arguments of the wrong type or out of bounds, or a header that is not
a JSON object chunkd takes, gets ``InvalidRequestError``; the connection stays.

A frame that breaks the framing rules is a :class:`~chunkd.errors.ProtocolError`,
and what becomes of the connection depends on whether the stream is still in step:

* **answered, the connection stays** (the whole frame was read, so the next one
  starts where it should): a request that carries a payload, fds on an op that takes
  none (or more than it takes), more than :data:`MAX_FDS` fds (the kernel cut the
  rest). The answer is an error frame of kind ``ProtocolError`` (``"id"`` echoed
  when the header could be read), and the fds that came are closed.
* **the connection is closed** (there is no telling where the next frame starts):
  a prefix whose lengths are over the limits (or a header length of 0), a frame cut
  off by the end of the stream. Nothing else is affected.
"""

from __future__ import annotations

from chunkd.client.protocol.discovery import default_socket_paths
from chunkd.client.protocol.errors import error_answer, error_of
from chunkd.client.protocol.fields import Field
from chunkd.client.protocol.frames import (
    MAX_DEPTH,
    MAX_FDS,
    MAX_HEADER,
    MAX_PAYLOAD,
    PREFIX,
    Frame,
    RawFrame,
    check_prefix,
    decode_header,
    encode_frame,
    loads,
    recv_frame,
    recv_raw,
    recv_raw_async,
    send_frame,
    send_frame_async,
)
from chunkd.client.protocol.ops import (
    COMMIT_MODES,
    DURABILITY_LEVELS,
    FIRST_BATCH_PHASES,
    INLINE_MAX,
    JOB_NAME,
    LIST_PAGE,
    LOADER_BUCKETS,
    MAX_ID_BYTES,
    MAX_JOB_BYTES,
    MAX_LAYOUT,
    MAX_LIST_PAGE,
    MAX_NAME_BYTES,
    MAX_PREFETCH_QUEUED,
    MAX_PREFETCH_RANGES,
    MAX_RANGES,
    MAX_REPLICAS,
    MAX_REPORT_STEPS,
    MAX_SCRUB_PAGE,
    MAX_SECONDS,
    MAX_STEP,
    MAX_WORLD_SIZE,
    OPS,
    RESERVED_JOB_NAMES,
    VERSION,
    Op,
    check_job_name,
    describe_ops,
    request_header,
)
from chunkd.errors import ProtocolError

__all__ = [
    "COMMIT_MODES",
    "DURABILITY_LEVELS",
    "FIRST_BATCH_PHASES",
    "INLINE_MAX",
    "JOB_NAME",
    "LIST_PAGE",
    "LOADER_BUCKETS",
    "MAX_DEPTH",
    "MAX_FDS",
    "MAX_HEADER",
    "MAX_ID_BYTES",
    "MAX_JOB_BYTES",
    "MAX_LAYOUT",
    "MAX_LIST_PAGE",
    "MAX_NAME_BYTES",
    "MAX_PAYLOAD",
    "MAX_PREFETCH_QUEUED",
    "MAX_PREFETCH_RANGES",
    "MAX_RANGES",
    "MAX_REPLICAS",
    "MAX_REPORT_STEPS",
    "MAX_SCRUB_PAGE",
    "MAX_SECONDS",
    "MAX_STEP",
    "MAX_WORLD_SIZE",
    "OPS",
    "PREFIX",
    "RESERVED_JOB_NAMES",
    "VERSION",
    "Field",
    "Frame",
    "Op",
    "ProtocolError",
    "RawFrame",
    "check_job_name",
    "check_prefix",
    "decode_header",
    "default_socket_paths",
    "encode_frame",
    "error_answer",
    "error_of",
    "loads",
    "recv_frame",
    "recv_raw",
    "recv_raw_async",
    "request_header",
    "send_frame",
    "send_frame_async",
]

__doc__ = (__doc__ or "") + describe_ops()
