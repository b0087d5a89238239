"""Trainer-side consumers: ready prompt groups as steps and verl ``DataProto`` batches.

The exports are imported when first used: verl imports ``trajbus.consumers.verl.plugin`` in every
process that imports verl, and that must not pull in the Kafka consumer stack.
"""

from __future__ import annotations

from trajbus.infra.lazy import lazy_exports

_EXPORTS = {
    "BatchConsumer": "trajbus.consumers.batch_consumer",
    "drain": "trajbus.consumers.batch_consumer",
    "PolicyVersionPublisher": "trajbus.consumers.off_policy",
    "UnknownChannel": "trajbus.consumers.channels",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports("trajbus.consumers", _EXPORTS, lambda: globals())
