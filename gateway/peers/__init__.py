"""Peers: the other chunkd nodes of a cluster, and which of them owns which chunk.

A chunk is read from the backend once for the cluster: its owner among the healthy
members fetches it, and the others ask the owner for it over the peer protocol,
verifying what they get against its id. One job per module:

- :mod:`.membership`: who the members are (``[peers]``: a static list, a file
  re-read when it changes, a DNS name re-resolved every round), the addresses
  they connect from (the peers' connection budget) and their labels (``rack=``);
- :mod:`.health`: the ``/healthz`` probes, members marked down and up, and whether
  this node is apart from the others or rejoined lately (the handoff window);
- :mod:`.placement`: rendezvous (HRW) hashing, and the list of members a reader
  asks for a key, in order;
- :mod:`.client`: the peer protocol (written down there) from the asking side: one
  GET per source, the adaptive wait on a busy or silent owner, verification and
  counting;
- :mod:`.token`: the shared secret, read from ``token_file`` and checked in
  constant time;
- :mod:`.holders`: the lists a chunk's owner keeps of the members that hold it, so
  that a hot chunk spreads over its holders, not just its owner (bounded, expiring);
- :mod:`.replicas`: copies of a save's chunks in other failure domains' RAM, so that a
  replaced node restores from its peers; :mod:`.replica_routes` serves their pushes;
- :mod:`.cluster`: :class:`Peers`, which puts them together for the daemon.

The chunk and page routes are served by :mod:`chunkd.gateway.api`.
"""

from __future__ import annotations

from chunkd.errors import OwnerSilentError
from chunkd.gateway.peers.cluster import Peers
from chunkd.gateway.peers.membership import Peer
from chunkd.gateway.peers.placement import rank_owners
from chunkd.gateway.peers.token import read_token

__all__ = ["OwnerSilentError", "Peer", "Peers", "rank_owners", "read_token"]
