from __future__ import annotations

from chunkd.gateway.cli import main

raise SystemExit(main())
