"""Reading the statistics topic: the newest snapshot of every writer (the record: ``streams.wire.stats``)."""

from __future__ import annotations

import time
from typing import Any

from confluent_kafka import TopicPartition

from trajbus.infra.clients import reader
from trajbus.infra.topics import watermarks
from trajbus.streams.wire.stats import decode_snapshot
from trajbus.streams.wire.topics import stats_topic


def read_snapshots(bootstrap_servers: str, prefix: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The newest snapshot of every worker that ever wrote one (and no tombstone after it), read from the
    compacted stats topic."""
    topic = stats_topic(prefix)
    consumer = reader(bootstrap_servers, {"group.id": f"{prefix}.stats-reader"})
    latest: dict[bytes, dict[str, Any]] = {}
    try:
        metadata = consumer.list_topics(topic, timeout=timeout).topics.get(topic)
        if metadata is None or metadata.error is not None:
            return []
        assignment = []
        ends = {}
        for p in metadata.partitions:
            low, high = watermarks(consumer, TopicPartition(topic, p), timeout)
            if high > low:
                assignment.append(TopicPartition(topic, p, low))
                ends[p] = high
        consumer.assign(assignment)
        deadline = time.monotonic() + timeout
        while ends and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None or message.error():
                continue
            if message.value() is None:  # a tombstone: its writer stopped (a gateway)
                latest.pop(message.key(), None)
            else:
                latest[message.key()] = decode_snapshot(message.value())
            if message.offset() + 1 >= ends.get(message.partition(), 0):
                ends.pop(message.partition(), None)
    finally:
        consumer.close()
    return list(latest.values())
