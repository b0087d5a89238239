"""A trainers' group that holds none of its channel's partitions is made to share them out again.

librdkafka's group leader assigns only the partitions its metadata shows. A trainer that joins while its
channel's topics are being created can see its group settle with no member holding any partition, and stay
so: the topic's later metadata did not make it rejoin (seen on the 3-node cluster, about one start in 25 with
the topics created 0-4 s after the trainer subscribed: the group stable, its one member assigned nothing,
groups piling up unread). The worker watches for the same gap in its own group
(``streams.worker.assignment_watch``). Here, while a subscribed consumer holds no partition, every
``UNASSIGNED_TIMEOUT`` seconds it asks the cluster whether the topic has partitions and whether any member of
the group holds one; when the topic has some and nobody holds them, it subscribes again, and the group
rebalances on fresh metadata. More trainers than partitions is no gap: then another member holds each one.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from confluent_kafka import ConsumerGroupState
from confluent_kafka.admin import ConsumerGroupDescription

from trajbus.infra.clients import admin

log = logging.getLogger(__name__)

UNASSIGNED_TIMEOUT = 10.0
"""Seconds a subscribed consumer holds no partition before it asks whether its group holds any."""
ASK_TIMEOUT = 10.0
"""Seconds the cluster has to list the topic and describe the group."""


class AssignmentCheck:
    """The rule: held nothing for ``timeout`` seconds, the topic has partitions, nobody in the group holds one:
    ``rejoin``. ``holds``: whether this consumer holds a partition now; ``partitions``: how many the topic has;
    ``group_holds``: whether a member of the group holds one, or the group is sharing them out (both asked of the
    cluster, only when due)."""

    def __init__(self, holds: Callable[[], bool], partitions: Callable[[], int], group_holds: Callable[[], bool],
                 rejoin: Callable[[], None], timeout: float = UNASSIGNED_TIMEOUT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.holds, self.partitions, self.group_holds, self.rejoin = holds, partitions, group_holds, rejoin
        self.timeout, self.clock = timeout, clock
        self._since = clock()

    def check(self) -> bool:
        """Asked while fetches wait; True when it made the consumer rejoin."""
        now = self.clock()
        if self.holds():
            self._since = now
            return False
        if now - self._since < self.timeout:
            return False
        self._since = now  # asked at most once a timeout, whatever the answer
        try:
            count = self.partitions()
            if not count or self.group_holds():
                return False
        except Exception as exc:  # the cluster did not answer (it may be restarting): ask again next time
            log.debug("could not ask whether the group holds its partitions: %s", exc)
            return False
        log.warning("the trainers' group holds none of the %d partitions of its channel's groups topic: "
                    "subscribing again so the group shares them out", count)
        self.rejoin()
        return True


def watch_assignment(consumer: Any, topic: str, group_id: str, servers: str,
                     rejoin: Callable[[], None]) -> AssignmentCheck:
    """The check of ``consumer`` subscribed to ``topic`` in ``group_id``, asking the cluster at ``servers``."""

    def partitions() -> int:
        described = consumer.list_topics(topic, timeout=ASK_TIMEOUT).topics.get(topic)
        return 0 if described is None or described.error is not None else len(described.partitions)

    def group_holds() -> bool:
        """Whether a member holds one of the partitions, or the group is sharing them out now (a rebalance
        under way, such as one waiting out a dead member's session, decides by itself)."""
        group = describe_group(servers, group_id)
        return group.state != ConsumerGroupState.STABLE or any(
            tp.topic == topic for member in group.members for tp in member.assignment.topic_partitions)

    return AssignmentCheck(lambda: bool(consumer.assignment()), partitions, group_holds, rejoin)


def describe_group(servers: str, group_id: str) -> ConsumerGroupDescription:
    """The consumer group as its coordinator describes it: state, coordinator, members and their partitions."""
    client = admin(servers, {"logger": log})  # held until the answer came
    return client.describe_consumer_groups([group_id], request_timeout=ASK_TIMEOUT)[group_id].result(
        timeout=ASK_TIMEOUT)
