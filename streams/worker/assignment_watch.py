"""A watch on the worker's group assignment: a topic the assignment left out is asked for again.

Faust's assignor (faust-streaming 0.15) assigns only the topics the leader's metadata knows;
for any other it logs ``Ignoring missing topic`` and the whole group holds none of that
topic's partitions. aiokafka rejoins once the leader's metadata shows the topic, but it
refreshes that metadata only every 5 minutes while no partition is fetched. Seen after a
broker was SIGKILLed while a worker joined its group and restarted on its port (issue 35):
the worker stayed alive, held no partition, assembled nothing, and every acknowledged step
waited. Every member learns which topics an assignment covered (Faust's topic groups), so
each can tell a left-out topic from a worker that merely has none to hold (more workers than
partitions). A topic left out for ``--unassigned-timeout`` seconds makes the worker refresh
its consumer's metadata and, where Kafka knows the topic, rejoin the group: the next
assignment covers it. Left out again, it tries again after another timeout.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Awaitable, Callable, Iterable

import faust

from trajbus.streams.worker.periodic import every
from trajbus.streams.worker.settings import WorkerSettings
from trajbus.streams.worker.stats import WorkerMetrics
from trajbus.streams.wire.topics import channel_of, steps_topic

log = logging.getLogger("trajbus.worker")

CHECK_INTERVAL = 1.0
"""Seconds between checks: a left-out topic is asked for within the timeout plus this."""


class AssignmentWatch:
    """The rule: which topics the last assignment left out, and when it is time to rejoin for them."""

    def __init__(self, topics: Iterable[str], timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.topics = frozenset(topics)
        self.timeout, self.clock = timeout, clock
        self.left_out: frozenset[str] = frozenset()
        self.since: float | None = None
        """When the left-out topics were last asked for (or left out): the timeout counts from there."""
        self.rejoins = 0

    def assigned(self, covers: Callable[[str], bool]) -> None:
        """A new assignment: ``covers(topic)`` says whether it assigned that topic's partitions."""
        self.left_out = frozenset(topic for topic in self.topics if not covers(topic))
        self.since = self.clock() if self.left_out else None
        if self.left_out:
            log.warning("the group's assignment left out %s (unknown to the broker's metadata then); "
                        "rejoining in %.0fs unless a rebalance covers them", sorted(self.left_out), self.timeout)

    def revoked(self) -> None:
        """A rebalance began: nothing to judge until its assignment."""
        self.left_out, self.since = frozenset(), None

    def due(self) -> frozenset[str]:
        """The topics left out for ``timeout`` seconds or more: time to ask for them (none: empty)."""
        if self.since is None or self.clock() - self.since < self.timeout:
            return frozenset()
        return self.left_out

    async def check(self, rejoin_for: Callable[[frozenset[str]], Awaitable[set[str]]]) -> bool:
        """Rejoin if it is time; ``rejoin_for`` rejoins if Kafka knows any of the topics and returns those.
        Returns whether it rejoined. Topics Kafka does not know are asked for again at the next check."""
        topics, since = self.due(), self.since
        if not topics or since is None:
            return False
        known = await rejoin_for(topics)  # the new assignment may come before this returns
        if not known:
            return False
        self.rejoins += 1
        log.warning("topics %s exist but the group's assignment left them out %.0fs before: rejoined the group",
                    sorted(known), self.clock() - since)
        if self.since == since:  # no assignment meanwhile: another timeout for this rejoin to bring one
            self.since = self.clock()
        return True


def covered_by(app: faust.App) -> Callable[[str], bool]:
    """Whether the last assignment covered a topic: Faust's assignor sends every member the topic groups
    it assigned, and a topic it ignored has none."""
    def covers(topic: str) -> bool:
        try:
            app.assignor.group_for_topic(topic)
        except KeyError:
            return False
        return True
    return covers


def held_by_channel(app: faust.App, prefix: str, channels: Iterable[str]) -> dict[str, set[int]]:
    """The steps partitions this worker holds, by channel."""
    topics = {steps_topic(channel, prefix) for channel in channels}
    held: dict[str, set[int]] = {}
    for tp in app.assignor.assigned_actives():
        if tp.topic in topics:
            held.setdefault(channel_of(tp.topic, prefix), set()).add(tp.partition)
    return held


def watch_assignment(app: faust.App, settings: WorkerSettings, metrics: WorkerMetrics,
                     changelog: str) -> AssignmentWatch:
    """Wire a watch over the steps topics and the table's changelog (``changelog``) into ``app``; the
    worker's ``trajbus_worker_partitions_held`` and ``trajbus_worker_group_rejoins`` follow it."""
    prefix = settings.topics.prefix
    topics = [steps_topic(channel, prefix) for channel in settings.channels]
    watch = AssignmentWatch([*topics, changelog], settings.unassigned_timeout)

    @app.on_partitions_revoked.connect
    async def forget_assignment(app: faust.App, revoked: set, **kwargs: Any) -> None:
        watch.revoked()
        metrics.hold({})

    @app.on_partitions_assigned.connect
    async def note_assignment(app: faust.App, assigned: set, **kwargs: Any) -> None:
        watch.assigned(covered_by(app))
        held = held_by_channel(app, prefix, settings.channels)
        metrics.hold(held)
        log.debug("assigned steps partitions %s", {c: sorted(p) for c, p in sorted(held.items())} or "none")

    async def check_assignment() -> None:  # a failed look-up is tried again at the next check
        if await watch.check(app.consumer.rejoin_for):
            metrics.group_rejoins.inc()

    every(app, CHECK_INTERVAL, check_assignment, "checking the group's assignment")
    return watch
