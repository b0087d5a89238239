"""The worker table's keys, and steps-topic records read directly (not through Faust).

Every key starts with its source partition, so writes made outside an event (timeouts)
still land in that partition's changelog partition (``PartitionKeyedTable``), and all
state of a partition is ordered in one changelog partition.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from trajbus.infra.clients import reader
from trajbus.infra.topics import describe_topics, read_partition

log = logging.getLogger("trajbus.worker")

SOURCE_PARTITION = "trajbus-source-partition"
SOURCE_OFFSET = "trajbus-source-offset"
"""Headers of an emitted group: the source partition and the offset of its last event."""


@dataclass(frozen=True)
class StateKey:
    """``{partition}|{kind}|{channel}|{prompt_uid}``: kind ``g`` pending group, ``e`` emitted
    (or dropped) marker, ``w`` groups-topic watermark and ``o`` applied source offset of the
    partition (these two without prompt_uid)."""

    partition: int
    kind: str
    channel: str
    prompt_uid: str = ""

    def encode(self) -> bytes:
        return f"{self.partition}|{self.kind}|{self.channel}|{self.prompt_uid}".encode()

    @classmethod
    def decode(cls, raw: bytes) -> "StateKey":
        partition, kind, channel, prompt_uid = raw.decode().split("|", 3)
        return cls(int(partition), kind, channel, prompt_uid)


@dataclass(frozen=True)
class SourceRecord:
    """A steps-topic record read directly (not through Faust), shaped like Faust's message."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list


def read_range(bootstrap_servers: str, topic: str, partition: int, start: int, end: int) -> list[SourceRecord]:
    """Records of one partition with ``start <= offset < end`` (fewer where the log has gaps)."""
    consumer = reader(bootstrap_servers, {"group.id": "trajbus.read-range", "enable.partition.eof": True,
                                          "logger": log})
    try:
        return [SourceRecord(topic, partition, m.offset(), m.key(), m.value(), list(m.headers() or []))
                for m in read_partition(consumer, topic, partition, start, end)]
    finally:
        consumer.close()


def emitted_past(bootstrap_servers: str, topic: str, partition: int,
                 marks: dict[str, int]) -> dict[str, tuple[int, int, int]]:
    """Groups of ``topic`` emitted from source ``partition`` past the watermark ``marks`` (groups
    partition -> last recorded offset). Returns prompt_uid -> (groups partition, groups offset, source offset)."""
    log_bounds = describe_topics(bootstrap_servers, names=[topic])[0]
    found: dict[str, tuple[int, int, int]] = {}
    for p, (low, high) in enumerate(zip(log_bounds.start_offsets, log_bounds.end_offsets)):
        start = max(low, marks.get(str(p), -1) + 1)
        if start >= high:
            continue
        for record in read_range(bootstrap_servers, topic, p, start, high):
            headers = dict(record.headers)
            if headers.get(SOURCE_PARTITION) == str(partition).encode():
                found[record.key.decode()] = (p, record.offset, int(headers[SOURCE_OFFSET]))
    return found
