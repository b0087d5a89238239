"""What the worker's halves (``streams.emission``, ``streams.recovery``) use of ``streams.app.GroupAssembler``.

The assembler is one object split by concept into mixins; each mixin declares here,
once, the parts of the assembler it relies on, so a reader (and a type checker)
sees them without opening ``streams.app``.
"""

from __future__ import annotations

from typing import MutableMapping

from trajbus.streams.assembly import PendingGroup
from trajbus.streams.bodies import StepBodies
from trajbus.streams.settings import WorkerSettings
from trajbus.streams.stats import WorkerMetrics


class AssemblerParts:
    """Attributes set by ``GroupAssembler.__init__``."""

    bootstrap_servers: str
    settings: WorkerSettings
    prefix: str
    state: MutableMapping[bytes, bytes]
    """The Faust table (keys: ``StateKey``)."""
    pending: dict[int, dict[bytes, PendingGroup]]
    """Per source partition, pending groups changed since the last tick."""
    metrics: WorkerMetrics
    bodies: StepBodies
