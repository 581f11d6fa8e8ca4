"""The one cache folder (models, compiled kernels, calibration results):
``$TINYSERVE_CACHE_DIR``, default ``~/.cache/tinyserve``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    env = os.environ.get("TINYSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tinyserve"
