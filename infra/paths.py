"""Where trajbus keeps things outside the repository.

Two environment variables move them: ``TRAJBUS_CACHE_DIR`` (downloaded broker
jars; safe to share between users and runs) and ``TRAJBUS_STATE_DIR`` (the
embedded broker's data, log and address; one per running broker).
"""

from __future__ import annotations

import os
from pathlib import Path


def trajbus_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("TRAJBUS_CACHE_DIR") or Path(base) / "trajbus")


def default_state_dir() -> Path:
    """The embedded broker that `trajbus broker up` manages lives here."""
    override = os.environ.get("TRAJBUS_STATE_DIR")
    return Path(override) if override else trajbus_cache_dir() / "broker"
