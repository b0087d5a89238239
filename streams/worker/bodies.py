"""Step bodies of pending groups: the records as read, kept in memory up to a bound, else read back.

The worker's table holds each pending group's index (source offsets), not its steps:
the steps topic already holds them durably, and rewriting a growing group at every
event made the changelog grow with the square of the group. The common path finds a
body here, as it arrived; a body evicted by the bound, or not seen by this process (a
restart, a partition taken over), is read back from the steps topic when its group is
emitted, so a worker's memory is bounded and nothing depends on it. The bound is in bytes:
cachetools' ``LRUCache`` with each body's length as its size.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Iterable

from cachetools import LRUCache

from trajbus.streams.wire import codec
from trajbus.streams.wire.prefix import StepDelta
from trajbus.streams.wire.records import Step

Where = tuple[str, int]
"""(channel, source partition)."""


class StepBodies:
    """Encoded steps by (channel, partition, offset), least recently used out first past ``max_bytes``."""

    def __init__(self, max_bytes: int, read_back: Callable[[str, int, int, int], list],
                 on_read_back: Callable[[int], Any] = lambda count: None) -> None:
        """``read_back(channel, partition, start, end)``: the records at ``start <= offset < end``;
        ``on_read_back(count)``: told how many records each read back returned (a metric)."""
        self.max_bytes = max_bytes
        self.read_back = read_back
        self.on_read_back = on_read_back
        self._bodies: LRUCache[tuple[str, int, int], bytes] = LRUCache(max_bytes, getsizeof=len)

    @property
    def bytes_in_use(self) -> int:
        return int(self._bodies.currsize)

    def put(self, where: Where, offset: int, value: bytes) -> None:
        """Hold a body as it arrived; one larger than the whole bound is not held (it is read back)."""
        key = (*where, offset)
        if key not in self._bodies and len(value) <= self.max_bytes:
            self._bodies[key] = value

    def forget(self, where: Where, offsets: Iterable[int]) -> None:
        for offset in offsets:
            self._bodies.pop((*where, offset), None)

    async def steps(self, where: Where, offsets: Iterable[int]) -> dict[int, Step | StepDelta]:
        """The steps at ``offsets``, decoded with their token ids and log-probs as numpy arrays (they are
        only re-encoded into a group); those not held are read back from the topic in one range."""
        wanted = sorted(set(offsets))
        found = {o: self._bodies[(*where, o)] for o in wanted if (*where, o) in self._bodies}
        missing = [o for o in wanted if o not in found]
        if missing:
            records = await asyncio.to_thread(self.read_back, *where, missing[0], missing[-1] + 1)
            needed = set(missing)
            for record in records:
                if record.offset in needed:
                    found[record.offset] = record.value
            self.on_read_back(len(records))
            lost = needed - set(found)
            if lost:
                raise LookupError(f"steps of {where[0]}[{where[1]}] at offsets {sorted(lost)[:5]} are no longer "
                                  f"in the topic (retention): their group cannot be assembled")
        return {offset: codec.decode(value, arrays=True) for offset, value in found.items()}
