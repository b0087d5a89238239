"""Where the worker stands in each steps partition: the next source offset to apply.

Faust's committed offsets say where its consumer resumes, not what the table
applied, and faust-streaming 0.15 can resume a partition past its first records,
leave a partition's tail undelivered after a rebalance, or never fetch an assigned
partition at all (faust-streaming issues #471, #629). So the worker keeps its own
position per (channel, partition) in the table (``AssemblyState.applied_position``), checks every
delivered offset against it, and reads directly what stays undelivered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from trajbus.infra.group_lag import consumer_group_lag
from trajbus.infra.retry import retrying_async
from trajbus.streams.wire.topics import steps_topic
from trajbus.streams.worker.state_store import AssemblyState

log = logging.getLogger("trajbus.worker")

STALL_AFTER = 3.0
"""Seconds a partition's log may end past our position, with the position not moving, before the
records are read directly: long enough for Faust to deliver a burst, short enough for a trainer."""


class SourcePositions:
    """Applied source positions per (channel, partition), in memory and saved in the table."""

    def __init__(self, state: AssemblyState, bootstrap_servers: str, group_id: str, prefix: str,
                 resume_deadline: float) -> None:
        self.state, self.bootstrap_servers, self.group_id, self.prefix = state, bootstrap_servers, group_id, prefix
        self.resume_deadline = resume_deadline
        self._expected: dict[tuple[str, int], int] = {}
        self.stalls: dict[tuple[str, int], tuple[int | None, float]] = {}
        """(channel, partition) -> (our position, since when) while the log ends past it."""
        self.resume_points: dict[str, dict[int, int]] = {}
        """Per channel, where the worker group resumes each partition, read once per assignment."""

    def known(self, channel: str, partition: int) -> int | None:
        """The next source offset to apply, from memory or else from the recovered table."""
        if (channel, partition) in self._expected:
            return self._expected[(channel, partition)]
        applied = self.state.applied_position(partition, channel)
        return None if applied is None else applied + 1

    def in_memory(self, channel: str, partition: int, default: int) -> int:
        """The next source offset to apply as held in memory (set by ``start_of`` and each applied record),
        else ``default``: unlike ``known`` never read from the table, so a range being applied goes by
        what it applied itself."""
        return self._expected.get((channel, partition), default)

    async def resume_point(self, channel: str, partition: int) -> int:
        """With no position saved (a new table): where this worker group resumes, its committed offset,
        else the log start. Read for every partition at once: a partition's commit cannot move before
        its first event is applied, which waits for this. Raises where Kafka does not answer."""
        if channel not in self.resume_points:
            topic = steps_topic(channel, self.prefix)
            lags = await asyncio.to_thread(consumer_group_lag, self.bootstrap_servers, self.group_id, topic)
            self.resume_points[channel] = {lag.partition: lag.position for lag in lags}
        return self.resume_points[channel][partition]

    async def start_of(self, channel: str, partition: int) -> int:
        """``known``, else the resume point, asked again through an outage (up to ``resume_deadline``
        seconds, under the one retry policy): guessing from the offset Faust delivers could skip records
        nothing would reveal."""
        position = self.known(channel, partition)
        if position is None:
            position = await self.asked_resume_point(channel, partition)
        self._expected[(channel, partition)] = position
        return position

    async def asked_resume_point(self, channel: str, partition: int) -> int:
        what = f"resume point of {steps_topic(channel, self.prefix)}[{partition}]"
        try:
            async for attempt in retrying_async(self.resume_deadline, log, f"asking the {what}"):
                with attempt:
                    return await self.resume_point(channel, partition)
        except Exception as exc:  # noqa: BLE001 - Kafka away past the deadline: said with the last error
            raise RuntimeError(f"{what} unknown after {self.resume_deadline:.0f}s: {exc}") from exc
        raise AssertionError("unreachable: the retries end in a value or an error")

    def advance(self, channel: str, partition: int, offset: int) -> None:
        """``offset`` was applied. A partition's first position is saved at once, as the offset before
        this one (its group change reaches the table only with the next tick); later ones once a tick.
        Without a saved position, a new owner would have to ask the consumer group again."""
        self._expected[(channel, partition)] = offset + 1
        if self.state.applied_position(partition, channel) is None:
            self.state.save_position(partition, channel, offset - 1)

    def stalled(self, channel: str, partition: int, end: int) -> bool:
        """Whether the log, ending at ``end``, has stood past our position for ``STALL_AFTER`` seconds
        while the position did not move (a partition never delivered stalls at no position)."""
        key, position = (channel, partition), self.known(channel, partition)
        if end == 0 or (position is not None and end <= position):
            self.stalls.pop(key, None)
            return False
        now = time.monotonic()
        seen = self.stalls.get(key)
        if seen is None or seen[0] != position:
            self.stalls[key] = (position, now)
            return False
        return now - seen[1] >= STALL_AFTER

    def save(self, partition: int) -> None:
        """Write a partition's applied positions to the table (once per tick).

        A saved position may lag what was applied: after a restart the events in
        between are read again and recognised as replays (by the group's last offset
        or its emitted marker). It must never lead, and it cannot: it is written to
        the same changelog partition after the writes of the events it covers.
        """
        for (channel, owner), next_offset in self._expected.items():
            if owner == partition:
                self.state.save_position(partition, channel, next_offset - 1)

    def forget_partition(self, partition: int) -> None:
        """One partition's positions are re-read from the table (an event of it failed half-way)."""
        for key in [key for key in self._expected if key[1] == partition]:
            del self._expected[key]
            self.stalls.pop(key, None)

    def forget(self) -> None:
        """After a rebalance, positions are re-read from the recovered table."""
        self._expected.clear()
        self.stalls.clear()
        self.resume_points.clear()
