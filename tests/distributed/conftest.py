"""The tensor-parallel tests reuse the parity helpers of tests/model (tiny checkpoints, the
paged-cache driver); spawned rank processes inherit this sys.path."""

from __future__ import annotations

import sys
from pathlib import Path

here = Path(__file__).resolve().parent
for p in (here, here.parent / "model"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
