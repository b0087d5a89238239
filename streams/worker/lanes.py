"""One lane per source partition: a partition's events in order, the partitions side by side.

A group's end costs two acknowledged writes (the group, then its ledger outcome), each a replication
round trip on a cluster (14-16 ms on 3 nodes). Applied one event at a time, as a Faust agent does, every
partition waits for every other partition's round trips: one worker emitted a few dozen groups a second
whatever its partitions. Here the agent only routes each event to its partition's lane (a bounded queue
and a task); each lane applies its events in order, so the exactly-once rules, which are per partition
(positions, markers, the ledger before the table), hold as before, while the round trips of different
partitions overlap.

Faust's own guarantees are kept by acknowledging each event by hand once its lane applied it (the agent
reads ``stream.noack()``): the committed offset never passes an event not yet applied, and a rebalance
waits for the lanes as it waits for an agent's event in progress. An event of an older consumer generation
(a rebalance happened since it was read), or read while flow is suspended for one, is acknowledged and not
applied, as Faust's stream skips it; the next owner applies it from the table's positions.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

log = logging.getLogger("trajbus.worker")

LANE_DEPTH = 64
"""Events a lane holds before the agent waits: enough to cover a round trip of a busy partition, few
enough that a rebalance drains them at once."""


class PartitionLanes:
    """Routes events to per-partition lanes; an async context manager that closes every lane on exit."""

    def __init__(self, apply: Callable[[Any], Awaitable[None]], stale: Callable[[Any], bool],
                 depth: int = LANE_DEPTH) -> None:
        """``apply(event)``: one event, in its partition's order; ``stale(event)``: whether to pass it over
        (acknowledged, not applied)."""
        self.apply, self.stale, self.depth = apply, stale, depth
        self._lanes: dict[int, tuple[asyncio.Queue, asyncio.Task]] = {}
        self._failure: BaseException | None = None

    async def __aenter__(self) -> PartitionLanes:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def put(self, event: Any) -> None:
        """Queue ``event`` on its partition's lane (waits while the lane is full). A lane that failed
        raises its error here, as the agent's own event would have."""
        self.raise_failure()
        partition = event.message.partition
        if partition not in self._lanes:
            queue: asyncio.Queue = asyncio.Queue(self.depth)
            task = asyncio.create_task(self._run(queue), name=f"trajbus-lane-{partition}")
            task.add_done_callback(self._ended)
            self._lanes[partition] = (queue, task)
        await self._lanes[partition][0].put(event)

    def raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    async def _run(self, queue: asyncio.Queue) -> None:
        while True:
            event = await queue.get()
            try:
                if not self.stale(event):
                    await self.apply(event)
            finally:
                event.ack()  # as Faust's stream acknowledges an agent's event, failed or not
                queue.task_done()

    def _ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._failure = task.exception()
            log.error("%s stopped: %r", task.get_name(), self._failure)

    async def close(self) -> None:
        """Cancel every lane (an event in progress is interrupted, as Faust interrupts an agent) and
        acknowledge what was still queued: Faust waits for every event it handed out to be acknowledged."""
        for queue, task in self._lanes.values():
            task.cancel()
        await asyncio.gather(*(task for _, task in self._lanes.values()), return_exceptions=True)
        for queue, _ in self._lanes.values():
            while not queue.empty():
                queue.get_nowait().ack()
        self._lanes.clear()
