"""The steps partitions a worker holds, and the one lock per partition that serialises its work.

An event, the tick's flush and sweep, and recovery's direct reads all change a partition's state and
position; each holds the partition's lock while it does, so they never interleave. The assembler owns
this part and hands it to recovery: both ask it, neither asks the other.
"""

from __future__ import annotations

import asyncio
from typing import Callable


class HeldPartitions:
    """Which steps partitions this worker holds now (``active``), and each one's lock (``lock``)."""

    def __init__(self, active: Callable[[], set[int]]) -> None:
        """``active()``: the steps partitions the consumer group assigned to this worker (Faust's assignor)."""
        self._active = active
        self._locks: dict[int, asyncio.Lock] = {}

    def active(self) -> set[int]:
        return self._active()

    def lock(self, partition: int) -> asyncio.Lock:
        return self._locks.setdefault(partition, asyncio.Lock())
