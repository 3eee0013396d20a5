"""A soak client process: ``python -m chunkd.testing.soak PLAN``."""

from __future__ import annotations

import sys

from chunkd.testing.soak.client import client_main

if __name__ == "__main__":
    raise SystemExit(client_main(sys.argv[1]))
