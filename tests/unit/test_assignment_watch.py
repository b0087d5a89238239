"""The assignment watch rejoins for a topic the group's assignment left out, after its timeout, and
never for a worker that merely holds nothing."""

from __future__ import annotations

import asyncio

from trajbus.streams.worker.assignment_watch import AssignmentWatch

TOPICS = ("p.steps.train", "p-worker-train-assembly-changelog")


class FakeGroup:
    """``rejoin_for`` of the worker's consumer: the topics Kafka knows, and the rejoins asked for."""

    def __init__(self, known: set[str]) -> None:
        self.known, self.rejoins = known, 0

    async def rejoin_for(self, topics: frozenset[str]) -> set[str]:
        found = set(topics) & self.known
        self.rejoins += bool(found)
        return found


def test_a_left_out_topic_is_asked_for_after_the_timeout_and_again_if_still_left_out():
    now = [100.0]
    watch = AssignmentWatch(TOPICS, timeout=30, clock=lambda: now[0])
    group = FakeGroup(known=set())
    check = lambda: asyncio.run(watch.check(group.rejoin_for))  # noqa: E731
    assert not check(), "no assignment yet"
    watch.assigned(lambda topic: False)  # the leader's metadata knew neither topic
    assert watch.left_out == set(TOPICS)
    now[0] = 129.0
    assert not check() and group.rejoins == 0, "within the timeout"
    now[0] = 131.0
    assert not check() and group.rejoins == 0, "Kafka does not know the topics yet: no rejoin"
    group.known = {TOPICS[0]}
    now[0] = 132.0
    assert check() and group.rejoins == 1 and watch.rejoins == 1, "known now: rejoined at once"
    now[0] = 150.0
    assert not check(), "a rejoin has its own timeout to bring an assignment"
    now[0] = 163.0
    assert check() and group.rejoins == 2, "no new assignment came: asked again"
    watch.revoked()
    now[0] = 300.0
    assert not check(), "mid-rebalance: nothing to judge"
    watch.assigned(lambda topic: True)
    now[0] = 1000.0
    assert not check() and watch.left_out == set(), "every topic covered"


def test_a_worker_holding_nothing_in_a_covering_assignment_never_rejoins():
    """More workers than partitions: this one holds none, but the assignment covered every topic."""
    now = [0.0]
    watch = AssignmentWatch(TOPICS, timeout=30, clock=lambda: now[0])
    group = FakeGroup(known=set(TOPICS))
    watch.assigned(lambda topic: True)
    for now[0] in (31.0, 300.0, 3000.0):
        assert not asyncio.run(watch.check(group.rejoin_for))
    assert group.rejoins == 0


def test_only_the_left_out_topics_are_asked_for():
    now = [0.0]
    watch = AssignmentWatch(TOPICS, timeout=5, clock=lambda: now[0])
    asked: list[frozenset[str]] = []

    async def rejoin_for(topics: frozenset[str]) -> set[str]:
        asked.append(topics)
        return set(topics)

    watch.assigned(lambda topic: topic == TOPICS[0])  # the changelog alone was ignored
    now[0] = 6.0
    assert asyncio.run(watch.check(rejoin_for))
    assert asked == [frozenset({TOPICS[1]})]


def test_an_assignment_that_arrives_during_the_rejoin_is_what_counts():
    now = [0.0]
    watch = AssignmentWatch(TOPICS, timeout=30, clock=lambda: now[0])

    async def rejoin_for(topics: frozenset[str]) -> set[str]:
        watch.revoked()  # the rebalance ran in the consumer's thread before the call returned
        watch.assigned(lambda topic: True)
        return set(topics)

    watch.assigned(lambda topic: False)
    now[0] = 31.0
    assert asyncio.run(watch.check(rejoin_for)) and watch.rejoins == 1
    now[0] = 1000.0
    assert not watch.due() and watch.since is None, "the covering assignment stands"
