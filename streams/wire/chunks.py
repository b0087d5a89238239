"""Group records larger than one Kafka record: written as chunks, named by a manifest.

Prefix sharing keeps most groups far below the topics' ``max.message.bytes`` (16 MiB),
but 16 rollouts x 100 turns of 128k-token contexts still outgrow it. Such a group's
value (exactly the bytes of a ``ReadyGroup`` record) is cut into chunks on
``{prefix}.chunks.{channel}``; once every chunk is acknowledged, a ``ChunkedGroup``
manifest takes the group's place on the groups topic. The groups topic thus still
holds one record per group, in readiness order: commits, checkpoints, the queue
bound, the worker's recovery and replay all work on it unchanged, and a writer that
dies between chunks leaves only chunks that no manifest names, which retention
deletes. A reader fetches the chunks a manifest names by offset and checks their
size and CRC-32 before decoding the joined bytes (``ChunkReader``).
"""

from __future__ import annotations

import logging
import uuid
import zlib
from typing import Any, Callable, Mapping

from confluent_kafka import Consumer, Producer, TopicPartition

from trajbus.infra.clients import reader
from trajbus.infra.topics import read_partition, watermarks
from trajbus.streams.wire import codec
from trajbus.streams.wire.prefix import StructuredGroup
from trajbus.streams.wire.records import ChunkedGroup, ReadyGroup

log = logging.getLogger(__name__)

RECORD_OVERHEAD = 64 * 1024
"""Bytes a record may need beyond its value (key, headers, batch framing), with a wide margin."""


def fits(value: bytes, max_message_bytes: int) -> bool:
    """Whether ``value`` goes in one record of a topic with this ``max.message.bytes``."""
    return len(value) + RECORD_OVERHEAD <= max_message_bytes


def split(value: bytes, max_message_bytes: int) -> list[memoryview]:
    """``value`` in pieces that each fit one record (views: nothing is copied)."""
    size = max_message_bytes - RECORD_OVERHEAD
    if size <= 0:
        raise ValueError(f"max_message_bytes: {max_message_bytes} leaves no room for a chunk")
    view = memoryview(value)
    return [view[start:start + size] for start in range(0, len(value), size)]


def manifest(prompt_uid: str, topic: str, written: list[tuple[int, int]], value: bytes) -> ChunkedGroup:
    """The record naming ``value``'s chunks, acknowledged in order at (partition, offset) ``written``
    of ``topic``; they share the group's key, hence one partition."""
    partitions = {partition for partition, _ in written}
    if len(partitions) != 1:
        raise RuntimeError(f"chunks of group {prompt_uid} landed on partitions {sorted(partitions)}")
    return ChunkedGroup(prompt_uid, topic, partitions.pop(), [offset for _, offset in written], len(value),
                        zlib.crc32(value))


def join(group: ChunkedGroup, chunks: Mapping[int, bytes]) -> bytes:
    """The group's value from its chunks by offset; ``DecodeError`` if one is missing or they do not match."""
    missing = [offset for offset in group.offsets if offset not in chunks]
    if missing:
        raise codec.DecodeError(f"chunked group {group.prompt_uid}: chunks at {group.topic}[{group.partition}] "
                                f"offsets {missing} are missing")
    value = b"".join(chunks[offset] for offset in group.offsets)
    if len(value) != group.size or zlib.crc32(value) != group.crc32:
        raise codec.DecodeError(f"chunked group {group.prompt_uid}: its chunks do not match the manifest "
                                f"({len(value)} bytes, {group.size} named)")
    return value


class ChunkReader:
    """Turns ``ChunkedGroup`` manifests into their groups; its consumer is opened on first use."""

    def __init__(self, bootstrap_servers: str) -> None:
        self.bootstrap_servers = bootstrap_servers
        self._consumer: Consumer | None = None

    def whole(self, record: Any, **decode_options: bool) -> Any:
        """A manifest's group (decoded with ``codec.decode``'s options); any other record as it is.
        Raises ``DecodeError``."""
        if not isinstance(record, ChunkedGroup):
            return record
        group = codec.decode(self.group_bytes(record), **decode_options)
        if not isinstance(group, (ReadyGroup, StructuredGroup)):
            raise codec.DecodeError(f"chunked group {record.prompt_uid}: its chunks hold a {type(group).__name__}")
        return group

    def group_bytes(self, group: ChunkedGroup) -> bytes:
        if self._consumer is None:
            self._consumer = reader(self.bootstrap_servers, {
                "group.id": f"trajbus.chunks.{uuid.uuid4().hex[:8]}",
                "enable.partition.eof": True, "auto.offset.reset": "error", "logger": log})
        wanted = set(group.offsets)
        low, _high = watermarks(self._consumer, TopicPartition(group.topic, group.partition), 10.0)
        if min(wanted) < low:  # a reader behind retention: this group is gone, the next may not be
            raise codec.DecodeError(f"chunked group {group.prompt_uid}: its chunks before offset {low} of "
                                    f"{group.topic}[{group.partition}] were deleted by retention")
        chunks = {m.offset(): m.value() for m in read_partition(self._consumer, group.topic, group.partition,
                                                                  min(wanted), max(wanted) + 1)
                  if m.offset() in wanted}
        return join(group, chunks)

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None


def produce_group(producer: Producer, topic: str, chunks_topic: str, group: ReadyGroup,
                  extra_headers: list[tuple[str, bytes]], max_message_bytes: int,
                  on_delivery: Callable[[Any, Any], None], timeout: float = 60.0) -> None:
    """Queue ``group`` on ``topic`` with a confluent-kafka producer; past ``max_message_bytes``, its
    chunks first (flushed: acknowledged) and then its manifest."""
    key, value = group.prompt_uid.encode(), codec.encode(group)
    if fits(value, max_message_bytes):
        producer.produce(topic, key=key, value=value, headers=codec.headers_for(group) + extra_headers,
                         on_delivery=on_delivery)
        return
    written: dict[int, tuple[int, int]] = {}
    errors: list[Any] = []

    def chunk_delivered(index: int) -> Callable[[Any, Any], None]:
        def delivered(error: Any, message: Any) -> None:
            if error:
                errors.append(error)
            else:
                written[index] = (message.partition(), message.offset())
        return delivered

    pieces = split(value, max_message_bytes)
    for index, piece in enumerate(pieces):
        producer.produce(chunks_topic, key=key, value=bytes(piece), on_delivery=chunk_delivered(index))
    if producer.flush(timeout) or errors or len(written) != len(pieces):
        raise RuntimeError(f"chunks of group {group.prompt_uid}: {errors or 'not all'} acknowledged")
    record = manifest(group.prompt_uid, chunks_topic, [written[i] for i in range(len(pieces))], value)
    producer.produce(topic, key=key, value=codec.encode(record), headers=codec.headers_for(record) + extra_headers,
                     on_delivery=on_delivery)
