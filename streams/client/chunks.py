"""Chunked group records on Kafka: reading the chunks a manifest names, writing a group as chunks.

The framing (how a value is cut, what the manifest says, how chunks join) is the wire's
(``streams.wire.chunks``); this is the I/O around it, for readers of the groups topic
(``ChunkReader``) and for writers other than the stream worker (``produce_group``: replay,
the benchmarks), which writes its own through its outbox.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Callable

from confluent_kafka import Consumer, Producer, TopicPartition

from trajbus.infra.clients import reader
from trajbus.infra.topics import read_partition, watermarks
from trajbus.streams.wire import codec
from trajbus.streams.wire.chunks import fits, join, manifest, split
from trajbus.streams.wire.prefix import StructuredGroup
from trajbus.streams.wire.records import ChunkedGroup, ReadyGroup

log = logging.getLogger(__name__)


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
