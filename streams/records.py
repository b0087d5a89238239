"""``streams.records``, the name shared/CONTRACT.md gives the records: they live in ``streams.wire.records``."""

from trajbus.streams.wire.records import ReadyGroup, Step, TrajectoryEnd

__all__ = ["ReadyGroup", "Step", "TrajectoryEnd"]
