"""Where consumer groups stand on a topic: committed offsets against the log's bounds.

One group's position per partition (``consumer_group_lag``: the worker's queue bound, the
trainer's resume point, slime's reader), and every group's lag on a prefix's topics
(``consumer_groups_lag``: ``trajbus topics``). Read with a consumer that never subscribes, so
it neither joins nor disturbs the group it inspects; the offsets come from ``infra.topics``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from confluent_kafka import TopicPartition

from trajbus.infra import clients
from trajbus.infra.topics import admin_client, watermarks

log = logging.getLogger(__name__)


@dataclass
class PartitionLag:
    """Where one consumer group stands on one partition."""

    partition: int
    low: int
    high: int
    committed: int | None
    """The group's committed offset, or None when it never committed."""

    @property
    def position(self) -> int:
        """Where the group resumes: its commit, else the log start (auto.offset.reset=earliest)."""
        return self.low if self.committed is None else max(self.committed, self.low)

    @property
    def lag(self) -> int:
        return max(0, self.high - self.position)


def consumer_group_lag(bootstrap_servers: str, group_id: str, topic: str, timeout: float = 10.0) -> list[PartitionLag]:
    """Per partition of ``topic``: log bounds and ``group_id``'s committed offset.

    Reads the commit with a consumer that never subscribes, so it does not join
    (or disturb) the group it inspects.
    """
    probe = clients.reader(bootstrap_servers, {"group.id": group_id, "logger": log})
    try:
        partitions = probe.list_topics(topic, timeout=timeout).topics[topic].partitions
        committed = probe.committed([TopicPartition(topic, p) for p in sorted(partitions)], timeout=timeout)
        result = []
        for tp in committed:
            low, high = watermarks(probe, TopicPartition(topic, tp.partition), timeout)
            result.append(PartitionLag(tp.partition, low, high, tp.offset if tp.offset >= 0 else None))
        return result
    finally:
        probe.close()


@dataclass
class GroupLag:
    """One consumer group's committed position on one partition, and how far it trails the log end."""

    group_id: str
    topic: str
    partition: int
    committed: int
    high: int

    @property
    def lag(self) -> int:
        return max(0, self.high - self.committed)


def consumer_groups_lag(bootstrap_servers: str, topic_prefix: str, timeout: float = 10.0) -> list[GroupLag]:
    """Every consumer group with commits on topics starting with ``topic_prefix``, per partition."""
    from confluent_kafka import ConsumerGroupTopicPartitions

    admin = admin_client(bootstrap_servers)
    listing = admin.list_consumer_groups(request_timeout=timeout).result(timeout)
    group_ids = sorted(g.group_id for g in listing.valid)
    probe = clients.reader(bootstrap_servers, {"group.id": "trajbus.lag-probe", "logger": log})
    result: list[GroupLag] = []
    try:
        for group_id in group_ids:
            futures = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group_id)],
                                                        request_timeout=timeout)
            for future in futures.values():
                for tp in future.result(timeout).topic_partitions or []:
                    if not tp.topic.startswith(topic_prefix) or tp.offset < 0:
                        continue
                    _low, high = watermarks(probe, TopicPartition(tp.topic, tp.partition), timeout)
                    result.append(GroupLag(group_id, tp.topic, tp.partition, tp.offset, high))
    finally:
        probe.close()
    return sorted(result, key=lambda g: (g.group_id, g.topic, g.partition))
