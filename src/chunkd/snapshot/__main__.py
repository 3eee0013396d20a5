"""``python -m chunkd.snapshot --memory BYTES [--shape-only]``: a large manifest's check in
a worker process (:func:`chunkd.snapshot.worker.manifest_check_main`)."""

from __future__ import annotations

from chunkd.snapshot.worker import manifest_check_main

raise SystemExit(manifest_check_main())
