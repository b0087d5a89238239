"""The worker's partition lanes: each partition's events in order, partitions side by side, every event
acknowledged once after it was applied (or passed over), a lane's failure raised to the agent."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from trajbus.streams.worker.lanes import PartitionLanes


@dataclass
class Message:
    partition: int
    offset: int


@dataclass
class Event:
    message: Message
    acks: list = field(default_factory=list)

    def ack(self) -> bool:
        self.acks.append(self.message.offset)
        return True


def events(partition: int, offsets: range) -> list[Event]:
    return [Event(Message(partition, offset)) for offset in offsets]


def test_a_partition_waiting_on_its_writes_does_not_hold_up_the_others():
    async def scenario() -> list[tuple[int, int]]:
        applied: list[tuple[int, int]] = []
        release = asyncio.Event()

        async def apply(event: Event) -> None:
            if event.message.partition == 0 and event.message.offset == 0:
                await release.wait()  # partition 0's first group waits for its acknowledgement
            applied.append((event.message.partition, event.message.offset))
            if len([p for p, _ in applied if p == 1]) == 3:
                release.set()

        async with PartitionLanes(apply, stale=lambda event: False) as lanes:
            for a, b in zip(events(0, range(3)), events(1, range(3))):
                await lanes.put(a)
                await lanes.put(b)
            while len(applied) < 6:
                await asyncio.sleep(0.01)
        return applied

    applied = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert applied[:3] == [(1, 0), (1, 1), (1, 2)]  # partition 1 went on while partition 0 waited
    assert [offset for partition, offset in applied if partition == 0] == [0, 1, 2]  # in order


def test_each_event_is_acknowledged_once_after_it_was_applied_or_passed_over():
    async def scenario(sent: list[Event]) -> list[int]:
        applied: list[int] = []

        async def apply(event: Event) -> None:
            assert event.acks == []  # not acknowledged before it is applied
            applied.append(event.message.offset)

        async with PartitionLanes(apply, stale=lambda event: event.message.offset % 2 == 1) as lanes:
            for event in sent:
                await lanes.put(event)
            while sum(len(event.acks) for event in sent) < len(sent):
                await asyncio.sleep(0.01)
        return applied

    sent = events(3, range(6))
    assert asyncio.run(asyncio.wait_for(scenario(sent), 10)) == [0, 2, 4]  # the stale ones passed over
    assert [event.acks for event in sent] == [[offset] for offset in range(6)]


def test_a_lane_that_failed_raises_its_error_at_the_next_event():
    async def scenario() -> None:
        async def apply(event: Event) -> None:
            raise RuntimeError(f"gave up on offset {event.message.offset}")

        async with PartitionLanes(apply, stale=lambda event: False) as lanes:
            first = events(0, range(1))[0]
            await lanes.put(first)
            while not first.acks:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0)  # the lane's end is noticed
            await lanes.put(events(1, range(1))[0])

    with pytest.raises(RuntimeError, match="gave up on offset 0"):
        asyncio.run(asyncio.wait_for(scenario(), 10))


def test_closing_interrupts_the_event_in_progress_and_acknowledges_what_was_queued():
    async def scenario(sent: list[Event]) -> list[int]:
        started: list[int] = []

        async def apply(event: Event) -> None:
            started.append(event.message.offset)
            await asyncio.Event().wait()  # never acknowledged by the broker

        lanes = PartitionLanes(apply, stale=lambda event: False, depth=8)
        for event in sent:
            await lanes.put(event)
        while not started:
            await asyncio.sleep(0.01)
        await lanes.close()
        return started

    sent = events(5, range(4))
    assert asyncio.run(asyncio.wait_for(scenario(sent), 10)) == [0]
    assert [event.acks for event in sent] == [[0], [1], [2], [3]]  # Faust waits for none of them
