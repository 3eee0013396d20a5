"""The inspector's views of one object version, one module per format: what ``open``,
``rows`` and ``sample`` read (``docs/inspector.md``).

Every view reads through the worker's :class:`~chunkd.client.Client` only, pinned to
the version it was opened on, and only the ranges it needs; where the dataset code has
a reader of the format (:mod:`chunkd.client.datasets.formats`), the view reads through
it, so there is one reader of each format:

- :mod:`~chunkd.client.inspect.views.view`: what a view is (:class:`View
  <chunkd.client.inspect.views.view.View>`), and how a file's faults are reported.
- :mod:`~chunkd.client.inspect.views.parquet`: Parquet, through the Parquet format's
  footer scan and row groups.
- :mod:`~chunkd.client.inspect.views.lines`: text and JSON lines by line number; a
  ``.jsonl.zst`` object through the JSON lines format.
- :mod:`~chunkd.client.inspect.views.wds`: a WebDataset tar, through the WebDataset
  format's header walk.
- :mod:`~chunkd.client.inspect.views.mds`: an MDS shard, through the MDS format.
- :mod:`~chunkd.client.inspect.views.media` and
  :mod:`~chunkd.client.inspect.views.binary`: an image, audio or video object, and
  anything else.

Which view an object gets, and the views a worker keeps open, are
:mod:`chunkd.client.inspect.objects`'s.
"""
