"""The local socket: sealed chunks handed to the trainers of this node.

Speaks :mod:`chunkd.client.protocol` (framing, ops and fd passing are written down
there). For a read, each chunk of the range goes out as its sealed memfd
(SCM_RIGHTS); the client maps it read-only, so the bytes cross no socket and the
node holds one copy whatever the number of readers. Small reads are answered
inline. Its rooms, each with one job:

* :mod:`.server`: the transport (:class:`LocalServer`): bind, permissions and
  group, accept, peer credentials, framing, ``SIOCOUTQ`` backpressure, a waiting
  request stopped when its client goes, and dispatch: a lookup in
  :data:`~.server.HANDLERS` by the request's op;
* :mod:`.answer`: :class:`~.answer.Answer`, what an answer carries besides its
  header (leases, fds, payload), which every handler fills;
* :mod:`.family`: how a family registers its handlers
  (:class:`~.family.Family`), the daemon's parts they may call
  (:class:`~.family.Parts`), and the table's check;
* one module of ops per family: :mod:`.read_ops` (``stat``, ``read``, ``readv``,
  ``list``), :mod:`.checkpoint_ops` (``ckpt_*``), :mod:`.dataset_ops` (``ds_*``),
  :mod:`.prefetch_ops` (``hello``, ``prefetch``).

A handler calls the parts of :class:`~.family.Parts` through their public
methods, and reaches through none of them to a third.

Adding an op is two entries:

1. its declaration in :data:`chunkd.client.protocol.OPS` (fields, bounds, fds,
   answer, errors; the server checks each request against it, and the client builds
   each request from it);
2. its handler in its family's module, registered with ``@FAMILY.op("name")``: an
   ``async`` function of ``(parts, args, answer)`` that returns the answer's header.

The server checks, when it is imported, that every op of ``OPS`` has exactly one
handler and every handler names an op of ``OPS``
(:func:`~.family.handler_table`): an op declared without a handler, or a handler of
an op not declared, fails the daemon's import with a message naming it.
"""

from __future__ import annotations

from chunkd.gateway.localsock.server import LocalServer

__all__ = ["LocalServer"]
