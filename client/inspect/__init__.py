"""The data inspector's decoding side: the worker process the daemon runs to read
objects and dataset snapshots for ``/inspect/`` (``docs/inspector.md``).

- :mod:`~chunkd.client.inspect.worker`: the process (``python -m
  chunkd.client.inspect.worker``), its line protocol and its ops.
- :mod:`~chunkd.client.inspect.objects`: which view an object gets, and the views a
  worker keeps open.
- :mod:`~chunkd.client.inspect.views`: the views of one object version, one module per
  format (Parquet, JSON lines and text, WebDataset, MDS, media, binary).
- :mod:`~chunkd.client.inspect.lines`: line paging with a bounded index of offsets.
- :mod:`~chunkd.client.inspect.rl`: RL rollouts and episodes.
- :mod:`~chunkd.client.inspect.registry`: datasets, snapshots, diffs and steps.
- :mod:`~chunkd.client.inspect.values`: values as the inspector sends them.

It is client code: it reads through :class:`chunkd.client.Client` only, and never
imports the daemon.
"""

from __future__ import annotations
