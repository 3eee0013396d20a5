"""A large manifest's check, in a process of its own (``python -m chunkd.snapshot``).

The daemon starts it by module name (``gateway/datasets/registry.py``) so that a large
parse's memory and GIL are a worker's, under an address-space limit.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from chunkd.errors import ManifestError
from chunkd.snapshot.manifest import Snapshot, snapshot_id
from chunkd.snapshot.shape import check_manifest_shape

__all__ = ["manifest_check_main"]


def manifest_check_main(argv: Sequence[str] | None = None) -> int:
    """``python -m chunkd.snapshot --memory BYTES [--shape-only]``: check the manifest
    on fd 0 as :meth:`Snapshot.parse` does, under an address-space limit of BYTES.

    The daemon runs it for a manifest too large to parse in its own process
    (``ds_commit``; docs/datasets.md, "What a registration may cost the daemon"): the
    parse's Python objects, about 11 times a real manifest's size, then live and die
    in this process, and the daemon's event loop never waits on its GIL. fd 0 is a
    regular file or a memfd, read whole from offset 0. One JSON line goes to stdout:
    ``{"id": ID, "members": N, "samples": N, "claims": [FIELD, ...], "schema": N,
    "peak_bytes": N}``
    (``claims``: :attr:`Snapshot.claims`, the fields of chunkd's own records the
    manifest carries), or ``{"error": KIND, "message": TEXT}``; the exit status is 0
    either way (anything else is a crash).

    With ``--shape-only`` (the daemon resolving a large manifest it is about to parse
    itself): only its hash and shape (:func:`check_manifest_shape`), nothing parsed;
    the answer is ``{"id": ID, "peak_bytes": N}`` or the error.
    """
    import argparse
    import os
    import resource
    import sys

    parser = argparse.ArgumentParser(prog="python -m chunkd.snapshot")
    parser.add_argument("--memory", type=int, required=True, help="RLIMIT_AS, bytes")
    parser.add_argument("--shape-only", action="store_true", help="hash and shape only")
    args = parser.parse_args(argv)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = args.memory if hard == resource.RLIM_INFINITY else min(args.memory, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    answer: dict[str, Any]
    size = 0
    try:
        size = os.fstat(0).st_size
        data = os.pread(0, size, 0) if size else b""
        if args.shape_only:
            ident = snapshot_id(data)
            check_manifest_shape(data)
            answer = {"id": ident}
        else:
            snapshot = Snapshot.parse(data)
            answer = {
                "id": snapshot.id,
                "members": len(snapshot.members),
                "samples": len(snapshot),
                "claims": list(snapshot.claims),
                "schema": snapshot.schema,
            }
    except ManifestError as exc:
        answer = {"error": "ManifestError", "message": str(exc)}
    except MemoryError:
        answer = {
            "error": "ManifestError",
            "message": (
                f"checking the manifest of {size} bytes needed more than {limit >> 20} MiB "
                "of memory, more than a manifest of its size takes: it is not one"
            ),
        }
    answer["peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sys.stdout.write(json.dumps(answer) + "\n")
    return 0
