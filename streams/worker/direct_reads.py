"""Records the worker reads directly (not through Faust): a steps range, and groups emitted past a watermark.

Faust delivers what it delivers; the worker reads a range itself where Faust skipped it
(``recovery.PartitionRecovery.apply_range``), and a new owner of a source partition reads
the groups topic past the table's watermark for what an earlier owner emitted
(``emitted_past``): each group carries its source partition and offset in headers
(``streams.wire.headers.source_headers``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from trajbus.infra.clients import reader
from trajbus.infra.topics import describe_topics, end_offsets_of, read_partition
from trajbus.streams.wire.headers import source_of

log = logging.getLogger("trajbus.worker")


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
                 marks: dict[int, int]) -> dict[str, tuple[int, int, int]]:
    """Groups of ``topic`` emitted from source ``partition`` past the watermark ``marks`` (groups
    partition -> last recorded offset). Returns prompt_uid -> (groups partition, groups offset, source offset)."""
    log_bounds = describe_topics(bootstrap_servers, names=[topic])[0]
    found: dict[str, tuple[int, int, int]] = {}
    for p, (low, high) in enumerate(zip(log_bounds.start_offsets, log_bounds.end_offsets)):
        start = max(low, marks.get(p, -1) + 1)
        if start >= high:
            continue
        for record in read_range(bootstrap_servers, topic, p, start, high):
            source = source_of(dict(record.headers))
            if source is not None and source[0] == partition:
                found[record.key.decode()] = (p, record.offset, source[1])
    return found


class DirectReads:
    """The worker's direct reads of one cluster (recovery and step bodies are given this, or a fake)."""

    def __init__(self, bootstrap_servers: str) -> None:
        self.bootstrap_servers = bootstrap_servers

    def read_range(self, topic: str, partition: int, start: int, end: int) -> list[SourceRecord]:
        return read_range(self.bootstrap_servers, topic, partition, start, end)

    def emitted_past(self, topic: str, partition: int, marks: dict[int, int]) -> dict[str, tuple[int, int, int]]:
        return emitted_past(self.bootstrap_servers, topic, partition, marks)

    def end_offsets(self, partitions: list[tuple[str, int]], timeout: float) -> dict[tuple[str, int], int]:
        return end_offsets_of(self.bootstrap_servers, partitions, timeout)
