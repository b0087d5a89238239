"""Step bodies of pending groups: held as they arrive up to a bound, else read back from the log."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from trajbus.streams.wire import codec
from trajbus.streams.worker.bodies import StepBodies
from trajbus.streams.wire.records import Step


@dataclass
class Record:
    offset: int
    value: bytes


def encoded(index: int) -> bytes:
    return codec.encode(Step(prompt_ids=[1] * 50, response_ids=[index], trajectory_uid="t", prompt_uid="p",
                             step_index=index))


class Topic:
    """One steps partition as a list; counts the ranges read back."""

    def __init__(self, n: int, retained_from: int = 0) -> None:
        self.values = [encoded(i) for i in range(n)]
        self.retained_from = retained_from
        self.reads: list[tuple[int, int]] = []

    def read_back(self, channel: str, partition: int, start: int, end: int) -> list[Record]:
        self.reads.append((start, end))
        return [Record(o, self.values[o]) for o in range(max(start, self.retained_from), end)]


def test_held_bodies_are_served_without_a_read_and_forgotten_ones_free_their_bytes():
    topic = Topic(4)
    bodies = StepBodies(max_bytes=10**6, read_back=topic.read_back)
    for offset in range(4):
        bodies.put(("train", 0), offset, topic.values[offset])
    steps = asyncio.run(bodies.steps(("train", 0), [3, 1]))
    assert {o: s.response_ids.tolist() for o, s in steps.items()} == {1: [1], 3: [3]} and topic.reads == []
    bodies.forget(("train", 0), [0, 1, 2, 3])
    assert bodies.bytes_in_use == 0


def test_past_the_bound_the_oldest_go_and_are_read_back_in_one_range():
    topic = Topic(6)
    size = len(topic.values[0])
    bodies = StepBodies(max_bytes=3 * size, read_back=topic.read_back)
    for offset in range(6):
        bodies.put(("train", 0), offset, topic.values[offset])
    assert bodies.bytes_in_use <= 3 * size
    steps = asyncio.run(bodies.steps(("train", 0), range(6)))
    assert [steps[o].response_ids.tolist() for o in range(6)] == [[o] for o in range(6)]
    assert topic.reads == [(0, 3)], "only the evicted, once"


def test_a_body_gone_from_the_topic_is_named():
    topic = Topic(4, retained_from=2)
    bodies = StepBodies(max_bytes=10**6, read_back=topic.read_back)
    with pytest.raises(LookupError, match=r"offsets \[0, 1\] are no longer in the topic"):
        asyncio.run(bodies.steps(("train", 0), [0, 1, 3]))


def test_a_body_larger_than_the_whole_bound_is_read_back_not_held():
    topic = Topic(2)
    bodies = StepBodies(max_bytes=len(topic.values[0]) - 1, read_back=topic.read_back)
    bodies.put(("train", 0), 0, topic.values[0])
    assert bodies.bytes_in_use == 0
    steps = asyncio.run(bodies.steps(("train", 0), [0]))
    assert steps[0].response_ids.tolist() == [0] and topic.reads == [(0, 1)]
