"""Where selfspec keeps what it makes once per machine: converted targets, cost curves, kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$SELFSPEC_CACHE`, else `~/.cache/selfspec`."""
    return Path(os.environ.get("SELFSPEC_CACHE") or Path.home() / ".cache" / "selfspec")
