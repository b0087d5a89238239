"""Trainer-side consumers: ready prompt groups as steps and verl ``DataProto`` batches.

The exports are imported when first used: verl imports ``trajbus.consumers.verl.plugin`` in every
process that imports verl, and that must not pull in the Kafka consumer stack.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BatchConsumer": "trajbus.consumers.batch_consumer",
    "drain": "trajbus.consumers.batch_consumer",
    "PolicyVersionPublisher": "trajbus.consumers.off_policy",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trajbus.consumers' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
