"""Where relpos keeps what it builds once: the parsed chorales (:mod:`relpos.music.cache`) and
the compiled C kernels (:mod:`relpos.native`)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_ENV_VAR", "default_cache_dir"]

#: Environment variable that overrides the default cache directory.
CACHE_ENV_VAR = "RELPOS_CACHE"


def default_cache_dir() -> Path:
    """``$RELPOS_CACHE`` if set (and non-empty), else ``~/.cache/relpos``."""
    env = os.environ.get(CACHE_ENV_VAR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "relpos"
