"""User code named by a dotted path in a setting: a group filter, a reward function, an agent, a rollout.

Every layer takes such settings, so the one way to resolve them lives at the bottom, and an error names
the setting that held the path, not only the path.
"""

from __future__ import annotations

import importlib
from typing import Any


def import_dotted(path: str, what: str) -> Any:
    """``package.module:attr`` or ``package.module.attr`` -> the object; ``ValueError`` naming ``what``."""
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{what}: {path!r} is not a dotted path like package.module.function")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what}: cannot import {path!r} ({exc})") from None
